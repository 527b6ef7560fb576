//! Block IO: one record per completed request issued on behalf of the target.
use crate::{EventHeader, EventKind, Record};

/// Emitted at `block_rq_complete`. The header's pid/tid/cpu are the *issuer's* (completions run
/// in interrupt context, so the request is matched to its issue by device and sector).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockIoEvent {
    pub hdr: EventHeader,
    /// Kernel `dev_t` as the block tracepoints print it: major << 20 | minor.
    pub dev: u32,
    pub bytes: u32,
    pub sector: u64,
    /// When the request entered the IO scheduler (`block_rq_insert`); 0 if it went straight to issue.
    pub insert_ns: u64,
    /// When the driver got it (`block_rq_issue`).
    pub issue_ns: u64,
    /// When it completed (`block_rq_complete`).
    pub complete_ns: u64,
    /// `rwbs` flags as the kernel prints them ("R", "RA", "WS", "FF", ...), NUL padded.
    pub rwbs: [u8; 8],
    pub error: i32,
    /// How the request was matched to the target: [`BY_ISSUER`], [`BY_BLKCG`] or [`BY_FILE`].
    pub matched: u32,
    /// The file the request's first page belongs to (`page->mapping->host`): its inode and its
    /// superblock's `s_dev` (the kernel's encoding, as filemap records carry it); 0 when the page
    /// is anonymous or the kernel's offsets are unknown.
    pub ino: u64,
    pub ino_dev: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<BlockIoEvent>() == 96);

/// The request was issued by a target thread (or queued by one).
pub const BY_ISSUER: u32 = 0;
/// Issued by another task (the cgroup throttle's kworker, a flusher) for a bio of the target's
/// block cgroup.
pub const BY_BLKCG: u32 = 1;
/// Issued by another task for a page of a file the target maps.
pub const BY_FILE: u32 = 2;

/// Key of a file in [`crate::maps::TARGET_FILES`]: inode and superblock `s_dev`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileId {
    pub ino: u64,
    pub dev: u32,
    pub _pad: u32,
}
impl Record for BlockIoEvent {
    const KIND: EventKind = EventKind::BlockIo;
}

/// Key of an in-flight request: device and start sector (unique while it is in flight).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockKey {
    pub dev: u32,
    pub _pad: u32,
    pub sector: u64,
}

/// What the kernel remembers between issue and completion.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStart {
    pub pid: u32,
    pub tid: u32,
    pub cpu: u32,
    pub bytes: u32,
    pub insert_ns: u64,
    pub issue_ns: u64,
    pub rwbs: [u8; 8],
    pub matched: u32,
    pub ino_dev: u32,
    pub ino: u64,
}
