//! The `probe` command line: parse, set up logging, run, print errors with their causes, exit
//! with a documented code (0 ok, 1 partial: probes skipped or events lost, 2 error).
use std::{path::PathBuf, process::ExitCode, time::Instant};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use probe_user::{bench, cmd, exit, record, util::text::terminal};

#[derive(Parser)]
#[command(name = "probe", version, about = "eBPF tracing for local LLM servers: why was the first token slow?")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Trace a running process (and processes it starts) until Ctrl-C, the duration, or its exit.
    Trace(probe_user::cmd::trace::Args),
    /// Stay on: follow a server (across restarts), keep a window of recent events, save an
    /// incident directory for every slow or abnormal request and for a server exit, and serve
    /// Prometheus metrics. Runs until SIGINT/SIGTERM (see scripts/probe-watch.service).
    Watch(probe_user::cmd::watch::Args),
    /// Read a recording directory again and print its summary (or its JSON).
    Report(probe_user::cmd::report::Args),
    /// Draw a flamegraph (SVG, plus the folded stacks beside it) from a recording.
    Flamegraph(probe_user::cmd::flamegraph::Args),
    /// Write the recording as a Chrome trace-event JSON timeline (opens in the Perfetto UI).
    Timeline(probe_user::cmd::timeline::Args),
    /// Export a recording for other tools: its stacks as pprof profiles (`go tool pprof`,
    /// Pyroscope, Grafana, Parca, speedscope), its requests as OpenTelemetry spans (OTLP/JSON, or
    /// sent to a collector with --otlp).
    Export(probe_user::cmd::export::Args),
    /// Pack a recording's report, flamegraphs, timeline and environment into one .tar.gz for an
    /// issue (never the raw event log, so no prompt or response text).
    Bundle(probe_user::cmd::bundle::Args),
    /// Compare: a recording's slowest request against its warm baseline, one request against
    /// another, or two recordings (today's against yesterday's). Writes diff.md, diff.json and
    /// differential flamegraphs (diff-cpu.svg, diff-offcpu.svg, with their folded stacks).
    Diff(probe_user::cmd::diff::Args),
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

fn run(cli: Cli, started: Instant) -> anyhow::Result<i32> {
    match cli.command {
        Command::Trace(args) => cmd::trace::run(args, started),
        Command::Watch(args) => cmd::watch::run(args, started),
        Command::Report(args) => cmd::report::run(args),
        Command::Flamegraph(args) => cmd::flamegraph::run(args),
        Command::Timeline(args) => cmd::timeline::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Bundle(args) => cmd::bundle::run(args),
        Command::Diff(args) => cmd::diff::run(args),
        Command::Doctor => Ok(cmd::doctor::run()),
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
    use std::time::Duration;

    use probe_user::cmd::{max_size_text, parse_ring_mb, parse_sample_hz, parse_size, parse_trace_duration};

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
        assert!(matches!(r.command, Command::Export(cmd::export::Args { format: None, otlp: Some(_), .. })));
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
        assert!(matches!(r.command, Command::Trace(cmd::trace::Args { duration: Some(d), .. }) if d == Duration::from_secs(5)));
    }
}
