//! The recording's reader: frames streamed one at a time, a torn tail or a corrupt frame
//! reported as a problem instead of failing, v1 frames read as v2 ones.
use std::{
    fs::File,
    io::{self, BufRead, BufReader},
    path::Path,
};

use super::*;

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
    pub(super) pos: u64,
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
