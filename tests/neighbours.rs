//! probe among neighbours nobody vets (issue 39): the node agent (`probe watch --all`) beside
//! hostile listeners and clients started by the test (tests/clients/hostile.py), and a trace
//! beside a same-port server in another network namespace. Real probe, real llama-server, real
//! sockets; the truth comes from the listeners' own logs, /proc and the clients' clocks.
use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

mod common;
use common::{Killed, env_path, free_port, probe_bin, serial, workload::scratch};

fn hostile() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/hostile.py")
}

/// A hostile listener (hostile.py listen MODE) on `port`, logging the heads it reads to `log`.
fn listener(mode: &str, port: u16, log: &Path) -> Killed {
    let mut c = Command::new("python3")
        .arg(hostile())
        .args(["listen", mode, &port.to_string()])
        .arg(log)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "listening", "hostile.py {mode} did not start");
    Killed(c)
}

/// `probe watch --all` with its log lines.
struct Agent {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Agent {
    fn start(dir: &Path, metrics: SocketAddr, args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut child = Command::new(probe_bin())
            .args(["watch", "--all", "--scan-every", "1s"])
            .arg("--dir")
            .arg(dir)
            .args(["--metrics-addr", &metrics.to_string()])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        Agent { child, lines, log: vec![] }
    }

    fn wait_log(&mut self, what: &str, limit: Duration) -> String {
        let t = Instant::now();
        loop {
            if let Some(l) = self.log.iter().find(|l| l.contains(what)) {
                return l.clone();
            }
            let left = limit.checked_sub(t.elapsed()).unwrap_or_else(|| panic!("no `{what}` in the agent's log: {:#?}", self.log));
            match self.lines.recv_timeout(left) {
                Ok(l) => self.log.push(l),
                Err(_) => panic!("no `{what}` in the agent's log: {:#?}", self.log),
            }
        }
    }

    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One GET, timed by the client's clock: (status, body, elapsed).
fn timed_get(addr: SocketAddr, path: &str) -> (u16, String, Duration) {
    let t = Instant::now();
    let (st, body) = common::http(addr, "GET", path, None, &[]).unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"));
    (st, String::from_utf8_lossy(&body).into_owned(), t.elapsed())
}

#[test]
fn the_node_agent_among_hostile_listeners_and_clients() {
    let _serial = serial();
    common::bpf::wait_no_probe_programs();
    let d = scratch("neighbours-agent");
    let heard = d.join("heard.jsonl");
    let key = format!("sk-neighbour-{}-secret", std::process::id());
    // The neighbours: one notes every header it is sent, two answer 401 to everything (with an
    // API's error body, as a server with a key would), three answer slowly, endlessly or never.
    let ports: Vec<u16> = (0..6).map(|_| free_port()).collect();
    let modes = ["log", "api401", "api401", "trickle", "endless", "silent"];
    let _hostile: Vec<Killed> = modes.iter().zip(&ports).map(|(m, p)| listener(m, *p, &heard)).collect();
    let llama_port = free_port();
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let state = d.join("state");
    let mut agent = Agent::start(&state, metrics, &["--api-key-for", &format!("port={llama_port}")], &[("PROBE_API_KEY", key.as_str())]);
    // The 401 listeners are servers that want a key: followed, without one.
    for p in &ports[1..3] {
        agent.wait_log(&format!("on port {p};"), Duration::from_secs(30));
    }
    let wants = agent.wait_log("wants an API key and is followed without one", Duration::from_secs(5));
    assert!(!wants.contains("sends it the API key"), "{wants}");
    // A slowloris client on the metrics port (the DaemonSet's liveness probe) before the server comes.
    let mut loris =
        Killed(Command::new("python3").arg(hostile()).arg("slowloris").arg(metrics.to_string()).stdout(Stdio::piped()).spawn().unwrap());
    let mut line = String::new();
    BufReader::new(loris.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");
    // The real server, with the key, started while the trickling listeners are being asked.
    let mut cmd = Command::new(env_path("LLAMA_SERVER"));
    cmd.arg("-m").arg(env_path("LLAMA_MODEL")).args(["-c", "1024", "-np", "1", "--no-repack", "--api-key", &key]);
    cmd.args(["--host", "127.0.0.1", "--port", &llama_port.to_string()]);
    let _llama = Killed(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    let llama_addr: SocketAddr = format!("127.0.0.1:{llama_port}").parse().unwrap();
    common::wait_healthy(llama_addr);
    let ready = Instant::now();
    let found = agent.wait_log(&format!("on port {llama_port};"), Duration::from_secs(30));
    let followed_in = ready.elapsed();
    assert!(found.contains("llama-server"), "{found}");
    assert!(
        followed_in <= Duration::from_secs(3),
        "the server was followed {:.1} s after it answered (over 3 s: slow listeners held discovery back)",
        followed_in.as_secs_f64()
    );
    agent.wait_log("sends it the API key and headers (port=", Duration::from_secs(5));
    // A scrape and the liveness probe answer at once, the slowloris client still connected.
    let (st, text, took) = timed_get(metrics, "/metrics");
    assert_eq!(st, 200, "{text}");
    assert!(took < Duration::from_secs(1), "a scrape took {took:?} beside a slowloris client");
    let (st, ok, took) = timed_get(metrics, "/healthz");
    assert!(st == 200 && ok.trim() == "ok" && took < Duration::from_secs(1), "{st} {ok:?} {took:?}");
    assert!(loris.0.try_wait().unwrap().is_none(), "the slowloris client gave up first");
    // The two 401 listeners and the real server: three servers (once each follower serves its
    // metrics); the slow ones are not followed.
    let t = Instant::now();
    loop {
        let (_, text, _) = timed_get(metrics, "/metrics");
        let servers = common::prometheus_sum(&text, "probe_servers");
        if servers == 3.0 {
            break;
        }
        assert!(servers < 3.0 && t.elapsed() < Duration::from_secs(20), "probe_servers {servers}, wanted 3:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    }
    agent.drain();
    for p in &ports[3..] {
        assert!(!agent.log.iter().any(|l| l.contains(&format!("on port {p};"))), "a slow listener was followed: {:#?}", agent.log);
    }
    // Three servers on one set of kernel programs, in the agent's own process: no follower
    // process holds the key (or anything else) in its environment or command line.
    assert_eq!(common::bpf::probe_programs(), 4, "one object's programs for three servers");
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", agent.child.id())).unwrap_or_default();
    assert!(children.trim().is_empty(), "the agent started processes: {children}");
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid: u32 = e.file_name().to_string_lossy().parse().unwrap_or(0);
        if pid != 0 && pid != agent.child.id() && std::fs::read(e.path().join("environ")).is_ok_and(|v| contains(&v, key.as_bytes())) {
            panic!("pid {pid} holds the key in its environment");
        }
    }
    // The scoped server was sent the key: its /props (which wants it) answered probe's polls.
    let t = Instant::now();
    let port_label = format!("port=\"{llama_port}\"");
    loop {
        let (_, text, _) = timed_get(metrics, "/metrics");
        if text.lines().any(|l| l.starts_with("probe_server_sleeping{") && l.contains(&port_label)) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the server's /props never answered probe (no key sent?):\n{text}");
        std::thread::sleep(Duration::from_millis(300));
    }
    let heads = std::fs::read_to_string(&heard).unwrap();
    for m in ["log", "api401", "trickle", "endless", "silent"] {
        assert!(heads.contains(&format!("\"mode\": \"{m}\"")), "the {m} listener was never asked: {heads}");
    }
    assert!(!heads.contains(&key), "a neighbour was sent the key: {heads}");
    assert!(!heads.to_ascii_lowercase().contains("authorization"), "a neighbour was sent credentials: {heads}");
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&c).replace('\0', " ");
            // The llama-server itself was given its key on its command line by this test.
            assert!(!contains(&c, key.as_bytes()) || text.contains("llama-server"), "the key is on a command line: {text}");
        }
    }
    // The agent killed outright: the programs go with it.
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    let t = Instant::now();
    while common::bpf::probe_programs() != 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "probe's programs outlived the killed agent");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("the server was followed {:.2} s after it answered, beside six hostile listeners", followed_in.as_secs_f64());
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_same_port_server_in_another_network_namespace_is_not_the_targets() {
    let _serial = serial();
    let d = scratch("neighbours-netns");
    let ns = format!("probe-nb-{}", std::process::id());
    let ip = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&["netns", "add", &ns]);
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _gone = Gone(ns.clone());
    ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
    let (srv, addr) = common::shared_llama_server(&["-c", "1024", "-np", "1", "--no-repack"]);
    let _srv = Killed(srv);
    let port = addr.port().to_string();
    // The neighbour: a web server on the same address and port, in its own namespace.
    let www = d.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("index.html"), "hello").unwrap();
    let _neighbour = Killed(
        Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-m", "http.server", "--bind", "127.0.0.1", &port])
            .current_dir(&www)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let in_ns = |n: usize| {
        let code = format!(
            "import urllib.request,time\nfor i in range(200):\n  try:\n    urllib.request.urlopen('http://127.0.0.1:{port}/').read(); break\n  except OSError: time.sleep(0.05)\nfor i in range({n}): urllib.request.urlopen('http://127.0.0.1:{port}/').read()\n"
        );
        let st = Command::new("ip").args(["netns", "exec", &ns, "python3", "-c", &code]).status().unwrap();
        assert!(st.success(), "the neighbour did not answer in its namespace");
    };
    in_ns(1);
    let out = d.join("rec");
    let (trace, _lines, _) = common::start_trace(&[
        "--pid",
        &_srv.0.id().to_string(),
        "--duration",
        "4s",
        "--no-poll",
        "--out",
        out.to_str().unwrap(),
        "--force",
    ]);
    in_ns(6);
    let (st, body) = common::http(addr, "POST", "/completion", Some(&serde_json::json!({"prompt": "Hello", "n_predict": 2})), &[]).unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let done = trace.wait_with_output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let r = common::read_report(&out);
    let conns = r["connections"].as_array().cloned().unwrap_or_default();
    assert_eq!(conns.len(), 1, "the target served one connection; the report has {}: {conns:#?}", conns.len());
    assert_eq!(conns[0]["local"].as_str(), Some(addr.to_string().as_str()), "{conns:#?}");
    assert_eq!(r["requests"].as_array().map(Vec::len), Some(1), "{:#}", r["requests"]);
}

/// `probe trace ARGS` (with `env`) run to its end: its report and its peak RSS (MiB, from
/// wait4's rusage: the kernel's account, not probe's).
// The child is reaped by wait4 itself.
#[allow(clippy::zombie_processes)]
fn trace_rss(args: &[&str], env: &[(&str, &str)], log: &Path) -> (serde_json::Value, u64) {
    let child = Command::new(probe_bin())
        .arg("trace")
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value for wait4 to fill in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child, with pointers to live values.
    let rc = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(rc, child.id() as i32);
    let said = std::fs::read_to_string(log).unwrap_or_default();
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) <= 1, "probe trace {args:?}: {status}\n{said}");
    let out = args.iter().skip_while(|a| **a != "--out").nth(1).unwrap();
    (common::read_report(Path::new(out)), ru.ru_maxrss as u64 / 1024)
}

/// The residency fallback (mincore, where cachestat is missing: forced here, this kernel has
/// cachestat) on a model file as large as the filesystem takes, sparse but for 64 pages: probe
/// pays for the file's data, not its size (a byte per page of the size was 512 MiB for 2 TiB),
/// and counts the pages the test wrote.
#[test]
fn a_huge_sparse_model_file_costs_what_its_data_costs() {
    use std::os::unix::fs::FileExt as _;
    let _serial = serial();
    let d = scratch("neighbours-sparse");
    let path = d.join("weights.bin");
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    let size = [16u64 << 40, 8 << 40, 4 << 40, (2 << 40) - (1 << 20), 1 << 40]
        .into_iter()
        .find(|&s| f.set_len(s).is_ok())
        .expect("the filesystem takes no sparse file of 1 TiB");
    let page = vec![7u8; 4096];
    let mut written = 0u64;
    let ranges = [(0, 16), (size / 2 / 4096 * 4096, 16), (size - 32 * 4096, 32)];
    for (at, n) in ranges {
        for i in 0..n {
            f.write_all_at(&page, at + i * 4096).unwrap();
            written += 1;
        }
    }
    f.sync_all().unwrap();
    let mut target = Killed(
        Command::new("python3")
            .args(["-c", "import mmap,sys,time\nf=open(sys.argv[1],'rb')\nm=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\nprint('mapped',flush=True)\ntime.sleep(120)"])
            .arg(&path)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(target.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "mapped");
    let out = d.join("rec");
    let pid = target.0.id().to_string();
    let args = ["--pid", &pid, "--duration", "4s", "--no-poll", "--out", out.to_str().unwrap()];
    let (r, rss) = trace_rss(&args, &[("PROBE_NO_CACHESTAT", "1")], &d.join("probe.log"));
    let files = r["system"]["model_files"].as_array().cloned().unwrap_or_default();
    let m = files.iter().find(|x| x["path"] == path.to_str().unwrap()).unwrap_or_else(|| panic!("not measured: {files:#?}"));
    assert_eq!(m["bytes"].as_u64(), Some(size), "{m}");
    // Measured by mincore (cachestat would have said how many pages were evicted).
    assert!(m["evicted"].is_null(), "cachestat measured it, not the fallback: {m}");
    assert!(m["readings"].as_u64().unwrap() >= 2, "{m}");
    let resident = (m["resident_end"].as_f64().unwrap() * (size / 4096) as f64).round() as u64;
    // The truth: the kernel's own count of the written pages in the page cache now (a hole has no
    // page to cache; a written page may have been reclaimed since it was written: DAMON runs here).
    let cached = resident_pages(&f, &ranges);
    assert!(cached > 0 && cached <= written, "{cached} of the {written} written pages cached");
    assert!(resident.abs_diff(cached) <= 1, "resident pages by probe's mincore {resident}, by the kernel now {cached}: {m}");
    assert!(rss < 200, "probe's peak RSS was {rss} MiB measuring a {} GiB sparse file", size >> 30);
    eprintln!("a {} GiB sparse file ({written} pages of data) measured by mincore: probe's peak RSS {rss} MiB", size >> 30);
}

/// Pages of `ranges` (offset, pages) of `f` in the page cache, by mincore over a mapping of each.
fn resident_pages(f: &std::fs::File, ranges: &[(u64, u64)]) -> u64 {
    use std::os::fd::AsRawFd as _;
    let mut n = 0;
    for &(at, pages) in ranges {
        let len = (pages * 4096) as usize;
        // SAFETY: a fresh read-only shared mapping of the test's own file, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), at as libc::off_t) };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        let mut v = vec![0u8; pages as usize];
        // SAFETY: `v` holds one byte per page of the mapping.
        assert_eq!(unsafe { libc::mincore(p, len, v.as_mut_ptr()) }, 0, "mincore");
        n += v.iter().filter(|&&b| b & 1 != 0).count() as u64;
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
    }
    n
}

/// A target that maps many distinct executables (copies of one library, each with its own
/// build id) and runs code in all of them, traced under a small unwind budget: the sections held
/// stay within it, the modules left out are counted and said (at most as many as the target's own
/// /proc/PID/maps has), and the same trace without a budget leaves none out.
#[test]
fn many_distinct_executables_stay_within_the_unwind_budget() {
    let _serial = serial();
    let d = scratch("neighbours-elves");
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/target_files/lib.c");
    const COPIES: usize = 48;
    let mut libs = Vec::new();
    for i in 0..COPIES {
        let out = d.join(format!("libcopy{i}.so"));
        let st = Command::new("cc")
            .args(["-O2", "-shared", "-fPIC", &format!("-Wl,--build-id=0x{:032x}", 0xfeed_0000u128 + i as u128)])
            .arg(&lib)
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
        libs.push(out);
    }
    // The target: dlopens every copy and spins in each in turn, forever.
    let code = "import ctypes,sys,time\nlibs=[ctypes.CDLL(p) for p in sys.argv[1:]]\nprint('loaded',flush=True)\nwhile True:\n  for l in libs: l.victim_spin(20000)\n";
    let mut target = Killed(Command::new("python3").args(["-c", code]).args(&libs).stdout(Stdio::piped()).spawn().unwrap());
    let mut line = String::new();
    BufReader::new(target.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "loaded");
    let pid = target.0.id();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mapped: std::collections::HashSet<&str> = maps
        .lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
        .filter_map(|l| l.split_whitespace().nth(5))
        .collect();
    let copies_mapped = mapped.iter().filter(|p| p.contains("libcopy")).count();
    assert_eq!(copies_mapped, COPIES, "{maps}");
    // Room for a few of the copies (a few hundred bytes of sections each), not for libc.
    let budget: u64 = 16 << 10;
    let run = |name: &str, env: &[(&str, &str)]| {
        let out = d.join(name);
        let pid = pid.to_string();
        let args = ["--pid", &pid, "--duration", "3s", "--no-poll", "--out", out.to_str().unwrap()];
        trace_rss(&args, env, &d.join(format!("{name}.log")))
    };
    let (free, _) = run("unbudgeted", &[]);
    let (tight, _) = run("budgeted", &[("PROBE_UNWIND_BUDGET", &budget.to_string())]);
    assert_eq!(free["unwind"]["left_out_modules"].as_u64().unwrap_or(0), 0, "{}", free["unwind"]);
    let left_out = tight["unwind"]["left_out_modules"].as_u64().unwrap_or(0);
    let held = tight["unwind"]["held_bytes"].as_u64().unwrap_or(0);
    assert!(held <= budget, "{held} bytes of unwind sections held over a budget of {budget}: {}", tight["unwind"]);
    assert!(
        left_out >= 1 && left_out as usize <= mapped.len(),
        "{left_out} left out of {} modules mapped: {}",
        mapped.len(),
        tight["unwind"]
    );
    // The trace goes on: stacks are still taken and unwound as far as the budget allows.
    assert!(tight["unwind"]["samples"].as_u64().unwrap() > 0, "{}", tight["unwind"]);
    let text = Command::new(probe_bin()).arg("report").arg(d.join("budgeted")).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("{left_out} modules unwound without their unwind tables")), "{text}");
    eprintln!("{left_out} of {} executable modules left out under a {} KiB unwind budget ({held} bytes held)", mapped.len(), budget >> 10);
}

/// A client that sends probe's poll User-Agent is not hidden by it: its request is in the report
/// (the head's claim is checked against the socket's owner), while probe's own polls stay out.
#[test]
fn a_client_posing_as_probes_poller_is_still_counted() {
    let _serial = serial();
    let d = scratch("neighbours-poser");
    let (srv, addr) = common::shared_llama_server(&["-c", "1024", "-np", "1", "--no-repack", "--metrics"]);
    let _srv = Killed(srv);
    let out = d.join("rec");
    let (trace, _lines, _) =
        common::start_trace(&["--pid", &_srv.0.id().to_string(), "--duration", "5s", "--out", out.to_str().unwrap(), "--force"]);
    // Probe's poller asks /metrics and /props meanwhile; the poser asks for a completion.
    std::thread::sleep(Duration::from_millis(1500));
    let body = serde_json::json!({"prompt": "Tell me a story", "n_predict": 12});
    let (st, answer) = common::http(addr, "POST", "/completion", Some(&body), &[("User-Agent", "probe-poll/9.9")]).unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&answer));
    let done = trace.wait_with_output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let r = common::read_report(&out);
    let reqs = r["requests"].as_array().cloned().unwrap_or_default();
    assert!(
        reqs.iter().any(|q| q["path"] == "/completion" && q["method"] == "POST"),
        "the poser's request was hidden: {reqs:#?} (probe_polls {})",
        r["probe_polls"]
    );
    assert!(r["probe_polls"].as_u64().unwrap_or(0) >= 1, "probe's own polls were not recognised: {}", r["probe_polls"]);
    assert!(!reqs.iter().any(|q| q["path"] == "/metrics" || q["path"] == "/props"), "probe's own polls were counted: {reqs:#?}");
}
