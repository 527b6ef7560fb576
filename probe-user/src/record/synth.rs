//! A synthetic recording with the mix of a real night-long trace, for the report benchmark
//! (`cargo xtask bench`): a server that maps a model file, fills the page cache from it
//! (filemap), takes major faults on it, reads it from disk (block IO), maps and unmaps
//! anonymous memory, reclaims under a memory limit, serves a few hundred streamed requests over
//! TCP, and is sampled on and off the CPU (stack records over a small set of distinct stacks),
//! with the once-a-second userspace records (stats, memory, endpoint polls). Deterministic for a
//! given event count.
use std::{io, path::Path};

use crate::{
    os::procfs::Mapping,
    record::decode::encode,
    record::samples::{EndpointPoll, Kind, LlamaProps, Mem, MemReading, Sample},
    record::{
        StackKind, StackRecord, Writer,
        records::{End, Ksyms, Maps, Meta, Module, Stats, Subsystem, SubsystemStatus, UnwindCounters, UserRecord},
    },
    stream::{RequestRecord, payload::Stop},
};
use probe_common::{
    EventHeader, EventKind, Record,
    blockio::BlockIoEvent,
    fault::{FAULT_MAJOR, FaultEvent},
    filemap::FilemapEvent,
    mem::{MEM_MEMCG_RECLAIM, MemEvent},
    mmap::MmapEvent,
    sock::{AF_INET, SOCK_STATE, SockEvent, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_ESTABLISHED, TCP_LAST_ACK, TCP_SYN_RECV},
};

/// What was written.
#[derive(Debug, Default)]
pub struct Summary {
    pub kernel_events: u64,
    pub stack_records: u64,
    pub other_records: u64,
    pub requests: u64,
    pub bytes: u64,
    pub seconds: f64,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const PID: u32 = 4242;
const START: u64 = 1_000_000_000_000;
const MODEL_INO: u64 = 777;
const MODEL_DEV: u32 = (254 << 20) | 1;
const MODEL_BASE: u64 = 0x7f00_0000_0000;
const MODEL_LEN: u64 = 4 << 30;
/// Kernel events per second of the synthetic trace.
const RATE: u64 = 20_000;

fn hdr<T: Record>(tid: u32, ts: u64) -> EventHeader {
    EventHeader { kind: T::KIND as u32, pid: PID, tid, cpu: (ts % 2) as u32, ts_ns: ts }
}

/// Write a recording of about `events` records (kernel events and stack records) to `dir`:
/// the records a trace starts with, then the events, a request every 2 s and the
/// once-a-second records among them, then the end.
pub fn write(dir: &Path, events: u64) -> io::Result<Summary> {
    let mut w = Writer::create(dir).map_err(|e| io::Error::other(format!("{e:#}")))?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut s = Summary::default();
    let secs = (events / RATE).max(1);
    s.seconds = secs as f64;
    let requests = (secs / 2).clamp(1, 400);
    let stacks = preamble(&mut w)?;

    let total_ns = secs * 1_000_000_000;
    let per_ns = total_ns / events.max(1);
    let mut next_second = START + 1_000_000_000;
    let mut next_request = 0u64;
    let mut anon: Vec<(u64, u64)> = vec![];
    let mut t = START;
    for i in 0..events {
        t += per_ns;
        // Records from other CPUs arrive up to 20 µs out of order.
        let ts = t - rng.below(20_000);
        let tid = PID + 1 + rng.below(8) as u32;
        let raw = match event(&mut rng, &mut anon, &stacks, tid, ts) {
            Event::Kernel(raw) => raw,
            Event::Stack(v) => {
                w.stack(&v)?;
                s.stack_records += 1;
                continue;
            }
        };
        w.kernel(&raw)?;
        s.kernel_events += 1;
        // A request every 2 s: its connection's TCP states and, when it ends, its record.
        if t >= START + next_request * 2_000_000_000 && next_request < requests {
            request(&mut w, &mut rng, &mut s, next_request, t)?;
            next_request += 1;
        }
        if t >= next_second {
            next_second += 1_000_000_000;
            second(&mut w, &mut s, i, t)?;
        }
    }
    w.record(&UserRecord::End(End { ts_ns: t + 1, reason: "synthetic".into() }))?;
    s.bytes = w.bytes;
    w.close()?;
    Ok(s)
}

/// The distinct stacks the samples are drawn from: 8 kernel ones, 64 user ones.
struct Stacks {
    kernel: Vec<Vec<u64>>,
    user: Vec<Vec<(i64, u64)>>,
}

/// The records a trace starts with: meta, the model's mapping, the server's module and the
/// kernel names of the stacks to come (returned).
fn preamble(w: &mut Writer) -> io::Result<Stacks> {
    w.record(&UserRecord::Meta(Box::new(Meta {
        format_version: crate::record::VERSION,
        pid: PID,
        comm: "llama-server".into(),
        cmdline: "llama-server -m /models/model.gguf".into(),
        start_ns: START,
        page_size: 4096,
        targets: vec![PID],
        block_devices: [("254:1".to_string(), "vda1".to_string())].into(),
        probes: vec![SubsystemStatus { name: Subsystem::Offcpu, live: true, ..Default::default() }],
        ..Default::default()
    })))?;
    let model = Mapping {
        start: MODEL_BASE,
        end: MODEL_BASE + MODEL_LEN,
        perms: "r--s".into(),
        offset: 0,
        major: 254,
        minor: 1,
        inode: MODEL_INO,
        path: "/models/model.gguf".into(),
    };
    w.record(&UserRecord::Maps(Maps { pid: PID, ts_ns: START, mappings: vec![model] }))?;
    w.record(&UserRecord::Module(Module { id: 0, path: "/usr/bin/llama-server".into() }))?;
    // 64 distinct user stacks, 8 kernel ones.
    let kstacks: Vec<Vec<u64>> = (0..8).map(|k| (0..12).map(|i| 0xffff_ffff_8100_0000 + k * 0x1000 + i * 0x40).collect()).collect();
    let ustacks: Vec<Vec<(i64, u64)>> = (0..64).map(|k| (0..20).map(|i| (0, 0x1000 + k * 0x100 + i * 0x10)).collect()).collect();
    let mut ksyms = vec![];
    for (k, st) in kstacks.iter().enumerate() {
        for (i, a) in st.iter().enumerate() {
            ksyms.push((
                *a,
                if i == 0 {
                    "__schedule".to_string()
                } else if k % 2 == 0 {
                    format!("io_fn_{k}_{i}")
                } else {
                    format!("fn_{k}_{i}")
                },
            ));
        }
    }
    w.record(&UserRecord::Ksyms(Ksyms { syms: ksyms }))?;
    Ok(Stacks { kernel: kstacks, user: ustacks })
}

/// One drawn record: a kernel event (raw) or a stack sample.
enum Event {
    Kernel(Vec<u8>),
    Stack(StackRecord),
}

/// The next event, drawn: 40% filemap, 10% major faults, 10% block IO, 10% mmap/munmap of
/// anonymous memory (`anon` holds what is mapped), 3% memcg reclaim, the rest stack samples.
fn event(rng: &mut Rng, anon: &mut Vec<(u64, u64)>, stacks: &Stacks, tid: u32, ts: u64) -> Event {
    let dice = rng.below(100);
    let page = rng.below(MODEL_LEN / 4096);
    Event::Kernel(match dice {
        0..=39 => encode(&FilemapEvent { hdr: hdr::<FilemapEvent>(tid, ts), ino: MODEL_INO, index: page, dev: MODEL_DEV, order: 0 }),
        40..=49 => {
            encode(&FaultEvent { hdr: hdr::<FaultEvent>(tid, ts), addr: MODEL_BASE + page * 4096, ip: 0x4010, flags: FAULT_MAJOR, _pad: 0 })
        }
        50..=59 => {
            let mut rwbs = [0u8; 8];
            rwbs[..2].copy_from_slice(b"RA");
            let lat = 50_000 + rng.below(2_000_000);
            encode(&BlockIoEvent {
                hdr: hdr::<BlockIoEvent>(tid, ts),
                dev: MODEL_DEV,
                bytes: 131072,
                sector: page * 8,
                insert_ns: ts - lat - 10_000,
                issue_ns: ts - lat,
                complete_ns: ts,
                rwbs,
                ..Default::default()
            })
        }
        60..=69 => {
            let mut m = MmapEvent { hdr: hdr::<MmapEvent>(tid, ts), enter_ns: ts - 2000, ..Default::default() };
            if anon.len() > 64 || (rng.below(2) == 0 && !anon.is_empty()) {
                let (addr, len) = anon.swap_remove(rng.below(anon.len() as u64) as usize);
                (m.op, m.addr, m.len, m.ret) = (2, addr, len, 0);
            } else {
                let addr = 0x7e00_0000_0000 + rng.below(1 << 20) * 0x10_0000;
                (m.op, m.len, m.ret, m.fd) = (1, 0x10_0000, addr as i64, -1);
                anon.push((addr, m.len));
            }
            encode(&m)
        }
        70..=72 => encode(&MemEvent {
            hdr: hdr::<MemEvent>(tid, ts),
            what: MEM_MEMCG_RECLAIM,
            begin_ns: ts - 200_000,
            nr: 32,
            ..Default::default()
        }),
        _ => {
            // A stack record: 3 in 4 on-CPU samples, the rest off-CPU waits.
            let offcpu = rng.below(4) == 0;
            let k = rng.below(8) as usize;
            let mut v = StackRecord {
                what: if offcpu { StackKind::Offcpu } else { StackKind::Cpu },
                pid: PID,
                tid,
                ts_ns: ts,
                user: stacks.user[rng.below(64) as usize].clone(),
                complete: rng.below(10) != 0,
                ..Default::default()
            };
            if offcpu {
                v.kernel = stacks.kernel[k].clone();
                v.blocked_ns = Some(100_000 + rng.below(5_000_000));
                v.wait = Some(if k.is_multiple_of(2) { "[io wait]" } else { "[lock wait]" }.into());
            }
            return Event::Stack(v);
        }
    })
}

/// Request `id`, arrived at `t`: its connection's TCP states, then its record.
fn request(w: &mut Writer, rng: &mut Rng, s: &mut Summary, id: u64, t: u64) -> io::Result<()> {
    let arrival = t - START;
    let ttft = 50.0 + rng.below(2000) as f64;
    let end = ttft + 500.0 + rng.below(1000) as f64;
    let port = 40000 + (id % 20000) as u16;
    let sk = 0xffff_8880_0000_0000 + id * 0x1000;
    let sock = |old: i32, new: i32, dt: u64| {
        let mut e = SockEvent {
            hdr: hdr::<SockEvent>(PID + 1, t + dt),
            skaddr: sk,
            what: SOCK_STATE,
            oldstate: old,
            newstate: new,
            family: AF_INET,
            sport: 8080,
            dport: port,
            in_target: 1,
            ..Default::default()
        };
        e.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        e.daddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        encode(&e)
    };
    let end_ns = (end * 1e6) as u64;
    for (old, new, dt) in [
        (TCP_SYN_RECV, TCP_ESTABLISHED, 0),
        (TCP_ESTABLISHED, TCP_CLOSE_WAIT, end_ns),
        (TCP_CLOSE_WAIT, TCP_LAST_ACK, end_ns + 1000),
        (TCP_LAST_ACK, TCP_CLOSE, end_ns + 50_000),
    ] {
        w.kernel(&sock(old, new, dt))?;
        s.kernel_events += 1;
    }
    let chunks = 64 + rng.below(192);
    let q = RequestRecord {
        id,
        pid: PID,
        local: "127.0.0.1:8080".into(),
        peer: format!("127.0.0.1:{port}"),
        role: crate::stream::Role::Server,
        method: Some("POST".into()),
        path: Some("/v1/chat/completions".into()),
        status: Some(200),
        stream: Some(true),
        arrival_ms: Some(arrival as f64 / 1e6),
        ttft_ms: Some(ttft),
        end_ms: Some(end),
        chunks,
        chunk_times_ms: (0..chunks).map(|c| ttft + (end - ttft) * c as f64 / chunks as f64).collect(),
        stop: Stop {
            finish_reason: Some(if id.is_multiple_of(5) { "length" } else { "stop" }.into()),
            done_marker: true,
            ..Default::default()
        },
        closed_by: crate::stream::ClosedBy::Client,
        reset: crate::stream::Reset::None,
        content_complete: true,
        transport_complete: true,
        ..Default::default()
    };
    w.record(&UserRecord::Request(Box::new(q)))?;
    s.requests += 1;
    s.other_records += 1;
    Ok(())
}

/// The once-a-second records at `t` (after `i` events): stats, memory, an endpoint poll.
fn second(w: &mut Writer, s: &mut Summary, i: u64, t: u64) -> io::Result<()> {
    w.record(&UserRecord::Stats(Box::new(Stats {
        ts_ns: t,
        lost: EventKind::ALL.iter().map(|k| (k.name().to_string(), 0)).collect(),
        counters: [("user_faults".to_string(), i / 2)].into(),
        unwind: UnwindCounters {
            samples: s.stack_records,
            complete: s.stack_records * 9 / 10,
            ns: s.stack_records * 9000,
            load_ns: 30_000_000,
            ..Default::default()
        },
        ..Default::default()
    })))?;
    let mem = Mem {
        rss_kib: Some(900_000),
        mem_available_kib: Some(20_000_000),
        pgmajfault: i / 10,
        psi_some_us: Some(i),
        psi_full_us: Some(i / 2),
        ..Default::default()
    };
    w.sample(&Sample::Mem(MemReading { ts_ns: t, mem }))?;
    w.sample(&Sample::Endpoint(EndpointPoll {
        ts_ns: t,
        kind: Kind::LlamaCpp,
        addr: "127.0.0.1:8080".into(),
        props: Some(LlamaProps { is_sleeping: Some(false), total_slots: Some(4), ..Default::default() }),
        metrics: Some([("llamacpp:requests_deferred".to_string(), 0.0)].into()),
        ..Default::default()
    }))?;
    s.other_records += 3;
    Ok(())
}
