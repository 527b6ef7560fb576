//! Memory pressure as the target lives it: direct reclaim (global or its memory cgroup's limit)
//! and compaction in the target's threads, each sent once with its begin and end, and OOM kills
//! of a target process (sent from whichever task ran the OOM killer).
use crate::{EventHeader, EventKind, Record};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemEvent {
    pub hdr: EventHeader,
    /// [`MEM_DIRECT_RECLAIM`], [`MEM_MEMCG_RECLAIM`], [`MEM_COMPACTION`] or [`MEM_OOM_VICTIM`].
    pub what: u32,
    /// OOM: the victim's pid (also in `hdr.pid`); else 0.
    pub victim: u32,
    /// When the reclaim or compaction began (`hdr.ts_ns` is its end); OOM: the kill.
    pub begin_ns: u64,
    /// Reclaim: pages reclaimed. Compaction: its status. OOM: the victim's RSS in KiB.
    pub nr: u64,
}
const _: () = assert!(core::mem::size_of::<MemEvent>() == 48);
impl Record for MemEvent {
    const KIND: EventKind = EventKind::Mem;
}

pub const MEM_DIRECT_RECLAIM: u32 = 1;
pub const MEM_MEMCG_RECLAIM: u32 = 2;
pub const MEM_COMPACTION: u32 = 3;
pub const MEM_OOM_VICTIM: u32 = 4;

pub const fn mem_name(what: u32) -> &'static str {
    match what {
        MEM_DIRECT_RECLAIM => "direct_reclaim",
        MEM_MEMCG_RECLAIM => "memcg_reclaim",
        MEM_COMPACTION => "compaction",
        MEM_OOM_VICTIM => "oom_kill",
        _ => "unknown",
    }
}
