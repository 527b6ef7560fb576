//! `probe doctor`: what this kernel and these privileges let probe do, found by really loading
//! and attaching every probe to probe's own process (then detaching).
use std::path::Path;

use crate::{exit, probes, tracefs};

pub fn run() -> i32 {
    let mut code = exit::OK;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("kernel        {}", release.trim());
    match probes::check_privileges() {
        Ok(()) => println!("privileges    ok (root or CAP_BPF+CAP_PERFMON)"),
        Err(e) => {
            println!("privileges    MISSING: {e}");
            return exit::ERROR;
        }
    }
    match tracefs::ensure_mounted() {
        Ok(p) => println!("tracefs       {}", p.display()),
        Err(e) => {
            println!("tracefs       MISSING: {e}");
            return exit::ERROR;
        }
    }
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    println!(
        "BTF           {}",
        if btf { "present (/sys/kernel/btf/vmlinux)" } else { "absent: tp_btf programs and later stack features need it" }
    );
    let kprobes = Path::new("/sys/kernel/tracing/kprobe_events").exists();
    println!("kprobes       {}", if kprobes { "present (probe does not need them)" } else { "absent (probe does not need them)" });
    let opts =
        probes::Options { pid: std::process::id(), only: None, ring_bytes: 1 << 20, sample_hz: 99, offcpu_d_only: false, more: Vec::new() };
    match probes::attach(&opts) {
        Ok(a) => {
            println!("BPF object    loaded (ring buffer, hash and per-CPU maps work)");
            for s in &a.status {
                if s.live && s.skipped.is_empty() {
                    println!("probe {:<8} live ({})", s.name, crate::text::count(s.attached.len() as u64, "program"));
                } else if s.live {
                    println!("probe {:<8} live, without: {}", s.name, s.skipped.join("; "));
                } else {
                    code = exit::PARTIAL;
                    println!("probe {:<8} UNAVAILABLE: {}", s.name, s.skipped.join("; "));
                }
            }
        }
        Err(e) => {
            println!("BPF object    FAILED: {e:#}");
            return exit::ERROR;
        }
    }
    samplers();
    code
}

/// What the samplers beside the kernel probes will find here (none of it is required).
fn samplers() {
    use crate::sampler::{gpu, host, residency};
    match gpu::open() {
        Ok(mut g) => {
            for d in g.devices() {
                println!(
                    "GPU {}         {} (driver {}), max SM {} MHz",
                    d.index,
                    d.name,
                    d.driver,
                    d.max_sm_mhz.map_or("?".into(), |m| m.to_string())
                );
            }
        }
        Err(why) => println!("GPU           {why}"),
    }
    match host::cpufreq() {
        Some(f) => println!("cpufreq       {} CPUs, max {} MHz", f.cur_khz.len(), f.max_khz.iter().max().copied().unwrap_or(0) / 1000),
        None => println!("cpufreq       absent: CPU clocks not sampled (common in VMs)"),
    }
    match host::cpuidle() {
        Some(c) => println!("cpuidle       {} states: {}", c.names.len(), c.names.join(", ")),
        None => println!("cpuidle       absent"),
    }
    let psi = Path::new("/proc/pressure/memory").exists();
    println!(
        "PSI           {}",
        if psi { "present (memory and io stall time)" } else { "absent: boot with psi=1 for memory-pressure stall time" }
    );
    let me = std::process::id();
    match host::memory_cgroup(me) {
        Some(d) => println!("memory cgroup {} (probe's own; the target's is read at trace time)", d.display()),
        None => println!("memory cgroup none found"),
    }
    let exe = std::fs::File::open("/proc/self/exe");
    match exe.ok().and_then(|f| residency::measure(&f, "/proc/self/exe")) {
        Some(r) if r.evicted.is_some() => println!("page cache    cachestat(2) (residency and evictions)"),
        Some(_) => println!("page cache    mincore(2) (residency; this kernel has no cachestat)"),
        None => println!("page cache    cannot measure residency here"),
    }
}
