//! The machine around the target as people read it: one block per source (GPU, CPU clocks and
//! idle states, memory, model files, the server's endpoints), an absent one said in a line.
use crate::analysis::system::{Stall, System};

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
}

/// The human lines for `probe report`: one block per source, absent ones said in a line.
pub fn render(s: &System) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "\nSystem:");
    gpu(&mut o, s);
    cpu(&mut o, s);
    memory(&mut o, s);
    model_files(&mut o, s);
    for e in &s.server {
        server(&mut o, e);
    }
    o
}

/// One line per GPU: its clocks, power states, power and VRAM, what held its clocks.
fn gpu(o: &mut String, s: &System) {
    use std::fmt::Write as _;
    match &s.gpu.absent {
        Some(why) => {
            let _ = writeln!(o, "  GPU: {why}");
        }
        None => {
            for d in &s.gpu.per_device {
                let name = s
                    .gpu
                    .devices
                    .iter()
                    .find(|x| x.index == d.index)
                    .map(|x| format!("{} (driver {})", x.name, x.driver))
                    .unwrap_or_default();
                let clocks = match (d.sm_mhz_min, d.sm_mhz_max) {
                    (Some(a), Some(b)) => format!("SM clock {a}-{b} MHz"),
                    _ => "SM clock unknown".into(),
                };
                let ps: Vec<String> = d.pstates.iter().map(|p| format!("P{p}")).collect();
                let reasons: Vec<String> = d.reasons.iter().map(|(k, n)| format!("{k} ({n})")).collect();
                let _ = writeln!(
                    o,
                    "  GPU {} {name}: {clocks}, states {}, power max {}, VRAM used max {}, the target's {}{}",
                    d.index,
                    if ps.is_empty() { "?".into() } else { ps.join(",") },
                    d.power_w_max.map(|w| format!("{w:.0} W")).unwrap_or_else(|| "?".into()),
                    d.vram_used_max.map(mib).unwrap_or_else(|| "?".into()),
                    d.target_vram_max.map(mib).unwrap_or_else(|| "?".into()),
                    if reasons.is_empty() { String::new() } else { format!("; clocks held by {}", reasons.join(", ")) }
                );
            }
        }
    }
}

/// The CPUs' frequency against their maximum, and how long they sat in each idle state.
fn cpu(o: &mut String, s: &System) {
    use std::fmt::Write as _;
    match (&s.cpu_freq.absent, s.cpu_freq.share_min, s.cpu_freq.share_max) {
        (Some(why), _, _) => {
            let _ = writeln!(o, "  CPU: {why}");
        }
        (None, Some(a), Some(b)) => {
            let _ = writeln!(
                o,
                "  CPU frequency: {:.0}%-{:.0}% of maximum ({:.0} MHz)",
                a * 100.0,
                b * 100.0,
                s.cpu_freq.max_mhz.unwrap_or(0.0)
            );
        }
        _ => {}
    }
    if !s.cpu_freq.idle.is_empty() {
        let states: Vec<String> = s
            .cpu_freq
            .idle
            .iter()
            .map(|i| format!("{} {:.0}% ({} entries, exit {} us)", i.name, i.share * 100.0, i.entries, i.latency_us))
            .collect();
        let _ = writeln!(o, "  CPU idle states: {}", states.join(", "));
    }
}

/// The target's reclaim and compaction stalls, the system's pressure, RSS, its memory cgroup
/// and OOM kills.
fn memory(o: &mut String, s: &System) {
    use std::fmt::Write as _;
    let m = &s.memory;
    let stall = |name: &str, st: &Stall| {
        if st.count == 0 {
            None
        } else {
            Some(format!("{name} {}x {:.0} ms (max {:.0} ms, {} pages)", st.count, st.total_ms, st.max_ms, st.pages))
        }
    };
    let stalls: Vec<String> =
        [stall("direct reclaim", &m.direct_reclaim), stall("cgroup reclaim", &m.memcg_reclaim), stall("compaction", &m.compaction)]
            .into_iter()
            .flatten()
            .collect();
    let _ = writeln!(
        o,
        "  Memory: in the target {}; system PSI memory some {} / full {}, io some {}; direct-reclaim scans {}, swap-ins {}",
        if stalls.is_empty() { "no reclaim or compaction".into() } else { stalls.join(", ") },
        m.psi_some_ms.map(|x| format!("{x:.0} ms")).unwrap_or_else(|| "n/a".into()),
        m.psi_full_ms.map(|x| format!("{x:.0} ms")).unwrap_or_else(|| "n/a".into()),
        m.psi_io_some_ms.map(|x| format!("{x:.0} ms")).unwrap_or_else(|| "n/a".into()),
        m.pgscan_direct,
        m.pswpin
    );
    if let (Some(a), Some(b), Some(c)) = (m.rss_kib_start, m.rss_kib_max, m.rss_kib_end) {
        let _ = writeln!(o, "  Target RSS: {} at start, {} max, {} at end", mib(a << 10), mib(b << 10), mib(c << 10));
    }
    if let Some(cg) = &m.cgroup {
        let limit = m.cgroup_limit.map(|l| format!("limit {}", mib(l))).unwrap_or_else(|| "no limit".into());
        let _ = writeln!(
            o,
            "  Memory cgroup {cg}: {limit}, usage max {}, limit hits {}",
            m.cgroup_usage_max.map(mib).unwrap_or_else(|| "?".into()),
            m.cgroup_limit_hits.unwrap_or(0)
        );
    }
    for k in &m.oom_kills {
        let _ = writeln!(o, "  OOM kill: pid {} at +{:.3} s ({} resident)", k.pid, k.t_ms / 1e3, mib(k.rss_kib << 10));
    }
}

/// How much of each model file was in the page cache, and what was evicted while tracing.
fn model_files(o: &mut String, s: &System) {
    use std::fmt::Write as _;
    for f in &s.model_files {
        let _ = writeln!(
            o,
            "  Page cache: {} ({}): {:.0}% resident at start, {:.0}% at end, lowest {:.0}%{}",
            f.path,
            mib(f.bytes),
            f.resident_start * 100.0,
            f.resident_end * 100.0,
            f.resident_min * 100.0,
            f.evicted.filter(|&e| e > 0).map(|e| format!(", {e} pages evicted while tracing")).unwrap_or_default()
        );
    }
}

/// One line per server endpoint polled: its slots, queue maxima, preemptions, sleep, models.
fn server(o: &mut String, e: &crate::analysis::system::Endpoint) {
    use std::fmt::Write as _;
    let pick = |k: &str| e.series.get(k).map(|x| format!("{:.0}", x.max));
    let mut facts = Vec::new();
    if let (Some(n), Some(c)) = (e.total_slots, e.n_ctx_slot) {
        facts.push(format!("{n} slots x {c} tokens"));
    }
    for (k, label) in [
        ("llamacpp:requests_processing", "processing max"),
        ("llamacpp:requests_deferred", "deferred max"),
        ("vllm:num_requests_waiting", "waiting max"),
        ("vllm:num_requests_running", "running max"),
    ] {
        if let Some(v) = pick(k) {
            facts.push(format!("{label} {v}"));
        }
    }
    if let Some(p) = e.series.iter().find(|(k, _)| k.starts_with("vllm:num_preemptions")) {
        facts.push(format!("preemptions {:.0}", p.1.last - p.1.first));
    }
    if e.sleeping_polls > 0 {
        facts.push(format!("sleeping in {} of {} polls", e.sleeping_polls, e.polls));
    }
    if let Some(st @ (401 | 403)) = e.metrics_status {
        facts.push(format!("/metrics answered {st}: the server wants a key (give probe --api-key or PROBE_API_KEY)"));
    } else if e.metrics_status.is_some() && e.kind == crate::record::samples::Kind::LlamaCpp {
        facts.push("no /metrics (start it with --metrics for queue depth)".into());
    }
    for m in &e.loaded_models {
        facts.push(format!("loaded {} until {}", m.name.as_deref().unwrap_or("?"), m.expires_at.as_deref().unwrap_or("?")));
    }
    let _ = writeln!(
        o,
        "  Server {} at {}{}: {}",
        e.kind.name(),
        e.addr,
        if e.netns { " (in its own network namespace)" } else { "" },
        if facts.is_empty() { format!("{} polls", e.polls) } else { facts.join(", ") }
    );
}
