//! `cargo xtask`: setup, build, test, demo and bench for probe. Every entry point runs the
//! idempotent setup first, so a fresh machine needs only these commands.
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

mod cost;
mod python_cost;
mod soak;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks (nightly rust-src, bpf-linker), cached in ~/.cache/probe.
    Setup,
    /// Setup, then build `probe` (release) and the test workloads.
    Build,
    /// Setup, build, then run every test (unit, golden and kernel tests; needs root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        args: Vec<String>,
    },
    /// The main job end to end: trace a real llama-server through a slow morning request (asleep,
    /// its model out of the page cache), a few ordinary ones, and one under a CPU hog; print the
    /// verdicts.
    Demo,
    /// Measure: start-to-armed time (median of 10), the drained event rate at a high event rate,
    /// reporting, llama-server's speed traced and untraced, and the cost of tracing it (probe
    /// beside bpftrace).
    Bench {
        /// Only the tracing cost: probe and bpftrace on an idle and a generating llama-server.
        #[arg(long)]
        cost: bool,
        /// Only Ctrl-C to exit: on an idle process and under an mmap/munmap flood.
        #[arg(long)]
        stop: bool,
        /// Only what Python frames cost: llama-cpp-python and vLLM under the same load, traced
        /// with and without them.
        #[arg(long)]
        python: bool,
    },
    /// A real llama-server under concurrent streaming clients for minutes, every probe on: probe's
    /// peak memory and its slope, events lost, recording size per minute, probe's CPU.
    Soak {
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        #[arg(long, default_value_t = 8)]
        clients: usize,
    },
    /// Several producer threads against probe's ring buffer: drained events/s, where loss starts.
    Stress,
    /// Build probe and install it as the README's Security section says: /usr/local/bin/probe
    /// (or --prefix), mode 0750, group `probe`, its capabilities, man pages and completions
    /// (scripts/install.sh; sudo is asked for once). `--uninstall` removes them.
    Install {
        #[arg(long, default_value = "/usr/local")]
        prefix: String,
        /// The group that may run it.
        #[arg(long, default_value = "probe")]
        group: String,
        #[arg(long)]
        uninstall: bool,
    },
    /// Build probe and its .deb (target/debian/probe_VERSION_ARCH.deb; cargo-deb, built once into
    /// ~/.cache/probe): `sudo apt install ./target/debian/probe_*.deb` installs it.
    Deb,
    /// Build probe (release) and its OCI image with podman or docker (scripts/image.sh): `FROM
    /// scratch`, the binary and the libraries it links, tagged localhost/probe:VERSION and
    /// :latest, in root's image store (through sudo when run as a user). deploy/kubernetes/probe.yaml
    /// runs it.
    Image {
        /// podman or docker (default: podman when installed).
        #[arg(long)]
        engine: Option<String>,
        /// Also write the image to this file as an OCI archive (for `ctr images import` or
        /// `podman load` on a node).
        #[arg(long)]
        save: Option<PathBuf>,
    },
    /// Setup, build the fuzz targets in fuzz/ (cargo-fuzz, nightly), run each for `--secs` on a
    /// scratch copy of its committed corpus; fails with the crashing input's path.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        secs: u64,
    },
}

fn root() -> PathBuf {
    let xtask = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().map(PathBuf::from).unwrap_or(xtask)
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn setup() -> anyhow::Result<()> {
    run(Command::new("bash").arg(root().join("scripts/setup.sh")))
}

fn build() -> anyhow::Result<()> {
    setup()?;
    run(Command::new("cargo").current_dir(root()).args(["build", "--release", "-p", "probe-user", "-p", "probe-tests"]))
}

/// Build the .deb (scripts/deb.sh: cargo-deb, cached) from the built probe; its path.
fn deb() -> anyhow::Result<PathBuf> {
    let out =
        Command::new("bash").arg(root().join("scripts/deb.sh")).stderr(Stdio::inherit()).output().context("cannot run scripts/deb.sh")?;
    if !out.status.success() {
        bail!("scripts/deb.sh failed: {}", out.status);
    }
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(root().join(path))
}

fn bin(name: &str) -> PathBuf {
    root().join("target/release").join(name)
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn require_root() -> anyhow::Result<()> {
    if !is_root() {
        bail!("this needs root: it loads BPF programs (run it with sudo)");
    }
    Ok(())
}

/// Whether what loads BPF programs goes through sudo. The README's commands run as a normal
/// user: cargo lives in the user's ~/.cargo/bin (outside sudo's PATH), and building as root
/// would leave root-owned files in target/ and ~/.cache/probe. So xtask builds as the user and
/// elevates only the processes that need root (probe, the test binaries). PROBE_SUDO=1 takes
/// that path as root too.
fn via_sudo() -> bool {
    !is_root() || std::env::var("PROBE_SUDO").is_ok_and(|v| v == "1")
}

/// Ask for the password once, up front (sudo remembers it for the run), when [`via_sudo`].
fn sudo_ready() -> anyhow::Result<()> {
    if !via_sudo() {
        return Ok(());
    }
    let found = Command::new("sudo").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !found {
        bail!("this loads BPF programs: run it as root, or install sudo (xtask builds as you and runs only probe and the tests as root)");
    }
    run(Command::new("sudo").arg("-v")).context("sudo refused")
}

/// `program` as root: itself when xtask is root, else `sudo -E program` (the environment kept:
/// the tests' paths and PROBE_* settings).
fn elevated(program: impl AsRef<std::ffi::OsStr>) -> Command {
    if via_sudo() {
        let mut c = Command::new("sudo");
        c.arg("-E").arg("--").arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// After a run through sudo: what root made in target/ and in the cache (recordings, test
/// scratch, vLLM's caches) goes back to the user.
fn give_back_files() {
    if !via_sudo() || is_root() {
        return;
    }
    let id = |flag: &str| {
        Command::new("id").arg(flag).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
    };
    let owner = format!("{}:{}", id("-u"), id("-g"));
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let mut cmd = Command::new("sudo");
    cmd.args(["find"])
        .arg(root().join("target"))
        .arg(home.join(".cache"))
        .args(["-xdev", "-user", "0", "-exec", "chown", "-h", &owner, "{}", "+"]);
    let _ = cmd.stderr(Stdio::null()).status();
}

/// The host's target triple (cargo's runner variable is named after it).
fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc").arg("-vV").output().context("cannot run rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .context("rustc -vV printed no host")
}

/// Run a setup script that prints `KEY=value` lines; returns the values of `keys`.
fn script_vars(script: &str, env: &[(&str, &str)], keys: &[&str]) -> anyhow::Result<Vec<String>> {
    script_vars_args(script, &[], env, keys)
}

/// The same, with arguments.
fn script_vars_args(script: &str, args: &[&str], env: &[(&str, &str)], keys: &[&str]) -> anyhow::Result<Vec<String>> {
    let out = Command::new("bash").arg(root().join(script)).args(args).envs(env.iter().copied()).stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("{script} failed (see above)");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    keys.iter()
        .map(|k| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .map(String::from)
                .with_context(|| format!("{script} printed no {k}"))
        })
        .collect()
}

/// Build (or find cached) llama-server and the SmolLM2 model: (server, model) paths.
fn llama() -> anyhow::Result<(String, String)> {
    let v = script_vars("scripts/llama.sh", &[], &["LLAMA_SERVER", "LLAMA_MODEL"])?;
    Ok((v[0].clone(), v[1].clone()))
}

/// Install (or find cached) the CPU vLLM and the model converted for it: (python, model folder).
fn vllm(gguf: &str) -> anyhow::Result<(String, String)> {
    let v = script_vars("scripts/vllm.sh", &[("LLAMA_MODEL", gguf)], &["VLLM_PYTHON", "VLLM_MODEL"])?;
    Ok((v[0].clone(), v[1].clone()))
}

/// Install (or find cached) llama-cpp-python's server, built here: its venv's python.
fn llama_python() -> anyhow::Result<String> {
    let v = script_vars("scripts/llama-python.sh", &[], &["LLAMA_PYTHON"])?;
    Ok(v[0].clone())
}

/// The official schema checkers for deploy/kubernetes/ (PyPI kubernetes-validate, npm
/// @kubernetes-models/prometheus-operator): their folder.
fn manifests() -> anyhow::Result<String> {
    let v = script_vars("scripts/manifests.sh", &[], &["KUBE_VALIDATE"])?;
    Ok(v[0].clone())
}

/// probe's OCI image (scripts/image.sh), built from the release binary: its tag.
/// `as_root`: in root's image store (the container tests run as root), through sudo when xtask
/// is not root.
fn image(engine: Option<&str>, save: Option<&Path>, as_root: bool) -> anyhow::Result<String> {
    let version = Command::new(bin("probe")).arg("--version").output().context("cannot run the built probe")?;
    let version = String::from_utf8_lossy(&version.stdout).split_whitespace().nth(1).unwrap_or("dev").to_string();
    let tag = format!("localhost/probe:{version}");
    let probe = bin("probe");
    let env: Vec<(&str, &str)> = engine.map(|e| vec![("ENGINE", e)]).unwrap_or_default();
    let args = [tag.as_str(), probe.to_str().context("a non-UTF-8 target path")?, "/usr/bin/probe"];
    let v = if as_root && via_sudo() {
        let mut all = vec!["bash".to_string(), root().join("scripts/image.sh").display().to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let out = elevated("env").args(env.iter().map(|(k, v)| format!("{k}={v}"))).args(&all).stderr(Stdio::inherit()).output()?;
        if !out.status.success() {
            bail!("scripts/image.sh failed (see above)");
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        vec![text.lines().find_map(|l| l.strip_prefix("IMAGE=")).context("scripts/image.sh printed no IMAGE")?.to_string()]
    } else {
        script_vars_args("scripts/image.sh", &args, &env, &["IMAGE"])?
    };
    let engine = engine.map(str::to_string).unwrap_or_else(|| {
        if Command::new("podman").arg("--version").output().is_ok_and(|o| o.status.success()) { "podman".into() } else { "docker".into() }
    });
    let mut tag_latest = if as_root { elevated(&engine) } else { Command::new(&engine) };
    run(tag_latest.args(["tag", &tag, "localhost/probe:latest"]))?;
    if let Some(file) = save {
        let _ = std::fs::remove_file(file);
        let mut c = if as_root { elevated(&engine) } else { Command::new(&engine) };
        c.arg("save").arg("-o").arg(file);
        if engine == "podman" {
            c.args(["--format", "oci-archive"]);
        }
        run(c.arg(&tag))?;
        println!("image: saved {tag} to {}", file.display());
    }
    Ok(v[0].clone())
}

/// AIPerf (PyPI) for the side-by-side bench test.
fn aiperf() -> anyhow::Result<String> {
    let v = script_vars("scripts/aiperf.sh", &[], &["AIPERF"])?;
    Ok(v[0].clone())
}

fn test(args: &[String]) -> anyhow::Result<()> {
    sudo_ready()?;
    build()?;
    // The .deb the packaging test installs (tests/kernel.rs).
    let deb = deb()?;
    let (server, model) = llama()?;
    let (vllm_python, vllm_model) = vllm(&model)?;
    let llama_python = llama_python()?;
    let aiperf = aiperf()?;
    let kube_validate = manifests()?;
    // The image the container tests run (tests/deploy.rs), in root's store.
    let probe_image = image(None, None, true)?;
    // Pass cargo's output through and close with one total line over every test binary.
    let mut cargo = Command::new("cargo");
    if via_sudo() {
        // cargo builds as the user and runs each test binary through sudo (the kernel tests load
        // BPF programs): the aya template's `runner = "sudo -E"`, for this run only.
        let var = format!("CARGO_TARGET_{}_RUNNER", host_triple()?.to_uppercase().replace(['-', '.'], "_"));
        cargo.env(var, "sudo -E");
        let clients = PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/probe/clients");
        cargo.env("PROBE_CLIENTS", std::env::var_os("PROBE_CLIENTS").map_or(clients, PathBuf::from));
    }
    let mut child = cargo
        .current_dir(root())
        .env("PROBE_BIN", bin("probe"))
        .env("PROBE_DEB", deb)
        .env("LLAMA_SERVER", server)
        .env("LLAMA_MODEL", model)
        .env("VLLM_PYTHON", vllm_python)
        .env("VLLM_MODEL", vllm_model)
        .env("LLAMA_PYTHON", llama_python)
        .env("AIPERF", aiperf)
        .env("PROBE_IMAGE", probe_image)
        .env("KUBE_VALIDATE", kube_validate)
        // A failing test's message, not a backtrace of the test harness, is what CI's log keeps.
        .env("RUST_BACKTRACE", "0")
        .args(["test", "--release", "--workspace", "--exclude", "probe-ebpf", "--no-fail-fast"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run cargo test")?;
    let (mut passed, mut failed, mut ignored) = (0u64, 0u64, 0u64);
    // Each failing test's name and the first lines of its panic, repeated after the total.
    let (mut failures, mut in_failure): (Vec<String>, usize) = (Vec::new(), 0);
    for line in BufReader::new(child.stdout.take().context("cargo test stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if line.starts_with("---- ") && line.ends_with(" stdout ----") {
            failures.push(line.clone());
            in_failure = 0;
        } else if line.starts_with("thread '") && line.contains("panicked at") {
            failures.push(line.clone());
            in_failure = 6;
        } else if in_failure > 0 {
            in_failure -= 1;
            failures.push(format!("    {}", line.chars().take(600).collect::<String>()));
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            let count = |what: &str| -> u64 {
                rest.split(';').find_map(|p| p.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse().ok()).unwrap_or(0)
            };
            passed += count("passed");
            failed += count("failed");
            ignored += count("ignored");
        }
    }
    let status = child.wait()?;
    give_back_files();
    if !failures.is_empty() {
        println!("\nfailures:\n{}", failures.join("\n"));
    }
    println!("\ntests: {passed} passed, {failed} failed, {ignored} skipped");
    if !status.success() || failed > 0 {
        bail!("tests failed ({status})");
    }
    if passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}

/// Start a workload (it prints `ready PID` and waits for a line on stdin).
/// Returns the child, its pid, and its later stdout lines.
fn start_workload(args: &[&str]) -> anyhow::Result<(std::process::Child, u32, std::sync::mpsc::Receiver<String>)> {
    let mut child = Command::new(bin("probe-workload")).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("workload stdout")?);
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            bail!("workload exited before it was ready");
        }
        if let Some(pid) = line.strip_prefix("ready ") {
            let pid = pid.trim().parse()?;
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for l in out.lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
            return Ok((child, pid, rx));
        }
    }
}

fn wait_for(path: &Path, limit: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > limit {
            bail!("{} did not appear within {limit:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// One HTTP request with `Connection: close`; reads the whole response, or drops the connection
/// after `cut_after` SSE events. Returns (status line, SSE events read).
fn http(addr: &str, path: &str, body: &str, cut_after: Option<usize>) -> anyhow::Result<(String, usize)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        let events = buf.windows(6).filter(|w| w == b"data: ").count();
        if cut_after.is_some_and(|c| events > c) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&buf);
    Ok((text.lines().next().unwrap_or("").to_string(), buf.windows(6).filter(|w| w == b"data: ").count()))
}

/// A llama-server (SmolLM2-135M) on a free loopback port, answering /health; killed when dropped.
struct Llama {
    child: std::process::Child,
    addr: String,
}

impl Llama {
    /// Start it with `args` (beside the model and the address), its stderr to `log`, and wait up
    /// to 60 s for /health.
    fn start(args: &[&str], log: Option<&Path>) -> anyhow::Result<Llama> {
        let (server, model) = llama()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
        let stderr = match log {
            Some(p) => Stdio::from(std::fs::File::create(p)?),
            None => Stdio::null(),
        };
        let child = Command::new(&server)
            .args(["-m", &model])
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        let srv = Llama { child, addr: format!("127.0.0.1:{port}") };
        println!("llama-server on {} with {model}", srv.addr);
        let t = Instant::now();
        while !http_get_ok(&srv.addr, "/health") {
            if t.elapsed() > Duration::from_secs(60) {
                let see = log.map(|p| format!(" (see {})", p.display())).unwrap_or_default();
                bail!("llama-server did not become healthy in 60 s{see}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(srv)
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Llama {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The main job end to end: a real llama-server with SmolLM2-135M, traced by probe while it
/// answers a morning request (asleep, the model evicted: load and disk, the model file named), a
/// few ordinary requests (one cut short by the client), the same request warm, and under three
/// busy loops (cpu_contention, naming them); probe prints the verdicts.
fn demo() -> anyhow::Result<()> {
    sudo_ready()?;
    build()?;
    let dir = root().join("target/demo");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The server sleeps (unloads its model) after 2 s idle: the slow morning scene.
    let srv = Llama::start(&["-c", "2048", "-np", "2", "--metrics", "--sleep-idle-seconds", "2"], Some(&dir.join("llama-server.log")))?;
    let addr = srv.addr.clone();
    let rec = dir.join("recording");
    // The slow morning: asleep, and the model file gone from the page cache (before probe
    // attaches, so that the demo's own polls are not in the recording).
    asleep_and_evicted(&addr, &llama()?.1)?;
    // Only probe runs as root (through sudo for a normal user); the recording is yours.
    let mut probe = elevated(bin("probe")).args(["trace", "--pid", &srv.pid(), "--out"]).arg(&rec).spawn()?;
    wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the morning request (server asleep, model not in the page cache): {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    let chat = |n: u32, stream: bool| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"Write a short story about a lighthouse."}}],"max_tokens":{n},"stream":{stream},"temperature":0}}"#
        )
    };
    let steps: [(&str, String, Option<usize>, &str); 4] = [
        ("/v1/chat/completions", chat(32, true), None, "streamed chat, max_tokens 32"),
        (
            "/completion",
            r#"{"prompt":"The lighthouse keeper","n_predict":16,"stream":true}"#.to_string(),
            None,
            "native /completion, n_predict 16",
        ),
        ("/v1/chat/completions", chat(200, true), Some(5), "streamed chat, the client leaves after 5 events"),
        ("/v1/chat/completions", chat(12, false), None, "non-streamed chat, max_tokens 12"),
    ];
    for (path, body, cut, what) in steps {
        let (status, events) = http(&addr, path, &body, cut)?;
        println!("demo: {what}: {status}, {events} SSE events read");
    }
    // The same request as the morning one, warm: the baseline the verdicts compare with.
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the same request, warm: {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    // A request under a CPU hog: busy loops under a name of their own hold both CPUs.
    let hogs = CpuHogs::start(3)?;
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the same request under 3 busy loops (cpuhog): {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    drop(hogs);
    // A prompt longer than a slot's context (-c 2048 over -np 2 slots: 1024 tokens each): the
    // server refuses it, and says both sizes.
    let long = "The lighthouse keeper wrote in his log every night. ".repeat(150);
    let body = serde_json::json!({"messages": [{"role": "user", "content": long}], "max_tokens": 8, "stream": false}).to_string();
    let (status, _) = http(&addr, "/v1/chat/completions", &body, None)?;
    println!("demo: a prompt longer than a slot's context: {status}");
    std::thread::sleep(Duration::from_millis(500));
    // SIGINT, as Ctrl-C would: probe writes report.json and prints the summary.
    // Through sudo as well: a user may not signal the root-owned sudo (it relays the signal).
    elevated("kill").args(["-INT", &probe.id().to_string()]).status()?;
    let status = probe.wait()?;
    give_back_files();
    println!("\ndemo: probe exited with {status}; recording and report.json in {}", rec.display());
    Ok(())
}

/// The demo's morning request: a short question (the reload, not the prompt, is the wait), a
/// short answer, not streamed, its prompt computed every time (the warm repeat did as much work).
fn morning_body() -> String {
    let prompt = "Good morning. What should the lighthouse keeper write in his log tonight?";
    serde_json::json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0, "stream": false, "cache_prompt": false})
        .to_string()
}

/// Wait until llama-server says it sleeps (`--sleep-idle-seconds`: its model unmapped), then drop
/// the model file from the page cache (DONTNEED evicts the clean pages of a file nobody maps):
/// the machine the morning after.
fn asleep_and_evicted(addr: &str, model: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let props = http_get(addr, "/props").and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok());
        if props.is_some_and(|p| p["is_sleeping"] == true) {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("llama-server did not go to sleep within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let f = std::fs::File::open(model).with_context(|| format!("cannot open {model}"))?;
    // SAFETY: a valid descriptor for the call; posix_fadvise only advises the kernel.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Busy loops named `cpuhog` (a link to /bin/sh: a process is named by what it was run as);
/// killed when dropped.
struct CpuHogs(Vec<std::process::Child>);

impl CpuHogs {
    fn start(n: usize) -> anyhow::Result<CpuHogs> {
        let link = root().join("target/demo/cpuhog");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/bin/sh", &link)?;
        let kids = (0..n).map(|_| Command::new(&link).args(["-c", "while :; do :; done"]).spawn()).collect::<Result<_, _>>()?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(CpuHogs(kids))
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        for k in &mut self.0 {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// The body of a GET answered 200, when it was.
fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

fn http_get_ok(addr: &str, path: &str) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return false };
    if write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

/// Interleaved untraced/traced runs of the generation bench.
const PAIRS: usize = 12;

/// Geometric mean of ratios and its 95% confidence interval (Student's t on the log ratios).
fn ratio_interval(r: &[f64]) -> (f64, f64, f64) {
    let n = r.len();
    if n < 2 {
        let m = r.first().copied().unwrap_or(f64::NAN);
        return (m, f64::NAN, f64::NAN);
    }
    let logs: Vec<f64> = r.iter().map(|x| x.ln()).collect();
    let mean = logs.iter().sum::<f64>() / n as f64;
    let var = logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    // Two-sided 97.5% quantiles of Student's t for 1..=30 degrees of freedom, then normal.
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101,
        2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    let t = T.get(n - 2).copied().unwrap_or(1.96);
    let half = t * (var / n as f64).sqrt();
    (mean.exp(), (mean - half).exp(), (mean + half).exp())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn bench() -> anyhow::Result<()> {
    require_root()?;
    build()?;
    let dir = root().join("target/bench");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    // 1. Start to armed: wall time from spawning `probe trace` to its "armed" line.
    let mut sleeper = Command::new("sleep").arg("600").spawn()?;
    let (mut wall, mut inner) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let t = Instant::now();
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &sleeper.id().to_string(), "--duration", "200ms", "--out"])
            .arg(dir.join(format!("armed-{i}")))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut err = BufReader::new(p.stderr.take().context("stderr")?);
        let mut line = String::new();
        while err.read_line(&mut line)? > 0 {
            if let Some(rest) = line.split("armed in ").nth(1) {
                wall.push(t.elapsed().as_secs_f64() * 1e3);
                inner.push(rest.split(' ').next().unwrap_or("0").parse::<f64>().unwrap_or(0.0));
                break;
            }
            line.clear();
        }
        std::io::copy(&mut err, &mut std::io::sink())?;
        p.wait()?;
    }
    let _ = sleeper.kill();
    println!(
        "start to armed (10 runs): median {:.1} ms wall (spawn → \"armed\"), {:.1} ms inside probe; max {:.1} ms",
        median(wall.clone()),
        median(inner),
        wall.iter().cloned().fold(0.0, f64::max)
    );
    // Stage by stage (report.json's `armed.stages`), medians over the runs.
    let (mut stages, mut slowest): (Vec<(String, Vec<f64>)>, Vec<String>) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let Ok(text) = std::fs::read(dir.join(format!("armed-{i}/report.json"))) else { continue };
        let r: serde_json::Value = serde_json::from_slice(&text)?;
        let mut slowest_seen = false;
        for st in r["armed"]["stages"].as_array().into_iter().flatten() {
            let (Some(name), Some(ms)) = (st[0].as_str(), st[1].as_f64()) else { continue };
            let name = match name.strip_prefix("program ") {
                Some(_) if slowest_seen => continue,
                Some(p) => {
                    slowest_seen = true;
                    if !slowest.iter().any(|n| n == p) {
                        slowest.push(p.to_string());
                    }
                    "slowest program".to_string()
                }
                None => name.to_string(),
            };
            match stages.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push(ms),
                None => stages.push((name, vec![ms])),
            }
        }
    }
    let parts: Vec<String> = stages.into_iter().map(|(n, v)| format!("{n} {:.1}", median(v))).collect();
    println!("  stages (median ms): {}; the slowest program: {}", parts.join(", "), slowest.join(" or "));

    // 2. High event rate: mmap+munmap in a tight loop (2 records per iteration), untraced
    //    then traced, in this one invocation.
    let secs = 3.0;
    // (syscalls per second, seconds the loop ran) from the workload's `done calls=N secs=S`.
    let calls = |out: &str| -> (f64, f64) {
        let kv = |k: &str| out.split_whitespace().find_map(|w| w.strip_prefix(k)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (kv("calls=") / kv("secs=").max(1e-9), kv("secs="))
    };
    let run_loop = |traced: bool| -> anyhow::Result<((f64, f64), Option<serde_json::Value>)> {
        let (mut w, pid, lines) = start_workload(&["mmap-loop", &secs.to_string()])?;
        let rec = dir.join(format!("rate-{traced}"));
        let mut probe = None;
        if traced {
            probe = Some(
                Command::new(bin("probe"))
                    .args(["trace", "--pid", &pid.to_string(), "--probes", "mmap", "--out"])
                    .arg(&rec)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()?,
            );
            wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        }
        writeln!(w.stdin.take().context("stdin")?, "go")?;
        let out = lines.iter().find(|l| l.starts_with("done")).unwrap_or_default();
        w.wait()?;
        let report = match probe {
            Some(mut p) => {
                p.wait()?;
                Some(serde_json::from_slice(&std::fs::read(rec.join("report.json"))?)?)
            }
            None => None,
        };
        Ok((calls(&out), report))
    };
    let ((base, _), _) = run_loop(false)?;
    let ((traced, ran), report) = run_loop(true)?;
    let report = report.context("no report")?;
    let events = report["events"].as_u64().unwrap_or(0);
    let lost: u64 = report["lost_events"].as_object().map(|o| o.values().filter_map(|v| v.as_u64()).sum()).unwrap_or(0);
    println!("high event rate (mmap+munmap loop, one record per syscall, {secs} s):");
    println!("  untraced: {:.0} syscalls/s", base);
    println!("  traced:   {:.0} syscalls/s  (ratio {:.2} against untraced)", traced, traced / base.max(1.0));
    println!("  probe drained {events} events ({:.0} events/s while the loop ran {ran:.1} s), lost {lost}", events as f64 / ran.max(1e-9));
    let (secs, rss) = timed(Command::new(bin("probe")).args(["report", "--json"]).arg(dir.join("rate-true")))?;
    println!("  reporting it: {secs:.2} s, peak RSS {:.0} MB; on disk: {}", rss / 1e6, sizes(&dir.join("rate-true"), false)?);
    bench_stop(&dir)?;
    bench_report(&dir)?;
    bench_llama(&dir)?;
    cost::bench_cost(&dir)?;
    watch_all_cost()
}

/// Ctrl-C to exit: SIGINT to `probe trace` (every probe) until it exited with its report written,
/// on an idle process and under an mmap/munmap flood; medians of 5 and of 3.
fn bench_stop(dir: &Path) -> anyhow::Result<()> {
    let stop = |pid: u32, rec: &Path| -> anyhow::Result<f64> {
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &pid.to_string(), "--out"])
            .arg(rec)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
        p.wait()?;
        let secs = t.elapsed().as_secs_f64();
        if !rec.join("report.json").is_file() {
            bail!("probe exited without its report in {}", rec.display());
        }
        Ok(secs)
    };
    let mut sleeper = Command::new("sleep").arg("600").spawn()?;
    let idle = (0..5).map(|i| stop(sleeper.id(), &dir.join(format!("stop-idle-{i}")))).collect::<anyhow::Result<Vec<f64>>>()?;
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let mut flood = Vec::new();
    for i in 0..3 {
        let (mut w, pid, _lines) = start_workload(&["mmap-loop", "10"])?;
        writeln!(w.stdin.take().context("stdin")?, "go")?;
        flood.push(stop(pid, &dir.join(format!("stop-flood-{i}")))?);
        let _ = w.kill();
        let _ = w.wait();
    }
    let ms = |v: &[f64]| format!("median {:.0} ms, max {:.0} ms", median(v.to_vec()) * 1e3, v.iter().cloned().fold(0.0, f64::max) * 1e3);
    println!(
        "Ctrl-C to exit (SIGINT to probe's exit, report written; every probe): idle process {}; under an mmap/munmap flood {}",
        ms(&idle),
        ms(&flood)
    );
    Ok(())
}

/// `cargo xtask bench --cost`: the tracing-cost section alone (its files in target/bench/cost).
fn bench_cost_only() -> anyhow::Result<()> {
    require_root()?;
    build()?;
    cost::bench_cost(&root().join("target/bench"))?;
    watch_all_cost()
}

/// `probe watch --all` as a node agent with 0, 1, 4 and 16 llama-servers (scripts/watch-all-cost.sh):
/// probe's CPU and its BPF programs' run time per wall second.
/// With `PROBE_COST_BASELINE` (an earlier probe binary) the same sweep runs for it first, in the
/// same invocation, so the two tables sit side by side.
fn watch_all_cost() -> anyhow::Result<()> {
    let (server, model) = llama()?;
    let mut bins = Vec::new();
    if let Some(b) = std::env::var_os("PROBE_COST_BASELINE").map(PathBuf::from).filter(|p| p.is_file()) {
        bins.push(("baseline (PROBE_COST_BASELINE)", b));
    }
    bins.push(("this build", bin("probe")));
    for (what, probe) in bins {
        println!("watch --all, {what}: {}", probe.display());
        run(Command::new("bash")
            .arg(root().join("scripts/watch-all-cost.sh"))
            .env("LLAMA_SERVER", &server)
            .env("LLAMA_MODEL", &model)
            .env("PROBE_BIN", probe))?;
    }
    Ok(())
}

/// Wall time and peak RSS (bytes) of a command run to the end, its output discarded.
fn timed(cmd: &mut Command) -> anyhow::Result<(f64, f64)> {
    let t = Instant::now();
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child, with valid pointers.
    let r = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    if r < 0 {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) > 1 {
        bail!("{cmd:?} failed (status {status:#x})");
    }
    Ok((t.elapsed().as_secs_f64(), ru.ru_maxrss as f64 * 1024.0))
}

/// `probe report --sizes DIR` in one line: bytes per record of each kind (`stacks`: also the
/// stack samples; otherwise the kernel records only, with their average).
fn sizes(dir: &Path, stacks: bool) -> anyhow::Result<String> {
    let out = Command::new(bin("probe")).args(["report", "--sizes"]).arg(dir).output()?;
    let (mut parts, mut n, mut bytes) = (vec![], 0u64, 0u64);
    for l in String::from_utf8_lossy(&out.stdout).lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (Some(k), Some(c), Some(b), Some(per)) =
            (f.first(), f.get(1).and_then(|v| v.parse::<u64>().ok()), f.get(2).and_then(|v| v.parse::<u64>().ok()), f.get(3))
        else {
            continue;
        };
        if k.starts_with("json:") || (k.starts_with("stack:") && !stacks) {
            continue;
        }
        if !k.contains(':') {
            n += c;
            bytes += b;
        }
        parts.push(format!("{k} {per} B"));
    }
    Ok(format!("{} ({} kernel records, {:.1} bytes each on average)", parts.join(", "), n, bytes as f64 / n.max(1) as f64))
}

/// Reporting a night-long recording: a synthetic one with a real trace's mix (10 M kernel
/// events and stack samples, 250 requests), and `perf report` on as many samples.
fn bench_report(dir: &Path) -> anyhow::Result<()> {
    const EVENTS: u64 = 10_000_000;
    let night = dir.join("night");
    let out = Command::new(bin("probe")).args(["synth", "--events", &EVENTS.to_string(), "--out"]).arg(&night).output()?;
    if !out.status.success() {
        bail!("probe synth: {}", String::from_utf8_lossy(&out.stderr));
    }
    println!("reporting a night-long recording ({}):", String::from_utf8_lossy(&out.stdout).trim());
    println!("  on disk: {}", sizes(&night, true)?);
    let (secs, rss) = timed(Command::new(bin("probe")).args(["report", "--json"]).arg(&night))?;
    println!("  probe report: {secs:.2} s, peak RSS {:.0} MB (goals: 10 s, 400 MB)", rss / 1e6);
    // Against an earlier probe on the same recording, in the same run (PROBE_BASELINE=path of its
    // binary, e.g. one built from the last release): both are timed twice, alternately, best of two.
    if let Some(base) = std::env::var_os("PROBE_BASELINE").map(PathBuf::from) {
        let best = |b: &Path| -> anyhow::Result<(f64, f64)> {
            let mut t = (f64::MAX, 0.0f64);
            for _ in 0..2 {
                let (s, r) = timed(Command::new(b).args(["report", "--json"]).arg(&night))?;
                t = (t.0.min(s), t.1.max(r));
            }
            Ok(t)
        };
        let (old, new) = (best(&base)?, best(&bin("probe"))?);
        println!(
            "  against {}: {:.2} s and {:.0} MB before, {:.2} s and {:.0} MB now: {:.2}× as fast, {:.2}× the memory",
            base.display(),
            old.0,
            old.1 / 1e6,
            new.0,
            new.1 / 1e6,
            old.0 / new.0.max(1e-9),
            new.1 / old.1.max(1.0)
        );
    }
    // The reference: perf's own report over as many samples (page faults, one sample each; no
    // call chains) of a process writing 40 GB a page at a time.
    let data = dir.join("perf.data");
    let rec = Command::new("perf")
        .args(["record", "-q", "-e", "page-faults", "-c", "1", "-o"])
        .arg(&data)
        .args(["--", "python3", "-c", &format!("for _ in range({}): b = b'\\x01' * (256 << 20)", EVENTS / 65536 + 1)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match rec {
        Ok(s) if s.success() => {
            let (psecs, prss) = timed(Command::new("perf").args(["report", "--stdio", "-i"]).arg(&data))?;
            println!(
                "  perf report --stdio on {} page-fault samples: {psecs:.2} s, peak RSS {:.0} MB; probe/perf: {:.2}× the time, {:.2}× the memory",
                EVENTS / 65536 * 65536 + 65536,
                prss / 1e6,
                secs / psecs.max(1e-9),
                rss / prss.max(1.0)
            );
        }
        _ => println!("  perf record did not run here (perf missing or not permitted): no reference figure"),
    }
    let _ = std::fs::remove_file(&data);
    let _ = std::fs::remove_dir_all(&night);
    Ok(())
}

/// One 256-token completion (ignore_eos, temperature 0, seed 7, no prompt cache) from a
/// llama-server: tokens/s as the server measured it (timings.predicted_per_second).
fn generate_256(addr: &str) -> anyhow::Result<f64> {
    let body = r#"{"prompt":"Write a long story about a lighthouse keeper and the sea.","n_predict":256,"seed":7,"temperature":0,"cache_prompt":false,"ignore_eos":true}"#;
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(s, "POST /completion HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let json = text.split("\r\n\r\n").nth(1).context("no body")?;
    let v: serde_json::Value = serde_json::from_str(json)?;
    v["timings"]["predicted_per_second"].as_f64().context("no timings")
}

/// Generation speed of a real llama-server untraced and traced (all probes, 99 Hz CPU stacks
/// with unwinding), interleaved: the ratio, and the unwinding cost per sample.
fn bench_llama(dir: &Path) -> anyhow::Result<()> {
    let srv = Llama::start(&["-c", "2048", "-np", "1"], None)?;
    let addr = srv.addr.clone();
    let generate = || generate_256(&addr);
    generate()?; // warm up
    let (mut plain, mut traced, mut unwind_us, mut load_ms, mut samples) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0u64);
    for i in 0..PAIRS {
        plain.push(generate()?);
        let rec = dir.join(format!("llama-{i}"));
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &srv.pid(), "--hz", "99", "--out"])
            .arg(&rec)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        traced.push(generate()?);
        Command::new("kill").args(["-INT", &p.id().to_string()]).status()?;
        p.wait()?;
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(rec.join("report.json"))?)?;
        unwind_us.push(r["unwind"]["us_per_sample"].as_f64().unwrap_or(0.0));
        load_ms.push(r["unwind"]["load_ms"].as_f64().unwrap_or(0.0));
        samples += r["stacks"]["cpu"]["stacks"].as_u64().unwrap_or(0);
    }
    let (p, t) = (median(plain.clone()), median(traced.clone()));
    let pairs: Vec<f64> = plain.iter().zip(&traced).map(|(a, b)| b / a).collect();
    println!("llama-server generation (SmolLM2-135M, 256 tokens, {PAIRS} interleaved pairs):");
    println!("  untraced: median {p:.1} tokens/s {plain:.1?}");
    println!("  traced:   median {t:.1} tokens/s {traced:.1?}  (all probes, 99 Hz CPU stacks)");
    println!("  ratio traced/untraced: {:.3} (medians), {:.3} (median of the {PAIRS} pairs {pairs:.3?})", t / p, median(pairs.clone()));
    let (mean, lo, hi) = ratio_interval(&pairs);
    println!(
        "  ratio with a 95% confidence interval (geometric mean of the pairs, t on log ratios): {mean:.3} [{lo:.3}, {hi:.3}], width {:.1}%",
        (hi - lo) * 100.0
    );
    println!(
        "  unwinding: median {:.1} us per stack ({samples} CPU samples); loading unwind tables: median {:.1} ms per trace",
        median(unwind_us),
        median(load_ms)
    );
    Ok(())
}

/// Every fuzz target for `secs` seconds (two at a time on two cores), with overflow checks and
/// debug assertions on, a memory limit and a per-input timeout (a hang or a blow-up fails too).
/// Targets start from a scratch copy of fuzz/corpus/<target> under target/fuzz-corpus (the
/// committed corpus is never written); crashing inputs land in target/fuzz-artifacts/<target>.
fn fuzz(secs: u64) -> anyhow::Result<()> {
    // (target, -max_len): a recording needs room for a few frames of every kind.
    const TARGETS: [(&str, u32); 6] = [
        ("stream_tracker", 16384),
        ("http_body", 4096),
        ("splitter", 4096),
        ("recording_report", 65536),
        ("exposition", 16384),
        ("python_frames", 16384),
    ];
    setup()?;
    let root = root();
    let cache = std::env::var_os("PROBE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/probe")))
        .context("neither PROBE_CACHE nor HOME is set")?;
    let path = std::env::join_paths(
        std::iter::once(cache.join("cargo-fuzz/bin")).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )?;
    let target_dir = root.join("target/fuzz");
    // -O -a: release with debug assertions and overflow checks; -s none: no AddressSanitizer (the
    // code is safe Rust: ASan would double the build and halve the execs/s for little). AYA_BUILD_SKIP:
    // probe-user without its eBPF object (the targets never load it; see probe-user/build.rs).
    let cargo_fuzz = |args: &[&str]| {
        let mut c = Command::new("cargo");
        c.current_dir(root.join("fuzz")).env("PATH", &path).env("AYA_BUILD_SKIP", "1").args(["+nightly", "fuzz"]).args(args);
        c.args(["-O", "-a", "-s", "none", "--target-dir"]).arg(&target_dir);
        c
    };
    let t = Instant::now();
    run(&mut cargo_fuzz(&["build"]))?;
    println!("fuzz: built {} targets in {:.0} s", TARGETS.len(), t.elapsed().as_secs_f64());
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).min(TARGETS.len());
    let mut failed = Vec::new();
    for batch in TARGETS.chunks(jobs) {
        let mut running = Vec::new();
        for &(name, max_len) in batch {
            let corpus = root.join("target/fuzz-corpus").join(name);
            let artifacts = root.join("target/fuzz-artifacts").join(name);
            let log = root.join("target/fuzz-logs").join(format!("{name}.log"));
            let _ = std::fs::remove_dir_all(&corpus);
            for d in [&corpus, &artifacts, &log.parent().context("log dir")?.to_path_buf()] {
                std::fs::create_dir_all(d)?;
            }
            for f in std::fs::read_dir(root.join("fuzz/corpus").join(name))? {
                let f = f?;
                std::fs::copy(f.path(), corpus.join(f.file_name()))?;
            }
            let mut cmd = cargo_fuzz(&["run", name]);
            cmd.arg(&corpus).arg("--").args([
                format!("-max_total_time={secs}"),
                format!("-max_len={max_len}"),
                "-rss_limit_mb=2560".into(),
                "-timeout=10".into(),
                "-print_final_stats=1".into(),
                format!("-artifact_prefix={}/", artifacts.display()),
            ]);
            if name != "recording_report" {
                cmd.arg(format!("-dict={}", root.join("fuzz/http.dict").display()));
            }
            let out = std::fs::File::create(&log)?;
            let child = cmd.stdout(out.try_clone()?).stderr(out).spawn().context("cannot run cargo fuzz")?;
            running.push((name, corpus, log, child));
        }
        for (name, corpus, log, mut child) in running {
            let status = child.wait()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let stat = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)).map_or("?".to_string(), |v| v.trim().to_string());
            let files = std::fs::read_dir(&corpus).map_or(0, |d| d.count());
            println!(
                "fuzz: {name}: {} execs, {} execs/s, corpus {files} inputs, peak RSS {} MB ({})",
                stat("stat::number_of_executed_units:"),
                stat("stat::average_exec_per_sec:"),
                stat("stat::peak_rss_mb:"),
                if status.success() { "ok".to_string() } else { format!("FAILED: {status}") }
            );
            if !status.success() {
                // The panic (or libFuzzer's timeout / out-of-memory line) and what follows it.
                let lines: Vec<&str> = text.lines().collect();
                let from = lines
                    .iter()
                    .position(|l| l.contains("panicked at") || l.starts_with("==") || l.contains("ERROR: libFuzzer"))
                    .unwrap_or(lines.len().saturating_sub(30));
                let shown = lines[from..].iter().take_while(|l| !l.starts_with("stack backtrace:")).take(30);
                for l in shown.chain(lines.iter().filter(|l| l.starts_with("SUMMARY:"))) {
                    println!("  {}", l.chars().take(400).collect::<String>());
                }
                let artifact = text.lines().find_map(|l| l.split("Test unit written to ").nth(1)).unwrap_or("(none written)");
                println!("fuzz: {name} failed; input: {artifact}; log: {}", log.display());
                println!(
                    "fuzz: reproduce with: cd fuzz && AYA_BUILD_SKIP=1 cargo +nightly fuzz run -O -a -s none --target-dir ../target/fuzz {name} {artifact}"
                );
                failed.push(name);
            }
        }
    }
    if !failed.is_empty() {
        bail!("fuzz targets failed: {}", failed.join(", "));
    }
    println!("fuzz: {} targets × {secs} s, no failure ({:.0} s in all)", TARGETS.len(), t.elapsed().as_secs_f64());
    Ok(())
}

fn main() -> std::process::ExitCode {
    // One line per cause, no backtrace (RUST_BACKTRACE may be set): what failed stays at the end
    // of a CI log.
    match run_cmd(Cli::parse().cmd) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_cmd(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Setup => setup(),
        Cmd::Build => build(),
        Cmd::Test { args } => test(&args),
        Cmd::Demo => demo(),
        Cmd::Bench { cost: true, .. } => bench_cost_only(),
        Cmd::Bench { python: true, .. } => {
            require_root()?;
            build()?;
            python_cost::bench_python()
        }
        Cmd::Bench { stop: true, .. } => {
            require_root()?;
            build()?;
            let dir = root().join("target/bench/stop");
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            bench_stop(&dir)
        }
        Cmd::Bench { .. } => bench(),
        Cmd::Soak { minutes, clients } => soak::soak(minutes, clients),
        Cmd::Stress => soak::stress(),
        Cmd::Fuzz { secs } => fuzz(secs),
        Cmd::Image { engine, save } => {
            build()?;
            // Root's image store: the agent runs as root (privileged, eBPF).
            sudo_ready()?;
            let tag = image(engine.as_deref(), save.as_deref(), true)?;
            println!("image: {tag} (and localhost/probe:latest); deploy/kubernetes/probe.yaml runs {tag}");
            Ok(())
        }
        Cmd::Deb => {
            build()?;
            println!("{}", deb()?.display());
            Ok(())
        }
        Cmd::Install { prefix, group, uninstall } => {
            if !uninstall {
                setup()?;
                run(Command::new("cargo").current_dir(root()).args(["build", "--release", "-p", "probe-user"]))?;
            }
            sudo_ready()?;
            let mut c = elevated("bash");
            c.current_dir(root()).arg(root().join("scripts/install.sh")).args(["--prefix", &prefix, "--group", &group]);
            if uninstall {
                c.arg("--uninstall");
            } else {
                c.arg(bin("probe"));
            }
            run(&mut c)
        }
    }
}
