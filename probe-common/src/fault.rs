//! Page faults: one record per major fault of the target (perf software event, period 1).
use crate::{EventHeader, EventKind, Record};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultEvent {
    pub hdr: EventHeader,
    /// Faulting user address.
    pub addr: u64,
    /// User instruction pointer at the fault.
    pub ip: u64,
    /// [`FAULT_MAJOR`] ...
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<FaultEvent>() == 48);
impl Record for FaultEvent {
    const KIND: EventKind = EventKind::Fault;
}

pub const FAULT_MAJOR: u32 = 1;
