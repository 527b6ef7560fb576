//! `cargo xtask bench`: start-to-armed time, the drained event rate, reporting, llama-server's
//! speed traced and untraced, Ctrl-C to exit, and the watch agent's cost.
use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::report::Report;
use crate::setup::{bin, build, llama, require_root, root, run};
use crate::workload::{Llama, start_workload, wait_for};

/// Interleaved untraced/traced runs of the generation bench.
pub(crate) const PAIRS: usize = 12;

/// Geometric mean of ratios and its 95% confidence interval (Student's t on the log ratios).
pub(crate) fn ratio_interval(r: &[f64]) -> (f64, f64, f64) {
    let n = r.len();
    if n < 2 {
        let m = r.first().copied().unwrap_or(f64::NAN);
        return (m, f64::NAN, f64::NAN);
    }
    let logs: Vec<f64> = r.iter().map(|x| x.ln()).collect();
    let mean = logs.iter().sum::<f64>() / n as f64;
    let var = logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    // Two-sided 97.5% quantiles of Student's t for 1..=30 degrees of freedom, then normal.
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101,
        2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    let t = T.get(n - 2).copied().unwrap_or(1.96);
    let half = t * (var / n as f64).sqrt();
    (mean.exp(), (mean - half).exp(), (mean + half).exp())
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub(crate) fn bench() -> anyhow::Result<()> {
    require_root()?;
    build()?;
    let dir = root().join("target/bench");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    // 1. Start to armed: wall time from spawning `probe trace` to its "armed" line.
    let mut sleeper = Command::new("sleep").arg("600").spawn()?;
    let (mut wall, mut inner) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let t = Instant::now();
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &sleeper.id().to_string(), "--duration", "200ms", "--out"])
            .arg(dir.join(format!("armed-{i}")))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut err = BufReader::new(p.stderr.take().context("stderr")?);
        let mut line = String::new();
        while err.read_line(&mut line)? > 0 {
            if let Some(rest) = line.split("armed in ").nth(1) {
                wall.push(t.elapsed().as_secs_f64() * 1e3);
                inner.push(rest.split(' ').next().unwrap_or("0").parse::<f64>().unwrap_or(0.0));
                break;
            }
            line.clear();
        }
        std::io::copy(&mut err, &mut std::io::sink())?;
        p.wait()?;
    }
    let _ = sleeper.kill();
    println!(
        "start to armed (10 runs): median {:.1} ms wall (spawn → \"armed\"), {:.1} ms inside probe; max {:.1} ms",
        median(wall.clone()),
        median(inner),
        wall.iter().cloned().fold(0.0, f64::max)
    );
    // Stage by stage (report.json's `armed.stages`), medians over the runs.
    let (mut stages, mut slowest): (Vec<(String, Vec<f64>)>, Vec<String>) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let Ok(text) = std::fs::read(dir.join(format!("armed-{i}/report.json"))) else { continue };
        let r: Report = serde_json::from_slice(&text)?;
        let mut slowest_seen = false;
        for (name, ms) in r.armed.stages {
            let name = match name.strip_prefix("program ") {
                Some(_) if slowest_seen => continue,
                Some(p) => {
                    slowest_seen = true;
                    if !slowest.iter().any(|n| n == p) {
                        slowest.push(p.to_string());
                    }
                    "slowest program".to_string()
                }
                None => name,
            };
            match stages.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push(ms),
                None => stages.push((name, vec![ms])),
            }
        }
    }
    let parts: Vec<String> = stages.into_iter().map(|(n, v)| format!("{n} {:.1}", median(v))).collect();
    println!("  stages (median ms): {}; the slowest program: {}", parts.join(", "), slowest.join(" or "));

    // 2. High event rate: mmap+munmap in a tight loop (2 records per iteration), untraced
    //    then traced, in this one invocation.
    let secs = 3.0;
    // (syscalls per second, seconds the loop ran) from the workload's `done calls=N secs=S`.
    let calls = |out: &str| -> (f64, f64) {
        let kv = |k: &str| out.split_whitespace().find_map(|w| w.strip_prefix(k)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (kv("calls=") / kv("secs=").max(1e-9), kv("secs="))
    };
    let run_loop = |traced: bool| -> anyhow::Result<((f64, f64), Option<Report>)> {
        let (mut w, pid, lines) = start_workload(&["mmap-loop", &secs.to_string()])?;
        let rec = dir.join(format!("rate-{traced}"));
        let mut probe = None;
        if traced {
            probe = Some(
                Command::new(bin("probe"))
                    .args(["trace", "--pid", &pid.to_string(), "--probes", "mmap", "--out"])
                    .arg(&rec)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()?,
            );
            wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        }
        writeln!(w.stdin.take().context("stdin")?, "go")?;
        let out = lines.iter().find(|l| l.starts_with("done")).unwrap_or_default();
        w.wait()?;
        let report = match probe {
            Some(mut p) => {
                p.wait()?;
                Some(Report::read(&rec)?)
            }
            None => None,
        };
        Ok((calls(&out), report))
    };
    let ((base, _), _) = run_loop(false)?;
    let ((traced, ran), report) = run_loop(true)?;
    let report = report.context("no report")?;
    let (events, lost) = (report.events, report.lost());
    println!("high event rate (mmap+munmap loop, one record per syscall, {secs} s):");
    println!("  untraced: {:.0} syscalls/s", base);
    println!("  traced:   {:.0} syscalls/s  (ratio {:.2} against untraced)", traced, traced / base.max(1.0));
    println!("  probe drained {events} events ({:.0} events/s while the loop ran {ran:.1} s), lost {lost}", events as f64 / ran.max(1e-9));
    let (secs, rss) = timed(Command::new(bin("probe")).args(["report", "--json"]).arg(dir.join("rate-true")))?;
    println!("  reporting it: {secs:.2} s, peak RSS {:.0} MB; on disk: {}", rss / 1e6, sizes(&dir.join("rate-true"), false)?);
    bench_stop(&dir)?;
    bench_report(&dir)?;
    bench_llama(&dir)?;
    crate::cost::bench_cost(&dir)?;
    watch_all_cost()
}

/// Ctrl-C to exit: SIGINT to `probe trace` (every probe) until it exited with its report written,
/// on an idle process and under an mmap/munmap flood; medians of 5 and of 3.
pub(crate) fn bench_stop(dir: &Path) -> anyhow::Result<()> {
    let stop = |pid: u32, rec: &Path| -> anyhow::Result<f64> {
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &pid.to_string(), "--out"])
            .arg(rec)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
        p.wait()?;
        let secs = t.elapsed().as_secs_f64();
        if !rec.join("report.json").is_file() {
            bail!("probe exited without its report in {}", rec.display());
        }
        Ok(secs)
    };
    let mut sleeper = Command::new("sleep").arg("600").spawn()?;
    let idle = (0..5).map(|i| stop(sleeper.id(), &dir.join(format!("stop-idle-{i}")))).collect::<anyhow::Result<Vec<f64>>>()?;
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let mut flood = Vec::new();
    for i in 0..3 {
        let (mut w, pid, _lines) = start_workload(&["mmap-loop", "10"])?;
        writeln!(w.stdin.take().context("stdin")?, "go")?;
        flood.push(stop(pid, &dir.join(format!("stop-flood-{i}")))?);
        let _ = w.kill();
        let _ = w.wait();
    }
    let ms = |v: &[f64]| format!("median {:.0} ms, max {:.0} ms", median(v.to_vec()) * 1e3, v.iter().cloned().fold(0.0, f64::max) * 1e3);
    println!(
        "Ctrl-C to exit (SIGINT to probe's exit, report written; every probe): idle process {}; under an mmap/munmap flood {}",
        ms(&idle),
        ms(&flood)
    );
    Ok(())
}

/// `cargo xtask bench --cost`: the tracing-cost section alone (its files in target/bench/cost).
pub(crate) fn bench_cost_only() -> anyhow::Result<()> {
    require_root()?;
    build()?;
    crate::cost::bench_cost(&root().join("target/bench"))?;
    watch_all_cost()
}

/// `probe watch --all` as a node agent with 0, 1, 4 and 16 llama-servers (scripts/watch-all-cost.sh):
/// probe's CPU and its BPF programs' run time per wall second.
/// With `PROBE_COST_BASELINE` (an earlier probe binary) the same sweep runs for it first, in the
/// same invocation, so the two tables sit side by side.
pub(crate) fn watch_all_cost() -> anyhow::Result<()> {
    let (server, model) = llama()?;
    let mut bins = Vec::new();
    if let Some(b) = std::env::var_os("PROBE_COST_BASELINE").map(PathBuf::from).filter(|p| p.is_file()) {
        bins.push(("baseline (PROBE_COST_BASELINE)", b));
    }
    bins.push(("this build", bin("probe")));
    for (what, probe) in bins {
        println!("watch --all, {what}: {}", probe.display());
        run(Command::new("bash")
            .arg(root().join("scripts/watch-all-cost.sh"))
            .env("LLAMA_SERVER", &server)
            .env("LLAMA_MODEL", &model)
            .env("PROBE_BIN", probe))?;
    }
    Ok(())
}

/// Wall time and peak RSS (bytes) of a command run to the end, its output discarded.
pub(crate) fn timed(cmd: &mut Command) -> anyhow::Result<(f64, f64)> {
    let t = Instant::now();
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child, with valid pointers.
    let r = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    if r < 0 {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) > 1 {
        bail!("{cmd:?} failed (status {status:#x})");
    }
    Ok((t.elapsed().as_secs_f64(), ru.ru_maxrss as f64 * 1024.0))
}

/// `probe report --sizes DIR` in one line: bytes per record of each kind (`stacks`: also the
/// stack samples; otherwise the kernel records only, with their average).
pub(crate) fn sizes(dir: &Path, stacks: bool) -> anyhow::Result<String> {
    let out = Command::new(bin("probe")).args(["report", "--sizes"]).arg(dir).output()?;
    let (mut parts, mut n, mut bytes) = (vec![], 0u64, 0u64);
    for l in String::from_utf8_lossy(&out.stdout).lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (Some(k), Some(c), Some(b), Some(per)) =
            (f.first(), f.get(1).and_then(|v| v.parse::<u64>().ok()), f.get(2).and_then(|v| v.parse::<u64>().ok()), f.get(3))
        else {
            continue;
        };
        if k.starts_with("json:") || (k.starts_with("stack:") && !stacks) {
            continue;
        }
        if !k.contains(':') {
            n += c;
            bytes += b;
        }
        parts.push(format!("{k} {per} B"));
    }
    Ok(format!("{} ({} kernel records, {:.1} bytes each on average)", parts.join(", "), n, bytes as f64 / n.max(1) as f64))
}

/// Reporting a night-long recording: a synthetic one with a real trace's mix (10 M kernel
/// events and stack samples, 250 requests), and `perf report` on as many samples.
pub(crate) fn bench_report(dir: &Path) -> anyhow::Result<()> {
    const EVENTS: u64 = 10_000_000;
    let night = dir.join("night");
    let out = Command::new(bin("probe")).args(["synth", "--events", &EVENTS.to_string(), "--out"]).arg(&night).output()?;
    if !out.status.success() {
        bail!("probe synth: {}", String::from_utf8_lossy(&out.stderr));
    }
    println!("reporting a night-long recording ({}):", String::from_utf8_lossy(&out.stdout).trim());
    println!("  on disk: {}", sizes(&night, true)?);
    let (secs, rss) = timed(Command::new(bin("probe")).args(["report", "--json"]).arg(&night))?;
    println!("  probe report: {secs:.2} s, peak RSS {:.0} MB (goals: 10 s, 400 MB)", rss / 1e6);
    // Against an earlier probe on the same recording, in the same run (PROBE_BASELINE=path of its
    // binary, e.g. one built from the last release): both are timed twice, alternately, best of two.
    if let Some(base) = std::env::var_os("PROBE_BASELINE").map(PathBuf::from) {
        let best = |b: &Path| -> anyhow::Result<(f64, f64)> {
            let mut t = (f64::MAX, 0.0f64);
            for _ in 0..2 {
                let (s, r) = timed(Command::new(b).args(["report", "--json"]).arg(&night))?;
                t = (t.0.min(s), t.1.max(r));
            }
            Ok(t)
        };
        let (old, new) = (best(&base)?, best(&bin("probe"))?);
        println!(
            "  against {}: {:.2} s and {:.0} MB before, {:.2} s and {:.0} MB now: {:.2}× as fast, {:.2}× the memory",
            base.display(),
            old.0,
            old.1 / 1e6,
            new.0,
            new.1 / 1e6,
            old.0 / new.0.max(1e-9),
            new.1 / old.1.max(1.0)
        );
    }
    // The reference: perf's own report over as many samples (page faults, one sample each; no
    // call chains) of a process writing 40 GB a page at a time.
    let data = dir.join("perf.data");
    let rec = Command::new("perf")
        .args(["record", "-q", "-e", "page-faults", "-c", "1", "-o"])
        .arg(&data)
        .args(["--", "python3", "-c", &format!("for _ in range({}): b = b'\\x01' * (256 << 20)", EVENTS / 65536 + 1)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match rec {
        Ok(s) if s.success() => {
            let (psecs, prss) = timed(Command::new("perf").args(["report", "--stdio", "-i"]).arg(&data))?;
            println!(
                "  perf report --stdio on {} page-fault samples: {psecs:.2} s, peak RSS {:.0} MB; probe/perf: {:.2}× the time, {:.2}× the memory",
                EVENTS / 65536 * 65536 + 65536,
                prss / 1e6,
                secs / psecs.max(1e-9),
                rss / prss.max(1.0)
            );
        }
        _ => println!("  perf record did not run here (perf missing or not permitted): no reference figure"),
    }
    let _ = std::fs::remove_file(&data);
    let _ = std::fs::remove_dir_all(&night);
    Ok(())
}

/// One 256-token completion (ignore_eos, temperature 0, seed 7, no prompt cache) from a
/// llama-server: tokens/s as the server measured it (timings.predicted_per_second).
pub(crate) fn generate_256(addr: &str) -> anyhow::Result<f64> {
    let body = r#"{"prompt":"Write a long story about a lighthouse keeper and the sea.","n_predict":256,"seed":7,"temperature":0,"cache_prompt":false,"ignore_eos":true}"#;
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(s, "POST /completion HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    predicted_per_second(text.split("\r\n\r\n").nth(1).context("no body")?)
}

/// The generation speed in a /completion answer's body.
fn predicted_per_second(json: &str) -> anyhow::Result<f64> {
    let v: Completion = serde_json::from_str(json)?;
    v.timings.and_then(|t| t.predicted_per_second).context("no timings")
}

/// The part of llama-server's /completion answer read here (its `timings`).
#[derive(Deserialize)]
struct Completion {
    timings: Option<Timings>,
}

#[derive(Deserialize)]
struct Timings {
    predicted_per_second: Option<f64>,
}

/// Generation speed of a real llama-server untraced and traced (all probes, 99 Hz CPU stacks
/// with unwinding), interleaved: the ratio, and the unwinding cost per sample.
pub(crate) fn bench_llama(dir: &Path) -> anyhow::Result<()> {
    let srv = Llama::start(&["-c", "2048", "-np", "1"], None)?;
    let addr = srv.addr.clone();
    let generate = || generate_256(&addr);
    generate()?; // warm up
    let (mut plain, mut traced, mut unwind_us, mut load_ms, mut samples) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0u64);
    for i in 0..PAIRS {
        plain.push(generate()?);
        let rec = dir.join(format!("llama-{i}"));
        let mut p = Command::new(bin("probe"))
            .args(["trace", "--pid", &srv.pid(), "--hz", "99", "--out"])
            .arg(&rec)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        traced.push(generate()?);
        Command::new("kill").args(["-INT", &p.id().to_string()]).status()?;
        p.wait()?;
        let r = Report::read(&rec)?;
        unwind_us.push(r.unwind.us_per_sample);
        load_ms.push(r.unwind.load_ms);
        samples += r.stacks.get("cpu").map_or(0, |s| s.stacks);
    }
    let (p, t) = (median(plain.clone()), median(traced.clone()));
    let pairs: Vec<f64> = plain.iter().zip(&traced).map(|(a, b)| b / a).collect();
    println!("llama-server generation (SmolLM2-135M, 256 tokens, {PAIRS} interleaved pairs):");
    println!("  untraced: median {p:.1} tokens/s {plain:.1?}");
    println!("  traced:   median {t:.1} tokens/s {traced:.1?}  (all probes, 99 Hz CPU stacks)");
    println!("  ratio traced/untraced: {:.3} (medians), {:.3} (median of the {PAIRS} pairs {pairs:.3?})", t / p, median(pairs.clone()));
    let (mean, lo, hi) = ratio_interval(&pairs);
    println!(
        "  ratio with a 95% confidence interval (geometric mean of the pairs, t on log ratios): {mean:.3} [{lo:.3}, {hi:.3}], width {:.1}%",
        (hi - lo) * 100.0
    );
    println!(
        "  unwinding: median {:.1} us per stack ({samples} CPU samples); loading unwind tables: median {:.1} ms per trace",
        median(unwind_us),
        median(load_ms)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama-server's /completion answer: its speed, or "no timings" without one.
    #[test]
    fn completion_speed() {
        let body = r#"{"content":" The","tokens_predicted":256,"timings":{"prompt_n":14,"predicted_n":256,"predicted_per_second":187.5}}"#;
        assert_eq!(predicted_per_second(body).unwrap(), 187.5);
        for body in [r#"{"content":""}"#, r#"{"timings":{"prompt_n":14}}"#] {
            assert_eq!(predicted_per_second(body).unwrap_err().to_string(), "no timings");
        }
        assert!(predicted_per_second("not json").is_err());
    }
}
