//! Host readings from /proc and /sys: CPU frequency (cpufreq), memory pressure (PSI, vmstat
//! reclaim/compaction/swap/OOM counters), the target's RSS and its memory cgroup. Each reader
//! returns `None` where the kernel does not offer it, so a VM without cpufreq just has no CPU
//! clock track.
use serde::{Deserialize, Serialize};

/// Current and highest frequency of every CPU with cpufreq, kHz.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CpuFreq {
    pub cur_khz: Vec<u64>,
    pub max_khz: Vec<u64>,
}

pub fn cpufreq() -> Option<CpuFreq> {
    let mut f = CpuFreq::default();
    for cpu in 0.. {
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}");
        if !std::path::Path::new(&dir).exists() {
            break;
        }
        let read = |name: &str| read_kept(&format!("{dir}/cpufreq/{name}")).and_then(|s| s.trim().parse::<u64>().ok());
        let (Some(cur), Some(max)) = (read("scaling_cur_freq"), read("cpuinfo_max_freq")) else { continue };
        f.cur_khz.push(cur);
        f.max_khz.push(max);
    }
    (!f.cur_khz.is_empty()).then_some(f)
}

pub fn cpuidle() -> Option<CpuIdle> {
    // The CPUs' idle states (their names and exit latencies) are found once; each reading adds up
    // their time and usage only (every 2 s while the target idles: the rest was half its reads).
    thread_local! {
        static LAYOUT: std::cell::OnceCell<(CpuIdle, Vec<(usize, String)>)> = const { std::cell::OnceCell::new() };
    }
    LAYOUT.with(|layout| {
        let (base, states) = layout.get_or_init(cpuidle_layout);
        let mut c = base.clone();
        for (st, dir) in states {
            let num = |f: &str| read_kept(&format!("{dir}/{f}")).and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
            c.time_us[*st] += num("time");
            c.usage[*st] += num("usage");
        }
        (c.cpus > 0).then_some(c)
    })
}

/// The CPUs' idle states: their names and exit latencies (from the first CPU that has each), the
/// times and usages zero, and every (state, directory) to read them from.
fn cpuidle_layout() -> (CpuIdle, Vec<(usize, String)>) {
    let mut c = CpuIdle::default();
    let mut states = Vec::new();
    for cpu in 0.. {
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}");
        if !std::path::Path::new(&dir).exists() {
            break;
        }
        let mut any = false;
        for st in 0.. {
            let sd = format!("{dir}/cpuidle/state{st}");
            let Ok(name) = std::fs::read_to_string(format!("{sd}/name")) else { break };
            if c.names.len() <= st {
                c.names.push(name.trim().to_string());
                c.latency_us.push(std::fs::read_to_string(format!("{sd}/latency")).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0));
                c.time_us.push(0);
                c.usage.push(0);
            }
            states.push((st, sd));
            any = true;
        }
        c.cpus += u32::from(any);
    }
    (c, states)
}

/// /proc/stat's steal over every CPU, ms since boot.
pub fn steal_ms() -> Option<u64> {
    let t = read_kept("/proc/stat")?;
    parse_steal_ms(&t, clock_ticks())
}

fn parse_steal_ms(stat: &str, hz: u64) -> Option<u64> {
    let l = stat.lines().find(|l| l.starts_with("cpu "))?;
    let steal: u64 = l.split_whitespace().nth(8)?.parse().ok()?;
    Some(steal * 1000 / hz.max(1))
}

use crate::{
    os::procfs::clock_ticks,
    record::samples::{CpuIdle, Mem},
};

pub(crate) fn psi_total(text: &str, kind: &str) -> Option<u64> {
    text.lines().find(|l| l.starts_with(kind))?.split_whitespace().find_map(|w| w.strip_prefix("total="))?.parse().ok()
}

fn vmstat(text: &str, m: &mut Mem) {
    for l in text.lines() {
        let mut it = l.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next().and_then(|v| v.parse::<u64>().ok())) else { continue };
        match k {
            "pgscan_direct" => m.pgscan_direct = v,
            "compact_stall" => m.compact_stall = v,
            "pswpin" => m.pswpin = v,
            "pgmajfault" => m.pgmajfault = v,
            "oom_kill" => m.oom_kill = v,
            k if k.starts_with("allocstall_") => m.allocstall += v,
            _ => {}
        }
    }
}

fn status_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(key))?.split_whitespace().next()?.parse().ok()
}

/// The memory cgroup directory of `pid` (v1 `memory` controller, else the v2 unified one).
pub fn memory_cgroup(pid: u32) -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for l in text.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
        if ctrl.split(',').any(|c| c == "memory") {
            return Some(std::path::PathBuf::from(format!("/sys/fs/cgroup/memory{path}")));
        }
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    for root in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        let dir = std::path::PathBuf::from(format!("{root}{path}"));
        if dir.join("memory.current").exists() {
            return Some(dir);
        }
    }
    None
}

/// The swap areas in use (/proc/swaps: the file or device of each).
pub fn swaps() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    text.lines().skip(1).filter_map(|l| l.split_whitespace().next().map(str::to_string)).collect()
}

/// The CPU cgroup directory of `pid` (v1 `cpu` controller, else the v2 unified one with cpu.max).
pub fn cpu_cgroup(pid: u32) -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for l in text.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
        if ctrl.split(',').any(|c| c == "cpu") {
            // Mounted as "cpu" or "cpu,cpuacct" (a link named cpu points at the latter).
            return ["cpu", "cpu,cpuacct"]
                .iter()
                .map(|m| std::path::PathBuf::from(format!("/sys/fs/cgroup/{m}{path}")))
                .find(|d| d.join("cpu.cfs_quota_us").exists());
        }
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(|root| std::path::PathBuf::from(format!("{root}{path}")))
        .find(|d| d.join("cpu.stat").exists())
}

/// CFS bandwidth of a CPU cgroup into `m`: v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` and
/// cpu.stat `throttled_time` (ns); v2 `cpu.max` ("max 100000" or "50000 100000") and cpu.stat
/// `throttled_usec`.
fn cpu_bandwidth(dir: &std::path::Path, m: &mut Mem) {
    let read = |name: &str| read_kept(&dir.join(name).to_string_lossy());
    m.cpu_cgroup = Some(dir.display().to_string());
    let stat = read("cpu.stat").unwrap_or_default();
    let field = |k: &str| stat.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.trim().parse::<u64>().ok());
    m.nr_throttled = field("nr_throttled");
    if let Some(q) = read("cpu.cfs_quota_us") {
        m.cpu_quota_us = q.trim().parse::<i64>().ok().and_then(|q| u64::try_from(q).ok());
        m.cpu_period_us = read("cpu.cfs_period_us").and_then(|p| p.trim().parse().ok());
        m.throttled_ns = field("throttled_time");
    } else {
        if let Some(max) = read("cpu.max") {
            let mut it = max.split_whitespace();
            m.cpu_quota_us = it.next().and_then(|q| q.parse().ok());
            m.cpu_period_us = it.next().and_then(|p| p.parse().ok());
        }
        m.throttled_ns = field("throttled_usec").map(|us| us * 1000);
    }
}

/// Most files [`read_kept`] keeps open (a machine with more C-state files than this reopens them
/// each time, as it would without keeping them).
const KEPT_FILES: usize = 256;

/// The text of a /proc or /sys file the sampler reads many times a second, from a descriptor kept
/// open and read again from offset 0: the open and its path walk cost more than the read. A
/// file that stops answering (a process that exited: ESRCH) is opened afresh once.
fn read_kept(path: &str) -> Option<String> {
    use std::{cell::RefCell, collections::HashMap, fs::File, os::unix::fs::FileExt as _};
    thread_local! {
        static KEPT: RefCell<HashMap<String, File>> = RefCell::new(HashMap::new());
    }
    KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        for _ in 0..2 {
            if !kept.contains_key(path) {
                if kept.len() >= KEPT_FILES {
                    kept.clear();
                }
                kept.insert(path.to_string(), File::open(path).ok()?);
            }
            let f = kept.get(path)?;
            let (mut out, mut buf) = (Vec::new(), [0u8; 8192]);
            // A sysfs attribute is made whole at the read from offset 0, at most a page: one read
            // that returns less than a page has it all (no second read to find the end).
            let one_read = path.starts_with("/sys/");
            let whole = loop {
                match f.read_at(&mut buf, out.len() as u64) {
                    Ok(0) => break true,
                    Ok(n) => {
                        out.extend_from_slice(&buf[..n]);
                        if one_read && n < 4096 {
                            break true;
                        }
                    }
                    Err(_) => break false,
                }
            };
            if whole {
                return Some(String::from_utf8_lossy(&out).into_owned());
            }
            kept.remove(path);
        }
        None
    })
}

/// The memory (and CPU bandwidth) readings of `pid` and its cgroups.
pub fn mem(pid: u32, cgroup: Option<&std::path::Path>, cpu: Option<&std::path::Path>) -> Mem {
    let mut m = Mem::default();
    if let Some(t) = read_kept("/proc/pressure/memory") {
        m.psi_some_us = psi_total(&t, "some");
        m.psi_full_us = psi_total(&t, "full");
    }
    if let Some(t) = read_kept("/proc/pressure/io") {
        m.psi_io_some_us = psi_total(&t, "some");
    }
    if let Some(t) = read_kept("/proc/vmstat") {
        vmstat(&t, &mut m);
    }
    if let Some(t) = read_kept("/proc/meminfo") {
        m.mem_available_kib = status_kib(&t, "MemAvailable:");
    }
    if let Some(t) = read_kept(&format!("/proc/{pid}/status")) {
        m.rss_kib = status_kib(&t, "VmRSS:");
        m.rss_file_kib = status_kib(&t, "RssFile:");
        m.rss_anon_kib = status_kib(&t, "RssAnon:");
        m.swap_kib = status_kib(&t, "VmSwap:");
    }
    if let Some(dir) = cpu {
        cpu_bandwidth(dir, &mut m);
    }
    if let Some(dir) = cgroup {
        let num = |name: &str| read_kept(&dir.join(name).to_string_lossy()).and_then(|s| s.trim().parse::<u64>().ok());
        m.cgroup = Some(dir.display().to_string());
        if dir.join("memory.limit_in_bytes").exists() {
            m.cgroup_usage = num("memory.usage_in_bytes");
            m.cgroup_limit = num("memory.limit_in_bytes").filter(|&l| l < (1 << 62));
            m.cgroup_limit_hits = num("memory.failcnt");
        } else {
            m.cgroup_usage = num("memory.current");
            m.cgroup_limit = num("memory.max");
            m.cgroup_limit_hits = read_kept(&dir.join("memory.events").to_string_lossy()).and_then(|t| status_kib(&t, "max "));
        }
    }
    m
}

/// The machine at attach, for the recording's meta: /proc/cpuinfo's model name, the CPUs this
/// process may run on, /proc/meminfo's MemTotal and /proc/driver/nvidia/version's first line.
pub fn machine() -> crate::record::records::Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    crate::record::records::Machine {
        cpu_model: read("/proc/cpuinfo")
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
            .unwrap_or_default(),
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get() as u32),
        mem_total_kib: read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0),
        nvidia_driver: std::fs::read_to_string("/proc/driver/nvidia/version").ok().and_then(|v| v.lines().next().map(str::to_string)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn steal_is_the_cpu_line_s_eighth_time() {
        let stat = "cpu  100 0 50 9000 10 0 5 250 0 0\ncpu0 50 0 25 4500 5 0 2 125 0 0\n";
        assert_eq!(super::parse_steal_ms(stat, 100), Some(2500));
        assert_eq!(super::parse_steal_ms("cpu0 1 2 3\n", 100), None);
        assert!(super::steal_ms().is_some(), "this kernel's /proc/stat has a steal column");
    }

    use super::*;

    #[test]
    fn reads_psi_and_vmstat() {
        let psi = "some avg10=0.00 avg60=0.00 avg300=0.00 total=1234\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=56\n";
        assert_eq!(psi_total(psi, "some"), Some(1234));
        assert_eq!(psi_total(psi, "full"), Some(56));
        let mut m = Mem::default();
        vmstat("pgscan_direct 10\nallocstall_normal 2\nallocstall_movable 3\noom_kill 1\npswpin 0\n", &mut m);
        assert_eq!((m.pgscan_direct, m.allocstall, m.oom_kill), (10, 5, 1));
        assert_eq!(status_kib("Name:\tx\nVmRSS:\t  1024 kB\n", "VmRSS:"), Some(1024));
    }

    /// A kept-open /proc file reads the current text every time, and a process's status file
    /// stops answering once it exited (its kept descriptor is dropped, not read stale).
    #[test]
    fn kept_files_read_fresh_and_let_go_of_exited_processes() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let path = format!("/proc/{}/status", child.id());
        assert!(read_kept(&path).unwrap().contains("State:"));
        let a = read_kept("/proc/uptime").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = read_kept("/proc/uptime").unwrap();
        assert_ne!(a, b, "the second read gave the first text again");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(read_kept(&path), None, "an exited process's status still read");
    }

    #[test]
    fn idle_states_sum_over_cpus() {
        // Most of these machines have cpuidle (haltpoll); its totals only grow. Where the kernel
        // runs no idle driver (`current_driver` reads `none`), there are no states to read.
        let driver = std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver").unwrap_or_default();
        if driver.trim() == "none" {
            assert!(cpuidle().is_none(), "idle states read where the kernel has no cpuidle driver");
            return;
        }
        let a = cpuidle().expect("no cpuidle in /sys/devices/system/cpu/cpu*/cpuidle");
        std::thread::sleep(std::time::Duration::from_millis(50));
        let b = cpuidle().unwrap();
        assert_eq!(a.names, b.names);
        assert!(a.cpus > 0 && !a.names.is_empty());
        assert!(a.time_us.iter().zip(&b.time_us).all(|(x, y)| y >= x), "{a:?} {b:?}");
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let m = mem(me, memory_cgroup(me).as_deref(), cpu_cgroup(me).as_deref());
        assert!(m.rss_kib.unwrap_or(0) > 0 && m.swap_kib.is_some(), "{m:?}");
        // Every kernel with CFS bandwidth control has a cpu.stat with nr_throttled (0 at the root).
        assert!(m.cpu_cgroup.is_some() && m.nr_throttled.is_some() && m.throttled_ns.is_some(), "{m:?}");
    }
}
