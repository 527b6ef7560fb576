//! Memory-map syscalls of the target: mmap, munmap, mremap, madvise, mlock and friends.
use crate::{EventHeader, EventKind, Record};

/// Emitted at syscall exit, with the arguments saved at entry. Argument meaning per op:
/// mmap(addr, len, prot, flags, fd, off) · munmap(addr, len) · mremap(addr, len=old_len,
/// arg2=new_len, arg3=flags, arg4=new_addr) · madvise(addr, len, arg2=advice) ·
/// mlock/munlock(addr, len) · mlock2(addr, len, arg2=flags) · mprotect(addr, len, arg2=prot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MmapEvent {
    pub hdr: EventHeader,
    /// [`MmapOp`] as u32.
    pub op: u32,
    /// File descriptor for mmap (-1 for anonymous), otherwise -1.
    pub fd: i32,
    pub addr: u64,
    pub len: u64,
    pub arg2: u64,
    pub arg3: u64,
    pub arg4: u64,
    /// Syscall return: the mapped address for mmap/mremap, 0 or -errno otherwise.
    pub ret: i64,
    /// Entry timestamp (the header carries the exit time).
    pub enter_ns: u64,
}
const _: () = assert!(core::mem::size_of::<MmapEvent>() == 88);
impl Record for MmapEvent {
    const KIND: EventKind = EventKind::Mmap;
}

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmapOp {
    Mmap = 1,
    Munmap = 2,
    Mremap = 3,
    Madvise = 4,
    Mlock = 5,
    Munlock = 6,
    Mlock2 = 7,
    Mprotect = 8,
}

impl MmapOp {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mmap => "mmap",
            Self::Munmap => "munmap",
            Self::Mremap => "mremap",
            Self::Madvise => "madvise",
            Self::Mlock => "mlock",
            Self::Munlock => "munlock",
            Self::Mlock2 => "mlock2",
            Self::Mprotect => "mprotect",
        }
    }
}

impl TryFrom<u32> for MmapOp {
    type Error = u32;
    fn try_from(v: u32) -> Result<Self, u32> {
        Ok(match v {
            1 => Self::Mmap,
            2 => Self::Munmap,
            3 => Self::Mremap,
            4 => Self::Madvise,
            5 => Self::Mlock,
            6 => Self::Munlock,
            7 => Self::Mlock2,
            8 => Self::Mprotect,
            other => return Err(other),
        })
    }
}

/// Saved at syscall entry, keyed by tid, consumed at exit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MmapArgs {
    pub op: u32,
    pub fd: i32,
    pub addr: u64,
    pub len: u64,
    pub arg2: u64,
    pub arg3: u64,
    pub arg4: u64,
    pub enter_ns: u64,
}
