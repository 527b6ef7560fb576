//! GPU clocks, power state and memory, behind [`GpuSource`] so the collector does not care where
//! they come from: NVML (nvml-wrapper, `libnvidia-ml.so` loaded at run time, or the library
//! `PROBE_NVML_LIB` names) on a machine with an NVIDIA driver, or a scripted fake for tests on
//! machines without a GPU.
//!
//! A sleeping GPU stays asleep: an open NVML handle keeps a runtime-power-managed device out of D3,
//! so the sampler opens NVML only while the target is busy and closes it when it idles; meanwhile
//! the device's power state comes from sysfs files the kernel answers without resuming it
//! ([`pci_power`]: `power/runtime_status` and `power_state`, never the config-space attributes
//! such as `current_link_speed`, which resume a suspended device to answer).
use std::path::Path;

use serde::Deserialize;

use crate::record::samples::{GpuDevice, GpuSample, PciPower, PowerState, RuntimeStatus};

const PCI_DEVICES: &str = "/sys/bus/pci/devices";
/// Another sysfs PCI device directory to read (tests: these machines have no GPU).
const PCI_ROOT_ENV: &str = "PROBE_PCI_ROOT";
/// PCI vendor id of NVIDIA, and the display-controller class (VGA 0x0300, 3D 0x0302).
const NVIDIA: &str = "0x10de";
const DISPLAY_CLASS: &str = "0x03";

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// The sysfs directories of the NVIDIA display devices, found once (`vendor` and `class` are kept
/// by the kernel from enumeration); None when the PCI bus is not visible here (then whether there
/// is a GPU is NVML's to say).
pub fn nvidia_devices() -> Option<Vec<std::path::PathBuf>> {
    match std::env::var_os(PCI_ROOT_ENV) {
        Some(root) => nvidia_devices_in(Path::new(&root)),
        None => nvidia_devices_in(Path::new(PCI_DEVICES)),
    }
}

/// [`nvidia_devices`] under another root (tests).
pub fn nvidia_devices_in(root: &Path) -> Option<Vec<std::path::PathBuf>> {
    let mut out: Vec<std::path::PathBuf> = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|d| {
            read(&d.join("vendor")).is_some_and(|v| v == NVIDIA) && read(&d.join("class")).is_some_and(|c| c.starts_with(DISPLAY_CLASS))
        })
        .collect();
    out.sort();
    Some(out)
}

/// The power state of these devices now: `power/runtime_status`, `power_state` and
/// `power/control`, none of which resumes a device (a sample reads these three files a GPU).
pub fn pci_power(devices: &[std::path::PathBuf]) -> Vec<PciPower> {
    devices
        .iter()
        .map(|d| PciPower {
            addr: d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            runtime: read(&d.join("power/runtime_status")).map_or(RuntimeStatus::Unsupported, RuntimeStatus::from),
            state: read(&d.join("power_state")).map(PowerState::from),
            runtime_pm: read(&d.join("power/control")).is_some_and(|c| c == "auto"),
        })
        .collect()
}

/// Devices and states under `root` at once (tests).
#[cfg(test)]
fn pci_power_in(root: &Path) -> Option<Vec<PciPower>> {
    nvidia_devices_in(root).map(|d| pci_power(&d))
}

/// Where GPU readings come from.
pub trait GpuSource: Send {
    fn devices(&mut self) -> Vec<GpuDevice>;
    /// Read every device now; `pids` are the traced processes (for their GPU memory).
    fn sample(&mut self, pids: &[u32]) -> Vec<GpuSample>;
}

/// The GPU source for this machine: the scripted fake when `PROBE_FAKE_GPU` names a script (tests
/// only), else NVML. `Err` says why GPU clocks are not sampled (no driver: not an error).
/// Dropping the source closes NVML (nvmlShutdown): every handle goes with it.
pub fn open() -> Result<Box<dyn GpuSource>, String> {
    if let Some(path) = std::env::var_os("PROBE_FAKE_GPU") {
        return Fake::load(std::path::Path::new(&path)).map(|f| Box::new(f) as Box<dyn GpuSource>);
    }
    nvml::Nvml::open().map(|n| Box::new(n) as Box<dyn GpuSource>)
}

/// Whether NVML may stay open while the target idles: only where no device would sleep meanwhile
/// (every NVIDIA device found has runtime power management off), or for the scripted source. A
/// PCI bus that cannot be seen is taken as one whose GPUs may sleep.
pub fn keep_open_when_idle(pci: Option<&[PciPower]>) -> bool {
    match pci {
        Some(devs) if !devs.is_empty() => devs.iter().all(|d| !d.runtime_pm),
        _ => std::env::var_os("PROBE_FAKE_GPU").is_some(),
    }
}

/// Whether NVML is worth opening here: an NVIDIA display device on the PCI bus, or a library or
/// script named explicitly (`PROBE_NVML_LIB`, `PROBE_FAKE_GPU`), or a PCI bus this process cannot
/// see (a container with sysfs masked: NVML says). Err: why not, without loading NVML.
pub fn present(pci: Option<&[PciPower]>) -> Result<(), String> {
    if std::env::var_os("PROBE_FAKE_GPU").is_some() || std::env::var_os("PROBE_NVML_LIB").is_some() {
        return Ok(());
    }
    match pci {
        Some([]) => Err("no NVIDIA GPU: GPU clocks not sampled (no NVIDIA display device on the PCI bus)".into()),
        _ => Ok(()),
    }
}

mod nvml {
    use nvml_wrapper::{
        Nvml as Lib,
        enum_wrappers::device::{Clock, PerformanceState},
        enums::device::UsedGpuMemory,
        error::NvmlError,
    };

    use super::{GpuDevice, GpuSample, GpuSource};
    use crate::record::samples::ClockReason;

    pub struct Nvml {
        lib: Lib,
        count: u32,
    }

    impl Nvml {
        pub fn open() -> Result<Nvml, String> {
            // The library to load instead of the driver's (a driver installed elsewhere; the tests'
            // stand-in that logs every call): loaded through the same path as the real one.
            let path = std::env::var_os("PROBE_NVML_LIB");
            let lib = match &path {
                Some(p) => Lib::builder().lib_path(p).init(),
                None => Lib::init(),
            };
            let lib = lib.map_err(|e| match e {
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
                        .map(|r| r.iter_names().map(|(n, _)| ClockReason::from(n.to_ascii_lowercase())).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NVIDIA display devices only, with their runtime PM state; a missing `power_state` (kernels
    /// before 5.19) leaves the runtime status to say it.
    #[test]
    fn pci_power_states_come_from_sysfs() {
        let root = std::env::temp_dir().join(format!("probe-pci-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dev = |name: &str, files: &[(&str, &str)]| {
            let d = root.join(name);
            std::fs::create_dir_all(d.join("power")).unwrap();
            for (f, v) in files {
                std::fs::write(d.join(f), format!("{v}\n")).unwrap();
            }
        };
        dev(
            "0000:01:00.0",
            &[
                ("vendor", "0x10de"),
                ("class", "0x030000"),
                ("power_state", "D3cold"),
                ("power/runtime_status", "suspended"),
                ("power/control", "auto"),
            ],
        );
        dev("0000:02:00.0", &[("vendor", "0x10de"), ("class", "0x030200"), ("power/runtime_status", "active"), ("power/control", "on")]);
        // An NVIDIA audio function and another vendor's GPU are not GPUs probe reads.
        dev("0000:01:00.1", &[("vendor", "0x10de"), ("class", "0x040300"), ("power/runtime_status", "suspended")]);
        dev("0000:03:00.0", &[("vendor", "0x1002"), ("class", "0x030000"), ("power/runtime_status", "active")]);
        let got = pci_power_in(&root).unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].asleep() && got[0].runtime_pm && got[0].said() == "D3cold", "{:?}", got[0]);
        assert!(!got[1].asleep() && !got[1].runtime_pm && got[1].said() == "active", "{:?}", got[1]);
        // NVML stays open at idle only where no device would sleep.
        assert!(!keep_open_when_idle(Some(&got)));
        assert!(keep_open_when_idle(Some(&got[1..])));
        assert!(present(Some(&[])).is_err() || std::env::var_os("PROBE_NVML_LIB").is_some());
        assert!(pci_power_in(&root.join("none")).is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
