//! Helpers shared by the test binaries: where `probe` is, and starting a trace that is armed.
#![allow(dead_code)]
pub mod bpf;
pub mod otlp;
pub mod prometheus;
pub mod workload;
use std::{
    io::{BufRead, BufReader},
    net::{SocketAddr, TcpListener},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// Where `probe trace` keeps its verified programs between traces (bpffs).
pub const KEPT_ROOT: &str = "/sys/fs/bpf/probe";

/// The `probe` binary: $PROBE_BIN (set by `cargo xtask test`) or target/release/probe.
pub fn probe_bin() -> PathBuf {
    let p = std::env::var_os("PROBE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/probe"));
    assert!(p.exists(), "{} not found: run `cargo xtask test` (builds it) or set PROBE_BIN", p.display());
    p
}

/// A running `probe trace`, started with `args` and returned once it printed "armed in":
/// the child, its later stderr lines, and the armed line (which lists the live probes).
// The child is returned to the caller, who waits for it.
#[allow(clippy::zombie_processes)]
pub fn start_trace(args: &[&str]) -> (Child, mpsc::Receiver<String>, String) {
    start_trace_env(args, &[])
}

/// [`start_trace`] with variables added to probe's environment.
#[allow(clippy::zombie_processes)]
pub fn start_trace_env(args: &[&str], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>, String) {
    let mut child = Command::new(probe_bin())
        .arg("trace")
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn probe");
    let err = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    loop {
        let l = rx.recv_timeout(Duration::from_secs(30)).expect("probe did not arm within 30 s");
        assert!(!l.contains("error"), "probe failed to start: {l}");
        if l.contains("armed in") {
            return (child, rx, l);
        }
    }
}

/// One test at a time in this test binary (each binary has its own lock: `common` is compiled
/// into each): tests that share the two CPUs, a server or the kernel's BPF object count.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A free TCP port on loopback (bound and let go).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child that leads its own process group (a shell loop and what it runs): the whole group is
/// killed when dropped, then the leader is reaped ([`Killed`]).
pub struct KilledGroup(pub Killed);

impl KilledGroup {
    pub fn spawn(cmd: &mut Command) -> KilledGroup {
        use std::os::unix::process::CommandExt;
        KilledGroup(spawn_owned(cmd.process_group(0)))
    }
}

impl Drop for KilledGroup {
    fn drop(&mut self) {
        // SAFETY: signalling the process group our child leads.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
    }
}

/// A child process killed and reaped when dropped: a failing test leaves nothing running.
pub struct Killed(pub Child);

impl std::ops::Deref for Killed {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// Spawn `cmd` as a child that cannot outlive the test: killed and reaped when the returned guard
/// drops (a failing assertion unwinds through it), and sent SIGKILL by the kernel when the
/// spawning thread ends (PR_SET_PDEATHSIG: a test's thread, so even a leaked guard dies with its
/// test, never lingering as a listener the next test binary's node agent would find).
pub fn spawn_owned(cmd: &mut Command) -> Killed {
    Killed(die_with_spawner(cmd).spawn().unwrap_or_else(|e| panic!("start {:?}: {e}", cmd.get_program())))
}

/// `cmd`'s child gets SIGKILL from the kernel when the thread that spawns it ends
/// (PR_SET_PDEATHSIG; kept across exec).
pub fn die_with_spawner(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        })
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl From<Child> for Killed {
    fn from(c: Child) -> Killed {
        Killed(c)
    }
}

/// The Python of the test clients' venv (openai, httpx, requests, opentelemetry-proto), which
/// scripts/setup.sh installs: $PROBE_CLIENTS/bin/python or ~/.cache/probe/clients/bin/python.
pub fn clients_python() -> PathBuf {
    let p = std::env::var_os("PROBE_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/probe/clients"))
        .join("bin/python");
    assert!(p.exists(), "{} not found: scripts/setup.sh installs the test clients", p.display());
    p
}

/// A path from the environment (`cargo xtask test` sets LLAMA_SERVER and LLAMA_MODEL).
pub fn env_path(name: &str) -> PathBuf {
    let p =
        PathBuf::from(std::env::var_os(name).unwrap_or_else(|| {
            panic!("{name} is not set: run the tests with `cargo xtask test`, which builds llama-server and the model")
        }));
    assert!(p.exists(), "{name}={} does not exist", p.display());
    p
}

/// `GET /health` answers 200.
pub fn healthy(addr: std::net::SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return false };
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut b = String::new();
    let _ = s.read_to_string(&mut b);
    b.starts_with("HTTP/1.1 200")
}

/// The slow morning's setup: wait until llama-server (`--sleep-idle-seconds`) says it sleeps
/// (/props answers without waking it; the model is unmapped), then drop `model` from the page
/// cache (DONTNEED evicts the clean pages of a file nobody maps).
pub fn sleep_then_evict(addr: std::net::SocketAddr, model: &std::path::Path) {
    wait_asleep(addr);
    let f = std::fs::File::open(model).unwrap();
    // SAFETY: valid fd for the call; posix_fadvise only advises the kernel.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Wait until llama-server says it is sleeping (`--sleep-idle-seconds`: model unloaded).
pub fn wait_asleep(addr: std::net::SocketAddr) {
    use std::io::{Read, Write};
    let t = std::time::Instant::now();
    loop {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /props HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut b = String::new();
        let _ = s.read_to_string(&mut b);
        let body = b.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        if serde_json::from_str::<serde_json::Value>(body).ok().and_then(|v| v["is_sleeping"].as_bool()) == Some(true) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "llama-server did not go to sleep");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn wait_healthy(addr: std::net::SocketAddr) {
    let t = std::time::Instant::now();
    while !healthy(addr) {
        assert!(t.elapsed() < Duration::from_secs(60), "llama-server on {addr} did not become healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A llama-server ($LLAMA_SERVER, model $LLAMA_MODEL) on a free loopback port with `args`, that
/// dies with the test process (PR_SET_PDEATHSIG from a spawning thread that never ends);
/// returned once /health answers.
pub fn shared_llama_server(args: &[&str]) -> (Child, std::net::SocketAddr) {
    llama_server_from(&env_path("LLAMA_SERVER"), args)
}

/// [`shared_llama_server`] from another llama-server executable (a copy, another build).
pub fn llama_server_from(exe: &std::path::Path, args: &[&str]) -> (Child, std::net::SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = Command::new(exe);
    cmd.arg("-m").arg(env_path("LLAMA_MODEL")).args(args).args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    // The server dies with the thread that spawned it, so spawn it from a thread that lives as
    // long as the test process.
    die_with_spawner(&mut cmd);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(cmd.spawn());
        loop {
            std::thread::park();
        }
    });
    let child = rx.recv().unwrap().expect("start llama-server");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_healthy(addr);
    (child, addr)
}

/// `probe report DIR --json` recomputed where kernel symbols cannot be read (as user `nobody`:
/// kallsyms reads as zeros; as root with /proc/kallsyms hidden in a private mount namespace) must
/// equal the report.json written at trace time: the analysis is a pure function of the recording.
pub fn assert_report_is_the_same_offline(dir: &std::path::Path) {
    let at_trace: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).expect("report.json")).unwrap();
    let bin = probe_bin();
    // The recording is private (0700, 0600): nobody reads a copy given to it, as a user reads
    // the recording `sudo probe trace` made for them.
    let theirs = dir.with_file_name(format!("{}-nobody", dir.file_name().unwrap().to_string_lossy()));
    let _ = std::fs::remove_dir_all(&theirs);
    std::fs::create_dir(&theirs).unwrap();
    std::fs::copy(dir.join("events.bin"), theirs.join("events.bin")).unwrap();
    for p in [&theirs, &theirs.join("events.bin")] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    let ways: [(&str, Vec<String>); 2] = [
        (
            "as nobody",
            vec![
                "setpriv".into(),
                "--reuid=65534".into(),
                "--regid=65534".into(),
                "--clear-groups".into(),
                bin.display().to_string(),
                "report".into(),
                theirs.display().to_string(),
                "--json".into(),
            ],
        ),
        (
            "without kallsyms",
            vec![
                "unshare".into(),
                "-m".into(),
                "sh".into(),
                "-c".into(),
                format!("mount --bind /dev/null /proc/kallsyms && exec {} report {} --json", bin.display(), dir.display()),
            ],
        ),
    ];
    for (how, argv) in ways {
        let out = Command::new(&argv[0]).args(&argv[1..]).output().unwrap_or_else(|e| panic!("{how}: cannot run {}: {e}", argv[0]));
        assert!(out.status.code().is_some_and(|c| c <= 1), "{how}: probe report failed: {}", String::from_utf8_lossy(&out.stderr));
        let again: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{how}: not JSON: {e}"));
        if again != at_trace {
            let keys: Vec<&String> =
                at_trace.as_object().unwrap().iter().filter(|(k, v)| again.get(k.as_str()) != Some(v)).map(|(k, _)| k).collect();
            panic!("the report recomputed {how} differs from the one written at trace time in {keys:?}");
        }
    }
}

/// nginx as a gateway in front of `upstream` (a real one: the Debian package that setup installs),
/// with `proxy_read_timeout` `timeout_s` and no buffering, on a free loopback port; stopped on drop.
pub struct Nginx {
    child: Child,
    pub addr: std::net::SocketAddr,
}

impl Nginx {
    /// Its one process (no master): what a test traces to see the gateway's side.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn start(upstream: std::net::SocketAddr, timeout_s: u32) -> Nginx {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("nginx-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let d = dir.display();
        let conf = format!(
            "daemon off; master_process off; worker_processes 1; pid {d}/nginx.pid; error_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{ access_log off; client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp; uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;\n\
               server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://{upstream}; proxy_http_version 1.1; proxy_buffering off; proxy_read_timeout {timeout_s}s; }} }} }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("nginx is not installed: run scripts/setup.sh");
        let child = Command::new(bin)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let gw = Nginx { child, addr: format!("127.0.0.1:{port}").parse().unwrap() };
        let t = std::time::Instant::now();
        while !healthy(gw.addr) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "nginx did not come up: {}",
                std::fs::read_to_string(dir.join("error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        gw
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The userspace record types docs/recording.md lists (its `- `type`` bullets).
fn documented_record_types() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/recording.md")).unwrap();
    doc.lines().filter_map(|l| l.strip_prefix("- `")).filter_map(|l| l.split('`').next()).map(String::from).collect()
}

/// report.json of a finished trace in `dir`, after checking the recording against the docs and
/// the analysis against itself: the recording holds only documented userspace record types, and
/// `probe report --json` (streamed from the file in two passes) says exactly what `probe trace`
/// wrote at its end (analysed in memory).
pub fn read_report(dir: &std::path::Path) -> serde_json::Value {
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    let sizes = Command::new(probe_bin()).args(["report", "--sizes"]).arg(dir).output().unwrap();
    assert!(sizes.status.success(), "probe report --sizes: {}", String::from_utf8_lossy(&sizes.stderr));
    assert!(String::from_utf8_lossy(&sizes.stdout).contains("json:threads"), "{}: no thread names recorded", dir.display());
    let known = documented_record_types();
    for line in String::from_utf8_lossy(&sizes.stdout).lines().skip(1) {
        if let Some(ty) = line.split_whitespace().next().and_then(|k| k.strip_prefix("json:")) {
            assert!(known.iter().any(|k| k == ty), "{}: a `{ty}` record is not in docs/recording.md", dir.display());
        }
    }
    let again = Command::new(probe_bin()).args(["report", "--json"]).arg(dir).output().unwrap();
    let streamed: serde_json::Value = serde_json::from_slice(&again.stdout)
        .unwrap_or_else(|e| panic!("probe report --json {}: {e}: {}", dir.display(), String::from_utf8_lossy(&again.stderr)));
    assert_eq!(streamed, written, "{}: the streamed report differs from the one probe trace wrote", dir.display());
    written
}

/// One HTTP/1.1 request with `Connection: close` (a JSON body, more headers): (status, body).
pub fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, Vec<u8>)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let end = out.windows(4).position(|w| w == b"\r\n\r\n").map_or(out.len(), |i| i + 4);
    let status = String::from_utf8_lossy(&out[..end]).split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, out[end..].to_vec()))
}

/// Every file under `dir` (recursively): path and bytes.
pub fn all_files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(all_files(&p));
        } else {
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out
}

/// The sum of a Prometheus metric's series in exposition text (every label set).
pub fn prometheus_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(' ') || r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// llama-cpp-python's OpenAI server ($LLAMA_PYTHON, built by scripts/llama-python.sh) on a free
/// port, serving $LLAMA_MODEL; killed when dropped.
pub struct PyServer {
    pub child: Child,
    pub addr: std::net::SocketAddr,
}

impl Drop for PyServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PyServer {
    pub fn start() -> PyServer {
        PyServer::start_with(&[])
    }

    /// With more of the server's settings (`--interrupt_requests false`, ...).
    pub fn start_with(args: &[&str]) -> PyServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(env_path("LLAMA_PYTHON"))
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(env_path("LLAMA_MODEL"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--n_ctx", "2048", "--n_threads", "2", "--verbose", "false"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start llama-cpp-python's server");
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let t = std::time::Instant::now();
        while !http(addr, "GET", "/v1/models", None, &[]).is_ok_and(|r| r.0 == 200) {
            assert!(t.elapsed() < Duration::from_secs(120), "llama-cpp-python's server did not answer within 120 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        PyServer { child, addr }
    }

    pub fn complete(&self, prompt: &str, max_tokens: u64) -> serde_json::Value {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 1});
        let (status, out) = http(self.addr, "POST", "/v1/completions", Some(&body), &[]).unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        serde_json::from_slice(&out).unwrap()
    }
}

/// vLLM's OpenAI server (CPU build from PyPI, installed by scripts/vllm.sh), in its own process
/// group (the API server starts an engine process), killed as a group when dropped.
pub struct Vllm {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Vllm {
    pub fn start(args: &[&str]) -> Vllm {
        Vllm::start_env(args, &[])
    }

    /// With more in its environment (`PYTHONPATH` for a `--middleware` of a test's own).
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Vllm {
        use std::os::unix::process::CommandExt;
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vllm-cache");
        let mut cmd = Command::new(env_path("VLLM_PYTHON"));
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"]).arg(env_path("VLLM_MODEL"));
        cmd.args([
            "--served-model-name",
            "model",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
        ]);
        cmd.args(args);
        cmd.envs([("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")]).env("VLLM_CACHE_ROOT", &cache);
        cmd.envs(env.iter().copied());
        let log = std::fs::File::create(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vllm.log")).unwrap();
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        // SAFETY: setsid in the child before exec: its own process group, killed as one.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut v = Vllm { child: cmd.spawn().expect("start vLLM"), addr };
        let t = Instant::now();
        while !healthy(addr) {
            assert!(v.child.try_wait().unwrap().is_none(), "vLLM exited while starting: see target/tmp/vllm.log");
            assert!(t.elapsed() < Duration::from_secs(300), "vLLM did not answer /health within 300 s: see target/tmp/vllm.log");
            std::thread::sleep(Duration::from_millis(500));
        }
        v
    }

    /// A metric from `/metrics`, summed over its labels.
    pub fn metric(&self, name: &str) -> f64 {
        let mut s = std::net::TcpStream::connect(self.addr).unwrap();
        use std::io::{Read, Write};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        prometheus_sum(&text, name)
    }

    pub fn preemptions(&self) -> f64 {
        self.metric("vllm:num_preemptions_total")
    }

    /// Wait until vLLM runs and queues nothing. The streams of clients that left keep their KV
    /// blocks until vLLM notices; the next cell's streams would queue behind them and start one
    /// by one (a first stream could end before the last one's first token).
    pub fn wait_idle(&self) {
        let t = Instant::now();
        while self.metric("vllm:num_requests_running") + self.metric("vllm:num_requests_waiting") > 0.0 {
            assert!(t.elapsed() < Duration::from_secs(120), "vLLM still busy 120 s after the clients finished");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // SAFETY: signalling the process group we created.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A fresh output folder for one test: `NAME-PID` under the test target's scratch folder (an
/// earlier run's with the same name is removed).
pub fn out_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Busy loops, three for every CPU, under a command name of their own (`cpuhog`, as the
/// verdicts name competitors), killed on drop: a CPU-bound neighbour of the server. Three a CPU
/// leave a one-thread server about a quarter of a core (one loop a CPU left it half of one on a
/// 2-core box: a 1.5× slowdown that a noisy machine's intervals can hide).
pub struct Hog(pub Vec<Child>);

impl Hog {
    pub fn start() -> Hog {
        let hog = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cpuhog");
        if !hog.exists() {
            let _ = std::os::unix::fs::symlink("/bin/sh", &hog);
        }
        let n = 3 * std::thread::available_parallelism().map_or(2, |n| n.get());
        Hog((0..n).map(|_| Command::new(&hog).args(["-c", "while :; do :; done"]).spawn().expect("start a busy loop")).collect())
    }

    pub fn pids(&self) -> Vec<u32> {
        self.0.iter().map(Child::id).collect()
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A verdict's wait for a CPU (`cpu` ms) against schedstat's run-queue wait of the threads that
/// did the work: at least the busiest one's, at most their sum, each within 15% or 50 ms (the
/// request waits when any of them waits).
pub fn assert_cpu_wait_agrees(cpu: f64, busiest: f64, sum: f64, verdict: &serde_json::Value) {
    let slack = |x: f64| (0.15 * x).max(50.0);
    assert!(
        cpu >= busiest - slack(busiest) && cpu <= sum + slack(sum),
        "cpu_contention {cpu:.0} ms vs schedstat {busiest:.0}..{sum:.0} ms: {verdict}"
    );
}
