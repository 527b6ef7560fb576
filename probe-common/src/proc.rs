//! Process lifecycle of the target set: forks (children join the target), execs and exits.
use crate::{EventHeader, EventKind, Record};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcEvent {
    pub hdr: EventHeader,
    /// [`PROC_FORK`], [`PROC_EXEC`] or [`PROC_EXIT`].
    pub op: u32,
    /// Fork: the child's pid (a new thread's tid for clone(CLONE_THREAD)). Exit: the exiting tid.
    pub child: u32,
    /// Exit: 1 when the whole thread group is gone.
    pub group_dead: u32,
    pub _pad: u32,
    pub comm: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<ProcEvent>() == 56);
impl Record for ProcEvent {
    const KIND: EventKind = EventKind::Proc;
}

pub const PROC_FORK: u32 = 1;
pub const PROC_EXEC: u32 = 2;
pub const PROC_EXIT: u32 = 3;
