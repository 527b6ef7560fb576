//! Memory-map syscalls of the target: mmap, munmap, mremap, madvise, mlock and friends.
use crate::{EventHeader, EventKind, Record};

/// Emitted at syscall exit, with the arguments saved at entry. Argument meaning per op:
/// mmap(addr, len, prot, flags, fd, off) · munmap(addr, len) · mremap(addr, len=old_len,
/// arg2=new_len, arg3=flags, arg4=new_addr) · madvise(addr, len, arg2=advice) ·
/// mlock/munlock(addr, len) · mlock2(addr, len, arg2=flags) · mprotect(addr, len, arg2=prot).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// mmap of a file: the file's inode and kernel dev_t (major << 20 | minor), read in the
    /// kernel from the fd at entry, so the file is known even if it is unmapped at once.
    pub ino: u64,
    pub dev: u32,
    pub _pad: u32,
    /// mmap of a file: its base name, NUL padded (the full path comes from /proc when it can).
    pub name: [u8; crate::kernel::NAME_LEN],
}
const _: () = assert!(core::mem::size_of::<MmapEvent>() == 152);
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmapArgs {
    pub op: u32,
    pub fd: i32,
    pub addr: u64,
    pub len: u64,
    pub arg2: u64,
    pub arg3: u64,
    pub arg4: u64,
    pub enter_ns: u64,
    pub ino: u64,
    pub dev: u32,
    pub _pad: u32,
    pub name: [u8; crate::kernel::NAME_LEN],
}

impl Default for MmapEvent {
    fn default() -> Self {
        Self {
            hdr: Default::default(),
            op: 0,
            fd: -1,
            addr: 0,
            len: 0,
            arg2: 0,
            arg3: 0,
            arg4: 0,
            ret: 0,
            enter_ns: 0,
            ino: 0,
            dev: 0,
            _pad: 0,
            name: [0; crate::kernel::NAME_LEN],
        }
    }
}
