//! `probe watch --all`: every LLM server on the node, each followed by a `probe watch --pid`
//! of its own (its own probes, warm baseline, incidents and labels; one that fails stays alone).
//!
//! Servers are found by [`super::discover`]; credentials go only to the servers the operator
//! scoped them to ([`super::scope`]). The metrics of all the followers are served as one
//! exposition, each sample labelled with where its server runs (`place`).
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

use super::{
    discover::{Answer, Asker, Listener, scan},
    log_line, metrics,
    scope::{Grant, Scope, Scopes, Server},
};

/// The most servers one agent follows; more are counted (`probe_servers_refused_total`) and
/// left alone, so listeners made to look like servers cannot grow the agent without bound.
pub const MAX_SERVERS: usize = 64;

/// `--all`'s options; `child_args` are the `watch` flags every follower gets as well.
pub struct Options {
    pub dir: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    pub child_args: Vec<String>,
    pub pod_logs: PathBuf,
    pub scan_every: Duration,
    /// The operator's headers (`--api-key`, `--header`), and the servers they go to.
    pub credentials: Vec<(String, String)>,
    pub scopes: Vec<Scope>,
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
    let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // The signals first: once the metrics answer (the readiness probe, a test's scrape), a
    // SIGTERM must stop the agent cleanly, not kill it before its handler is there.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut sigint, mut sigterm) = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?))
    })?;
    if let Some(addr) = o.metrics_addr {
        let (f, n, r) = (followers.clone(), scans.clone(), refused.clone());
        let bound =
            metrics::serve_with(addr, Arc::new(move || render(&f, &n, &r))).with_context(|| format!("cannot serve metrics on {addr}"))?;
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
    let mut scopes = Scopes::new(o.scopes.clone());
    let mut asker = Asker::default();
    // Listeners asked with a definite answer, by (pid, port); failed followers, by pid.
    let mut answered: HashMap<(u32, u16), Answer> = HashMap::new();
    let mut failed: HashMap<u32, Instant> = HashMap::new();
    let mut refused_said = false;
    'scans: loop {
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
        asker.retain(&live);
        for l in &found {
            if !followed.contains(&l.pid) && !failed.contains_key(&l.pid) && !answered.contains_key(&(l.pid, l.addr.port())) {
                asker.start(l);
            }
        }
        // Until the next scan, follow each server as its answer comes.
        let next = Instant::now() + o.scan_every;
        loop {
            for (l, a) in asker.answers() {
                if matches!(a, Answer::Later | Answer::Slow) {
                    continue;
                }
                answered.insert((l.pid, l.addr.port()), a);
                if a == Answer::NotServer || !crate::procfs::exists(l.pid) {
                    continue;
                }
                // One server per process: another of its ports found it already.
                let n = followers.lock().unwrap_or_else(|e| e.into_inner()).len();
                if followers.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&l.pid) {
                    continue;
                }
                if n >= MAX_SERVERS {
                    refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if !std::mem::replace(&mut refused_said, true) {
                        log_line!(
                            "probe watch: already following {MAX_SERVERS} servers, the most one agent follows: pid {} on port {} and any more are left alone (probe_servers_refused_total counts them)",
                            l.pid,
                            l.addr.port()
                        );
                    }
                    continue;
                }
                follow(&o, &exe, &servers_dir, &l, a, &mut scopes, &followers, &mut failed);
            }
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if stopped(left.min(Duration::from_millis(100))) {
                break 'scans;
            }
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

/// Follow a server that answered: its labels, its follower, the credentials if a scope grants
/// them.
#[allow(clippy::too_many_arguments)]
fn follow(
    o: &Options,
    exe: &Path,
    servers_dir: &Path,
    l: &Listener,
    a: Answer,
    scopes: &mut Scopes,
    followers: &Mutex<HashMap<u32, Follower>>,
    failed: &mut HashMap<u32, Instant>,
) {
    let mut labels = super::place::labels(l.pid, &o.pod_logs);
    labels.push(("port".into(), l.addr.port().to_string()));
    let name = key_of(&labels, l.addr.port());
    let grant = if o.credentials.is_empty() { Grant::NotScoped } else { scopes.grant(&Server::of(l.pid, l.addr.port(), &labels)) };
    let credentials = matches!(grant, Grant::Yes(_)).then_some(o.credentials.as_slice());
    match spawn(exe, o, l.pid, &servers_dir.join(&name), &labels, &name, credentials) {
        Ok(f) => {
            let said: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            log_line!(
                "probe watch [{name}]: found a server: pid {} ({}) on port {}; {}",
                l.pid,
                crate::text::terminal(&crate::procfs::comm(l.pid)),
                l.addr.port(),
                crate::text::terminal(&said.join(" "))
            );
            match (&grant, a) {
                (Grant::Yes(scope), _) => log_line!("probe watch [{name}]: sends it the API key and headers ({scope})"),
                (Grant::NotPinned(why), _) => log_line!("probe watch [{name}]: sends it no credentials: {why}"),
                (Grant::NotScoped, Answer::WantsKey) => log_line!(
                    "probe watch [{name}]: it wants an API key and is followed without one (its endpoints unread); give --api-key-for port={} (or container=NAME, exe=PATH) to send it one",
                    l.addr.port()
                ),
                _ => {}
            }
            followers.lock().unwrap_or_else(|e| e.into_inner()).insert(l.pid, f);
        }
        Err(e) => {
            log_line!("probe watch [{name}]: cannot follow pid {}: {e:#}", l.pid);
            failed.insert(l.pid, Instant::now());
        }
    }
}

/// Start `probe watch --pid PID --once` for one server; its log lines are ours, prefixed. The
/// credentials, if any, go through its environment (never its command line, which every user
/// reads), and it dies with the agent (a follower of a killed agent would hold its probes).
fn spawn(
    exe: &Path,
    o: &Options,
    pid: u32,
    dir: &Path,
    labels: &[(String, String)],
    name: &str,
    credentials: Option<&[(String, String)]>,
) -> anyhow::Result<Follower> {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = Command::new(exe);
    cmd.arg("watch").args(&o.child_args);
    cmd.arg("--pid").arg(pid.to_string()).arg("--dir").arg(dir).arg("--once").arg("--metrics-addr").arg("127.0.0.1:0");
    for (k, v) in labels {
        cmd.arg("--label").arg(format!("{k}={v}"));
    }
    cmd.env_remove("PROBE_API_KEY").env_remove("PROBE_HEADERS");
    if let Some(h) = credentials {
        cmd.env("PROBE_HEADERS", crate::httpc::headers_env(h));
    }
    let agent = std::process::id() as i32;
    // SAFETY: only prctl(2), getppid(2) and _exit(2) between fork and exec. The death signal
    // is the forking thread's: this is the agent's main thread, which lives as long as it does.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The agent died before the signal was set: end now.
            if libc::getppid() != agent {
                libc::_exit(0);
            }
            Ok(())
        });
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
fn render(
    followers: &Mutex<HashMap<u32, Follower>>,
    scans: &std::sync::atomic::AtomicU64,
    refused: &std::sync::atomic::AtomicU64,
) -> String {
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
         # HELP probe_servers_refused_total Servers found and not followed: the agent followed its most already.\n# TYPE probe_servers_refused_total counter\n\
         probe_servers_refused_total{{node=\"{node}\"}} {}\n\
         # HELP probe_agent_cpu_seconds_total CPU time of the node agent itself (its followers count their own).\n# TYPE probe_agent_cpu_seconds_total counter\n\
         probe_agent_cpu_seconds_total{{node=\"{node}\"}} {}\n",
        addrs.len(),
        scans.load(std::sync::atomic::Ordering::Relaxed),
        refused.load(std::sync::atomic::Ordering::Relaxed),
        crate::collector::own_cpu_ns() as f64 / 1e9
    )];
    for a in addrs {
        let deadline = Instant::now() + Duration::from_secs(2);
        if let Ok((200, body)) =
            crate::httpc::get_anonymous(&crate::httpc::Url::of(a), "/metrics", Duration::from_secs(2), deadline, 16 << 20)
        {
            texts.push(String::from_utf8_lossy(&body).into_owned());
        }
    }
    metrics::merge(&texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_file_names() {
        let l = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
        assert_eq!(key_of(&l(&[("node", "n"), ("namespace", "llm"), ("pod", "llama-0")]), 8080), "llm_llama-0-port8080");
        assert_eq!(key_of(&l(&[("container", "../x y")]), 1), ".._x_y-port1");
        assert_eq!(key_of(&l(&[]), 11434), "host-port11434");
    }
}
