//! TCP connections of the target: every state change with its 4-tuple, and resets sent and
//! received, so userspace can tell who closed first (local FIN, peer FIN, RST either way).
//!
//! Many transitions run in softirq (peer FIN, RST, handshake of accepted sockets), and on
//! loopback softirq runs on whatever task sent the packet, so the current task says nothing
//! about whose socket it is. Ownership is by socket instead (`OWNED_SOCKS`): marked when one
//! of the target's threads calls connect/listen/close or sends/receives on it (the fd is walked
//! to its `struct sock`), or when its local port is one the target listens on (accepted sockets).
use aya_ebpf::{
    macros::{map, raw_tracepoint, tracepoint},
    maps::{HashMap, LruHashMap},
    programs::{RawTracePointContext, TracePointContext},
};
use probe_common::{
    sock::*,
    tracepoints::{
        SYSCALL_ARG0, inet_sock_set_state as st, sock_recv_length as rl, sock_send_length as sl, tcp_receive_reset as rr,
        tcp_send_reset as sr,
    },
};

use crate::{
    current_target, emit, field, header, insert, insert_lru,
    task::{offsets, read, sock_of_fd},
};

#[map(name = "OWNED_SOCKS")]
static OWNED_SOCKS: LruHashMap<u64, u8> = LruHashMap::with_max_entries(65536, 0);

/// Ports the target listens on: a quick filter before [`LISTEN_ADDRS`] (never removed here: a
/// stale port costs a lookup in LISTEN_ADDRS, nothing more).
#[map(name = "LISTEN_PORTS")]
static LISTEN_PORTS: HashMap<u16, u8> = HashMap::with_max_entries(1024, 0);

/// The target's listening sockets by namespace, port and address: whose accepted connections
/// are the target's.
#[map(name = "LISTEN_ADDRS")]
static LISTEN_ADDRS: HashMap<ListenKey, u8> = HashMap::with_max_entries(1024, 0);

/// Whether `sk` is one of the target's TCP sockets.
#[inline(always)]
pub fn is_owned(sk: u64) -> bool {
    // SAFETY: u8 value, nothing borrowed past the lookup.
    unsafe { OWNED_SOCKS.get(&sk) }.is_some()
}

#[inline(always)]
fn owned(skaddr: u64, sport: u16) -> bool {
    // SAFETY: u8 values, nothing borrowed past the lookup.
    unsafe { OWNED_SOCKS.get(&skaddr).is_some() || (LISTEN_PORTS.get(&sport).is_some() && on_a_target_listener(skaddr, sport)) }
}

/// The key of `sk`'s local end: namespace, port, bound address. None where the layout is unknown.
#[inline(always)]
fn listen_key(sk: u64, sport: u16) -> Option<ListenKey> {
    let k = offsets();
    if k.valid == 0 {
        return None;
    }
    let (family, addr) = local_addr(sk, &k)?;
    Some(ListenKey::new(netns_of(sk), sport, family, &addr))
}

/// `sk`'s family and local address (IPv4 in the first 4 bytes, as the events carry it).
#[inline(always)]
fn local_addr(sk: u64, k: &probe_common::kernel::KernelOffsets) -> Option<(u16, [u8; 16])> {
    let family: u16 = read(sk, k.skc_family)?;
    let mut addr = [0u8; 16];
    if family == AF_INET6 {
        addr = read(sk, k.skc_v6_rcv_saddr)?;
    } else {
        let a: [u8; 4] = read(sk, k.skc_rcv_saddr)?;
        addr[..4].copy_from_slice(&a);
    }
    Some((family, addr))
}

/// The inode of `sk`'s network namespace; 0 where the layout is unknown (user space keys the
/// target's listeners under 0 too).
#[inline(always)]
fn netns_of(sk: u64) -> u32 {
    let k = offsets();
    if k.skc_net == 0 || k.net_inum == 0 {
        return 0;
    }
    read::<u64>(sk, k.skc_net).filter(|&n| n != 0).and_then(|net| read::<u32>(net, k.net_inum)).unwrap_or(0)
}

/// Whether a socket on one of the target's ports is on the target's listener: the same
/// namespace, and its address or the wildcard the listener is bound to. Unknown layout: the
/// port alone says (as before namespaces were told apart). A function of its own (a BPF
/// subprogram, its stack frame apart from its callers'): inlined, tcp_send_reset's stack passed
/// the 512-byte limit.
#[inline(never)]
fn on_a_target_listener(sk: u64, sport: u16) -> bool {
    let Some(mut key) = listen_key(sk, sport) else { return true };
    // One key, changed in place: the programs that call this are near the stack's limit.
    // SAFETY: u8 values, nothing borrowed past the lookups.
    unsafe {
        if LISTEN_ADDRS.get(&key).is_some() {
            return true;
        }
        if key.is_v4() {
            key.addr[12..].copy_from_slice(&[0; 4]);
            if LISTEN_ADDRS.get(&key).is_some() {
                return true;
            }
        }
        key.addr = [0; 16];
        LISTEN_ADDRS.get(&key).is_some()
    }
}

/// sock:inet_sock_set_state: every TCP/IP state change (ports in host order).
#[tracepoint(category = "sock", name = "inet_sock_set_state")]
pub fn inet_sock_set_state(ctx: TracePointContext) -> u32 {
    let _ = try_inet_sock_set_state(&ctx);
    0
}

fn try_inet_sock_set_state(ctx: &TracePointContext) -> Result<(), i64> {
    let protocol: u16 = field(ctx, st::PROTOCOL)?;
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    let skaddr: u64 = field(ctx, st::SKADDR)?;
    let sport: u16 = field(ctx, st::SPORT)?;
    let newstate: i32 = field(ctx, st::NEWSTATE)?;
    if !owned(skaddr, sport) {
        return Ok(());
    }
    let target = current_target();
    let (pid, tid) = target.unwrap_or((0, 0));
    let family: u16 = field(ctx, st::FAMILY)?;
    let mut ev = SockEvent {
        hdr: header::<SockEvent>(pid, tid),
        skaddr,
        what: SOCK_STATE,
        oldstate: field(ctx, st::OLDSTATE)?,
        newstate,
        family,
        sport,
        dport: field(ctx, st::DPORT)?,
        in_target: target.is_some() as u8,
        ..Default::default()
    };
    if family == AF_INET6 {
        ev.saddr = field(ctx, st::SADDR_V6)?;
        ev.daddr = field(ctx, st::DADDR_V6)?;
    } else {
        let s: [u8; 4] = field(ctx, st::SADDR)?;
        let d: [u8; 4] = field(ctx, st::DADDR)?;
        ev.saddr[..4].copy_from_slice(&s);
        ev.daddr[..4].copy_from_slice(&d);
    }
    state_changed(&ev);
    Ok(())
}

/// Send a state change and keep the ownership maps in step with it.
#[inline(always)]
fn state_changed(ev: &SockEvent) {
    let (skaddr, sport, newstate) = (ev.skaddr, ev.sport, ev.newstate);
    emit(ev);
    if newstate == TCP_CLOSE {
        let _ = OWNED_SOCKS.remove(&skaddr);
        if ev.oldstate == TCP_LISTEN {
            let _ = LISTEN_ADDRS.remove(&ListenKey::new(netns_of(skaddr), sport, ev.family, &ev.saddr));
        }
    } else if newstate == TCP_LISTEN {
        insert(&LISTEN_PORTS, &sport, &1u8);
        insert(&LISTEN_ADDRS, &ListenKey::new(netns_of(skaddr), sport, ev.family, &ev.saddr), &1u8);
    } else {
        // Accepted sockets are owned through their listener's port until now.
        insert_lru(&OWNED_SOCKS, &skaddr, &1u8);
    }
}

/// The 4-tuple of `sk` from its sock_common (the classic tracepoints read the same fields).
#[inline(always)]
fn from_sock(sk: u64, what: u32) -> Option<SockEvent> {
    let k = offsets();
    if k.valid == 0 {
        return None;
    }
    let (family, saddr) = local_addr(sk, &k)?;
    let target = current_target();
    let (pid, tid) = target.unwrap_or((0, 0));
    let mut ev = SockEvent {
        hdr: header::<SockEvent>(pid, tid),
        skaddr: sk,
        what,
        family,
        sport: read(sk, k.skc_num)?,
        dport: u16::from_be(read(sk, k.skc_dport)?),
        in_target: target.is_some() as u8,
        saddr,
        ..Default::default()
    };
    if family == AF_INET6 {
        ev.daddr = read(sk, k.skc_v6_daddr)?;
    } else {
        let d: [u8; 4] = read(sk, k.skc_daddr)?;
        ev.daddr[..4].copy_from_slice(&d);
    }
    Some(ev)
}

/// inet_sock_set_state(const struct sock *sk, int oldstate, int newstate) as a raw tracepoint,
/// preferred over the classic one: state changes run in softirq, on top of whatever BPF program
/// the interrupted task was running, and the kernel skips a classic tracepoint program whenever
/// any tracepoint/kprobe/perf program is running on the CPU. Raw tracepoints only guard against
/// themselves. Only TCP sockets are ever owned, so no protocol check is needed.
#[raw_tracepoint(tracepoint = "inet_sock_set_state")]
pub fn inet_sock_set_state_raw(ctx: RawTracePointContext) -> i32 {
    let sk: u64 = ctx.arg(0);
    let old: u64 = ctx.arg(1);
    let new: u64 = ctx.arg(2);
    let k = offsets();
    let Some(sport) = read::<u16>(sk, k.skc_num) else { return 0 };
    if k.valid == 0 || !owned(sk, sport) {
        return 0;
    }
    if let Some(mut ev) = from_sock(sk, SOCK_STATE) {
        ev.oldstate = old as i32;
        ev.newstate = new as i32;
        state_changed(&ev);
    }
    0
}

/// tcp_receive_reset(struct sock *sk) as a raw tracepoint (softirq; see above).
#[raw_tracepoint(tracepoint = "tcp_receive_reset")]
pub fn tcp_receive_reset_raw(ctx: RawTracePointContext) -> i32 {
    let sk: u64 = ctx.arg(0);
    let k = offsets();
    let Some(sport) = read::<u16>(sk, k.skc_num) else { return 0 };
    if k.valid == 0 || !owned(sk, sport) {
        return 0;
    }
    if let Some(mut ev) = from_sock(sk, SOCK_RESET_RECEIVED) {
        ev.hdr.pid = 0;
        ev.hdr.tid = 0;
        emit(&ev);
    }
    0
}

/// tcp:tcp_receive_reset: the peer reset the connection (softirq; ports in host order).
#[tracepoint(category = "tcp", name = "tcp_receive_reset")]
pub fn tcp_receive_reset(ctx: TracePointContext) -> u32 {
    let _ = try_tcp_receive_reset(&ctx);
    0
}

fn try_tcp_receive_reset(ctx: &TracePointContext) -> Result<(), i64> {
    let skaddr: u64 = field(ctx, rr::SKADDR)?;
    let sport: u16 = field(ctx, rr::SPORT)?;
    if !owned(skaddr, sport) {
        return Ok(());
    }
    let family: u16 = field(ctx, rr::FAMILY)?;
    let mut ev = SockEvent {
        hdr: header::<SockEvent>(0, 0),
        skaddr,
        what: SOCK_RESET_RECEIVED,
        family,
        sport,
        dport: field(ctx, rr::DPORT)?,
        in_target: current_target().is_some() as u8,
        ..Default::default()
    };
    if family == AF_INET6 {
        ev.saddr = field(ctx, rr::SADDR_V6)?;
        ev.daddr = field(ctx, rr::DADDR_V6)?;
    } else {
        let s: [u8; 4] = field(ctx, rr::SADDR)?;
        let d: [u8; 4] = field(ctx, rr::DADDR)?;
        ev.saddr[..4].copy_from_slice(&s);
        ev.daddr[..4].copy_from_slice(&d);
    }
    emit(&ev);
    Ok(())
}

/// tcp_send_reset(const struct sock *sk, const struct sk_buff *skb, ...) as a raw tracepoint,
/// preferred when the sock offsets are known: a reset answering an incoming segment is sent
/// from softirq, where the classic program is skipped whenever another BPF program runs on
/// that CPU.
#[raw_tracepoint(tracepoint = "tcp_send_reset")]
pub fn tcp_send_reset_raw(ctx: RawTracePointContext) -> i32 {
    let sk: u64 = ctx.arg(0);
    let k = offsets();
    if sk == 0 || k.valid == 0 {
        return 0;
    }
    let Some(sport) = read::<u16>(sk, k.skc_num) else { return 0 };
    if !owned(sk, sport) {
        return 0;
    }
    if let Some(mut ev) = from_sock(sk, SOCK_RESET_SENT) {
        ev.oldstate = read::<u8>(sk, k.skc_state).map_or(0, i32::from);
        emit(&ev);
    }
    0
}

/// tcp:tcp_send_reset (skaddr @16, state @24, saddr/daddr sockaddr @32/@60): we send an RST,
/// e.g. close() with unread data, or a segment for a dead socket (skaddr 0: not a connection).
#[tracepoint(category = "tcp", name = "tcp_send_reset")]
pub fn tcp_send_reset(ctx: TracePointContext) -> u32 {
    let _ = try_tcp_send_reset(&ctx);
    0
}

fn try_tcp_send_reset(ctx: &TracePointContext) -> Result<(), i64> {
    let skaddr: u64 = field(ctx, sr::SKADDR)?;
    if skaddr == 0 {
        return Ok(());
    }
    // struct sockaddr_in{6}: family u16, port u16 (network order), v4 addr @4 / v6 addr @8.
    let s: [u8; 28] = field(ctx, sr::SADDR)?;
    let d: [u8; 28] = field(ctx, sr::DADDR)?;
    let family = u16::from_ne_bytes([s[0], s[1]]);
    let sport = u16::from_be_bytes([s[2], s[3]]);
    if !owned(skaddr, sport) {
        return Ok(());
    }
    let target = current_target();
    let (pid, tid) = target.unwrap_or((0, 0));
    let mut ev = SockEvent {
        hdr: header::<SockEvent>(pid, tid),
        skaddr,
        what: SOCK_RESET_SENT,
        oldstate: field(ctx, sr::STATE)?,
        family,
        sport,
        dport: u16::from_be_bytes([d[2], d[3]]),
        in_target: target.is_some() as u8,
        ..Default::default()
    };
    if family == AF_INET6 {
        ev.saddr.copy_from_slice(&s[8..24]);
        ev.daddr.copy_from_slice(&d[8..24]);
    } else {
        ev.saddr[..4].copy_from_slice(&s[4..8]);
        ev.daddr[..4].copy_from_slice(&d[4..8]);
    }
    emit(&ev);
    Ok(())
}

/// sock:sock_send_length / sock_recv_length (sk @8, family @16, protocol @18): a send or recv
/// in the target's thread marks the socket as the target's, including connections opened
/// before probe attached (the slow request already in flight).
#[tracepoint(category = "sock", name = "sock_send_length")]
pub fn sock_send_length(ctx: TracePointContext) -> u32 {
    let _ = mark(&ctx, sl::SK, sl::PROTOCOL);
    0
}

#[tracepoint(category = "sock", name = "sock_recv_length")]
pub fn sock_recv_length(ctx: TracePointContext) -> u32 {
    let _ = mark(&ctx, rl::SK, rl::PROTOCOL);
    0
}

#[inline(always)]
fn mark(ctx: &TracePointContext, sk_off: usize, proto_off: usize) -> Result<(), i64> {
    if current_target().is_none() {
        return Ok(());
    }
    let protocol: u16 = field(ctx, proto_off)?;
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    own(field(ctx, sk_off)?);
    Ok(())
}

/// Mark a live socket as the target's. A socket already in CLOSE is not marked: its memory
/// is about to be freed and reused for someone else's socket (seen: a server's close() after
/// the peer's FIN had closed the sock, then curl's next socket at the same address).
#[inline(always)]
fn own(sk: u64) {
    // SAFETY: u8 value, nothing borrowed past the lookup.
    if unsafe { OWNED_SOCKS.get(&sk) }.is_some() {
        return;
    }
    let k = offsets();
    match read::<u8>(sk, k.skc_state) {
        Some(state) if state as i32 != TCP_CLOSE && k.valid != 0 => insert_lru(&OWNED_SOCKS, &sk, &1u8),
        _ => {}
    }
}

/// syscalls:sys_enter_connect / sys_enter_listen / sys_enter_close (fd @16): the target acts on
/// a socket; mark it before the state change the call causes (SYN_SENT, LISTEN, FIN_WAIT1).
#[inline(always)]
fn own_fd(ctx: &TracePointContext) -> Result<(), i64> {
    if current_target().is_none() {
        return Ok(());
    }
    let fd: u64 = field(ctx, SYSCALL_ARG0)?;
    if let Some(sk) = sock_of_fd(fd as i32) {
        own(sk);
    }
    Ok(())
}

#[tracepoint(category = "syscalls", name = "sys_enter_connect")]
pub fn sock_connect(ctx: TracePointContext) -> u32 {
    let _ = own_fd(&ctx);
    0
}

#[tracepoint(category = "syscalls", name = "sys_enter_listen")]
pub fn sock_listen(ctx: TracePointContext) -> u32 {
    let _ = own_fd(&ctx);
    0
}

#[tracepoint(category = "syscalls", name = "sys_enter_close")]
pub fn sock_close(ctx: TracePointContext) -> u32 {
    let _ = own_fd(&ctx);
    0
}
