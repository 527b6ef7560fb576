//! The recording's writer: frames buffered and flushed at least once a second, a full disk
//! stopped at a whole frame, and the context a `probe watch` segment starts with.
use std::{
    fs::File,
    io::{self, Write},
    path::Path,
};

use super::{records::RecordType, *};

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
    latest: std::collections::BTreeMap<(RecordType, i64), Vec<u8>>,
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
            U::Maps(m) => (RecordType::Maps, i64::from(m.pid)),
            U::Module(m) => (RecordType::Module, m.id),
            U::Files(_) | U::Ksyms(_) | U::PyFrames(_) | U::Threads(_) | U::Procs(_) => {
                self.grown_bytes += bytes.len();
                self.grown.push_back(bytes.to_vec());
                while self.grown_bytes > CONTEXT_GROWN {
                    let Some(old) = self.grown.pop_front() else { break };
                    self.grown_bytes -= old.len();
                }
                return;
            }
            U::Stats(_) => (RecordType::Stats, 0),
            U::Sample(s) => (s.record_type(), 0),
            U::Request(_) | U::End(_) | U::Stack(_) | U::WarmBaseline(_) | U::CutFrames(_) | U::Other(_) => return,
        };
        self.latest.insert((ty, key), bytes.to_vec());
    }

    /// The records in the order a reader wants them: meta, modules and mappings, the rest (by
    /// their types' words, as segments have always begun).
    fn records(&self) -> impl Iterator<Item = &Vec<u8>> {
        let first = |t: RecordType| self.latest.iter().filter(move |((ty, _), _)| *ty == t).map(|(_, b)| b);
        let mut rest: Vec<_> = self.latest.iter().filter(|((ty, _), _)| !matches!(ty, RecordType::Module | RecordType::Maps)).collect();
        rest.sort_by_key(|((ty, _), _)| ty.name());
        self.meta
            .iter()
            .chain(first(RecordType::Module))
            .chain(first(RecordType::Maps))
            .chain(self.grown.iter())
            .chain(rest.into_iter().map(|(_, b)| b))
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
        let bytes = r.to_json().map_err(io::Error::other)?;
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
            c.latest.insert((s.record_type(), 0), bytes.clone());
        }
        self.json_bytes(&bytes)
    }

    /// A record given as anything that serializes to its JSON (tests): written as given; a
    /// record of a known kind joins the context.
    pub fn json(&mut self, value: &impl serde::Serialize) -> io::Result<()> {
        let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
        if let Some(c) = self.context.as_mut()
            && bytes.len() <= MAX_FRAME as usize
            && let Ok(r) = records::UserRecord::parse(&bytes)
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
pub(super) fn whole_frames(buf: &[u8], limit: usize, header: bool) -> (usize, usize, usize) {
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
