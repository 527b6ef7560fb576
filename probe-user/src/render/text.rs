//! The human summary printed by `probe trace` and `probe report`.
use crate::{
    analysis::report::{Closer, Report, ResetSeen},
    util::text::bytes,
};

/// Why a trace has no requests to give verdicts on, in the words a person can act on.
pub fn no_requests(r: &Report) -> String {
    let served: Vec<&str> = r.system.server.iter().map(|e| e.addr.as_str()).collect();
    if served.is_empty() {
        format!(
            "No requests: pid {} answered no HTTP on any TCP port probe could poll while tracing. Check that it is the server's pid (`ss -ltnp`), or trace a server in a container with --container",
            r.target.pid
        )
    } else {
        format!("No requests: none arrived at {} while tracing (only probe's own polls, which are not counted)", served.join(", "))
    }
}

/// The human summary printed by `probe trace` and `probe report`, section by section.
pub fn render(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "probe report: pid {} ({}), {:.1} s, {}{}",
        r.target.pid,
        r.target.comm,
        r.duration_s,
        r.events_phrase(),
        r.target.end_reason.as_ref().map(|e| format!(", stopped: {e}")).unwrap_or_default()
    );
    verdicts(&mut o, r);
    machine(&mut o, r);
    files(&mut o, r);
    connections(&mut o, r);
    stacks(&mut o, r);
    cost(&mut o, r);
    requests(&mut o, r);
    losses(&mut o, r);
    o
}

/// The verdicts first, one line each with the evidence behind them.
fn verdicts(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    if !r.requests.is_empty() {
        let _ = writeln!(o, "\nVerdicts:");
        for q in r.requests.iter().take(50) {
            let Some(v) = &q.verdict else { continue };
            let req = format!("{} {}", q.method.as_deref().unwrap_or("?"), q.path.as_deref().unwrap_or("?"));
            let ttft = q.ttft_ms.map(|t| format!("TTFT {t:.0} ms")).unwrap_or_else(|| "no first token seen".into());
            let slow =
                if v.slow_cause == crate::analysis::verdict::SlowCause::None { String::new() } else { format!(", slow: {}", v.slow_cause) };
            let cut = if v.prompt_cut { "; prompt cut by the server" } else { "" };
            let _ = writeln!(o, "  #{} {req}: {ttft}{slow}; stopped: {}{cut}", q.id, v.stop_cause.words());
            for e in v.evidence.iter().take(4) {
                let _ = writeln!(o, "      {e}");
            }
            if let Some(e) = &q.engine {
                let _ = writeln!(o, "      {}", e.words());
            }
        }
    } else {
        let _ = writeln!(o, "\n{}", no_requests(r));
    }
}

/// The engine, the machine and the processes traced.
fn machine(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    if let Some(e) = &r.engine {
        let _ = writeln!(o, "\nEngine (llama.cpp, by uprobe): {}", e.words());
    }
    o.push_str(&crate::render::system::render(&r.system));
    let forked: Vec<String> =
        r.target.processes.iter().filter(|p| p.pid != r.target.pid).map(|p| format!("{} ({})", p.pid, p.comm)).collect();
    if !forked.is_empty() {
        let _ = writeln!(o, "  also traced: {}", forked.join(", "));
    }
}

/// Files read, block IO per device, page faults and memory maps.
fn files(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    let _ = writeln!(o, "\nFiles read (largest first):");
    if r.files.is_empty() {
        let _ = writeln!(o, "  none: nothing was read from storage through the page cache");
    } else {
        let _ = writeln!(o, "  {:>12} {:>11} {:>8} {:>10}  path", "major faults", "read", "reads", "io time");
        for f in r.files.iter().take(20) {
            let _ = writeln!(
                o,
                "  {:>12} {:>11} {:>8} {:>7.1} ms  {}",
                f.major_faults,
                bytes(f.read_bytes),
                f.block_reads,
                f.io_time_ms,
                f.path
            );
        }
        if r.files.len() > 20 {
            let _ = writeln!(o, "  ... {} more in report.json", r.files.len() - 20);
        }
    }
    let b = &r.blockio;
    let _ = writeln!(o, "\nBlock IO: {} requests, {} read, {} written", b.requests, bytes(b.read_bytes), bytes(b.write_bytes));
    for d in &b.devices {
        let _ = writeln!(
            o,
            "  {} {}: {} requests, device latency p50 {:.0} us, p90 {:.0} us, p99 {:.0} us, max {:.0} us",
            d.dev,
            d.name.as_deref().unwrap_or(""),
            d.requests,
            d.latency_us.p50,
            d.latency_us.p90,
            d.latency_us.p99,
            d.latency_us.max
        );
    }
    let minor = r.faults.minor.map(|m| m.to_string()).unwrap_or_else(|| "not counted".into());
    let _ = writeln!(o, "\nPage faults: {} major ({} outside file mappings), {minor} minor", r.faults.major, r.faults.major_unresolved);
    let counts: Vec<String> = r.mmap_counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
    let _ = writeln!(o, "\nMemory maps: {}", if counts.is_empty() { "none".into() } else { counts.join(", ") });
    for m in r.mmaps.iter().filter(|m| m.path.is_some() && m.op.op() == Some(probe_common::mmap::MmapOp::Mmap)).take(10) {
        let _ = writeln!(o, "  +{:.3} s pid {} mmap {} {}", m.t_ms / 1e3, m.pid, bytes(m.len), m.path.as_deref().unwrap_or(""));
    }
}

/// The TCP connections and how each ended.
fn connections(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    let _ = writeln!(o, "\nTCP connections: {}", r.connections.len());
    for c in r.connections.iter().take(30) {
        let how = match (c.closed_by, c.reset) {
            (Closer::None, _) => "still open".to_string(),
            (by, ResetSeen::None) => format!("closed by {}", by.name()),
            (by, rst) => format!("closed by {} (reset {})", by.name(), rst.name()),
        };
        let _ = writeln!(o, "  {} <-> {}  {how}", c.local, c.peer);
    }
    if r.connections.len() > 30 {
        let _ = writeln!(o, "  ... {} more in report.json", r.connections.len() - 30);
    }
}

/// The stack samples: how many, how deep, why the cut ones stop.
fn stacks(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    if !r.stacks.is_empty() {
        let per: Vec<String> = r.stacks.iter().map(|(k, s)| format!("{} {k} (median depth {})", s.stacks, s.median_depth)).collect();
        let _ = writeln!(o, "\nStacks: {}; {}", per.join(", "), crate::render::unwound(&r.unwind, "us"));
        if r.unwind.left_out_modules > 0 {
            let _ = writeln!(
                o,
                "  {} modules unwound without their unwind tables: they would have passed probe's budget for them ({} MiB held; PROBE_UNWIND_BUDGET sets it)",
                r.unwind.left_out_modules,
                r.unwind.held_bytes >> 20
            );
        }
        // Why the others stop, over every kind.
        let mut cut: std::collections::BTreeMap<crate::record::Cut, u64> = Default::default();
        for (c, n) in r.stacks.values().flat_map(|s| s.cut.iter()) {
            *cut.entry(*c).or_default() += n;
        }
        if !cut.is_empty() {
            let why: Vec<String> = cut.iter().map(|(c, n)| format!("{} ({n})", c.words())).collect();
            let _ = writeln!(o, "  the others stop because {}", why.join(", "));
        }
        // Where they stop, per kind (the trace named their outermost frames).
        for (k, s) in r.stacks.iter().filter(|(_, s)| !s.cut_under.is_empty()) {
            let under: Vec<String> = s.cut_under.iter().map(|u| format!("{} ({})", u.frame, u.stacks)).collect();
            let _ = writeln!(o, "  cut {k} stacks stop under {}", under.join(", "));
        }
    }
}

/// What tracing cost while it ran.
fn cost(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    if let Some(c) = &r.cost {
        let top: Vec<String> = c
            .programs
            .iter()
            .take(3)
            .map(|p| format!("{} {:.2}% ({:.0}/s × {:.1} us)", p.name, p.pct_of_core, p.runs_per_s, p.ns_per_run / 1e3))
            .collect();
        let bpf = match &c.bpf_unmeasured {
            Some(why) => format!("BPF programs not measured: {why}"),
            None => format!("BPF programs {:.2}%: {}", c.bpf_pct, if top.is_empty() { "none ran".into() } else { top.join(", ") }),
        };
        let _ = writeln!(
            o,
            "\nTracing cost: {:.2}% of one core over {:.1} s (probe's process {:.2}%, {bpf})",
            c.pct_of_core, c.wall_s, c.probe_pct
        );
    }
}

/// The requests table.
fn requests(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    if !r.requests.is_empty() {
        let _ = writeln!(o, "\nRequests: {}", r.requests.len());
        let _ = writeln!(
            o,
            "  {:>4} {:<28} {:>6} {:>9} {:>9} {:>6} {:>7} {:<8} {:<13} {:<8}",
            "id", "request", "status", "ttft ms", "total ms", "chunks", "max tok", "finish", "ended", "complete"
        );
        for q in r.requests.iter().take(50) {
            let req = format!("{} {}", q.method.as_deref().unwrap_or("?"), q.path.as_deref().unwrap_or("?"));
            let req: String = req.chars().take(28).collect();
            let fmt = |v: Option<f64>| v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into());
            let finish = q
                .stop
                .finish_reason
                .clone()
                .or(q.stop.stop_type.clone())
                .or(q.stop.done_reason.clone())
                .or(q.stop.error.as_ref().map(|_| "error".to_string()))
                .unwrap_or_else(|| "-".into());
            let ended = q.ended();
            let _ = writeln!(
                o,
                "  {:>4} {:<28} {:>6} {:>9} {:>9} {:>6} {:>7} {:<8} {:<13} {}{}",
                q.id,
                req,
                q.status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                fmt(q.ttft_ms),
                fmt(q.end_ms),
                q.chunks,
                q.max_tokens.map(|m| m.to_string()).unwrap_or_else(|| "-".into()),
                finish,
                ended,
                q.completeness(),
                if q.partial { " (partly seen)" } else { "" }
            );
        }
        if r.requests.len() > 50 {
            let _ = writeln!(o, "  ... {} more in report.json", r.requests.len() - 50);
        }
    }
}

/// What was lost or skipped, and the recording's problems.
fn losses(o: &mut String, r: &Report) {
    use std::fmt::Write as _;
    let lost: u64 = r.lost_events.values().sum();
    if lost == 0 {
        let _ = writeln!(o, "\nLost events: none");
    } else {
        let per: Vec<String> = r.lost_events.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(o, "\nLost events: {lost} ({})", per.join(", "));
    }
    // Losses no map reports: a return whose start an LRU map no longer held (or held never:
    // begun before attach).
    if let Some(n) = r.counters.get(probe_common::Counter::Unmatched.name()).filter(|n| **n > 0) {
        let _ = writeln!(
            o,
            "  {n} syscall exits and calls' returns had no start (begun before attach, or evicted from a full map): their records are missing"
        );
    }
    for p in r.probes.iter().filter(|p| !p.live) {
        let _ = writeln!(o, "Skipped probe {}: {}", p.name, serde_json::to_string(&p.skipped).unwrap_or_default());
    }
    for p in &r.problems {
        let _ = writeln!(o, "Note: {p}");
    }
}
