//! `probe trace`: attach to a running server, record, stop, write every output.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::{collector, exit, util::text::terminal};

use super::*;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "cgroup", "container"])))]
pub struct Args {
    /// The process to trace (e.g. `pgrep -o llama-server`), as the host's /proc numbers it.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Every process of this cgroup (v2; relative to /sys/fs/cgroup or absolute), followed as
    /// processes join and leave it; the trace ends when it is empty.
    #[arg(long)]
    pub cgroup: Option<String>,
    /// Every process of this container (Docker, Podman, containerd, CRI-O): its name, or at
    /// least 4 characters of its id; found through its cgroup.
    #[arg(long)]
    pub container: Option<String>,
    /// Stop after this long (e.g. 30s, 2m, 500ms; also --max-duration). Default: until
    /// Ctrl-C or the target exits.
    #[arg(long, visible_alias = "max-duration", value_parser = parse_trace_duration)]
    pub duration: Option<Duration>,
    /// Stop once the recording holds this much (e.g. 500M, 2G; K, M, G, T are powers of
    /// 1024), as --duration does. It may pass it by what the ring buffer holds at that moment (and
    /// what probe copied out of it unread while every CPU was busy).
    #[arg(long, value_parser = parse_size)]
    pub max_size: Option<u64>,
    /// Recording directory, created new with mode 0700 (an existing one must be empty and
    /// yours). Default: probe-PID-UNIXTIME in the current directory.
    #[arg(short, long, visible_alias = "output")]
    pub out: Option<PathBuf>,
    /// Replace the recording already in --out (one of yours; other files there are kept).
    #[arg(long)]
    pub force: bool,
    /// Only these probes (comma separated): blockio, fault, filemap, mmap, sock, stream, cpu,
    /// offcpu, mem, proc, engine (llama.cpp's decode steps, by uprobe).
    /// A named probe that cannot attach is an error; by default such probes are skipped.
    #[arg(long, value_delimiter = ',')]
    pub probes: Option<Vec<String>>,
    /// Ring buffer size in MiB (a power of two, 1 to 1024). While every CPU is busy probe leaves
    /// its records there (a 256-token request of llama-server on 2 busy cores: 7 MB/s); 32 holds
    /// 2 s of that before probe copies them out. Smaller arms faster (16: about 10 ms less).
    #[arg(long, default_value_t = 32, value_parser = parse_ring_mb)]
    pub ring_mb: u32,
    /// Print report.json instead of the human summary at the end.
    #[arg(long)]
    pub json: bool,
    /// On-CPU stack sampling frequency, per thread (Hz, 1 to 10000; `--probes` without cpu
    /// turns sampling off).
    #[arg(long, default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=MAX_HZ))]
    pub hz: u64,
    /// Also store the bytes of request streams (prompts, answers) in the recording. Off by
    /// default: only request metadata (timing, sizes, stop reasons) is kept.
    #[arg(long)]
    pub capture_text: bool,
    /// Native frames only in CPython targets' stacks: their Python frames (`module.function
    /// (file.py:line)` in place of the interpreter's evaluation frames) are not read.
    #[arg(long)]
    pub no_python_frames: bool,
    /// The most of one core (percent) the Python frames' own work may take, over any 5 s:
    /// the kernel's walks and probe's reading and naming. Beyond it they are turned off for
    /// the rest of the trace, and the report says so. 0: no limit.
    #[arg(long, default_value_t = 1.0, value_parser = parse_budget)]
    pub python_budget: f64,
    /// The most user stack (KiB, 1 to 128) a stack record copies. Whole stacks need as much as
    /// the thread's frames take (llama-server's main thread: 80 KiB, learned per thread); less
    /// makes each sample cheaper and cuts deeper stacks: 64 halves what llama-server's CPU
    /// samples copy and leaves its main thread's stacks short of `main`. Copies come in sizes
    /// of 1, 2, 4 … 64 and 128 KiB: a value between two copies the smaller.
    #[arg(long, default_value_t = STACK_KIB_MAX, value_parser = clap::value_parser!(u32).range(1..=i64::from(STACK_KIB_MAX)))]
    pub stack_kib: u32,
    /// GPU (NVML), CPU-frequency and memory-pressure samples per second (up to 1000); 0
    /// turns them off.
    #[arg(long, default_value_t = 10.0, value_parser = parse_sample_hz)]
    pub sample_hz: f64,
    /// Do not poll the server's own endpoints (llama.cpp /metrics and /props, vLLM /metrics,
    /// Ollama /api/ps) on the ports it listens on.
    #[arg(long)]
    pub no_poll: bool,
    /// Keep the ring's drain and the samplers at normal priority and never hold them back: by
    /// default they yield the CPUs to the server (idle priority) and, while every CPU is busy,
    /// wait (records in the ring, memory and GPU readings every 3 s instead of --sample-hz).
    /// With this the readings keep their rate, and the verdicts may name probe as a competitor.
    #[arg(long)]
    pub no_yield: bool,
    /// Do not keep the verified kernel programs for the next trace, and remove any kept. By
    /// default a trace takes the programs an earlier one kept pinned in /sys/fs/bpf/probe (not
    /// verified again: arming is then mostly attaching) and keeps its own there when it ends;
    /// nothing of them runs between traces, but their maps stay allocated (the ring, --ring-mb,
    /// and about 28 MiB more) until this flag or a reboot removes them.
    #[arg(long)]
    pub no_keep: bool,
    #[command(flatten)]
    pub auth: crate::util::httpc::ServerAuth,
    /// Send the requests as OpenTelemetry spans (with their verdicts) to this OTLP/HTTP
    /// collector, e.g. http://127.0.0.1:4318 (Jaeger, Tempo, the OpenTelemetry Collector).
    #[arg(long, value_parser = crate::render::export::otlp::Endpoint::parse)]
    pub otlp: Option<crate::render::export::otlp::Endpoint>,
    /// No live view: on a terminal, probe otherwise shows each request in flight and what it
    /// waits on, once a second (without a terminal it never does).
    #[arg(short, long)]
    pub quiet: bool,
    /// Say what arming took, stage by stage (kernel BTF, object load, programs, the slowest
    /// programs), after the "armed" line.
    #[arg(short, long)]
    pub verbose: bool,
}

/// `--stack-kib`'s largest value (the kernel's largest copy, 128 KiB): no cap.
const STACK_KIB_MAX: u32 = 128;

/// `probe trace`: attach, record, stop, write every output.
pub fn run(args: Args, started: Instant) -> anyhow::Result<i32> {
    let Args {
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
        stack_kib,
        sample_hz,
        no_poll,
        no_yield,
        no_keep,
        auth,
        otlp,
        quiet,
        verbose,
    } = args;
    auth.install();
    if no_yield {
        crate::os::yielding::never();
    }
    let cgroup = match (&cgroup, &container) {
        (Some(c), _) => Some(crate::os::cgroup::resolve(c)?),
        (_, Some(c)) => Some(crate::os::cgroup::find_container(c)?),
        _ => None,
    };
    let pid = match (pid, &cgroup) {
        (Some(p), _) => p,
        (None, Some(cg)) => crate::os::cgroup::main_pid(&crate::os::cgroup::procs(cg))
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
        stack_limit: if stack_kib >= STACK_KIB_MAX { 0 } else { stack_kib << 10 },
        keep: if no_keep { crate::kernel::kept::Keep::Forget } else { crate::kernel::kept::Keep::Take },
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
        write!(stdout, "{}", terminal(&crate::render::text::render(&outcome.report))).and_then(|()| {
            writeln!(stdout, "\nrecording: {}  (report.json beside it; `probe report {}` prints this again)", out.display(), out.display())
        })
    };
    Ok(if outcome.partial { exit::PARTIAL } else { exit::OK })
}
