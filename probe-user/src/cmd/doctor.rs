//! `probe doctor`: a checklist of what this kernel and these privileges let probe do. Each
//! capability and kernel feature is a row, ok or missing, with what it enables. As root (or with
//! CAP_BPF and CAP_PERFMON) every probe is really loaded and attached to probe's own process,
//! then handed off to be detached after probe exits (closing 60 tracepoints waits for the
//! kernel: seconds that nobody should wait for).
use std::path::Path;

use crate::{exit, kernel::probes, os::tracefs};

/// The capabilities probe uses without full root: (name, number, what it enables). The README's
/// Security section lists the same (a test checks), and its `setcap` line gives the first six.
pub const CAPABILITIES: [(&str, u32, &str); 7] = [
    ("CAP_BPF", 39, "load the kernel programs and their maps"),
    ("CAP_PERFMON", 38, "attach them to tracepoints, and sample stacks with perf events"),
    ("CAP_DAC_READ_SEARCH", 2, "read tracefs and the model files the server mapped"),
    ("CAP_SYS_PTRACE", 19, "read another user's /proc/PID (maps, io, status, its threads)"),
    ("CAP_SYSLOG", 34, "name kernel addresses in stacks (/proc/kallsyms)"),
    ("CAP_CHECKPOINT_RESTORE", 40, "open the exact files the server mapped (/proc/PID/map_files)"),
    ("CAP_SYS_ADMIN", 21, "mount tracefs when it is not mounted (only then)"),
];

/// A row: its name padded, then what was found.
fn row(name: &str, what: impl std::fmt::Display) {
    println!("{name:<24}{what}");
}

pub fn run() -> i32 {
    let mut code = exit::OK;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    row("kernel", release.trim());
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let caps = probes::effective_caps();
    for (name, bit, what) in CAPABILITIES {
        let ok = root || caps & (1u64 << bit) != 0;
        row(name, format!("{}: {what}", if ok { "ok" } else { "missing" }));
    }
    let tracing = probes::check_privileges().is_ok();
    let tracefs_ok = if tracing {
        match tracefs::ensure_mounted() {
            Ok(p) => {
                row("tracefs", format!("ok: {}", p.display()));
                true
            }
            Err(e) => {
                row("tracefs", format!("missing: {e}"));
                false
            }
        }
    } else {
        let mounted = ["/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"].iter().any(|p| Path::new(p).exists());
        row(
            "tracefs",
            if mounted {
                "mounted (its files need privileges to read)"
            } else {
                "not readable as this user (probe mounts it if it must, as root)"
            },
        );
        false
    };
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    row("BTF", if btf { "ok: /sys/kernel/btf/vmlinux (struct offsets for raw tracepoints)" } else { "missing: classic tracepoints only" });
    let kprobes = Path::new("/sys/kernel/tracing/kprobe_events").exists();
    row("kprobes", if kprobes { "present (probe does not need them)" } else { "absent (probe does not need them)" });
    if !tracing {
        row("probes", "not tried: loading them needs root, or CAP_BPF and CAP_PERFMON (run `sudo probe doctor`)");
        code = exit::ERROR;
    } else if tracefs_ok {
        let opts = probes::Options {
            pid: std::process::id(),
            only: None,
            ring_bytes: 1 << 20,
            sample_hz: 99,
            offcpu_d_only: false,
            stack_limit: 0,
            more: Vec::new(),
            // A check of its own: the kept set stays as the traces left it.
            keep: crate::kernel::kept::Keep::Leave,
        };
        match probes::attach(&opts) {
            Ok(a) => {
                row("BPF object", "ok: loaded (ring buffer, hash and per-CPU maps work)");
                for s in &a.status {
                    let name = format!("probe {}", s.name);
                    if s.live && s.skipped.is_empty() {
                        row(&name, format!("ok: live ({})", crate::util::text::count(s.attached.len() as u64, "program")));
                    } else if s.live {
                        row(&name, format!("ok: live, without: {}", s.skipped.join("; ")));
                    } else if s.name == probes::Subsystem::Engine {
                        // Checked on probe itself, which embeds no llama.cpp.
                        row(&name, "ok: attaches where a target embeds llama.cpp (none in probe itself)".to_string());
                    } else {
                        code = exit::PARTIAL;
                        row(&name, format!("missing: {}", s.skipped.join("; ")));
                    }
                }
                probes::hand_off(a);
                row("kept programs", crate::kernel::kept::describe());
            }
            Err(e) => {
                row("BPF object", format!("missing: {e:#}"));
                code = exit::ERROR;
            }
        }
    } else {
        code = exit::ERROR;
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
                row(
                    &format!("GPU {}", d.index),
                    format!("ok: {} (driver {}), max SM {} MHz", d.name, d.driver, d.max_sm_mhz.map_or("?".into(), |m| m.to_string())),
                );
            }
        }
        Err(why) => row("GPU", format!("missing: {why}")),
    }
    match host::cpufreq() {
        Some(f) => row("cpufreq", format!("ok: {} CPUs, max {} MHz", f.cur_khz.len(), f.max_khz.iter().max().copied().unwrap_or(0) / 1000)),
        None => row("cpufreq", "missing: CPU clocks not sampled (common in VMs)"),
    }
    match host::cpuidle() {
        Some(c) => row("cpuidle", format!("ok: {} states: {}", c.names.len(), c.names.join(", "))),
        None => row("cpuidle", "missing: idle-state residency not sampled"),
    }
    let psi = Path::new("/proc/pressure/memory").exists();
    row("PSI", if psi { "ok: memory and io stall time" } else { "missing: boot with psi=1 for memory-pressure stall time" });
    let me = std::process::id();
    match host::memory_cgroup(me) {
        Some(d) => row("memory cgroup", format!("ok: {} (probe's own; the target's is read at trace time)", d.display())),
        None => row("memory cgroup", "missing: no memory cgroup found"),
    }
    let exe = std::fs::File::open("/proc/self/exe");
    match exe.ok().and_then(|f| residency::measure(&f, "/proc/self/exe")) {
        Some(r) if r.evicted.is_some() => row("page cache", "ok: cachestat(2) (residency and evictions)"),
        Some(_) => row("page cache", "ok: mincore(2) (residency; this kernel has no cachestat)"),
        None => row("page cache", "missing: cannot measure residency here"),
    }
}

#[cfg(test)]
mod tests {
    /// The README's capability list (Security, "Without full root") and its setcap line are
    /// doctor's list.
    #[test]
    fn the_readme_lists_the_capabilities_doctor_checks() {
        let readme = include_str!("../../../README.md");
        let section = &readme[readme.find("**Without full root.**").expect("the README's Security section")..];
        let section =
            &section[..section.find("```\n").and_then(|a| section[a + 4..].find("```").map(|b| a + 4 + b)).unwrap_or(section.len())];
        let listed: std::collections::BTreeSet<&str> =
            section.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("CAP_")).collect();
        let ours: std::collections::BTreeSet<&str> = super::CAPABILITIES.iter().map(|c| c.0).collect();
        assert_eq!(listed, ours, "README capabilities vs doctor's");
        let setcap = section.lines().find(|l| l.contains("setcap")).expect("a setcap line");
        for (name, _, _) in &super::CAPABILITIES[..6] {
            assert!(setcap.contains(&name.to_lowercase()), "setcap does not give {name}: {setcap}");
        }
    }
}
