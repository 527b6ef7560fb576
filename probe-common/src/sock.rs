//! TCP sockets of the target: state changes and resets, with the 4-tuple.
use crate::{EventHeader, EventKind, Record};

/// One TCP state change or reset. For state changes `oldstate`/`newstate` are the kernel's
/// TCP_* numbers (1 = ESTABLISHED ... 7 = CLOSE, 10 = LISTEN); for resets `what` says which way.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockEvent {
    pub hdr: EventHeader,
    /// Kernel `struct sock *`: identifies the connection for its lifetime.
    pub skaddr: u64,
    /// [`SOCK_STATE`], [`SOCK_RESET_RECEIVED`] or [`SOCK_RESET_SENT`].
    pub what: u32,
    pub oldstate: i32,
    pub newstate: i32,
    /// AF_INET (2) or AF_INET6 (10).
    pub family: u16,
    pub sport: u16,
    pub dport: u16,
    /// 1 when the change ran in one of the target's threads (a local action), 0 in softirq etc.
    pub in_target: u8,
    pub _pad: [u8; 5],
    /// IPv4 in the first 4 bytes, or IPv6.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<SockEvent>() == 88);
impl Record for SockEvent {
    const KIND: EventKind = EventKind::Sock;
}

pub const SOCK_STATE: u32 = 0;
pub const SOCK_RESET_RECEIVED: u32 = 1;
pub const SOCK_RESET_SENT: u32 = 2;

pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;
pub const IPPROTO_TCP: u16 = 6;

/// TCP states as numbered in the kernel's `include/net/tcp_states.h`.
pub const TCP_ESTABLISHED: i32 = 1;
pub const TCP_SYN_SENT: i32 = 2;
pub const TCP_SYN_RECV: i32 = 3;
pub const TCP_FIN_WAIT1: i32 = 4;
pub const TCP_FIN_WAIT2: i32 = 5;
pub const TCP_TIME_WAIT: i32 = 6;
pub const TCP_CLOSE: i32 = 7;
pub const TCP_CLOSE_WAIT: i32 = 8;
pub const TCP_LAST_ACK: i32 = 9;
pub const TCP_LISTEN: i32 = 10;
pub const TCP_CLOSING: i32 = 11;
