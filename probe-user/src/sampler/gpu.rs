//! GPU clocks, power state and memory, behind [`GpuSource`] so the collector does not care where
//! they come from: NVML (nvml-wrapper, `libnvidia-ml.so.1` loaded at run time) on a machine with
//! an NVIDIA driver, or a scripted fake for tests on machines without a GPU.
use serde::{Deserialize, Serialize};

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
    pub reasons: Vec<String>,
    /// GPU memory used by the traced processes on this device.
    pub target_vram: Option<u64>,
}

/// Where GPU readings come from.
pub trait GpuSource: Send {
    fn devices(&mut self) -> Vec<GpuDevice>;
    /// Read every device now; `pids` are the traced processes (for their GPU memory).
    fn sample(&mut self, pids: &[u32]) -> Vec<GpuSample>;
}

/// The GPU source for this machine: the scripted fake when `PROBE_FAKE_GPU` names a script (tests
/// only), else NVML. `Err` says why GPU clocks are not sampled (no driver: not an error).
pub fn open() -> Result<Box<dyn GpuSource>, String> {
    if let Some(path) = std::env::var_os("PROBE_FAKE_GPU") {
        return Fake::load(std::path::Path::new(&path)).map(|f| Box::new(f) as Box<dyn GpuSource>);
    }
    nvml::Nvml::open().map(|n| Box::new(n) as Box<dyn GpuSource>)
}

mod nvml {
    use nvml_wrapper::{
        Nvml as Lib,
        enum_wrappers::device::{Clock, PerformanceState},
        enums::device::UsedGpuMemory,
        error::NvmlError,
    };

    use super::{GpuDevice, GpuSample, GpuSource};

    pub struct Nvml {
        lib: Lib,
        count: u32,
    }

    impl Nvml {
        pub fn open() -> Result<Nvml, String> {
            let lib = Lib::init().map_err(|e| match e {
                NvmlError::LibloadingError(_) => "no NVIDIA GPU: GPU clocks not sampled (libnvidia-ml.so.1 not found)".to_string(),
                NvmlError::DriverNotLoaded => "no NVIDIA GPU: GPU clocks not sampled (driver not loaded)".to_string(),
                e => format!("no NVIDIA GPU: GPU clocks not sampled (NVML: {e})"),
            })?;
            let count = lib.device_count().map_err(|e| format!("NVML cannot count devices: {e}"))?;
            if count == 0 {
                return Err("no NVIDIA GPU: GPU clocks not sampled (NVML sees no device)".into());
            }
            Ok(Nvml { lib, count })
        }
    }

    fn pstate(p: PerformanceState) -> Option<u32> {
        use PerformanceState::*;
        Some(match p {
            Zero => 0,
            One => 1,
            Two => 2,
            Three => 3,
            Four => 4,
            Five => 5,
            Six => 6,
            Seven => 7,
            Eight => 8,
            Nine => 9,
            Ten => 10,
            Eleven => 11,
            Twelve => 12,
            Thirteen => 13,
            Fourteen => 14,
            Fifteen => 15,
            Unknown => return None,
        })
    }

    impl GpuSource for Nvml {
        fn devices(&mut self) -> Vec<GpuDevice> {
            let driver = self.lib.sys_driver_version().unwrap_or_default();
            (0..self.count)
                .filter_map(|i| {
                    let d = self.lib.device_by_index(i).ok()?;
                    Some(GpuDevice {
                        index: i,
                        name: d.name().unwrap_or_default(),
                        uuid: d.uuid().unwrap_or_default(),
                        driver: driver.clone(),
                        max_sm_mhz: d.max_clock_info(Clock::Graphics).ok(),
                        max_mem_mhz: d.max_clock_info(Clock::Memory).ok(),
                        power_limit_w: d.enforced_power_limit().ok().map(|mw| mw as f64 / 1e3),
                        vram_total: d.memory_info().ok().map(|m| m.total),
                    })
                })
                .collect()
        }

        fn sample(&mut self, pids: &[u32]) -> Vec<GpuSample> {
            (0..self.count)
                .filter_map(|i| {
                    let d = self.lib.device_by_index(i).ok()?;
                    let mem = d.memory_info().ok();
                    let util = d.utilization_rates().ok();
                    let procs = d
                        .running_compute_processes()
                        .unwrap_or_default()
                        .into_iter()
                        .chain(d.running_graphics_processes().unwrap_or_default());
                    let target: u64 = procs
                        .filter(|p| pids.contains(&p.pid))
                        .map(|p| match p.used_gpu_memory {
                            UsedGpuMemory::Used(b) => b,
                            UsedGpuMemory::Unavailable => 0,
                        })
                        .sum();
                    let reasons = d
                        .current_throttle_reasons()
                        .map(|r| r.iter_names().map(|(n, _)| n.to_ascii_lowercase()).collect())
                        .unwrap_or_default();
                    Some(GpuSample {
                        index: i,
                        sm_mhz: d.clock_info(Clock::Graphics).ok(),
                        mem_mhz: d.clock_info(Clock::Memory).ok(),
                        pstate: d.performance_state().ok().and_then(pstate),
                        power_w: d.power_usage().ok().map(|mw| mw as f64 / 1e3),
                        util_gpu: util.as_ref().map(|u| u.gpu),
                        util_mem: util.as_ref().map(|u| u.memory),
                        vram_used: mem.as_ref().map(|m| m.used),
                        vram_free: mem.as_ref().map(|m| m.free),
                        reasons,
                        target_vram: Some(target),
                    })
                })
                .collect()
        }
    }
}

/// A scripted GPU for tests on machines without one (these CI machines have no GPU). The script
/// (JSON) lists the devices and readings with the ms after the source was opened at which each
/// takes effect: `{"devices":[GpuDevice..], "samples":[{"after_ms":0,"gpus":[GpuSample..]},..]}`.
/// Selected only by the `PROBE_FAKE_GPU` environment variable.
pub struct Fake {
    devices: Vec<GpuDevice>,
    samples: Vec<(f64, Vec<GpuSample>)>,
    opened: std::time::Instant,
}

#[derive(Deserialize)]
struct Script {
    devices: Vec<GpuDevice>,
    samples: Vec<ScriptSample>,
}

#[derive(Deserialize)]
struct ScriptSample {
    after_ms: f64,
    gpus: Vec<GpuSample>,
}

impl Fake {
    pub fn load(path: &std::path::Path) -> Result<Fake, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("PROBE_FAKE_GPU={}: {e}", path.display()))?;
        let s: Script = serde_json::from_str(&text).map_err(|e| format!("PROBE_FAKE_GPU={}: not a GPU script: {e}", path.display()))?;
        let mut samples: Vec<(f64, Vec<GpuSample>)> = s.samples.into_iter().map(|x| (x.after_ms, x.gpus)).collect();
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Fake { devices: s.devices, samples, opened: std::time::Instant::now() })
    }
}

impl GpuSource for Fake {
    fn devices(&mut self) -> Vec<GpuDevice> {
        self.devices.clone()
    }
    fn sample(&mut self, _pids: &[u32]) -> Vec<GpuSample> {
        let now = self.opened.elapsed().as_secs_f64() * 1e3;
        self.samples.iter().rev().find(|(t, _)| *t <= now).map(|(_, g)| g.clone()).unwrap_or_default()
    }
}
