//! The samplers' records, typed: what `crate::sampler` writes (a frame each, `type` naming the
//! variant) and `crate::analysis::system`, the timeline, the bundle and watch's gauges read back.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One sampler record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Sample {
    /// Which sources this machine has, once at the start.
    Samplers(Sources),
    Gpu(GpuReading),
    Cpufreq(CpuFreqReading),
    Mem(MemReading),
    Cpuidle(CpuIdleReading),
    Residency(ResidencyReading),
    Endpoint(EndpointPoll),
    /// The target as probe found it right after arming (once).
    Attach(AttachState),
}

impl Sample {
    pub fn ts_ns(&self) -> u64 {
        match self {
            Sample::Samplers(s) => s.ts_ns,
            Sample::Gpu(s) => s.ts_ns,
            Sample::Cpufreq(s) => s.ts_ns,
            Sample::Mem(s) => s.ts_ns,
            Sample::Cpuidle(s) => s.ts_ns,
            Sample::Residency(s) => s.ts_ns,
            Sample::Endpoint(s) => s.ts_ns,
            Sample::Attach(s) => s.ts_ns,
        }
    }
}

/// The sources the samplers found, and why each missing one is missing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Sources {
    pub ts_ns: u64,
    pub hz: f64,
    /// Each CPU's highest frequency (None: no cpufreq).
    pub cpufreq_max_khz: Option<Vec<u64>>,
    /// /proc/pressure/memory exists.
    pub psi: bool,
    pub memory_cgroup: Option<String>,
    /// The swap areas (/proc/swaps: file or device), at the start.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub swaps: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<GpuDevice>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_absent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpufreq_absent: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuReading {
    pub ts_ns: u64,
    pub gpus: Vec<GpuSample>,
    /// The devices' PCI power states (sysfs, read without waking them), when they changed: at
    /// attach, while idle, at the target's first busy moment (a request's arrival) and after NVML
    /// opened.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pci: Vec<PciPower>,
    /// The devices as NVML names them, in the first reading after it was opened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<GpuDevice>>,
    /// How long opening NVML took (ms): a suspended device resumes to answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opened_ms: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CpuFreqReading {
    pub ts_ns: u64,
    pub cur_khz: Vec<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemReading {
    #[serde(default)]
    pub ts_ns: u64,
    #[serde(flatten)]
    pub mem: Mem,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuIdleReading {
    #[serde(default)]
    pub ts_ns: u64,
    #[serde(flatten)]
    pub idle: CpuIdle,
}

/// The target right after the probes were armed: what came before attach is described by it,
/// never guessed (see `crate::kernel::attach`). One bounded read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AttachState {
    pub ts_ns: u64,
    /// Each target thread's state and what it was blocked in.
    pub threads: Vec<ThreadAtAttach>,
    /// /proc/PID/io `read_bytes` of the main target (bytes it had made the disk read so far).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<u64>,
    /// The IO limits of the target's cgroups, per device.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub io_limits: Vec<IoLimit>,
    /// The target's connections in the middle of a request, by the kernel's TCP state.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub in_flight: Vec<ConnAtAttach>,
    /// Why the connections could not be asked, when they could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_flight_absent: Option<String>,
}

/// One thread at attach: /proc/PID/task/TID/stat's state letter, and wchan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ThreadAtAttach {
    pub tid: u32,
    pub comm: String,
    pub state: ThreadState,
    /// The kernel function it sleeps in (`/proc/PID/task/TID/wchan`), when the kernel says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wchan: Option<String>,
}

/// A thread's state as /proc/PID/task/TID/stat says it, by its letter (written as that letter):
/// the ones probe tells apart, and any other the kernel has (T stopped, Z zombie, I idle, ...).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum ThreadState {
    /// R: running or runnable.
    Running,
    /// S: sleeping, interruptible (a futex, a socket, epoll).
    Sleeping,
    /// D: uninterruptible sleep (IO, a file page fault, a lock in the kernel).
    DiskSleep,
    #[default]
    Unknown,
    Other(char),
}

impl ThreadState {
    /// The state of /proc's letter (its first character).
    pub fn of(letter: &str) -> ThreadState {
        match letter.chars().next() {
            Some('R') => ThreadState::Running,
            Some('S') => ThreadState::Sleeping,
            Some('D') => ThreadState::DiskSleep,
            Some(c) if c != '?' => ThreadState::Other(c),
            _ => ThreadState::Unknown,
        }
    }

    pub fn letter(self) -> char {
        match self {
            ThreadState::Running => 'R',
            ThreadState::Sleeping => 'S',
            ThreadState::DiskSleep => 'D',
            ThreadState::Unknown => '?',
            ThreadState::Other(c) => c,
        }
    }
}

impl From<String> for ThreadState {
    fn from(s: String) -> ThreadState {
        ThreadState::of(&s)
    }
}

impl From<ThreadState> for String {
    fn from(s: ThreadState) -> String {
        s.letter().to_string()
    }
}

crate::closed_set! {
    /// Which file of the cgroup set an IO limit: v1's blkio.throttle.* or v2's io.max.
    LimitSource {
        #[default]
        BlkioThrottle = "blkio.throttle",
        IoMax = "io.max",
    }
}

/// An IO limit of a cgroup on one device, as its own file sets it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IoLimit {
    /// The cgroup's directory.
    pub cgroup: String,
    /// "MAJ:MIN".
    pub dev: String,
    /// Where it was read.
    pub source: LimitSource,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<u64>,
    /// Bytes read on that device by the cgroup so far (blkio.throttle.io_service_bytes, io.stat rbytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<u64>,
}

/// A connection of the target found mid-request at attach.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConnAtAttach {
    pub local: String,
    pub peer: String,
    /// "unread" (request bytes wait in the receive queue, or in the listener's accept queue),
    /// "waiting" (read, no response byte since), "responding" (a response began after it).
    pub state: String,
    /// ms since the last request bytes arrived, and since the server last sent (tcp_info).
    pub last_recv_ms: u32,
    pub last_sent_ms: u32,
    pub rqueue: u32,
}

/// Why a residency reading was taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResidencyWhy {
    #[default]
    Periodic,
    /// At the end of the trace.
    End,
    /// On SIGUSR1.
    OnDemand,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResidencyReading {
    pub ts_ns: u64,
    pub why: ResidencyWhy,
    pub files: Vec<Residency>,
}

crate::closed_set! {
    /// What a port answers as.
    Kind {
        LlamaCpp = "llama.cpp",
        Vllm = "vllm",
        Ollama = "ollama",
        /// Answers HTTP but none of the known endpoints.
        #[default]
        Other = "other",
        /// Does not answer HTTP (or not on loopback): asked once, then left alone.
        NotHttp = "none",
    }
}

/// One poll of one of the server's ports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EndpointPoll {
    pub ts_ns: u64,
    pub addr: String,
    /// Polled inside the target's network namespace.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub netns: bool,
    pub kind: Kind,
    /// Prometheus series `name{labels}` → value (histogram buckets left out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<BTreeMap<String, f64>>,
    /// The HTTP status of /metrics when it was not 200.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub props: Option<LlamaProps>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ps: Option<Vec<LoadedModel>>,
    /// probe's own local ports for this poll: the report leaves requests from them out.
    pub local_ports: Vec<u16>,
}

impl EndpointPoll {
    /// The poll found a server (not a port that does not answer HTTP).
    pub fn answered(&self) -> bool {
        self.kind != Kind::NotHttp
    }

    pub fn sleeping(&self) -> Option<bool> {
        self.props.as_ref().and_then(|p| p.is_sleeping)
    }

    pub fn metric(&self, series: &str) -> Option<f64> {
        self.metrics.as_ref()?.get(series).copied()
    }
}

/// llama.cpp's /props, the fields probe keeps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LlamaProps {
    pub is_sleeping: Option<bool>,
    pub total_slots: Option<u64>,
    pub n_ctx_slot: Option<u64>,
    pub model_path: Option<String>,
    pub build_info: Option<String>,
}

/// An Ollama model loaded at the poll (/api/ps).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadedModel {
    pub name: Option<String>,
    pub size: Option<u64>,
    pub size_vram: Option<u64>,
    pub expires_at: Option<String>,
}

crate::closed_set! {
    /// A device's `power/runtime_status` (runtime power management), as sysfs writes it.
    RuntimeStatus {
        Active = "active",
        Suspended = "suspended",
        Suspending = "suspending",
        Resuming = "resuming",
        Error = "error",
        /// No runtime power management (the file says so, or there is none): the device stays in D0.
        Unsupported = "unsupported",
    }
    /// A word a later kernel has.
    Other(String)
}

/// A recording without the field reads as no word, as the string it was read into did.
impl Default for RuntimeStatus {
    fn default() -> Self {
        RuntimeStatus::Other(String::new())
    }
}

crate::closed_set! {
    /// A PCI device's `power_state` (Linux 5.19 and later), as sysfs writes it.
    PowerState {
        D0 = "D0",
        D1 = "D1",
        D2 = "D2",
        D3hot = "D3hot",
        D3cold = "D3cold",
        Unknown = "unknown",
        Error = "error",
    }
    /// A word a later kernel has.
    Other(String)
}

/// A GPU's PCI power state as sysfs has it without waking the device.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PciPower {
    /// The PCI address (0000:01:00.0).
    pub addr: String,
    /// `power/runtime_status`; unsupported where the file is missing.
    pub runtime: RuntimeStatus,
    /// `power_state`, where the kernel has it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<PowerState>,
    /// `power/control` is `auto`: the kernel suspends the device when nothing holds it (an open
    /// NVML handle does).
    pub runtime_pm: bool,
}

impl PciPower {
    /// Suspended (runtime PM) or in a D3 state.
    pub fn asleep(&self) -> bool {
        matches!(self.runtime, RuntimeStatus::Suspended | RuntimeStatus::Suspending)
            || matches!(self.state, Some(PowerState::D3hot | PowerState::D3cold))
    }

    /// How it is said: "D3cold", else the runtime status.
    pub fn said(&self) -> &str {
        self.state
            .as_ref()
            .filter(|s| **s != PowerState::D0 || self.runtime == RuntimeStatus::Active)
            .map_or(self.runtime.name(), PowerState::name)
    }
}

/// A GPU as it is at the start of the trace.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuDevice {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub driver: String,
    /// Highest SM (graphics) and memory clocks the device supports, MHz.
    pub max_sm_mhz: Option<u32>,
    pub max_mem_mhz: Option<u32>,
    pub power_limit_w: Option<f64>,
    pub vram_total: Option<u64>,
}

crate::closed_set! {
    /// Why a GPU's clocks are held down (NVML's clock-event reasons, by their names in lower case).
    ClockReason {
        /// Nothing runs on the GPU: not a throttle.
        GpuIdle = "gpu_idle",
        ApplicationsClocksSetting = "applications_clocks_setting",
        SwPowerCap = "sw_power_cap",
        HwSlowdown = "hw_slowdown",
        SyncBoost = "sync_boost",
        SwThermalSlowdown = "sw_thermal_slowdown",
        HwThermalSlowdown = "hw_thermal_slowdown",
        HwPowerBrakeSlowdown = "hw_power_brake_slowdown",
        DisplayClockSetting = "display_clock_setting",
    }
    /// A reason a later NVML names.
    Other(String)
}

/// One reading of one GPU. Fields NVML cannot give on this device are `None`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub sm_mhz: Option<u32>,
    pub mem_mhz: Option<u32>,
    /// Performance state: 0 (P0, full speed) .. 15 (P15, idle).
    pub pstate: Option<u32>,
    pub power_w: Option<f64>,
    /// % of the last sample period a kernel ran / device memory was busy.
    pub util_gpu: Option<u32>,
    pub util_mem: Option<u32>,
    pub vram_used: Option<u64>,
    pub vram_free: Option<u64>,
    /// Why clocks are held down now (clock-event reasons), e.g. gpu_idle, sw_power_cap.
    #[serde(default)]
    pub reasons: Vec<ClockReason>,
    /// GPU memory used by the traced processes on this device.
    pub target_vram: Option<u64>,
}

/// Memory pressure, system-wide and for the target.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Mem {
    /// PSI memory "some" and "full" stall totals, µs since boot.
    pub psi_some_us: Option<u64>,
    pub psi_full_us: Option<u64>,
    /// PSI io "some" total, µs.
    pub psi_io_some_us: Option<u64>,
    /// /proc/vmstat counters (pages / events since boot).
    pub pgscan_direct: u64,
    pub allocstall: u64,
    pub compact_stall: u64,
    pub pswpin: u64,
    pub pgmajfault: u64,
    pub oom_kill: u64,
    pub mem_available_kib: Option<u64>,
    /// The target's resident memory (KiB): all, file-backed, anonymous.
    pub rss_kib: Option<u64>,
    pub rss_file_kib: Option<u64>,
    pub rss_anon_kib: Option<u64>,
    /// The target's memory cgroup: usage and limit (bytes), failcnt / max events.
    pub cgroup: Option<String>,
    pub cgroup_usage: Option<u64>,
    pub cgroup_limit: Option<u64>,
    pub cgroup_limit_hits: Option<u64>,
    /// The target's memory in swap (VmSwap, KiB): it falls as pages are faulted back in.
    pub swap_kib: Option<u64>,
    /// The target's CPU cgroup and its CFS bandwidth limit: quota and period (µs; no quota: None),
    /// and how often and how long (ns) it was throttled, cumulative (cpu.stat).
    pub cpu_cgroup: Option<String>,
    pub cpu_quota_us: Option<u64>,
    pub cpu_period_us: Option<u64>,
    pub nr_throttled: Option<u64>,
    pub throttled_ns: Option<u64>,
    /// The host's steal over every CPU, ms since boot (/proc/stat's `cpu` line; a VM's host
    /// running something else on its CPUs). Not per target: the machine's.
    pub steal_ms: Option<u64>,
}

/// CPU idle states (cpuidle sysfs), summed over CPUs: per state its name, exit latency (µs), time
/// spent in it (µs) and entries, cumulative.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct CpuIdle {
    pub cpus: u32,
    pub names: Vec<String>,
    pub latency_us: Vec<u64>,
    pub time_us: Vec<u64>,
    pub usage: Vec<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Residency {
    pub path: String,
    pub bytes: u64,
    pub pages: u64,
    pub resident: u64,
    /// Pages of the file evicted from the cache (cachestat only; since boot, per inode history).
    pub evicted: Option<u64>,
    /// Which file it is (`probe diff` compares model files by these, never by a hash: reading
    /// the file would warm the page cache being compared).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inode: u64,
    #[serde(default, skip_serializing_if = "is_zero_i")]
    pub mtime_unix_s: i64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_i(n: &i64) -> bool {
    *n == 0
}

impl Residency {
    pub fn share(&self) -> f64 {
        if self.pages == 0 { 1.0 } else { self.resident as f64 / self.pages as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_round_trips_and_carries_its_type() {
        let all = [
            Sample::Samplers(Sources {
                ts_ns: 1,
                hz: 10.0,
                cpufreq_max_khz: Some(vec![3_000_000]),
                gpu_absent: Some("no".into()),
                ..Default::default()
            }),
            Sample::Gpu(GpuReading {
                ts_ns: 2,
                gpus: vec![GpuSample { index: 0, sm_mhz: Some(1500), reasons: vec!["gpu_idle".into()], ..Default::default() }],
                ..Default::default()
            }),
            Sample::Cpufreq(CpuFreqReading { ts_ns: 3, cur_khz: vec![1, 2] }),
            Sample::Mem(MemReading { ts_ns: 4, mem: Mem { rss_kib: Some(5), pswpin: 7, ..Default::default() } }),
            Sample::Cpuidle(CpuIdleReading {
                ts_ns: 5,
                idle: CpuIdle { cpus: 2, names: vec!["C1".into()], latency_us: vec![2], time_us: vec![9], usage: vec![3] },
            }),
            Sample::Residency(ResidencyReading {
                ts_ns: 6,
                why: ResidencyWhy::OnDemand,
                files: vec![Residency { path: "/m".into(), bytes: 8, pages: 2, resident: 1, evicted: None, inode: 5, mtime_unix_s: 6 }],
            }),
            Sample::Endpoint(EndpointPoll {
                ts_ns: 7,
                addr: "127.0.0.1:8080".into(),
                kind: Kind::LlamaCpp,
                metrics: Some([("llamacpp:requests_deferred".to_string(), 1.0)].into()),
                props: Some(LlamaProps { is_sleeping: Some(true), ..Default::default() }),
                local_ports: vec![40000],
                ..Default::default()
            }),
        ];
        for s in &all {
            let kind = s.kind();
            let v = serde_json::to_value(s).unwrap();
            assert_eq!((v["type"].as_str(), s.kind()), (Some(kind), kind));
            assert_eq!(&serde_json::from_value::<Sample>(v).unwrap(), s);
            // The recording's reader reads each by its type, as the variant.
            let r = super::super::records::UserRecord::Sample(Box::new(s.clone()));
            assert_eq!(super::super::records::UserRecord::parse(&r.to_json().unwrap()).unwrap(), r);
        }
        // Older or sparser frames read with defaults.
        let s: Sample = serde_json::from_str(r#"{"type":"mem","ts_ns":9,"rss_kib":3}"#).unwrap();
        assert!(matches!(s, Sample::Mem(m) if m.mem.rss_kib == Some(3) && m.ts_ns == 9));
        let s: Sample = serde_json::from_str(r#"{"type":"endpoint","ts_ns":1,"kind":"none","local_ports":[5]}"#).unwrap();
        assert!(matches!(s, Sample::Endpoint(e) if !e.answered() && e.local_ports == [5]));
    }

    /// A thread's state is written as /proc's letter and read back as the same state, any letter
    /// the kernel has included; an IO limit's source as its file's name.
    #[test]
    fn thread_states_and_limit_sources_keep_their_words() {
        for (letter, state) in
            [("R", ThreadState::Running), ("S", ThreadState::Sleeping), ("D", ThreadState::DiskSleep), ("I", ThreadState::Other('I'))]
        {
            let t = ThreadAtAttach { tid: 1, state: ThreadState::of(letter), ..Default::default() };
            assert_eq!(t.state, state);
            let v = serde_json::to_value(&t).unwrap();
            assert_eq!(v["state"], letter);
            assert_eq!(serde_json::from_value::<ThreadAtAttach>(v).unwrap(), t);
        }
        assert_eq!(ThreadState::of(""), ThreadState::Unknown);
        let l = IoLimit { source: LimitSource::IoMax, ..Default::default() };
        assert_eq!(serde_json::to_value(&l).unwrap()["source"], "io.max");
        let old: IoLimit = serde_json::from_str(r#"{"cgroup":"/x","dev":"8:0","source":"blkio.throttle"}"#).unwrap();
        assert_eq!(old.source, LimitSource::BlkioThrottle);
    }

    /// sysfs's power words and NVML's reasons are read into their sets and written back as the
    /// same words, a word this version does not list included; values order by their words.
    #[test]
    fn power_states_and_clock_reasons_keep_their_words() {
        let line = r#"{"addr":"0000:01:00.0","runtime":"suspended","state":"D3cold","runtime_pm":true}"#;
        let p: PciPower = serde_json::from_str(line).unwrap();
        assert_eq!((&p.runtime, &p.state), (&RuntimeStatus::Suspended, &Some(PowerState::D3cold)));
        assert!(p.asleep() && p.said() == "D3cold");
        assert_eq!(serde_json::to_string(&p).unwrap(), line);
        let later = r#"{"addr":"a","runtime":"frozen","state":"D4","runtime_pm":false}"#;
        let p: PciPower = serde_json::from_str(later).unwrap();
        assert_eq!((&p.runtime, &p.state), (&RuntimeStatus::Other("frozen".into()), &Some(PowerState::Other("D4".into()))));
        assert!(!p.asleep() && p.said() == "D4");
        assert_eq!(serde_json::to_string(&p).unwrap(), later);
        let on = PciPower { runtime: RuntimeStatus::Active, state: Some(PowerState::D0), ..Default::default() };
        let held = PciPower { runtime: RuntimeStatus::Unsupported, ..on.clone() };
        assert_eq!((on.said(), held.said()), ("D0", "unsupported"));
        let g: GpuSample = serde_json::from_str(r#"{"index":0,"reasons":["sw_power_cap","gpu_idle","new_reason"]}"#).unwrap();
        assert_eq!(g.reasons, [ClockReason::SwPowerCap, ClockReason::GpuIdle, ClockReason::Other("new_reason".into())]);
        assert_eq!(serde_json::to_value(&g).unwrap()["reasons"], serde_json::json!(["sw_power_cap", "gpu_idle", "new_reason"]));
        let mut sorted = g.reasons.clone();
        sorted.sort();
        assert_eq!(sorted.iter().map(ClockReason::name).collect::<Vec<_>>(), ["gpu_idle", "new_reason", "sw_power_cap"]);
    }
}
