//! `probe watch --all`: every LLM server on the node, each followed as a `probe watch --pid`
//! would (its own window, warm baseline, incidents and labels) on a thread of the agent's, all on
//! one set of kernel programs ([`crate::collector::hub`]): the programs are loaded with the first
//! server and each later one joins the target set, so the kernel's cost does not grow with the
//! number of servers, only with their work.
//!
//! Servers are found by [`super::discover`]; credentials go only to the servers the operator
//! scoped them to ([`super::scope`]). The metrics of all the servers are served as one
//! exposition, each sample labelled with where its server runs (`place`).
use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
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

/// `--all`'s options; `server` holds the `watch` flags every server is followed with.
pub struct Options {
    pub dir: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    pub server: super::Options,
    pub pod_logs: PathBuf,
    pub scan_every: Duration,
    /// The operator's headers (`--api-key`, `--header`), and the servers they go to.
    pub credentials: Vec<(String, String)>,
    pub scopes: Vec<Scope>,
}

/// One server, followed on a thread of the agent's.
struct Follower {
    thread: std::thread::JoinHandle<()>,
    key: String,
    metrics: Arc<super::metrics::Metrics>,
    stop: Arc<AtomicBool>,
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
    crate::kernel::probes::check_privileges()?;
    let state = crate::util::output::OutDir::create_or_open(&o.dir)?;
    drop(state);
    let servers_dir = o.dir.join("servers");
    crate::util::output::OutDir::create_or_open(&servers_dir)?;
    let metrics_addr = o.metrics_addr;
    let scan_every = o.scan_every;
    let mut agent = Agent::new(o, servers_dir);
    // The signals first: once the metrics answer (the readiness probe, a test's scrape), a
    // SIGTERM must stop the agent cleanly, not kill it before its handler is there.
    let mut signals = super::Signals::listen(None)?;
    if let Some(addr) = metrics_addr {
        let (f, n, r, k) = (agent.followers.clone(), agent.scans.clone(), agent.refused.clone(), agent.node.clone());
        let bound = metrics::serve_with(addr, Arc::new(move || render(&f, &n, &r, &k)))
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
        log_line!("probe watch: metrics on http://{bound}/metrics");
    }
    log_line!("probe watch: looking for LLM servers on this node (every {} s)", scan_every.as_secs_f64());
    'scans: loop {
        agent.scans.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        agent.reap();
        agent.scan();
        // Until the next scan, follow each server as its answer comes.
        let next = Instant::now() + scan_every;
        loop {
            agent.follow_answers();
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if signals.stopped(left.min(Duration::from_millis(100))) {
                break 'scans;
            }
        }
    }
    log_line!("probe watch: stopping");
    agent.stop_all();
    Ok(crate::exit::OK)
}

/// The node agent's state between scans: the servers it follows, the listeners it asked, and
/// what its metrics count.
struct Agent {
    o: Options,
    servers_dir: PathBuf,
    followers: Arc<Mutex<HashMap<u32, Follower>>>,
    scans: Arc<std::sync::atomic::AtomicU64>,
    refused: Arc<std::sync::atomic::AtomicU64>,
    node: Arc<crate::collector::hub::Node>,
    me: u32,
    owners: HashMap<u64, Option<u32>>,
    closed: HashMap<Option<u64>, Instant>,
    scopes: Scopes,
    asker: Asker,
    /// Listeners asked with a definite answer, by (pid, port).
    answered: HashMap<(u32, u16), Answer>,
    /// Failed followers, by pid.
    failed: HashMap<u32, Instant>,
    refused_said: bool,
}

impl Agent {
    fn new(o: Options, servers_dir: PathBuf) -> Agent {
        let scopes = Scopes::new(o.scopes.clone());
        Agent {
            o,
            servers_dir,
            followers: Arc::new(Mutex::new(HashMap::new())),
            scans: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            refused: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            node: Arc::new(crate::collector::hub::Node::default()),
            me: crate::os::procfs::self_pid(),
            owners: HashMap::new(),
            closed: HashMap::new(),
            scopes,
            asker: Asker::default(),
            answered: HashMap::new(),
            failed: HashMap::new(),
            refused_said: false,
        }
    }

    /// Servers whose following ended (they exited, or could not be traced).
    fn reap(&mut self) {
        let mut f = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        let ended: Vec<u32> = f.iter().filter(|(_, x)| x.thread.is_finished()).map(|(p, _)| *p).collect();
        for p in ended {
            if let Some(x) = f.remove(&p) {
                let _ = x.thread.join();
                log_line!("probe watch [{}]: no longer followed; its incidents stay in {}", x.key, self.servers_dir.join(&x.key).display());
                if crate::os::procfs::exists(p) {
                    self.failed.insert(p, Instant::now());
                }
            }
        }
    }

    /// Scan the node's listeners and ask those not followed, not failed and not answered yet
    /// whether they are LLM servers.
    fn scan(&mut self) {
        // No server left on the programs: they go until the next one comes.
        self.node.release_idle();
        let skip: HashSet<u32> = HashSet::from([self.me]);
        let followed: HashSet<u32> = self.followers.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        self.failed.retain(|p, t| t.elapsed() < Duration::from_secs(30) && crate::os::procfs::exists(*p));
        let found = scan(&mut self.owners, &skip, &mut self.closed);
        let live: HashSet<(u32, u16)> = found.iter().map(|l| (l.pid, l.addr.port())).collect();
        self.answered.retain(|k, _| live.contains(k));
        self.asker.retain(&live);
        for l in &found {
            if !followed.contains(&l.pid) && !self.failed.contains_key(&l.pid) && !self.answered.contains_key(&(l.pid, l.addr.port())) {
                self.asker.start(l);
            }
        }
    }

    /// Follow each listener that answered it is a server (up to [`MAX_SERVERS`]).
    fn follow_answers(&mut self) {
        for (l, a) in self.asker.answers() {
            if matches!(a, Answer::Later | Answer::Slow) {
                continue;
            }
            self.answered.insert((l.pid, l.addr.port()), a);
            if a == Answer::NotServer || !crate::os::procfs::exists(l.pid) {
                continue;
            }
            // One server per process: another of its ports found it already.
            let n = self.followers.lock().unwrap_or_else(|e| e.into_inner()).len();
            if self.followers.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&l.pid) {
                continue;
            }
            if n >= MAX_SERVERS {
                self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !std::mem::replace(&mut self.refused_said, true) {
                    log_line!(
                        "probe watch: already following {MAX_SERVERS} servers, the most one agent follows: pid {} on port {} and any more are left alone (probe_servers_refused_total counts them)",
                        l.pid,
                        l.addr.port()
                    );
                }
                continue;
            }
            follow(&self.o, &self.node, &self.servers_dir, &l, a, &mut self.scopes, &self.followers, &mut self.failed);
        }
    }

    /// Stop every follower and wait for them.
    fn stop_all(&self) {
        let all: Vec<Follower> = self.followers.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, f)| f).collect();
        for f in &all {
            f.stop.store(true, Ordering::Relaxed);
        }
        // Each server's session ends its window and hands it over; one that does not within 10 s is
        // left (the process exits, and the programs with it).
        let until = Instant::now() + Duration::from_secs(10);
        for f in all {
            while !f.thread.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            if f.thread.is_finished() {
                let _ = f.thread.join();
            }
        }
    }
}

/// Follow a server that answered: its labels, its follower, the credentials if a scope grants
/// them.
#[allow(clippy::too_many_arguments)]
fn follow(
    o: &Options,
    node: &Arc<crate::collector::hub::Node>,
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
    match start(o, node, l.pid, &servers_dir.join(&name), &labels, &name, credentials) {
        Ok(f) => {
            let said: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            log_line!(
                "probe watch [{name}]: found a server: pid {} ({}) on port {}; {}",
                l.pid,
                crate::util::text::terminal(&crate::os::procfs::comm(l.pid)),
                l.addr.port(),
                crate::util::text::terminal(&said.join(" "))
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

/// Follow one server as `probe watch --pid PID --once` would, on a thread of its own, its
/// kernel side a member of the node's programs. The credentials, if any, go to its endpoint polls
/// only (never a command line, an environment or another server's polls).
fn start(
    o: &Options,
    node: &Arc<crate::collector::hub::Node>,
    pid: u32,
    dir: &Path,
    labels: &[(String, String)],
    name: &str,
    credentials: Option<&[(String, String)]>,
) -> anyhow::Result<Follower> {
    let metrics = Arc::new(super::metrics::Metrics::default());
    metrics.set_shared_process();
    let stop = Arc::new(AtomicBool::new(false));
    let mut opts = o.server.clone();
    opts.select = super::target::Select::Pid(pid);
    opts.dir = dir.to_path_buf();
    opts.metrics_addr = None;
    opts.once = true;
    opts.labels = labels.to_vec();
    opts.member = Some(super::Member {
        node: node.clone(),
        metrics: metrics.clone(),
        stop: stop.clone(),
        headers: credentials.map(<[_]>::to_vec).unwrap_or_default(),
        key: name.to_string(),
    });
    let key = name.to_string();
    let thread = std::thread::Builder::new().name("probe-server".into()).spawn(move || {
        crate::util::text::set_log_key(Some(key));
        if let Err(e) = super::run(opts) {
            log_line!("probe watch: {}", crate::util::text::terminal(&format!("{e:#}")));
        }
    })?;
    Ok(Follower { thread, key: name.to_string(), metrics, stop })
}

/// The servers' metrics as one exposition, and the node agent's own.
fn render(
    followers: &Mutex<HashMap<u32, Follower>>,
    scans: &std::sync::atomic::AtomicU64,
    refused: &std::sync::atomic::AtomicU64,
    node: &crate::collector::hub::Node,
) -> String {
    let servers: Vec<Arc<super::metrics::Metrics>> =
        followers.lock().unwrap_or_else(|e| e.into_inner()).values().map(|f| f.metrics.clone()).collect();
    let hub = node.hub();
    let bpf_ns: u64 = hub.as_ref().map_or(0, |h| h.runs().values().map(|r| r.run_ns).sum());
    let unrouted = hub.as_ref().map_or(0, |h| h.unrouted());
    let node = metrics::escape(&super::place::node());
    let mut texts = vec![format!(
        "# HELP probe_servers LLM servers probe follows on this node.\n# TYPE probe_servers gauge\nprobe_servers{{node=\"{node}\"}} {}\n\
         # HELP probe_discovery_scans_total Scans of the node's listening sockets for LLM servers.\n# TYPE probe_discovery_scans_total counter\n\
         probe_discovery_scans_total{{node=\"{node}\"}} {}\n\
         # HELP probe_servers_refused_total Servers found and not followed: the agent followed its most already.\n# TYPE probe_servers_refused_total counter\n\
         probe_servers_refused_total{{node=\"{node}\"}} {}\n\
         # HELP probe_agent_cpu_seconds_total CPU time of the node agent, every server's following included.\n# TYPE probe_agent_cpu_seconds_total counter\n\
         probe_agent_cpu_seconds_total{{node=\"{node}\"}} {}\n\
         # HELP probe_bpf_run_seconds_total Run time of probe's BPF programs in the kernel (one set for every server on the node), seconds.\n# TYPE probe_bpf_run_seconds_total counter\n\
         probe_bpf_run_seconds_total{{node=\"{node}\"}} {}\n\
         # HELP probe_events_unrouted_total Kernel records of no followed server (a process or socket that had just left).\n# TYPE probe_events_unrouted_total counter\n\
         probe_events_unrouted_total{{node=\"{node}\"}} {}\n",
        servers.len(),
        scans.load(std::sync::atomic::Ordering::Relaxed),
        refused.load(std::sync::atomic::Ordering::Relaxed),
        crate::collector::own_cpu_ns() as f64 / 1e9,
        bpf_ns as f64 / 1e9,
        unrouted,
    )];
    texts.extend(servers.iter().map(|m| m.render()));
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
