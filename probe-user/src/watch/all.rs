//! `probe watch --all`: every LLM server on the node, each followed by a `probe watch --pid`
//! of its own (its own probes, warm baseline, incidents and labels; one that fails stays alone).
//!
//! Servers are found by what they do, never by a name: every few seconds the listening TCP
//! sockets of every network namespace are read (one /proc/PID/net/tcp{,6} per namespace), and
//! each new one is asked once, from inside its namespace, for `/v1/models` (OpenAI-style servers:
//! llama.cpp, vLLM, Ollama, LM Studio, llama-cpp-python) and `/api/tags` (Ollama). A model list,
//! or a 401/403 (an API key), is a server; anything else is not, and is not asked again. A
//! server still loading (503) or not yet accepting is asked again at the next scan. The
//! metrics of all the followers are served as one exposition, each sample labelled with where
//! its server runs (`place`).
use std::{
    collections::{HashMap, HashSet},
    io::BufRead as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::{log_line, metrics};

/// `--all`'s options; `child_args` are the `watch` flags every follower gets as well.
pub struct Options {
    pub dir: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    pub child_args: Vec<String>,
    pub pod_logs: PathBuf,
    pub scan_every: Duration,
}

/// A listening socket found in a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    pub pid: u32,
    pub addr: SocketAddr,
    pub netns: Option<u64>,
}

/// What asking a listener said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Server,
    NotServer,
    /// Not now (refused, loading): ask again at the next scan.
    Later,
}

/// (local address, inode) of every LISTEN socket in /proc/net/tcp{,6} text.
pub fn parse_listeners(text: &str) -> Vec<(SocketAddr, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if *f.get(3)? != "0A" {
                return None;
            }
            let addr = crate::procfs::parse_listen_addrs(&format!("h\n{l}\n"), &HashSet::from([f.get(9)?.parse().ok()?])).pop()?;
            Some((addr, f.get(9)?.parse().ok()?))
        })
        .collect()
}

/// Every listening TCP socket on the node with the process that owns it (the topmost of its
/// owners). `owners` caches inode → pid across scans, so a scan reads file descriptors only
/// for sockets it has not seen before.
pub fn scan(owners: &mut HashMap<u64, Option<u32>>, skip: &HashSet<u32>, closed: &mut HashMap<Option<u64>, Instant>) -> Vec<Listener> {
    let mut by_ns: HashMap<Option<u64>, Vec<u32>> = HashMap::new();
    for p in crate::procfs::all_pids() {
        if !skip.contains(&p) {
            by_ns.entry(crate::procfs::netns(p)).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let ours = crate::procfs::netns(crate::procfs::self_pid());
    for (ns, members) in &by_ns {
        // A namespace probe could not enter is tried again a minute later.
        if closed.get(ns).is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            continue;
        }
        let Some(socks) = listeners_in(*ns == ours, members[0]) else {
            if closed.insert(*ns, Instant::now()).is_none() {
                log_line!(
                    "probe watch: cannot enter the network namespace of pid {} (another user namespace?): its servers are not looked for",
                    members[0]
                );
            }
            continue;
        };
        let new: HashSet<u64> = socks.iter().map(|s| s.1).filter(|i| !owners.contains_key(i)).collect();
        if !new.is_empty() {
            let mut found: HashMap<u64, Vec<u32>> = HashMap::new();
            for &p in members {
                for i in crate::procfs::socket_inodes(p).intersection(&new) {
                    found.entry(*i).or_default().push(p);
                }
            }
            // A socket no process was found for (ours, one that closed meanwhile) is
            // remembered too: a scan reads file descriptors only for sockets new to it.
            for i in new {
                owners.insert(i, found.get(&i).and_then(|p| crate::procfs::topmost(p)));
            }
        }
        for (addr, inode) in socks {
            seen.insert(inode);
            if let Some(&Some(pid)) = owners.get(&inode).filter(|p| p.is_some_and(|p| !skip.contains(&p))) {
                out.push(Listener { pid, addr, netns: *ns });
            }
        }
    }
    owners.retain(|i, _| seen.contains(i));
    out
}

/// The listening sockets of `member`'s network namespace: the kernel's sock_diag dump of LISTEN
/// sockets (from a thread moved into that namespace), which costs what the listeners cost;
/// /proc/PID/net/tcp{,6} walks every socket of the namespace (a busy server's thousands of
/// connections, every scan), so it is only the fallback.
fn listeners_in(ours: bool, member: u32) -> Option<Vec<(SocketAddr, u64)>> {
    let dump = move || {
        if !ours {
            let ns = std::fs::File::open(format!("/proc/{member}/ns/net")).ok()?;
            crate::procfs::enter_netns(&ns).ok()?;
        }
        crate::procfs::tcp_listeners()
    };
    let got = if ours {
        dump()
    } else {
        std::thread::Builder::new().name("probe-scan".into()).spawn(dump).ok().and_then(|t| t.join().ok()).flatten()
    };
    if got.is_none() && !ours {
        // A namespace probe cannot enter (another user namespace): its servers could not be
        // asked either.
        return None;
    }
    Some(got.unwrap_or_else(|| {
        let text: String = ["tcp", "tcp6"].iter().filter_map(|f| std::fs::read_to_string(format!("/proc/{member}/net/{f}")).ok()).collect();
        parse_listeners(&text)
    }))
}

/// Ask a listener, from inside its network namespace, whether it serves models.
pub fn ask(l: &Listener) -> Answer {
    let l = l.clone();
    let ours = crate::procfs::netns(crate::procfs::self_pid());
    let run = move || {
        if l.netns != ours {
            let Ok(ns) = std::fs::File::open(format!("/proc/{}/ns/net", l.pid)) else { return Answer::Later };
            if crate::procfs::enter_netns(&ns).is_err() {
                return Answer::Later;
            }
        }
        let ip: std::net::IpAddr = match l.addr.ip() {
            ip if !ip.is_unspecified() => ip,
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        };
        let url = crate::httpc::Url::of(SocketAddr::new(ip, l.addr.port()));
        let mut later = false;
        for (path, key) in [("/v1/models", "data"), ("/api/tags", "models")] {
            match crate::httpc::request(&url, "GET", path, None, Duration::from_secs(1)) {
                Ok((401 | 403, _)) => return Answer::Server,
                Ok((200, body)) => {
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    if v[key].is_array() {
                        return Answer::Server;
                    }
                }
                Ok((503, _)) => later = true,
                Ok(_) => {}
                Err(e) if e.contains("refused") => later = true,
                Err(_) => {}
            }
        }
        if later { Answer::Later } else { Answer::NotServer }
    };
    // A thread of its own: setns moves only the calling thread.
    std::thread::Builder::new().name("probe-ask".into()).spawn(run).ok().and_then(|t| t.join().ok()).unwrap_or(Answer::Later)
}

/// One server's follower.
struct Follower {
    child: Child,
    key: String,
    metrics: Arc<Mutex<Option<SocketAddr>>>,
}

/// A directory name from label values: letters, digits, `.`, `_`, `-`.
fn key_of(labels: &[(String, String)], port: u16) -> String {
    let get = |k: &str| labels.iter().find(|l| l.0 == k).map(|l| l.1.as_str());
    let what = match (get(super::place::NAMESPACE), get(super::place::POD), get(super::place::CONTAINER), get(super::place::CONTAINER_ID)) {
        (Some(ns), Some(pod), ..) => format!("{ns}_{pod}"),
        (.., Some(c), _) => c.to_string(),
        (.., Some(id)) => id.chars().take(12).collect(),
        _ => "host".into(),
    };
    let raw = format!("{what}-port{port}");
    raw.chars().map(|c| if c.is_ascii_alphanumeric() || ".-_".contains(c) { c } else { '_' }).take(120).collect()
}

/// Run until SIGINT/SIGTERM. Returns the exit code.
pub fn run(o: Options) -> anyhow::Result<i32> {
    crate::probes::check_privileges()?;
    let state = crate::output::OutDir::create_or_open(&o.dir)?;
    drop(state);
    let servers_dir = o.dir.join("servers");
    crate::output::OutDir::create_or_open(&servers_dir)?;
    let followers: Arc<Mutex<HashMap<u32, Follower>>> = Arc::new(Mutex::new(HashMap::new()));
    let scans = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // The signals first: once the metrics answer (the readiness probe, a test's scrape), a
    // SIGTERM must stop the agent cleanly, not kill it before its handler is there.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut sigint, mut sigterm) = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?))
    })?;
    if let Some(addr) = o.metrics_addr {
        let (f, n) = (followers.clone(), scans.clone());
        let bound =
            metrics::serve_with(addr, Arc::new(move || render(&f, &n))).with_context(|| format!("cannot serve metrics on {addr}"))?;
        log_line!("probe watch: metrics on http://{bound}/metrics");
    }
    let exe = std::env::current_exe().context("cannot find probe's own executable to start a follower")?;
    let mut stopped = |d: Duration| {
        rt.block_on(async {
            tokio::select! {
                _ = sigint.recv() => true,
                _ = sigterm.recv() => true,
                _ = tokio::time::sleep(d) => false,
            }
        })
    };
    log_line!("probe watch: looking for LLM servers on this node (every {} s)", o.scan_every.as_secs_f64());
    let me = crate::procfs::self_pid();
    let mut owners = HashMap::new();
    let mut closed = HashMap::new();
    // Listeners asked with a definite answer, by (pid, port); failed followers, by pid.
    let mut answered: HashMap<(u32, u16), Answer> = HashMap::new();
    let mut failed: HashMap<u32, Instant> = HashMap::new();
    loop {
        scans.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Followers that ended (their server exited, or it could not be traced).
        {
            let mut f = followers.lock().unwrap_or_else(|e| e.into_inner());
            let ended: Vec<u32> = f.iter_mut().filter_map(|(p, x)| x.child.try_wait().ok().flatten().map(|_| *p)).collect();
            for p in ended {
                if let Some(x) = f.remove(&p) {
                    log_line!("probe watch [{}]: follower ended; its incidents stay in {}", x.key, servers_dir.join(&x.key).display());
                    if crate::procfs::exists(p) {
                        failed.insert(p, Instant::now());
                    }
                }
            }
        }
        let mut skip: HashSet<u32> = HashSet::from([me]);
        let followed: HashSet<u32> = followers.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        for p in followers.lock().unwrap_or_else(|e| e.into_inner()).values().map(|x| x.child.id()) {
            skip.insert(p);
            skip.extend(crate::procfs::descendants(p));
        }
        failed.retain(|p, t| t.elapsed() < Duration::from_secs(30) && crate::procfs::exists(*p));
        let found = scan(&mut owners, &skip, &mut closed);
        let live: HashSet<(u32, u16)> = found.iter().map(|l| (l.pid, l.addr.port())).collect();
        answered.retain(|k, _| live.contains(k));
        for l in &found {
            let key = (l.pid, l.addr.port());
            if followed.contains(&l.pid) || failed.contains_key(&l.pid) || answered.contains_key(&key) {
                continue;
            }
            // One server per process: another of its ports found it already this scan.
            if followers.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&l.pid) {
                continue;
            }
            match ask(l) {
                Answer::Later => continue,
                a => {
                    answered.insert(key, a);
                    if a == Answer::NotServer {
                        continue;
                    }
                }
            }
            let mut labels = super::place::labels(l.pid, &o.pod_logs);
            labels.push(("port".into(), l.addr.port().to_string()));
            let name = key_of(&labels, l.addr.port());
            match spawn(&exe, &o, l.pid, &servers_dir.join(&name), &labels, &name) {
                Ok(f) => {
                    let said: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    log_line!(
                        "probe watch [{name}]: found a server: pid {} ({}) on port {}; {}",
                        l.pid,
                        crate::text::terminal(&crate::procfs::comm(l.pid)),
                        l.addr.port(),
                        crate::text::terminal(&said.join(" "))
                    );
                    followers.lock().unwrap_or_else(|e| e.into_inner()).insert(l.pid, f);
                }
                Err(e) => {
                    log_line!("probe watch [{name}]: cannot follow pid {}: {e:#}", l.pid);
                    failed.insert(l.pid, Instant::now());
                }
            }
        }
        if stopped(o.scan_every) {
            break;
        }
    }
    log_line!("probe watch: stopping the followers");
    let mut all: Vec<Follower> = followers.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, f)| f).collect();
    for f in &all {
        // SAFETY: kill(2) on a child of ours that has not been reaped.
        unsafe { libc::kill(f.child.id() as i32, libc::SIGTERM) };
    }
    let until = Instant::now() + Duration::from_secs(10);
    for f in &mut all {
        while f.child.try_wait().ok().flatten().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        if f.child.try_wait().ok().flatten().is_none() {
            let _ = f.child.kill();
            let _ = f.child.wait();
        }
    }
    Ok(crate::exit::OK)
}

/// Start `probe watch --pid PID --once` for one server; its log lines are ours, prefixed.
fn spawn(exe: &Path, o: &Options, pid: u32, dir: &Path, labels: &[(String, String)], name: &str) -> anyhow::Result<Follower> {
    let mut cmd = Command::new(exe);
    cmd.arg("watch").args(&o.child_args);
    cmd.arg("--pid").arg(pid.to_string()).arg("--dir").arg(dir).arg("--once").arg("--metrics-addr").arg("127.0.0.1:0");
    for (k, v) in labels {
        cmd.arg("--label").arg(format!("{k}={v}"));
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().context("cannot start a follower")?;
    let err = child.stderr.take().context("no stderr from the follower")?;
    let metrics = Arc::new(Mutex::new(None));
    let (m, key) = (metrics.clone(), name.to_string());
    std::thread::Builder::new().name("probe-follower-log".into()).spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(a) = line.split("metrics on http://").nth(1).and_then(|r| r.split('/').next()).and_then(|a| a.parse().ok()) {
                *m.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
                continue;
            }
            let line = line.strip_prefix("probe watch: ").unwrap_or(&line);
            log_line!("probe watch [{key}]: {line}");
        }
    })?;
    Ok(Follower { child, key: name.to_string(), metrics })
}

/// The followers' metrics as one exposition, and the node agent's own.
fn render(followers: &Mutex<HashMap<u32, Follower>>, scans: &std::sync::atomic::AtomicU64) -> String {
    let addrs: Vec<SocketAddr> = followers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .filter_map(|f| *f.metrics.lock().unwrap_or_else(|e| e.into_inner()))
        .collect();
    let node = metrics::escape(&super::place::node());
    let mut texts = vec![format!(
        "# HELP probe_servers LLM servers probe follows on this node.\n# TYPE probe_servers gauge\nprobe_servers{{node=\"{node}\"}} {}\n\
         # HELP probe_discovery_scans_total Scans of the node's listening sockets for LLM servers.\n# TYPE probe_discovery_scans_total counter\n\
         probe_discovery_scans_total{{node=\"{node}\"}} {}\n\
         # HELP probe_agent_cpu_seconds_total CPU time of the node agent itself (its followers count their own).\n# TYPE probe_agent_cpu_seconds_total counter\n\
         probe_agent_cpu_seconds_total{{node=\"{node}\"}} {}\n",
        addrs.len(),
        scans.load(std::sync::atomic::Ordering::Relaxed),
        crate::collector::own_cpu_ns() as f64 / 1e9
    )];
    for a in addrs {
        if let Ok((200, body)) = crate::httpc::request(&crate::httpc::Url::of(a), "GET", "/metrics", None, Duration::from_secs(2)) {
            texts.push(String::from_utf8_lossy(&body).into_owned());
        }
    }
    metrics::merge(&texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_of_both_families() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n\
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 100 0 0 10 0\n\
   0: 00000000000000000000000000000000:2382 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1 0\n";
        let l = parse_listeners(text);
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(l[0], ("127.0.0.1:8080".parse().unwrap(), 4242));
        assert_eq!(l[1].0.port(), 9090);
    }

    #[test]
    fn keys_are_file_names() {
        let l = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
        assert_eq!(key_of(&l(&[("node", "n"), ("namespace", "llm"), ("pod", "llama-0")]), 8080), "llm_llama-0-port8080");
        assert_eq!(key_of(&l(&[("container", "../x y")]), 1), ".._x_y-port1");
        assert_eq!(key_of(&l(&[]), 11434), "host-port11434");
    }
}
