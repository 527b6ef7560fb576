//! A per-CPU array's value summed over the CPUs, read with one system call and no allocation of
//! aya's (whose read also reads the CPUs' count from sysfs each time): for the watchdog's looks,
//! several a second.
use std::os::fd::{AsRawFd, OwnedFd};

use super::kept::{bpf, possible_cpus};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;

/// `union bpf_attr` for BPF_MAP_LOOKUP_ELEM.
#[repr(C, align(8))]
struct LookupAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Slot 0 of a `PerCpuArray<i64>`, summed.
pub struct PerCpuSum {
    fd: OwnedFd,
    cpus: usize,
}

impl PerCpuSum {
    /// The map `fd` refers to (its own descriptor: it lives as long as this does).
    pub fn new(fd: OwnedFd) -> PerCpuSum {
        PerCpuSum { fd, cpus: possible_cpus() }
    }

    /// The sum over the possible CPUs (None when the read failed).
    pub fn sum(&self) -> Option<i64> {
        let key = 0u32;
        let mut values = vec![0i64; self.cpus];
        let mut a = LookupAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            _pad: 0,
            key: (&raw const key) as u64,
            value: values.as_mut_ptr() as u64,
            flags: 0,
        };
        bpf(BPF_MAP_LOOKUP_ELEM, &mut a).ok()?;
        Some(values.iter().fold(0i64, |s, v| s.wrapping_add(*v)))
    }
}
