//! The sentences behind a verdict's split: who held the CPUs, what was swapped, the CPU quota,
//! the server threads on the critical path; each said only when it explains something.
use super::*;

/// The part of a time-ordered series from 10 s before `from` to `until`.
pub(super) fn around<T>(v: &[T], ts: impl Fn(&T) -> u64, from: u64, until: u64) -> &[T] {
    let lo = v.partition_point(|x| ts(x) < from.saturating_sub(10_000_000_000));
    let hi = v.partition_point(|x| ts(x) <= until).max(lo);
    &v[lo..hi]
}

/// What ran on the CPUs the target's threads waited for, charged with each wait (clipped to
/// `from..to`), largest first; the target's own processes left out.
pub(super) fn competitors(w: &Window<'_>, from: u64, to: u64) -> Vec<Competitor> {
    let mut by: HashMap<u32, (u64, u64)> = HashMap::new();
    for c in w.cpu_waits {
        let (a, b) = (c.from.max(from), c.to.min(to));
        if a < b && c.other != 0 && !w.target_pids.contains(&c.other) {
            let e = by.entry(c.other).or_default();
            e.0 += b - a;
            e.1 += b.saturating_sub(a.max(c.held_from));
        }
    }
    let mut top: Vec<(u32, (u64, u64))> = by.into_iter().collect();
    top.sort_by_key(|&(pid, (ns, held))| (std::cmp::Reverse(held), std::cmp::Reverse(ns), pid));
    top.into_iter()
        .map(|(pid, (ns, held))| {
            let (comm, cgroup) = w.other_names.and_then(|n| n.get(&pid)).map_or((None, None), |(c, g)| (Some(c.clone()), g.clone()));
            Competitor { pid, comm, cgroup, ms: ns as f64 / 1e6, held_ms: Some(held as f64 / 1e6) }
        })
        .collect()
}

/// "N ms waiting for a CPU ...; the CPUs went to: who (pid, cgroup) M ms, ...": what ran on the
/// CPU a waiting thread got back, charged with that wait (clipped to the window).
pub(super) fn cpu_evidence(cpu: f64, w: &Window<'_>, from: u64, to: u64, throttled: bool) -> String {
    let top = competitors(w, from, to);
    let names: Vec<String> = top.iter().take(3).map(|c| format!("{} {:.0} ms", c.who(), c.held())).collect();
    let went = if names.is_empty() { String::new() } else { format!("; the CPU went to: {}", names.join(", ")) };
    // Throttled, with others holding under half the wait: the CPUs were mostly idle meanwhile.
    let others_ms: f64 = top.iter().map(|c| c.ms).sum();
    let why = if throttled && others_ms < 0.5 * cpu {
        "its CPU quota ran out, while the CPUs were mostly idle"
    } else if throttled {
        "other processes held the CPUs, and its CPU quota ran out"
    } else {
        "other processes held the CPUs"
    };
    format!("{cpu:.0} ms waiting for a CPU (runnable, not running: {why}){went}")
}

/// "N ms faulting memory back in from swap (/swapfile): M MiB swapped back in (the server's
/// VmSwap fell from A to B MiB)".
pub(super) fn swap_evidence(ms: f64, w: &Window<'_>, from: u64, to: u64) -> String {
    let area = if w.swaps.is_empty() { String::new() } else { format!(" ({})", w.swaps.join(", ")) };
    let back = across(w.pressure, from, to)
        .and_then(|(a, b)| Some((a.swap_kib?, b.swap_kib?)))
        .map(|(a, b)| {
            format!(
                ": {} swapped back in (the server's VmSwap went from {} to {})",
                mib(a.saturating_sub(b) << 10),
                mib(a << 10),
                mib(b << 10)
            )
        })
        .unwrap_or_default();
    format!("{ms:.0} ms faulting the server's memory back in from swap{area}{back}")
}

/// "the server's CPU quota (cgroup /x: 0.20 CPU, 20000 of every 100000 µs) throttled it N
/// times, M ms (cpu.stat)", when the cgroup was throttled across the window.
pub(super) fn quota_evidence(w: &Window<'_>, from: u64, to: u64) -> Option<String> {
    let (a, b) = across(w.pressure, from, to)?;
    let ns = b.throttled_ns?.checked_sub(a.throttled_ns?).filter(|&ns| ns > 0)?;
    let times = b.nr_throttled.unwrap_or(0).saturating_sub(a.nr_throttled.unwrap_or(0));
    // The quota in force during the window (it may have been lifted since), read at or before
    // its end: a quota set after the request ended throttles what came after, not it (the
    // reading after the window counts throttling up to that reading).
    let lo = w.pressure.partition_point(|r| r.ts_ns < from);
    let hi = w.pressure.partition_point(|r| r.ts_ns <= to);
    let set = w.pressure[lo..hi].iter().rev().chain([a]).find(|r| r.quota_us.is_some())?;
    let limit = match (set.quota_us, set.period_us) {
        (Some(q), Some(p)) if p > 0 => format!(": {:.2} CPU, {q} of every {p} µs", q as f64 / p as f64),
        _ => String::new(),
    };
    let cg = b.cpu_cgroup.as_deref().unwrap_or("?");
    Some(format!("the server's CPU quota throttled it {times} times, {:.0} ms (cgroup {cg}{limit}; its cpu.stat)", ns as f64 / 1e6))
}
/// The server threads the request waited on (the critical path through other threads than the
/// one that sent the response), each with what it did meanwhile: said when that thread stalled
/// (did anything but run) for at least 1 ms and 5% of the TTFT. A wait on a thread that ran the
/// whole time is the server's own work.
pub(super) fn path_evidence(w: &Window<'_>, ttft: f64, v: &mut Verdict) {
    let Some(p) = &w.path else { return };
    let stalled = |t: &&crate::analysis::critical::OnPath| {
        let s = &t.states;
        let stall = s.cpu_wait + s.disk + s.memory + s.idle;
        t.tid != p.writer && stall >= 1.0 && stall >= 0.05 * ttft
    };
    let name = |tid: u32| match w.thread_names.and_then(|n| n.get(&tid)) {
        Some(n) => format!("{tid} ({n})"),
        None => tid.to_string(),
    };
    for t in p.threads.iter().filter(stalled).take(2) {
        v.evidence.push(format!(
            "the request waited {:.0} ms on server thread {} (the thread that sent the response, {}, waited on it through a futex), which meanwhile was {}",
            t.ms,
            name(t.tid),
            name(p.writer),
            t.states.words()
        ));
    }
    // Where the threads waited (`critical_path.threads[].waits`) is data, not a sentence here:
    // an async server's event loop waits in its poll while a worker computes, and the waker that
    // would say so is not always seen (a sentence would name the poll as the cause).
    v.critical_path = w.path.clone();
}

/// The sentences behind the split, each said only when it explains something.
pub(super) fn evidence(b: &Breakdown<'_>, w: &Window<'_>, v: &mut Verdict) {
    let s = &b.split;
    let (from, read) = (b.from, b.read);
    if let Some((_, e)) = &b.ramp {
        v.evidence.push(e.clone());
    }
    if w.server_sleeping {
        v.evidence.push("the server reported itself sleeping (model unloaded) before this request arrived".into());
    }
    if let Some(n) = w.server_deferred.filter(|&n| n >= 1.0) {
        v.evidence.push(format!("the server reported up to {n:.0} deferred request(s) (no free slot) meanwhile"));
    }
    // A millisecond blocked, or a MiB read.
    if s.disk >= 1.0 || read >= 1 << 20 {
        let files: Vec<String> = w.files_read.iter().filter(|f| f.1 > 0).take(3).map(|(p, b, _)| format!("{p} ({})", mib(*b))).collect();
        let what = if files.is_empty() {
            "no file read in the window: the waits were page faults on anonymous memory (swap) or on file pages read before it".to_string()
        } else {
            format!("{} read: {}", mib(read), files.join(", "))
        };
        v.evidence.push(format!("{:.0} ms blocked on disk before the first token; {what}", s.disk));
        // The disk may be the cgroup's limit, not the device: named from the cgroup's own files.
        for l in w.io_limits.iter().filter(|l| l.read_bps.is_some() || l.read_iops.is_some()).take(2) {
            let rate = match (l.read_bps, l.read_iops) {
                (Some(b), _) => format!("{:.1} MB/s", b as f64 / 1e6),
                (None, Some(n)) => format!("{n} reads/s"),
                (None, None) => continue,
            };
            let file = match l.source {
                crate::record::samples::LimitSource::IoMax => "io.max",
                crate::record::samples::LimitSource::BlkioThrottle => "blkio.throttle.read_*_device",
            };
            v.evidence.push(format!("disk: reads throttled by the cgroup's limit ({rate} on device {}; {file} of {})", l.dev, l.cgroup));
        }
    }
    if let Some((t, _)) = b.reloaded.last() {
        let files: Vec<&str> = b.reloaded.iter().take(2).map(|(_, p)| p.as_str()).collect();
        v.evidence.push(format!(
            "{:.0} ms loading the model again after sleep: {} mapped {:.0} ms after arrival, from the page cache ({} read from disk)",
            s.load,
            files.join(", "),
            t.saturating_sub(from) as f64 / 1e6,
            mib(read)
        ));
    }
    for (t, p) in &b.loaded {
        v.evidence.push(format!(
            "{p} was mapped {:.0} ms after arrival and read from disk: a model (re)load",
            t.saturating_sub(from) as f64 / 1e6
        ));
    }
    let (reclaim, swap) = (union_ms(w.mem_waits, b.from, b.to), union_ms(w.swap_waits, b.from, b.to));
    if swap >= 1.0 {
        v.evidence.push(swap_evidence(swap, w, b.from, b.to));
    }
    if reclaim >= 1.0 || (s.memory > 0.0 && swap < 1.0) {
        v.evidence.push(format!("{reclaim:.0} ms in memory reclaim or compaction (direct reclaim, cgroup limit, or blocked allocating)"));
    }
    if s.cpu_contention >= 1.0 {
        let quota = quota_evidence(w, b.served_from, b.to);
        v.evidence.push(cpu_evidence(s.cpu_contention, w, b.served_from, b.to, quota.is_some()));
        v.evidence.extend(quota);
    }
    let steal_idle = s.steal - b.steal_run;
    if steal_idle >= 1.0 {
        v.evidence.push(format!(
            "{steal_idle:.0} ms runnable while its CPU ran nothing in this machine: the hypervisor had it (steal; /proc/stat's steal grew {:.0} ms over the CPUs meanwhile)",
            steal_across(w.pressure, b.served_from, b.to)
        ));
    }
    if b.steal_run >= 1.0 {
        v.evidence.push(format!(
            "the hypervisor took {:.0} ms of the CPUs the server ran on, while its threads ran (steal: each run's time on the CPU less what the kernel charged the thread, at every context switch; the most-stolen thread)",
            b.steal_run
        ));
    }
    let woke = b.idle_wait - steal_idle;
    if woke >= 10.0 {
        v.data_quality.push(format!(
            "{woke:.0} ms runnable with its CPU idle and no steal counted for it (wake-up latency: a CPU leaving a sleep state, or a virtual CPU its host had not run yet): not counted as waiting for a CPU"
        ));
    }
    if s.queue >= 1.0 {
        match w.engine {
            Some(_) => v.evidence.push(format!("{:.0} ms queued before the engine began its prompt (llama.cpp's steps)", s.queue)),
            None => v.evidence.push(format!("{:.0} ms waiting while other requests were served", s.queue)),
        }
    }
    // The two measures of the queue, when they disagree by more than 10% (and 10 ms: parsing and
    // tokenizing a request take a few).
    if w.engine.is_some() && (s.queue - b.idle_queue).abs() > 0.1 * s.queue.max(b.idle_queue) && (s.queue - b.idle_queue).abs() >= 10.0 {
        v.evidence.push(format!(
            "the engine's queue ({:.0} ms, arrival to its first prompt batch) and the time other requests were served ({:.0} ms) disagree by more than 10%",
            s.queue, b.idle_queue
        ));
    }
    // The prompt cache, as the server counts it (llama.cpp: prompt_n computed, cache_n reused;
    // vLLM: its prefix-cache counters across the request, shared with requests in flight).
    if let Some((n, cached)) = b.cache {
        v.evidence.push(format!("{n} prompt tokens computed, {cached} reused from the server's prompt cache"));
    } else if let Some((hits, queries)) = w.server_prefix_cache.filter(|p| p.1 >= 1.0) {
        v.evidence.push(format!(
            "{hits:.0} of {queries:.0} prompt tokens hit the server's prefix cache while this request was served (vllm:prefix_cache_hits/queries; requests in flight meanwhile share the count)"
        ));
    }
    if s.compute >= 1.0 {
        let what = if b.generated > 0.0 { "prompt processing and generation" } else { "prompt processing" };
        let (timed, compute) = (b.prompt + b.generated, s.compute);
        v.evidence.push(if timed - compute >= 1.0 && timed - compute >= 0.05 * timed {
            // The server's clock runs through the stalls: the waits above are part of its time.
            format!("{compute:.0} ms of {what}, its own work (the server timed {timed:.0} ms: the rest is the waits above)")
        } else {
            format!("{compute:.0} ms of {what} (server's timings)")
        });
    }
}
