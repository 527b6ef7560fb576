//! A request's TTFT split into its parts (queue, disk, memory, cpu_contention, power, load,
//! compute, unexplained), with the figures its evidence quotes.
use super::*;

/// A request's TTFT split, with what its evidence quotes.
pub(super) struct Breakdown<'w> {
    pub(super) split: Split,
    /// The queue estimated from the time other requests were served (the fallback when the
    /// engine did not say).
    pub(super) idle_queue: f64,
    pub(super) from: u64,
    /// Where the request's own prompt processing began (by the server's timings; else arrival).
    pub(super) served_from: u64,
    pub(super) to: u64,
    /// Bytes read from disk in the window.
    pub(super) read: u64,
    /// Files mapped and read from disk in the window (a model (re)load), and mapped again from
    /// the page cache after the server slept.
    pub(super) loaded: Vec<&'w (u64, String)>,
    pub(super) reloaded: Vec<&'w (u64, String)>,
    /// The slowest clock ramp and its sentence.
    pub(super) ramp: Option<(f64, String)>,
    /// The server's own times: prompt, and generation when the first token is the whole answer.
    pub(super) prompt: f64,
    pub(super) generated: f64,
    /// (prompt tokens computed, reused from the prompt cache), when the server says.
    pub(super) cache: Option<(u64, u64)>,
    /// Runnable with its CPU idle in this guest, ms (steal is the part the host's steal covers).
    pub(super) idle_wait: f64,
    /// The part of steal taken while the threads ran (per switch), ms.
    pub(super) steal_run: f64,
}

pub(super) fn breakdown<'w>(q: &RequestRecord, w: &'w Window<'_>, ttft: f64) -> Breakdown<'w> {
    let from = w.arrival_ns;
    let to = from + (ttft * 1e6) as u64;
    let disk = union_ms(w.io_waits, from, to);
    let stalls: Vec<(u64, u64)> = w.mem_waits.iter().chain(w.swap_waits).copied().collect();
    let memory = union_ms(&stalls, from, to);
    let read: u64 = w.files_read.iter().map(|f| f.1).sum();
    // A model (re)load: a file mapped in the window that was also read from disk in it (a MiB
    // or more: a few pages read back is a reload from the page cache, below). It starts at the
    // first read of that file (a loader reads the header before mapping).
    let loaded: Vec<&(u64, String)> =
        w.mapped.iter().filter(|(_, p)| w.files_read.iter().any(|(f, b, _)| f == p && *b >= 1 << 20)).collect();
    // A reload from the page cache: the server said it was asleep (model unloaded) before this
    // request and mapped files again in the window, none read from disk. What it did before its
    // prompt processing began (mapping the model, runtime init) is the load; without the
    // server's timings, until its last mapping.
    let reloaded: Vec<&(u64, String)> = if loaded.is_empty() && w.server_sleeping { w.mapped.iter().collect() } else { vec![] };
    // A non-streamed response's "first token" is the whole answer: generation is compute too.
    let timings = q.stop.server_timings.as_ref();
    // The server's word for its prompt time; else the engine's own (its prompt batches).
    let prompt = timings.and_then(|t| t["prompt_ms"].as_f64()).or(w.engine.map(|e| e.prompt_ms)).unwrap_or(0.0);
    let generated = if q.stream == Some(false) { timings.and_then(|t| t["predicted_ms"].as_f64()).unwrap_or(0.0) } else { 0.0 };
    // Waiting for a CPU another process held: the union over the target's threads (the request
    // waits when any of the threads working for it waits), less what disk and memory already
    // explain. Waits behind the server's own threads are its own work sharing the CPUs; waits
    // before its own prompt processing began (behind other requests, by the server's timings)
    // are queue, whatever slowed the others.
    let served_from = if timings.is_some() { to.saturating_sub(((prompt + generated) * 1e6) as u64).max(from) } else { from };
    // A wait with its CPU idle in this guest (the idle task switched out for it) is another
    // process's only when the server's CPU quota throttled it; else the CPU was not running it
    // for nobody here: the hypervisor's steal when the host says steal grew, else wake-up latency
    // (left unexplained, and said).
    let throttled = quota_evidence(w, served_from, to).is_some();
    let behind_idle = |c: &&CpuWait| c.other == 0 && !throttled;
    let runq: Vec<(u64, u64)> =
        w.cpu_waits.iter().filter(|c| !w.target_pids.contains(&c.other) && !behind_idle(c)).map(|c| (c.from, c.to)).collect();
    let cpu = union_ms(&runq, served_from, to).min((ttft - disk - memory).max(0.0));
    let idle_waits: Vec<(u64, u64)> = w.cpu_waits.iter().filter(behind_idle).map(|c| (c.from, c.to)).collect();
    let idle_wait = union_ms(&idle_waits, served_from, to);
    let steal_idle = idle_wait.min(steal_across(w.pressure, served_from, to)).min((ttft - disk - memory - cpu).max(0.0));
    // The host's steal while the threads ran is inside the server's own timings (its prompt
    // time is wall time): taken out of its work, not added on top.
    let steal_run = steal_running_ms(w.steal_runs, served_from, to).min((ttft - disk - memory - cpu - steal_idle).max(0.0));
    let steal = steal_idle + steal_run;
    let cpu = cpu + steal;
    let load = match (loaded.first(), reloaded.last()) {
        (Some((t, p)), _) => {
            let first = w.files_read.iter().filter(|(f, _, _)| f == p).map(|f| f.2).min().unwrap_or(*t).min(*t).max(from);
            // Until the server's own prompt processing began, when its timings say (that is
            // compute, not load); else until the first token.
            let until = if timings.is_some() { served_from.max(first) } else { to };
            ((until.saturating_sub(first)) as f64 / 1e6 - disk - memory).clamp(0.0, ttft)
        }
        (None, Some((t, _))) => {
            let before_work = if timings.is_some() { ttft - prompt - generated } else { t.saturating_sub(from) as f64 / 1e6 };
            (before_work - disk - memory - cpu).clamp(0.0, ttft)
        }
        (None, None) => 0.0,
    };
    let ramp = ramp(q, w, from, ttft);
    let power = ramp.as_ref().map_or(0.0, |r| r.0.min(ttft).min((ttft - disk - memory - cpu - load).max(0.0)));
    let compute = (prompt + generated - steal_run).max(0.0).min((ttft - disk - memory - cpu - load - power).max(0.0));
    let left = (ttft - (disk + memory + cpu + load + power + compute)).max(0.0);
    // Queue: arrival to the engine's first prompt batch for this request where the engine probe
    // saw it; else the time other requests were being served.
    let idle_queue = left.min(union_ms(&w.others, from, to));
    // At least the time other requests were served meanwhile: every request ahead is credited,
    // also when the engine's join gave this request a run that began before its own (one slot,
    // requests read in another order than the server took them).
    let queue = w.engine.map_or(idle_queue, |e| left.min(e.queue_ms.max(idle_queue)));
    let split = Split {
        queue,
        disk,
        memory,
        cpu_contention: cpu - steal,
        power,
        load,
        compute,
        unexplained: (left - queue).max(0.0),
        before_attach: 0.0,
        steal,
    };
    let cache = timings.and_then(|t| Some((t["prompt_n"].as_u64()?, t["cache_n"].as_u64()?)));
    Breakdown { split, from, served_from, to, read, loaded, reloaded, ramp, prompt, generated, cache, idle_queue, idle_wait, steal_run }
}

/// A GPU asleep (runtime-suspended, D3) at arrival, by sysfs: how long until it was seen awake
/// (ms, and the sentence); 0 ms and a sentence that says so when it was not seen to wake before
/// `until`. The slowest device when several slept.
pub(super) fn resumed(pci: &[crate::analysis::system::PciState], from: u64, until: u64) -> Option<(f64, String)> {
    let mut devices: Vec<&str> = pci.iter().map(|p| p.1.as_str()).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut out: Option<(f64, String)> = None;
    for d in devices {
        let Some(at) = pci.iter().rev().find(|p| p.1 == d && p.0 <= from).filter(|p| p.2) else { continue };
        let found = match pci.iter().find(|p| p.1 == d && p.0 > from && p.0 <= until && !p.2) {
            Some(up) => {
                let ms = (up.0 - from) as f64 / 1e6;
                (ms, format!("GPU {d} in {} at arrival: resumed in {ms:.0} ms", at.3))
            }
            None => (0.0, format!("GPU {d} in {} at arrival (not seen to resume while the request ran)", at.3)),
        };
        if out.as_ref().is_none_or(|o| found.0 > o.0) {
            out = Some(found);
        }
    }
    out
}

/// Power: the slowest of the GPUs and the CPUs to reach its working clock when it was below it
/// at arrival (ms, and the sentence that says so).
pub(super) fn ramp(q: &RequestRecord, w: &Window<'_>, from: u64, ttft: f64) -> Option<(f64, String)> {
    let until = from + (q.end_ms.unwrap_or(ttft).max(ttft) * 1e6) as u64;
    let mut ramp: Option<(f64, String)> = None;
    // Readings are in time order: look only at the request's span (and 10 s before it).
    let gpu = around(w.gpu_clocks, |g| g.0, from, until);
    let mut devices: Vec<u32> = gpu.iter().map(|g| g.1).collect();
    devices.sort_unstable();
    devices.dedup();
    for d in devices {
        let series: Vec<(u64, f64)> = gpu.iter().filter(|g| g.1 == d).map(|g| (g.0, g.2)).collect();
        if let Some((ms, at)) = ramp_ms(&series, from, until) {
            let p = gpu.iter().rev().find(|g| g.1 == d && g.0 <= from).and_then(|g| g.3).map(|p| format!(", P{p}")).unwrap_or_default();
            if ramp.as_ref().is_none_or(|r| ms > r.0) {
                ramp =
                    Some((ms, format!("GPU {d} SM clock at {:.0}% of its working clock at arrival{p}; {ms:.0} ms to ramp up", at * 100.0)));
            }
        }
    }
    if let Some((ms, e)) = resumed(w.gpu_pci, from, until)
        && ramp.as_ref().is_none_or(|r| ms > r.0 || r.0 == 0.0)
    {
        ramp = Some((ms, e));
    }
    if let Some((ms, at)) = ramp_ms(around(w.cpu_clocks, |c| c.0, from, until), from, until)
        && ramp.as_ref().is_none_or(|r| ms > r.0)
    {
        ramp = Some((ms, format!("CPU frequency at {:.0}% of maximum at arrival; {ms:.0} ms to ramp up", at * 100.0)));
    }
    ramp
}
