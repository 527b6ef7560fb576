//! probe's kernel programs. Every program filters to the target set (`TARGETS`, kept up to date
//! by `proc`), sends fixed-size records through one ring buffer, and counts what it could not send.
#![no_std]
#![no_main]

mod blockio;
mod engine;
mod fault;
mod filemap;
mod mem;
mod mmap;
mod proc;
mod python;
mod sock;
mod stack;
mod stream;
mod task;

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use probe_common::{Counter, EventHeader, MAX_KINDS, MAX_TARGETS, Record};

#[map(name = "EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(probe_common::DEFAULT_RING_BYTES, 0);

#[map(name = "TARGETS")]
static TARGETS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_TARGETS, 0);

#[map(name = "LOST")]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_KINDS, 0);

#[map(name = "COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_KINDS, 0);

// Flags of bpf_ringbuf_submit / bpf_ringbuf_query (include/uapi/linux/bpf.h).
const BPF_RB_NO_WAKEUP: u64 = 1;
pub(crate) const BPF_RB_FORCE_WAKEUP: u64 = 2;
pub(crate) const BPF_RB_AVAIL_DATA: u64 = 0;
pub(crate) const BPF_RB_RING_SIZE: u64 = 1;

/// The current task as (tgid, tid) when its process is being traced.
#[inline(always)]
pub(crate) fn current_target() -> Option<(u32, u32)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is a u8 copied out immediately; no reference outlives the lookup.
    if unsafe { TARGETS.get(&tgid) }.is_some() { Some((tgid, pid_tgid as u32)) } else { None }
}

#[inline(always)]
fn now_ns() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn cpu() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_smp_processor_id() }
}

#[inline(always)]
fn header<T: Record>(pid: u32, tid: u32) -> EventHeader {
    EventHeader { kind: T::KIND as u32, pid, tid, cpu: cpu(), ts_ns: now_ns() }
}

#[inline(always)]
fn add(map: &PerCpuArray<u64>, index: u32, n: u64) {
    if let Some(p) = map.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, only this CPU writes it while the program runs (no preemption).
        unsafe { *p += n };
    }
}

#[inline(always)]
fn count(c: Counter) {
    add(&COUNTERS, c as u32, 1);
}

/// Send one record. A full ring buffer is counted per kind, never silent. The consumer is woken
/// only when the backlog first crosses `WAKEUP_BACKLOG_BYTES`; a 20 ms timer drains the rest.
#[inline(always)]
fn emit<T: Record + 'static>(ev: &T) {
    match EVENTS.reserve::<T>(0) {
        Some(mut slot) => {
            slot.write(*ev);
            slot.submit(ringbuf_flags(core::mem::size_of::<T>() as u64));
        }
        None => add(&LOST, T::KIND as u32, 1),
    }
}

/// One forced wakeup of the drain per `1 << WAKEUP_SHIFT` bytes of backlog
/// (`probe_common::wakeup_shift`: a sixteenth of the ring, 64 KiB to 1 MiB). Set by userspace
/// before load; 256 KiB if it is not.
#[unsafe(no_mangle)]
static WAKEUP_SHIFT: u32 = 18;

/// Submit flags for a record of `size` bytes: wake the consumer only when this record makes the
/// backlog cross a multiple of `1 << WAKEUP_SHIFT` (a crossing missed in a race between CPUs is
/// caught at the next one, not left to the timer).
#[inline(always)]
fn ringbuf_flags(size: u64) -> u64 {
    // SAFETY: a read of a global the loader set; volatile so the compiler keeps the load.
    let shift = unsafe { core::ptr::read_volatile(&raw const WAKEUP_SHIFT) } & 31;
    let before = EVENTS.query(BPF_RB_AVAIL_DATA);
    if before >> shift != (before + size + 8) >> shift { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP }
}

/// Read a tracepoint field; a failed read is counted and turned into `Err`.
#[inline(always)]
fn field<T>(ctx: &TracePointContext, offset: usize) -> Result<T, i64> {
    // SAFETY: `offset` comes from probe_common::tracepoints, checked by userspace against the
    // running kernel's format file before this program was attached; the read is a probe read.
    match unsafe { ctx.read_at::<T>(offset) } {
        Ok(v) => Ok(v),
        Err(e) => {
            count(Counter::ReadErrors);
            Err(e as i64)
        }
    }
}

/// Insert into a hash map, counting a full map.
#[inline(always)]
fn insert<K, V>(map: &HashMap<K, V>, k: &K, v: &V) {
    if map.insert(k, v, 0).is_err() {
        count(Counter::MapFull);
    }
}

/// Insert into an LRU hash map: a full map forgets its least recently used entry (entries that
/// wait for an event that may never come: a syscall's exit in a killed thread, a lost block
/// completion); a failed insert is counted.
#[inline(always)]
fn insert_lru<K, V>(map: &LruHashMap<K, V>, k: &K, v: &V) {
    if map.insert(k, v, 0).is_err() {
        count(Counter::MapFull);
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
