//! The recording directory's event log, `events.bin` (format v2; v1 still reads; both are
//! documented in docs/recording.md).
//!
//! A file header (`PROBEREC`, version u32, flags u32) then frames. v2 frames are
//! `varint len | u8 type | payload`. A kernel record (type 1) is stored compactly: `u8 kind |
//! zigzag varint ts delta from the previous kernel record | varint pid | zigzag varint tid - pid |
//! varint cpu | body`, the body of a fixed-size record cut into 8-byte words, each XOR the same
//! word of the previous record of its kind ([`Chain`]), up to the last nonzero one. Type 2 is one
//! JSON object written by userspace (typed in [`records`]); type 3 one stack sample, binary
//! ([`StackRecord`]). v1 frames were `u32 len | u16 type | u16 0 | payload`, kernel records whole.
//!
//! The writer flushes at least once a second, so a `probe` killed by SIGKILL leaves a readable
//! file. The [`Reader`] streams frames (memory does not grow with the file), keeps every whole
//! frame and reports a torn tail or a corrupt frame instead of failing.
use probe_common::EventHeader;

use self::{decode::Event, problem::Problem};

pub mod decode;
pub mod problem;
pub mod records;
pub mod samples;
pub mod synth;

mod compact;
mod reader;
mod recording;
mod stack;
mod writer;

pub use self::{compact::*, reader::*, recording::*, stack::*, writer::*};

pub const FILE_NAME: &str = crate::util::output::RECORDING_FILE;
pub const MAGIC: &[u8; 8] = b"PROBEREC";
/// The format this probe writes.
pub const VERSION: u32 = 2;
/// Whole passes over a recording made by this process: readers that reached the end. Every
/// command reads `events.bin` at most twice (crate::analysis); `PROBE_COUNT_PASSES=1` makes the
/// binary print this count at exit, for the test that holds it to that.
pub static PASSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// The oldest format this probe reads.
pub const OLDEST: u32 = 1;
pub const FRAME_KERNEL: u8 = 1;
pub const FRAME_JSON: u8 = 2;
/// Every `type` of userspace (JSON) record probe writes, in docs/recording.md's order: the
/// record types ([`records::RecordType`]) but v1's `stack`, the last. The docs test checks the
/// page against this list, and every real trace in the test suite checks that its recording
/// holds no other.
pub const USER_RECORD_TYPES: [&str; 21] = {
    let mut out = [""; 21];
    let mut i = 0;
    while i < out.len() {
        out[i] = records::RecordType::WORDS[i];
        i += 1;
    }
    out
};
const _: () = assert!(records::RecordType::WORDS.len() == USER_RECORD_TYPES.len() + 1);
/// v2: one unwound stack sample ([`StackRecord`]), binary.
pub const FRAME_STACK: u8 = 3;
/// No frame is larger than this; a larger length means the file is corrupt. The writer refuses
/// larger JSON records (see [`Writer::json`]).
pub const MAX_FRAME: u32 = 16 << 20;
const HEADER: usize = size_of::<EventHeader>();

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

/// A varint from the front of `b`, and the rest.
#[inline]
fn take_varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &c) in b.iter().enumerate().take(10) {
        v |= u64::from(c & 0x7f) << (7 * i);
        if c & 0x80 == 0 {
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

/// A recording of one userspace record (header and frame): appended to joined segments, it
/// reads as their last record (the `end` of an incident).
pub fn standalone(r: &records::UserRecord) -> Vec<u8> {
    let body = r.to_json().unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + 32);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    put_varint(&mut out, body.len() as u64);
    out.push(FRAME_JSON);
    out.extend_from_slice(&body);
    out
}

/// The first record of `joined` when it is a JSON one (a recording's meta record), and the
/// bytes after it.
fn first_frame(joined: &[u8]) -> Option<(records::Meta, &[u8])> {
    let frames = joined.get(16..)?;
    let (len, rest) = take_varint(frames)?;
    let (&ty, rest) = rest.split_first()?;
    let body = rest.get(..len as usize)?;
    if ty != FRAME_JSON || joined[..8] != MAGIC[..] {
        return None;
    }
    match records::UserRecord::parse(body).ok()? {
        records::UserRecord::Meta(m) => Some((*m, &rest[len as usize..])),
        _ => None,
    }
}

/// Stream the stack samples of the recording in `dir` to `f`, with the meta record read before
/// them (None in a recording without one): memory does not grow with the samples.
pub fn for_each_stack(dir: &std::path::Path, mut f: impl FnMut(Option<&records::Meta>, &StackRecord)) -> Result<(), ReadError> {
    let mut r = Reader::open(dir)?;
    let mut meta = None;
    while let Some(frame) = r.next_frame() {
        match frame {
            Frame::Stack(s) => f(meta.as_ref(), &s),
            Frame::Json(b) => match records::UserRecord::parse(&b) {
                Ok(records::UserRecord::Meta(m)) if meta.is_none() => meta = Some(*m),
                Ok(records::UserRecord::Stack(s)) => f(meta.as_ref(), &s),
                _ => {}
            },
            Frame::Kernel(_) => {}
        }
    }
    Ok(())
}

/// The meta record at the start of a recording in memory (a window of `probe watch`).
pub fn first_meta(joined: &[u8]) -> Option<records::Meta> {
    Some(first_frame(joined)?.0)
}

/// `joined` (a recording, or segments joined) with its first record, a JSON one (the meta
/// record of a segment), changed by `f`. None when it does not start with a JSON record.
pub fn with_meta(joined: &[u8], f: impl FnOnce(&mut records::Meta)) -> Option<Vec<u8>> {
    let (mut m, after) = first_frame(joined)?;
    f(&mut m);
    let body2 = records::UserRecord::Meta(Box::new(m)).to_json().ok()?;
    let mut out = Vec::with_capacity(joined.len() + 32);
    out.extend_from_slice(&joined[..16]);
    put_varint(&mut out, body2.len() as u64);
    out.push(FRAME_JSON);
    out.extend_from_slice(&body2);
    out.extend_from_slice(after);
    Some(out)
}

/// Why the writer stopped writing events: the disk refused more. Everything before it is on
/// disk, ending on a whole frame; later records are counted ([`Writer::dropped`]), not written.
#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use probe_common::{EventHeader, EventKind, fault::FaultEvent, mmap::MmapEvent};

    use super::StackKind;

    /// A recording of one JSON record and three faults; and the byte offset where each frame ends.
    fn sample(dir: &Path) -> (Vec<u8>, Vec<usize>) {
        let mut w = Writer::create(dir).unwrap();
        let mut ends = vec![];
        w.json(&serde_json::json!({"type": "meta", "pid": 1})).unwrap();
        ends.push(w.bytes as usize);
        for i in 0..3u64 {
            let ev = FaultEvent {
                hdr: EventHeader { kind: EventKind::Fault as u32, pid: 1, tid: 1, cpu: 0, ts_ns: 1_000_000 + i * 5000 },
                addr: 0x7f00_0000_1000 * (i + 1),
                ..Default::default()
            };
            w.kernel(&decode::encode(&ev)).unwrap();
            ends.push(w.bytes as usize);
        }
        w.flush().unwrap();
        (std::fs::read(dir.join(FILE_NAME)).unwrap(), ends)
    }

    /// `probe watch`'s segments: each starts with the context (meta, latest maps, modules) and
    /// reads alone; joined end to end they read as one recording, chains restarting at each
    /// header, every event kept.
    #[test]
    fn rotated_segments_read_alone_and_joined() {
        let dir = std::env::temp_dir().join(format!("probe-segments-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = crate::util::output::OutDir::create_recording(&dir, false).unwrap();
        let mut w = Writer::create_file(out.create("a.bin").unwrap()).unwrap();
        w.keep_context();
        w.json(&serde_json::json!({"type": "meta", "pid": 1, "start_ns": 5})).unwrap();
        w.json(&serde_json::json!({"type": "maps", "pid": 1, "mappings": [], "ts_ns": 1})).unwrap();
        w.json(&serde_json::json!({"type": "maps", "pid": 1, "mappings": [], "ts_ns": 2})).unwrap();
        w.json(&serde_json::json!({"type": "module", "id": 3, "path": "/x"})).unwrap();
        let fault = |i: u64| {
            decode::encode(&FaultEvent {
                hdr: EventHeader { kind: EventKind::Fault as u32, pid: 1, tid: 1, cpu: 0, ts_ns: 1_000_000 + i * 5000 },
                addr: 0x7f00_0000_1000 * (i + 1),
                ..Default::default()
            })
        };
        for i in 0..3 {
            w.kernel(&fault(i)).unwrap();
        }
        w.stack(&StackRecord { what: StackKind::Cpu, pid: 1, tid: 1, ts_ns: 2_000_000, user: vec![(3, 0x10)], ..Default::default() })
            .unwrap();
        w.json(&serde_json::json!({"type": "request", "id": 1})).unwrap();
        // The latest stats and samplers' records, after the mappings in their types' words' order.
        w.json(&serde_json::json!({"type": "stats", "ts_ns": 4})).unwrap();
        w.json(&serde_json::json!({"type": "gpu", "ts_ns": 4})).unwrap();
        w.sample(&samples::Sample::Cpufreq(samples::CpuFreqReading { ts_ns: 4, cur_khz: vec![] })).unwrap();
        w.rotate(out.create("b.bin").unwrap()).unwrap();
        for i in 3..6 {
            w.kernel(&fault(i)).unwrap();
        }
        w.stack(&StackRecord { what: StackKind::Cpu, pid: 1, tid: 1, ts_ns: 3_000_000, user: vec![(3, 0x20)], ..Default::default() })
            .unwrap();
        drop(w);
        let read = |b: &[u8]| {
            let mut r = Reader::new(b, Some(b.len() as u64), "x").unwrap();
            let mut types = vec![];
            let mut faults = vec![];
            while let Some(f) = r.next_frame() {
                match f {
                    Frame::Json(j) => {
                        types.push(serde_json::from_slice::<serde_json::Value>(&j).unwrap()["type"].as_str().unwrap().to_string())
                    }
                    Frame::Kernel(decode::Event::Fault(f)) => faults.push(f.addr),
                    Frame::Kernel(_) => {}
                    Frame::Stack(s) => types.push(format!("stack@{}", s.ts_ns)),
                }
            }
            assert!(r.finish().is_empty());
            (types, faults)
        };
        let b = std::fs::read(dir.join("b.bin")).unwrap();
        let (types, faults) = read(&b);
        assert_eq!(
            types,
            ["meta", "module", "maps", "cpufreq", "gpu", "stats", "stack@3000000"],
            "the second segment starts with the context, once"
        );
        assert_eq!(faults, (3..6).map(|i| 0x7f00_0000_1000 * (i + 1)).collect::<Vec<u64>>());
        let mut joined = std::fs::read(dir.join("a.bin")).unwrap();
        joined.extend_from_slice(&b);
        joined.extend_from_slice(&standalone(&records::UserRecord::End(records::End { ts_ns: 0, reason: "x".into() })));
        let (types, faults) = read(&joined);
        assert_eq!(faults.len(), 6);
        assert_eq!(types.iter().filter(|t| t.starts_with("stack@")).count(), 2);
        assert_eq!(types.last().map(String::as_str), Some("end"));
        // The window's start goes into its first (meta) record; the rest reads the same.
        let patched = with_meta(&joined, |m| m.window_start_ns = Some(7)).unwrap();
        assert_eq!(read(&patched).1, faults);
        let rec = parse(&patched, "x").unwrap();
        assert_eq!(rec.meta().and_then(|m| m.window_start_ns), Some(7));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_oversized_record_is_dropped_and_counted_not_fatal() {
        let dir = std::env::temp_dir().join(format!("probe-rec-oversized-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = Writer::create(&dir).unwrap();
        w.json(&serde_json::json!({"type": "meta", "pid": 1})).unwrap();
        let huge = "x".repeat(MAX_FRAME as usize + 1);
        w.json(&serde_json::json!({"type": "maps", "pid": 1, "mappings": [huge]})).unwrap();
        w.json_bytes(&vec![b' '; MAX_FRAME as usize + 1]).unwrap();
        w.json(&serde_json::json!({"type": "end", "ts_ns": 2, "reason": "x"})).unwrap();
        assert_eq!(w.dropped, Dropped { oversized: 2, disk_full: 0 });
        w.close().unwrap();
        let rec = read_dir(&dir).unwrap();
        assert_eq!(rec.records.len(), 2);
        assert!(rec.problems.is_empty(), "{:?}", rec.problems);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cut_write_keeps_only_whole_frames() {
        let dir = std::env::temp_dir().join(format!("probe-rec-cut-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (bytes, ends) = sample(&dir);
        // The buffer as written after the header: one JSON frame then three kernel frames.
        for cut in 16..=bytes.len() {
            let (whole, frames, events) = whole_frames(&bytes, cut, true);
            let expect = ends.iter().filter(|&&e| e <= cut).count();
            assert_eq!(frames, expect, "cut at {cut}");
            assert_eq!(whole, if expect == 0 { 16 } else { ends[expect - 1] }, "cut at {cut}");
            assert_eq!(events, expect.saturating_sub(1), "cut at {cut}");
        }
        let (_, frames, _) = whole_frames(&bytes[16..], bytes.len() - 16, false);
        assert_eq!(frames, 4);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn reads_back_what_was_written() {
        let dir = std::env::temp_dir().join(format!("probe-rec-{}", std::process::id()));
        let (bytes, ends) = sample(&dir);
        let rec = parse(&bytes, "x").unwrap();
        assert_eq!(rec.events.len(), 3);
        assert_eq!(rec.records.len(), 1);
        assert!(rec.problems.is_empty(), "{:?}", rec.problems);
        let Event::Fault(f) = rec.events[2] else { panic!() };
        assert_eq!((f.hdr.ts_ns, f.addr, f.hdr.pid, f.hdr.tid), (1_010_000, 0x7f00_0000_1000 * 3, 1, 1));

        // Every truncation keeps all whole frames before it and says what was cut.
        for cut in 17..bytes.len() {
            let r = parse(&bytes[..cut], "x").unwrap();
            let whole = ends.iter().filter(|&&e| e <= cut).count();
            assert_eq!(r.records.len() + r.events.len(), whole, "cut at {cut}");
            assert_eq!(r.problems.len(), usize::from(!ends.contains(&cut)), "cut at {cut}: {:?}", r.problems);
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn corrupt_frames_and_bad_files_are_reported() {
        let dir = std::env::temp_dir().join(format!("probe-rec-c-{}", std::process::id()));
        let (mut bytes, ends) = sample(&dir);
        // The second frame's type byte (after a one-byte length).
        bytes[ends[0] + 1] = 9;
        let r = parse(&bytes, "x").unwrap();
        assert_eq!(r.events.len(), 0);
        assert_eq!(r.records.len(), 1);
        assert!(r.problems[0].to_string().contains(&format!("corrupt frame at byte {}", ends[0])), "{:?}", r.problems);
        assert!(matches!(parse(b"hello world, not a recording", "x"), Err(ReadError::BadMagic { .. })));
        assert!(matches!(parse(b"PROBE", "x"), Err(ReadError::BadMagic { .. })));
        let mut future = bytes.clone();
        future[8..12].copy_from_slice(&(VERSION + 1).to_ne_bytes());
        let e = parse(&future, "x").unwrap_err().to_string();
        assert!(e.contains("written by a newer probe"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn compact_records_round_trip_and_shrink() {
        let anon = MmapEvent {
            hdr: EventHeader { kind: EventKind::Mmap as u32, pid: 4242, tid: 4250, cpu: 1, ts_ns: 5_000_000_000 },
            op: 1,
            fd: -1,
            addr: 0,
            len: 1 << 20,
            ret: 0x7f12_3456_0000,
            enter_ns: 4_999_990_000,
            ..Default::default()
        };
        let mut named = anon;
        named.name[..10].copy_from_slice(b"model.gguf");
        named.ino = 77;
        // The next anonymous map a little later, a little higher: what churn looks like.
        let mut next = anon;
        next.hdr.ts_ns += 7_000;
        next.enter_ns += 7_000;
        next.ret += 0x10_0000;
        // Out of order by a little (records from other CPUs): a negative time delta.
        let mut early = next;
        early.hdr.ts_ns -= 9_000;
        let (mut w, mut r) = (Chain::default(), Chain::default());
        let mut sizes = vec![];
        for ev in [anon, named, anon, next, early] {
            let raw = decode::encode(&ev);
            let mut out = vec![];
            compact(&raw, &mut w, &mut out).unwrap();
            assert_eq!(expand(&out, &mut r).unwrap(), raw);
            sizes.push(out.len());
        }
        assert!(sizes[0] < 48, "an anonymous mmap takes {} bytes, not {}: {sizes:?}", sizes[0], size_of::<MmapEvent>());
        assert!(sizes[3] < 24, "the next one in a churn takes {}: {sizes:?}", sizes[3]);
        // A cut record never expands.
        let mut out = vec![];
        compact(&decode::encode(&next), &mut Chain::default(), &mut out).unwrap();
        for cut in 0..out.len() {
            assert!(expand(&out[..cut], &mut Chain::default()).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn a_long_recording_keeps_its_end_in_memory_and_says_so() {
        let dir = std::env::temp_dir().join(format!("probe-rec-keep-{}", std::process::id()));
        let mut w = Writer::create(&dir).unwrap();
        for i in 0..10u64 {
            let ev =
                FaultEvent { hdr: EventHeader { kind: EventKind::Fault as u32, pid: 1, tid: 1, cpu: 0, ts_ns: i }, ..Default::default() };
            w.kernel(&decode::encode(&ev)).unwrap();
            w.stack(&StackRecord { pid: 1, tid: 1, ts_ns: i, user: vec![(0, i)], ..Default::default() }).unwrap();
        }
        w.flush().unwrap();
        let bytes = std::fs::read(dir.join(FILE_NAME)).unwrap();
        let rec = Recording::collect_keeping(Reader::new(&bytes[..], None, "x").unwrap(), 4, 3);
        assert_eq!(rec.events.iter().map(|e| e.header().ts_ns).collect::<Vec<_>>(), [6, 7, 8, 9]);
        assert_eq!(rec.stacks.iter().map(|s| s.ts_ns).collect::<Vec<_>>(), [7, 8, 9]);
        assert_eq!((rec.events_not_kept, rec.stacks_not_kept), (6, 7));
        assert!(rec.problems[0].to_string().contains("last 4 kernel events and 3 stack samples"), "{:?}", rec.problems);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The OS reason is said once, with the path, however the error is printed.
    #[test]
    fn a_missing_recording_says_why_once() {
        let e = anyhow::Error::new(read_dir(std::path::Path::new("/nonexistent-probe-recording")).unwrap_err())
            .context("cannot read the recording");
        let text = format!("{e:#}");
        assert_eq!(text.matches("No such file or directory").count(), 1, "{text}");
        assert!(text.contains("/nonexistent-probe-recording/events.bin"), "{text}");
    }

    #[test]
    fn stack_samples_round_trip() {
        let s = StackRecord {
            what: StackKind::Offcpu,
            pid: 10,
            tid: 9,
            ts_ns: 1_000_000,
            user: vec![(0, 0x1234), (2, 0x10), (-1, 0x7fff_0000_1000)],
            kernel: vec![0xffff_ffff_8100_0000, 0xffff_ffff_8000_0010],
            complete: true,
            addr: 0,
            state: 2,
            wait: Some("[io wait]".into()),
            blocked_ns: Some(12345),
            still_blocked: true,
            waker: Some(4_194_303),
            cut: None,
            user_not_read: 0,
        };
        let mut out = vec![];
        s.encode(999_000, &mut out);
        assert_eq!(StackRecord::decode(&out, 999_000), Some(s.clone()));
        // Each reason a stack was cut comes back.
        for cut in Cut::ALL {
            let c = StackRecord { complete: false, cut: Some(cut), ..s.clone() };
            let mut b = vec![];
            c.encode(999_000, &mut b);
            assert_eq!(StackRecord::decode(&b, 999_000), Some(c));
        }
        // Counted, not read: the same record without its user frames' addresses (but for an
        // off-CPU stack's, which name where a thread waited).
        assert_eq!(StackRecord::decode_with(&out, 999_000, false), Some(s.clone()));
        let cpu = StackRecord { what: StackKind::Cpu, ..s.clone() };
        let mut out = vec![];
        cpu.encode(999_000, &mut out);
        let counted = StackRecord::decode_with(&out, 999_000, false).unwrap();
        assert_eq!((counted.user.len(), counted.user_depth()), (0, 3));
        assert_eq!(StackRecord { user: s.user.clone(), user_not_read: 0, ..counted }, cpu);
        assert!(out.len() < 60, "{} bytes", out.len());
        // Cut anywhere: never a panic, never a wrong record.
        for cut in 0..out.len() {
            assert_eq!(StackRecord::decode(&out[..cut], 999_000), None, "cut at {cut}");
        }
    }

    #[test]
    fn version_1_recordings_still_read() {
        let mut v1 = MAGIC.to_vec();
        v1.extend_from_slice(&1u32.to_ne_bytes());
        v1.extend_from_slice(&0u32.to_ne_bytes());
        let ev = FaultEvent {
            hdr: EventHeader { kind: EventKind::Fault as u32, pid: 3, tid: 4, cpu: 0, ts_ns: 9 },
            addr: 5,
            ..Default::default()
        };
        let raw = decode::encode(&ev);
        v1.extend_from_slice(&(raw.len() as u32).to_ne_bytes());
        v1.extend_from_slice(&1u16.to_ne_bytes());
        v1.extend_from_slice(&0u16.to_ne_bytes());
        v1.extend_from_slice(&raw);
        let r = parse(&v1, "x").unwrap();
        assert_eq!(r.events, vec![Event::Fault(ev)]);
        assert!(r.problems.is_empty());
    }
}
