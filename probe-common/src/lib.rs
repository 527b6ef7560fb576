//! The ABI between probe's kernel programs and userspace: `#[repr(C)]` event records, event kinds,
//! map names and limits. Every record starts with [`EventHeader`]. Nothing here allocates.
#![no_std]

pub mod blockio;
pub mod engine;
pub mod fault;
pub mod filemap;
pub mod kernel;
pub mod mem;
pub mod mmap;
pub mod proc;
pub mod python;
pub mod sock;
pub mod stack;
pub mod stream;
pub mod tracepoints;

use core::mem::size_of;

/// Names of the maps the kernel programs define and userspace opens.
pub mod maps {
    /// `RingBuf`: every event record.
    pub const EVENTS: &str = "EVENTS";
    /// `HashMap<u32 tgid, u8>`: the processes being traced (the target and its descendants).
    pub const TARGETS: &str = "TARGETS";
    /// `LruHashMap<u32 tid, u32 bytes>`: how much user stack to copy for a thread (written by the collector).
    pub const USTACK_NEED: &str = "USTACK_NEED";
    /// `LruHashMap<u32 tgid, [u8; 16] comm>`: the processes charged with a target thread's wait
    /// for a CPU, named by the kernel as they ran (one that exits before probe reads its record
    /// keeps its name).
    pub const OTHER_COMMS: &str = "OTHER_COMMS";
    /// `PerCpuArray<u64>` indexed by [`crate::EventKind`]: ring buffer reserve failures.
    pub const LOST: &str = "LOST";
    /// `PerCpuArray<u64>` indexed by [`crate::Counter`]: in-kernel counters (not events).
    pub const COUNTERS: &str = "COUNTERS";
    /// `HashMap<u16 port, u8>`: TCP ports the target listens on (accepted sockets are the target's).
    pub const LISTEN_PORTS: &str = "LISTEN_PORTS";
    pub const LISTEN_ADDRS: &str = "LISTEN_ADDRS";
    /// `HashMap<u64 struct sock *, u8>`: TCP sockets known to belong to the target.
    pub const OWNED_SOCKS: &str = "OWNED_SOCKS";
    /// `HashMap<u64 cgroup id, u32 tgid>`: the target's block cgroups (v1 blkio, or a v2 cgroup
    /// below the root): a bio charged to one is the target's whoever issues it.
    pub const TARGET_BLKCG: &str = "TARGET_BLKCG";
    /// `HashMap<blockio::FileId, u32 tgid>`: files the target maps (the model): a block request
    /// for their pages is the target's whoever issues it.
    pub const TARGET_FILES: &str = "TARGET_FILES";
    /// `HashMap<u32 tid, python::PyThread>`: CPython threads and where their current frame is
    /// (written by the collector): their stack events carry Python frames.
    pub const PY_THREADS: &str = "PY_THREADS";
    /// `PerCpuArray<i64>` of one, summed over the CPUs: how many target threads are runnable (on a CPU or waiting for one),
    /// as the switches since arming say; a hint for holding the drain while the server runs
    /// (meaningless with OFFCPU_D_ONLY, `probe watch`).
    pub const RUNNABLE: &str = "RUNNABLE";
    /// `HashMap<stack::StackKey, stack::StackSpans>`: the mappings that may hold a thread's stack, for
    /// the first stack copies of a thread whose needs are not known yet (written by the collector).
    pub const STACK_RANGES: &str = "STACK_RANGES";
}

/// Ring buffer size in bytes unless the user asks for another (must be a power of two pages).
pub const DEFAULT_RING_BYTES: u32 = 16 << 20;
/// Once the ring's backlog crosses a multiple of `1 << wakeup_shift(ring bytes)` bytes, the
/// producer forces one wakeup of the drain (waking it per event halves throughput; its timer,
/// every 100 ms while records flow, reads the rest): a sixteenth of the ring, from 64 KiB to
/// 1 MiB. Each wake-up costs the drain tens of µs of CPU on a VM (a switch between address
/// spaces), so a 32 MiB ring filling at 7 MB/s wakes it 7 times a second, not 28. Set by
/// userspace before load ([`kernel::WAKEUP_SHIFT_SYMBOL`]).
pub const fn wakeup_shift(ring_bytes: u32) -> u32 {
    let s = if ring_bytes >= 32 { (ring_bytes / 16).ilog2() } else { 0 };
    if s < 16 {
        16
    } else if s > 20 {
        20
    } else {
        s
    }
}
/// Size of the `LOST` and `COUNTERS` arrays.
pub const MAX_KINDS: u32 = 16;
pub const MAX_TARGETS: u32 = 4096;

/// What a record is. Carried as `u32` in [`EventHeader::kind`]; decode with `TryFrom`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    BlockIo = 1,
    Fault = 2,
    Mmap = 3,
    Sock = 4,
    Proc = 5,
    Filemap = 6,
    Data = 7,
    Stack = 8,
    Sched = 9,
    Mem = 10,
    Engine = 11,
    PyStack = 12,
}

impl EventKind {
    pub const ALL: [EventKind; 12] = [
        Self::BlockIo,
        Self::Fault,
        Self::Mmap,
        Self::Sock,
        Self::Proc,
        Self::Filemap,
        Self::Data,
        Self::Stack,
        Self::Sched,
        Self::Mem,
        Self::Engine,
        Self::PyStack,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Self::BlockIo => "blockio",
            Self::Fault => "fault",
            Self::Mmap => "mmap",
            Self::Sock => "sock",
            Self::Proc => "proc",
            Self::Filemap => "filemap",
            Self::Data => "stream",
            Self::Stack => "stack",
            Self::Sched => "sched",
            Self::Mem => "mem",
            Self::Engine => "engine",
            Self::PyStack => "pystack",
        }
    }

    /// Size in bytes of this kind's record.
    pub const fn record_size(self) -> usize {
        match self {
            Self::BlockIo => size_of::<blockio::BlockIoEvent>(),
            Self::Fault => size_of::<fault::FaultEvent>(),
            Self::Mmap => size_of::<mmap::MmapEvent>(),
            Self::Sock => size_of::<sock::SockEvent>(),
            Self::Proc => size_of::<proc::ProcEvent>(),
            Self::Filemap => size_of::<filemap::FilemapEvent>(),
            // The fixed part; `captured` payload bytes follow it.
            Self::Data => size_of::<stream::DataEvent>(),
            // The fixed part; `ustack_bytes` of user stack follow it.
            Self::Stack => size_of::<stack::StackEvent>(),
            Self::Sched => size_of::<stack::SchedEvent>(),
            Self::Mem => size_of::<mem::MemEvent>(),
            Self::Engine => size_of::<engine::EngineEvent>(),
            Self::PyStack => size_of::<python::PyStackEvent>(),
        }
    }
}

impl TryFrom<u32> for EventKind {
    type Error = u32;
    fn try_from(v: u32) -> Result<Self, u32> {
        Ok(match v {
            1 => Self::BlockIo,
            2 => Self::Fault,
            3 => Self::Mmap,
            4 => Self::Sock,
            5 => Self::Proc,
            6 => Self::Filemap,
            7 => Self::Data,
            8 => Self::Stack,
            9 => Self::Sched,
            10 => Self::Mem,
            11 => Self::Engine,
            12 => Self::PyStack,
            other => return Err(other),
        })
    }
}

/// In-kernel counters (index into `COUNTERS`), for things too frequent to send one by one.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Every user page fault of the target (`exceptions:page_fault_user`), minor and major.
    UserFaults = 0,
    /// A map insert failed (map full): attribution for that record may be missing.
    MapFull = 1,
    /// A `bpf_probe_read_*` of a tracepoint field failed inside a program.
    ReadErrors = 2,
    /// Run-queue waits of target threads shorter than [`stack::SHORT_WAIT_NS`]: counted here, not
    /// sent one by one (a busy box preempts for a few µs many times a second).
    ShortWaits = 3,
    /// Their total, ns.
    ShortWaitNs = 4,
    /// A syscall's exit or a call's return whose start was not in its LRU map (DATA_ARGS,
    /// MMAP_ARGS, ENGINE_CALL): evicted from the full map, or begun before attach. Its record is
    /// missing: a loss the map itself would not tell.
    Unmatched = 5,
    /// Python frame walks (probe_common::python), and the time they took, ns: what Python
    /// frames cost in the kernel, for their budget.
    PyWalks = 6,
    PyWalkNs = 7,
    /// Files the target mapped executable (a library loaded after attach): probe's drain, held
    /// back while every CPU is busy, is let go to follow it (the engine probe attaches there).
    ExecMaps = 8,
    /// Stack records whose user stack was cut short (or left out) because the ring buffer was
    /// filling ([`stack::TRIM_AT`]): room kept for the small records (IO, faults, requests) a
    /// verdict needs. Their flamegraph frames stop early; nothing else is missing.
    TrimmedStacks = 9,
}

impl Counter {
    pub const ALL: [Counter; 10] = [
        Self::UserFaults,
        Self::MapFull,
        Self::ReadErrors,
        Self::ShortWaits,
        Self::ShortWaitNs,
        Self::Unmatched,
        Self::PyWalks,
        Self::PyWalkNs,
        Self::ExecMaps,
        Self::TrimmedStacks,
    ];
    pub const fn name(self) -> &'static str {
        match self {
            Self::UserFaults => "user_faults",
            Self::MapFull => "map_full",
            Self::ReadErrors => "read_errors",
            Self::ShortWaits => "short_cpu_waits",
            Self::ShortWaitNs => "short_cpu_wait_ns",
            Self::Unmatched => "unmatched_returns",
            Self::PyWalks => "python_walks",
            Self::PyWalkNs => "python_walk_ns",
            Self::ExecMaps => "exec_maps",
            Self::TrimmedStacks => "trimmed_stacks",
        }
    }
}

/// The first 24 bytes of every record. `ts_ns` is CLOCK_MONOTONIC (`bpf_ktime_get_ns`);
/// `pid` is the thread group id (what userspace calls the pid), `tid` the thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    pub kind: u32,
    pub pid: u32,
    pub tid: u32,
    pub cpu: u32,
    pub ts_ns: u64,
}
const _: () = assert!(size_of::<EventHeader>() == 24);

/// Implemented by every record type: its kind, and that it starts with an [`EventHeader`].
pub trait Record: Copy {
    const KIND: EventKind;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all these types are #[repr(C)], made of integers and integer arrays with explicit
    // padding fields, so every bit pattern is valid and there are no uninitialised bytes.
    unsafe impl aya::Pod for crate::EventHeader {}
    unsafe impl aya::Pod for crate::blockio::BlockIoEvent {}
    unsafe impl aya::Pod for crate::fault::FaultEvent {}
    unsafe impl aya::Pod for crate::mmap::MmapEvent {}
    unsafe impl aya::Pod for crate::sock::SockEvent {}
    unsafe impl aya::Pod for crate::sock::ListenKey {}
    unsafe impl aya::Pod for crate::proc::ProcEvent {}
    unsafe impl aya::Pod for crate::filemap::FilemapEvent {}
    unsafe impl aya::Pod for crate::kernel::KernelOffsets {}
    unsafe impl aya::Pod for crate::stream::DataEvent {}
    unsafe impl aya::Pod for crate::stack::StackEvent {}
    unsafe impl aya::Pod for crate::stack::SchedEvent {}
    unsafe impl aya::Pod for crate::mem::MemEvent {}
    unsafe impl aya::Pod for crate::engine::EngineEvent {}
    unsafe impl aya::Pod for crate::engine::BatchFill {}
    unsafe impl aya::Pod for crate::python::PyThread {}
    unsafe impl aya::Pod for crate::python::PyStackEvent {}
    unsafe impl aya::Pod for crate::blockio::FileId {}
    unsafe impl aya::Pod for crate::stack::StackKey {}
    unsafe impl aya::Pod for crate::stack::StackSpans {}
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_wakeup_backlog_is_a_sixteenth_of_the_ring_from_64_kib_to_1_mib() {
        assert_eq!(super::wakeup_shift(32 << 20), 20);
        assert_eq!(super::wakeup_shift(16 << 20), 20);
        assert_eq!(super::wakeup_shift(4 << 20), 18);
        assert_eq!(super::wakeup_shift(1 << 20), 16);
        assert_eq!(super::wakeup_shift(4096), 16);
        assert_eq!(super::wakeup_shift(u32::MAX), 20);
    }
}
