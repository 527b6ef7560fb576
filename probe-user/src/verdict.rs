//! Verdicts: why a request's first token was slow, and why its response stopped, from what the
//! trace saw in the request's window. Pure: built from a [`Window`] of facts, golden-tested.
//!
//! TTFT is split into queue, disk, memory, power, load, compute and an explicit unexplained
//! remainder. Disk and memory are the union of the target's off-CPU intervals that the kernel
//! stack classifies as IO / page-fault wait or reclaim, clipped to [arrival, first token].
//! Load is a file mapped in the window and read from disk (a model (re)load), less its disk
//! time. Compute is the server's own prompt time. Queue is what is left while another request
//! was being served; the rest is unexplained.
use serde::{Deserialize, Serialize};

use crate::stream::RequestRecord;

/// Facts about one request's window (CLOCK_MONOTONIC ns).
#[derive(Clone, Debug, Default)]
pub struct Window {
    pub arrival_ns: u64,
    /// Off-CPU intervals of the target in IO or page-fault wait.
    pub io_waits: Vec<(u64, u64)>,
    /// Off-CPU intervals in memory reclaim or compaction.
    pub mem_waits: Vec<(u64, u64)>,
    /// Files read from disk in the window: (path, bytes, time of the first read).
    pub files_read: Vec<(String, u64, u64)>,
    /// Files mapped in the window: (time, path).
    pub mapped: Vec<(u64, String)>,
    /// When the other requests were being served: (start of their prompt processing, end).
    pub others: Vec<(u64, u64)>,
    /// Events lost anywhere in the trace, and the share of stacks unwound.
    pub lost_events: u64,
    pub offcpu_probe: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Split {
    pub queue: f64,
    pub disk: f64,
    pub memory: f64,
    pub power: f64,
    pub load: f64,
    pub compute: f64,
    pub unexplained: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Verdict {
    /// TTFT split by cause, ms (null when the request has no TTFT).
    pub ttft_ms: Option<Split>,
    /// disk | memory | power | queue | load | compute | none
    pub slow_cause: String,
    /// eos | requested_limit | server_limit | stop_word | client_disconnect | deadline | oom |
    /// server_error | crash | unknown
    pub stop_cause: String,
    /// One line per fact the verdict rests on, with numbers and names.
    pub evidence: Vec<String>,
    pub data_quality: Vec<String>,
}

/// Total length of the union of intervals, clipped to [from, to].
pub fn union_ms(intervals: &[(u64, u64)], from: u64, to: u64) -> f64 {
    let mut v: Vec<(u64, u64)> = intervals.iter().map(|&(a, b)| (a.max(from), b.min(to))).filter(|(a, b)| a < b).collect();
    v.sort_unstable();
    let (mut total, mut cur): (u64, Option<(u64, u64)>) = (0, None);
    for (a, b) in v {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((s, e)) = cur {
        total += e - s;
    }
    total as f64 / 1e6
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

pub fn stop_cause(q: &RequestRecord) -> (String, Option<String>) {
    let s = &q.stop;
    let produced = q
        .stop
        .usage
        .as_ref()
        .and_then(|u| u["completion_tokens"].as_u64())
        .or_else(|| s.server_timings.as_ref().and_then(|t| t["predicted_n"].as_u64().or(t["eval_count"].as_u64())))
        .unwrap_or(q.chunks);
    let length = s.finish_reason.as_deref() == Some("length") || s.stop_type.as_deref() == Some("limit") || s.done_reason.as_deref() == Some("length") || s.stopped.as_deref() == Some("limit");
    let cause = if s.error.is_some() || q.status.is_some_and(|c| c >= 400) {
        "server_error"
    } else if !q.complete && q.closed_by == "client" {
        let idle = q.chunk_times_ms.last().zip(q.end_ms).map(|(l, e)| e - l).unwrap_or(0.0);
        if idle >= 5000.0 { "deadline" } else { "client_disconnect" }
    } else if !q.complete && q.closed_by == "server_abort" {
        "crash"
    } else if length {
        match q.max_tokens {
            Some(m) if m > 0 && produced + 1 < m as u64 => "server_limit",
            _ => "requested_limit",
        }
    } else if s.stop_type.as_deref() == Some("word") || s.stopped.as_deref() == Some("word") {
        "stop_word"
    } else if s.finish_reason.as_deref() == Some("stop") || s.stop_type.as_deref() == Some("eos") || s.done_reason.as_deref() == Some("stop") || s.stopped.as_deref() == Some("eos") {
        "eos"
    } else {
        "unknown"
    };
    let why = match cause {
        "server_limit" => Some(format!("stopped at length after {produced} tokens, below the requested {}: the server's context (slot or KV pool) ran out", q.max_tokens.unwrap_or(0))),
        "requested_limit" => Some(format!("stopped at the requested limit ({} tokens)", q.max_tokens.map_or("?".into(), |m| m.to_string()))),
        "client_disconnect" => Some(format!("the client closed the connection after {} chunks, before the response ended", q.chunks)),
        "deadline" => Some("the peer closed after 5 s or more without a chunk: a timeout (gateway or client)".to_string()),
        "server_error" => Some(format!("HTTP {} {}", q.status.unwrap_or(0), q.stop.error.as_ref().map(|e| e.to_string()).unwrap_or_default())),
        _ => None,
    };
    (cause.to_string(), why)
}

pub fn attribute(q: &RequestRecord, w: &Window) -> Verdict {
    let mut v = Verdict::default();
    let (stop, why) = stop_cause(q);
    v.stop_cause = stop;
    v.evidence.extend(why);
    if q.partial {
        v.data_quality.push("probe attached while this request was in flight: its start was not seen".into());
    }
    if w.lost_events > 0 {
        v.data_quality.push(format!("{} events were lost in this trace: shares are lower bounds", w.lost_events));
    }
    if !w.offcpu_probe {
        v.data_quality.push("the offcpu probe was not live: disk and memory waits are not measured".into());
    }
    v.data_quality.push("no power data: GPU and CPU clocks are not sampled yet".into());
    let Some(ttft) = q.ttft_ms else {
        v.slow_cause = "none".into();
        return v;
    };
    let from = w.arrival_ns;
    let to = from + (ttft * 1e6) as u64;
    let disk = union_ms(&w.io_waits, from, to);
    let memory = union_ms(&w.mem_waits, from, to);
    let read: u64 = w.files_read.iter().map(|f| f.1).sum();
    // A model (re)load: a file mapped in the window that was also read from disk in it.
    // It starts at the first read of that file (a loader reads the header before mapping).
    let loaded: Vec<&(u64, String)> = w.mapped.iter().filter(|(_, p)| w.files_read.iter().any(|(f, b, _)| f == p && *b > 0)).collect();
    let load = match loaded.first() {
        Some((t, p)) => {
            let first = w.files_read.iter().filter(|(f, _, _)| f == p).map(|f| f.2).min().unwrap_or(*t).min(*t).max(from);
            ((to.saturating_sub(first)) as f64 / 1e6 - disk - memory).clamp(0.0, ttft)
        }
        None => 0.0,
    };
    // A non-streamed response's "first token" is the whole answer: generation is compute too.
    let timings = q.stop.server_timings.as_ref();
    let prompt = timings.and_then(|t| t["prompt_ms"].as_f64()).unwrap_or(0.0);
    let generated = if q.stream == Some(false) { timings.and_then(|t| t["predicted_ms"].as_f64()).unwrap_or(0.0) } else { 0.0 };
    let compute = (prompt + generated).min(ttft);
    let known = disk + memory + load + compute;
    let left = (ttft - known).max(0.0);
    let busy = union_ms(&w.others, from, to);
    let queue = left.min(busy);
    let split = Split { queue, disk, memory, power: 0.0, load, compute, unexplained: (left - queue).max(0.0) };
    if disk > 0.0 || read > 0 {
        let mut files: Vec<String> = w.files_read.iter().take(3).map(|(p, b, _)| format!("{p} ({})", mib(*b))).collect();
        if files.is_empty() {
            files.push("no file named".into());
        }
        v.evidence.push(format!("{disk:.0} ms blocked on disk before the first token; {} read: {}", mib(read), files.join(", ")));
    }
    for (t, p) in &loaded {
        v.evidence.push(format!("{p} was mapped {:.0} ms after arrival and read from disk: a model (re)load", t.saturating_sub(from) as f64 / 1e6));
    }
    if memory > 0.0 {
        v.evidence.push(format!("{memory:.0} ms in memory reclaim or compaction"));
    }
    if queue >= 1.0 {
        v.evidence.push(format!("{queue:.0} ms waiting while other requests were served"));
    }
    if compute >= 1.0 {
        v.evidence.push(format!("{compute:.0} ms of prompt processing{} (server's timings)", if generated > 0.0 { " and generation" } else { "" }));
    }
    // The cause: the largest share that is not normal work, if it matters (≥ 25% and ≥ 20 ms).
    let candidates = [("disk", disk), ("memory", memory), ("load", load), ("queue", queue)];
    let (name, ms) = candidates.iter().copied().fold(("none", 0.0), |a, b| if b.1 > a.1 { b } else { a });
    v.slow_cause = if ms >= 20.0 && ms >= 0.25 * ttft {
        name.into()
    } else if compute >= 0.5 * ttft && ttft >= 200.0 {
        "compute".into()
    } else {
        "none".into()
    };
    v.ttft_ms = Some(split);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::payload::Stop;

    fn req(ttft: f64) -> RequestRecord {
        RequestRecord { ttft_ms: Some(ttft), complete: true, closed_by: "server".into(), status: Some(200), ..Default::default() }
    }

    #[test]
    fn union_clips_and_merges() {
        let ms = 1_000_000;
        assert_eq!(union_ms(&[(0, 10 * ms), (5 * ms, 20 * ms), (30 * ms, 40 * ms)], 2 * ms, 35 * ms), 23.0);
        assert_eq!(union_ms(&[], 0, 10), 0.0);
    }

    #[test]
    fn cold_reload_is_disk_and_names_the_file() {
        let ms = 1_000_000u64;
        let q = req(1500.0);
        let w = Window {
            arrival_ns: 1000 * ms,
            io_waits: vec![(1100 * ms, 2300 * ms)],
            files_read: vec![("/models/m.gguf".into(), 98 << 20, 1020 * ms)],
            mapped: vec![(1050 * ms, "/models/m.gguf".into())],
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!(s.disk, 1200.0);
        assert_eq!(s.load, 280.0); // from the first read (20 ms after arrival) to the token, less disk
        assert_eq!(v.slow_cause, "disk");
        assert!(v.evidence.iter().any(|e| e.contains("/models/m.gguf (98.0 MiB)")), "{:?}", v.evidence);
    }

    #[test]
    fn waiting_behind_others_is_queue() {
        let ms = 1_000_000u64;
        let mut q = req(900.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 40.0}));
        let w = Window { arrival_ns: 0, others: vec![(0, 850 * ms)], offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        assert_eq!(v.slow_cause, "queue");
        let s = v.ttft_ms.unwrap();
        assert_eq!((s.queue, s.compute, s.unexplained), (850.0, 40.0, 10.0));
    }

    #[test]
    fn stop_causes() {
        let mut q = req(10.0);
        q.max_tokens = Some(8);
        q.chunks = 8;
        q.stop = Stop { finish_reason: Some("length".into()), ..Default::default() };
        assert_eq!(stop_cause(&q).0, "requested_limit");
        q.max_tokens = Some(4000);
        q.stop.usage = Some(serde_json::json!({"completion_tokens": 990}));
        assert_eq!(stop_cause(&q).0, "server_limit");
        q.stop = Stop { finish_reason: Some("stop".into()), ..Default::default() };
        assert_eq!(stop_cause(&q).0, "eos");
        let mut c = req(10.0);
        c.complete = false;
        c.closed_by = "client".into();
        assert_eq!(stop_cause(&c).0, "client_disconnect");
        c.chunk_times_ms = vec![10.0];
        c.end_ms = Some(30_010.0);
        assert_eq!(stop_cause(&c).0, "deadline");
        let mut e = req(10.0);
        e.status = Some(400);
        assert_eq!(stop_cause(&e).0, "server_error");
    }
}
