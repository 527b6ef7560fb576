//! The request-stream tracker (`probe_user::stream::Tracker`) driven by a sequence of kernel
//! records read from the input: data records on a few sockets in both directions (`len` beyond
//! what was captured, tail records of large calls, lost and stray tails), TCP state changes and
//! resets. Seeds are real conversations (fuzz/seeds.py); fuzz/http.dict has the wire's words.
//!
//! Beyond "no panic": every request the tracker starts comes out exactly once (ids 1..=N after
//! `finish`), byte counts cover the uncaptured bytes, the closed sets hold their documented
//! words, and each record survives the JSON round trip the recording puts it through.
#![no_main]

use std::collections::BTreeSet;

use libfuzzer_sys::fuzz_target;
use probe_common::{
    EventHeader, EventKind,
    sock::{AF_INET, AF_INET6, SOCK_RESET_RECEIVED, SOCK_RESET_SENT, SOCK_STATE, SockEvent},
    stream::{DATA_CAP, DATA_TAIL, DIR_RECV, DIR_SEND, DataEvent, Syscall, tail_len},
};
use probe_fuzz::Input;
use probe_user::stream::{RequestRecord, Tracker};

/// Sockets the events are spread over; the fourth never carries data in the seeds.
const SOCKETS: [u64; 4] = [0xffff_8881_0000_1000, 0xffff_8881_0000_2000, 0xffff_8881_0000_3000, 0xffff_8881_dead_0000];
const MAX_OPS: usize = 1000;
/// Time steps are in units of 100 µs.
const TICK_NS: u64 = 100_000;
const SYSCALLS: [Syscall; 8] = [
    Syscall::Read,
    Syscall::Write,
    Syscall::Recvfrom,
    Syscall::Sendto,
    Syscall::Readv,
    Syscall::Writev,
    Syscall::Recvmsg,
    Syscall::Sendmsg,
];

fn hdr(kind: EventKind, ts: u64) -> EventHeader {
    EventHeader { kind: kind as u32, pid: 100, tid: 101, cpu: 0, ts_ns: ts }
}

/// A data record as the kernel writes it: `captured` bytes of a call that moved `len`.
fn data_event(sk: u64, s: usize, ts: u64, enter: u64, dir: u8, syscall: Syscall, v6: bool) -> DataEvent {
    let mut ev = DataEvent {
        hdr: hdr(EventKind::Data, ts),
        sk,
        enter_ns: enter,
        fd: 7,
        dir,
        syscall: syscall as u8,
        family: if v6 { AF_INET6 } else { AF_INET },
        sport: 8080,
        dport: 50000 + s as u16,
        ..Default::default()
    };
    if v6 {
        ev.saddr[15] = 1;
        ev.daddr[15] = 1;
    } else {
        ev.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        ev.daddr[..4].copy_from_slice(&[127, 0, 0, 1]);
    }
    ev
}

fn check(r: &RequestRecord, ids: &mut BTreeSet<u64>) {
    assert!(ids.insert(r.id), "request {} came out twice", r.id);
    assert!(
        r.bytes_not_captured <= r.request_bytes + r.response_bytes,
        "{} bytes not captured of {} + {}",
        r.bytes_not_captured,
        r.request_bytes,
        r.response_bytes
    );
    // role, closed_by and reset are closed sets by type (crate::stream::{Role, ClosedBy, Reset}).
    // A request whose head was seen has its method, path and arrival; one probe attached in the
    // middle of has them only as inferred from its response (method, path) and as the kernel's
    // estimate at attach (arrival).
    assert_eq!(r.partial && !r.path_inferred, r.method.is_none(), "{r:?}");
    assert_eq!(r.partial && !r.path_inferred, r.path.is_none(), "{r:?}");
    assert!(!r.path_inferred || r.partial, "{r:?}");
    assert_eq!(r.partial && r.arrival_by == probe_user::stream::Arrival::Seen, r.arrival_ms.is_none(), "{r:?}");
    assert!(r.chunk_times_ms.len() as u64 <= r.chunks, "{} chunk times for {} chunks", r.chunk_times_ms.len(), r.chunks);
    // TTFT is the first content chunk; an answer sent whole with no text (EOS at once) was ready
    // when it was sent.
    let whole = r.stream != Some(true)
        && r.chunk_times_ms.is_empty()
        && r.content_complete
        && r.status.is_some_and(|s| s < 400)
        && r.stop.error.is_none();
    assert_eq!(r.ttft_ms, if whole { r.final_ms } else { r.chunk_times_ms.first().copied() }, "{r:?}");
    assert_eq!(r.chunk_gaps.is_some(), r.chunk_times_ms.len() >= 2);
    if let Some(g) = &r.chunk_gaps {
        assert!(g.p50_ms <= g.p99_ms && g.p99_ms <= g.max_ms, "{g:?}");
    }
    for t in [r.arrival_ms, r.ttfb_ms, r.ttft_ms, r.end_ms, r.final_ms, r.closed_ms]
        .into_iter()
        .flatten()
        .chain(r.chunk_times_ms.iter().copied())
    {
        assert!(t.is_finite() && t >= 0.0, "time {t} in {r:?}");
    }
    // What the recording stores is what the report reads back.
    let json = serde_json::to_string(r).expect("a request record serializes");
    let back: RequestRecord = serde_json::from_str(&json).expect("a request record reads back");
    let (a, b) = (serde_json::to_value(r).expect("to JSON"), serde_json::to_value(&back).expect("to JSON"));
    // Exactly: serde_json reads floats back bit for bit (float_roundtrip, Cargo.toml).
    assert!(a == b, "JSON round trip changed the record:\n{a}\n{b}");
}

/// The input format (fuzz/seeds.py writes it): start time u32 (ms), flags u8 (bit 0: keep
/// text), then operations, each an op byte (bits 0-1: socket, bits 2-4: what) and its fields:
/// - 0-3 data: flags u8 (bit 0 send, bits 1-3 syscall, bit 4 IPv6, bit 5 fill to the capture
///   limit, bits 6-7 uncaptured length: none, u16, u32), step u16, [uncaptured], payload (u16 + bytes)
/// - 4 tail of the socket's last call: step u16, flags u8 (bit 0: a stray one, bit 1: its
///   direction), payload (u16 + bytes)
/// - 5 socket event: what u8 (state, reset received, reset sent, other), old u8, new u8, step u16
/// - 6 take the finished requests
/// - 7 the clock steps back: u16 µs (records from another CPU)
fn run(inp: &mut Input) {
    let mut ts = u64::from(inp.u32()) * 1_000_000;
    let mut t = Tracker::new(ts, inp.u8() & 1 != 0);
    let mut ids = BTreeSet::new();
    // Each socket's last data record (for its tail record).
    let mut last: [Option<DataEvent>; SOCKETS.len()] = [None; SOCKETS.len()];
    for _ in 0..MAX_OPS {
        if inp.is_empty() {
            break;
        }
        let op = inp.u8();
        let s = usize::from(op & 3);
        let sk = SOCKETS[s];
        match (op >> 2) & 7 {
            0..=3 => {
                let flags = inp.u8();
                let step = u64::from(inp.u16()) * TICK_NS;
                let enter = ts + step / 2;
                ts += step;
                let uncaptured = match flags >> 6 {
                    1 => u32::from(inp.u16()),
                    2 => inp.u32(),
                    _ => 0,
                };
                let mut p = inp.blob(DATA_CAP).to_vec();
                if flags & 0x20 != 0 {
                    // A large call (a prompt echo): its head fills the capture limit.
                    let fill = p.last().copied().unwrap_or(b' ');
                    p.resize(DATA_CAP, fill);
                }
                let dir = if flags & 1 != 0 { DIR_SEND } else { DIR_RECV };
                let mut ev = data_event(sk, s, ts, enter, dir, SYSCALLS[usize::from(flags >> 1 & 7)], flags & 0x10 != 0);
                ev.captured = p.len() as u32;
                ev.len = ev.captured.saturating_add(uncaptured);
                t.on_data(&ev, &p);
                last[s] = Some(ev);
            }
            4 => {
                ts += u64::from(inp.u16()) * TICK_NS;
                let flags = inp.u8();
                let p = inp.blob(DATA_CAP);
                let (mut ev, p) = match last[s].take() {
                    // The kernel sends at most the call's last tail_len bytes.
                    Some(head) if flags & 1 == 0 => (head, &p[..p.len().min(tail_len(head.syscall, head.len, head.captured) as usize)]),
                    _ => {
                        let dir = if flags & 2 != 0 { DIR_SEND } else { DIR_RECV };
                        (data_event(sk, s, ts, ts, dir, Syscall::Write, false), p)
                    }
                };
                ev.hdr.ts_ns = ts;
                ev.syscall |= DATA_TAIL;
                ev.captured = p.len() as u32;
                t.on_data(&ev, p);
            }
            5 => {
                let what = [SOCK_STATE, SOCK_RESET_RECEIVED, SOCK_RESET_SENT, 9][usize::from(inp.u8() & 3)];
                let (oldstate, newstate) = (i32::from(inp.u8()), i32::from(inp.u8()));
                ts += u64::from(inp.u16()) * TICK_NS;
                t.on_sock(&SockEvent {
                    hdr: hdr(EventKind::Sock, ts),
                    skaddr: sk,
                    what,
                    oldstate,
                    newstate,
                    family: AF_INET,
                    ..Default::default()
                });
            }
            6 => {
                for r in t.take_done() {
                    check(&r, &mut ids);
                }
            }
            _ => ts = ts.saturating_sub(u64::from(inp.u16()) * 1000),
        }
    }
    t.finish();
    assert_eq!(t.in_flight(), 0, "requests left in flight after finish");
    for r in t.take_done() {
        check(&r, &mut ids);
    }
    // Every request the tracker started came out: ids are 1..=N.
    if let Some(&max) = ids.last() {
        assert_eq!(max, ids.len() as u64, "requests lost: ids {ids:?}");
    }
}

fuzz_target!(|data: &[u8]| run(&mut Input::new(data)));
