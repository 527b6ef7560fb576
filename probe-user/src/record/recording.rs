//! A recording read into memory ([`Recording`], built by a [`Keeper`]), and the tools that
//! read one whole: rewrite in today's format, sizes by record kind, the meta record alone.
use std::{io::BufRead, path::Path};

use super::*;

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
    pub unreadable: Vec<(records::RecordType, String)>,
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
    pub fn record(&mut self, r: Result<records::UserRecord, (records::RecordType, String)>) {
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
pub fn user_record(bytes: &[u8]) -> Option<Result<records::UserRecord, (records::RecordType, String)>> {
    match records::UserRecord::read(bytes) {
        Ok(r) => Some(Ok(r)),
        Err((Some(ty), e)) => Some(Err((ty, why(&e)))),
        Err((None, _)) => None,
    }
}

/// Why a record is not of its type's shape, as the report says it: serde's words without the
/// place in the record's text (the report names the record; the words were always said so).
fn why(e: &serde_json::Error) -> String {
    let said = e.to_string();
    match said.strip_suffix(&format!(" at line {} column {}", e.line(), e.column())) {
        Some(words) if e.line() > 0 => words.to_string(),
        _ => said,
    }
}

impl Recording {
    fn collect<R: BufRead>(r: Reader<R>) -> Recording {
        Recording::collect_keeping(r, KEEP_EVENTS, KEEP_STACKS)
    }

    pub(super) fn collect_keeping<R: BufRead>(mut r: Reader<R>, keep_events: u64, keep_stacks: u64) -> Recording {
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

    /// A recording of userspace records, each anything that serializes to a record's JSON
    /// (tests, tools).
    pub fn from_json<T: serde::Serialize>(values: Vec<T>) -> Recording {
        let mut rec = Recording::default();
        for v in values {
            match serde_json::to_vec(&v).and_then(|json| records::UserRecord::parse(&json)) {
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
            Frame::Json(b) => match records::UserRecord::parse(&b) {
                Ok(records::UserRecord::Stack(s)) => w.stack(&s),
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
