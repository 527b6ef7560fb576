//! Page-cache fills: a folio of a file was added to the page cache in the target's context
//! (a read, readahead or fault that will go to disk). Names the file behind disk reads:
//! block requests carry only sectors, this carries device + inode.
use crate::{EventHeader, EventKind, Record};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilemapEvent {
    pub hdr: EventHeader,
    pub ino: u64,
    /// Page index in the file (offset / 4096).
    pub index: u64,
    /// Kernel dev_t of the file's superblock: major << 20 | minor.
    pub dev: u32,
    /// The folio holds 2^order pages.
    pub order: u32,
}
const _: () = assert!(core::mem::size_of::<FilemapEvent>() == 48);
impl Record for FilemapEvent {
    const KIND: EventKind = EventKind::Filemap;
}
