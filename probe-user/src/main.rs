//! The `probe` command line: parse, set up logging, run, print errors with their causes, exit
//! with a documented code (0 ok, 1 partial: probes skipped or events lost, 2 error).
use std::{
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use probe_user::{bench, bundle, collector, doctor, exit, flame, output, perfetto, recording, report, text::terminal};

#[derive(Parser)]
#[command(name = "probe", version, about = "eBPF tracing for local LLM servers: why was the first token slow?")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Trace a running process (and processes it starts) until Ctrl-C, the duration, or its exit.
    Trace {
        /// The process to trace (e.g. `pgrep -o llama-server`).
        #[arg(long)]
        pid: u32,
        /// Stop after this long (e.g. 30s, 2m, 500ms). Default: until Ctrl-C or the target exits.
        #[arg(long, value_parser = parse_duration)]
        duration: Option<Duration>,
        /// Recording directory, created new with mode 0700 (an existing one must be empty and
        /// yours). Default: probe-PID-UNIXTIME in the current directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace the recording already in --out (one of yours; other files there are kept).
        #[arg(long)]
        force: bool,
        /// Only these probes (comma separated): blockio, fault, filemap, mmap, sock, stream, cpu,
        /// offcpu, mem, proc.
        /// A named probe that cannot attach is an error; by default such probes are skipped.
        #[arg(long, value_delimiter = ',')]
        probes: Option<Vec<String>>,
        /// Ring buffer size in MiB (a power of two).
        #[arg(long, default_value_t = 16)]
        ring_mb: u32,
        /// Print report.json instead of the human summary at the end.
        #[arg(long)]
        json: bool,
        /// On-CPU stack sampling frequency, per thread (Hz).
        #[arg(long, default_value_t = 99)]
        hz: u64,
        /// Also store the bytes of request streams (prompts, answers) in the recording. Off by
        /// default: only request metadata (timing, sizes, stop reasons) is kept.
        #[arg(long)]
        capture_text: bool,
        /// GPU (NVML), CPU-frequency and memory-pressure samples per second; 0 turns them off.
        #[arg(long, default_value_t = 10.0)]
        sample_hz: f64,
        /// Do not poll the server's own endpoints (llama.cpp /metrics and /props, vLLM /metrics,
        /// Ollama /api/ps) on the ports it listens on.
        #[arg(long)]
        no_poll: bool,
    },
    /// Read a recording directory again and print its summary (or its JSON).
    Report {
        dir: PathBuf,
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
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Replace --output if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
    },
    /// Write the recording as a Chrome trace-event JSON timeline (opens in the Perfetto UI).
    Timeline {
        dir: PathBuf,
        /// Output file (default DIR/timeline.json).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Replace --output if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
    },
    /// Pack a recording's report, flamegraphs, timeline and environment into one .tar.gz for an
    /// issue (never the raw event log, so no prompt or response text).
    Bundle {
        dir: PathBuf,
        /// Output file (default DIR.tar.gz beside the recording). Created new, mode 0600.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Replace the output file if it exists (never through a symbolic link).
        #[arg(long)]
        force: bool,
        /// Hide directory names in paths and IP addresses.
        #[arg(long)]
        mask: bool,
    },
    /// Say which kernel features are present and what probe can do here.
    Doctor,
    /// Write a synthetic recording with a real trace's mix of records (the report benchmark).
    #[command(hide = true)]
    Synth {
        /// Kernel events and stack records to write.
        #[arg(long)]
        events: u64,
        #[arg(long)]
        out: PathBuf,
    },
    /// Drive a running server with controlled experiments (concurrency, prompt length, idle
    /// time) and explain every change in length or latency with stop reasons and verdicts.
    Bench(Box<bench::BenchArgs>),
}

/// `--duration`: `30s`, `2m`, `500ms`, `1h 30m` (humantime); a bare number is seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    probe_user::parse_duration_or(s, Duration::from_secs(1))
}

fn run(cli: Cli, started: Instant) -> anyhow::Result<i32> {
    match cli.command {
        Command::Trace { pid, duration, out, force, probes, ring_mb, json, hz, capture_text, sample_hz, no_poll } => {
            if !ring_mb.is_power_of_two() {
                anyhow::bail!("--ring-mb must be a power of two (got {ring_mb})");
            }
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
                sample_hz: hz,
                host_hz: sample_hz.max(0.0),
                poll: !no_poll,
                started,
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&outcome.report)?);
            } else {
                print!("{}", terminal(&report::render(&outcome.report)));
                println!("\nrecording: {}  (report.json beside it; `probe report {}` prints this again)", out.display(), out.display());
            }
            Ok(if outcome.partial { exit::PARTIAL } else { exit::OK })
        }
        Command::Report { dir, sizes: true, .. } => {
            let s = recording::sizes(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            println!("{:<16} {:>12} {:>14} {:>10}", "kind", "records", "bytes", "per record");
            for (k, (n, b)) in &s {
                println!("{k:<16} {n:>12} {b:>14} {:>10.1}", *b as f64 / (*n).max(1) as f64);
            }
            Ok(exit::OK)
        }
        Command::Report { dir, json, html, .. } => {
            let r = if html {
                let (page, r) = probe_user::html::write(&dir)?;
                println!("{}", page.display());
                r
            } else {
                // Streamed: memory does not grow with the recording.
                report::build_dir(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else if !html {
                print!("{}", terminal(&report::render(&r)));
            }
            // A torn or corrupt recording is reported from what was whole, and says so (exit 1).
            Ok(if r.lost_events.values().any(|&n| n > 0) || !r.problems.is_empty() { exit::PARTIAL } else { exit::OK })
        }
        Command::Flamegraph { dir, kind, request, from, to, output, force } => {
            let kind = flame::Kind::parse(&kind).with_context(|| format!("unknown kind `{kind}`: choose cpu, offcpu, faults or io"))?;
            let meta = recording::read_meta(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            let start = meta.map_or(0, |m| m.start_ns);
            let secs = |s: f64| start + (s * 1e9) as u64;
            let mut window = flame::Window { from_ns: from.map(secs), to_ns: to.map(secs) };
            if let Some(id) = request {
                let r = report::build_dir(&dir)?;
                let q = r
                    .requests
                    .iter()
                    .find(|q| q.id == id)
                    .with_context(|| format!("no request {id} in this recording (see `probe report {}`)", dir.display()))?;
                let arrival =
                    q.arrival_ms.with_context(|| format!("request {id} was already in flight when probe attached: use --from/--to"))?;
                window.from_ns = Some(start + (arrival * 1e6) as u64);
                window.to_ns = Some(start + ((arrival + q.end_ms.unwrap_or(0.0)) * 1e6) as u64);
            }
            // Streamed: every stack of the recording, however long.
            let folded = flame::Flames::of_dir(&dir, window)?.get(kind);
            if folded.is_empty() {
                anyhow::bail!("no {} stacks in {} for this window", kind.name(), dir.display());
            }
            let title = match request {
                Some(id) => format!("probe: {} stacks of request {id}", kind.name()),
                None => format!("probe: {} stacks", kind.name()),
            };
            let (svg, text) = (flame::svg(&folded, kind, &title)?, flame::folded_text(&folded));
            let out = match output {
                Some(out) => {
                    output::write_file(&out, &svg, force)?;
                    output::write_file(&out.with_extension("folded"), text.as_bytes(), force)?;
                    out
                }
                None => {
                    let d = output::OutDir::open(&dir)?;
                    d.write(&format!("flame-{}.folded", kind.name()), text.as_bytes())?;
                    d.write(&format!("flame-{}.svg", kind.name()), &svg)?
                }
            };
            println!("{} ({} stacks, weight {})", out.display(), folded.len(), folded.values().sum::<u64>());
            Ok(exit::OK)
        }
        Command::Timeline { dir, output, force } => {
            let rec = recording::read_dir(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            let trace = perfetto::build(&rec, &report::build_dir(&dir)?, &probe_user::ksyms::Names::of(&rec));
            let bytes = serde_json::to_vec(&trace)?;
            let out = match output {
                Some(out) => {
                    output::write_file(&out, &bytes, force)?;
                    out
                }
                None => output::OutDir::open(&dir)?.write("timeline.json", &bytes)?,
            };
            println!("{} ({} events; open it in the Perfetto UI)", out.display(), trace["traceEvents"].as_array().map_or(0, Vec::len));
            Ok(exit::OK)
        }
        Command::Bundle { dir, output, mask, force } => {
            let r = report::build_dir(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            let rec = recording::read_dir(&dir).with_context(|| format!("cannot read the recording in {}", dir.display()))?;
            let name = dir
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "probe".into());
            let out = output.unwrap_or_else(|| dir.with_file_name(format!("{name}.tar.gz")));
            let flames = flame::Flames::of_dir(&dir, flame::Window::default())?;
            let files = bundle::write(&rec, &r, &flames, &out, mask, force)?;
            println!("{} ({})", out.display(), files.join(", "));
            Ok(exit::OK)
        }
        Command::Doctor => Ok(doctor::run()),
        Command::Synth { events, out } => {
            let s = probe_user::synth::write(&out, events)?;
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

fn main() -> ExitCode {
    let started = Instant::now();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(cli, started) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("probe: error: {}", terminal(&format!("{e:#}")));
            ExitCode::from(exit::ERROR as u8)
        }
    }
}
