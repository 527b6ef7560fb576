//! `probe timeline`: the recording as Chrome trace-event JSON, which the Perfetto UI
//! (ui.perfetto.dev, or chrome://tracing) opens: a track per request with its wait for the first
//! token and every token, each target thread's off-CPU time by wait class, block IO per device,
//! major faults, memory maps and TCP state changes. Times are µs from the start of the trace.
use std::collections::BTreeMap;

use probe_common::{fault::FAULT_MAJOR, mmap::MmapOp, sock::SOCK_STATE};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    analysis::report,
    record::decode::Event,
    record::{Recording, samples::Sample},
};

const REQUESTS_PID: u64 = 1;
const BLOCKIO_PID: u64 = 2;
const TCP_PID: u64 = 3;
const SYSTEM_PID: u64 = 4;
/// The engine's decode steps (llama.cpp, by uprobe): one track per context.
const ENGINE_PID: u64 = 5;

crate::closed_set! {
    /// The marks on a request's track that the page's chart draws its own way: the wait for the
    /// first token (its TTFT written beside it), the first token (a strong tick) and the others.
    /// The chart reads them back by these names, from timelines read back too.
    RequestMark {
        #[default]
        UntilFirstToken = "until first token",
        FirstToken = "first token",
        Token = "token",
    }
}

/// What an event is, in the trace-event format's letters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// A slice with a duration.
    #[serde(rename = "X")]
    Complete,
    /// A point in time.
    #[serde(rename = "i", alias = "I")]
    Instant,
    /// A counter's values at a time.
    #[serde(rename = "C")]
    Counter,
    /// A process or thread name.
    #[serde(rename = "M")]
    Meta,
}

/// One trace event. The fields are in the order timeline.json has always written them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Details: a name for `M`, values for `C`, anything for a slice or instant. Kept as JSON:
    /// the page's chart reads back any trace's details, other programs' too; probe writes them
    /// from the typed structs below ([`details`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
    /// µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    pub name: String,
    pub ph: Phase,
    pub pid: u64,
    /// An instant's scope: "t" (thread) or "g" (global).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<String>,
    pub tid: u64,
    /// µs from the start of the trace (or of its window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
}

impl TraceEvent {
    fn slice(name: impl Into<String>, pid: impl Into<u64>, tid: impl Into<u64>, ts: f64, dur: f64, args: Option<Value>) -> Self {
        TraceEvent { args, dur: Some(dur), name: name.into(), ph: Phase::Complete, pid: pid.into(), s: None, tid: tid.into(), ts: Some(ts) }
    }

    fn instant(name: impl Into<String>, pid: impl Into<u64>, tid: impl Into<u64>, ts: f64, global: bool, args: Option<Value>) -> Self {
        let s = Some(if global { "g" } else { "t" }.to_string());
        TraceEvent { args, dur: None, name: name.into(), ph: Phase::Instant, pid: pid.into(), s, tid: tid.into(), ts: Some(ts) }
    }
}

/// An event's details as the trace keeps them, from one of the typed structs below. Their
/// JSON is an object (keys in order), so the fields are in alphabetical order as written.
fn details(d: impl Serialize) -> Option<Value> {
    serde_json::to_value(d).ok()
}

/// A process or thread name (`M`).
#[derive(Serialize)]
struct NameArgs<'a> {
    name: &'a str,
}

/// A request's slice: its answer and the verdict's causes.
#[derive(Serialize)]
struct RequestArgs {
    chunks: u64,
    closed_by: crate::stream::ClosedBy,
    slow_cause: Option<crate::analysis::verdict::SlowCause>,
    status: Option<u16>,
    stop_cause: Option<crate::analysis::verdict::StopCause>,
}

/// The wait for the first token: the verdict's split of it.
#[derive(Serialize)]
struct TtftArgs<'a> {
    ttft_ms: Option<&'a crate::analysis::verdict::Split>,
}

/// An off-CPU slice: the thread that woke it.
#[derive(Serialize)]
struct WokenArgs {
    woken_by_tid: u32,
}

/// A block request.
#[derive(Serialize)]
struct BlockIoArgs {
    bytes: u32,
    issuer_tid: u32,
    queue_us: f64,
    sector: u64,
}

/// A GPU's clocks, MHz.
#[derive(Serialize)]
struct ClockArgs {
    mem: Option<u32>,
    sm: Option<u32>,
}

/// VRAM in use, MiB: all of it and the target's.
#[derive(Serialize)]
struct VramArgs {
    target: Option<u64>,
    used: Option<u64>,
}

/// Memory pressure stall, ms per second: some task, or every task, stalled.
#[derive(Serialize)]
struct PsiArgs {
    full: f64,
    some: f64,
}

/// The target's RSS, MiB: all of it and its file-backed part.
#[derive(Serialize)]
struct RssArgs {
    all: u64,
    file: Option<u64>,
}

/// A counter with one series, `key`.
fn one<T: Serialize>(key: &str, value: T) -> BTreeMap<&str, T> {
    BTreeMap::from([(key, value)])
}

/// A major fault: the address, in hex.
#[derive(Serialize)]
struct FaultArgs {
    addr: String,
}

/// A memory-map call.
#[derive(Serialize)]
struct MmapArgs {
    len: u64,
}

/// A memory stall (reclaim, compaction): pages scanned or its status.
#[derive(Serialize)]
struct MemArgs {
    pages_or_status: u64,
}

/// A TCP event: the peer's port.
#[derive(Serialize)]
struct SockArgs {
    dport: u16,
}

/// A decode step: its tokens, per sequence, and what the engine returned.
#[derive(Serialize)]
struct StepArgs {
    ret: i32,
    sequences: BTreeMap<String, u16>,
    tokens: u32,
}

/// A cache sequence removed: which, and the positions.
#[derive(Serialize)]
struct SeqRmArgs {
    p0: i32,
    p1: i32,
    seq: i32,
}

/// The timeline: Chrome trace-event JSON as the Perfetto UI and chrome://tracing open it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    #[serde(rename = "displayTimeUnit", default)]
    pub display_time_unit: String,
    #[serde(rename = "otherData", default)]
    pub other: OtherData,
    #[serde(rename = "traceEvents")]
    pub events: Vec<TraceEvent>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OtherData {
    pub probe: String,
    pub target_pid: u32,
}

fn meta(pid: u64, tid: Option<u64>, name: &str) -> TraceEvent {
    let (kind, tid) = match tid {
        None => ("process_name", 0),
        Some(t) => ("thread_name", t),
    };
    TraceEvent { args: details(NameArgs { name }), dur: None, name: kind.into(), ph: Phase::Meta, pid, s: None, tid, ts: None }
}

/// Counter tracks from the sampler records: GPU clocks, power and VRAM, CPU frequency, memory
/// pressure (PSI stall ms per second, RSS), the model files' residency, the server's queue.
fn counters(rec: &Recording, us: &dyn Fn(u64) -> f64, ev: &mut Vec<TraceEvent>) {
    let c = |name: String, ts: f64, values: Option<Value>| TraceEvent {
        args: values,
        dur: None,
        name,
        ph: Phase::Counter,
        pid: SYSTEM_PID,
        s: None,
        tid: 0,
        ts: Some(ts),
    };
    let mut last_psi: Option<(u64, u64, u64)> = None;
    let mut last_idle: Option<(u64, &[u64])> = None;
    for v in rec.samples() {
        let t = v.ts_ns();
        let ts = us(t);
        match v {
            Sample::Gpu(v) => {
                for g in &v.gpus {
                    let i = g.index;
                    ev.push(c(format!("GPU {i} clock MHz"), ts, details(ClockArgs { mem: g.mem_mhz, sm: g.sm_mhz })));
                    ev.push(c(format!("GPU {i} P-state"), ts, details(one("P", g.pstate))));
                    ev.push(c(format!("GPU {i} power W"), ts, details(one("W", g.power_w))));
                    ev.push(c(
                        format!("GPU {i} VRAM MiB"),
                        ts,
                        details(VramArgs { target: g.target_vram.map(|b| b >> 20), used: g.vram_used.map(|b| b >> 20) }),
                    ));
                }
            }
            Sample::Cpufreq(v) => {
                let khz = &v.cur_khz;
                if !khz.is_empty() {
                    ev.push(c(
                        "CPU MHz (mean)".into(),
                        ts,
                        details(one("MHz", khz.iter().map(|&k| k as f64).sum::<f64>() / khz.len() as f64 / 1e3)),
                    ));
                }
            }
            Sample::Cpuidle(v) => {
                let time = &v.idle.time_us;
                if let Some((t0, prev)) = last_idle {
                    let wall = (t.saturating_sub(t0) as f64 / 1e3 * f64::from(v.idle.cpus)).max(1.0);
                    let mut shares: BTreeMap<&str, f64> = BTreeMap::new();
                    for (i, name) in v.idle.names.iter().enumerate() {
                        let d = time.get(i).zip(prev.get(i)).map_or(0, |(a, b)| a.saturating_sub(*b));
                        shares.insert(name, (d as f64 / wall * 100.0).min(100.0));
                    }
                    ev.push(c("CPU idle % by state".into(), ts, details(shares)));
                }
                last_idle = Some((t, time));
            }
            Sample::Mem(v) => {
                let v = &v.mem;
                if let (Some(some), Some(full)) = (v.psi_some_us, v.psi_full_us) {
                    if let Some((t0, s0, f0)) = last_psi {
                        let secs = (t.saturating_sub(t0) as f64 / 1e9).max(1e-3);
                        ev.push(c(
                            "memory stall ms/s (PSI)".into(),
                            ts,
                            details(PsiArgs {
                                full: full.saturating_sub(f0) as f64 / 1e3 / secs,
                                some: some.saturating_sub(s0) as f64 / 1e3 / secs,
                            }),
                        ));
                    }
                    last_psi = Some((t, some, full));
                }
                if let Some(rss) = v.rss_kib {
                    ev.push(c("target RSS MiB".into(), ts, details(RssArgs { all: rss >> 10, file: v.rss_file_kib.map(|k| k >> 10) })));
                }
            }
            Sample::Residency(v) => {
                for f in &v.files {
                    let name = f.path.rsplit('/').next().unwrap_or("?").to_string();
                    ev.push(c(
                        format!("{name} in page cache %"),
                        ts,
                        details(one("%", f.resident as f64 / (f.pages as f64).max(1.0) * 100.0)),
                    ));
                }
            }
            Sample::Endpoint(v) => {
                for (k, label) in [
                    ("llamacpp:requests_processing", "processing"),
                    ("llamacpp:requests_deferred", "deferred"),
                    ("vllm:num_requests_running", "running"),
                    ("vllm:num_requests_waiting", "waiting"),
                ] {
                    if let Some(x) = v.metric(k) {
                        ev.push(c(format!("server requests {label}"), ts, details(one(label, x))));
                    }
                }
                if let Some(sleeping) = v.sleeping() {
                    ev.push(c("server sleeping (1 = asleep)".into(), ts, details(one("sleeping", u8::from(sleeping)))));
                }
            }
            Sample::Samplers(_) | Sample::Attach(_) => {}
        }
    }
}

/// The timeline of what an analysis' recording kept.
pub fn of(a: &crate::analysis::Analysis) -> Trace {
    build(&a.recording, &a.report, &a.names)
}

/// Build the trace. `kernel` classifies off-CPU waits (see crate::analysis::ksyms).
pub fn build(rec: &Recording, r: &report::Report, kernel: &crate::analysis::ksyms::Names) -> Trace {
    let start = rec.meta().map_or(0, |m| m.start_ns);
    // A window of a longer trace (a `probe watch` incident) is drawn from its own start.
    let origin = rec.meta().and_then(|m| m.window_start_ns).unwrap_or(start).max(start);
    let us = |ns: u64| ns.saturating_sub(origin) as f64 / 1e3;
    let mut ev: Vec<TraceEvent> = vec![
        meta(REQUESTS_PID, None, "requests"),
        meta(BLOCKIO_PID, None, "block IO"),
        meta(TCP_PID, None, "TCP"),
        meta(SYSTEM_PID, None, "system (GPU, CPU, memory)"),
        meta(r.target.pid as u64, None, &format!("{} (pid {})", r.target.comm, r.target.pid)),
    ];
    for q in &r.requests {
        let name = format!("#{} {} {}", q.id, q.method.as_deref().unwrap_or("?"), q.path.as_deref().unwrap_or("?"));
        ev.push(meta(REQUESTS_PID, Some(q.id), &name));
        let Some(a) = q.arrival_ms else { continue };
        let at = a * 1e3 - (origin - start) as f64 / 1e3;
        let v = q.verdict.as_ref();
        let args = RequestArgs {
            chunks: q.chunks,
            closed_by: q.closed_by,
            slow_cause: v.map(|v| v.slow_cause),
            status: q.status,
            stop_cause: v.map(|v| v.stop_cause),
        };
        ev.push(TraceEvent::slice(name, REQUESTS_PID, q.id, at, q.end_ms.unwrap_or(0.0) * 1e3, details(args)));
        if let Some(t) = q.ttft_ms {
            let args = details(TtftArgs { ttft_ms: v.and_then(|v| v.ttft_ms.as_ref()) });
            ev.push(TraceEvent::slice(RequestMark::UntilFirstToken.name(), REQUESTS_PID, q.id, at, t * 1e3, args));
            ev.push(TraceEvent::instant(RequestMark::FirstToken.name(), REQUESTS_PID, q.id, at + t * 1e3, false, None));
        }
        for c in q.chunk_times_ms.iter().skip(1) {
            ev.push(TraceEvent::instant(RequestMark::Token.name(), REQUESTS_PID, q.id, at + c * 1e3, false, None));
        }
    }
    // Off-CPU time of each target thread, named by what it waited for.
    let mut threads: BTreeMap<(u64, u64), ()> = BTreeMap::new();
    for s in rec.stacks.iter().filter(|s| s.what == crate::record::StackKind::Offcpu) {
        let Some(b) = s.blocked_ns else { continue };
        threads.insert((u64::from(s.pid), u64::from(s.tid)), ());
        let args = s.waker.and_then(|w| details(WokenArgs { woken_by_tid: w }));
        ev.push(TraceEvent::slice(kernel.wait_of_stack(s), s.pid, s.tid, us(s.ts_ns), b as f64 / 1e3, args));
    }
    let mut devices: BTreeMap<u32, u64> = BTreeMap::new();
    let mut engine_tracks: BTreeMap<u64, u64> = BTreeMap::new();
    for e in &rec.events {
        match e {
            Event::BlockIo(b) => {
                let n = devices.len() as u64 + 1;
                let tid = *devices.entry(b.dev).or_insert(n);
                let begin = if b.insert_ns != 0 { b.insert_ns } else { b.issue_ns };
                let rwbs = String::from_utf8_lossy(b.rwbs.split(|&c| c == 0).next().unwrap_or_default()).to_string();
                let queue_us = if b.insert_ns != 0 { b.issue_ns.saturating_sub(b.insert_ns) as f64 / 1e3 } else { 0.0 };
                let args = details(BlockIoArgs { bytes: b.bytes, issuer_tid: b.hdr.tid, queue_us, sector: b.sector });
                let dur = b.complete_ns.saturating_sub(begin) as f64 / 1e3;
                ev.push(TraceEvent::slice(format!("{rwbs} {} KiB", b.bytes / 1024), BLOCKIO_PID, tid, us(begin), dur, args));
            }
            Event::Fault(f) if f.flags & FAULT_MAJOR != 0 => {
                threads.insert((f.hdr.pid as u64, f.hdr.tid as u64), ());
                let args = details(FaultArgs { addr: format!("{:#x}", f.addr) });
                ev.push(TraceEvent::instant("major fault", f.hdr.pid, f.hdr.tid, us(f.hdr.ts_ns), false, args));
            }
            Event::Mmap(m) => {
                threads.insert((m.hdr.pid as u64, m.hdr.tid as u64), ());
                let op = MmapOp::try_from(m.op).map(|o| o.name()).unwrap_or("mmap?");
                let dur = m.hdr.ts_ns.saturating_sub(m.enter_ns) as f64 / 1e3;
                ev.push(TraceEvent::slice(op, m.hdr.pid, m.hdr.tid, us(m.enter_ns), dur, details(MmapArgs { len: m.len })));
            }
            Event::Engine(e) => engine_event(e, &us, &mut ev, &mut engine_tracks),
            Event::Mem(m) if m.what == probe_common::mem::MEM_OOM_VICTIM => {
                ev.push(TraceEvent::instant(format!("OOM kill of pid {}", m.victim), SYSTEM_PID, 0u64, us(m.hdr.ts_ns), true, None));
            }
            Event::Mem(m) => {
                threads.insert((m.hdr.pid as u64, m.hdr.tid as u64), ());
                let dur = m.hdr.ts_ns.saturating_sub(m.begin_ns) as f64 / 1e3;
                let args = details(MemArgs { pages_or_status: m.nr });
                ev.push(TraceEvent::slice(probe_common::mem::mem_name(m.what), m.hdr.pid, m.hdr.tid, us(m.begin_ns), dur, args));
            }
            Event::Sock(s) => {
                let name = if s.what == SOCK_STATE {
                    format!("{} → {}", report::state_name(s.oldstate), report::state_name(s.newstate))
                } else if s.what == probe_common::sock::SOCK_RESET_RECEIVED {
                    "reset received".to_string()
                } else {
                    "reset sent".to_string()
                };
                ev.push(TraceEvent::instant(name, TCP_PID, s.sport, us(s.hdr.ts_ns), false, details(SockArgs { dport: s.dport })));
            }
            _ => {}
        }
    }
    counters(rec, &us, &mut ev);
    for (dev, tid) in &devices {
        ev.push(meta(BLOCKIO_PID, Some(*tid), &format!("dev {}:{}", dev >> 20, dev & 0xfffff)));
    }
    if !engine_tracks.is_empty() {
        ev.push(meta(ENGINE_PID, None, "engine (llama.cpp decode steps)"));
        for (ctx, tid) in &engine_tracks {
            ev.push(meta(ENGINE_PID, Some(*tid), &format!("context {ctx:#x}")));
        }
    }
    let names = rec.thread_names();
    for (pid, tid) in threads.keys() {
        let name = match names.get(&(*tid as u32)) {
            Some(n) => format!("{n} ({tid})"),
            None => format!("thread {tid}"),
        };
        ev.push(meta(*pid, Some(*tid), &name));
    }
    Trace {
        display_time_unit: "ms".into(),
        other: OtherData { probe: env!("CARGO_PKG_VERSION").into(), target_pid: r.target.pid },
        events: ev,
    }
}

/// An engine record on the engine track: a step as a slice carrying its batch (tokens per
/// sequence), cache drops and runtime init as instants and slices.
fn engine_event(
    e: &probe_common::engine::EngineEvent,
    us: &impl Fn(u64) -> f64,
    ev: &mut Vec<TraceEvent>,
    tracks: &mut BTreeMap<u64, u64>,
) {
    use probe_common::engine::{ENGINE_CLEAR, ENGINE_SEQ_RM, SEQS, what_name};
    let n = tracks.len() as u64 + 1;
    let track = if e.what == ENGINE_SEQ_RM || e.what == ENGINE_CLEAR || e.ctx == 0 { 0 } else { *tracks.entry(e.ctx).or_insert(n) };
    let dur = e.hdr.ts_ns.saturating_sub(e.begin_ns) as f64 / 1e3;
    match e.what {
        ENGINE_SEQ_RM => {
            let args = details(SeqRmArgs { p0: e.p0, p1: e.p1, seq: e.seq });
            ev.push(TraceEvent::instant("cache: sequence removed", ENGINE_PID, track, us(e.begin_ns), false, args));
        }
        ENGINE_CLEAR => ev.push(TraceEvent::instant("cache cleared", ENGINE_PID, track, us(e.begin_ns), false, None)),
        _ => {
            let sequences = (0..SEQS).filter(|&s| e.seq_tokens[s] > 0).map(|s| (format!("seq {s}"), e.seq_tokens[s])).collect();
            let args = details(StepArgs { ret: e.ret as i32, sequences, tokens: e.n_tokens });
            let name = format!("{} {} tok", what_name(e.what), e.n_tokens);
            ev.push(TraceEvent::slice(name, ENGINE_PID, track, us(e.begin_ns), dur, args));
        }
    }
}
