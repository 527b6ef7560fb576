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
    println!("BTF           {}", if btf { "present (/sys/kernel/btf/vmlinux)" } else { "absent: tp_btf programs and later stack features need it" });
    let kprobes = Path::new("/sys/kernel/tracing/kprobe_events").exists();
    println!("kprobes       {}", if kprobes { "present (probe does not need them)" } else { "absent (probe does not need them)" });
    let opts = probes::Options { pid: std::process::id(), only: None, ring_bytes: 1 << 20, sample_hz: 99 };
    match probes::attach(&opts) {
        Ok(a) => {
            println!("BPF object    loaded (ring buffer, hash and per-CPU maps work)");
            for s in &a.status {
                if s.live && s.skipped.is_empty() {
                    println!("probe {:<8} live ({} programs)", s.name, s.attached.len());
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
    code
}
