//! The machine around the target during a trace, from the sampler records and the mem probe:
//! GPU clocks and memory, CPU frequency, memory pressure (PSI, reclaim, compaction, OOM kills,
//! RSS, memory cgroup), the model files' page-cache residency and the server's own endpoints.
//! Pure: records in, summary out (`render::system` writes it for people).
use std::collections::{BTreeMap, HashSet};

use crate::record::samples::{
    ClockReason, CpuFreqReading, CpuIdleReading, EndpointPoll, GpuDevice, GpuSample, LoadedModel, Mem, ResidencyReading, Sample,
};
use probe_common::mem::{MEM_COMPACTION, MEM_DIRECT_RECLAIM, MEM_MEMCG_RECLAIM, MEM_OOM_VICTIM, MemEvent};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct System {
    pub gpu: Gpu,
    pub cpu_freq: CpuFreq,
    pub memory: Memory,
    pub model_files: Vec<ModelFile>,
    pub server: Vec<Endpoint>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Gpu {
    /// Why GPU clocks were not sampled (no NVIDIA driver), if so.
    pub absent: Option<String>,
    pub devices: Vec<GpuDevice>,
    pub samples: u64,
    pub per_device: Vec<GpuStats>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuStats {
    pub index: u32,
    pub sm_mhz_min: Option<u32>,
    pub sm_mhz_max: Option<u32>,
    pub pstates: Vec<u32>,
    pub power_w_max: Option<f64>,
    pub util_gpu_max: Option<u32>,
    pub vram_used_max: Option<u64>,
    pub target_vram_max: Option<u64>,
    /// Clock-event reasons seen, with how many samples had each.
    pub reasons: BTreeMap<ClockReason, u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct IdleState {
    pub name: String,
    pub latency_us: u64,
    /// Share of all CPUs' time in this state while tracing, and how often they entered it.
    pub share: f64,
    pub entries: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CpuFreq {
    pub absent: Option<String>,
    /// CPU idle states (cpuidle), when the kernel has them.
    #[serde(default)]
    pub idle: Vec<IdleState>,
    pub samples: u64,
    /// Mean over CPUs of current/max, lowest and highest seen.
    pub share_min: Option<f64>,
    pub share_max: Option<f64>,
    pub max_mhz: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stall {
    pub count: u64,
    pub total_ms: f64,
    pub max_ms: f64,
    /// Reclaim: pages reclaimed.
    pub pages: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct OomKill {
    pub t_ms: f64,
    pub pid: u32,
    pub rss_kib: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Memory {
    /// In the target's threads (mem probe).
    pub direct_reclaim: Stall,
    pub memcg_reclaim: Stall,
    pub compaction: Stall,
    pub oom_kills: Vec<OomKill>,
    /// System-wide during the trace (deltas of PSI totals and /proc/vmstat).
    pub psi_some_ms: Option<f64>,
    pub psi_full_ms: Option<f64>,
    pub psi_io_some_ms: Option<f64>,
    pub pgscan_direct: u64,
    pub allocstall: u64,
    pub compact_stall: u64,
    pub pswpin: u64,
    pub oom_kill_events: u64,
    pub mem_available_min_kib: Option<u64>,
    /// The target (and its children): resident memory, KiB.
    pub rss_kib_start: Option<u64>,
    pub rss_kib_max: Option<u64>,
    pub rss_kib_end: Option<u64>,
    pub rss_file_kib_max: Option<u64>,
    pub cgroup: Option<String>,
    pub cgroup_limit: Option<u64>,
    pub cgroup_usage_max: Option<u64>,
    pub cgroup_limit_hits: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ModelFile {
    pub path: String,
    pub bytes: u64,
    /// Share of its pages in the page cache: first and last reading, lowest seen.
    pub resident_start: f64,
    pub resident_end: f64,
    pub resident_min: f64,
    pub readings: u64,
    /// Pages evicted while tracing (cachestat), if known.
    pub evicted: Option<u64>,
    /// Its inode and modification time (seconds since the epoch), when the recording has them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inode: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_unix_s: Option<i64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Series {
    pub first: f64,
    pub last: f64,
    pub max: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Endpoint {
    pub addr: String,
    pub kind: crate::record::samples::Kind,
    pub polls: u64,
    pub build_info: Option<String>,
    pub model_path: Option<String>,
    pub total_slots: Option<u64>,
    /// llama.cpp: context per slot (tokens).
    pub n_ctx_slot: Option<u64>,
    /// llama.cpp: polls that found the server sleeping (model unloaded).
    pub sleeping_polls: u64,
    pub metrics_status: Option<u64>,
    /// The address is in the target's network namespace (a container's), not probe's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub netns: bool,
    /// Prometheus series: first, last and highest value while tracing.
    pub series: BTreeMap<String, Series>,
    /// Ollama: models loaded at the last poll (name, size_vram, expires_at).
    pub loaded_models: Vec<LoadedModel>,
}

/// Local ports of probe's own endpoint polls: requests from them are not the server's traffic.
pub fn poll_ports(samples: &[Sample]) -> HashSet<u16> {
    samples.iter().filter_map(|s| if let Sample::Endpoint(e) = s { Some(&e.local_ports) } else { None }).flatten().copied().collect()
}

fn max_in<T: PartialOrd + Copy>(out: &mut Option<T>, x: Option<T>) {
    if let Some(x) = x {
        *out = Some(match *out {
            Some(o) if o >= x => o,
            _ => x,
        });
    }
}

fn gpu_stats(st: &mut GpuStats, g: &GpuSample) {
    if let Some(c) = g.sm_mhz {
        st.sm_mhz_min = Some(st.sm_mhz_min.map_or(c, |m| m.min(c)));
        st.sm_mhz_max = Some(st.sm_mhz_max.map_or(c, |m| m.max(c)));
    }
    if let Some(p) = g.pstate
        && !st.pstates.contains(&p)
    {
        st.pstates.push(p);
        st.pstates.sort_unstable();
    }
    max_in(&mut st.power_w_max, g.power_w);
    max_in(&mut st.util_gpu_max, g.util_gpu);
    max_in(&mut st.vram_used_max, g.vram_used);
    max_in(&mut st.target_vram_max, g.target_vram);
    for r in &g.reasons {
        *st.reasons.entry(r.clone()).or_default() += 1;
    }
}

fn endpoint(eps: &mut BTreeMap<String, Endpoint>, v: &EndpointPoll) {
    let e = eps.entry(v.addr.clone()).or_insert_with(|| Endpoint { addr: v.addr.clone(), ..Default::default() });
    e.kind = v.kind;
    e.polls += 1;
    e.metrics_status = v.metrics_status.map(u64::from);
    e.netns |= v.netns;
    if let Some(p) = &v.props {
        e.build_info = p.build_info.clone().or(e.build_info.take());
        e.model_path = p.model_path.clone().or(e.model_path.take());
        e.total_slots = p.total_slots.or(e.total_slots);
        e.n_ctx_slot = p.n_ctx_slot.or(e.n_ctx_slot);
        e.sleeping_polls += u64::from(p.is_sleeping == Some(true));
    }
    for (k, &x) in v.metrics.iter().flatten() {
        let sr = e.series.entry(k.clone()).or_insert(Series { first: x, last: x, max: x });
        sr.last = x;
        sr.max = sr.max.max(x);
    }
    if let Some(ps) = &v.ps {
        e.loaded_models = ps.clone();
    }
}

fn idle_states(a: &CpuIdleReading, b: &CpuIdleReading) -> Vec<IdleState> {
    let wall_us = b.ts_ns.saturating_sub(a.ts_ns) as f64 / 1e3 * f64::from(b.idle.cpus.max(1));
    let (x, y) = (&a.idle, &b.idle);
    y.names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let dt = y.time_us.get(i).zip(x.time_us.get(i)).map_or(0, |(y, x)| y.saturating_sub(*x));
            IdleState {
                name: name.clone(),
                latency_us: y.latency_us.get(i).copied().unwrap_or(0),
                share: if wall_us > 0.0 { (dt as f64 / wall_us).min(1.0) } else { 0.0 },
                entries: y.usage.get(i).zip(x.usage.get(i)).map_or(0, |(y, x)| y.saturating_sub(*x)),
            }
        })
        .collect()
}

fn memory_deltas(m: &mut Memory, a: &Mem, b: &Mem) {
    let dms = |x: Option<u64>, y: Option<u64>| Some(y?.saturating_sub(x?) as f64 / 1e3);
    m.psi_some_ms = dms(a.psi_some_us, b.psi_some_us);
    m.psi_full_ms = dms(a.psi_full_us, b.psi_full_us);
    m.psi_io_some_ms = dms(a.psi_io_some_us, b.psi_io_some_us);
    m.pgscan_direct = b.pgscan_direct.saturating_sub(a.pgscan_direct);
    m.allocstall = b.allocstall.saturating_sub(a.allocstall);
    m.compact_stall = b.compact_stall.saturating_sub(a.compact_stall);
    m.pswpin = b.pswpin.saturating_sub(a.pswpin);
    m.oom_kill_events = b.oom_kill.saturating_sub(a.oom_kill);
    m.rss_kib_start = a.rss_kib;
    m.rss_kib_end = b.rss_kib;
    m.cgroup_limit_hits = match (a.cgroup_limit_hits, b.cgroup_limit_hits) {
        (Some(x), Some(y)) => Some(y.saturating_sub(x)),
        _ => None,
    };
}

pub fn build(samples: &[Sample], mem_events: &[&MemEvent], start: u64) -> System {
    let mut s = System::default();
    let mut first_mem: Option<&Mem> = None;
    let mut last_mem: Option<&Mem> = None;
    let (mut first_idle, mut last_idle): (Option<&CpuIdleReading>, Option<&CpuIdleReading>) = (None, None);
    let mut files: BTreeMap<String, ModelFile> = BTreeMap::new();
    let mut first_evicted: BTreeMap<String, u64> = BTreeMap::new();
    let mut eps: BTreeMap<String, Endpoint> = BTreeMap::new();
    let cpu_maxes = cpu_max(samples);
    for v in samples {
        match v {
            Sample::Samplers(v) => {
                s.gpu.absent = v.gpu_absent.clone();
                s.gpu.devices = v.gpus.clone().unwrap_or_default();
                s.cpu_freq.absent = v.cpufreq_absent.clone();
                if let Some(m) = &v.cpufreq_max_khz {
                    s.cpu_freq.max_mhz =
                        m.iter().map(|&k| k as f64).fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b)))).map(|k| k / 1e3);
                }
                s.memory.cgroup = v.memory_cgroup.clone();
            }
            Sample::Gpu(v) => {
                if let Some(d) = v.devices.as_ref().filter(|_| s.gpu.devices.is_empty()) {
                    s.gpu.devices = d.clone();
                }
                if v.gpus.is_empty() {
                    continue;
                }
                s.gpu.samples += 1;
                for g in &v.gpus {
                    let st = match s.gpu.per_device.iter().position(|d| d.index == g.index) {
                        Some(p) => &mut s.gpu.per_device[p],
                        None => {
                            s.gpu.per_device.push(GpuStats { index: g.index, ..Default::default() });
                            s.gpu.per_device.last_mut().expect("just pushed")
                        }
                    };
                    gpu_stats(st, g);
                }
            }
            Sample::Cpufreq(v) => {
                s.cpu_freq.samples += 1;
                if let Some(share) = cpu_share(v, &cpu_maxes) {
                    s.cpu_freq.share_min = Some(s.cpu_freq.share_min.map_or(share, |m| m.min(share)));
                    s.cpu_freq.share_max = Some(s.cpu_freq.share_max.map_or(share, |m| m.max(share)));
                }
            }
            Sample::Mem(v) => {
                let v = &v.mem;
                first_mem.get_or_insert(v);
                last_mem = Some(v);
                let m = &mut s.memory;
                max_in(&mut m.rss_kib_max, v.rss_kib);
                max_in(&mut m.rss_file_kib_max, v.rss_file_kib);
                max_in(&mut m.cgroup_usage_max, v.cgroup_usage);
                if let Some(x) = v.mem_available_kib {
                    m.mem_available_min_kib = Some(m.mem_available_min_kib.map_or(x, |o| o.min(x)));
                }
                if let Some(l) = v.cgroup_limit {
                    m.cgroup_limit = Some(l);
                }
            }
            Sample::Cpuidle(v) => {
                first_idle.get_or_insert(v);
                last_idle = Some(v);
            }
            Sample::Residency(v) => residency(&mut files, &mut first_evicted, v),
            Sample::Endpoint(v) if v.answered() => endpoint(&mut eps, v),
            Sample::Endpoint(_) | Sample::Attach(_) => {}
        }
    }
    if let (Some(a), Some(b)) = (first_idle, last_idle) {
        s.cpu_freq.idle = idle_states(a, b);
    }
    if let (Some(a), Some(b)) = (first_mem, last_mem) {
        memory_deltas(&mut s.memory, a, b);
    }
    memory_stalls(&mut s.memory, mem_events, start);
    s.model_files = files.into_values().collect();
    s.model_files.sort_by_key(|f| std::cmp::Reverse(f.bytes));
    s.server = eps.into_values().collect();
    s
}

/// One residency reading into the model files' table: each file's residency at the start, its
/// lowest, at the end, and the pages evicted since its first reading.
fn residency(files: &mut BTreeMap<String, ModelFile>, first_evicted: &mut BTreeMap<String, u64>, v: &ResidencyReading) {
    for r in &v.files {
        let share = r.share();
        let f = files.entry(r.path.clone()).or_insert_with(|| ModelFile {
            path: r.path.clone(),
            bytes: r.bytes,
            resident_start: share,
            resident_min: share,
            inode: (r.inode != 0).then_some(r.inode),
            mtime_unix_s: (r.inode != 0).then_some(r.mtime_unix_s),
            ..Default::default()
        });
        f.resident_end = share;
        f.resident_min = f.resident_min.min(share);
        f.readings += 1;
        if let Some(e) = r.evicted {
            let first = *first_evicted.entry(r.path.clone()).or_insert(e);
            f.evicted = Some(e.saturating_sub(first));
        }
    }
}

/// The kernel's memory events into the memory section: reclaim and compaction stalls (count,
/// time, pages), and OOM kills (ms from `start`).
fn memory_stalls(m: &mut Memory, mem_events: &[&MemEvent], start: u64) {
    let ms = |ts: u64| ts.saturating_sub(start) as f64 / 1e6;
    for e in mem_events {
        let dur = e.hdr.ts_ns.saturating_sub(e.begin_ns) as f64 / 1e6;
        let stall = match e.what {
            MEM_DIRECT_RECLAIM => &mut m.direct_reclaim,
            MEM_MEMCG_RECLAIM => &mut m.memcg_reclaim,
            MEM_COMPACTION => &mut m.compaction,
            MEM_OOM_VICTIM => {
                m.oom_kills.push(OomKill { t_ms: ms(e.hdr.ts_ns), pid: e.victim, rss_kib: e.nr });
                continue;
            }
            _ => continue,
        };
        stall.count += 1;
        stall.total_ms += dur;
        stall.max_ms = stall.max_ms.max(dur);
        if e.what != MEM_COMPACTION {
            stall.pages += e.nr;
        }
    }
}

fn cpu_max(samples: &[Sample]) -> Vec<f64> {
    samples
        .iter()
        .find_map(|v| if let Sample::Samplers(s) = v { s.cpufreq_max_khz.as_ref() } else { None })
        .map(|m| m.iter().map(|&k| k as f64).collect())
        .unwrap_or_default()
}

/// Mean over CPUs of cur/max for one cpufreq record.
fn cpu_share(v: &CpuFreqReading, max: &[f64]) -> Option<f64> {
    let cur = &v.cur_khz;
    if cur.is_empty() || cur.len() != max.len() {
        return None;
    }
    Some(cur.iter().zip(max).map(|(&c, m)| if *m > 0.0 { c as f64 / m } else { 1.0 }).sum::<f64>() / cur.len() as f64)
}

/// (time, device, SM clock as a share of its working clock, P-state).
pub type GpuClock = (u64, u32, f64, Option<u32>);

/// A GPU's PCI power state as sysfs said it: (time, PCI address, asleep, as said: "D3cold").
pub type PciState = (u64, String, bool, String);

/// Every GPU power state read from sysfs, in time order (a reading lists the devices whose state
/// changed since the one before).
pub fn pci_series(samples: &[Sample]) -> Vec<PciState> {
    samples
        .iter()
        .filter_map(|v| if let Sample::Gpu(g) = v { Some(g) } else { None })
        .flat_map(|g| g.pci.iter().map(move |p| (g.ts_ns, p.addr.clone(), p.asleep(), p.said().to_string())))
        .collect()
}

/// Clock readings over time for the verdicts: (ts, share of the device's working clock).
/// GPU: SM clock / highest SM clock seen in the trace (or the device maximum); CPU: mean cur/max.
pub fn clock_series(samples: &[Sample]) -> (Vec<GpuClock>, Vec<(u64, f64)>) {
    let gpu_readings = || samples.iter().filter_map(|v| if let Sample::Gpu(g) = v { Some(g) } else { None });
    let mut gpu_max: BTreeMap<u32, f64> = BTreeMap::new();
    for g in gpu_readings().flat_map(|v| &v.gpus) {
        if let Some(c) = g.sm_mhz {
            let e = gpu_max.entry(g.index).or_insert(0.0);
            *e = e.max(f64::from(c));
        }
    }
    let mut gpu = Vec::new();
    for v in gpu_readings() {
        for g in &v.gpus {
            if let (Some(c), Some(m)) = (g.sm_mhz, gpu_max.get(&g.index))
                && *m > 0.0
            {
                gpu.push((v.ts_ns, g.index, f64::from(c) / m, g.pstate));
            }
        }
    }
    let max = cpu_max(samples);
    let cpu = samples.iter().filter_map(|v| if let Sample::Cpufreq(c) = v { Some((c.ts_ns, cpu_share(c, &max)?)) } else { None }).collect();
    (gpu, cpu)
}
