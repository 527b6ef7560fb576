//! Userspace records, typed: one Rust type per record kind the analysis reads (docs/recording.md
//! lists the fields). The samplers' records (`samplers`, `gpu`, `cpufreq`, `mem`, `cpuidle`,
//! `residency`, `endpoint`) stay JSON objects for `crate::analysis::system`, which summarises them.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, de::IgnoredAny};

use super::{StackRecord, samples::Sample};
pub use crate::os::procfs::OpenFile;
use crate::{os::procfs::Mapping, stream::RequestRecord, util::Lenient};

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn page_size() -> u64 {
    4096
}

/// A probe (a group of kernel programs), as `--probes` and every report name it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Subsystem {
    Blockio,
    Fault,
    Filemap,
    Mmap,
    Sock,
    Stream,
    Cpu,
    Offcpu,
    Mem,
    Proc,
    /// llama.cpp's decode steps, by uprobe (not a kernel subsystem: the engine's own view).
    Engine,
    /// A probe this version does not know (a later recording's).
    #[default]
    #[serde(other)]
    Unknown,
}

impl Subsystem {
    /// Every probe, in the order they are listed.
    pub const ALL: [Subsystem; 11] = [
        Subsystem::Blockio,
        Subsystem::Fault,
        Subsystem::Filemap,
        Subsystem::Mmap,
        Subsystem::Sock,
        Subsystem::Stream,
        Subsystem::Cpu,
        Subsystem::Offcpu,
        Subsystem::Mem,
        Subsystem::Proc,
        Subsystem::Engine,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Subsystem::Blockio => "blockio",
            Subsystem::Fault => "fault",
            Subsystem::Filemap => "filemap",
            Subsystem::Mmap => "mmap",
            Subsystem::Sock => "sock",
            Subsystem::Stream => "stream",
            Subsystem::Cpu => "cpu",
            Subsystem::Offcpu => "offcpu",
            Subsystem::Mem => "mem",
            Subsystem::Proc => "proc",
            Subsystem::Engine => "engine",
            Subsystem::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for Subsystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Subsystem {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Subsystem::ALL.into_iter().find(|x| x.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Subsystem::ALL.iter().map(|x| x.name()).collect();
            format!("unknown probe `{s}`: choose from {}", names.join(", "))
        })
    }
}

/// What happened to one subsystem (probe) at attach time: written by the collector in `meta`,
/// shown by every report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SubsystemStatus {
    pub name: Subsystem,
    pub live: bool,
    pub attached: Vec<String>,
    /// "program: reason" for each program that did not attach.
    pub skipped: Vec<String>,
}

/// `null` (as recordings before typed probe lists could hold) reads as the empty default.
fn null_as_default<'de, D: serde::Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The first frame: what was traced, when, with which probes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Meta {
    pub format_version: u32,
    pub probe_version: String,
    pub pid: u32,
    pub comm: String,
    pub cmdline: String,
    pub exe: String,
    /// The executable's GNU build id, read at attach (its ELF note only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe_build_id: Option<String>,
    /// Pids traced at attach (the target and its descendants).
    pub targets: Vec<u32>,
    /// CLOCK_MONOTONIC at the start; every `ts_ns` is on this clock.
    pub start_ns: u64,
    /// Where the events begin when this recording is a window of a longer trace (an incident
    /// of `probe watch`): the duration and the timeline count from here. Times such as a
    /// request's `arrival_ms` still count from `start_ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_start_ns: Option<u64>,
    /// Which blocks have off-CPU stacks: "all", or "uninterruptible" (disk, faults, reclaim
    /// only: `probe watch`). Absent in older recordings: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offcpu_waits: Option<String>,
    pub start_unix_ms: u64,
    /// The cgroup traced (`--cgroup`, `--container`): every process in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// On-CPU stack samples per second per thread (0: no CPU sampling, or an older recording).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_hz: u64,
    pub kernel: String,
    /// The machine's name at attach (`/proc/sys/kernel/hostname`): OTLP's `host.name`. Absent in
    /// older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The machine at attach (`probe bundle`'s environment.txt). Absent in older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    pub armed_ms: f64,
    /// What arming took, stage by stage: `[name, ms]` (the three slowest programs last).
    #[serde(default)]
    pub arm_stages: Vec<(String, f64)>,
    /// Per probe: `name`, `live`, `attached`, `skipped` with reasons.
    #[serde(deserialize_with = "null_as_default")]
    pub probes: Vec<SubsystemStatus>,
    #[serde(default = "page_size")]
    pub page_size: u64,
    pub capture_text: bool,
    /// `"major:minor"` → device name.
    pub block_devices: BTreeMap<String, String>,
}

/// The machine a recording was made on, read at attach: its CPU model and count, its memory and
/// the NVIDIA driver's version line (when a driver is loaded).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Machine {
    pub cpu_model: String,
    pub cpus: u32,
    pub mem_total_kib: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvidia_driver: Option<String>,
}

/// The file-backed lines of /proc/PID/maps at a time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Maps {
    pub pid: u32,
    pub ts_ns: u64,
    pub mappings: Vec<Mapping>,
}

/// Open files not named before.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Files {
    pub pid: u32,
    pub ts_ns: u64,
    pub files: Vec<OpenFile>,
}

/// A file stack frames refer to by id.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Module {
    pub id: i64,
    pub path: String,
}

/// Kernel addresses named while tracing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Ksyms {
    pub syms: Vec<(u64, String)>,
}

/// The module id Python frames carry in a stack record's user frames (the offset is the frame's
/// id in the recording's `pyframes` records).
pub const PY_MODULE: i64 = -2;

/// Python frames named while tracing: `(id, "module.qualname (file.py:line)")`; stack records
/// carry them as user frames of module [`PY_MODULE`] with the id as offset.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PyFrames {
    pub frames: Vec<(u64, String)>,
}

/// Thread names: `(pid, tid, name)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Threads {
    pub ts_ns: u64,
    pub threads: Vec<(u32, u32, String)>,
}

/// Where user stacks that stop short of their end stop: their outermost frame, named at trace
/// time (the modules are read then; a report elsewhere has only the recording), the most
/// common first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CutFrames {
    pub frames: Vec<CutFrame>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CutFrame {
    /// The stack kind (`cpu`, `offcpu`, `fault`, `io`).
    pub kind: String,
    pub module: i64,
    pub offset: u64,
    pub name: String,
    /// Cut stacks of this kind whose outermost frame it is.
    pub stacks: u64,
}

/// The warm baseline `probe watch` keeps for its server across sessions and restarts: fast
/// requests (their verdict found nothing but the server's own work) of earlier sessions. A
/// window it analyses carries it, so the incident's report compares with the same requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmBaseline {
    pub warm: Vec<Warm>,
}

/// One warm request: its prompt size (in tokens when the server said, else bytes), its TTFT and
/// when it was served.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Warm {
    pub size: u64,
    pub unit: String,
    pub ttft_ms: f64,
    pub at_unix_ms: u64,
}

/// A process that is not traced but ran while a target thread waited for a CPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OtherProc {
    pub pid: u32,
    pub comm: String,
    /// Its cgroup (v2 path), when /proc had one.
    pub cgroup: Option<String>,
}

/// Other processes named since the last such record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Procs {
    pub ts_ns: u64,
    pub procs: Vec<OtherProc>,
}

/// Unwinding while tracing: samples, how many reached the end, time spent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UnwindCounters {
    pub samples: u64,
    pub complete: u64,
    pub ns: u64,
    pub load_ns: u64,
    /// Off-CPU stacks that reused the thread's last unwound user stack (the kernel saw it
    /// block at the same place and left the stack bytes out).
    pub reused: u64,
    /// Modules unwound without their unwind sections (over the budget), and the bytes of
    /// sections held (crate::kernel::unwind::UNWIND_BUDGET).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub left_out: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_bytes: u64,
}

/// Counters, cumulative since attach (every second and at the end).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub ts_ns: u64,
    /// Ring-buffer reserve failures per kind.
    pub lost: BTreeMap<String, u64>,
    pub counters: BTreeMap<String, u64>,
    /// Records received per kind.
    pub events: BTreeMap<String, u64>,
    /// Program runs the kernel skipped, per program.
    pub skipped_runs: BTreeMap<String, u64>,
    pub unwind: UnwindCounters,
    /// What the request-stream tracker gave up to stay bounded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streams: Option<crate::stream::Limits>,
    /// What tracing has cost so far (absent in recordings before it was measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
    /// Python frames, when a target ran a CPython probe reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<PythonStats>,
}

/// Python frames so far: stacks merged, frames that could not be named, this process's time on
/// them (the kernel's is the `python_walk_ns` counter), and why they were turned off.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PythonStats {
    pub merged: u64,
    pub unnamed: u64,
    pub work_ns: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub off: Option<String>,
}

/// What tracing has cost since attach: probe's own CPU time and its BPF programs' run time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cost {
    /// probe's process CPU time, user + system, all its threads.
    pub cpu_ns: u64,
    /// Runs and run time per program (the kernel's bpf_stats).
    pub bpf: BTreeMap<String, ProgCost>,
    /// Why the programs' run time is not counted, when it is not (then `bpf` holds zeros).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpf_unmeasured: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProgCost {
    pub runs: u64,
    pub ns: u64,
}

impl Stats {
    /// Events lost or never made, all kinds.
    pub fn lost_total(&self) -> u64 {
        self.lost.values().sum::<u64>() + self.skipped_runs.values().sum::<u64>()
    }
}

/// The last frame of a clean stop.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct End {
    pub ts_ns: u64,
    pub reason: String,
}

crate::closed_set! {
    /// The `type` of a userspace (JSON) record: the one list of them, in docs/recording.md's
    /// order, v1's `stack` (read, no longer written) last. The reader dispatches on it
    /// ([`UserRecord::read`]); a type not in it is a later probe's.
    RecordType {
        #[default]
        Meta = "meta",
        Maps = "maps",
        Files = "files",
        Module = "module",
        Ksyms = "ksyms",
        PyFrames = "pyframes",
        Threads = "threads",
        Procs = "procs",
        Request = "request",
        Stats = "stats",
        Samplers = "samplers",
        Gpu = "gpu",
        Cpufreq = "cpufreq",
        Mem = "mem",
        Cpuidle = "cpuidle",
        Residency = "residency",
        Endpoint = "endpoint",
        Attach = "attach",
        End = "end",
        CutFrames = "cut_frames",
        WarmBaseline = "warm_baseline",
        /// A v1 stack sample (JSON then; binary frames since v2).
        Stack = "stack",
    }
}

/// A record's `type`, read from its JSON text before the record (its other fields are skipped,
/// not held), as a map read it: the last `type` key's string; "" when there is none or it is not
/// a string. Only a JSON object has one.
struct Tag(String);

impl<'de> Deserialize<'de> for Tag {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Tag, D::Error> {
        /// A key, told without copying it.
        #[derive(Deserialize)]
        #[serde(field_identifier)]
        enum Key {
            #[serde(rename = "type")]
            Type,
            #[serde(other)]
            Other,
        }
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Tag;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Tag, A::Error> {
                let mut word = None;
                while let Some(key) = map.next_key()? {
                    match key {
                        Key::Type => word = map.next_value::<Lenient<String>>()?.ok(),
                        Key::Other => _ = map.next_value::<IgnoredAny>()?,
                    }
                }
                Ok(Tag(word.unwrap_or_default()))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// The frame of a record of a type this version does not know: its `type` alone.
#[derive(Serialize)]
struct TypeOnly<'a> {
    #[serde(rename = "type")]
    word: &'a str,
}

/// One userspace record.
#[derive(Clone, Debug, PartialEq)]
pub enum UserRecord {
    Meta(Box<Meta>),
    Maps(Maps),
    Files(Files),
    Module(Module),
    Ksyms(Ksyms),
    PyFrames(PyFrames),
    Threads(Threads),
    Procs(Procs),
    Request(Box<RequestRecord>),
    Stats(Box<Stats>),
    End(End),
    /// A v1 stack sample (JSON then; binary frames since v2).
    Stack(Box<StackRecord>),
    /// `probe watch`'s warm baseline from earlier sessions.
    WarmBaseline(WarmBaseline),
    /// Where cut user stacks stop (written at the end of a trace).
    CutFrames(CutFrames),
    /// A sampler's record, for `crate::analysis::system`.
    Sample(Box<Sample>),
    /// A record of a kind this version does not know (a later probe's): its `type`, kept so the
    /// reader can count it; nothing reads it.
    Other(String),
}

impl UserRecord {
    /// A record from its JSON text: typed by its `type`, read first from the same text (the
    /// record is then read as its type, with no untyped tree between); a type this version does
    /// not know (a later probe's) is kept by name ([`UserRecord::Other`]), never an error. On an
    /// error, the type whose shape the JSON is not, or none when the text is not JSON at all.
    pub fn read(bytes: &[u8]) -> Result<UserRecord, (Option<RecordType>, serde_json::Error)> {
        // Text first: a string is then read in place, not checked again.
        let text = std::str::from_utf8(bytes).map_err(|e| (None, serde::de::Error::custom(e)))?;
        let word = match serde_json::from_str::<Tag>(text) {
            Ok(Tag(word)) => word,
            // JSON but not an object: a record with no type.
            Err(e) => match serde_json::from_str::<IgnoredAny>(text) {
                Ok(_) => String::new(),
                Err(_) => return Err((None, e)),
            },
        };
        let Ok(ty) = word.parse::<RecordType>() else { return Ok(UserRecord::Other(word)) };
        UserRecord::typed(ty, text).map_err(|e| (Some(ty), e))
    }

    /// A record from its JSON text ([`UserRecord::read`], the error alone).
    pub fn parse(bytes: &[u8]) -> Result<UserRecord, serde_json::Error> {
        UserRecord::read(bytes).map_err(|(_, e)| e)
    }

    /// The record of type `ty` from its JSON text. Older request records read with today's
    /// fields ([`RequestRecord::read`]); a sampler's record is read as its variant, by its type
    /// (not through [`Sample`]'s tag, which would hold the record untyped first).
    fn typed(ty: RecordType, text: &str) -> Result<UserRecord, serde_json::Error> {
        use serde_json::from_str as from;
        let sample = |s: Sample| UserRecord::Sample(Box::new(s));
        Ok(match ty {
            RecordType::Meta => UserRecord::Meta(Box::new(from(text)?)),
            RecordType::Maps => UserRecord::Maps(from(text)?),
            RecordType::Files => UserRecord::Files(from(text)?),
            RecordType::Module => UserRecord::Module(from(text)?),
            RecordType::Ksyms => UserRecord::Ksyms(from(text)?),
            RecordType::PyFrames => UserRecord::PyFrames(from(text)?),
            RecordType::Threads => UserRecord::Threads(from(text)?),
            RecordType::Procs => UserRecord::Procs(from(text)?),
            RecordType::Request => UserRecord::Request(Box::new(RequestRecord::read(text)?)),
            RecordType::Stats => UserRecord::Stats(Box::new(from(text)?)),
            RecordType::End => UserRecord::End(from(text)?),
            RecordType::Stack => UserRecord::Stack(Box::new(from(text)?)),
            RecordType::WarmBaseline => UserRecord::WarmBaseline(from(text)?),
            RecordType::CutFrames => UserRecord::CutFrames(from(text)?),
            RecordType::Samplers => sample(Sample::Samplers(from(text)?)),
            RecordType::Gpu => sample(Sample::Gpu(from(text)?)),
            RecordType::Cpufreq => sample(Sample::Cpufreq(from(text)?)),
            RecordType::Mem => sample(Sample::Mem(from(text)?)),
            RecordType::Cpuidle => sample(Sample::Cpuidle(from(text)?)),
            RecordType::Residency => sample(Sample::Residency(from(text)?)),
            RecordType::Endpoint => sample(Sample::Endpoint(from(text)?)),
            RecordType::Attach => sample(Sample::Attach(from(text)?)),
        })
    }

    /// The record as its JSON frame holds it: its fields and its `type` (what
    /// [`UserRecord::read`] reads back). Written through serde_json's map, whose objects keep
    /// their keys in order: recordings have always been written so.
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut v = match self {
            UserRecord::Meta(m) => serde_json::to_value(m)?,
            UserRecord::Maps(m) => serde_json::to_value(m)?,
            UserRecord::Files(f) => serde_json::to_value(f)?,
            UserRecord::Module(m) => serde_json::to_value(m)?,
            UserRecord::Ksyms(k) => serde_json::to_value(k)?,
            UserRecord::PyFrames(p) => serde_json::to_value(p)?,
            UserRecord::Threads(t) => serde_json::to_value(t)?,
            UserRecord::Procs(p) => serde_json::to_value(p)?,
            UserRecord::Request(q) => serde_json::to_value(q)?,
            UserRecord::Stats(s) => serde_json::to_value(s)?,
            UserRecord::End(e) => serde_json::to_value(e)?,
            UserRecord::Stack(s) => serde_json::to_value(s)?,
            UserRecord::WarmBaseline(w) => serde_json::to_value(w)?,
            UserRecord::CutFrames(c) => serde_json::to_value(c)?,
            // Tagged by serde with its own `type`.
            UserRecord::Sample(s) => return serde_json::to_vec(&serde_json::to_value(s)?),
            UserRecord::Other(word) => return serde_json::to_vec(&TypeOnly { word }),
        };
        if let Some(ty) = self.record_type() {
            v["type"] = ty.name().into();
        }
        serde_json::to_vec(&v)
    }

    /// Its `type`; None for a type this version does not know.
    pub fn record_type(&self) -> Option<RecordType> {
        Some(match self {
            UserRecord::Meta(_) => RecordType::Meta,
            UserRecord::Maps(_) => RecordType::Maps,
            UserRecord::Files(_) => RecordType::Files,
            UserRecord::Module(_) => RecordType::Module,
            UserRecord::Ksyms(_) => RecordType::Ksyms,
            UserRecord::PyFrames(_) => RecordType::PyFrames,
            UserRecord::Threads(_) => RecordType::Threads,
            UserRecord::Procs(_) => RecordType::Procs,
            UserRecord::Request(_) => RecordType::Request,
            UserRecord::Stats(_) => RecordType::Stats,
            UserRecord::End(_) => RecordType::End,
            UserRecord::Stack(_) => RecordType::Stack,
            UserRecord::WarmBaseline(_) => RecordType::WarmBaseline,
            UserRecord::CutFrames(_) => RecordType::CutFrames,
            UserRecord::Sample(s) => s.record_type(),
            UserRecord::Other(_) => return None,
        })
    }

    /// Its time, for records that carry one.
    pub fn ts_ns(&self) -> Option<u64> {
        match self {
            UserRecord::Maps(m) => Some(m.ts_ns),
            UserRecord::Files(f) => Some(f.ts_ns),
            UserRecord::Threads(t) => Some(t.ts_ns),
            UserRecord::Procs(p) => Some(p.ts_ns),
            UserRecord::Stats(s) => Some(s.ts_ns),
            UserRecord::End(e) => Some(e.ts_ns),
            UserRecord::Stack(s) => Some(s.ts_ns),
            UserRecord::Sample(s) => Some(s.ts_ns()),
            _ => None,
        }
    }
}

/// A sampler record's `type` (here with the other types: `samples` does not name `records`).
impl Sample {
    /// Its `type`, as its frame holds it.
    pub fn kind(&self) -> &'static str {
        self.record_type().name()
    }

    /// Its `type` ([`Sample`]'s serde tag words are the same).
    pub fn record_type(&self) -> RecordType {
        match self {
            Sample::Samplers(_) => RecordType::Samplers,
            Sample::Gpu(_) => RecordType::Gpu,
            Sample::Cpufreq(_) => RecordType::Cpufreq,
            Sample::Mem(_) => RecordType::Mem,
            Sample::Cpuidle(_) => RecordType::Cpuidle,
            Sample::Residency(_) => RecordType::Residency,
            Sample::Endpoint(_) => RecordType::Endpoint,
            Sample::Attach(_) => RecordType::Attach,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every typed variant, with its fields set, reads back as written.
    #[test]
    fn every_record_variant_round_trips() {
        use crate::stream::{ClosedBy, RequestRecord, Reset, Role};
        let mapping =
            Mapping { start: 0x1000, end: 0x2000, offset: 0, major: 254, minor: 0, inode: 7, path: "/m.gguf".into(), perms: "r--p".into() };
        let all = vec![
            UserRecord::Meta(Box::new(Meta {
                pid: 7,
                comm: "llama-server".into(),
                targets: vec![7, 8],
                start_ns: 9,
                window_start_ns: Some(10),
                cpu_hz: 99,
                probes: vec![SubsystemStatus { name: Subsystem::Cpu, live: true, attached: vec!["cpu_sample".into()], skipped: vec![] }],
                block_devices: [("254:0".to_string(), "vda".to_string())].into(),
                page_size: 4096,
                ..Default::default()
            })),
            UserRecord::Maps(Maps { pid: 7, ts_ns: 11, mappings: vec![mapping] }),
            UserRecord::Files(Files {
                pid: 7,
                ts_ns: 12,
                files: vec![OpenFile { major: 254, minor: 0, inode: 7, path: "/m.gguf".into() }],
            }),
            UserRecord::Module(Module { id: 3, path: "/usr/bin/llama-server".into() }),
            UserRecord::Ksyms(Ksyms { syms: vec![(0xffff_ffff_8100_0000, "io_schedule".into())] }),
            UserRecord::PyFrames(PyFrames { frames: vec![(0, "app.spin (app.py:12)".into())] }),
            UserRecord::Threads(Threads { ts_ns: 13, threads: vec![(7, 9, "llama-server".into())] }),
            UserRecord::CutFrames(CutFrames {
                frames: vec![CutFrame {
                    kind: "cpu".into(),
                    module: 2,
                    offset: 0x4d10,
                    name: "server_queue::start_loop".into(),
                    stacks: 120,
                }],
            }),
            UserRecord::WarmBaseline(WarmBaseline {
                warm: vec![Warm { size: 250, unit: "token".into(), ttft_ms: 412.5, at_unix_ms: 1_764_000_000_000 }],
            }),
            UserRecord::Request(Box::new(RequestRecord {
                id: 1,
                pid: 7,
                role: Role::Client,
                closed_by: ClosedBy::Server,
                reset: Reset::ByServer,
                method: Some("POST".into()),
                arrival_ms: Some(1.5),
                ttft_ms: Some(20.0),
                chunks: 3,
                chunk_times_ms: vec![20.0, 30.0, 40.0],
                // Floats read back bit for bit, the server's large ones too (serde_json's
                // float_roundtrip: its default parser reads these one unit in the last place off).
                stop: crate::stream::payload::Stop {
                    usage: Some(serde_json::json!({"n": -1.490143767845386e129, "t": 6.162599865641032e196})),
                    server_timings: Some(serde_json::json!({"prompt_ms": 1.947700395895162e-169})),
                    ..Default::default()
                },
                final_ms: Some(1.0498824276453545e74),
                ..Default::default()
            })),
            UserRecord::Stats(Box::new(Stats {
                ts_ns: 14,
                lost: [("fault".to_string(), 2)].into(),
                events: [("fault".to_string(), 5)].into(),
                unwind: UnwindCounters { samples: 3, complete: 2, ..Default::default() },
                cost: Some(Cost { cpu_ns: 5, ..Default::default() }),
                ..Default::default()
            })),
            UserRecord::End(End { ts_ns: 15, reason: "interrupted".into() }),
            UserRecord::Stack(Box::new(StackRecord {
                pid: 7,
                tid: 9,
                ts_ns: 16,
                user: vec![(3, 0x10)],
                kernel: vec![1],
                ..Default::default()
            })),
            UserRecord::Sample(Box::new(Sample::Cpufreq(super::super::samples::CpuFreqReading { ts_ns: 17, cur_khz: vec![1] }))),
            UserRecord::Other("later".into()),
        ];
        for r in all {
            let json = r.to_json().unwrap();
            let back = UserRecord::parse(&json).unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(&json)));
            assert_eq!(back, r, "{}", String::from_utf8_lossy(&json));
        }
    }

    /// The record types are one list: their words, the written ones, the reader's dispatch.
    #[test]
    fn record_types_are_one_list() {
        let names: Vec<&str> = RecordType::ALL.iter().map(|t| t.name()).collect();
        assert_eq!(names, RecordType::WORDS);
        assert_eq!(&RecordType::WORDS[..RecordType::WORDS.len() - 1], &crate::record::USER_RECORD_TYPES[..]);
        // A later probe's type is kept by name, never an error; a known type of the wrong shape
        // says which type it is.
        assert_eq!(UserRecord::read(br#"{"type": "later"}"#).unwrap(), UserRecord::Other("later".into()));
        assert_eq!(UserRecord::read(br#"{"type": "stack", "pid": "x"}"#).unwrap_err().0, Some(RecordType::Stack));
    }

    /// Request records written before the two completeness fields (one `complete`, closes called
    /// "server" and "server_abort") read with today's fields and words; today's read as written.
    #[test]
    fn older_request_records_read_with_todays_words() {
        use crate::stream::{ClosedBy, Role};
        let try_read = |extra: serde_json::Value| {
            let mut v = serde_json::json!({"type": "request", "id": 1, "pid": 7, "local": "127.0.0.1:8080", "peer": "127.0.0.1:5000",
                "role": "server", "chunks": 2, "chunk_times_ms": [1.5, 2.5], "done_marker": false, "reset": "none", "partial": false,
                "request_bytes": 10, "response_bytes": 20, "bytes_not_captured": 0, "messages_unread": 0});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            UserRecord::read(&serde_json::to_vec(&v).unwrap()).map_err(|(ty, _)| ty)
        };
        let read = |extra: serde_json::Value| match try_read(extra.clone()) {
            Ok(UserRecord::Request(q)) => *q,
            r => panic!("{extra}: {r:?}"),
        };
        let words = |q: RequestRecord| (q.closed_by, q.content_complete, q.transport_complete);
        // As the llama-demo recording holds them: a response that ended, the connection kept open.
        let q = read(
            serde_json::json!({"complete": true, "closed_by": "server", "done_marker": true, "finish_reason": "length", "error": null}),
        );
        assert_eq!(
            q,
            RequestRecord {
                id: 1,
                pid: 7,
                local: "127.0.0.1:8080".into(),
                peer: "127.0.0.1:5000".into(),
                role: Role::Server,
                chunks: 2,
                chunk_times_ms: vec![1.5, 2.5],
                stop: crate::stream::payload::Stop { done_marker: true, finish_reason: Some("length".into()), ..Default::default() },
                closed_by: ClosedBy::None,
                content_complete: true,
                transport_complete: true,
                request_bytes: 10,
                response_bytes: 20,
                ..Default::default()
            }
        );
        // The server aborted, after its final message (a stop field) or before it.
        assert_eq!(
            words(read(serde_json::json!({"complete": false, "closed_by": "server_abort", "stop_type": "eos"}))),
            (ClosedBy::Server, true, false)
        );
        assert_eq!(
            words(read(serde_json::json!({"complete": false, "closed_by": "server_abort", "stop_type": null}))),
            (ClosedBy::Server, false, false)
        );
        // The client closed; an error is a final message; a done marker is one.
        assert_eq!(
            words(read(serde_json::json!({"complete": false, "closed_by": "client", "error": {"code": 500}}))),
            (ClosedBy::Client, true, false)
        );
        assert_eq!(
            words(read(serde_json::json!({"complete": false, "closed_by": "client", "done_marker": true}))),
            (ClosedBy::Client, true, false)
        );
        for said in ["finish_reason", "stopped", "done_reason"] {
            assert_eq!(words(read(serde_json::json!({"closed_by": "client", said: "stop"}))), (ClosedBy::Client, true, false), "{said}");
        }
        // No close seen: open at the end; `complete` absent or not a bool is false; a
        // `content_complete` an older record held is today's word, not its own.
        assert_eq!(words(read(serde_json::json!({}))), (ClosedBy::Open, false, false));
        assert_eq!(
            words(read(serde_json::json!({"complete": "yes", "closed_by": null, "content_complete": true}))),
            (ClosedBy::Open, false, false)
        );
        assert_eq!(words(read(serde_json::json!({"complete": true, "closed_by": 5}))), (ClosedBy::Open, true, true));
        // Today's records: as written (`server` is the server closing), `complete` ignored.
        assert_eq!(
            words(read(serde_json::json!({"transport_complete": false, "closed_by": "server", "complete": true, "finish_reason": "stop"}))),
            (ClosedBy::Server, false, false)
        );
        assert_eq!(
            words(read(serde_json::json!({"transport_complete": true, "content_complete": true, "closed_by": "none"}))),
            (ClosedBy::None, true, true)
        );
        // A word neither today's nor an older probe's is an error, in either shape; so is an
        // older word in today's shape, and no word there.
        let wrong = Err(Some(RecordType::Request));
        assert_eq!(try_read(serde_json::json!({"closed_by": "later"})), wrong);
        assert_eq!(try_read(serde_json::json!({"closed_by": "later", "transport_complete": true})), wrong);
        assert_eq!(try_read(serde_json::json!({"closed_by": "server_abort", "transport_complete": true})), wrong);
        assert_eq!(try_read(serde_json::json!({"transport_complete": true})), wrong);
        assert_eq!(try_read(serde_json::json!({"closed_by": "client", "transport_complete": null})), wrong);
    }

    /// A record's JSON, read.
    fn from_value(v: serde_json::Value) -> Result<UserRecord, serde_json::Error> {
        UserRecord::parse(&serde_json::to_vec(&v).unwrap())
    }

    /// The `type` is read from the text as a map reads it: JSON that is not an object, or whose
    /// `type` is not a string, has none (a record of no type this version knows); the last `type`
    /// key counts; escapes are read. Text that is not JSON is no record at all.
    #[test]
    fn the_type_is_read_from_the_text() {
        let read = |text: &[u8]| UserRecord::read(text).map_err(|(ty, _)| ty);
        for no_type in [&b"5"[..], b"[\"meta\"]", b"[]", b"null", b"{}", br#"{"type": 3}"#, br#"{"type": ["meta"], "pid": 1}"#] {
            assert_eq!(read(no_type), Ok(UserRecord::Other(String::new())), "{}", String::from_utf8_lossy(no_type));
        }
        assert_eq!(read(br#"{"type": "meta", "type": "end", "ts_ns": 1}"#), Ok(UserRecord::End(End { ts_ns: 1, ..Default::default() })));
        assert_eq!(read(br#"{"type": "meta", "type": null}"#), Ok(UserRecord::Other(String::new())));
        assert_eq!(read(br#"{"ts_ns": 2, "typ\u0065": "\u0065nd"}"#), Ok(UserRecord::End(End { ts_ns: 2, ..Default::default() })));
        assert_eq!(read(br#"{"type": "la\"ter"}"#), Ok(UserRecord::Other("la\"ter".into())));
        for not_json in [&b"{not json"[..], b"", b"{\"type\": \"end\"} x", b"{\"type\": \"end\", \"x\": \"\xff\"}"] {
            assert_eq!(read(not_json), Err(None), "{}", String::from_utf8_lossy(not_json));
        }
        assert_eq!(read(br#"{"type": "end", "ts_ns": "x"}"#), Err(Some(RecordType::End)));
    }

    #[test]
    fn typed_records_read_what_the_collector_writes() {
        let v = serde_json::json!({"type": "stats", "ts_ns": 5, "lost": {"fault": 2}, "skipped_runs": {"x": 1}, "unwind": {"samples": 3}});
        let UserRecord::Stats(s) = from_value(v).unwrap() else { panic!() };
        assert_eq!((s.lost_total(), s.unwind.samples), (3, 3));
        let v = serde_json::json!({"type": "threads", "ts_ns": 1, "threads": [[1, 2, "llama-server"]]});
        assert_eq!(from_value(v).unwrap(), UserRecord::Threads(Threads { ts_ns: 1, threads: vec![(1, 2, "llama-server".into())] }));
        let v = serde_json::json!({"type": "meta", "pid": 7, "start_ns": 9});
        let UserRecord::Meta(m) = from_value(v).unwrap() else { panic!() };
        assert_eq!((m.pid, m.start_ns, m.page_size), (7, 9, 4096));
        assert!(matches!(from_value(serde_json::json!({"type": "gpu", "ts_ns": 3})).unwrap(), UserRecord::Sample(_)));
        assert_eq!(from_value(serde_json::json!({"type": "later", "x": 1})).unwrap(), UserRecord::Other("later".into()));
        assert!(from_value(serde_json::json!({"type": "maps", "pid": "not a pid"})).is_err());
    }
}
