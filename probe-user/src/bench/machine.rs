//! The machine's state while a level ran, so that no speed figure is "clock-unattributed": CPU
//! frequency (sampled every 250 ms) and governor, the share of time in each CPU idle state,
//! memory and CPU pressure (PSI), GPU clocks, power and throttle reasons (NVML, where there is
//! one), and the CPU other processes used (/proc). A level run that others' CPU or memory
//! pressure competed with is flagged `contended`, naming who.
use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{
    record::samples::ClockReason,
    sampler::{gpu, host, procs},
};

/// Others' CPU use (cores, averaged over the level) from which a level is contended.
pub const CONTENDED_CORES: f64 = 0.5;
/// Memory pressure (PSI some, % of the level's time) from which a level is contended.
pub const CONTENDED_MEM_PSI: f64 = 10.0;
const EVERY: Duration = Duration::from_millis(250);

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct Competitor {
    pub pid: u32,
    pub comm: String,
    /// CPU used, cores (CPU seconds / the level's seconds).
    pub cores: f64,
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct GpuState {
    pub index: u32,
    pub sm_mhz_mean: Option<f64>,
    pub sm_mhz_min: Option<f64>,
    pub power_w_mean: Option<f64>,
    pub pstate_max: Option<u32>,
    /// Clock-event reasons seen in any sample (e.g. sw_power_cap, hw_slowdown), idle left out.
    pub reasons: Vec<ClockReason>,
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct Machine {
    pub cpus: usize,
    /// Mean current frequency over the CPUs and the samples, and the highest they offer, MHz.
    pub cpu_mhz_mean: Option<f64>,
    pub cpu_mhz_max: Option<f64>,
    pub governor: Option<String>,
    /// Share of the CPUs' time in each idle state, %.
    pub idle_pct: BTreeMap<String, f64>,
    /// PSI "some": % of the time at least one task stalled on memory / waited for a CPU.
    pub mem_psi_pct: Option<f64>,
    pub cpu_psi_pct: Option<f64>,
    /// CPU used by the server's processes and by every other process (probe excluded), cores.
    pub server_cores: Option<f64>,
    pub others_cores: f64,
    /// The other processes that used the most CPU (at most 3, above 0.05 cores).
    pub competitors: Vec<Competitor>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuState>,
    /// Why the level counts as contended (empty: it does not).
    pub why: Vec<String>,
}

impl Machine {
    pub fn contended(&self) -> bool {
        !self.why.is_empty()
    }

    /// Why the level counts as contended (see CONTENDED_CORES, CONTENDED_MEM_PSI).
    fn judge(&mut self) {
        self.why.clear();
        if self.others_cores >= CONTENDED_CORES {
            let who: Vec<String> = self.competitors.iter().map(|c| format!("{} (pid {}) {:.2}", c.comm, c.pid, c.cores)).collect();
            self.why.push(format!(
                "other processes used {:.2} cores{}",
                self.others_cores,
                if who.is_empty() { String::new() } else { format!(": {}", who.join(", ")) }
            ));
        }
        if let Some(p) = self.mem_psi_pct.filter(|p| *p >= CONTENDED_MEM_PSI) {
            self.why.push(format!("memory pressure stalled tasks {p:.0}% of the time"));
        }
    }

    /// The mean state over a level's runs (competitors and reasons from every run).
    pub fn mean(ms: &[&Machine]) -> Option<Machine> {
        let first = (*ms.first()?).clone();
        if ms.len() == 1 {
            return Some(first);
        }
        let n = ms.len() as f64;
        let avg = |g: &dyn Fn(&Machine) -> Option<f64>| crate::util::stats::mean(&ms.iter().filter_map(|m| g(m)).collect::<Vec<_>>());
        let mut m = Machine {
            cpus: first.cpus,
            cpu_mhz_mean: avg(&|m| m.cpu_mhz_mean),
            cpu_mhz_max: first.cpu_mhz_max,
            governor: first.governor.clone(),
            mem_psi_pct: avg(&|m| m.mem_psi_pct),
            cpu_psi_pct: avg(&|m| m.cpu_psi_pct),
            server_cores: avg(&|m| m.server_cores),
            others_cores: ms.iter().map(|m| m.others_cores).sum::<f64>() / n,
            gpus: first.gpus.clone(),
            ..Default::default()
        };
        for k in first.idle_pct.keys() {
            m.idle_pct.insert(k.clone(), ms.iter().filter_map(|x| x.idle_pct.get(k)).sum::<f64>() / n);
        }
        let mut by: BTreeMap<(u32, String), f64> = BTreeMap::new();
        for x in ms {
            for c in &x.competitors {
                *by.entry((c.pid, c.comm.clone())).or_insert(0.0) += c.cores / n;
            }
        }
        let mut comp: Vec<Competitor> = by.into_iter().map(|((pid, comm), cores)| Competitor { pid, comm, cores }).collect();
        comp.sort_by(|a, b| b.cores.total_cmp(&a.cores));
        comp.truncate(3);
        m.competitors = comp;
        // One sentence for the level: how many of its runs were contended, with the means.
        let contended = ms.iter().filter(|x| x.contended()).count();
        if contended > 0 {
            m.judge();
            if m.why.is_empty() {
                m.why.push(String::new());
            }
            for w in m.why.iter_mut() {
                *w = format!("{contended} of {} runs: {}", ms.len(), if w.is_empty() { "contended".to_string() } else { w.clone() });
            }
        }
        Some(m)
    }

    /// One line: "2.9 GHz (max 3.5), others 1.9 cores (stress 1.0, yes 0.9), memory PSI 0%".
    pub fn words(&self) -> String {
        let mut parts = Vec::new();
        if let Some(f) = self.cpu_mhz_mean {
            parts.push(format!(
                "CPU {:.2} GHz{}{}",
                f / 1e3,
                self.cpu_mhz_max.map(|m| format!(" (max {:.2})", m / 1e3)).unwrap_or_default(),
                self.governor.as_ref().map(|g| format!(" {g}")).unwrap_or_default()
            ));
        }
        let comp: Vec<String> = self.competitors.iter().map(|c| format!("{} (pid {}) {:.2}", c.comm, c.pid, c.cores)).collect();
        parts.push(format!(
            "other processes {:.2} cores{}",
            self.others_cores,
            if comp.is_empty() { String::new() } else { format!(": {}", comp.join(", ")) }
        ));
        if let Some(s) = self.server_cores {
            parts.push(format!("server {s:.2} cores"));
        }
        if let Some(p) = self.mem_psi_pct {
            parts.push(format!("memory PSI {p:.0}%"));
        }
        for g in &self.gpus {
            if let Some(sm) = g.sm_mhz_mean {
                parts.push(format!(
                    "GPU{} {sm:.0} MHz{}{}",
                    g.index,
                    g.power_w_mean.map(|w| format!(" {w:.0} W")).unwrap_or_default(),
                    if g.reasons.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", g.reasons.iter().map(ClockReason::name).collect::<Vec<_>>().join(", "))
                    }
                ));
            }
        }
        parts.join(", ")
    }
}

struct Samples {
    mhz: Vec<f64>,
    gpu: BTreeMap<u32, Vec<crate::record::samples::GpuSample>>,
}

/// Watches the machine from `start` to `stop`.
pub struct Watch {
    t0: Instant,
    server: Option<u32>,
    procs: std::collections::HashMap<u32, procs::Proc>,
    psi: (Option<u64>, Option<u64>),
    idle: Option<crate::record::samples::CpuIdle>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Samples>>,
}

fn psi(path: &str) -> Option<u64> {
    host::psi_total(&std::fs::read_to_string(path).ok()?, "some")
}

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

impl Watch {
    /// `server`: the server's pid (its processes' CPU is the server's, not a competitor's).
    /// `gpu_on`: sample NVML (each sample costs a few ms of CPU; off when there is no GPU).
    pub fn start(server: Option<u32>, gpu_on: bool) -> Watch {
        Watch::with_gpu(server, if gpu_on { gpu::open().ok() } else { None })
    }

    /// [`Watch::start`] with the GPU source given (NVML, or the scripted fake in tests).
    pub fn with_gpu(server: Option<u32>, src: Option<Box<dyn gpu::GpuSource>>) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bench-machine".into())
            .spawn(move || {
                let mut src = src;
                let mut s = Samples { mhz: Vec::new(), gpu: BTreeMap::new() };
                while !flag.load(Ordering::Relaxed) {
                    if let Some(f) = host::cpufreq() {
                        s.mhz.push(f.cur_khz.iter().sum::<u64>() as f64 / f.cur_khz.len().max(1) as f64 / 1e3);
                    }
                    if let Some(g) = src.as_mut() {
                        for x in g.sample(&[]) {
                            s.gpu.entry(x.index).or_default().push(x);
                        }
                    }
                    let t = Instant::now();
                    while t.elapsed() < EVERY && !flag.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(25));
                    }
                }
                s
            })
            .ok();
        Watch {
            t0: Instant::now(),
            server,
            procs: procs::snapshot(),
            psi: (psi("/proc/pressure/memory"), psi("/proc/pressure/cpu")),
            idle: host::cpuidle(),
            stop,
            thread,
        }
    }

    pub fn stop(mut self) -> Machine {
        let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.thread.take().and_then(|t| t.join().ok()).unwrap_or(Samples { mhz: Vec::new(), gpu: BTreeMap::new() });
        let after = procs::snapshot();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut m = Machine { cpus, ..Default::default() };
        m.cpu_mhz_mean = crate::util::stats::mean(&samples.mhz);
        m.cpu_mhz_max = host::cpufreq().and_then(|f| f.max_khz.iter().max().map(|k| *k as f64 / 1e3));
        m.governor = read_trim("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor");
        let pct = |a: Option<u64>, b: Option<u64>| Some((b?.saturating_sub(a?)) as f64 / 1e4 / secs);
        m.mem_psi_pct = pct(self.psi.0, psi("/proc/pressure/memory"));
        m.cpu_psi_pct = pct(self.psi.1, psi("/proc/pressure/cpu"));
        if let (Some(a), Some(b)) = (self.idle.as_ref(), host::cpuidle()) {
            let total_us = secs * 1e6 * b.cpus.max(1) as f64;
            for (i, name) in b.names.iter().enumerate() {
                let d = b.time_us.get(i).copied().unwrap_or(0).saturating_sub(a.time_us.get(i).copied().unwrap_or(0));
                m.idle_pct.insert(name.clone(), d as f64 * 100.0 / total_us);
            }
        }
        let me = procs::family(&after, std::process::id());
        let server = self.server.map(|p| procs::family(&after, p)).unwrap_or_default();
        let mut server_s = 0.0;
        for (pid, comm, s) in procs::used(&self.procs, &after) {
            if me.contains(&pid) {
                continue;
            }
            if server.contains(&pid) {
                server_s += s;
                continue;
            }
            m.others_cores += s / secs;
            if m.competitors.len() < 3 && s / secs >= 0.05 {
                m.competitors.push(Competitor { pid, comm, cores: s / secs });
            }
        }
        m.server_cores = self.server.map(|_| server_s / secs);
        for (index, v) in samples.gpu {
            let f = |g: &dyn Fn(&crate::record::samples::GpuSample) -> Option<f64>| -> Vec<f64> { v.iter().filter_map(g).collect() };
            let sm = f(&|s| s.sm_mhz.map(f64::from));
            let pw = f(&|s| s.power_w);
            let mut reasons: Vec<ClockReason> =
                v.iter().flat_map(|s| s.reasons.iter().cloned()).filter(|r| *r != ClockReason::GpuIdle).collect();
            reasons.sort();
            reasons.dedup();
            m.gpus.push(GpuState {
                index,
                sm_mhz_mean: crate::util::stats::mean(&sm),
                sm_mhz_min: sm.iter().copied().reduce(f64::min),
                power_w_mean: crate::util::stats::mean(&pw),
                pstate_max: v.iter().filter_map(|s| s.pstate).max(),
                reasons,
            });
        }
        m.judge();
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_clocks_power_and_throttle_reasons_per_level() {
        // The scripted GPU (no NVIDIA GPU on these machines): full clocks, then a power cap.
        let dir = std::env::temp_dir().join(format!("probe-machine-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("gpu.json");
        std::fs::write(
            &script,
            r#"{"devices":[{"index":0,"name":"Fake H200","uuid":"GPU-0","driver":"fake","max_sm_mhz":1980,"max_mem_mhz":null,"power_limit_w":700.0,"vram_total":null}],"samples":[
                {"after_ms":0,"gpus":[{"index":0,"sm_mhz":1980,"power_w":300.0,"pstate":0,"reasons":["gpu_idle"]}]},
                {"after_ms":300,"gpus":[{"index":0,"sm_mhz":1200,"power_w":700.0,"pstate":2,"reasons":["sw_power_cap"]}]}]}"#,
        )
        .unwrap();
        let src = gpu::Fake::load(&script).unwrap();
        let w = Watch::with_gpu(None, Some(Box::new(src)));
        std::thread::sleep(Duration::from_millis(800));
        let m = w.stop();
        let _ = std::fs::remove_dir_all(&dir);
        let g = &m.gpus[0];
        assert_eq!((g.index, g.sm_mhz_min, g.pstate_max), (0, Some(1200.0), Some(2)), "{g:?}");
        let mean = g.sm_mhz_mean.unwrap();
        assert!(mean > 1200.0 && mean < 1980.0, "{g:?}");
        assert_eq!(g.reasons, [ClockReason::SwPowerCap], "idle is not a throttle reason: {g:?}");
        assert!(m.words().contains("GPU0") && m.words().contains("sw_power_cap"), "{}", m.words());
    }

    #[test]
    fn a_busy_process_beside_the_level_is_a_competitor() {
        let w = Watch::start(None, false);
        // A loop that is not this process's child (probe's own family is never a competitor):
        // its shell exits at once and leaves it to init.
        let o = std::process::Command::new("sh").arg("-c").arg("sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!").output().unwrap();
        let pid: u32 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(1200));
        let m = w.stop();
        // SAFETY: kill has no memory preconditions; pid is the loop started above.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        assert!(m.others_cores >= 0.5, "{m:?}");
        // Named, unless three busier processes (a build beside the test) took the places.
        let named = m.competitors.iter().any(|c| c.pid == pid);
        assert!(named || (m.competitors.len() == 3 && m.competitors.iter().all(|c| c.cores >= 0.3)), "{m:?}");
        assert!(m.contended() && (!named || m.why[0].contains(&format!("pid {pid}"))), "{m:?}");
        let quiet = Watch::start(None, false);
        std::thread::sleep(Duration::from_millis(300));
        let q = quiet.stop();
        assert!(!q.competitors.iter().any(|c| c.pid == pid));
        let avg = Machine::mean(&[&m, &q]).unwrap();
        assert!((avg.others_cores - (m.others_cores + q.others_cores) / 2.0).abs() < 1e-9);
        assert!(avg.contended() && avg.why[0].starts_with("1 of 2 runs: "), "{:?}", avg.why);
    }
}
