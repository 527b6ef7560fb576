//! Request streams: bytes the target reads from and writes to its TCP sockets, a bounded
//! prefix of each call. Userspace parses them in memory (HTTP, SSE, NDJSON) and keeps only
//! request metadata; the bytes themselves are stored only with `--capture-text`.
use crate::{EventHeader, EventKind, Record};

/// Bytes captured per call at most; the rest is counted (`len - captured`).
pub const DATA_CAP: usize = 4095;
/// `captured & DATA_MASK` bounds the copy for the verifier (DATA_CAP + 1 is a power of two).
pub const DATA_MASK: u32 = 0xfff;

/// Fixed part of a data record; `captured` payload bytes follow it in the same record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataEvent {
    pub hdr: EventHeader,
    /// Kernel `struct sock *`, the same identity as in sock records.
    pub sk: u64,
    /// Syscall entry time (the header carries the exit time).
    pub enter_ns: u64,
    /// Bytes the call moved (its return value).
    pub len: u32,
    /// Payload bytes that follow this struct (≤ DATA_CAP, ≤ len).
    pub captured: u32,
    pub fd: i32,
    /// [`DIR_RECV`] or [`DIR_SEND`].
    pub dir: u8,
    /// [`Syscall`] as u8.
    pub syscall: u8,
    pub family: u16,
    /// recv/send flags (MSG_PEEK data is not stream data).
    pub flags: u32,
    /// Local and remote port, host order.
    pub sport: u16,
    pub dport: u16,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<DataEvent>() == 96);
impl Record for DataEvent {
    const KIND: EventKind = EventKind::Data;
}

/// Set in [`DataEvent::syscall`] on the record that carries the *last* bytes of a call that moved
/// more than [`DATA_CAP`] bytes from one buffer (read, write, recvfrom, sendto): what ends a
/// large message (a final SSE chunk that echoes the prompt, a long non-streamed answer, a long
/// prompt's `max_tokens`) is at its end. It follows the head record of the same call.
pub const DATA_TAIL: u8 = 0x80;

/// Tail bytes the kernel sends after a head record of this call: the last
/// min(len - DATA_CAP, DATA_CAP) bytes, for single-buffer calls whose head was full.
pub const fn tail_len(syscall: u8, len: u32, captured: u32) -> u32 {
    let single = syscall == Syscall::Read as u8
        || syscall == Syscall::Write as u8
        || syscall == Syscall::Recvfrom as u8
        || syscall == Syscall::Sendto as u8;
    if !single || captured as usize != DATA_CAP || len as usize <= DATA_CAP {
        return 0;
    }
    let rest = len - DATA_CAP as u32;
    if rest > DATA_CAP as u32 { DATA_CAP as u32 } else { rest }
}

pub const DIR_RECV: u8 = 0;
pub const DIR_SEND: u8 = 1;
pub const MSG_PEEK: u32 = 2;

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syscall {
    Read = 1,
    Write = 2,
    Recvfrom = 3,
    Sendto = 4,
    Readv = 5,
    Writev = 6,
    Recvmsg = 7,
    Sendmsg = 8,
}

/// Saved at syscall entry by tid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataArgs {
    pub buf: u64,
    pub enter_ns: u64,
    pub fd: i32,
    pub flags: u32,
    pub syscall: u8,
    pub _pad: [u8; 7],
}
