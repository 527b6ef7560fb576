//! `probe watch`: the flight recorder left on (one server, or every server on the node).
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use super::*;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "port", "exe", "cgroup", "container", "all"])))]
pub struct Args {
    /// Follow this process (then whoever listens on its ports, or runs its executable, after
    /// it exits).
    #[arg(long)]
    pub pid: Option<u32>,
    /// Follow whoever listens on this TCP port.
    #[arg(long)]
    pub port: Option<u16>,
    /// Follow a process with this name or executable file name (e.g. llama-server, ollama).
    #[arg(long)]
    pub exe: Option<String>,
    /// Follow every process of this cgroup (relative to /sys/fs/cgroup or absolute), as
    /// processes join it and as it empties and fills again.
    #[arg(long)]
    pub cgroup: Option<String>,
    /// Follow every process of this container (name, or at least 4 characters of its id),
    /// across restarts of the container.
    #[arg(long)]
    pub container: Option<String>,
    /// Follow every LLM server on this node, found by what it answers (a model list on
    /// /v1/models or /api/tags), each labelled with its node, container and pod; their
    /// incidents go to DIR/servers/NAME/.
    #[arg(long)]
    pub all: bool,
    /// Where the kubelet keeps pod logs (NAMESPACE_NAME_UID directories): pod names for --all.
    #[arg(long, default_value = "/var/log/pods")]
    pub pod_logs: PathBuf,
    /// How often --all looks for new servers.
    #[arg(long, default_value = "2s", value_parser = parse_duration, hide = true)]
    pub scan_every: Duration,
    /// A label (KEY=VALUE) on every metric, incident and span (--all gives each server its own).
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Stop when the target exits instead of waiting for its successor (--all follows each server so, on a thread of its own).
    #[arg(long, hide = true)]
    pub once: bool,
    /// With --all: the servers that get --api-key and --header (repeat for more):
    /// container=NAME, port=PORT or exe=PATH. No other listener on the node sees them, and a
    /// scope stays with the uid and executable it first matched.
    #[arg(long = "api-key-for", value_name = "SCOPE", value_parser = watch_scope, requires = "all")]
    pub api_key_for: Vec<crate::watch::scope::Scope>,
    /// Where incidents (DIR/incidents/TIME-CAUSE/) and the live window go.
    #[arg(long, default_value = "/var/lib/probe")]
    pub dir: PathBuf,
    /// How much recent history an incident holds before its request arrived.
    #[arg(long, default_value = "2m", value_parser = parse_window)]
    pub window: Duration,
    /// The most disk the live window uses (K, M, G).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub window_size: u64,
    /// A request whose first token took longer is an incident: a time (2s, 800ms) or a
    /// multiple of the recent median (4x; 2s until 10 requests were seen).
    #[arg(long, default_value = "2s", value_parser = crate::watch::SlowTtft::parse)]
    pub slow_ttft: crate::watch::SlowTtft,
    /// The most disk incidents use; the oldest are removed first (K, M, G).
    #[arg(long, default_value = "2G", value_parser = parse_size)]
    pub keep: u64,
    /// At most one incident of a cause this often (the rest are counted in the metrics).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub incident_gap: Duration,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464); off by default.
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Segment length of the live window: a window is kept in whole segments.
    #[arg(long, default_value = "30s", value_parser = parse_window, hide = true)]
    pub segment: Duration,
    /// On-CPU stack sampling frequency per thread (lower than trace's 99: the cost of staying on).
    #[arg(long, default_value_t = 19, value_parser = clap::value_parser!(u64).range(1..=MAX_HZ))]
    pub hz: u64,
    /// GPU, CPU-frequency and memory samples per second while the server is busy (0: off).
    #[arg(long, default_value_t = 2.0, value_parser = parse_sample_hz)]
    pub sample_hz: f64,
    /// Ring buffer size in MiB (a power of two, 1 to 1024).
    #[arg(long, default_value_t = 16, value_parser = parse_ring_mb)]
    pub ring_mb: u32,
    /// Do not poll the server's own endpoints.
    #[arg(long)]
    pub no_poll: bool,
    /// Off-CPU stacks for every block, as `trace` takes them (default: only uninterruptible
    /// waits, disk IO, page faults and reclaim, which the verdicts rest on; thread pools'
    /// frequent sleeps cost the most to record).
    #[arg(long)]
    pub offcpu_all: bool,
    #[command(flatten)]
    pub auth: crate::util::httpc::ServerAuth,
    /// Send the requests as OpenTelemetry spans (with their verdicts) to this OTLP/HTTP
    /// collector, e.g. http://127.0.0.1:4318 (Jaeger, Tempo, the OpenTelemetry Collector).
    #[arg(long, value_parser = crate::render::export::otlp::Endpoint::parse)]
    pub otlp: Option<crate::render::export::otlp::Endpoint>,
}

/// `probe watch`: the flight recorder left on.
pub fn run(args: Args, started: Instant) -> anyhow::Result<i32> {
    let Args {
        pid,
        port,
        exe,
        cgroup,
        container,
        dir,
        window,
        window_size,
        slow_ttft,
        keep,
        incident_gap,
        metrics_addr,
        segment,
        hz,
        sample_hz,
        ring_mb,
        no_poll,
        offcpu_all,
        auth,
        otlp,
        all,
        pod_logs,
        scan_every,
        labels,
        once,
        api_key_for,
    } = args;
    use crate::watch::{self, target::Select};
    let mut o = watch::Options {
        select: Select::Pid(0),
        dir,
        window,
        window_bytes: window_size,
        slow_ttft,
        keep,
        incident_gap,
        metrics_addr,
        segment: segment.min(window),
        hz,
        host_hz: sample_hz,
        ring_bytes: ring_mb << 20,
        poll: !no_poll,
        offcpu_d_only: !offcpu_all,
        started,
        otlp,
        labels,
        once,
        member: None,
    };
    if all {
        // The agent itself talks to no server: the credentials go to the scoped servers only.
        let credentials = auth.all();
        if !credentials.is_empty() && api_key_for.is_empty() {
            anyhow::bail!(
                "with --all, say which servers get the API key or headers: --api-key-for port=PORT (or container=NAME, exe=PATH); \
                 every other listener on the node is asked without them"
            );
        }
        return watch::all::run(watch::all::Options {
            dir: std::mem::take(&mut o.dir),
            metrics_addr: o.metrics_addr.take(),
            pod_logs,
            scan_every,
            credentials,
            scopes: api_key_for,
            server: o,
        });
    }
    auth.install();
    o.select = match (pid, port, exe, cgroup, container) {
        (Some(p), ..) => Select::Pid(p),
        (_, Some(p), ..) => Select::Port(p),
        (_, _, Some(e), ..) => Select::Exe(e),
        (_, _, _, Some(c), _) => Select::Cgroup(crate::os::cgroup::resolve(&c)?),
        (.., Some(c)) => Select::Cgroup(crate::os::cgroup::find_container(&c)?),
        _ => anyhow::bail!("give --pid, --port, --exe, --cgroup or --container"),
    };
    watch::run(o)
}
