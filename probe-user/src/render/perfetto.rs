//! `probe timeline`: the recording as Chrome trace-event JSON, which the Perfetto UI
//! (ui.perfetto.dev, or chrome://tracing) opens: a track per request with its wait for the first
//! token and every token, each target thread's off-CPU time by wait class, block IO per device,
//! major faults, memory maps and TCP state changes. Times are µs from the start of the trace.
use std::collections::BTreeMap;

use probe_common::{fault::FAULT_MAJOR, mmap::MmapOp, sock::SOCK_STATE};
use serde::{Deserialize, Serialize};

use crate::{
    analysis::report,
    analysis::verdict::{Split, SplitPart},
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

crate::closed_set! {
    /// The TCP events that are not state changes: the chart colours them alike.
    SockMark {
        #[default]
        ResetReceived = "reset received",
        ResetSent = "reset sent",
    }
}

crate::closed_set! {
    /// The timeline's own process tracks, named in their `process_name` events: the chart groups
    /// and labels its lanes by them.
    Track {
        #[default]
        Requests = "requests",
        BlockIo = "block IO",
        Tcp = "TCP",
        System = "system (GPU, CPU, memory)",
        Engine = "engine (llama.cpp decode steps)",
    }
}

/// One trace event. The fields are in the order timeline.json has always written them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Details: a name for `M`, series for `C`, a slice's or instant's own kind of details.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Details>,
    /// µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    pub name: String,
    pub ph: Phase,
    pub pid: u64,
    /// An instant's scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<Scope>,
    pub tid: u64,
    /// µs from the start of the trace (or of its window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
}

/// An instant's scope, in the trace-event format's letters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scope {
    /// On its thread's track.
    #[serde(rename = "t")]
    Thread,
    /// Across the whole trace.
    #[serde(rename = "g")]
    Global,
}

impl TraceEvent {
    fn slice(name: impl Into<String>, pid: impl Into<u64>, tid: impl Into<u64>, ts: f64, dur: f64, args: Option<Details>) -> Self {
        TraceEvent { args, dur: Some(dur), name: name.into(), ph: Phase::Complete, pid: pid.into(), s: None, tid: tid.into(), ts: Some(ts) }
    }

    fn instant(name: impl Into<String>, pid: impl Into<u64>, tid: impl Into<u64>, ts: f64, global: bool, args: Option<Details>) -> Self {
        let s = Some(if global { Scope::Global } else { Scope::Thread });
        TraceEvent { args, dur: None, name: name.into(), ph: Phase::Instant, pid: pid.into(), s, tid: tid.into(), ts: Some(ts) }
    }
}

/// Declares the details of one kind of event: a struct written as a JSON object with its fields
/// in the order given, which is alphabetical (timeline.json has always had its details' keys
/// sorted), and read back only from an object with exactly its keys (see [`Details`]).
macro_rules! details {
    ($($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident: $ty:ty),+ $(,)? })+) => {$(
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty,)+
        }

        impl $name {
            /// Each key with its value's JSON, in the order written.
            fn fields(&self) -> Vec<(&'static str, String)> {
                vec![$((stringify!($field), serde_json::to_string(&self.$field).unwrap_or_default())),+]
            }
        }
    )+};
}

details! {
    /// A process or thread name (`M`).
    NameArgs {
        name: String,
    }

    /// A request's slice: its answer and the verdict's causes.
    RequestArgs {
        chunks: u64,
        closed_by: crate::stream::ClosedBy,
        slow_cause: Option<crate::analysis::verdict::SlowCause>,
        status: Option<u16>,
        stop_cause: Option<crate::analysis::verdict::StopCause>,
    }

    /// The wait for the first token: the verdict's split of it.
    TtftArgs {
        /// Always written (null without a verdict), so read back only where it is: an empty
        /// object is a counter's (no series), not this.
        #[serde(deserialize_with = "Option::deserialize")]
        ttft_ms: Option<SplitByName>,
    }

    /// An off-CPU slice: the thread that woke it.
    WokenArgs {
        woken_by_tid: u32,
    }

    /// A block request.
    BlockIoArgs {
        bytes: u32,
        issuer_tid: u32,
        queue_us: f64,
        sector: u64,
    }

    /// A major fault: the address, in hex.
    FaultArgs {
        addr: String,
    }

    /// A memory-map call.
    MmapArgs {
        len: u64,
    }

    /// A memory stall (reclaim, compaction): pages scanned or its status.
    MemArgs {
        pages_or_status: u64,
    }

    /// A TCP event: the peer's port.
    SockArgs {
        dport: u16,
    }

    /// A decode step: what the engine returned, its tokens per sequence, and all its tokens.
    StepArgs {
        ret: i32,
        sequences: BTreeMap<String, u16>,
        tokens: u32,
    }

    /// A cache sequence removed: the positions, and which.
    SeqRmArgs {
        p0: i32,
        p1: i32,
        seq: i32,
    }
}

/// An event's details, one kind per thing the timeline draws. Written as the JSON object each
/// kind is; read back (the bundle cleans the timeline through its JSON) by its keys, which no
/// two kinds share, a counter's series last.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Details {
    Name(NameArgs),
    Request(RequestArgs),
    Ttft(TtftArgs),
    Woken(WokenArgs),
    BlockIo(BlockIoArgs),
    Fault(FaultArgs),
    Mmap(MmapArgs),
    Mem(MemArgs),
    Sock(SockArgs),
    Step(StepArgs),
    SeqRm(SeqRmArgs),
    /// A counter's series by key (`C`), in key order; null where the value was not read.
    Counter(BTreeMap<String, Option<Num>>),
}

impl Details {
    /// Each key with its value's JSON, in the order written: what the chart's hover titles say.
    pub fn fields(&self) -> Vec<(&str, String)> {
        match self {
            Details::Name(d) => d.fields(),
            Details::Request(d) => d.fields(),
            Details::Ttft(d) => d.fields(),
            Details::Woken(d) => d.fields(),
            Details::BlockIo(d) => d.fields(),
            Details::Fault(d) => d.fields(),
            Details::Mmap(d) => d.fields(),
            Details::Mem(d) => d.fields(),
            Details::Sock(d) => d.fields(),
            Details::Step(d) => d.fields(),
            Details::SeqRm(d) => d.fields(),
            Details::Counter(series) => series.iter().map(|(k, v)| (k.as_str(), serde_json::to_string(v).unwrap_or_default())).collect(),
        }
    }
}

/// A counter's value as written: a count (no fraction in the JSON) or a measure.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Num {
    Count(u64),
    Measure(f64),
}

impl Num {
    pub fn as_f64(self) -> f64 {
        match self {
            Num::Count(n) => n as f64,
            Num::Measure(x) => x,
        }
    }
}

impl From<u64> for Num {
    fn from(n: u64) -> Num {
        Num::Count(n)
    }
}

impl From<u32> for Num {
    fn from(n: u32) -> Num {
        Num::Count(n.into())
    }
}

impl From<u8> for Num {
    fn from(n: u8) -> Num {
        Num::Count(n.into())
    }
}

impl From<f64> for Num {
    fn from(x: f64) -> Num {
        Num::Measure(x)
    }
}

/// A counter's series from (key, value) pairs.
fn counter<const N: usize>(series: [(&str, Option<Num>); N]) -> Option<Details> {
    Some(Details::Counter(series.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

/// A counter with one series, `key`.
fn one(key: &str, value: Option<impl Into<Num>>) -> Option<Details> {
    counter([(key, value.map(Into::into))])
}

/// The verdict's split of a TTFT as the timeline writes it: the parts by name, in alphabetical
/// order, the ones a split leaves out when zero left out here too (as [`Split`] serializes).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct SplitByName(pub Split);

impl Serialize for SplitByName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut parts: Vec<(SplitPart, f64)> =
            self.0.by_part().filter(|&(p, ms)| !(matches!(p, SplitPart::BeforeAttach | SplitPart::Steal) && ms == 0.0)).collect();
        parts.sort_by_key(|(p, _)| p.name());
        s.collect_map(parts.into_iter().map(|(p, ms)| (p.name(), ms)))
    }
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

crate::closed_set! {
    /// What a `M` event names, in the trace-event format's words.
    MetaName {
        #[default]
        ProcessName = "process_name",
        ThreadName = "thread_name",
    }
}

fn meta(pid: u64, tid: Option<u64>, name: &str) -> TraceEvent {
    let (kind, tid) = match tid {
        None => (MetaName::ProcessName, 0),
        Some(t) => (MetaName::ThreadName, t),
    };
    let args = Some(Details::Name(NameArgs { name: name.into() }));
    TraceEvent { args, dur: None, name: kind.name().into(), ph: Phase::Meta, pid, s: None, tid, ts: None }
}

/// Counter tracks from the sampler records: GPU clocks, power and VRAM, CPU frequency, memory
/// pressure (PSI stall ms per second, RSS), the model files' residency, the server's queue.
fn counters(rec: &Recording, us: &dyn Fn(u64) -> f64, ev: &mut Vec<TraceEvent>) {
    let c = |name: String, ts: f64, values: Option<Details>| TraceEvent {
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
                    ev.push(c(
                        format!("GPU {i} clock MHz"),
                        ts,
                        counter([("mem", g.mem_mhz.map(Num::from)), ("sm", g.sm_mhz.map(Num::from))]),
                    ));
                    ev.push(c(format!("GPU {i} P-state"), ts, one("P", g.pstate)));
                    ev.push(c(format!("GPU {i} power W"), ts, one("W", g.power_w)));
                    ev.push(c(
                        format!("GPU {i} VRAM MiB"),
                        ts,
                        counter([("target", g.target_vram.map(|b| Num::from(b >> 20))), ("used", g.vram_used.map(|b| Num::from(b >> 20)))]),
                    ));
                }
            }
            Sample::Cpufreq(v) => {
                let khz = &v.cur_khz;
                if !khz.is_empty() {
                    ev.push(c(
                        "CPU MHz (mean)".into(),
                        ts,
                        one("MHz", Some(khz.iter().map(|&k| k as f64).sum::<f64>() / khz.len() as f64 / 1e3)),
                    ));
                }
            }
            Sample::Cpuidle(v) => {
                let time = &v.idle.time_us;
                if let Some((t0, prev)) = last_idle {
                    let wall = (t.saturating_sub(t0) as f64 / 1e3 * f64::from(v.idle.cpus)).max(1.0);
                    let mut shares = BTreeMap::new();
                    for (i, name) in v.idle.names.iter().enumerate() {
                        let d = time.get(i).zip(prev.get(i)).map_or(0, |(a, b)| a.saturating_sub(*b));
                        shares.insert(name.clone(), Some(Num::from((d as f64 / wall * 100.0).min(100.0))));
                    }
                    ev.push(c("CPU idle % by state".into(), ts, Some(Details::Counter(shares))));
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
                            counter([
                                ("full", Some(Num::from(full.saturating_sub(f0) as f64 / 1e3 / secs))),
                                ("some", Some(Num::from(some.saturating_sub(s0) as f64 / 1e3 / secs))),
                            ]),
                        ));
                    }
                    last_psi = Some((t, some, full));
                }
                if let Some(rss) = v.rss_kib {
                    ev.push(c(
                        "target RSS MiB".into(),
                        ts,
                        counter([("all", Some(Num::from(rss >> 10))), ("file", v.rss_file_kib.map(|k| Num::from(k >> 10)))]),
                    ));
                }
            }
            Sample::Residency(v) => {
                for f in &v.files {
                    let name = f.path.rsplit('/').next().unwrap_or("?").to_string();
                    ev.push(c(
                        format!("{name} in page cache %"),
                        ts,
                        one("%", Some(f.resident as f64 / (f.pages as f64).max(1.0) * 100.0)),
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
                        ev.push(c(format!("server requests {label}"), ts, one(label, Some(x))));
                    }
                }
                if let Some(sleeping) = v.sleeping() {
                    ev.push(c("server sleeping (1 = asleep)".into(), ts, one("sleeping", Some(u8::from(sleeping)))));
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
        meta(REQUESTS_PID, None, Track::Requests.name()),
        meta(BLOCKIO_PID, None, Track::BlockIo.name()),
        meta(TCP_PID, None, Track::Tcp.name()),
        meta(SYSTEM_PID, None, Track::System.name()),
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
        ev.push(TraceEvent::slice(name, REQUESTS_PID, q.id, at, q.end_ms.unwrap_or(0.0) * 1e3, Some(Details::Request(args))));
        if let Some(t) = q.ttft_ms {
            let args = Some(Details::Ttft(TtftArgs { ttft_ms: v.and_then(|v| v.ttft_ms.clone()).map(SplitByName) }));
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
        let args = s.waker.map(|w| Details::Woken(WokenArgs { woken_by_tid: w }));
        ev.push(TraceEvent::slice(kernel.wait_kind_of_stack(s).name(), s.pid, s.tid, us(s.ts_ns), b as f64 / 1e3, args));
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
                let args = Some(Details::BlockIo(BlockIoArgs { bytes: b.bytes, issuer_tid: b.hdr.tid, queue_us, sector: b.sector }));
                let dur = b.complete_ns.saturating_sub(begin) as f64 / 1e3;
                ev.push(TraceEvent::slice(format!("{rwbs} {} KiB", b.bytes / 1024), BLOCKIO_PID, tid, us(begin), dur, args));
            }
            Event::Fault(f) if f.flags & FAULT_MAJOR != 0 => {
                threads.insert((f.hdr.pid as u64, f.hdr.tid as u64), ());
                let args = Some(Details::Fault(FaultArgs { addr: format!("{:#x}", f.addr) }));
                ev.push(TraceEvent::instant("major fault", f.hdr.pid, f.hdr.tid, us(f.hdr.ts_ns), false, args));
            }
            Event::Mmap(m) => {
                threads.insert((m.hdr.pid as u64, m.hdr.tid as u64), ());
                let op = MmapOp::try_from(m.op).map(|o| o.name()).unwrap_or("mmap?");
                let dur = m.hdr.ts_ns.saturating_sub(m.enter_ns) as f64 / 1e3;
                ev.push(TraceEvent::slice(op, m.hdr.pid, m.hdr.tid, us(m.enter_ns), dur, Some(Details::Mmap(MmapArgs { len: m.len }))));
            }
            Event::Engine(e) => engine_event(e, &us, &mut ev, &mut engine_tracks),
            Event::Mem(m) if m.what == probe_common::mem::MEM_OOM_VICTIM => {
                ev.push(TraceEvent::instant(format!("OOM kill of pid {}", m.victim), SYSTEM_PID, 0u64, us(m.hdr.ts_ns), true, None));
            }
            Event::Mem(m) => {
                threads.insert((m.hdr.pid as u64, m.hdr.tid as u64), ());
                let dur = m.hdr.ts_ns.saturating_sub(m.begin_ns) as f64 / 1e3;
                let args = Some(Details::Mem(MemArgs { pages_or_status: m.nr }));
                ev.push(TraceEvent::slice(probe_common::mem::mem_name(m.what), m.hdr.pid, m.hdr.tid, us(m.begin_ns), dur, args));
            }
            Event::Sock(s) => {
                let name = if s.what == SOCK_STATE {
                    format!("{} → {}", report::state_name(s.oldstate), report::state_name(s.newstate))
                } else if s.what == probe_common::sock::SOCK_RESET_RECEIVED {
                    SockMark::ResetReceived.name().to_string()
                } else {
                    SockMark::ResetSent.name().to_string()
                };
                let args = Some(Details::Sock(SockArgs { dport: s.dport }));
                ev.push(TraceEvent::instant(name, TCP_PID, s.sport, us(s.hdr.ts_ns), false, args));
            }
            _ => {}
        }
    }
    counters(rec, &us, &mut ev);
    for (dev, tid) in &devices {
        ev.push(meta(BLOCKIO_PID, Some(*tid), &format!("dev {}:{}", dev >> 20, dev & 0xfffff)));
    }
    if !engine_tracks.is_empty() {
        ev.push(meta(ENGINE_PID, None, Track::Engine.name()));
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
            let args = Some(Details::SeqRm(SeqRmArgs { p0: e.p0, p1: e.p1, seq: e.seq }));
            ev.push(TraceEvent::instant("cache: sequence removed", ENGINE_PID, track, us(e.begin_ns), false, args));
        }
        ENGINE_CLEAR => ev.push(TraceEvent::instant("cache cleared", ENGINE_PID, track, us(e.begin_ns), false, None)),
        _ => {
            let sequences = (0..SEQS).filter(|&s| e.seq_tokens[s] > 0).map(|s| (format!("seq {s}"), e.seq_tokens[s])).collect();
            let args = Some(Details::Step(StepArgs { ret: e.ret as i32, sequences, tokens: e.n_tokens }));
            let name = format!("{} {} tok", what_name(e.what), e.n_tokens);
            ev.push(TraceEvent::slice(name, ENGINE_PID, track, us(e.begin_ns), dur, args));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// One of every kind of details, with nulls, fractions and a split with and without its
    /// optional parts.
    fn every_kind() -> Vec<Details> {
        let split = Split { queue: 1.5, disk: 20.0, compute: 3.25, unexplained: 0.5, ..Default::default() };
        let late = Split { before_attach: 7.0, steal: 0.125, ..split.clone() };
        vec![
            Details::Name(NameArgs { name: "llama-server (pid 7) \"x\"".into() }),
            Details::Request(RequestArgs {
                chunks: 12,
                closed_by: crate::stream::ClosedBy::default(),
                slow_cause: Some(crate::analysis::verdict::SlowCause::Disk),
                status: Some(200),
                stop_cause: None,
            }),
            Details::Ttft(TtftArgs { ttft_ms: Some(SplitByName(split)) }),
            Details::Ttft(TtftArgs { ttft_ms: Some(SplitByName(late)) }),
            Details::Ttft(TtftArgs { ttft_ms: None }),
            Details::Woken(WokenArgs { woken_by_tid: 42 }),
            Details::BlockIo(BlockIoArgs { bytes: 4096, issuer_tid: 9, queue_us: 0.0, sector: 1 << 40 }),
            Details::Fault(FaultArgs { addr: "0x7f00".into() }),
            Details::Mmap(MmapArgs { len: 1 << 30 }),
            Details::Mem(MemArgs { pages_or_status: 3 }),
            Details::Sock(SockArgs { dport: 8080 }),
            Details::Step(StepArgs { ret: -1, sequences: BTreeMap::from([("seq 0".into(), 5), ("seq 10".into(), 1)]), tokens: 6 }),
            Details::SeqRm(SeqRmArgs { p0: -1, p1: 100, seq: 2 }),
            counter([("mem", None), ("sm", Some(Num::from(1410u32)))]).unwrap(),
            one("W", Some(71.5)).unwrap(),
            one("sleeping", Some(1u8)).unwrap(),
            one("MHz", Some(f64::NAN)).unwrap(),
            Details::Counter(BTreeMap::new()),
        ]
    }

    /// Written as they always were (the details' JSON object, keys sorted), read back as the
    /// same kind, and titled in the chart with the same keys and values.
    #[test]
    fn details_are_written_as_their_sorted_json_and_read_back() {
        for d in every_kind() {
            let written = serde_json::to_string(&d).unwrap();
            let value = serde_json::to_value(&d).unwrap();
            assert_eq!(written, value.to_string(), "keys in order");
            let read: Details = serde_json::from_str(&written).unwrap();
            assert_eq!(std::mem::discriminant(&read), std::mem::discriminant(&d), "{written}");
            assert_eq!(serde_json::to_string(&read).unwrap(), written);
            let fields: Vec<String> = d.fields().iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let object: Vec<String> = value.as_object().unwrap().iter().map(|(k, v)| format!("{k}: {v}")).collect();
            assert_eq!(fields, object);
        }
        // A split keeps its own rule for the parts it leaves out, and is sorted.
        for d in every_kind() {
            if let Details::Ttft(TtftArgs { ttft_ms: Some(s) }) = d {
                assert_eq!(serde_json::to_string(&s).unwrap(), serde_json::to_value(&s.0).unwrap().to_string());
            }
        }
        // Counters as they were written from structs and maps.
        let clock = counter([("mem", None), ("sm", Some(Num::from(1410u32)))]);
        assert_eq!(serde_json::to_value(clock).unwrap(), json!({"mem": null, "sm": 1410}));
        assert_eq!(serde_json::to_string(&one("W", Some(71.0))).unwrap(), r#"{"W":71.0}"#);
        assert_eq!(serde_json::to_string(&one("P", None::<u32>)).unwrap(), r#"{"P":null}"#);
        assert_eq!(serde_json::to_value(one("MHz", Some(f64::NAN))).unwrap(), json!({"MHz": Value::Null}));
    }
}
