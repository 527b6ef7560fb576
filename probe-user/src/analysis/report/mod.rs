//! The analysis: a recording in, a [`Report`] out (pure), and its human summary. `probe trace`
//! and `probe report DIR` both go through [`build_dir`] (or [`build`] for a recording already in
//! memory), so the two always agree. The model (this file), the two-pass builder (`build`), with
//! its file and IO tables (`files`), the kernel records' reordering (`reorder`), the per-request
//! verdicts (`verdicts`) and the warm baseline (`warm`); the TCP state machine of the connections
//! table (`sock`); its text summary is `render::text`.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::stream::RequestRecord;

pub(crate) mod build;
mod files;
pub(crate) mod prompt;
mod reorder;
mod sock;
mod verdicts;
mod warm;

pub use build::build;
pub(crate) use build::{Builder, WindowIndex};
pub(crate) use reorder::Reorder;
pub use sock::state_name;
pub(crate) use warm::{prompt_size, similar_size};

/// report.json's layout version: 2 since recordings went binary and percentiles interpolate.
pub const SCHEMA_VERSION: u32 = 2;
/// Most memory-map rows listed one by one; the counts cover all.
pub const MAX_MMAP_ROWS: usize = 2000;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// The layout of report.json: [`SCHEMA_VERSION`] (absent in reports before it was versioned).
    #[serde(default)]
    pub schema_version: u32,
    pub target: Target,
    pub duration_s: f64,
    /// Kernel records in the recording (the ones analysed here).
    pub events: u64,
    /// Records the collector received from the kernel, all kinds: kernel records, and the stack
    /// samples and stream bytes it turned into stack and request records (the last `stats`
    /// record's count; `probe trace` says the same number when it stops).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub events_received: u64,
    pub files: Vec<FileStat>,
    pub blockio: BlockIo,
    pub faults: Faults,
    pub mmap_counts: BTreeMap<String, u64>,
    pub mmaps: Vec<MmapRow>,
    pub mmaps_not_listed: u64,
    pub connections: Vec<Connection>,
    /// Stack records per kind (cpu, offcpu, fault, io): count, unwound to the end, median depth.
    pub stacks: BTreeMap<String, StackStats>,
    /// User-stack unwinding while tracing: samples, how many reached the end of the stack, cost.
    pub unwind: Unwind,
    /// Every HTTP request seen on the target's sockets, in arrival order.
    pub requests: Vec<Request>,
    /// The engine's decode steps over the whole trace, when the engine probe attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::analysis::steps::EngineSummary>,
    /// GPU, CPU frequency, memory pressure, model-file residency, the server's own endpoints.
    #[serde(default)]
    pub system: crate::analysis::system::System,
    /// Requests probe itself made to the server's endpoints (left out of `requests`).
    #[serde(default)]
    pub probe_polls: u64,
    pub lost_events: BTreeMap<String, u64>,
    /// Program runs the kernel skipped because another BPF program was running on that CPU
    /// (per program; events that were never made).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skipped_runs: BTreeMap<String, u64>,
    /// The hypervisor's steal while each target thread ran, ms by tid (SCHED_STEAL records; none
    /// on a machine whose kernel does not account steal).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub steal_running_ms: BTreeMap<u32, f64>,
    pub counters: BTreeMap<String, u64>,
    /// Python frames, when a target ran a CPython probe reads: what they cost this process and
    /// why they were turned off, when they were (the kernel's walks: `python_walk_ns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<crate::record::records::PythonStats>,
    /// What the request-stream tracker gave up to stay bounded (connections dropped, peaks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_limits: Option<crate::stream::Limits>,
    /// From probe's start to its probes armed: ms, stage by stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub armed: Option<Armed>,
    /// What tracing cost while it ran: probe's CPU and its BPF programs' run time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
    #[serde(default)]
    pub probes: Vec<crate::record::records::SubsystemStatus>,
    pub problems: Vec<crate::record::problem::Problem>,
}

/// A request as the report shows it: the recorded request (its fields, flattened in
/// report.json) and the verdict the analysis added.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Request {
    #[serde(flatten)]
    pub record: RequestRecord,
    /// Why it was slow and why it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<crate::analysis::verdict::Verdict>,
    /// The engine's own view (llama.cpp's decode steps, by uprobe; see crate::analysis::steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::analysis::steps::RequestEngine>,
}

impl std::ops::Deref for Request {
    type Target = RequestRecord;
    fn deref(&self) -> &RequestRecord {
        &self.record
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Report {
    /// How many events, in the words every output uses (text, HTML, Markdown).
    pub fn events_phrase(&self) -> String {
        if self.events_received > 0 && self.events_received != self.events {
            format!("{} events received, {} kept as kernel records", self.events_received, self.events)
        } else {
            format!("{} events", self.events)
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StackStats {
    pub stacks: u64,
    pub complete: u64,
    pub median_depth: u64,
    /// Why the user stacks that stop short of their end stopped (none in older recordings).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cut: BTreeMap<crate::record::Cut, u64>,
    /// Where they stop: their most common outermost frames, named when the trace ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cut_under: Vec<CutUnder>,
}

/// Cut stacks whose outermost frame is `frame`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CutUnder {
    pub frame: String,
    pub stacks: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Unwind {
    pub samples: u64,
    pub complete: u64,
    /// Share of samples unwound to the end of the stack.
    pub success_rate: f64,
    pub us_per_sample: f64,
    /// Off-CPU stacks that reused their thread's last unwound user stack instead of unwinding.
    #[serde(default)]
    pub reused: u64,
    /// Reading ELF files and building unwinders (once per process and mapping change), ms.
    pub load_ms: f64,
    /// Modules unwound without their unwind sections: they would have passed probe's budget for
    /// them (crate::kernel::unwind::UNWIND_BUDGET); the bytes of sections held at the end.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub left_out_modules: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_bytes: u64,
}

/// Start to armed: the process starting, the output directory, preflight checks, kernel BTF, the
/// BPF object's load, the target set, every program's verification and attach, the ring; then
/// the three slowest programs (`program NAME`, inside `programs`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Armed {
    pub ms: f64,
    pub stages: Vec<(String, f64)>,
}

/// Tracing cost between the first and the last `stats` record (attach to stop; the analysis
/// after the stop is not in it), as a share of one CPU core.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Cost {
    pub wall_s: f64,
    /// probe's process CPU time (user + system), ms.
    pub probe_cpu_ms: f64,
    /// Run time of probe's BPF programs (the kernel's bpf_stats), ms.
    pub bpf_ms: f64,
    /// (probe_cpu_ms + bpf_ms) per wall second, % of one core.
    pub pct_of_core: f64,
    pub probe_pct: f64,
    pub bpf_pct: f64,
    /// Programs that ran, most costly first.
    pub programs: Vec<ProgramCost>,
    /// Why BPF run time was not measured (the figures then count probe's process only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bpf_unmeasured: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProgramCost {
    pub name: String,
    pub runs: u64,
    pub runs_per_s: f64,
    pub ns_per_run: f64,
    pub pct_of_core: f64,
}

impl Cost {
    /// From two cumulative measurements `wall_ns` apart.
    pub fn between(a: &crate::record::records::Cost, b: &crate::record::records::Cost, wall_ns: u64) -> Option<Cost> {
        if wall_ns == 0 {
            return None;
        }
        let wall_s = wall_ns as f64 / 1e9;
        let pct = |ns: u64| ns as f64 / wall_ns as f64 * 100.0;
        let mut programs: Vec<ProgramCost> = b
            .bpf
            .iter()
            .filter_map(|(name, e)| {
                let s = a.bpf.get(name).copied().unwrap_or_default();
                let (runs, ns) = (e.runs.saturating_sub(s.runs), e.ns.saturating_sub(s.ns));
                (runs > 0).then(|| ProgramCost {
                    name: name.clone(),
                    runs,
                    runs_per_s: runs as f64 / wall_s,
                    ns_per_run: ns as f64 / runs as f64,
                    pct_of_core: pct(ns),
                })
            })
            .collect();
        programs.sort_by(|x, y| y.pct_of_core.total_cmp(&x.pct_of_core).then_with(|| x.name.cmp(&y.name)));
        let cpu = b.cpu_ns.saturating_sub(a.cpu_ns);
        let bpf: u64 = b.bpf.iter().map(|(k, e)| e.ns.saturating_sub(a.bpf.get(k).map_or(0, |s| s.ns))).sum();
        Some(Cost {
            wall_s,
            probe_cpu_ms: cpu as f64 / 1e6,
            bpf_ms: bpf as f64 / 1e6,
            pct_of_core: pct(cpu + bpf),
            probe_pct: pct(cpu),
            bpf_pct: pct(bpf),
            programs,
            bpf_unmeasured: b.bpf_unmeasured.clone(),
        })
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Target {
    pub pid: u32,
    pub comm: String,
    pub cmdline: String,
    pub processes: Vec<Process>,
    pub end_reason: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Process {
    pub pid: u32,
    pub parent: Option<u32>,
    pub comm: String,
    /// ms after the trace started; None when it was there from the start.
    pub forked_ms: Option<f64>,
    pub exec_ms: Option<f64>,
    pub exited_ms: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FileStat {
    pub path: String,
    pub dev: String,
    pub inode: u64,
    pub major_faults: u64,
    /// Bytes this file added to the page cache for the target (pages read from storage).
    pub read_bytes: u64,
    /// Block read requests charged to this file, and their device time (issue → complete).
    pub block_reads: u64,
    pub io_time_ms: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BlockIo {
    pub requests: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub devices: Vec<Device>,
    /// Of `requests`, those another task issued for the target: bios of its block cgroup or of
    /// a file it maps (the cgroup throttle's kworker issues the bios over a limit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub issued_for_target: u64,
    /// The IO limits of the target's cgroup, as its own files set them (v1 blkio.throttle.*,
    /// v2 io.max), per device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<crate::record::samples::IoLimit>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Device {
    pub dev: String,
    pub name: Option<String>,
    pub requests: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Issue → complete, µs.
    pub latency_us: Percentiles,
    /// Insert → issue (time in the IO scheduler), µs, for requests that went through one.
    pub queue_us: Percentiles,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Faults {
    pub major: u64,
    /// User faults that were not major; None when the user-fault counter was not attached.
    pub minor: Option<u64>,
    /// Major faults whose address is in no file mapping probe saw (anonymous memory, swap).
    pub major_unresolved: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MmapRow {
    pub t_ms: f64,
    pub pid: u32,
    pub tid: u32,
    pub op: MmapCall,
    pub addr: String,
    pub len: u64,
    pub path: Option<String>,
    /// 0 on success, -errno on failure (mmap/mremap: 0 when an address came back).
    pub error: i64,
    pub result_addr: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Connection {
    pub local: String,
    pub peer: String,
    pub pid: Option<u32>,
    pub opened_ms: Option<f64>,
    pub closed_ms: Option<f64>,
    pub closed_by: Closer,
    pub reset: ResetSeen,
    pub states: Vec<String>,
}

crate::closed_set! {
    /// Which end of a connection closed it first (a FIN or a reset), as the target's socket saw it.
    Closer {
        Local = "local",
        Peer = "peer",
        /// Still open when the trace ended.
        #[default]
        None = "none",
    }
}

crate::closed_set! {
    /// A reset on a connection, from the target's side.
    ResetSeen {
        #[default]
        None = "none",
        Sent = "sent",
        Received = "received",
    }
}

/// A memory-map call: its op as the kernel side numbers it (probe-common `MmapOp`), written by
/// name ("mmap", "munmap"...; "opN" for an op this version does not know).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MmapCall(pub u32);

impl MmapCall {
    pub fn op(self) -> Option<probe_common::mmap::MmapOp> {
        probe_common::mmap::MmapOp::try_from(self.0).ok()
    }

    pub fn name(self) -> std::borrow::Cow<'static, str> {
        match self.op() {
            Some(o) => o.name().into(),
            None => format!("op{}", self.0).into(),
        }
    }
}

impl Serialize for MmapCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for MmapCall {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        let known = (1..=8).map(MmapCall).find(|c| c.name() == name.as_str());
        Ok(known.or_else(|| name.strip_prefix("op").and_then(|n| n.parse().ok()).map(MmapCall)).unwrap_or_default())
    }
}
