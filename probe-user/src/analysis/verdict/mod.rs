//! Verdicts: why a request's first token was slow, and why its response stopped, from what the
//! trace saw in the request's window. Pure: built from a [`Window`] of facts, golden-tested.
//!
//! TTFT is split into queue, disk, memory, cpu_contention, power, load, compute and an explicit
//! unexplained remainder. Disk and memory are the union of the target's off-CPU intervals that the
//! kernel stack classifies as IO / page-fault wait or reclaim, clipped to [arrival, first token].
//! cpu_contention is the union of the intervals in which a target thread was runnable but not
//! running (switched out still runnable, until the scheduler ran it again: sched_switch), so
//! many threads waiting at once count once. Load is a file mapped in the window and read from
//! disk (a model (re)load), less its disk time. Compute is the request's own work: the server's
//! prompt time, less what the stalls above explain (the server's clock counts them as its own).
//! Queue is what is left while another request was being served; the rest is unexplained.
//!
//! The model and [`attribute`] are here; the split itself is `breakdown`, the sentences behind
//! it `evidence`, the stop cause and the data-quality lines `stop`.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::stream::{ClosedBy, RequestRecord};

mod breakdown;
mod evidence;
mod stop;

use breakdown::*;
use evidence::*;
use stop::stop_and_quality;
pub use stop::{first_token_ms, idle_before_close_ms, keep_open, server_word, stop_cause};

/// A target thread waiting for a CPU: runnable from `from` until the scheduler ran it at `to`,
/// replacing `other` (the process that had the CPU), which had held it since `held_from` (the
/// wait's start when the kernel did not say).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuWait {
    pub from: u64,
    pub to: u64,
    pub tid: u32,
    pub other: u32,
    pub held_from: u64,
}

/// The hypervisor's steal while target thread `tid` ran, `ns` in all, somewhere in [from, to]
/// (the kernel programs' SCHED_STEAL records: wall time on the CPU less what the kernel charged).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StealRun {
    pub from: u64,
    pub to: u64,
    pub tid: u32,
    pub ns: u64,
}

/// The steal while the target's threads ran in [from, to], ms: each record's steal spread over its
/// span and clipped to the window, summed per thread; the most-stolen thread's (the threads of a
/// pool wait for the slowest at each step). `runs` sorted by `to`.
pub fn steal_running_ms(runs: &[StealRun], from: u64, to: u64) -> f64 {
    let mut per: HashMap<u32, f64> = HashMap::new();
    for r in &runs[runs.partition_point(|r| r.to <= from)..] {
        if r.from >= to {
            // Spans are at most 100 ms: past the window by more, no later record reaches in.
            if r.to > to + 200_000_000 {
                break;
            }
            continue;
        }
        let span = r.to.saturating_sub(r.from).max(1);
        let inside = r.to.min(to).saturating_sub(r.from.max(from));
        *per.entry(r.tid).or_default() += r.ns as f64 * inside as f64 / span as f64;
    }
    per.values().copied().fold(0.0, f64::max) / 1e6
}

/// One sampler reading of the target's swap use and its CPU cgroup's quota (cumulative counts).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pressure {
    pub ts_ns: u64,
    pub swap_kib: Option<u64>,
    pub cpu_cgroup: Option<String>,
    pub quota_us: Option<u64>,
    pub period_us: Option<u64>,
    pub nr_throttled: Option<u64>,
    pub throttled_ns: Option<u64>,
    /// The host's steal over every CPU, ms since boot (/proc/stat).
    pub steal_ms: Option<u64>,
}

impl Pressure {
    pub fn of(m: &crate::record::samples::MemReading) -> Pressure {
        let m0 = &m.mem;
        Pressure {
            ts_ns: m.ts_ns,
            swap_kib: m0.swap_kib,
            cpu_cgroup: m0.cpu_cgroup.clone(),
            quota_us: m0.cpu_quota_us,
            period_us: m0.cpu_period_us,
            nr_throttled: m0.nr_throttled,
            throttled_ns: m0.throttled_ns,
            steal_ms: m0.steal_ms,
        }
    }
}

/// The host's steal over every CPU across [from, to], ms: the growth between the readings that
/// bracket the window, scaled to the window when they span more (0 when unknown).
fn steal_across(p: &[Pressure], from: u64, to: u64) -> f64 {
    let Some((a, b)) = across(p, from, to) else { return 0.0 };
    let (Some(x), Some(y)) = (a.steal_ms, b.steal_ms) else { return 0.0 };
    let span = b.ts_ns.saturating_sub(a.ts_ns).max(to.saturating_sub(from)).max(1);
    y.saturating_sub(x) as f64 * to.saturating_sub(from) as f64 / span as f64
}

/// The last reading at or before `from` and the first at or after `to` (else the last one):
/// what a cumulative count grew by across a window.
fn across(p: &[Pressure], from: u64, to: u64) -> Option<(&Pressure, &Pressure)> {
    let before = p[..p.partition_point(|r| r.ts_ns <= from)].last()?;
    let after = p[p.partition_point(|r| r.ts_ns < to)..].first().or(p.last())?;
    Some((before, after))
}

/// Facts about one request's window (CLOCK_MONOTONIC ns). Trace-wide series are borrowed: the
/// report builds them once and every request's window points into them.
#[derive(Clone, Debug, Default)]
pub struct Window<'a> {
    pub arrival_ns: u64,
    /// Off-CPU intervals of the target in IO or page-fault wait.
    pub io_waits: &'a [(u64, u64)],
    /// Off-CPU intervals in memory reclaim or compaction.
    pub mem_waits: &'a [(u64, u64)],
    /// Off-CPU intervals faulting anonymous memory back in from swap (memory too).
    pub swap_waits: &'a [(u64, u64)],
    /// The sampler's readings of the target's swap and CPU quota, in time order.
    pub pressure: &'a [Pressure],
    /// The swap areas (/proc/swaps).
    pub swaps: &'a [String],
    /// Run-queue waits of the target's threads, in time order of their end.
    pub cpu_waits: &'a [CpuWait],
    /// The hypervisor's steal while the target's threads ran, in time order of their end.
    pub steal_runs: &'a [StealRun],
    /// Other processes by pid: (comm, cgroup).
    pub other_names: Option<&'a HashMap<u32, (String, Option<String>)>>,
    /// The target's own pids (a wait for a CPU behind its own threads is not another process's).
    pub target_pids: &'a [u32],
    /// Files read from disk in the window: (path, bytes, time of the first read).
    pub files_read: Vec<(String, u64, u64)>,
    /// Files mapped in the window: (time, path).
    pub mapped: Vec<(u64, String)>,
    /// When the other requests were being served: (start of their prompt processing, end).
    pub others: Vec<(u64, u64)>,
    /// Events lost anywhere in the trace, and the share of stacks unwound.
    pub lost_events: u64,
    pub offcpu_probe: bool,
    /// Stack records in this request's window, and how many were not unwound to the end.
    pub stacks: u64,
    pub stacks_cut: u64,
    /// Of those, the ones cut within [`DEEP_ENOUGH`] user frames of where they were taken, and
    /// why the cut ones stopped (by `record::Cut::ALL`).
    pub stacks_cut_shallow: u64,
    pub cut_reasons: [u64; 3],
    /// OOM kills of a target process (time).
    pub oom_kills: &'a [u64],
    /// GPU readings: (time, device, SM clock as a share of its working clock, P-state).
    pub gpu_clocks: &'a [crate::analysis::system::GpuClock],
    /// CPU readings: (time, mean current/max frequency).
    pub cpu_clocks: &'a [(u64, f64)],
    /// GPU power states from sysfs (time, device, asleep, state), in time order.
    pub gpu_pci: &'a [crate::analysis::system::PciState],
    /// Why there are no clock readings, when there are none.
    pub power_absent: Option<&'a str>,
    /// The server said it was sleeping (model unloaded) at its last poll before arrival.
    pub server_sleeping: bool,
    /// Highest count of requests the server reported deferred (queued) in the window.
    pub server_deferred: Option<f64>,
    /// Requests the server preempted while this one was served (vLLM `num_preemptions_total`).
    pub server_preemptions: Option<f64>,
    /// Prompt tokens that hit the server's prefix cache, of those looked up, while this request
    /// was served (vLLM `prefix_cache_hits_total` / `prefix_cache_queries_total`).
    pub server_prefix_cache: Option<(f64, f64)>,
    /// The critical path from arrival to the first response bytes (crate::analysis::critical).
    pub path: Option<crate::analysis::critical::Path>,
    /// Thread names by tid (the recording's `threads` records).
    pub thread_names: Option<&'a HashMap<u32, String>>,
    /// The frame most cut user stacks of the trace stop under (named at trace time).
    pub cut_under: Option<&'a str>,
    /// The engine's own view of this request (llama.cpp's steps by uprobe), when it was matched.
    pub engine: Option<&'a crate::analysis::steps::RequestEngine>,
    /// A request in flight at attach: ms from its (estimated) arrival to attach, and the state
    /// of the target then.
    pub before_attach_ms: f64,
    pub at_attach: Option<AtAttach>,
    /// The IO limits of the target's cgroups (a slow disk may be the limit).
    pub io_limits: &'a [crate::record::samples::IoLimit],
    /// When the trace ended (a request still in flight is judged up to there).
    pub trace_end_ns: u64,
    /// What the server's own endpoints said it is (llama.cpp, vLLM, Ollama), when known.
    pub server_kind: Option<crate::record::samples::Kind>,
}

/// A user stack cut at this depth or deeper still shows the functions a request's work ran in:
/// what is missing are callers near the thread's entry.
pub const DEEP_ENOUGH: usize = 8;

/// A clock below this share of its working level at arrival is a low power state...
const LOW_CLOCK: f64 = 0.7;
/// ...and it has ramped once it reaches this share.
const WORKING_CLOCK: f64 = 0.9;

/// How long a clock took to ramp after `from`: (ms, share at arrival), when it was low at
/// arrival and reached its working level before `until` (a device that never did was not the
/// one doing the work). `series` is in time order.
pub fn ramp_ms(series: &[(u64, f64)], from: u64, until: u64) -> Option<(f64, f64)> {
    let at = series.iter().rev().find(|(t, _)| *t <= from).or_else(|| series.iter().find(|(t, _)| *t <= from + 50_000_000))?.1;
    if at >= LOW_CLOCK {
        return None;
    }
    let up = series.iter().find(|(t, c)| *t > from && *t <= until && *c >= WORKING_CLOCK)?.0;
    Some(((up - from) as f64 / 1e6, at))
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Split {
    pub queue: f64,
    pub disk: f64,
    pub memory: f64,
    /// Runnable but not running: other processes (or a CPU quota) held the CPUs.
    #[serde(default)]
    pub cpu_contention: f64,
    pub power: f64,
    pub load: f64,
    pub compute: f64,
    pub unexplained: f64,
    /// A request in flight at attach: the time from its arrival (estimated) to attach. Described
    /// by the target's state at attach (the evidence), never spread over the other parts.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub before_attach: f64,
    /// Runnable while its CPU ran nothing in this guest, as the hypervisor took the CPU (the
    /// host's steal grew): not another process of this machine, not the request's work.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub steal: f64,
}

fn is_zero_ms(v: &f64) -> bool {
    *v == 0.0
}

crate::closed_set! {
    /// A part of the TTFT split, in the order every output lists them.
    SplitPart {
        #[default]
        Queue = "queue",
        Disk = "disk",
        Memory = "memory",
        CpuContention = "cpu_contention",
        Power = "power",
        Load = "load",
        Compute = "compute",
        Unexplained = "unexplained",
        BeforeAttach = "before_attach",
        Steal = "steal",
    }
}

impl Split {
    /// Each part with its ms, in [`SplitPart::ALL`] order.
    pub fn by_part(&self) -> impl Iterator<Item = (SplitPart, f64)> {
        SplitPart::ALL.iter().copied().zip(self.parts())
    }

    /// The largest part that is not the request's own work (disk, memory, cpu_contention, load,
    /// power, queue) and its ms; (None, 0) when all are 0.
    pub fn largest_stall(&self) -> (SlowCause, f64) {
        [
            (SlowCause::Disk, self.disk),
            (SlowCause::Memory, self.memory),
            (SlowCause::CpuContention, self.cpu_contention),
            (SlowCause::Load, self.load),
            (SlowCause::Power, self.power),
            (SlowCause::Queue, self.queue),
            (SlowCause::Steal, self.steal),
        ]
        .into_iter()
        .fold((SlowCause::None, 0.0), |a, b| if b.1 > a.1 { b } else { a })
    }

    /// All the parts that are not the request's own work, ms (watched ones only: not before_attach).
    pub fn stalls(&self) -> f64 {
        self.disk + self.memory + self.cpu_contention + self.load + self.power + self.queue + self.steal
    }

    /// The parts in [`SplitPart::ALL`] order, ms.
    pub fn parts(&self) -> [f64; 10] {
        [
            self.queue,
            self.disk,
            self.memory,
            self.cpu_contention,
            self.power,
            self.load,
            self.compute,
            self.unexplained,
            self.before_attach,
            self.steal,
        ]
    }

    /// The watched part named by `cause` (0 for none and compute).
    fn part(&self, cause: SlowCause) -> f64 {
        match cause {
            SlowCause::Disk => self.disk,
            SlowCause::Memory => self.memory,
            SlowCause::CpuContention => self.cpu_contention,
            SlowCause::Load => self.load,
            SlowCause::Power => self.power,
            SlowCause::Queue => self.queue,
            SlowCause::Steal => self.steal,
            _ => 0.0,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Verdict {
    /// TTFT split by cause, ms (null when the request has no TTFT).
    pub ttft_ms: Option<Split>,
    pub slow_cause: SlowCause,
    pub stop_cause: StopCause,
    /// What the stop cause rests on, in words, when more than its name (also the evidence's line):
    /// "the client closed the connection 2.0 s after the request".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_detail: Option<String>,
    /// One line per fact the verdict rests on, with numbers and names.
    pub evidence: Vec<String>,
    pub data_quality: Vec<String>,
    /// The server kept fewer prompt tokens than the client sent (see report::prompt).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prompt_cut: bool,
    /// The scheduler's view of the wait: the critical path from arrival to the first response
    /// bytes through the server's threads (see crate::analysis::critical), when the offcpu probe saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critical_path: Option<crate::analysis::critical::Path>,
    /// Files read from disk between arrival and the first token (largest first): what
    /// `probe diff` sets side by side.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_read: Vec<FileRead>,
    /// Other processes that held a CPU while the request's threads waited for one (largest
    /// first), from the scheduler's switch records.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub competitors: Vec<Competitor>,
    /// The model files' share in the page cache at the last reading before arrival.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_resident: Vec<Resident>,
    /// A request still waiting for its first token when the trace ended (Ctrl-C): how long it
    /// had been in flight, and its wait split so far (the slow cause is that split's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub so_far: Option<Split>,
}

/// What the target was doing when probe attached, for a request that arrived before.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AtAttach {
    /// "the server was blocked in a file fault (…); model.gguf 31% resident".
    pub words: String,
    /// The slow cause that state shows (a reload in progress: load; queued behind another
    /// request: queue).
    pub cause: Option<SlowCause>,
}

/// A model file's page-cache residency before a request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Resident {
    pub path: String,
    /// 0–1.
    pub share: f64,
    /// How long before arrival it was read, ms.
    pub read_ms_before: f64,
}

/// A file read from disk in a request's window.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FileRead {
    pub path: String,
    pub bytes: u64,
}

/// Another process that ran while a target thread waited for a CPU, and for how long.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Competitor {
    pub pid: u32,
    pub comm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The waits it was charged with: those it ended by giving the CPU back.
    pub ms: f64,
    /// Of those, the time it held the CPU (its run up to the switch; the same as `ms` in a
    /// recording from before the kernel said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_ms: Option<f64>,
}

impl Competitor {
    /// The time it held the CPU while a target thread waited ([`Competitor::held_ms`], else the
    /// waits it ended).
    pub fn held(&self) -> f64 {
        self.held_ms.unwrap_or(self.ms)
    }

    /// "stress (pid 43, cgroup /user.slice)".
    pub fn who(&self) -> String {
        match (&self.comm, &self.cgroup) {
            (Some(c), Some(g)) => format!("{c} (pid {}, cgroup {g})", self.pid),
            (Some(c), None) => format!("{c} (pid {})", self.pid),
            (None, _) => format!("pid {}", self.pid),
        }
    }
}

crate::closed_set! {
    /// Why a response stopped (see [`stop_cause`]).
    StopCause {
        Eos = "eos",
        RequestedLimit = "requested_limit",
        ServerLimit = "server_limit",
        StopWord = "stop_word",
        ClientDisconnect = "client_disconnect",
        Deadline = "deadline",
        Oom = "oom",
        ServerError = "server_error",
        Crash = "crash",
        #[default]
        Unknown = "unknown",
    }
}

crate::closed_set! {
    /// What made the first token slow (see [`attribute`]).
    SlowCause {
        Disk = "disk",
        Memory = "memory",
        Power = "power",
        Queue = "queue",
        Load = "load",
        CpuContention = "cpu_contention",
        /// The hypervisor took the CPUs (steal).
        Steal = "steal",
        /// A prefix an earlier request computed was computed again (the server lost its cache).
        PromptCache = "prompt_cache",
        Compute = "compute",
        #[default]
        None = "none",
    }
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

pub fn attribute(q: &RequestRecord, w: &Window<'_>) -> Verdict {
    let mut v = Verdict::default();
    stop_and_quality(q, w, &mut v);
    // A request still waiting for its first token at the end of the trace: judged so far.
    let so_far = (q.ttft_ms.is_none() && q.closed_by == ClosedBy::Open && !q.began_before_attach && q.chunks == 0)
        .then(|| q.arrival_ms.map(|_| (w.trace_end_ns.saturating_sub(w.arrival_ns)) as f64 / 1e6 + w.before_attach_ms))
        .flatten()
        .filter(|&ms| ms > 0.0 && w.trace_end_ns > 0);
    let Some(ttft) = q.ttft_ms.or(so_far) else {
        v.slow_cause = SlowCause::None;
        return v;
    };
    // What came before attach is its own part; the rest was watched.
    let before = w.before_attach_ms.clamp(0.0, ttft);
    let mut b = breakdown(q, w, ttft - before);
    b.split.before_attach = before;
    if before > 0.0 {
        let state = w.at_attach.as_ref().map(|a| format!("; at attach {}", a.words)).unwrap_or_default();
        v.evidence.push(format!("{before:.0} ms of this wait came before probe attached{state}"));
    }
    evidence(&b, w, &mut v);
    path_evidence(w, ttft, &mut v);
    let s = &b.split;
    // The cause: the largest share that is not normal work, if it matters: ≥ 20 ms, and it, or
    // the stalls together, ≥ 25% of the wait (disk and memory reclaim of one squeeze, each just
    // under a quarter, are still why the request was slow).
    // The time before attach counts for the cause the state at attach shows, with what was
    // watched of that cause.
    let (mut cause, mut ms) = s.largest_stall();
    let mut stalls = s.stalls();
    if let Some(c) = w.at_attach.as_ref().and_then(|a| a.cause) {
        stalls += before;
        if before + s.part(c) > ms {
            (cause, ms) = (c, before + s.part(c));
        }
    }
    v.slow_cause = if ms >= 20.0 && (ms >= 0.25 * ttft || stalls >= 0.25 * ttft) {
        cause
    } else if s.compute >= 0.5 * ttft && ttft >= 200.0 {
        SlowCause::Compute
    } else {
        SlowCause::None
    };
    v.files_read = w.files_read.iter().filter(|f| f.1 > 0).map(|(path, bytes, _)| FileRead { path: path.clone(), bytes: *bytes }).collect();
    v.competitors = competitors(w, b.served_from, b.to).into_iter().take(10).collect();
    if q.ttft_ms.is_none() {
        let part = match v.slow_cause {
            SlowCause::None => String::new(),
            c => format!(": {ms:.0} ms {}", c.words()),
        };
        v.evidence.insert(0, format!("in flight {:.1} s at the end of the trace, no token yet{part}", ttft / 1e3));
        v.in_flight_ms = Some(ttft);
        v.so_far = Some(b.split);
        return v;
    }
    v.ttft_ms = Some(b.split);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::payload::Stop;

    fn req(ttft: f64) -> RequestRecord {
        RequestRecord {
            ttft_ms: Some(ttft),
            content_complete: true,
            transport_complete: true,
            closed_by: ClosedBy::None,
            status: Some(200),
            ..Default::default()
        }
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
            io_waits: &[(1100 * ms, 2300 * ms)],
            files_read: vec![("/models/m.gguf".into(), 98 << 20, 1020 * ms)],
            mapped: vec![(1050 * ms, "/models/m.gguf".into())],
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!(s.disk, 1200.0);
        assert_eq!(s.load, 280.0); // from the first read (20 ms after arrival) to the token, less disk
        // With the server's timings, the load ends where its prompt processing began: that is compute.
        let mut timed = req(1500.0);
        timed.stop.server_timings = Some(serde_json::json!({"prompt_ms": 100.0}));
        let s = attribute(&timed, &w).ttft_ms.unwrap();
        assert_eq!((s.disk, s.load, s.compute), (1200.0, 180.0, 100.0));
        assert_eq!(v.slow_cause.name(), "disk");
        assert!(v.evidence.iter().any(|e| e.contains("/models/m.gguf (98.0 MiB)")), "{:?}", v.evidence);
    }

    /// Stacks cut deep (under the thread's entry) are no data-quality warning; cut shallow, they
    /// are, with why they stop.
    #[test]
    fn only_shallow_cut_stacks_are_a_warning() {
        let q = req(100.0);
        let deep = Window {
            offcpu_probe: true,
            stacks: 100,
            stacks_cut: 45,
            stacks_cut_shallow: 3,
            cut_reasons: [40, 5, 0],
            ..Default::default()
        };
        assert!(!attribute(&q, &deep).data_quality.iter().any(|d| d.contains("stacks")), "{:?}", attribute(&q, &deep).data_quality);
        let shallow = Window { stacks_cut_shallow: 30, ..deep };
        let v = attribute(&q, &shallow);
        let line = v.data_quality.iter().find(|d| d.contains("stacks")).unwrap();
        assert!(
            line.contains("30% of the stacks") && line.contains("the copied stack ran out: 40, no unwind info for a frame: 5"),
            "{line}"
        );
    }

    /// Faulting memory back in from swap is memory (not disk, not compute), with the MiB the
    /// server's VmSwap fell by and the swap area named.
    #[test]
    fn swapping_back_in_is_memory_and_names_the_swap_area() {
        let ms = 1_000_000u64;
        let mut q = req(1000.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 950.0}));
        let pressure = [
            Pressure { ts_ns: 0, swap_kib: Some(100 << 10), ..Default::default() },
            Pressure { ts_ns: 1200 * ms, swap_kib: Some(4 << 10), ..Default::default() },
        ];
        let w = Window {
            arrival_ns: 0,
            swap_waits: &[(100 * ms, 400 * ms), (300 * ms, 700 * ms)],
            pressure: &pressure,
            swaps: &["/swapfile".to_string()],
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.memory, s.disk, s.compute), (600.0, 0.0, 400.0));
        assert_eq!(v.slow_cause, SlowCause::Memory);
        assert!(
            v.evidence
                .iter()
                .any(|e| e.contains("600 ms faulting the server's memory back in from swap (/swapfile): 96.0 MiB swapped back in")),
            "{:?}",
            v.evidence
        );
        assert!(!v.evidence.iter().any(|e| e.contains("reclaim") || e.contains("no file")), "{:?}", v.evidence);
    }

    /// Two stalls of one squeeze (disk and memory), each just under a quarter of the wait,
    /// together nearly half of it: the request was slow for them, and the larger is named. One
    /// such stall alone, with the rest the request's own work, is not the cause: the work is.
    #[test]
    fn stalls_that_together_matter_name_the_largest() {
        let ms = 1_000_000u64;
        let mut q = req(200.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 200.0}));
        let w = Window {
            arrival_ns: 0,
            io_waits: &[(10 * ms, 57 * ms)],
            swap_waits: &[(100 * ms, 149 * ms)],
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.disk, s.memory), (47.0, 49.0));
        assert_eq!(v.slow_cause, SlowCause::Memory, "{:?}", v.evidence);
        let one = Window { io_waits: &[], ..w };
        assert_eq!(attribute(&q, &one).slow_cause, SlowCause::Compute);
    }

    /// Throttled by its CPU quota: the waits behind an idle CPU are cpu_contention, and the
    /// quota and its cpu.stat growth are said.
    #[test]
    fn a_cpu_quota_is_contention_and_says_the_quota() {
        let ms = 1_000_000u64;
        let mut q = req(1000.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 1000.0}));
        let waits = [CpuWait { from: 100 * ms, to: 900 * ms, tid: 7, other: 0, ..Default::default() }];
        let at = |ts_ns, n, t| Pressure {
            ts_ns,
            cpu_cgroup: Some("/slow".into()),
            quota_us: Some(20_000),
            period_us: Some(100_000),
            nr_throttled: Some(n),
            throttled_ns: Some(t),
            ..Default::default()
        };
        let pressure = [at(0, 3, 5 * ms), at(1100 * ms, 11, 805 * ms)];
        let w = Window { arrival_ns: 0, cpu_waits: &waits, pressure: &pressure, offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        assert_eq!((v.slow_cause, v.ttft_ms.as_ref().unwrap().cpu_contention), (SlowCause::CpuContention, 800.0));
        assert!(v.evidence.iter().any(|e| e.contains("its CPU quota ran out")), "{:?}", v.evidence);
        assert!(
            v.evidence.iter().any(|e| e.contains("throttled it 8 times, 800 ms (cgroup /slow: 0.20 CPU, 20000 of every 100000 µs")),
            "{:?}",
            v.evidence
        );
    }

    /// Runnable with its CPU idle in this guest (the idle task switched out for it), no quota:
    /// nobody here held the CPU. With the host's steal grown meanwhile it is steal (up to what
    /// the host counted); without, wake-up latency, said and left unexplained, never "waiting for
    /// a CPU" with nobody to name (CI: 64 ms of cpu_contention with every competitor at 0 ms).
    #[test]
    fn waits_behind_an_idle_cpu_are_steal_or_wake_up_latency_not_contention() {
        let ms = 1_000_000u64;
        let mut q = req(1000.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 1000.0}));
        let waits = [CpuWait { from: 100 * ms, to: 500 * ms, tid: 7, other: 0, ..Default::default() }];
        let bare = Window { arrival_ns: 0, cpu_waits: &waits, offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &bare);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.cpu_contention, s.steal, s.compute), (0.0, 0.0, 1000.0), "{v:?}");
        assert!(
            v.data_quality.iter().any(|d| d.starts_with("400 ms runnable with its CPU idle and no steal counted")),
            "{:?}",
            v.data_quality
        );
        assert!(!v.evidence.iter().any(|e| e.contains("waiting for a CPU")), "{:?}", v.evidence);
        // The host took 300 ms of the CPUs meanwhile: 300 ms is steal, the rest is still said.
        let at = |ts_ns, steal| Pressure { ts_ns, steal_ms: Some(steal), ..Default::default() };
        let pressure = [at(0, 5_000), at(1000 * ms, 5_300)];
        let vm = Window { pressure: &pressure, ..bare.clone() };
        let v = attribute(&q, &vm);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.cpu_contention, s.steal, s.compute), (0.0, 300.0, 700.0), "{v:?}");
        assert_eq!(v.slow_cause, SlowCause::Steal);
        assert!(v.evidence.iter().any(|e| e.starts_with("300 ms runnable while its CPU ran nothing in this machine")), "{:?}", v.evidence);
        assert!(v.data_quality.iter().any(|d| d.starts_with("100 ms runnable with its CPU idle")), "{:?}", v.data_quality);
    }

    /// Steal while the threads ran (per-switch records): taken out of the server's own work, the
    /// most-stolen thread's share of the window, a record's steal spread over its span.
    #[test]
    fn steal_while_running_comes_out_of_compute() {
        let ms = 1_000_000u64;
        let runs = [
            // Half of its span in the window: 150 of 300 ms.
            StealRun { from: 0, to: 200 * ms, tid: 7, ns: 300 * ms },
            StealRun { from: 400 * ms, to: 500 * ms, tid: 7, ns: 100 * ms },
            // Another thread, stolen less: the pool waits for the slowest.
            StealRun { from: 400 * ms, to: 500 * ms, tid: 8, ns: 50 * ms },
            // After the window.
            StealRun { from: 1100 * ms, to: 1200 * ms, tid: 7, ns: 90 * ms },
        ];
        assert_eq!(steal_running_ms(&runs, 100 * ms, 1000 * ms), 250.0);
        assert_eq!(steal_running_ms(&runs, 2000 * ms, 3000 * ms), 0.0);
        let mut q = req(1000.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 1000.0}));
        let w = Window { arrival_ns: 0, steal_runs: &runs[1..3], offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.steal, s.compute, s.cpu_contention, s.unexplained), (100.0, 900.0, 0.0, 0.0), "{v:?}");
        assert!(v.evidence.iter().any(|e| e.starts_with("the hypervisor took 100 ms of the CPUs the server ran on")), "{:?}", v.evidence);
        // Most of the TTFT stolen: steal is the slow cause.
        let big = [StealRun { from: 0, to: 1000 * ms, tid: 7, ns: 600 * ms }];
        let v = attribute(&q, &Window { steal_runs: &big, ..w.clone() });
        assert_eq!(v.slow_cause, SlowCause::Steal, "{v:?}");
    }

    /// Two threads wait for a CPU, overlapping: the request waits once. The server's prompt time
    /// ran through the waits: compute is what is left, and the competitors are named.
    #[test]
    fn waiting_for_a_cpu_is_contention_and_names_who_ran() {
        let ms = 1_000_000u64;
        let mut q = req(1000.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 1000.0}));
        let waits = [
            CpuWait { from: 100 * ms, to: 500 * ms, tid: 7, other: 42, ..Default::default() },
            CpuWait { from: 300 * ms, to: 700 * ms, tid: 8, other: 43, ..Default::default() },
            // Outside the window: not this request's.
            CpuWait { from: 1500 * ms, to: 1600 * ms, tid: 7, other: 42, ..Default::default() },
            // Behind the server's own thread: its own work sharing the CPUs, not contention.
            CpuWait { from: 800 * ms, to: 900 * ms, tid: 7, other: 9, ..Default::default() },
        ];
        let names: HashMap<u32, (String, Option<String>)> =
            [(42, ("cc1plus".to_string(), Some("/user.slice".to_string()))), (43, ("stress".to_string(), None))].into();
        let w = Window {
            arrival_ns: 0,
            cpu_waits: &waits,
            other_names: Some(&names),
            target_pids: &[9],
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.cpu_contention, s.compute, s.unexplained), (600.0, 400.0, 0.0));
        assert_eq!(v.slow_cause, SlowCause::CpuContention);
        let e = v.evidence.iter().find(|e| e.contains("waiting for a CPU")).unwrap();
        assert!(e.contains("cc1plus (pid 42, cgroup /user.slice) 400 ms") && e.contains("stress (pid 43) 400 ms"), "{e}");
        assert!(v.evidence.iter().any(|e| e.contains("the server timed 1000 ms")), "{:?}", v.evidence);
        // A control: no waits, the same request is compute.
        let calm = attribute(&q, &Window { arrival_ns: 0, offcpu_probe: true, ..Default::default() });
        assert_eq!((calm.slow_cause, calm.ttft_ms.unwrap().cpu_contention), (SlowCause::Compute, 0.0));
    }

    /// The process that gave the CPU back is charged with the wait it ended, and named for the part
    /// it held the CPU (its run up to the switch, as the kernel measured it): the wait's first part
    /// the CPU was another's, here the server's own thread.
    #[test]
    fn a_competitor_is_named_for_the_time_it_held_the_cpu() {
        let ms = 1_000_000u64;
        let q = req(1000.0);
        let waits = [
            CpuWait { from: 100 * ms, to: 500 * ms, tid: 7, other: 42, held_from: 480 * ms },
            // Before the kernel said: all of it.
            CpuWait { from: 600 * ms, to: 650 * ms, tid: 7, other: 42, held_from: 0 },
            // Held from before the window's start: clipped to it.
            CpuWait { from: 900 * ms, to: 1100 * ms, tid: 7, other: 43, held_from: 800 * ms },
        ];
        let w = Window { arrival_ns: 0, cpu_waits: &waits, offcpu_probe: true, ..Default::default() };
        let c = competitors(&w, 0, 1000 * ms);
        let by: HashMap<u32, (f64, f64)> = c.iter().map(|c| (c.pid, (c.ms, c.held()))).collect();
        assert_eq!(by[&42], (450.0, 70.0));
        assert_eq!(by[&43], (100.0, 100.0));
        assert_eq!(c[0].pid, 43, "named in the order of the time held");
        let v = attribute(&q, &w);
        let e = v.evidence.iter().find(|e| e.contains("waiting for a CPU")).unwrap();
        assert!(e.contains("pid 42 70 ms"), "{e}");
    }

    /// Woken from sleep with the model still in the page cache: nothing read from disk, the model
    /// mapped again, and the time before the server's prompt processing is the load.
    #[test]
    fn a_reload_from_the_page_cache_is_load() {
        let ms = 1_000_000u64;
        let mut q = req(900.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 200.0}));
        let asleep = Window {
            arrival_ns: 0,
            mapped: vec![(400 * ms, "/models/m.gguf".into())],
            server_sleeping: true,
            offcpu_probe: true,
            ..Default::default()
        };
        let v = attribute(&q, &asleep);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!((s.load, s.compute, s.disk, s.unexplained), (700.0, 200.0, 0.0, 0.0));
        assert_eq!(v.slow_cause, SlowCause::Load);
        assert!(
            v.evidence
                .iter()
                .any(|e| e.contains("/models/m.gguf mapped 400 ms after arrival, from the page cache (0.0 MiB read from disk)")),
            "{:?}",
            v.evidence
        );
        // Awake, the same mapping is not a reload.
        let awake = attribute(&q, &Window { server_sleeping: false, ..asleep });
        assert_eq!(awake.ttft_ms.unwrap().load, 0.0);
    }

    #[test]
    fn waiting_behind_others_is_queue() {
        let ms = 1_000_000u64;
        let mut q = req(900.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 40.0}));
        let w = Window { arrival_ns: 0, others: vec![(0, 850 * ms)], offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        assert_eq!(v.slow_cause.name(), "queue");
        let s = v.ttft_ms.unwrap();
        assert_eq!((s.queue, s.compute, s.unexplained), (850.0, 40.0, 10.0));
        // The engine's join says 100 ms (a run of a request ahead): the 850 ms others were served
        // are queue all the same.
        let e = crate::analysis::steps::RequestEngine { queue_ms: 100.0, ..Default::default() };
        let v = attribute(&q, &Window { engine: Some(&e), ..w.clone() });
        let s = v.ttft_ms.unwrap();
        assert_eq!((s.queue, s.unexplained), (850.0, 10.0));
    }

    #[test]
    fn a_gpu_asleep_at_arrival_is_power_until_it_resumed() {
        let ms = 1_000_000u64;
        let gpu = |t: u64, asleep: bool, s: &str| (t * ms, "0000:01:00.0".to_string(), asleep, s.to_string());
        let pci = vec![gpu(10, true, "D3cold"), gpu(250, false, "D0")];
        let (t, e) = resumed(&pci, 100 * ms, 1000 * ms).unwrap();
        assert_eq!(t, 150.0);
        assert_eq!(e, "GPU 0000:01:00.0 in D3cold at arrival: resumed in 150 ms");
        // Awake at arrival: nothing to say; asleep and never seen awake: said, no time.
        assert!(resumed(&pci, 300 * ms, 1000 * ms).is_none());
        let (t, e) = resumed(&pci[..1], 100 * ms, 1000 * ms).unwrap();
        assert!(t == 0.0 && e.contains("not seen to resume"), "{e}");
    }

    #[test]
    fn low_clock_at_arrival_is_power() {
        let ms = 1_000_000u64;
        let mut q = req(400.0);
        q.stop.server_timings = Some(serde_json::json!({"prompt_ms": 380.0}));
        // GPU 0 idles at 20% until 150 ms after arrival; GPU 1 is never used (stays low).
        let mut gpu: Vec<(u64, u32, f64, Option<u32>)> =
            (0..10).map(|i| (i * 50 * ms, 0, if i < 5 { 0.2 } else { 1.0 }, Some(if i < 5 { 8 } else { 0 }))).collect();
        gpu.extend((0..10).map(|i| (i * 50 * ms, 1, 0.1, Some(8))));
        let w = Window { arrival_ns: 100 * ms, gpu_clocks: &gpu, offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        let s = v.ttft_ms.clone().unwrap();
        assert_eq!(s.power, 150.0);
        assert_eq!(s.compute, 250.0);
        assert_eq!(v.slow_cause.name(), "power");
        assert!(v.evidence.iter().any(|e| e.contains("GPU 0 SM clock at 20%") && e.contains("P8")), "{:?}", v.evidence);
        // Clocks already up at arrival: no power share.
        let w = Window { arrival_ns: 300 * ms, gpu_clocks: &gpu, offcpu_probe: true, ..Default::default() };
        assert_eq!(attribute(&q, &w).ttft_ms.unwrap().power, 0.0);
        assert_eq!(ramp_ms(&[(0, 0.5), (10, 0.6)], 5, 100), None, "never reached its working clock");
    }

    #[test]
    fn an_oom_kill_in_the_window_is_the_stop_cause() {
        let mut q = req(10.0);
        q.arrival_ms = Some(0.0);
        q.content_complete = false;
        q.transport_complete = false;
        q.closed_by = ClosedBy::Server;
        q.end_ms = Some(500.0);
        let w = Window { arrival_ns: 1_000_000_000, oom_kills: &[1_400_000_000], ..Default::default() };
        assert_eq!(attribute(&q, &w).stop_cause.name(), "oom");
        let w = Window { arrival_ns: 1_000_000_000, oom_kills: &[900_000_000], ..Default::default() };
        assert_eq!(attribute(&q, &w).stop_cause.name(), "crash");
    }

    #[test]
    fn silence_before_the_close_is_a_deadline() {
        let mut q = req(10.0);
        q.content_complete = false;
        q.transport_complete = false;
        q.closed_by = ClosedBy::Client;
        q.chunks = 4;
        q.chunk_times_ms = vec![10.0, 20.0, 30.0, 40.0];
        q.closed_ms = Some(2040.0);
        assert_eq!(stop_cause(&q).0.name(), "deadline");
        assert!(stop_cause(&q).1.unwrap().contains("2.0 s"));
        q.closed_ms = Some(45.0); // the reader left while tokens flowed
        assert_eq!(stop_cause(&q).0.name(), "client_disconnect");
    }

    #[test]
    fn stop_causes() {
        let mut q = req(10.0);
        q.max_tokens = Some(8);
        q.chunks = 8;
        q.stop = Stop { finish_reason: Some("length".into()), ..Default::default() };
        assert_eq!(stop_cause(&q).0.name(), "requested_limit");
        q.max_tokens = Some(4000);
        q.stop.usage = Some(serde_json::json!({"completion_tokens": 990}));
        assert_eq!(stop_cause(&q).0.name(), "server_limit");
        q.stop = Stop { finish_reason: Some("stop".into()), ..Default::default() };
        assert_eq!(stop_cause(&q).0.name(), "eos");
        let mut c = req(10.0);
        c.content_complete = false;
        c.transport_complete = false;
        c.closed_by = ClosedBy::Client;
        assert_eq!(stop_cause(&c).0.name(), "client_disconnect");
        c.chunk_times_ms = vec![10.0];
        c.end_ms = Some(30_010.0);
        assert_eq!(stop_cause(&c).0.name(), "deadline");
        let mut e = req(10.0);
        e.status = Some(400);
        assert_eq!(stop_cause(&e).0.name(), "server_error");
    }

    /// A reader that closes right after the server's final message (before `[DONE]` or the
    /// terminal chunk): the server's stop stands, and the evidence says both facts.
    #[test]
    fn the_servers_stop_outranks_a_close_after_it() {
        for (stop, want) in [
            (Stop { finish_reason: Some("stop".into()), ..Default::default() }, "eos"),
            (Stop { stop_type: Some("word".into()), done_marker: true, ..Default::default() }, "stop_word"),
            (Stop { finish_reason: Some("stop".into()), stop_reason: Some(serde_json::json!("###")), ..Default::default() }, "stop_word"),
            (Stop { stop_type: Some("limit".into()), truncated: Some(true), done_marker: true, ..Default::default() }, "requested_limit"),
            (Stop { done_reason: Some("stop".into()), done_marker: true, ..Default::default() }, "eos"),
            (Stop { stopped: Some("eos".into()), done_marker: true, ..Default::default() }, "eos"),
        ] {
            let mut q = req(10.0);
            q.stop = stop;
            q.transport_complete = false;
            q.closed_by = ClosedBy::Client;
            q.reset = crate::stream::Reset::ByClient;
            q.chunks = 11;
            let (cause, why) = stop_cause(&q);
            assert_eq!(cause.name(), want, "{:?}", q.stop);
            let why = why.unwrap();
            assert!(why.contains("the client then closed before the end of the HTTP response, which is harmless"), "{why}");
        }
        // The same stop fields sent after the peer had left do not count (content_complete is
        // false: the stream tracker compares the final message with the peer's FIN).
        let mut q = req(10.0);
        q.stop = Stop { finish_reason: Some("stop".into()), ..Default::default() };
        q.content_complete = false;
        q.transport_complete = false;
        q.closed_by = ClosedBy::Client;
        q.chunk_times_ms = vec![5.0, 6.0, 7.0];
        q.closed_ms = Some(7.5);
        assert_eq!(stop_cause(&q).0.name(), "client_disconnect");
    }

    #[test]
    fn precedence_error_then_server_then_peer_then_transport() {
        // An error outranks everything, even a close before it.
        let mut q = req(10.0);
        q.stop.error = Some(serde_json::json!({"code": 500}));
        q.content_complete = false;
        q.closed_by = ClosedBy::Client;
        assert_eq!(stop_cause(&q).0.name(), "server_error");
        // The server's word (content complete) outranks the peer's close and the server's own close.
        let mut q = req(10.0);
        q.stop.finish_reason = Some("length".into());
        q.max_tokens = Some(16);
        q.chunks = 16;
        q.transport_complete = false;
        q.closed_by = ClosedBy::Server;
        assert_eq!(stop_cause(&q).0.name(), "requested_limit");
        // Without it: the peer's close...
        q.content_complete = false;
        q.closed_by = ClosedBy::Client;
        assert_eq!(stop_cause(&q).0.name(), "client_disconnect");
        // ...or the server's own close before its final message...
        q.closed_by = ClosedBy::Server;
        assert_eq!(stop_cause(&q).0.name(), "crash");
        // ...then the transport: still open at the end of the trace says nothing.
        q.closed_by = ClosedBy::Open;
        assert_eq!(stop_cause(&q).0.name(), "unknown");
        // A response whose framing ended without stop fields (not a generation) is not blamed.
        let mut g = req(1.0);
        g.stop = Stop::default();
        assert_eq!(stop_cause(&g).0.name(), "unknown");
        // A whole response, transport complete: the evidence has no transport remark.
        let mut e = req(1.0);
        e.stop.finish_reason = Some("stop".into());
        assert!(!stop_cause(&e).1.unwrap().contains("harmless"));
    }

    #[test]
    fn chunks_sent_after_the_peer_left_do_not_hide_a_deadline() {
        // A gateway closed after 2 s of silence; the server's next chunk went out after it.
        let mut q = req(10.0);
        q.content_complete = false;
        q.transport_complete = false;
        q.closed_by = ClosedBy::Client;
        q.chunk_times_ms = vec![10.0, 20.0, 2600.0];
        q.closed_ms = Some(2030.0);
        assert_eq!(stop_cause(&q).0.name(), "deadline");
    }

    #[test]
    fn preemptions_are_evidence_not_a_stop_cause() {
        let mut q = req(10.0);
        q.stop.finish_reason = Some("stop".into());
        let w = Window { server_preemptions: Some(3.0), offcpu_probe: true, ..Default::default() };
        let v = attribute(&q, &w);
        assert_eq!(v.stop_cause.name(), "eos");
        assert!(v.evidence.iter().any(|e| e.contains("preempted 3 request(s)")), "{:?}", v.evidence);
    }

    #[test]
    fn a_full_kv_pool_error_is_a_server_limit() {
        let mut q = req(10.0);
        q.max_tokens = Some(1000);
        q.chunks = 86;
        q.stop.error = Some(serde_json::json!({"code": 500, "type": "server_error", "reason": "context_exceeded"}));
        let (cause, why) = stop_cause(&q);
        assert_eq!(cause.name(), "server_limit");
        assert!(why.unwrap().contains("after 86 tokens"));
        q.stop.error = Some(serde_json::json!({"code": 500, "type": "server_error"}));
        assert_eq!(stop_cause(&q).0.name(), "server_error");
        // A prompt refused for the slot's context names both sizes (llama.cpp's 400 body).
        let body = serde_json::json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 751, "n_ctx": 512}});
        let mut stop = crate::stream::payload::Stop::default();
        crate::stream::payload::apply(&body, &mut stop, false);
        assert!(stop.error.as_ref().unwrap().get("message").is_none(), "no text kept: {:?}", stop.error);
        let refused = RequestRecord { status: Some(400), stop, ..req(5.0) };
        let why = stop_cause(&refused).1.unwrap();
        assert!(why.contains("its 751 tokens do not fit the slot's context of 512") && why.contains("raise -c or lower -np"), "{why}");
    }
}
