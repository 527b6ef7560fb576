//! The `probe` command line: parse, set up logging, run, print errors with their causes, exit
//! with a documented code (0 ok, 1 partial: probes skipped or events lost, 2 error).
use std::{
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use probe_user::{
    analysis::flame,
    analysis::{Analysis, Needs, Scope},
    bench,
    cmd::doctor,
    collector, exit, record,
    render::bundle,
    util::output,
    util::text::terminal,
};

#[derive(Parser)]
#[command(name = "probe", version, about = "eBPF tracing for local LLM servers: why was the first token slow?")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Trace a running process (and processes it starts) until Ctrl-C, the duration, or its exit.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "cgroup", "container"])))]
    Trace {
        /// The process to trace (e.g. `pgrep -o llama-server`), as the host's /proc numbers it.
        #[arg(long)]
        pid: Option<u32>,
        /// Every process of this cgroup (v2; relative to /sys/fs/cgroup or absolute), followed as
        /// processes join and leave it; the trace ends when it is empty.
        #[arg(long)]
        cgroup: Option<String>,
        /// Every process of this container (Docker, Podman, containerd, CRI-O): its name, or at
        /// least 4 characters of its id; found through its cgroup.
        #[arg(long)]
        container: Option<String>,
        /// Stop after this long (e.g. 30s, 2m, 500ms; also --max-duration). Default: until
        /// Ctrl-C or the target exits.
        #[arg(long, visible_alias = "max-duration", value_parser = parse_trace_duration)]
        duration: Option<Duration>,
        /// Stop once the recording holds this much (e.g. 500M, 2G; K, M, G, T are powers of
        /// 1024), as --duration does. It may pass it by what the ring buffer holds at that moment (and
        /// what probe copied out of it unread while every CPU was busy).
        #[arg(long, value_parser = parse_size)]
        max_size: Option<u64>,
        /// Recording directory, created new with mode 0700 (an existing one must be empty and
        /// yours). Default: probe-PID-UNIXTIME in the current directory.
        #[arg(short, long, visible_alias = "output")]
        out: Option<PathBuf>,
        /// Replace the recording already in --out (one of yours; other files there are kept).
        #[arg(long)]
        force: bool,
        /// Only these probes (comma separated): blockio, fault, filemap, mmap, sock, stream, cpu,
        /// offcpu, mem, proc, engine (llama.cpp's decode steps, by uprobe).
        /// A named probe that cannot attach is an error; by default such probes are skipped.
        #[arg(long, value_delimiter = ',')]
        probes: Option<Vec<String>>,
        /// Ring buffer size in MiB (a power of two, 1 to 1024). While every CPU is busy probe leaves
        /// its records there (a 256-token request of llama-server on 2 busy cores: 7 MB/s); 32 holds
        /// 2 s of that before probe copies them out. Smaller arms faster (16: about 10 ms less).
        #[arg(long, default_value_t = 32, value_parser = parse_ring_mb)]
        ring_mb: u32,
        /// Print report.json instead of the human summary at the end.
        #[arg(long)]
        json: bool,
        /// On-CPU stack sampling frequency, per thread (Hz, 1 to 10000; `--probes` without cpu
        /// turns sampling off).
        #[arg(long, default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=MAX_HZ))]
        hz: u64,
        /// Also store the bytes of request streams (prompts, answers) in the recording. Off by
        /// default: only request metadata (timing, sizes, stop reasons) is kept.
        #[arg(long)]
        capture_text: bool,
        /// Native frames only in CPython targets' stacks: their Python frames (`module.function
        /// (file.py:line)` in place of the interpreter's evaluation frames) are not read.
        #[arg(long)]
        no_python_frames: bool,
        /// The most of one core (percent) the Python frames' own work may take, over any 5 s:
        /// the kernel's walks and probe's reading and naming. Beyond it they are turned off for
        /// the rest of the trace, and the report says so. 0: no limit.
        #[arg(long, default_value_t = 1.0, value_parser = parse_budget)]
        python_budget: f64,
        /// GPU (NVML), CPU-frequency and memory-pressure samples per second (up to 1000); 0
        /// turns them off.
        #[arg(long, default_value_t = 10.0, value_parser = parse_sample_hz)]
        sample_hz: f64,
        /// Do not poll the server's own endpoints (llama.cpp /metrics and /props, vLLM /metrics,
        /// Ollama /api/ps) on the ports it listens on.
        #[arg(long)]
        no_poll: bool,
        /// Keep the ring's drain and the samplers at normal priority and never hold them back: by
        /// default they yield the CPUs to the server (idle priority) and, while every CPU is busy,
        /// wait (records in the ring, memory and GPU readings every 3 s instead of --sample-hz).
        /// With this the readings keep their rate, and the verdicts may name probe as a competitor.
        #[arg(long)]
        no_yield: bool,
        #[command(flatten)]
        auth: probe_user::util::httpc::ServerAuth,
        /// Send the requests as OpenTelemetry spans (with their verdicts) to this OTLP/HTTP
        /// collector, e.g. http://127.0.0.1:4318 (Jaeger, Tempo, the OpenTelemetry Collector).
        #[arg(long, value_parser = probe_user::render::export::otlp::Endpoint::parse)]
        otlp: Option<probe_user::render::export::otlp::Endpoint>,
        /// No live view: on a terminal, probe otherwise shows each request in flight and what it
        /// waits on, once a second (without a terminal it never does).
        #[arg(short, long)]
        quiet: bool,
        /// Say what arming took, stage by stage (kernel BTF, object load, programs, the slowest
        /// programs), after the "armed" line.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Stay on: follow a server (across restarts), keep a window of recent events, save an
    /// incident directory for every slow or abnormal request and for a server exit, and serve
    /// Prometheus metrics. Runs until SIGINT/SIGTERM (see scripts/probe-watch.service).
    #[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "port", "exe", "cgroup", "container", "all"])))]
    Watch {
        /// Follow this process (then whoever listens on its ports, or runs its executable, after
        /// it exits).
        #[arg(long)]
        pid: Option<u32>,
        /// Follow whoever listens on this TCP port.
        #[arg(long)]
        port: Option<u16>,
        /// Follow a process with this name or executable file name (e.g. llama-server, ollama).
        #[arg(long)]
        exe: Option<String>,
        /// Follow every process of this cgroup (relative to /sys/fs/cgroup or absolute), as
        /// processes join it and as it empties and fills again.
        #[arg(long)]
        cgroup: Option<String>,
        /// Follow every process of this container (name, or at least 4 characters of its id),
        /// across restarts of the container.
        #[arg(long)]
        container: Option<String>,
        /// Follow every LLM server on this node, found by what it answers (a model list on
        /// /v1/models or /api/tags), each labelled with its node, container and pod; their
        /// incidents go to DIR/servers/NAME/.
        #[arg(long)]
        all: bool,
        /// Where the kubelet keeps pod logs (NAMESPACE_NAME_UID directories): pod names for --all.
        #[arg(long, default_value = "/var/log/pods")]
        pod_logs: PathBuf,
        /// How often --all looks for new servers.
        #[arg(long, default_value = "2s", value_parser = parse_duration, hide = true)]
        scan_every: Duration,
        /// A label (KEY=VALUE) on every metric, incident and span (--all gives each server its own).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Stop when the target exits instead of waiting for its successor (--all follows each server so, on a thread of its own).
        #[arg(long, hide = true)]
        once: bool,
        /// With --all: the servers that get --api-key and --header (repeat for more):
        /// container=NAME, port=PORT or exe=PATH. No other listener on the node sees them, and a
        /// scope stays with the uid and executable it first matched.
        #[arg(long = "api-key-for", value_name = "SCOPE", value_parser = watch_scope, requires = "all")]
        api_key_for: Vec<probe_user::watch::scope::Scope>,
        /// Where incidents (DIR/incidents/TIME-CAUSE/) and the live window go.
        #[arg(long, default_value = "/var/lib/probe")]
        dir: PathBuf,
        /// How much recent history an incident holds before its request arrived.
        #[arg(long, default_value = "2m", value_parser = parse_window)]
        window: Duration,
        /// The most disk the live window uses (K, M, G).
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        window_size: u64,
        /// A request whose first token took longer is an incident: a time (2s, 800ms) or a
        /// multiple of the recent median (4x; 2s until 10 requests were seen).
        #[arg(long, default_value = "2s", value_parser = probe_user::watch::SlowTtft::parse)]
        slow_ttft: probe_user::watch::SlowTtft,
        /// The most disk incidents use; the oldest are removed first (K, M, G).
        #[arg(long, default_value = "2G", value_parser = parse_size)]
        keep: u64,
        /// At most one incident of a cause this often (the rest are counted in the metrics).
        #[arg(long, default_value = "60s", value_parser = parse_duration)]
        incident_gap: Duration,
        /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464); off by default.
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
        /// Segment length of the live window: a window is kept in whole segments.
        #[arg(long, default_value = "30s", value_parser = parse_window, hide = true)]
        segment: Duration,
        /// On-CPU stack sampling frequency per thread (lower than trace's 99: the cost of staying on).
        #[arg(long, default_value_t = 19, value_parser = clap::value_parser!(u64).range(1..=MAX_HZ))]
        hz: u64,
        /// GPU, CPU-frequency and memory samples per second while the server is busy (0: off).
        #[arg(long, default_value_t = 2.0, value_parser = parse_sample_hz)]
        sample_hz: f64,
        /// Ring buffer size in MiB (a power of two, 1 to 1024).
        #[arg(long, default_value_t = 16, value_parser = parse_ring_mb)]
        ring_mb: u32,
        /// Do not poll the server's own endpoints.
        #[arg(long)]
        no_poll: bool,
        /// Off-CPU stacks for every block, as `trace` takes them (default: only uninterruptible
        /// waits, disk IO, page faults and reclaim, which the verdicts rest on; thread pools'
        /// frequent sleeps cost the most to record).
        #[arg(long)]
        offcpu_all: bool,
        #[command(flatten)]
        auth: probe_user::util::httpc::ServerAuth,
        /// Send the requests as OpenTelemetry spans (with their verdicts) to this OTLP/HTTP
        /// collector, e.g. http://127.0.0.1:4318 (Jaeger, Tempo, the OpenTelemetry Collector).
        #[arg(long, value_parser = probe_user::render::export::otlp::Endpoint::parse)]
        otlp: Option<probe_user::render::export::otlp::Endpoint>,
    },
    /// Read a recording directory again and print its summary (or its JSON).
    Report {
        /// The recording directory (what `probe trace --out` wrote).
        dir: PathBuf,
        /// Print report.json to stdout instead of the summary.
        #[arg(long)]
        json: bool,
        /// Write DIR/report.html (self-contained: verdicts, timeline, flamegraphs) and print its path.
        #[arg(long)]
        html: bool,
        /// Print what the recording spends its space on (records and bytes per kind) instead.
        #[arg(long)]
        sizes: bool,
    },
    /// Draw a flamegraph (SVG, plus the folded stacks beside it) from a recording.
    Flamegraph {
        /// The recording directory (what `probe trace --out` wrote).
        dir: PathBuf,
        /// cpu (on-CPU samples), offcpu (blocked time, µs), faults (major faults), io (block requests).
        #[arg(long, default_value = "cpu")]
        kind: String,
        /// Only the stacks inside this request's time window (an id from the report).
        #[arg(long)]
        request: Option<u64>,
        /// Only stacks from this many seconds after the trace started.
        #[arg(long)]
        from: Option<f64>,
        /// Only stacks until this many seconds after the trace started.
        #[arg(long)]
        to: Option<f64>,
        /// Output SVG (default DIR/flame-KIND.svg); the folded text goes beside it (.folded).
        #[arg(short, long = "out", visible_alias = "output")]
        output: Option<PathBuf>,
        /// Replace --out if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
    },
    /// Write the recording as a Chrome trace-event JSON timeline (opens in the Perfetto UI).
    Timeline {
        /// The recording directory (what `probe trace --out` wrote).
        dir: PathBuf,
        /// Output file (default DIR/timeline.json).
        #[arg(short, long = "out", visible_alias = "output")]
        output: Option<PathBuf>,
        /// Replace --out if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
    },
    /// Export a recording for other tools: its stacks as pprof profiles (`go tool pprof`,
    /// Pyroscope, Grafana, Parca, speedscope), its requests as OpenTelemetry spans (OTLP/JSON, or
    /// sent to a collector with --otlp).
    Export {
        /// The recording directory (what `probe trace --out` wrote).
        dir: PathBuf,
        /// pprof: DIR/pprof-KIND.pb.gz per kind of stack (cpu, offcpu, faults, io);
        /// otlp-json: DIR/otlp.json (one OTLP ExportTraceServiceRequest). With --otlp alone, otlp-json.
        #[arg(long, value_enum, required_unless_present = "otlp")]
        format: Option<ExportFormat>,
        /// Where to write: a directory for pprof, a file for otlp-json (default: DIR).
        #[arg(short, long = "out", visible_alias = "output")]
        output: Option<PathBuf>,
        /// Replace the --out file of otlp-json if it exists (never through a symbolic link;
        /// files written into a recording or an --out directory are always replaced).
        #[arg(long)]
        force: bool,
        /// Also send the spans to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318).
        #[arg(long, value_parser = probe_user::render::export::otlp::Endpoint::parse)]
        otlp: Option<probe_user::render::export::otlp::Endpoint>,
    },
    /// Pack a recording's report, flamegraphs, timeline and environment into one .tar.gz for an
    /// issue (never the raw event log, so no prompt or response text).
    Bundle {
        /// The recording directory (what `probe trace --out` wrote).
        dir: PathBuf,
        /// Output file (default DIR.tar.gz beside the recording). Created new, mode 0600.
        #[arg(short, long = "out", visible_alias = "output")]
        output: Option<PathBuf>,
        /// Replace the output file if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
        /// Hide directory names in paths and IP addresses.
        #[arg(long)]
        mask: bool,
    },
    /// Compare: a recording's slowest request against its warm baseline, one request against
    /// another, or two recordings (today's against yesterday's). Writes diff.md, diff.json and
    /// differential flamegraphs (diff-cpu.svg, diff-offcpu.svg, with their folded stacks).
    Diff {
        /// The baseline recording (A); alone, the recording whose requests are compared.
        a: PathBuf,
        /// The recording compared against A (B). Without it, requests of A are compared.
        b: Option<PathBuf>,
        /// The request to explain (B's, else A's; default: the slowest first token).
        #[arg(long)]
        request: Option<u64>,
        /// The request(s) to compare it with, comma-separated (A's; default: the warm baseline,
        /// the requests of a similar prompt size served without a slow cause).
        #[arg(long, value_delimiter = ',')]
        against: Vec<u64>,
        /// Where to write (default: B's recording, else A's). Files there are replaced.
        #[arg(short, long = "out", visible_alias = "output")]
        output: Option<PathBuf>,
        /// Compare recordings of different server builds or model files anyway.
        #[arg(long)]
        force: bool,
        /// Print diff.json to stdout instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Say which kernel features are present and what probe can do here.
    Doctor,
    /// Print the shell completion script for probe (e.g. `probe completions bash | sudo tee
    /// /usr/share/bash-completion/completions/probe`).
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write probe's man pages (probe.1 and one per command, probe-trace.1, ...) into a directory.
    Man {
        /// The directory to write them into (e.g. /usr/local/share/man/man1); created if missing.
        dir: PathBuf,
    },
    /// Write a synthetic recording with a real trace's mix of records (the report benchmark).
    #[command(hide = true)]
    Synth {
        /// Kernel events and stack records to write.
        #[arg(long)]
        events: u64,
        /// The recording directory to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Drive a running server with controlled experiments (concurrency, prompt length, idle
    /// time) and explain every change in length or latency with stop reasons and verdicts.
    Bench(Box<bench::BenchArgs>),
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ExportFormat {
    Pprof,
    OtlpJson,
}

/// `--duration`: `30s`, `2m`, `500ms`, `1h 30m` (humantime); a bare number is seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    probe_user::parse_duration_or(s, Duration::from_secs(1))
}

/// `trace --duration`: a duration, not zero (a trace of nothing).
fn parse_trace_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("a trace of 0 seconds records nothing: give a duration such as 30s, or leave it out to trace until Ctrl-C".into());
    }
    Ok(d)
}

/// `watch --window`/`--segment`: a duration of at least a second.
fn parse_window(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!("`{s}` is under a second: give e.g. 2m"));
    }
    Ok(d)
}

/// The highest `--hz`: perf refuses rates above its `perf_event_max_sample_rate`, and more than
/// this per thread only measures probe itself.
const MAX_HZ: u64 = 10_000;
/// The largest ring buffer (`--ring-mb`); `ring_mb << 20` must fit the kernel's u32.
const MAX_RING_MB: u32 = 1024;
/// The smallest `--max-size`: the start of a recording (meta, maps) takes tens of KiB.
const MIN_MAX_SIZE: u64 = 64 << 10;

/// `--ring-mb`: a power of two from 1 to [`MAX_RING_MB`].
fn parse_ring_mb(s: &str) -> Result<u32, String> {
    let n: u32 = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number of MiB"))?;
    if n == 0 || n > MAX_RING_MB || !n.is_power_of_two() {
        return Err(format!("must be a power of two from 1 to {MAX_RING_MB} (MiB), e.g. 16"));
    }
    Ok(n)
}

/// `--sample-hz`: a finite number from 0 (off) to 1000.
fn parse_sample_hz(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() || !(0.0..=1000.0).contains(&v) {
        return Err(format!("`{s}` is out of range: give 0 (off) to 1000 samples per second"));
    }
    Ok(v)
}

/// `--python-budget`: a percentage of one core.
fn parse_budget(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().trim_end_matches('%').parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() || !(0.0..=100.0).contains(&v) {
        return Err(format!("`{s}` is out of range: give 0 (no limit) to 100 (percent of one core)"));
    }
    Ok(v)
}

/// `--max-size`: bytes, or a number with K, M, G or T (powers of 1024; `B`/`iB` may follow).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{s}`: unknown unit `{c}`: use K, M, G or T (e.g. 500M)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: f64 = num.trim().parse().map_err(|_| format!("`{s}` is not a size: use e.g. 500M, 2G or a number of bytes"))?;
    let bytes = n * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < MIN_MAX_SIZE as f64 || bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("`{s}` is out of range: give at least {} KiB, e.g. 100M", MIN_MAX_SIZE >> 10));
    }
    Ok(bytes as u64)
}

fn run(cli: Cli, started: Instant) -> anyhow::Result<i32> {
    match cli.command {
        command @ Command::Trace { .. } => trace_cmd(command, started),
        command @ Command::Watch { .. } => watch_cmd(command, started),
        Command::Report { dir, sizes: true, .. } => {
            let s = record::sizes(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            println!("{:<16} {:>12} {:>14} {:>10}", "kind", "records", "bytes", "per record");
            for (k, (n, b)) in &s {
                println!("{k:<16} {n:>12} {b:>14} {:>10.1}", *b as f64 / (*n).max(1) as f64);
            }
            Ok(exit::OK)
        }
        Command::Report { dir, json, html, .. } => report_cmd(dir, json, html),
        Command::Flamegraph { dir, kind, request, from, to, output, force } => flamegraph_cmd(dir, kind, request, from, to, output, force),
        Command::Timeline { dir, output, force } => timeline_cmd(dir, output, force),
        Command::Export { dir, format, output, force, otlp } => {
            // clap asks for --format unless --otlp is given: sending spans is exporting them as OTLP.
            export_cmd(dir, format.unwrap_or(ExportFormat::OtlpJson), output, force, otlp)
        }
        Command::Bundle { dir, output, mask, force } => bundle_cmd(dir, output, mask, force),
        Command::Diff { a, b, request, against, output, force, json } => diff_cmd(a, b, request, against, output, force, json),
        Command::Doctor => Ok(doctor::run()),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut <Cli as clap::CommandFactory>::command(), "probe", &mut script);
            // A reader that stops early (`| head`) is not an error.
            let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), &script);
            Ok(exit::OK)
        }
        Command::Man { dir } => man_cmd(&dir),
        Command::Synth { events, out } => {
            let s = probe_user::record::synth::write(&out, events)?;
            println!(
                "{} ({} kernel events, {} stack records, {} other records, {} requests, {:.0} s, {} bytes)",
                out.display(),
                s.kernel_events,
                s.stack_records,
                s.other_records,
                s.requests,
                s.seconds,
                s.bytes
            );
            Ok(exit::OK)
        }
        Command::Bench(args) => bench::run(*args),
    }
}

/// `probe trace`: attach, record, stop, write every output.
fn trace_cmd(command: Command, started: Instant) -> anyhow::Result<i32> {
    let Command::Trace {
        pid,
        cgroup,
        container,
        duration,
        max_size,
        out,
        force,
        probes,
        ring_mb,
        json,
        hz,
        capture_text,
        no_python_frames,
        python_budget,
        sample_hz,
        no_poll,
        no_yield,
        auth,
        otlp,
        quiet,
        verbose,
    } = command
    else {
        unreachable!("trace_cmd takes its own command")
    };
    auth.install();
    if no_yield {
        probe_user::os::yielding::never();
    }
    let cgroup = match (&cgroup, &container) {
        (Some(c), _) => Some(probe_user::os::cgroup::resolve(c)?),
        (_, Some(c)) => Some(probe_user::os::cgroup::find_container(c)?),
        _ => None,
    };
    let pid = match (pid, &cgroup) {
        (Some(p), _) => p,
        (None, Some(cg)) => probe_user::os::cgroup::main_pid(&probe_user::os::cgroup::procs(cg))
            .with_context(|| format!("{} has no processes to trace", cg.display()))?,
        (None, None) => anyhow::bail!("give --pid, --cgroup or --container"),
    };
    let out = out.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from(format!("probe-{pid}-{now}"))
    });
    let outcome = collector::trace(collector::TraceOptions {
        pid,
        duration,
        out: out.clone(),
        force,
        only: probes,
        ring_bytes: ring_mb << 20,
        capture_text,
        python_frames: !no_python_frames,
        python_budget,
        sample_hz: hz,
        host_hz: sample_hz.max(0.0),
        poll: !no_poll,
        started,
        max_size: max_size.map(|m| (m, max_size_text(m))),
        watch: None,
        offcpu_d_only: false,
        otlp,
        cgroup,
        quiet,
        verbose,
        node: None,
        stop: None,
        headers: None,
    })?;
    // Printing fails when the terminal is gone (SIGHUP): the recording is written anyway.
    use std::io::Write as _;
    let mut stdout = std::io::stdout();
    let _ = if json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&outcome.report)?)
    } else {
        write!(stdout, "{}", terminal(&probe_user::render::text::render(&outcome.report))).and_then(|()| {
            writeln!(stdout, "\nrecording: {}  (report.json beside it; `probe report {}` prints this again)", out.display(), out.display())
        })
    };
    Ok(if outcome.partial { exit::PARTIAL } else { exit::OK })
}

/// `probe watch`: the flight recorder left on.
fn watch_cmd(command: Command, started: Instant) -> anyhow::Result<i32> {
    let Command::Watch {
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
    } = command
    else {
        unreachable!("watch_cmd takes its own command")
    };
    use probe_user::watch::{self, target::Select};
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
        (_, _, _, Some(c), _) => Select::Cgroup(probe_user::os::cgroup::resolve(&c)?),
        (.., Some(c)) => Select::Cgroup(probe_user::os::cgroup::find_container(&c)?),
        _ => anyhow::bail!("give --pid, --port, --exe, --cgroup or --container"),
    };
    watch::run(o)
}

fn watch_scope(s: &str) -> Result<probe_user::watch::scope::Scope, String> {
    probe_user::watch::scope::Scope::parse(s)
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}`: give a label as KEY=VALUE"))?;
    let ok = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !k.starts_with(|c: char| c.is_ascii_digit());
    if !ok {
        return Err(format!("`{k}` is not a label name: letters, digits and _, not starting with a digit"));
    }
    Ok((k.to_string(), v.to_string()))
}

/// `probe report DIR [--json|--html]`.
fn report_cmd(dir: PathBuf, json: bool, html: bool) -> anyhow::Result<i32> {
    use probe_user::watch::fleet;
    // Incidents pulled from several nodes (a folder per node): listed, each with where.
    if !html && fleet::is_tree(&dir) {
        let all = fleet::list(&dir);
        if json {
            println!("{}", serde_json::to_string_pretty(&all)?);
        } else {
            print!("{}", terminal(&fleet::render(&dir, &all)));
        }
        return Ok(exit::OK);
    }
    let r = if html {
        let (page, r) = probe_user::render::html::write(&dir)?;
        println!("{}", page.display());
        r
    } else {
        // Streamed: memory does not grow with the recording.
        Analysis::report_dir(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else if !html {
        print!("{}", terminal(&probe_user::render::text::render(&r)));
        if let Some(l) = fleet::labels_of(&dir) {
            println!("\nWhere: {}", terminal(&fleet::place_words(&l)));
        }
    }
    // A torn or corrupt recording is reported from what was whole, and says so (exit 1).
    Ok(if r.lost_events.values().any(|&n| n > 0) || !r.problems.is_empty() { exit::PARTIAL } else { exit::OK })
}

/// `probe flamegraph DIR`: one kind's stacks, of the whole recording, a time window or a request.
fn flamegraph_cmd(
    dir: PathBuf,
    kind: String,
    request: Option<u64>,
    from: Option<f64>,
    to: Option<f64>,
    output: Option<PathBuf>,
    force: bool,
) -> anyhow::Result<i32> {
    let kind = flame::Kind::parse(&kind).with_context(|| format!("unknown kind `{kind}`: choose cpu, offcpu, faults or io"))?;
    let meta = record::read_meta(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
    let start = meta.map_or(0, |m| m.start_ns);
    let secs = |s: f64| start + (s * 1e9) as u64;
    let scope = match request {
        Some(id) => Scope::Request(id),
        None => Scope::Window(flame::Window { from_ns: from.map(secs), to_ns: to.map(secs), request: false }),
    };
    // Streamed: every stack of the recording, however long (two passes: the request's
    // window is known only once its record was read).
    let a = Analysis::of_dir(&dir, Needs { flames: true, scope, ..Needs::REPORT })
        .with_context(|| format!("cannot read the recording in {}", dir.display()))?;
    if let Some(e) = &a.scope_error {
        anyhow::bail!("{e} (see `probe report {}`)", dir.display());
    }
    let folded = a.folded(kind);
    if folded.is_empty() {
        anyhow::bail!("no {} stacks in {} for this window", kind.name(), dir.display());
    }
    let title = match request {
        Some(id) => format!("probe: {} stacks of request {id}", kind.name()),
        None => format!("probe: {} stacks", kind.name()),
    };
    let (svg, text) = (probe_user::render::flame::svg(&folded, kind, &title)?, flame::folded_text(&folded));
    let out = match output {
        Some(out) => {
            output::write_file(&out, &svg, force)?;
            output::write_file(&out.with_extension("folded"), text.as_bytes(), force)?;
            out
        }
        None => {
            // A request's or a window's graph gets a name of its own: the trace's whole-recording
            // flame-<kind>.svg stays as it was written.
            let name = match (request, from, to) {
                (Some(id), ..) => format!("flame-{}-req{id}", kind.name()),
                (None, None, None) => format!("flame-{}", kind.name()),
                (None, f, t) => format!("flame-{}-{}s-{}s", kind.name(), f.unwrap_or(0.0), t.map_or("end".into(), |t| t.to_string())),
            };
            let d = output::OutDir::open(&dir)?;
            d.write(&format!("{name}.folded"), text.as_bytes())?;
            d.write(&format!("{name}.svg"), &svg)?
        }
    };
    println!("{} ({} stacks, weight {})", out.display(), folded.len(), folded.values().sum::<u64>());
    Ok(exit::OK)
}

/// `probe timeline DIR`: timeline.json for the Perfetto UI.
fn timeline_cmd(dir: PathBuf, output: Option<PathBuf>, force: bool) -> anyhow::Result<i32> {
    let a = Analysis::of_dir(&dir, Needs { recording: true, ..Needs::REPORT })
        .with_context(|| format!("cannot read the recording in {}", dir.display()))?;
    let trace = probe_user::render::perfetto::of(&a);
    let bytes = serde_json::to_vec(&trace)?;
    let out = match output {
        Some(out) => {
            output::write_file(&out, &bytes, force)?;
            out
        }
        None => output::OutDir::open(&dir)?.write("timeline.json", &bytes)?,
    };
    println!("{} ({} events; open it in the Perfetto UI)", out.display(), trace.events.len());
    Ok(exit::OK)
}

/// `probe export DIR`: pprof profiles, OTLP/JSON, OTLP/HTTP.
fn export_cmd(
    dir: PathBuf,
    format: ExportFormat,
    output: Option<PathBuf>,
    force: bool,
    otlp: Option<probe_user::render::export::otlp::Endpoint>,
) -> anyhow::Result<i32> {
    let read = || format!("cannot read the recording in {}", dir.display());
    let pprof = matches!(format, ExportFormat::Pprof);
    let a = Analysis::of_dir(&dir, Needs { flames: pprof, pprof, ..Needs::REPORT }).with_context(read)?;
    let (r, meta) = (&a.report, &a.meta);
    match format {
        ExportFormat::Pprof => {
            let profiles =
                a.samples.as_ref().map(|s| probe_user::render::export::pprof::profiles(s, &a.flames.symbols, meta)).unwrap_or_default();
            if profiles.is_empty() {
                anyhow::bail!("{} has no stacks to export (was it traced with --probes without cpu/offcpu?)", dir.display());
            }
            let out = match &output {
                Some(o) => output::OutDir::create_or_open(o)?,
                None => output::OutDir::open(&dir)?,
            };
            for (kind, bytes) in profiles {
                let p = out.write(&format!("pprof-{}.pb.gz", kind.name()), &bytes)?;
                println!("{}  (go tool pprof -http=: {})", p.display(), p.display());
            }
        }
        ExportFormat::OtlpJson => {
            let e = probe_user::render::export::otlp::from_report(r, meta, None);
            let bytes = serde_json::to_vec(&e.to_json())?;
            let p = match output {
                Some(o) => {
                    output::write_file(&o, &bytes, force)?;
                    o
                }
                None => output::OutDir::open(&dir)?.write("otlp.json", &bytes)?,
            };
            println!("{} ({} spans)", p.display(), e.spans.len());
        }
    }
    if let Some(ep) = otlp {
        let e = probe_user::render::export::otlp::from_report(r, meta, None);
        let st = ep.send(&e).map_err(anyhow::Error::msg).context("cannot send the spans")?;
        println!("sent {} spans (collector answered {st})", e.spans.len());
    }
    Ok(exit::OK)
}

/// `probe bundle DIR`: the tarball to attach to an issue.
fn bundle_cmd(dir: PathBuf, output: Option<PathBuf>, mask: bool, force: bool) -> anyhow::Result<i32> {
    let a = Analysis::of_dir(&dir, Needs::ALL).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
    let name =
        dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "probe".into());
    let out = output.unwrap_or_else(|| dir.with_file_name(format!("{name}.tar.gz")));
    let files = bundle::write(&a, &out, mask, force)?;
    println!("{} ({})", out.display(), files.join(", "));
    Ok(exit::OK)
}

/// `probe diff A [B]`.
fn diff_cmd(
    a: PathBuf,
    b: Option<PathBuf>,
    request: Option<u64>,
    against: Vec<u64>,
    output: Option<PathBuf>,
    force: bool,
    json: bool,
) -> anyhow::Result<i32> {
    use probe_user::analysis::diff;
    let read = |dir: &PathBuf, whole: bool| {
        // Once each: the report, and the stacks folded per request (and for the whole recording
        // when two recordings are compared).
        Analysis::of_dir(dir, Needs { flames: whole, per_request: true, ..Needs::REPORT })
            .with_context(|| format!("cannot read the recording in {}", dir.display()))
    };
    // A recording with labels (an incident of `watch --all`, pulled from a node) says where.
    let name = |d: &PathBuf| match probe_user::watch::fleet::labels_of(d) {
        Some(l) => format!("{} ({})", d.display(), probe_user::watch::fleet::place_words(&l)),
        None => d.display().to_string(),
    };
    let one = |r: &probe_user::analysis::report::Report, id: u64, dir: &PathBuf| -> anyhow::Result<()> {
        match r.requests.iter().find(|q| q.id == id && !q.probe_poll) {
            None => anyhow::bail!("no request {id} in {} (see `probe report {}`)", dir.display(), dir.display()),
            Some(q) if q.ttft_ms.is_none() => anyhow::bail!("request {id} in {} has no first token to compare", dir.display()),
            Some(_) => Ok(()),
        }
    };
    let ids = |v: &[u64]| v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
    let (d, out_dir, drawn) = match &b {
        None => {
            let x = read(&a, false)?;
            let r = &x.report;
            let (warm, slow) = match (request, against.is_empty()) {
                (Some(n), false) => (against.clone(), n),
                (None, true) => diff::default_pair(r).map_err(anyhow::Error::msg)?,
                (None, false) => (against.clone(), diff::slowest(r).map_err(anyhow::Error::msg)?),
                // A named request against its own warm baseline (its prompt size, not the slowest's).
                (Some(n), true) => {
                    one(r, n, &a)?;
                    (diff::warm_baseline(r, n).map_err(anyhow::Error::msg)?, n)
                }
            };
            one(r, slow, &a)?;
            for &w in &warm {
                one(r, w, &a)?;
            }
            if warm.is_empty() || warm.contains(&slow) {
                anyhow::bail!("compare request {slow} with another request: --against M");
            }
            let label_b = if request.is_some() { format!("request {slow}") } else { format!("request {slow} (the slowest first token)") };
            let label_a = if against.is_empty() {
                format!("the warm baseline: request(s) {}", ids(&warm))
            } else {
                format!("request(s) {}", ids(&warm))
            };
            let out = match &output {
                Some(o) => output::OutDir::create_or_open(o)?,
                None => output::OutDir::open(&a)?,
            };
            let ia = diff::Input { analysis: &x, dir: name(&a), label: label_a, ids: warm };
            let ib = diff::Input { analysis: &x, dir: name(&a), label: label_b, ids: vec![slow] };
            {
                let d = diff::compare(&ia, &ib, false, force)?;
                let drawn = probe_user::render::diff::draw(&d, &ia, &ib, &|s: &str| s.to_string())?;
                (d, out, drawn)
            }
        }
        Some(bdir) => {
            let by_request = request.is_some() || !against.is_empty();
            let (xa, xb) = (read(&a, !by_request)?, read(bdir, !by_request)?);
            let all = |r: &probe_user::analysis::report::Report| {
                r.requests.iter().filter(|q| !q.probe_poll && q.ttft_ms.is_some()).map(|q| q.id).collect::<Vec<_>>()
            };
            let (ida, idb) = if by_request {
                let (Some(n), false) = (request, against.is_empty()) else {
                    anyhow::bail!("with two recordings, give both --request N (of B) and --against M (of A), or neither")
                };
                one(&xb.report, n, bdir)?;
                for &m in &against {
                    one(&xa.report, m, &a)?;
                }
                (against.clone(), vec![n])
            } else {
                (all(&xa.report), all(&xb.report))
            };
            for (ids, dir) in [(&ida, &a), (&idb, bdir)] {
                if ids.is_empty() {
                    anyhow::bail!(
                        "{} has no request with a first token: nothing to compare (see `probe report {}`)",
                        dir.display(),
                        dir.display()
                    );
                }
            }
            let label = |ids: &[u64]| {
                if by_request {
                    format!("request(s) {}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "))
                } else {
                    format!("every request ({})", ids.len())
                }
            };
            let out = match &output {
                Some(o) => output::OutDir::create_or_open(o)?,
                None => output::OutDir::open(bdir)?,
            };
            let ia = diff::Input { analysis: &xa, dir: name(&a), label: label(&ida), ids: ida.clone() };
            let ib = diff::Input { analysis: &xb, dir: name(bdir), label: label(&idb), ids: idb.clone() };
            {
                let d = diff::compare(&ia, &ib, !by_request, force)?;
                let drawn = probe_user::render::diff::draw(&d, &ia, &ib, &|s: &str| s.to_string())?;
                (d, out, drawn)
            }
        }
    };
    for (name, bytes) in &drawn {
        out_dir.write(name, bytes)?;
    }
    let md = out_dir.write("diff.md", probe_user::render::diff::markdown(&d).as_bytes())?;
    let js = out_dir.write("diff.json", &serde_json::to_vec_pretty(&d)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", terminal(&probe_user::render::diff::text(&d)));
        println!("\n{}\n{}", md.display(), js.display());
        for f in &d.flames {
            println!("{}", out_dir.path().join(&f.svg).display());
        }
    }
    Ok(exit::OK)
}

/// The size the user gave, written back the same way (for the end reason).
fn max_size_text(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// probe.1 and probe-CMD.1 for every command that is not hidden, into `dir`.
fn man_cmd(dir: &std::path::Path) -> anyhow::Result<i32> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let out = probe_user::util::output::OutDir::open(dir)?;
    let cmd = <Cli as clap::CommandFactory>::command();
    let mut pages = vec![("probe".to_string(), cmd.clone())];
    for sub in cmd.get_subcommands().filter(|c| !c.is_hide_set() && c.get_name() != "help") {
        // The page's NAME is `probe-CMD` (a man page's name; leaked once, for the process's life).
        let title: &'static str = Box::leak(format!("probe-{}", sub.get_name()).into_boxed_str());
        pages.push((title.to_string(), sub.clone().name(title).bin_name(format!("probe {}", sub.get_name()))));
    }
    for (title, page) in pages {
        let name = format!("{title}.1");
        let mut roff = Vec::new();
        clap_mangen::Man::new(page).title(title).render(&mut roff)?;
        let path = out.write(&name, &roff)?;
        let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), format!("{}\n", path.display()).as_bytes());
    }
    Ok(exit::OK)
}

fn main() -> ExitCode {
    let started = Instant::now();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = run(cli, started);
    // For the test that holds every command to two passes over events.bin (crate::analysis).
    if std::env::var_os("PROBE_COUNT_PASSES").is_some() {
        eprintln!("probe: passes over events.bin: {}", record::PASSES.load(std::sync::atomic::Ordering::Relaxed));
    }
    match result {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "probe: error: {}", terminal(&format!("{e:#}")));
            ExitCode::from(exit::ERROR as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `probe …` command in the README's shell blocks, as a user would type it, parses:
    /// `sudo` and comments left out, continuation lines joined, an optional `[--flag]` taken both
    /// with and without it, `$(…)` given a pid. (tests/fit.rs runs the quick ones for real.)
    #[test]
    fn every_readme_command_parses() {
        let readme = include_str!("../../README.md");
        let mut n = 0;
        for block in readme.split("```sh\n").skip(1) {
            let block = block.split("```").next().unwrap_or_default();
            let joined = block.replace("\\\n", " ");
            for line in joined.lines() {
                let line = line.split(" # ").next().unwrap_or_default().trim();
                let line = line.strip_prefix("sudo ").unwrap_or(line);
                let Some(rest) = line.strip_prefix("probe ") else { continue };
                let rest = rest.split(" && ").next().unwrap_or_default();
                let rest = rest.replace("$(pgrep -o llama-server)", "1234");
                let variants: Vec<String> = if rest.contains('[') {
                    let bare: String = rest.replace(['[', ']'], "");
                    let without = rest.split('[').next().unwrap_or_default().to_string() + rest.split(']').nth(1).unwrap_or_default();
                    vec![bare, without]
                } else {
                    vec![rest.clone()]
                };
                for v in variants {
                    let args: Vec<String> = std::iter::once("probe".to_string()).chain(shell_words(&v)).collect();
                    if let Err(e) = Cli::try_parse_from(&args) {
                        panic!("README: `{}` does not parse: {e}", args.join(" "));
                    }
                    n += 1;
                }
            }
        }
        assert!(n >= 20, "only {n} README commands found");
    }

    /// Words as a shell splits them (single and double quotes; no expansion).
    fn shell_words(s: &str) -> Vec<String> {
        let (mut words, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
        for c in s.chars() {
            match (quote, c) {
                (None, '\'' | '"') => (quote, any) = (Some(c), true),
                (Some(q), c) if c == q => quote = None,
                (None, c) if c.is_whitespace() => {
                    if any || !cur.is_empty() {
                        words.push(std::mem::take(&mut cur));
                    }
                    any = false;
                }
                (_, c) => cur.push(c),
            }
        }
        if any || !cur.is_empty() {
            words.push(cur);
        }
        words
    }

    /// Every subcommand, option and argument says what it is for in `--help` (issue 24).
    /// The README's `probe export DIR --otlp URL` parses as written; without either, --format
    /// is asked for.
    #[test]
    fn export_with_otlp_alone_is_otlp_json() {
        let r = Cli::try_parse_from(["probe", "export", "d", "--otlp", "http://127.0.0.1:4318"]).unwrap();
        assert!(matches!(r.command, Command::Export { format: None, otlp: Some(_), .. }));
        let e = Cli::try_parse_from(["probe", "export", "d"]).err().unwrap().to_string();
        assert!(e.contains("--format"), "{e}");
    }

    #[test]
    fn every_option_and_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = a.get_id().as_str();
                if id != "help" && id != "version" && a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                let p = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() && sub.get_long_about().is_none() {
                    missing.push(p.clone());
                }
                walk(sub, &p, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&<Cli as clap::CommandFactory>::command(), "probe", &mut missing);
        assert!(missing.is_empty(), "without help: {missing:#?}");
    }

    #[test]
    fn sizes_parse_with_binary_units_and_bounds() {
        assert_eq!(parse_size("100M"), Ok(100 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        for bad in ["", "abc", "10X", "1K", "-5M", "NaN", "inf", "99999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(max_size_text(100 << 20), "100M");
        assert_eq!(max_size_text(300_000), "300000");
    }

    #[test]
    fn trace_options_are_bounded() {
        assert_eq!(parse_ring_mb("16"), Ok(16));
        assert_eq!(parse_ring_mb("1024"), Ok(1024));
        for bad in ["0", "3", "2048", "4096", "-1", "x"] {
            assert!(parse_ring_mb(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_sample_hz("0"), Ok(0.0));
        assert_eq!(parse_sample_hz("2.5"), Ok(2.5));
        for bad in ["NaN", "inf", "-1", "1e9", "x"] {
            assert!(parse_sample_hz(bad).is_err(), "{bad}");
        }
        assert!(parse_trace_duration("0").is_err());
        assert!(parse_trace_duration("0s").is_err());
        assert_eq!(parse_trace_duration("2s"), Ok(Duration::from_secs(2)));
        for (hz, ok) in [("0", false), ("1", true), ("10000", true), ("10001", false), ("18446744073709551615", false)] {
            let r = Cli::try_parse_from(["probe", "trace", "--pid", "1", "--hz", hz]);
            assert_eq!(r.is_ok(), ok, "--hz {hz}");
        }
        let r = Cli::try_parse_from(["probe", "trace", "--pid", "1", "--max-duration", "5s"]).unwrap();
        assert!(matches!(r.command, Command::Trace { duration: Some(d), .. } if d == Duration::from_secs(5)));
    }
}
