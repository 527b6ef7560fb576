//! `cargo xtask fuzz`: every fuzz target for a while on a scratch copy of its corpus.
use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context, bail};

use crate::setup::{root, run, setup};

/// Every fuzz target for `secs` seconds (two at a time on two cores), with overflow checks and
/// debug assertions on, a memory limit and a per-input timeout (a hang or a blow-up fails too).
/// Targets start from a scratch copy of fuzz/corpus/<target> under target/fuzz-corpus (the
/// committed corpus is never written); crashing inputs land in target/fuzz-artifacts/<target>.
pub(crate) fn fuzz(secs: u64) -> anyhow::Result<()> {
    // (target, -max_len): a recording needs room for a few frames of every kind.
    const TARGETS: [(&str, u32); 6] = [
        ("stream_tracker", 16384),
        ("http_body", 4096),
        ("splitter", 4096),
        ("recording_report", 65536),
        ("exposition", 16384),
        ("python_frames", 16384),
    ];
    setup()?;
    let root = root();
    let cache = std::env::var_os("PROBE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/probe")))
        .context("neither PROBE_CACHE nor HOME is set")?;
    let path = std::env::join_paths(
        std::iter::once(cache.join("cargo-fuzz/bin")).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )?;
    let target_dir = root.join("target/fuzz");
    // -O -a: release with debug assertions and overflow checks; -s none: no AddressSanitizer (the
    // code is safe Rust: ASan would double the build and halve the execs/s for little). AYA_BUILD_SKIP:
    // probe-user without its eBPF object (the targets never load it; see probe-user/build.rs).
    let cargo_fuzz = |args: &[&str]| {
        let mut c = Command::new("cargo");
        c.current_dir(root.join("fuzz")).env("PATH", &path).env("AYA_BUILD_SKIP", "1").args(["+nightly", "fuzz"]).args(args);
        c.args(["-O", "-a", "-s", "none", "--target-dir"]).arg(&target_dir);
        c
    };
    let t = Instant::now();
    run(&mut cargo_fuzz(&["build"]))?;
    println!("fuzz: built {} targets in {:.0} s", TARGETS.len(), t.elapsed().as_secs_f64());
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).min(TARGETS.len());
    let mut failed = Vec::new();
    for batch in TARGETS.chunks(jobs) {
        let mut running = Vec::new();
        for &(name, max_len) in batch {
            let corpus = root.join("target/fuzz-corpus").join(name);
            let artifacts = root.join("target/fuzz-artifacts").join(name);
            let log = root.join("target/fuzz-logs").join(format!("{name}.log"));
            let _ = std::fs::remove_dir_all(&corpus);
            for d in [&corpus, &artifacts, &log.parent().context("log dir")?.to_path_buf()] {
                std::fs::create_dir_all(d)?;
            }
            for f in std::fs::read_dir(root.join("fuzz/corpus").join(name))? {
                let f = f?;
                std::fs::copy(f.path(), corpus.join(f.file_name()))?;
            }
            let mut cmd = cargo_fuzz(&["run", name]);
            cmd.arg(&corpus).arg("--").args([
                format!("-max_total_time={secs}"),
                format!("-max_len={max_len}"),
                "-rss_limit_mb=2560".into(),
                "-timeout=10".into(),
                "-print_final_stats=1".into(),
                format!("-artifact_prefix={}/", artifacts.display()),
            ]);
            if name != "recording_report" {
                cmd.arg(format!("-dict={}", root.join("fuzz/http.dict").display()));
            }
            let out = std::fs::File::create(&log)?;
            let child = cmd.stdout(out.try_clone()?).stderr(out).spawn().context("cannot run cargo fuzz")?;
            running.push((name, corpus, log, child));
        }
        for (name, corpus, log, mut child) in running {
            let status = child.wait()?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let stat = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)).map_or("?".to_string(), |v| v.trim().to_string());
            let files = std::fs::read_dir(&corpus).map_or(0, |d| d.count());
            println!(
                "fuzz: {name}: {} execs, {} execs/s, corpus {files} inputs, peak RSS {} MB ({})",
                stat("stat::number_of_executed_units:"),
                stat("stat::average_exec_per_sec:"),
                stat("stat::peak_rss_mb:"),
                if status.success() { "ok".to_string() } else { format!("FAILED: {status}") }
            );
            if !status.success() {
                // The panic (or libFuzzer's timeout / out-of-memory line) and what follows it.
                let lines: Vec<&str> = text.lines().collect();
                let from = lines
                    .iter()
                    .position(|l| l.contains("panicked at") || l.starts_with("==") || l.contains("ERROR: libFuzzer"))
                    .unwrap_or(lines.len().saturating_sub(30));
                let shown = lines[from..].iter().take_while(|l| !l.starts_with("stack backtrace:")).take(30);
                for l in shown.chain(lines.iter().filter(|l| l.starts_with("SUMMARY:"))) {
                    println!("  {}", l.chars().take(400).collect::<String>());
                }
                let artifact = text.lines().find_map(|l| l.split("Test unit written to ").nth(1)).unwrap_or("(none written)");
                println!("fuzz: {name} failed; input: {artifact}; log: {}", log.display());
                println!(
                    "fuzz: reproduce with: cd fuzz && AYA_BUILD_SKIP=1 cargo +nightly fuzz run -O -a -s none --target-dir ../target/fuzz {name} {artifact}"
                );
                failed.push(name);
            }
        }
    }
    if !failed.is_empty() {
        bail!("fuzz targets failed: {}", failed.join(", "));
    }
    println!("fuzz: {} targets × {secs} s, no failure ({:.0} s in all)", TARGETS.len(), t.elapsed().as_secs_f64());
    Ok(())
}
