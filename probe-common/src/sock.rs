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

/// A listening socket of the target, as the kernel maps key it: its network namespace (the
/// inode of `sk->__sk_common.skc_net`, 0 where the kernel's layout does not say), port and bound
/// address. The address is IPv6 or v4-mapped IPv6 (`::ffff:a.b.c.d`), so a v4 socket and a
/// dual-stack listener's v4 connections compare alike; a wildcard is `::` or `::ffff:0.0.0.0`.
/// A neighbour's server on the same port in another namespace, or on another address of the
/// host's, is not the target's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenKey {
    pub netns: u32,
    pub port: u16,
    pub _pad: u16,
    pub addr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<ListenKey>() == 24);

impl ListenKey {
    /// `addr` of `family` as the key holds it (v4 in the first 4 bytes, as the events carry it).
    pub fn new(netns: u32, port: u16, family: u16, addr: &[u8; 16]) -> ListenKey {
        let mut k = ListenKey { netns, port, _pad: 0, addr: [0; 16] };
        if family == AF_INET6 {
            k.addr = *addr;
        } else {
            k.addr[10] = 0xff;
            k.addr[11] = 0xff;
            k.addr[12] = addr[0];
            k.addr[13] = addr[1];
            k.addr[14] = addr[2];
            k.addr[15] = addr[3];
        }
        k
    }

    /// Whether the address is v4 (v4-mapped).
    pub fn is_v4(&self) -> bool {
        self.addr[..10] == [0; 10] && self.addr[10] == 0xff && self.addr[11] == 0xff
    }

    /// The same port and namespace on the wildcard of the address's family (v4: `0.0.0.0`).
    pub fn v4_wildcard(&self) -> ListenKey {
        let mut k = *self;
        k.addr[12..].copy_from_slice(&[0; 4]);
        k
    }

    /// The same port and namespace on `::` (a dual-stack listener takes v4 connections too).
    pub fn v6_wildcard(&self) -> ListenKey {
        ListenKey { addr: [0; 16], ..*self }
    }
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
