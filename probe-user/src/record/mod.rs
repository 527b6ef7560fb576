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
use std::{
    fs::File,
    io::{self, BufRead, BufReader, Write},
    path::Path,
};

use probe_common::{EventHeader, EventKind};

use self::{decode::Event, problem::Problem};

pub mod decode;
pub mod problem;
pub mod records;
pub mod samples;
pub mod synth;

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
/// Every `type` of userspace (JSON) record probe writes, in docs/recording.md's order. The docs
/// test checks the page against this list, and every real trace in the test suite checks that
/// its recording holds no other.
pub const USER_RECORD_TYPES: [&str; 21] = [
    "meta",
    "maps",
    "files",
    "module",
    "ksyms",
    "pyframes",
    "threads",
    "procs",
    "request",
    "stats",
    "samplers",
    "gpu",
    "cpufreq",
    "mem",
    "cpuidle",
    "residency",
    "endpoint",
    "attach",
    "end",
    "cut_frames",
    "warm_baseline",
];
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

/// One stack sample as the collector unwound it: user frames as (module id, file offset) with the
/// module table in `module` records, kernel addresses named by `ksyms` records. In v1
/// recordings it was a JSON record of `type: "stack"` with these fields.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StackRecord {
    pub what: StackKind,
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// Innermost first; module -1 for an address in no known module.
    #[serde(default)]
    pub user: Vec<(i64, u64)>,
    /// Innermost first.
    #[serde(default)]
    pub kernel: Vec<u64>,
    /// Unwound to the end of the stack.
    #[serde(default)]
    pub complete: bool,
    /// Fault and IO stacks: the address or sector; 0 otherwise.
    #[serde(default)]
    pub addr: u64,
    /// Off-CPU stacks: the task state at the switch.
    #[serde(default)]
    pub state: u32,
    /// Off-CPU stacks: the class of the wait (crate::analysis::ksyms::WAITS), decided at trace time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<String>,
    /// Off-CPU stacks: how long the thread stayed off the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_ns: Option<u64>,
    /// Still off the CPU when the trace ended (blocked_ns runs to the end).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub still_blocked: bool,
    /// Off-CPU stacks: the target thread that woke it (tid), when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waker: Option<u32>,
    /// Why the user stack stops short of its end, when it does (recordings before this: None).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
    /// User frames the reader counted and left undecoded (its `user_frames` off: a report
    /// needs their number, never their addresses); `user` is empty then.
    #[serde(skip)]
    pub user_not_read: u32,
}

impl StackRecord {
    /// How many user frames the stack has, read or not.
    pub fn user_depth(&self) -> usize {
        self.user.len() + self.user_not_read as usize
    }
}

crate::closed_set! {
    /// What a stack sample is of (serialized as today's words).
    StackKind {
        /// On-CPU samples at the sampling frequency.
        #[default]
        Cpu = "cpu",
        /// Blocked time: the stack at the switch-out, weighted by the time off the CPU.
        Offcpu = "offcpu",
        /// Major page faults.
        Fault = "fault",
        /// Block IO requests, at issue.
        Io = "io",
    }
}

/// Why unwinding stopped before the end of a user stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cut {
    /// The copied stack bytes ran out (a larger copy would have gone further).
    Bytes,
    /// No unwind information (CFI) for a frame.
    Cfi,
    /// A read of the stack failed (an address below the stack pointer or far past the copy).
    Read,
}

impl Cut {
    pub const ALL: [Cut; 3] = [Cut::Bytes, Cut::Cfi, Cut::Read];

    /// The words for people.
    pub fn words(self) -> &'static str {
        match self {
            Cut::Bytes => "the copied stack ran out",
            Cut::Cfi => "no unwind info for a frame",
            Cut::Read => "a stack read failed",
        }
    }

    fn bits(c: Option<Cut>) -> u8 {
        match c {
            None => 0,
            Some(Cut::Bytes) => 1,
            Some(Cut::Cfi) => 2,
            Some(Cut::Read) => 3,
        }
    }

    fn from_bits(b: u8) -> Option<Cut> {
        [None, Some(Cut::Bytes), Some(Cut::Cfi), Some(Cut::Read)][usize::from(b & 3)]
    }
}

impl StackRecord {
    /// As the JSON record v1 recordings held (and the renderers read).
    pub fn to_value(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["type"] = "stack".into();
        v
    }

    /// The binary form (frame type 3).
    fn encode(&self, prev_ts: u64, out: &mut Vec<u8>) {
        let kind = self.what as u8 + 1;
        let flags = u8::from(self.complete)
            | u8::from(self.wait.is_some()) << 1
            | u8::from(self.blocked_ns.is_some()) << 2
            | u8::from(self.still_blocked) << 3
            | Cut::bits(self.cut) << 4
            | u8::from(self.waker.is_some()) << 6;
        out.extend_from_slice(&[kind, flags]);
        put_varint(out, zigzag(self.ts_ns.wrapping_sub(prev_ts) as i64));
        put_varint(out, u64::from(self.pid));
        put_varint(out, zigzag(i64::from(self.tid) - i64::from(self.pid)));
        put_varint(out, self.addr);
        put_varint(out, u64::from(self.state));
        if let Some(w) = &self.wait {
            put_varint(out, w.len() as u64);
            out.extend_from_slice(w.as_bytes());
        }
        if let Some(b) = self.blocked_ns {
            put_varint(out, b);
        }
        if let Some(w) = self.waker {
            put_varint(out, u64::from(w));
        }
        put_varint(out, self.user.len() as u64);
        let mut prev = 0i64;
        for &(m, off) in &self.user {
            put_varint(out, zigzag(m.wrapping_sub(prev)));
            put_varint(out, off);
            prev = m;
        }
        put_varint(out, self.kernel.len() as u64);
        let mut prev = 0u64;
        for &a in &self.kernel {
            put_varint(out, zigzag(a.wrapping_sub(prev) as i64));
            prev = a;
        }
    }

    #[cfg(test)]
    fn decode(b: &[u8], prev_ts: u64) -> Option<StackRecord> {
        Self::decode_with(b, prev_ts, true)
    }

    /// `user`: decode the user frames (else count them in `user_not_read`; off-CPU stacks' always).
    fn decode_with(b: &[u8], prev_ts: u64, user: bool) -> Option<StackRecord> {
        fn string(b: &[u8]) -> Option<(String, &[u8])> {
            let (n, b) = take_varint(b)?;
            let n = usize::try_from(n).ok().filter(|&n| n <= b.len())?;
            Some((String::from_utf8(b[..n].to_vec()).ok()?, &b[n..]))
        }
        let (&[kind, flags], b) = b.split_first_chunk::<2>()?;
        let (dts, b) = take_varint(b)?;
        let (pid, b) = take_varint(b)?;
        let (dtid, b) = take_varint(b)?;
        let (addr, b) = take_varint(b)?;
        let (state, mut b) = take_varint(b)?;
        let mut s = StackRecord {
            ts_ns: prev_ts.wrapping_add(unzigzag(dts) as u64),
            pid: u32::try_from(pid).ok()?,
            tid: u32::try_from(pid as i64 + unzigzag(dtid)).ok()?,
            addr,
            state: u32::try_from(state).ok()?,
            complete: flags & 1 != 0,
            still_blocked: flags & 8 != 0,
            cut: Cut::from_bits(flags >> 4),
            ..Default::default()
        };
        s.what = *StackKind::ALL.get(usize::from(kind).checked_sub(1)?)?;
        // Off-CPU stacks' frames name where a thread waited on a request's critical path, which
        // every report has.
        let user = user || s.what == StackKind::Offcpu;
        if flags & 2 != 0 {
            let (w, rest) = string(b)?;
            s.wait = Some(w);
            b = rest;
        }
        if flags & 4 != 0 {
            let (v, rest) = take_varint(b)?;
            s.blocked_ns = Some(v);
            b = rest;
        }
        if flags & 64 != 0 {
            let (v, rest) = take_varint(b)?;
            s.waker = Some(u32::try_from(v).ok()?);
            b = rest;
        }
        let (n, mut b) = take_varint(b)?;
        // Every frame takes at least two bytes: a count beyond that is corruption.
        if n > b.len() as u64 {
            return None;
        }
        if user {
            s.user.reserve_exact(n as usize);
        } else {
            s.user_not_read = u32::try_from(n).ok()?;
        }
        let mut prev = 0i64;
        for _ in 0..n {
            let (dm, rest) = take_varint(b)?;
            let (off, rest) = take_varint(rest)?;
            if user {
                prev = prev.wrapping_add(unzigzag(dm));
                s.user.push((prev, off));
            }
            b = rest;
        }
        let (n, mut b) = take_varint(b)?;
        if n > b.len() as u64 {
            return None;
        }
        s.kernel.reserve_exact(n as usize);
        let mut prev = 0u64;
        for _ in 0..n {
            let (d, rest) = take_varint(b)?;
            prev = prev.wrapping_add(unzigzag(d) as u64);
            s.kernel.push(prev);
            b = rest;
        }
        b.is_empty().then_some(s)
    }
}

/// Fixed-size records are stored word by word, XOR the previous record of their kind; the
/// variable-length ones (a fixed part then a tail whose length the fixed part gives) whole, and
/// the engine's steps (272 bytes, mostly per-sequence arrays, one per decode step) whole too.
fn chained(kind: EventKind) -> bool {
    !matches!(kind, EventKind::Data | EventKind::Stack | EventKind::Engine | EventKind::PyStack)
}

/// What a compact record is relative to: the previous kernel record's time, and per kind the
/// previous record's body. Writer and reader keep the same chain.
#[derive(Default)]
pub struct Chain {
    ts: u64,
    prev: Vec<Vec<u8>>,
}

impl Chain {
    fn prev(&mut self, kind: EventKind) -> &mut Vec<u8> {
        let i = kind as usize;
        if self.prev.len() <= i {
            self.prev.resize(i + 1, vec![]);
        }
        let p = &mut self.prev[i];
        p.resize(kind.record_size() - HEADER, 0);
        p
    }
}

/// The most 8-byte words a fixed-size record's body has (mmap: 128 bytes).
const MAX_WORDS: usize = 16;
const _: () = {
    let mut i = 0;
    while i < EventKind::ALL.len() {
        let k = EventKind::ALL[i];
        assert!(
            matches!(k, EventKind::Data | EventKind::Stack | EventKind::Engine | EventKind::PyStack)
                || k.record_size() - HEADER <= MAX_WORDS * 8
        );
        i += 1;
    }
};

fn word(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    let part = &b[(i * 8).min(b.len())..((i + 1) * 8).min(b.len())];
    w[..part.len()].copy_from_slice(part);
    u64::from_ne_bytes(w)
}

/// The compact form of one raw kernel record, appended to `out`; the chain moves on.
pub fn compact(record: &[u8], chain: &mut Chain, out: &mut Vec<u8>) -> Option<()> {
    let kind = decode::kind_of(record).ok()?;
    let hdr = record.get(..HEADER)?;
    let field = |i: usize| u32::from_ne_bytes(hdr[i..i + 4].try_into().unwrap_or_default());
    let (pid, tid, cpu) = (field(4), field(8), field(12));
    let ts = u64::from_ne_bytes(hdr[16..24].try_into().unwrap_or_default());
    out.push(kind as u32 as u8);
    put_varint(out, zigzag(ts.wrapping_sub(chain.ts) as i64));
    put_varint(out, u64::from(pid));
    put_varint(out, zigzag(i64::from(tid) - i64::from(pid)));
    put_varint(out, u64::from(cpu));
    chain.ts = ts;
    let body = &record[HEADER..];
    if !chained(kind) {
        out.extend_from_slice(body);
        return Some(());
    }
    if body.len() != kind.record_size() - HEADER {
        return None;
    }
    let prev = chain.prev(kind);
    // On the collector's path for every event: no allocation.
    let mut words = [0u64; MAX_WORDS];
    let nw = body.len().div_ceil(8);
    for (i, w) in words[..nw].iter_mut().enumerate() {
        *w = word(body, i) ^ word(prev, i);
    }
    let n = words[..nw].iter().rposition(|&w| w != 0).map_or(0, |i| i + 1);
    put_varint(out, n as u64);
    for &w in &words[..n] {
        put_varint(out, w);
    }
    prev.copy_from_slice(body);
    Some(())
}

/// A compact record's header fields (kind, time delta, pid, tid, cpu) and its body.
type Compact<'a> = (EventKind, u64, u64, u64, u64, &'a [u8]);

fn compact_header(b: &[u8]) -> Option<Compact<'_>> {
    let (&kind, b) = b.split_first()?;
    let kind = EventKind::try_from(u32::from(kind)).ok()?;
    let (dts, b) = take_varint(b)?;
    let (pid, b) = take_varint(b)?;
    let (dtid, b) = take_varint(b)?;
    let (cpu, body) = take_varint(b)?;
    Some((kind, dts, pid, dtid, cpu, body))
}

/// A chained body's XOR words (how many, and their values); None when it is not one.
fn compact_words(kind: EventKind, mut body: &[u8]) -> Option<(usize, [u64; MAX_WORDS])> {
    let size = kind.record_size() - HEADER;
    let (n, rest) = take_varint(body)?;
    let n = usize::try_from(n).ok().filter(|&n| n <= size.div_ceil(8))?;
    body = rest;
    let mut words = [0u64; MAX_WORDS];
    for w in &mut words[..n] {
        let (v, rest) = take_varint(body)?;
        *w = v;
        body = rest;
    }
    body.is_empty().then_some((n, words))
}

/// The raw record back from its compact form; the chain moves on.
#[cfg(test)]
fn expand(b: &[u8], chain: &mut Chain) -> Option<Vec<u8>> {
    let mut rec = Vec::new();
    expand_into(b, chain, &mut rec).then_some(rec)
}

/// [`expand`] into `rec` (cleared first): false when the record is not whole.
fn expand_into(b: &[u8], chain: &mut Chain, rec: &mut Vec<u8>) -> bool {
    let Some((kind, dts, pid, dtid, cpu, body)) = compact_header(b) else { return false };
    let ts = chain.ts.wrapping_add(unzigzag(dts) as u64);
    let (Ok(tid), Ok(pid32), Ok(cpu)) = (u32::try_from(pid as i64 + unzigzag(dtid)), u32::try_from(pid), u32::try_from(cpu)) else {
        return false;
    };
    rec.clear();
    rec.extend_from_slice(&(kind as u32).to_ne_bytes());
    rec.extend_from_slice(&pid32.to_ne_bytes());
    rec.extend_from_slice(&tid.to_ne_bytes());
    rec.extend_from_slice(&cpu.to_ne_bytes());
    rec.extend_from_slice(&ts.to_ne_bytes());
    if !chained(kind) {
        rec.extend_from_slice(body);
        chain.ts = ts;
        return true;
    }
    let Some((_, words)) = compact_words(kind, body) else { return false };
    let size = kind.record_size() - HEADER;
    chain.ts = ts;
    let prev = chain.prev(kind);
    for (i, x) in words[..size.div_ceil(8)].iter().enumerate() {
        let w = (word(prev, i) ^ x).to_ne_bytes();
        let at = i * 8;
        let len = 8.min(size - at);
        prev[at..at + len].copy_from_slice(&w[..len]);
    }
    rec.extend_from_slice(prev);
    true
}

/// A compact record of a kind the reader skips: checked as [`expand`] checks it, the time chain
/// moved on, nothing built. Its kind's XOR chain is left behind: no record of that kind is
/// expanded by this reader. The kind, when the record is whole.
fn skip_compact(b: &[u8], chain: &mut Chain) -> Option<EventKind> {
    let (kind, dts, pid, dtid, cpu, body) = compact_header(b)?;
    let ok = u32::try_from(pid as i64 + unzigzag(dtid)).is_ok() && u32::try_from(pid).is_ok() && u32::try_from(cpu).is_ok();
    if !ok || (chained(kind) && compact_words(kind, body).is_none()) {
        return None;
    }
    chain.ts = chain.ts.wrapping_add(unzigzag(dts) as u64);
    Some(kind)
}

/// A recording of one userspace record (header and frame): appended to joined segments, it
/// reads as their last record (the `end` of an incident).
pub fn standalone(r: &records::UserRecord) -> Vec<u8> {
    let body = r.to_value().and_then(|v| serde_json::to_vec(&v)).unwrap_or_default();
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
    let body2 = serde_json::to_vec(&records::UserRecord::Meta(Box::new(m)).to_value().ok()?).ok()?;
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
#[derive(Debug)]
pub struct DiskFull {
    pub error: io::Error,
    /// Events (kernel records and stack samples) written before the disk filled.
    pub events_written: u64,
}

/// Is this write error the disk refusing more bytes (full, over quota, file too big)?
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG))
}

/// What the writer did not write, by cause (each a key of the stats record's `lost` map, so every
/// report counts it).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Userspace records over [`MAX_FRAME`] (the reader would refuse the frame).
    pub oversized: u64,
    /// Records (kernel, stack, userspace) not written because the disk was full.
    pub disk_full: u64,
}

/// Buffered frames are written once this many bytes wait (and at every [`Writer::flush`]).
const BUFFER_BYTES: usize = 1 << 20;

pub struct Writer {
    file: File,
    /// Whole frames not yet written to `file`.
    buf: Vec<u8>,
    /// Bytes of `file` (whole frames only).
    on_disk: u64,
    /// Bytes of the recording, written or buffered.
    pub bytes: u64,
    chain: Chain,
    prev_stack_ts: u64,
    /// Reused buffers: writing a record allocates nothing.
    scratch: Vec<u8>,
    head: Vec<u8>,
    /// Kernel records and stack samples written or buffered.
    events: u64,
    full: Option<DiskFull>,
    /// Set once the disk filled: no kernel record or stack sample is written after it (the
    /// compact chains and the stack timestamps continue from frames that may have been cut).
    events_closed: bool,
    pub dropped: Dropped,
    /// The records a segment starts with (`probe watch`), when kept: see [`Writer::rotate`].
    context: Option<Context>,
}

/// The most bytes of growing context ([`Context::grown`]: files, kernel names, thread names)
/// kept for the segments to come; past it the oldest go.
const CONTEXT_GROWN: usize = 16 << 20;

/// What a reader needs before a segment's first event to read it alone: the meta record, each
/// process's latest mappings, every module, the files, kernel names and thread names written so
/// far, and each sampler's latest record (the state the window starts in).
#[derive(Default)]
struct Context {
    meta: Option<Vec<u8>>,
    /// (type, key) → the latest record: maps by pid, module by id, samples and stats by type.
    latest: std::collections::BTreeMap<(&'static str, i64), Vec<u8>>,
    grown: std::collections::VecDeque<Vec<u8>>,
    grown_bytes: usize,
}

impl Context {
    fn note(&mut self, r: &records::UserRecord, bytes: &[u8]) {
        use records::UserRecord as U;
        let (ty, key) = match r {
            U::Meta(_) => {
                self.meta = Some(bytes.to_vec());
                return;
            }
            U::Maps(m) => ("maps", i64::from(m.pid)),
            U::Module(m) => ("module", m.id),
            U::Files(_) | U::Ksyms(_) | U::PyFrames(_) | U::Threads(_) | U::Procs(_) => {
                self.grown_bytes += bytes.len();
                self.grown.push_back(bytes.to_vec());
                while self.grown_bytes > CONTEXT_GROWN {
                    let Some(old) = self.grown.pop_front() else { break };
                    self.grown_bytes -= old.len();
                }
                return;
            }
            U::Stats(_) => ("stats", 0),
            U::Sample(s) => (s.kind(), 0),
            U::Request(_) | U::End(_) | U::Stack(_) | U::WarmBaseline(_) | U::CutFrames(_) | U::Other(_) => return,
        };
        self.latest.insert((ty, key), bytes.to_vec());
    }

    /// The records in the order a reader wants them: meta, modules and mappings, the rest.
    fn records(&self) -> impl Iterator<Item = &Vec<u8>> {
        let first = |t: &'static str| self.latest.iter().filter(move |((ty, _), _)| *ty == t).map(|(_, b)| b);
        self.meta
            .iter()
            .chain(first("module"))
            .chain(first("maps"))
            .chain(self.grown.iter())
            .chain(self.latest.iter().filter(|((ty, _), _)| !matches!(*ty, "module" | "maps")).map(|(_, b)| b))
    }
}

impl Writer {
    /// A new recording in a new directory `dir` (see [`crate::util::output::OutDir::create_recording`]).
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        let d = crate::util::output::OutDir::create_recording(dir, false)?;
        Ok(Self::create_in(&d)?)
    }

    /// A new recording file in `dir` (0600, the caller's).
    pub fn create_in(dir: &crate::util::output::OutDir) -> io::Result<Self> {
        Self::create_file(dir.create(FILE_NAME)?)
    }

    /// A new recording in `file` (made new and empty by the caller).
    pub fn create_file(file: File) -> io::Result<Self> {
        let mut buf = Vec::with_capacity(BUFFER_BYTES + (64 << 10));
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        let mut w = Self {
            file,
            buf,
            on_disk: 0,
            bytes: 16,
            chain: Chain::default(),
            prev_stack_ts: 0,
            scratch: Vec::with_capacity(256),
            head: Vec::with_capacity(11),
            events: 0,
            full: None,
            events_closed: false,
            dropped: Dropped::default(),
            context: None,
        };
        w.flush()?;
        if let Some(f) = w.full.take() {
            return Err(f.error);
        }
        Ok(w)
    }

    /// A writer of segments (`probe watch`): it keeps what a segment must start with, and
    /// [`Writer::rotate`] goes on in a new file.
    pub fn keep_context(&mut self) {
        self.context.get_or_insert_with(Context::default);
    }

    /// Close the current file and go on in `file`, which starts with the file header and the
    /// context (see [`Context`]): each segment reads alone, and segments joined end to end
    /// read as one recording. Returns the bytes the closed file holds.
    pub fn rotate(&mut self, file: File) -> io::Result<u64> {
        self.flush()?;
        if let Some(f) = self.full.take() {
            return Err(f.error);
        }
        let closed = self.on_disk;
        self.file = file;
        self.buf.clear();
        self.buf.extend_from_slice(MAGIC);
        self.buf.extend_from_slice(&VERSION.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.on_disk = 0;
        self.bytes = 16;
        self.chain = Chain::default();
        self.prev_stack_ts = 0;
        if let Some(c) = self.context.take() {
            for r in c.records() {
                self.frame(FRAME_JSON, r)?;
            }
            self.context = Some(c);
        }
        self.flush()?;
        Ok(closed)
    }

    /// The disk filled: no event is written any more (see [`Writer::resume`]).
    pub fn disk_full(&self) -> Option<&DiskFull> {
        self.full.as_ref()
    }

    /// Try writing again after room was made (the end record and final stats after a full disk).
    /// The frame chains start again from a state the reader has (kernel records are not written
    /// after this, so only userspace records follow).
    pub fn resume(&mut self) -> Option<DiskFull> {
        self.full.take()
    }

    /// Flush, and fail if anything was not written (a full disk): for copies that must be whole.
    pub fn close(mut self) -> io::Result<()> {
        self.flush()?;
        match self.full.take() {
            Some(f) => Err(f.error),
            None => Ok(()),
        }
    }

    /// Kernel records and stack samples written so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    fn frame(&mut self, ty: u8, payload: &[u8]) -> io::Result<()> {
        if self.full.is_some() {
            self.dropped.disk_full += 1;
            return Ok(());
        }
        let mut head = std::mem::take(&mut self.head);
        head.clear();
        put_varint(&mut head, payload.len() as u64);
        head.push(ty);
        self.buf.extend_from_slice(&head);
        self.buf.extend_from_slice(payload);
        self.bytes += (head.len() + payload.len()) as u64;
        self.head = head;
        if ty != FRAME_JSON {
            self.events += 1;
        }
        if self.buf.len() >= BUFFER_BYTES { self.flush() } else { Ok(()) }
    }

    /// One raw kernel record, as the ring buffer delivered it.
    pub fn kernel(&mut self, record: &[u8]) -> io::Result<()> {
        if self.events_closed {
            self.dropped.disk_full += 1;
            return Ok(());
        }
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        compact(record, &mut self.chain, &mut buf).ok_or_else(|| io::Error::other("kernel record with a bad header or size"))?;
        let r = self.frame(FRAME_KERNEL, &buf);
        self.scratch = buf;
        r
    }

    /// One userspace record. A record over [`MAX_FRAME`] is not written (the reader would take
    /// it for corruption and lose the rest of the file): it is counted in
    /// [`Dropped::oversized`] and the trace goes on.
    pub fn record(&mut self, r: &records::UserRecord) -> io::Result<()> {
        let bytes = serde_json::to_vec(&r.to_value().map_err(io::Error::other)?).map_err(io::Error::other)?;
        if let Some(c) = self.context.as_mut()
            && bytes.len() <= MAX_FRAME as usize
        {
            c.note(r, &bytes);
        }
        self.json_bytes(&bytes)
    }

    /// A sampler's record.
    pub fn sample(&mut self, s: &samples::Sample) -> io::Result<()> {
        let bytes = serde_json::to_vec(s).map_err(io::Error::other)?;
        if let Some(c) = self.context.as_mut()
            && bytes.len() <= MAX_FRAME as usize
        {
            c.latest.insert((s.kind(), 0), bytes.clone());
        }
        self.json_bytes(&bytes)
    }

    /// A record given as JSON (tests, `probe synth`): written as given; a record of a known
    /// kind joins the context.
    pub fn json(&mut self, value: &serde_json::Value) -> io::Result<()> {
        let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
        if let Some(c) = self.context.as_mut()
            && bytes.len() <= MAX_FRAME as usize
            && let Ok(r) = records::UserRecord::from_value(value.clone())
        {
            c.note(&r, &bytes);
        }
        self.json_bytes(&bytes)
    }

    /// One unwound stack sample.
    pub fn stack(&mut self, s: &StackRecord) -> io::Result<()> {
        if self.events_closed {
            self.dropped.disk_full += 1;
            return Ok(());
        }
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        s.encode(self.prev_stack_ts, &mut buf);
        self.prev_stack_ts = s.ts_ns;
        let r = self.frame(FRAME_STACK, &buf);
        self.scratch = buf;
        r
    }

    /// One userspace record already serialized (copying a recording); over [`MAX_FRAME`]:
    /// counted, not written.
    pub fn json_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.len() > MAX_FRAME as usize {
            self.dropped.oversized += 1;
            log::warn!("a record of {} bytes is over the {MAX_FRAME}-byte frame limit: not written (counted)", bytes.len());
            return Ok(());
        }
        self.frame(FRAME_JSON, bytes)
    }

    /// Write what is buffered. A full disk is not an error here: the file is cut back to its
    /// last whole frame, what did not fit is counted in [`Dropped::disk_full`] and
    /// [`Writer::disk_full`] says so; any other write error is returned.
    pub fn flush(&mut self) -> io::Result<()> {
        let mut done = 0;
        while done < self.buf.len() {
            match self.file.write(&self.buf[done..]) {
                Ok(0) => return self.stopped(done, io::Error::from_raw_os_error(libc::ENOSPC)),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_disk_full(&e) => return self.stopped(done, e),
                Err(e) => return Err(e),
            }
        }
        self.on_disk += done as u64;
        self.buf.clear();
        Ok(())
    }

    /// The disk took `written` bytes of the buffer, then refused: keep the whole frames among
    /// them, cut the file there, count the rest.
    fn stopped(&mut self, written: usize, error: io::Error) -> io::Result<()> {
        let (whole, frames, events) = whole_frames(&self.buf, written, self.on_disk == 0);
        let (_, all_frames, all_events) = whole_frames(&self.buf, self.buf.len(), self.on_disk == 0);
        self.on_disk += whole as u64;
        self.file.set_len(self.on_disk)?;
        use std::io::Seek as _;
        self.file.seek(io::SeekFrom::Start(self.on_disk))?;
        self.dropped.disk_full += (all_frames - frames) as u64;
        self.events -= (all_events - events) as u64;
        self.bytes = self.on_disk;
        self.buf.clear();
        self.full = Some(DiskFull { error, events_written: self.events });
        self.events_closed = true;
        Ok(())
    }
}

/// What is buffered reaches the file when the writer goes (a recording cut short by an error
/// keeps its last records).
impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Of `buf` (v2 frames, after the 16-byte file header when `header`), how many leading bytes
/// up to `limit` are whole frames, how many frames that is, and how many of them are events
/// (kernel records and stack samples).
fn whole_frames(buf: &[u8], limit: usize, header: bool) -> (usize, usize, usize) {
    let mut at = if header { 16 } else { 0 };
    if at > limit {
        return (0, 0, 0);
    }
    let (mut frames, mut events) = (0, 0);
    while let Some((len, rest)) = take_varint(&buf[at..]) {
        let head = buf.len() - at - rest.len() + 1;
        let end = at + head + len as usize;
        if end > limit || rest.is_empty() {
            break;
        }
        frames += 1;
        if rest[0] != FRAME_JSON {
            events += 1;
        }
        at = end;
    }
    (at, frames, events)
}

/// One frame read back.
pub enum Frame {
    Kernel(Event),
    Stack(StackRecord),
    /// A userspace record's JSON text (parse it with serde_json, into a `Value` or a type).
    Json(Vec<u8>),
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The OS reason is part of this error's own message, not a source of its own: printed with
    /// its causes (`{:#}`), it is said once.
    #[error("cannot read {path}: {err}")]
    Io { path: String, err: io::Error },
    #[error("{path} is not a probe recording (bad magic); expected a directory written by `probe trace`")]
    BadMagic { path: String },
    #[error("{path} is recording format v{found}, written by a newer probe; this probe (v{}) reads formats v{OLDEST} to v{VERSION}: use a newer probe", env!("CARGO_PKG_VERSION"))]
    Version { path: String, found: u32 },
}

/// Frames of a recording, one at a time.
pub struct Reader<R> {
    inp: R,
    /// Kernel kinds to decode (a bit per `EventKind`); the others are checked and skipped
    /// (v2 recordings). All by default.
    pub kinds: u64,
    /// Decode the stacks' user frames (on by default); off, they are counted, not kept.
    pub user_frames: bool,
    /// The expanded record, reused.
    raw: Vec<u8>,
    /// This reader's pass was counted in [`PASSES`].
    counted: bool,
    pub version: u32,
    /// Bytes consumed so far (frame positions in problems).
    pos: u64,
    /// The file's length when known (to say how much a torn tail lost).
    len: Option<u64>,
    chain: Chain,
    prev_stack_ts: u64,
    done: bool,
    /// Human-readable problems: torn tail, corrupt frame, undecodable records (counted).
    pub problems: Vec<Problem>,
    pub undecodable: u64,
    /// Bytes on disk of the frame [`Reader::next_frame`] returned last, its head included.
    pub frame_bytes: u64,
    buf: Vec<u8>,
}

impl Reader<BufReader<File>> {
    /// Open `DIR/events.bin`.
    pub fn open(dir: &Path) -> Result<Self, ReadError> {
        let path = dir.join(FILE_NAME);
        let io = |err| ReadError::Io { path: path.display().to_string(), err };
        let f = crate::util::output::open_recording_file(&path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        Reader::new(BufReader::with_capacity(1 << 20, f), Some(len), &path.display().to_string())
    }
}

impl<R: BufRead> Reader<R> {
    pub fn new(mut inp: R, len: Option<u64>, path: &str) -> Result<Self, ReadError> {
        let mut head = [0u8; 16];
        match inp.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(ReadError::BadMagic { path: path.into() }),
            Err(err) => return Err(ReadError::Io { path: path.into(), err }),
        }
        if &head[..8] != MAGIC {
            return Err(ReadError::BadMagic { path: path.into() });
        }
        let version = u32::from_ne_bytes(head[8..12].try_into().unwrap_or_default());
        if !(OLDEST..=VERSION).contains(&version) {
            return Err(ReadError::Version { path: path.into(), found: version });
        }
        Ok(Reader {
            inp,
            kinds: u64::MAX,
            user_frames: true,
            raw: Vec::new(),
            counted: false,
            version,
            pos: 16,
            len,
            chain: Chain::default(),
            prev_stack_ts: 0,
            done: false,
            problems: vec![],
            undecodable: 0,
            frame_bytes: 0,
            buf: vec![],
        })
    }

    fn torn(&mut self, at: u64) {
        self.problems.push(Problem::TornTail { at, ignored: self.len.map(|l| l.saturating_sub(at)) });
        self.done = true;
    }

    fn corrupt(&mut self, at: u64, ty: u32, len: u64) {
        self.problems.push(Problem::CorruptFrame { at, ty, len, ignored: self.len.map(|l| l.saturating_sub(at)) });
        self.done = true;
    }

    /// Fill `buf` with exactly `n` bytes; false at a torn end.
    fn fill(&mut self, n: usize) -> bool {
        self.buf.clear();
        self.buf.resize(n, 0);
        self.inp.read_exact(&mut self.buf).is_ok()
    }

    /// The next frame's type and length; None at the end (clean, torn or corrupt).
    fn head(&mut self) -> Option<(u8, u64)> {
        let at = self.pos;
        if self.inp.fill_buf().map_or(true, <[u8]>::is_empty) {
            self.done = true;
            return None;
        }
        if self.version == 1 {
            if !self.fill(8) {
                self.torn(at);
                return None;
            }
            let len = u32::from_ne_bytes(self.buf[..4].try_into().unwrap_or_default());
            let ty = u16::from_ne_bytes([self.buf[4], self.buf[5]]);
            if len > MAX_FRAME || !(ty == u16::from(FRAME_KERNEL) || ty == u16::from(FRAME_JSON)) {
                self.corrupt(at, u32::from(ty), u64::from(len));
                return None;
            }
            self.pos += 8;
            return Some((ty as u8, u64::from(len)));
        }
        // The common case: the length and type are in the buffer already (a frame's head is at
        // most 6 bytes): read them there, without a read call per byte.
        if let Ok(b) = self.inp.fill_buf()
            && b.len() >= 6
            && let Some((len, rest)) = take_varint(&b[..5])
            && len <= u64::from(MAX_FRAME)
            && matches!(rest.first(), Some(&(FRAME_KERNEL | FRAME_JSON | FRAME_STACK)))
            && !(b[0] == MAGIC[0] && b[1] == MAGIC[1])
        {
            let (ty, used) = (rest[0], 5 - rest.len() + 1);
            self.inp.consume(used);
            self.pos += used as u64;
            return Some((ty, len));
        }
        let mut len = 0u64;
        let mut i = 0;
        loop {
            let mut b = [0u8];
            if self.inp.read_exact(&mut b).is_err() {
                self.torn(at);
                return None;
            }
            len |= u64::from(b[0] & 0x7f) << (7 * i);
            i += 1;
            if b[0] & 0x80 == 0 {
                break;
            }
            if i == 5 {
                self.corrupt(at, 0, len);
                return None;
            }
        }
        let mut ty = [0u8];
        if self.inp.read_exact(&mut ty).is_err() {
            self.torn(at);
            return None;
        }
        // Recordings joined end to end (`probe watch` keeps its window as segment files and
        // an incident is the segments joined): another file header starts a new chain.
        if i == 1 && [len as u8, ty[0]] == MAGIC[..2] {
            let mut rest = [0u8; 14];
            if self.inp.read_exact(&mut rest).is_err() {
                self.torn(at);
                return None;
            }
            let version = u32::from_ne_bytes(rest[6..10].try_into().unwrap_or_default());
            if rest[..6] != MAGIC[2..] || version != self.version {
                self.corrupt(at, u32::from(ty[0]), len);
                return None;
            }
            self.pos += 16;
            self.chain = Chain::default();
            self.prev_stack_ts = 0;
            return self.head();
        }
        if len > u64::from(MAX_FRAME) || !matches!(ty[0], FRAME_KERNEL | FRAME_JSON | FRAME_STACK) {
            self.corrupt(at, u32::from(ty[0]), len);
            return None;
        }
        self.pos += i as u64 + 1;
        Some((ty[0], len))
    }

    /// The next whole frame, or None at the end of what can be read (see [`Reader::problems`]).
    /// Kernel records that do not decode are counted in `undecodable` and skipped.
    pub fn next_frame(&mut self) -> Option<Frame> {
        let f = self.frame();
        if f.is_none() && !self.counted {
            self.counted = true;
            PASSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        f
    }

    fn frame(&mut self) -> Option<Frame> {
        while !self.done {
            let at = self.pos;
            let (ty, len) = self.head()?;
            if !self.fill(len as usize) {
                self.torn(at);
                return None;
            }
            self.pos += len;
            self.frame_bytes = self.pos - at;
            if ty == FRAME_JSON {
                return Some(Frame::Json(std::mem::take(&mut self.buf)));
            }
            if ty == FRAME_STACK {
                match StackRecord::decode_with(&self.buf, self.prev_stack_ts, self.user_frames) {
                    Some(s) => {
                        self.prev_stack_ts = s.ts_ns;
                        return Some(Frame::Stack(s));
                    }
                    None => {
                        self.undecodable += 1;
                        continue;
                    }
                }
            }
            let decoded = if self.version == 1 {
                decode::decode(&self.buf).ok()
            } else if self.kinds != u64::MAX && self.buf.first().is_some_and(|&k| k >= 64 || self.kinds & (1 << k) == 0) {
                match skip_compact(&self.buf, &mut self.chain) {
                    Some(_) => continue,
                    None => None,
                }
            } else if expand_into(&self.buf, &mut self.chain, &mut self.raw) {
                decode::decode(&self.raw).ok()
            } else {
                None
            };
            match decoded {
                Some(ev) => return Some(Frame::Kernel(ev)),
                None => self.undecodable += 1,
            }
        }
        None
    }

    /// Problems after the last frame was read: the torn tail, corruption, undecodable records.
    pub fn finish(&mut self) -> Vec<Problem> {
        let mut p = std::mem::take(&mut self.problems);
        if self.undecodable > 0 {
            p.push(Problem::Undecodable(self.undecodable));
        }
        p
    }
}

/// The most kernel events and stack samples [`read_dir`] keeps in memory for the timeline: the
/// timeline of a longer recording shows its end (where a trace left running overnight holds the
/// morning's slow request), and says so. The report and the flamegraphs stream the whole file
/// ([`crate::analysis::report::build_dir`], [`crate::analysis::flame::Flames::of_dir`]).
pub const KEEP_EVENTS: u64 = 100_000;
pub const KEEP_STACKS: u64 = 100_000;

/// A recording read into memory (the timeline, the flamegraphs, the bundle).
#[derive(Debug, Default)]
pub struct Recording {
    pub events: Vec<Event>,
    /// Stack samples, in file order.
    pub stacks: Vec<StackRecord>,
    /// Userspace records other than stack samples, typed (the samplers' records in `Sample`).
    pub records: Vec<records::UserRecord>,
    /// Human-readable problems: torn tail, corrupt frame, undecodable records (counted).
    pub problems: Vec<Problem>,
    pub undecodable: u64,
    /// Userspace records that are JSON but not of their type's shape: (type, why), in file order.
    /// The report says each (as the streamed report does), instead of counting it undecodable.
    pub unreadable: Vec<(String, String)>,
    /// Kernel events and stack samples past [`KEEP_EVENTS`] / [`KEEP_STACKS`], not held.
    pub events_not_kept: u64,
    pub stacks_not_kept: u64,
}

/// Builds a [`Recording`] frame by frame: every userspace record, the last [`KEEP_EVENTS`]
/// kernel events and [`KEEP_STACKS`] stack samples (crate::analysis feeds it during its first
/// pass; [`read_dir`] alone for tools and tests).
pub struct Keeper {
    rec: Recording,
    events: std::collections::VecDeque<Event>,
    stacks: std::collections::VecDeque<StackRecord>,
    keep_events: u64,
    keep_stacks: u64,
}

impl Keeper {
    pub fn new(keep_events: u64, keep_stacks: u64) -> Keeper {
        Keeper { rec: Recording::default(), events: Default::default(), stacks: Default::default(), keep_events, keep_stacks }
    }

    pub fn kernel(&mut self, ev: Event) {
        if self.events.len() as u64 >= self.keep_events {
            self.events.pop_front();
            self.rec.events_not_kept += 1;
        }
        self.events.push_back(ev);
    }

    pub fn stack(&mut self, s: StackRecord) {
        if self.stacks.len() as u64 >= self.keep_stacks {
            self.stacks.pop_front();
            self.rec.stacks_not_kept += 1;
        }
        self.stacks.push_back(s);
    }

    /// A userspace record, typed, or its type and why it is not of its type's shape.
    pub fn record(&mut self, r: Result<records::UserRecord, (String, String)>) {
        match r {
            Ok(records::UserRecord::Stack(s)) => self.stack(*s),
            Ok(u) => self.rec.records.push(u),
            Err(e) => self.rec.unreadable.push(e),
        }
    }

    /// The recording, with the reader's problems and undecodable count.
    pub fn finish(mut self, problems: Vec<Problem>, undecodable: u64) -> Recording {
        let mut rec = std::mem::take(&mut self.rec);
        rec.events = self.events.into();
        rec.stacks.extend(self.stacks);
        rec.undecodable = undecodable;
        rec.problems = problems;
        if rec.events_not_kept + rec.stacks_not_kept > 0 {
            rec.problems.push(Problem::LongRecording {
                events: rec.events.len(),
                stacks: rec.stacks.len(),
                events_before: rec.events_not_kept,
                stacks_before: rec.stacks_not_kept,
            });
        }
        rec
    }
}

/// A userspace record from its JSON text: typed; its type and why, when it is JSON of the wrong
/// shape; None when it is not JSON at all (undecodable).
pub fn user_record(bytes: &[u8]) -> Option<Result<records::UserRecord, (String, String)>> {
    let v = serde_json::from_slice::<serde_json::Value>(bytes).ok()?;
    let ty = v["type"].as_str().unwrap_or_default().to_string();
    Some(records::UserRecord::from_value(v).map_err(|e| (ty, e.to_string())))
}

impl Recording {
    fn collect<R: BufRead>(r: Reader<R>) -> Recording {
        Recording::collect_keeping(r, KEEP_EVENTS, KEEP_STACKS)
    }

    fn collect_keeping<R: BufRead>(mut r: Reader<R>, keep_events: u64, keep_stacks: u64) -> Recording {
        let mut k = Keeper::new(keep_events, keep_stacks);
        while let Some(f) = r.next_frame() {
            match f {
                Frame::Kernel(ev) => k.kernel(ev),
                Frame::Stack(s) => k.stack(s),
                Frame::Json(b) => match user_record(&b) {
                    Some(u) => k.record(u),
                    None => r.undecodable += 1,
                },
            }
        }
        let undecodable = r.undecodable;
        k.finish(r.finish(), undecodable)
    }

    /// A recording of userspace records (tests, tools).
    pub fn from_json(values: Vec<serde_json::Value>) -> Recording {
        let mut rec = Recording::default();
        for v in values {
            match records::UserRecord::from_value(v) {
                Ok(records::UserRecord::Stack(s)) => rec.stacks.push(*s),
                Ok(u) => rec.records.push(u),
                Err(_) => rec.undecodable += 1,
            }
        }
        rec
    }

    /// Thread names by tid, from the `threads` records.
    pub fn thread_names(&self) -> std::collections::HashMap<u32, String> {
        self.records
            .iter()
            .filter_map(|r| if let records::UserRecord::Threads(t) = r { Some(&t.threads) } else { None })
            .flatten()
            .map(|(_, tid, name)| (*tid, name.clone()))
            .collect()
    }

    /// The samplers' records (`gpu`, `mem`, `endpoint`...), as written.
    pub fn samples(&self) -> impl Iterator<Item = &samples::Sample> {
        self.records.iter().filter_map(|r| if let records::UserRecord::Sample(s) = r { Some(&**s) } else { None })
    }

    /// The `meta` record, if any.
    pub fn meta(&self) -> Option<&records::Meta> {
        self.records.iter().find_map(|r| if let records::UserRecord::Meta(m) = r { Some(&**m) } else { None })
    }
}

/// Copy the recording in `from` to `to` in this probe's format, frame by frame and in order
/// (an older recording rewritten; tests). Returns the problems the reader met.
pub fn rewrite(from: &Path, to: &Path) -> Result<Vec<Problem>, ReadError> {
    let mut r = Reader::open(from)?;
    let io = |err| ReadError::Io { path: to.display().to_string(), err };
    let mut w = Writer::create(to).map_err(|e| io(std::io::Error::other(format!("{e:#}"))))?;
    while let Some(f) = r.next_frame() {
        match f {
            Frame::Kernel(ev) => w.kernel(&decode::encode_event(&ev)),
            Frame::Stack(s) => w.stack(&s),
            // v1 stack records become binary ones.
            Frame::Json(b) => match serde_json::from_slice::<serde_json::Value>(&b) {
                Ok(v) if v.get("type").and_then(|t| t.as_str()) == Some("stack") => match serde_json::from_value::<StackRecord>(v) {
                    Ok(s) => w.stack(&s),
                    Err(_) => w.json_bytes(&b),
                },
                _ => w.json_bytes(&b),
            },
        }
        .map_err(io)?;
    }
    w.close().map_err(io)?;
    Ok(r.finish())
}

/// Frames and bytes on disk by record kind (kernel kinds by name, userspace records by their
/// `type` as `json:TYPE`): what a recording spends its space on.
pub fn sizes(dir: &Path) -> Result<std::collections::BTreeMap<String, (u64, u64)>, ReadError> {
    #[derive(serde::Deserialize)]
    struct Peek {
        #[serde(rename = "type")]
        ty: Option<String>,
    }
    let mut out = std::collections::BTreeMap::<String, (u64, u64)>::new();
    let mut r = Reader::open(dir)?;
    while let Some(f) = r.next_frame() {
        let k = match f {
            Frame::Kernel(ev) => ev.kind().name().to_string(),
            Frame::Stack(s) => format!("stack:{}", s.what.name()),
            Frame::Json(b) => format!("json:{}", serde_json::from_slice::<Peek>(&b).ok().and_then(|p| p.ty).unwrap_or_default()),
        };
        let e = out.entry(k).or_default();
        e.0 += 1;
        e.1 += r.frame_bytes;
    }
    Ok(out)
}

/// The `meta` record of the recording in `dir` (its first frame), without reading the rest.
pub fn read_meta(dir: &Path) -> Result<Option<records::Meta>, ReadError> {
    let mut r = Reader::open(dir)?;
    while let Some(f) = r.next_frame() {
        if let Frame::Json(b) = f
            && let Ok(records::UserRecord::Meta(m)) = records::UserRecord::parse(&b)
        {
            return Ok(Some(*m));
        }
        if r.pos > 1 << 20 {
            break;
        }
    }
    Ok(None)
}

/// Read `DIR/events.bin` whole.
pub fn read_dir(dir: &Path) -> Result<Recording, ReadError> {
    Ok(Recording::collect(Reader::open(dir)?))
}

/// Read a recording from bytes (tests, tools).
pub fn parse(buf: &[u8], path: &str) -> Result<Recording, ReadError> {
    Ok(Recording::collect(Reader::new(buf, Some(buf.len() as u64), path)?))
}

#[cfg(test)]
mod tests {
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
        assert_eq!(types, ["meta", "module", "maps", "stack@3000000"], "the second segment starts with the context, once");
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
