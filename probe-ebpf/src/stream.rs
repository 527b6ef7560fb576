//! Request streams: a bounded prefix of every read and write on the target's TCP sockets
//! (read, write, recvfrom, sendto, readv, writev, recvmsg, sendmsg), captured at syscall exit
//! when the return value says how many bytes moved. Vectored calls capture their first iovec.
use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_probe_read_user as probe_read_user_raw},
    macros::{map, tracepoint},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::TracePointContext,
};
use probe_common::{
    Record,
    sock::AF_INET6,
    stream::{DATA_CAP, DATA_MASK, DATA_TAIL, DIR_RECV, DIR_SEND, DataArgs, DataEvent, MSG_PEEK, Syscall, tail_len},
    tracepoints::{SYSCALL_ARG0, SYSCALL_RET},
};

use crate::{
    EVENTS, LOST, add, current_target, field, header, insert_lru, now_ns, ringbuf_flags,
    sock::is_owned,
    task::{offsets, read, sock_of_fd},
};

const HDR: usize = core::mem::size_of::<DataEvent>();

/// When the targets' sockets last carried data (any CPU): the first data after a quiet spell (a
/// request's bytes at an idle server) wakes the drain at once, so that it need not look at the
/// ring more than once a second while the server idles.
#[map(name = "STREAM_LAST")]
static STREAM_LAST: Array<u64> = Array::with_max_entries(1, 0);
const STREAM_QUIET_NS: u64 = 50_000_000;

/// Submit flags for a data record of `size` bytes at `now`: a forced wakeup after a quiet spell,
/// else the backlog's ([`ringbuf_flags`]). While tokens stream (a write every few ms) nothing
/// more wakes the drain.
#[inline(always)]
fn data_flags(size: u64, now: u64) -> u64 {
    let quiet = match STREAM_LAST.get_ptr_mut(0) {
        // SAFETY: the map's one slot; a racing CPU writes a time as recent, either is right.
        Some(p) => unsafe {
            let last = *p;
            *p = now;
            now.saturating_sub(last) > STREAM_QUIET_NS
        },
        None => false,
    };
    if quiet { crate::BPF_RB_FORCE_WAKEUP } else { ringbuf_flags(size) }
}

#[map(name = "DATA_ARGS")]
static DATA_ARGS: LruHashMap<u32, DataArgs> = LruHashMap::with_max_entries(8192, 0);

/// Per-CPU record under construction: the fixed part, then up to DATA_CAP + 1 payload bytes.
#[map(name = "DATA_SCRATCH")]
static DATA_SCRATCH: PerCpuArray<[u8; HDR + DATA_CAP + 1]> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn enter(ctx: &TracePointContext, sc: Syscall, flags_arg: Option<usize>) -> Result<(), i64> {
    let Some((_, tid)) = current_target() else { return Ok(()) };
    let fd: u64 = field(ctx, SYSCALL_ARG0)?;
    let buf: u64 = field(ctx, SYSCALL_ARG0 + 8)?;
    let flags: u64 = match flags_arg {
        Some(i) => field(ctx, SYSCALL_ARG0 + 8 * i)?,
        None => 0,
    };
    let args = DataArgs { buf, enter_ns: now_ns(), fd: fd as i32, flags: flags as u32, syscall: sc as u8, _pad: [0; 7] };
    insert_lru(&DATA_ARGS, &tid, &args);
    Ok(())
}

#[inline(always)]
fn user<T>(addr: u64) -> Option<T> {
    // SAFETY: a probe read of user memory: a bad address returns an error, never faults.
    unsafe { bpf_probe_read_user(addr as *const T) }.ok()
}

#[inline(always)]
fn exit(ctx: &TracePointContext) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    // SAFETY: copied out before the remove.
    let Some(a) = (unsafe { DATA_ARGS.get(&tid) }).copied() else {
        crate::count(probe_common::Counter::Unmatched);
        return Ok(());
    };
    let _ = DATA_ARGS.remove(&tid);
    let ret: i64 = field(ctx, SYSCALL_RET)?;
    if ret <= 0 || a.flags & MSG_PEEK != 0 {
        return Ok(());
    }
    let Some(sk) = sock_of_fd(a.fd) else { return Ok(()) };
    if !is_owned(sk) {
        return Ok(());
    }
    // Where the bytes are: the buffer, or the first iovec of a vector / msghdr (msg_iov @16).
    let (src, avail) = match a.syscall {
        s if s == Syscall::Readv as u8 || s == Syscall::Writev as u8 => {
            (user::<u64>(a.buf).unwrap_or(0), user::<u64>(a.buf + 8).unwrap_or(0))
        }
        s if s == Syscall::Recvmsg as u8 || s == Syscall::Sendmsg as u8 => {
            let iov = user::<u64>(a.buf + 16).unwrap_or(0);
            (user::<u64>(iov).unwrap_or(0), user::<u64>(iov + 8).unwrap_or(0))
        }
        _ => (a.buf, ret as u64),
    };
    let avail = if avail > ret as u64 { ret as u64 } else { avail };
    let n = (if avail > DATA_CAP as u64 { DATA_CAP as u32 } else { avail as u32 }) & DATA_MASK;

    let Some(buf) = DATA_SCRATCH.get_ptr_mut(0) else { return Ok(()) };
    let ev = buf.cast::<DataEvent>();
    let dir = match a.syscall {
        s if s == Syscall::Write as u8 || s == Syscall::Sendto as u8 || s == Syscall::Writev as u8 || s == Syscall::Sendmsg as u8 => {
            DIR_SEND
        }
        _ => DIR_RECV,
    };
    let k = offsets();
    let family: u16 = read(sk, k.skc_family).unwrap_or(0);
    let mut e = DataEvent {
        hdr: header::<DataEvent>(pid, tid),
        sk,
        enter_ns: a.enter_ns,
        len: ret as u32,
        captured: n,
        fd: a.fd,
        dir,
        syscall: a.syscall,
        family,
        flags: a.flags,
        sport: read::<u16>(sk, k.skc_num).unwrap_or(0),
        dport: u16::from_be(read::<u16>(sk, k.skc_dport).unwrap_or(0)),
        saddr: [0; 16],
        daddr: [0; 16],
    };
    if family == AF_INET6 {
        e.saddr = read(sk, k.skc_v6_rcv_saddr).unwrap_or([0; 16]);
        e.daddr = read(sk, k.skc_v6_daddr).unwrap_or([0; 16]);
    } else {
        let s: [u8; 4] = read(sk, k.skc_rcv_saddr).unwrap_or([0; 4]);
        let d: [u8; 4] = read(sk, k.skc_daddr).unwrap_or([0; 4]);
        e.saddr[..4].copy_from_slice(&s);
        e.daddr[..4].copy_from_slice(&d);
    }
    // SAFETY: `buf` is this CPU's scratch slot, HDR + DATA_CAP + 1 bytes; n ≤ DATA_MASK = DATA_CAP.
    unsafe {
        ev.write(e);
        let payload = buf.cast::<u8>().add(HDR);
        // Volatile reload + mask right at the call: the verifier must see the bound on the
        // register passed as the size, and the compiler must not drop the mask as redundant.
        let size = core::ptr::read_volatile(&raw const (*ev).captured) & DATA_MASK;
        if probe_read_user_raw(payload.cast(), size, src as *const _) != 0 {
            (*ev).captured = 0;
        }
        let total = HDR + (core::ptr::read_volatile(&raw const (*ev).captured) & DATA_MASK) as usize;
        let bytes = core::slice::from_raw_parts(buf.cast::<u8>(), total);
        if EVENTS.output::<[u8]>(bytes, data_flags(total as u64, (*ev).hdr.ts_ns)).is_err() {
            add(&LOST, DataEvent::KIND as u32, 1);
        }
        // The end of a large single-buffer call, in a second record.
        let tail = tail_len(a.syscall, ret as u32, core::ptr::read_volatile(&raw const (*ev).captured)) & DATA_MASK;
        if tail == 0 {
            return Ok(());
        }
        (*ev).captured = tail;
        (*ev).syscall = a.syscall | DATA_TAIL;
        let from = src + ret as u64 - tail as u64;
        let size = core::ptr::read_volatile(&raw const (*ev).captured) & DATA_MASK;
        if probe_read_user_raw(payload.cast(), size, from as *const _) != 0 {
            (*ev).captured = 0;
        }
        let total = HDR + (core::ptr::read_volatile(&raw const (*ev).captured) & DATA_MASK) as usize;
        let bytes = core::slice::from_raw_parts(buf.cast::<u8>(), total);
        if EVENTS.output::<[u8]>(bytes, ringbuf_flags(total as u64)).is_err() {
            add(&LOST, DataEvent::KIND as u32, 1);
        }
    }
    Ok(())
}

macro_rules! data_pair {
    ($enter:ident, $exit:ident, $tp_enter:literal, $tp_exit:literal, $sc:expr, $flags:expr) => {
        #[tracepoint(category = "syscalls", name = $tp_enter)]
        pub fn $enter(ctx: TracePointContext) -> u32 {
            let _ = enter(&ctx, $sc, $flags);
            0
        }
        #[tracepoint(category = "syscalls", name = $tp_exit)]
        pub fn $exit(ctx: TracePointContext) -> u32 {
            let _ = exit(&ctx);
            0
        }
    };
}

// read(fd, buf, count) · write(fd, buf, count) · recvfrom(fd, buf, len, flags, ...) ·
// sendto(fd, buf, len, flags, ...) · readv/writev(fd, iov, iovcnt) · recvmsg/sendmsg(fd, msg, flags)
data_pair!(read_enter, read_exit, "sys_enter_read", "sys_exit_read", Syscall::Read, None);
data_pair!(write_enter, write_exit, "sys_enter_write", "sys_exit_write", Syscall::Write, None);
data_pair!(recvfrom_enter, recvfrom_exit, "sys_enter_recvfrom", "sys_exit_recvfrom", Syscall::Recvfrom, Some(3));
data_pair!(sendto_enter, sendto_exit, "sys_enter_sendto", "sys_exit_sendto", Syscall::Sendto, Some(3));
data_pair!(readv_enter, readv_exit, "sys_enter_readv", "sys_exit_readv", Syscall::Readv, None);
data_pair!(writev_enter, writev_exit, "sys_enter_writev", "sys_exit_writev", Syscall::Writev, None);
data_pair!(recvmsg_enter, recvmsg_exit, "sys_enter_recvmsg", "sys_exit_recvmsg", Syscall::Recvmsg, Some(2));
data_pair!(sendmsg_enter, sendmsg_exit, "sys_enter_sendmsg", "sys_exit_sendmsg", Syscall::Sendmsg, Some(2));
