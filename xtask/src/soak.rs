//! `cargo xtask soak`: a real llama-server under concurrent streaming clients for minutes, traced
//! with every probe on. Prints probe's peak memory and its slope (the goal is flat), events lost,
//! recording size per minute and probe's own CPU. A benchmark: it prints figures, it asserts
//! nothing.
use std::{
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::{
    report::Report,
    setup::{bin, build, require_root, root},
    workload::{Llama, http, wait_for},
};

/// A field of /proc/PID/status, KiB.
fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.split_whitespace().next()?.parse().ok()))
        .unwrap_or(0)
}

/// CPU seconds (user + system) a process has used.
pub(crate) fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Least-squares slope of (x, y).
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

pub fn soak(minutes: f64, clients: usize) -> anyhow::Result<()> {
    require_root()?;
    build()?;
    let dir = root().join("target/soak");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let ctx = (clients * 512).to_string();
    let srv = Llama::start(&["-c", &ctx, "-np", &clients.to_string(), "--metrics"], Some(&dir.join("llama-server.log")))?;
    let addr = srv.addr.clone();
    let rec = dir.join("rec");
    let mut probe = Command::new(bin("probe"))
        .args(["trace", "--pid", &srv.pid(), "--out"])
        .arg(&rec)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("probe.log"))?)
        .spawn()?;
    wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
    let pid = probe.id();
    let (stop, served, failed) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let (stop, served, failed, addr) = (stop.clone(), served.clone(), failed.clone(), addr.clone());
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"messages":[{{"role":"user","content":"Tell story number {i} about a lighthouse."}}],"max_tokens":48,"stream":true,"seed":{i},"temperature":0.7}}"#
                );
                while !stop.load(Ordering::Relaxed) {
                    match http(&addr, "/v1/chat/completions", &body, None) {
                        Ok((status, _)) if status.contains(" 200") => served.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    let (start, cpu0) = (Instant::now(), cpu_secs(pid));
    let total = Duration::from_secs_f64(minutes * 60.0);
    // (minutes since start, RSS MiB, recording MiB), every 5 s.
    let mut samples: Vec<(f64, f64, f64)> = Vec::new();
    while start.elapsed() < total {
        std::thread::sleep(Duration::from_secs(5).min(total.saturating_sub(start.elapsed())));
        let size = std::fs::metadata(rec.join("events.bin")).map(|m| m.len()).unwrap_or(0);
        let t = start.elapsed().as_secs_f64() / 60.0;
        samples.push((t, status_kib(pid, "VmRSS:") as f64 / 1024.0, size as f64 / (1 << 20) as f64));
        if samples.len().is_multiple_of(12) {
            let (_, rss, size) = samples[samples.len() - 1];
            println!("  {t:>5.1} min: probe RSS {rss:.1} MiB, recording {size:.1} MiB, {} requests served", served.load(Ordering::Relaxed));
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = cpu_secs(pid) - cpu0;
    let peak = status_kib(pid, "VmHWM:") as f64 / 1024.0;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let t_int = Instant::now();
    Command::new("kill").args(["-INT", &pid.to_string()]).status()?;
    let status = probe.wait()?;
    let stopped = t_int.elapsed().as_secs_f64();
    let report: Report =
        serde_json::from_slice(&std::fs::read(rec.join("report.json")).context("probe wrote no report.json (see target/soak/probe.log)")?)?;
    let (lost, skipped) = (report.lost(), report.skipped());
    let window = (minutes / 2.0).min(5.0);
    let tail: Vec<(f64, f64)> = samples.iter().filter(|s| s.0 >= minutes - window).map(|s| (s.0, s.1)).collect();
    let (first, last) = (tail.first().map_or(0.0, |s| s.1), tail.last().map_or(0.0, |s| s.1));
    let size = samples.last().map_or(0.0, |s| s.2);
    println!("soak: llama-server (SmolLM2-135M, -np {clients}) under {clients} streaming clients for {minutes:.1} min, every probe on");
    println!(
        "  requests: {} served to the clients ({} failed), {} in the recording",
        served.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        report.requests.len()
    );
    println!(
        "  probe RSS: peak {peak:.1} MiB; over the last {window:.1} min {first:.1} → {last:.1} MiB, slope {:+.3} MiB/min",
        slope(&tail)
    );
    println!("  events: {} recorded, {lost} lost, {skipped} program runs skipped by the kernel", report.events);
    println!("  recording: {size:.1} MiB, {:.1} MiB per minute", size / minutes.max(1e-9));
    println!("  probe CPU: {:.1}% of one core ({cpu:.1} s over {wall:.0} s)", cpu / wall * 100.0);
    println!("  stream tracker: {}", serde_json::to_string(&report.stream_limits)?);
    println!("  stop: SIGINT → exit ({status}) in {stopped:.2} s, report written");
    Ok(())
}

/// `cargo xtask stress`: several producer threads (the target's own) against probe's one ring
/// buffer: what probe drains with no loss, and where losses start.
pub fn stress() -> anyhow::Result<()> {
    use std::io::Write as _;
    require_root()?;
    build()?;
    let dir = root().join("target/stress");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let secs = 3.0;
    // (syscalls/s the target made, events/s probe drained, events lost).
    let run = |args: &[&str], probes: &str, ring_mb: u32| -> anyhow::Result<(f64, f64, u64)> {
        let (mut w, pid, lines) = crate::workload::start_workload(args)?;
        let rec = dir.join(format!("{}-{ring_mb}", args.join("-")));
        let mut probe = Command::new(bin("probe"))
            .args(["trace", "--pid", &pid.to_string(), "--probes", probes, "--ring-mb", &ring_mb.to_string(), "--no-poll", "--out"])
            .arg(&rec)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
        writeln!(w.stdin.take().context("stdin")?, "go")?;
        let done = lines.iter().find(|l| l.starts_with("done")).unwrap_or_default();
        w.wait()?;
        let mut err = String::new();
        std::io::Read::read_to_string(&mut probe.stderr.take().context("stderr")?, &mut err)?;
        probe.wait()?;
        // Records received, stream bytes included (they are parsed, not stored): "stopped: ...; N events".
        let received = err
            .lines()
            .find_map(|l| l.strip_prefix("probe: stopped: "))
            .and_then(|l| l.split("; ").nth(1)?.split(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        let kv = |k: &str| done.split_whitespace().find_map(|x| x.strip_prefix(k)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let ran = kv("secs=").max(1e-9);
        let lost = Report::read(&rec)?.lost();
        let _ = std::fs::remove_dir_all(&rec);
        Ok((kv("calls=") / ran, received / ran, lost))
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    println!("ring buffer stress: the target's own threads are the producers, probe drains one ring; {secs} s per run, {cores} cores");
    let pct = |lost: u64, drained: f64| lost as f64 * 100.0 / (drained * secs + lost as f64).max(1.0);
    println!("  small records (mmap probe, ~100 bytes a record), 16 MiB ring:");
    for threads in [1, cores, 2 * cores, 4 * cores] {
        let (calls, drained, lost) = run(&["mmap-threads", &threads.to_string(), "0", &secs.to_string()], "mmap", 16)?;
        println!(
            "    {threads:>2} threads: {calls:>9.0} syscalls/s, drained {drained:>9.0} events/s, lost {lost} ({:.2}%)",
            pct(lost, drained)
        );
    }
    println!("  4 KiB records (stream probe: loopback send + recv of 4000 bytes):");
    let mut first_loss = None;
    for (threads, ring) in [(1, 16), (cores, 16), (2 * cores, 16), (2 * cores, 4), (2 * cores, 1)] {
        let (calls, drained, lost) = run(&["tcp-threads", &threads.to_string(), &secs.to_string()], "stream,sock", ring)?;
        println!(
            "    {threads:>2} threads, {ring:>2} MiB ring: {calls:>8.0} syscalls/s, drained {drained:>8.0} events/s ({:.0} MiB/s), lost {lost} ({:.2}%)",
            drained * 4096.0 / (1 << 20) as f64,
            pct(lost, drained)
        );
        if lost > 0 && first_loss.is_none() {
            first_loss = Some((threads, ring, calls));
        }
    }
    match first_loss {
        Some((t, r, at)) => println!("  first loss: {t} threads, {r} MiB ring, at {at:.0} records/s"),
        None => println!("  no loss in any run: the producers' own limit came first"),
    }
    Ok(())
}
