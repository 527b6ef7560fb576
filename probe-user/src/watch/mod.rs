//! `probe watch`: the flight recorder left on. It finds its target (by pid, listening port or
//! executable name), traces it with the collector writing a window of segment files, follows
//! the server across restarts, analyses requests as they complete, saves an incident directory
//! (recording, report.json, report.html, bundle) for a slow or abnormal request or a server
//! exit, and serves Prometheus metrics.
//!
//! Threads: the main thread runs one trace session after another (`collector::trace`, which
//! owns the probes and signals); the [`incident::Watcher`] thread takes what a session sends
//! through its [`Link`] (finished requests, closed segments, the end) and does the analysis and
//! the writing; the metrics thread answers scrapes from [`metrics::Metrics`].
pub mod all;
pub mod baseline;
pub mod discover;
pub mod fleet;
pub mod incident;
pub mod metrics;
pub mod place;
pub mod scope;
pub mod target;

use std::{
    path::PathBuf,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use anyhow::Context as _;

pub use crate::collector::segments::{Link, Msg, Rotation, Segment, segment_name};

/// `probe watch`'s options (see main.rs for their flags).
#[derive(Clone)]
pub struct Options {
    pub select: target::Select,
    /// Where incidents and the live window go (0700, the caller's).
    pub dir: PathBuf,
    pub window: Duration,
    /// The most bytes the live window keeps on disk.
    pub window_bytes: u64,
    pub slow_ttft: SlowTtft,
    /// The most bytes incident directories keep; the oldest go first.
    pub keep: u64,
    /// The least time between two incidents of the same cause.
    pub incident_gap: Duration,
    pub metrics_addr: Option<std::net::SocketAddr>,
    pub segment: Duration,
    /// Per-thread on-CPU stack rate (lower than `trace`'s: the cost of staying on).
    pub hz: u64,
    pub host_hz: f64,
    pub ring_bytes: u32,
    pub poll: bool,
    pub offcpu_d_only: bool,
    pub started: Instant,
    /// Send each analysed request as an OpenTelemetry span here (`--otlp`).
    pub otlp: Option<crate::render::export::otlp::Endpoint>,
    /// Labels on every metric, incident and span (`place::labels` under `--all`).
    pub labels: Vec<(String, String)>,
    /// Stop when the target exits instead of waiting for its successor (`--all` finds it).
    pub once: bool,
    /// `--all`: this server is one of the node's, followed on a thread of the agent's (see
    /// [`Member`]); None for a `probe watch` of its own.
    pub member: Option<Member>,
}

/// What a server followed by the node agent shares with it: the one set of kernel programs,
/// its metrics (rendered in the agent's exposition), its credentials and a stop.
#[derive(Clone)]
pub struct Member {
    pub node: Arc<crate::collector::hub::Node>,
    pub metrics: Arc<metrics::Metrics>,
    pub stop: Arc<std::sync::atomic::AtomicBool>,
    /// The headers scoped to this server (none: `vec![]`).
    pub headers: Vec<(String, String)>,
    /// Its name in the agent's log and directories.
    pub key: String,
}

/// `--slow-ttft`: an absolute time, or a multiple of the recent median.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SlowTtft {
    Over(Duration),
    TimesMedian(f64),
}

/// Until this many requests were seen, a `Nx` rule uses [`FALLBACK_SLOW`].
pub const MEDIAN_MIN: usize = 10;
pub const FALLBACK_SLOW: Duration = Duration::from_secs(2);

impl SlowTtft {
    pub fn parse(s: &str) -> Result<SlowTtft, String> {
        let t = s.trim();
        if let Some(n) = t.strip_suffix('x').or_else(|| t.strip_suffix('X')) {
            let n: f64 = n.trim().parse().map_err(|_| format!("`{s}`: give a time (2s, 500ms) or a multiple of the median (4x)"))?;
            if !n.is_finite() || n <= 1.0 || n > 1000.0 {
                return Err(format!("`{s}`: a multiple of the median must be above 1 and at most 1000 (e.g. 4x)"));
            }
            return Ok(SlowTtft::TimesMedian(n));
        }
        let d = crate::parse_duration_or(t, Duration::from_secs(1))
            .map_err(|_| format!("`{s}` is not a slow-TTFT threshold: give a time (2s, 500ms) or a multiple of the median (4x)"))?;
        if d.is_zero() {
            return Err("a slow-TTFT threshold of 0 makes every request an incident: give e.g. 2s or 4x".into());
        }
        Ok(SlowTtft::Over(d))
    }

    /// The threshold in ms, given the recent TTFTs' median (None while fewer than [`MEDIAN_MIN`]).
    pub fn threshold_ms(self, median_ms: Option<f64>) -> f64 {
        match (self, median_ms) {
            (SlowTtft::Over(d), _) => d.as_secs_f64() * 1e3,
            (SlowTtft::TimesMedian(n), Some(m)) => n * m,
            (SlowTtft::TimesMedian(_), None) => FALLBACK_SLOW.as_secs_f64() * 1e3,
        }
    }
}

/// A line in the log: one per event, no status line (journald keeps them as they are).
macro_rules! log_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "{}", $crate::util::text::log_line(format_args!($($t)*)));
    }};
}
pub(crate) use log_line;

/// Wait this long between looks for a target that is not there (yet, or again).
const FIND_EVERY: Duration = Duration::from_secs(1);

/// SIGINT and SIGTERM, listened for from the start: a trace session sees them itself and ends
/// with them, and between sessions the waits here do. Listening from the start also keeps the
/// default action (death) away for good. A server of the node agent's also stops on the agent's
/// flag.
pub(crate) struct Signals {
    rt: tokio::runtime::Runtime,
    sigint: tokio::signal::unix::Signal,
    sigterm: tokio::signal::unix::Signal,
    stop: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl Signals {
    pub(crate) fn listen(stop: Option<Arc<std::sync::atomic::AtomicBool>>) -> anyhow::Result<Signals> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (sigint, sigterm) = rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            Ok::<_, std::io::Error>((signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?))
        })?;
        Ok(Signals { rt, sigint, sigterm, stop })
    }

    /// Wait `d`, or less if told to stop: whether told to stop.
    pub(crate) fn stopped(&mut self, d: Duration) -> bool {
        if self.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
            return true;
        }
        let Signals { rt, sigint, sigterm, .. } = self;
        rt.block_on(async {
            tokio::select! {
                _ = sigint.recv() => true,
                _ = sigterm.recv() => true,
                _ = tokio::time::sleep(d) => false,
            }
        })
    }
}

/// Run until SIGINT/SIGTERM. Returns the exit code.
pub fn run(o: Options) -> anyhow::Result<i32> {
    // Said once, now, rather than at every attempt to attach.
    crate::kernel::probes::check_privileges()?;
    let state = crate::util::output::OutDir::create_or_open(&o.dir)?;
    drop(state);
    let incidents = o.dir.join("incidents");
    crate::util::output::OutDir::create_or_open(&incidents)?;
    let metrics = start_metrics(&o)?;
    let mut signals = Signals::listen(o.member.as_ref().map(|m| m.stop.clone()))?;
    let otlp = o.otlp.clone().map(|e| Arc::new(crate::render::export::otlp::Sender::start(e)));
    if let Some(s) = &otlp {
        metrics.set_otlp(s.sent.clone(), s.dropped.clone());
    }
    let mut follow = target::Following::new(o.select.clone());
    let mut waiting_said = false;
    let mut sessions = 0u64;
    loop {
        let Some(pid) = follow.find() else {
            if !waiting_said {
                log_line!("probe watch: waiting for {}", follow.describe());
                waiting_said = true;
            }
            metrics.set_target(None);
            if signals.stopped(FIND_EVERY) {
                log_line!("probe watch: stopped while waiting");
                break;
            }
            continue;
        };
        waiting_said = false;
        if sessions > 0 {
            metrics.restarted();
        }
        sessions += 1;
        metrics.set_target(Some(pid));
        let started = if sessions == 1 { o.started } else { Instant::now() };
        let session = Session { o: &o, pid, incidents: &incidents, metrics: &metrics, otlp: &otlp, started };
        match session.run(&follow.describe())? {
            Ok(out) if out.target_exited && o.once => {
                log_line!("probe watch: pid {pid} exited");
                break;
            }
            Ok(out) if out.target_exited => {
                log_line!("probe watch: pid {pid} exited; looking for its successor");
                follow.exited(pid);
            }
            Ok(out) => {
                log_line!("probe watch: stopped: {}", out.reason);
                break;
            }
            Err(e) => {
                // The target went away while probe attached, or it cannot be traced: say so
                // and look again (a crash loop is slowed by FIND_EVERY).
                log_line!("probe watch: cannot trace pid {pid}: {}", crate::util::text::terminal(&format!("{e:#}")));
                follow.exited(pid);
                if o.once {
                    break;
                }
                if signals.stopped(FIND_EVERY) {
                    break;
                }
            }
        }
    }
    if let Some(otlp) = &otlp {
        let dropped = otlp.finish(Duration::from_secs(5));
        if dropped > 0 {
            log_line!("probe watch: {dropped} request spans and incident logs were not sent to the OTLP collector");
        }
    }
    Ok(crate::exit::OK)
}

/// The metrics this watch counts in (the node agent's share of them for one of its servers),
/// labelled, and served on `--metrics-addr` if given.
fn start_metrics(o: &Options) -> anyhow::Result<Arc<metrics::Metrics>> {
    let metrics = o.member.as_ref().map_or_else(|| Arc::new(metrics::Metrics::default()), |m| m.metrics.clone());
    metrics.set_labels(o.labels.clone());
    if let Some(addr) = o.metrics_addr {
        let bound = metrics::serve(addr, metrics.clone()).with_context(|| format!("cannot serve metrics on {addr}"))?;
        log_line!("probe watch: metrics on http://{bound}/metrics");
    }
    Ok(metrics)
}

/// One trace session of a found target: the collector writes the live window while the
/// [`incident::Watcher`] thread takes what it sends.
struct Session<'a> {
    o: &'a Options,
    pid: u32,
    incidents: &'a PathBuf,
    metrics: &'a Arc<metrics::Metrics>,
    otlp: &'a Option<Arc<crate::render::export::otlp::Sender>>,
    /// When the session counts from (the watch's start for the first).
    started: Instant,
}

impl Session<'_> {
    /// Trace the target until it exits or probe is stopped; the outer error is the watcher
    /// thread's that could not start, the inner the trace's.
    fn run(self, server: &str) -> anyhow::Result<anyhow::Result<crate::collector::TraceOutcome>> {
        let (o, pid) = (self.o, self.pid);
        let live = o.dir.join(format!("live-{pid}"));
        remove_live(&live);
        let (tx, rx) = mpsc::channel();
        let m = self.metrics.clone();
        let link = Arc::new(Link::new(
            tx,
            Rotation { every: o.segment, max_bytes: (o.window_bytes / 4).max(1 << 20) },
            Box::new(move |lost, bpf_ns| m.set_cost(lost, bpf_ns)),
        ));
        let watcher = incident::Watcher::new(o, pid, self.incidents.clone(), self.metrics.clone(), link.clone(), self.otlp.clone(), server);
        let key = crate::util::text::log_key();
        let worker = std::thread::Builder::new().name("probe-watcher".into()).spawn(move || {
            crate::util::text::set_log_key(key);
            // Analysis and incident writing wait for a free CPU: never ahead of the server.
            crate::os::procfs::idle_priority();
            watcher.run(rx)
        })?;
        log_line!("probe watch: following pid {pid} ({})", crate::util::text::terminal(&crate::os::procfs::comm(pid)));
        let outcome = crate::collector::trace(self.trace_options(live.clone(), link.clone()));
        let reason = outcome.as_ref().map_or_else(|e| format!("{e:#}"), |o| o.reason.clone());
        link.send(Msg::Ended { reason, target_exited: false, lost: 0 });
        drop(link);
        let _ = worker.join();
        remove_live(&live);
        Ok(outcome)
    }

    /// The collector's options for a session of `watch`: quiet, the live window in `live`,
    /// the segments sent through `link`.
    fn trace_options(&self, live: PathBuf, link: Arc<Link>) -> crate::collector::TraceOptions {
        let o = self.o;
        crate::collector::TraceOptions {
            pid: self.pid,
            duration: None,
            out: live,
            force: false,
            only: None,
            ring_bytes: o.ring_bytes,
            capture_text: false,
            python_frames: true,
            python_budget: 1.0,
            sample_hz: o.hz,
            host_hz: o.host_hz,
            poll: o.poll,
            started: self.started,
            max_size: None,
            watch: Some(link),
            offcpu_d_only: o.offcpu_d_only,
            stack_limit: 0,
            // A node agent stays armed while its server runs (it arms again only when the server
            // restarts): a kept set would hold its maps' memory the whole time for little.
            keep: crate::kernel::kept::Keep::Leave,
            otlp: None,
            cgroup: match &o.select {
                target::Select::Cgroup(c) => Some(c.clone()),
                _ => None,
            },
            quiet: true,
            verbose: false,
            node: o.member.as_ref().map(|m| m.node.clone()),
            stop: o.member.as_ref().map(|m| m.stop.clone()),
            headers: o.member.as_ref().map(|m| m.headers.clone()),
        }
    }
}

/// Remove a live window directory (ours: made 0700 by this process in its own state directory).
fn remove_live(live: &std::path::Path) {
    if std::fs::symlink_metadata(live).is_ok_and(|m| m.is_dir()) {
        let _ = std::fs::remove_dir_all(live);
    }
}
