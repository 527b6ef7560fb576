//! `cargo xtask`: setup, build, test, demo and bench for probe. Every entry point runs the
//! idempotent setup first, so a fresh machine needs only these commands.
use std::{path::PathBuf, process::Command};

use clap::{Parser, Subcommand};

mod bench;
mod cost;
mod demo;
mod fuzz;
mod python_cost;
mod report;
mod setup;
mod soak;
mod test;
mod workload;

use bench::{bench, bench_cost_only, bench_stop};
use demo::demo;
use fuzz::fuzz;
use setup::{bin, build, deb, elevated, image, require_root, root, run, setup, sudo_ready};
use test::test;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks (nightly rust-src, bpf-linker), cached in ~/.cache/probe.
    Setup,
    /// Setup, then build `probe` (release) and the test workloads.
    Build,
    /// Setup, build, then run every test (unit, golden and kernel tests; needs root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        args: Vec<String>,
    },
    /// The main job end to end: trace a real llama-server through a slow morning request (asleep,
    /// its model out of the page cache), a few ordinary ones, and one under a CPU hog; print the
    /// verdicts.
    Demo,
    /// Measure: start-to-armed time (median of 10), the drained event rate at a high event rate,
    /// reporting, llama-server's speed traced and untraced, and the cost of tracing it (probe
    /// beside bpftrace).
    Bench {
        /// Only the tracing cost: probe and bpftrace on an idle and a generating llama-server.
        #[arg(long)]
        cost: bool,
        /// Only Ctrl-C to exit: on an idle process and under an mmap/munmap flood.
        #[arg(long)]
        stop: bool,
        /// Only what Python frames cost: llama-cpp-python and vLLM under the same load, traced
        /// with and without them.
        #[arg(long)]
        python: bool,
    },
    /// A real llama-server under concurrent streaming clients for minutes, every probe on: probe's
    /// peak memory and its slope, events lost, recording size per minute, probe's CPU.
    Soak {
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        #[arg(long, default_value_t = 8)]
        clients: usize,
    },
    /// Several producer threads against probe's ring buffer: drained events/s, where loss starts.
    Stress,
    /// Build probe and install it as the README's Security section says: /usr/local/bin/probe
    /// (or --prefix), mode 0750, group `probe`, its capabilities, man pages and completions
    /// (scripts/install.sh; sudo is asked for once). `--uninstall` removes them.
    Install {
        #[arg(long, default_value = "/usr/local")]
        prefix: String,
        /// The group that may run it.
        #[arg(long, default_value = "probe")]
        group: String,
        #[arg(long)]
        uninstall: bool,
    },
    /// Build probe and its .deb (target/debian/probe_VERSION_ARCH.deb; cargo-deb, built once into
    /// ~/.cache/probe): `sudo apt install ./target/debian/probe_*.deb` installs it.
    Deb,
    /// Build probe (release) and its OCI image with podman or docker (scripts/image.sh): `FROM
    /// scratch`, the binary and the libraries it links, tagged localhost/probe:VERSION and
    /// :latest, in root's image store (through sudo when run as a user). deploy/kubernetes/probe.yaml
    /// runs it.
    Image {
        /// podman or docker (default: podman when installed).
        #[arg(long)]
        engine: Option<String>,
        /// Also write the image to this file as an OCI archive (for `ctr images import` or
        /// `podman load` on a node).
        #[arg(long)]
        save: Option<PathBuf>,
    },
    /// Setup, build the fuzz targets in fuzz/ (cargo-fuzz, nightly), run each for `--secs` on a
    /// scratch copy of its committed corpus; fails with the crashing input's path.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        secs: u64,
    },
}

fn main() -> std::process::ExitCode {
    // One line per cause, no backtrace (RUST_BACKTRACE may be set): what failed stays at the end
    // of a CI log.
    match run_cmd(Cli::parse().cmd) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_cmd(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Setup => setup(),
        Cmd::Build => build(),
        Cmd::Test { args } => test(&args),
        Cmd::Demo => demo(),
        Cmd::Bench { cost: true, .. } => bench_cost_only(),
        Cmd::Bench { python: true, .. } => {
            require_root()?;
            build()?;
            python_cost::bench_python()
        }
        Cmd::Bench { stop: true, .. } => {
            require_root()?;
            build()?;
            let dir = root().join("target/bench/stop");
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            bench_stop(&dir)
        }
        Cmd::Bench { .. } => bench(),
        Cmd::Soak { minutes, clients } => soak::soak(minutes, clients),
        Cmd::Stress => soak::stress(),
        Cmd::Fuzz { secs } => fuzz(secs),
        Cmd::Image { engine, save } => {
            build()?;
            // Root's image store: the agent runs as root (privileged, eBPF).
            sudo_ready()?;
            let tag = image(engine.as_deref(), save.as_deref(), true)?;
            println!("image: {tag} (and localhost/probe:latest); deploy/kubernetes/probe.yaml runs {tag}");
            Ok(())
        }
        Cmd::Deb => {
            build()?;
            println!("{}", deb()?.display());
            Ok(())
        }
        Cmd::Install { prefix, group, uninstall } => {
            if !uninstall {
                setup()?;
                run(Command::new("cargo").current_dir(root()).args(["build", "--release", "-p", "probe-user"]))?;
            }
            sudo_ready()?;
            let mut c = elevated("bash");
            c.current_dir(root()).arg(root().join("scripts/install.sh")).args(["--prefix", &prefix, "--group", &group]);
            if uninstall {
                c.arg("--uninstall");
            } else {
                c.arg(bin("probe"));
            }
            run(&mut c)
        }
    }
}
