//! One read of a recording, one model every output draws from. The data path is
//! `events.bin → record::Reader (typed frames) → Analysis (this file) → renderers` (text,
//! HTML, Markdown, Perfetto, pprof, OTLP, bundle, watch's incidents), each a function of
//! `&Analysis` or of its `Report`.
//!
//! Two passes over `events.bin`, never more, and each for a reason it cannot do without:
//! - pass 1 reads the userspace records (the target, the requests and their windows, the file
//!   mappings, the module table, the kernel names) and the stack samples' frames (what to
//!   symbolize);
//! - pass 2 reads the kernel records in time order and the stack samples again, now that each
//!   sample can be charged to the requests whose window holds it and named with the symbols of
//!   every module: both are known only at the end of pass 1 (a request's record is written when
//!   it ends, after the events inside it).
//!
//! Memory grows with requests, files, threads, connections and distinct stacks, not with the
//! recording's length: the timeline's events are the recording's last [`record::KEEP_EVENTS`].
pub mod critical;
pub mod diff;
pub mod flame;
pub mod ksyms;
pub mod report;
pub mod samples;
pub mod steps;
pub mod system;
pub mod verdict;

use std::path::Path;

use crate::{
    analysis::flame::{Flames, Folder, Symbols, Wanted, Window},
    analysis::ksyms::Names,
    analysis::report::{Builder, Reorder, Report},
    record::decode::Event,
    record::{self, Frame, ReadError, Reader, Recording, records::Meta},
};

/// Which stacks the flamegraphs fold.
#[derive(Clone, Copy, Debug, Default)]
pub enum Scope {
    /// Every stack.
    #[default]
    All,
    /// Those in a time window (CLOCK_MONOTONIC ns).
    Window(Window),
    /// Those of one request: arrival to last byte (its id in report.json).
    Request(u64),
}

/// What the outputs of a command need besides the report: the rest is not built.
#[derive(Clone, Copy, Debug, Default)]
pub struct Needs {
    /// The userspace records and the recording's last events and stacks (timeline, bundle).
    pub recording: bool,
    /// Symbolized, folded stacks (flamegraphs, report.html, bundle).
    pub flames: bool,
    /// Distinct samples with their labels (pprof).
    pub pprof: bool,
    /// Which stacks the flamegraphs fold.
    pub scope: Scope,
    /// Also fold each request's stacks on their own ([`Analysis::request_flames`]: `probe
    /// diff`, which knows which requests it compares only once the verdicts are made).
    pub per_request: bool,
}

impl Needs {
    /// The report alone (`probe report`, `--json`, watch's verdicts).
    pub const REPORT: Needs = Needs { recording: false, flames: false, pprof: false, scope: Scope::All, per_request: false };
    /// Every output of a trace: report.json, report.html, flamegraphs, timeline, bundle.
    pub const ALL: Needs = Needs { recording: true, flames: true, pprof: false, scope: Scope::All, per_request: true };
}

/// Why a scope could not be folded.
#[derive(Debug, thiserror::Error)]
pub enum ScopeError {
    #[error("no request {0} in this recording")]
    NoRequest(u64),
    #[error("request {0} was already in flight when probe attached: use --from/--to")]
    InFlightAtAttach(u64),
}

/// The analysis of one recording.
pub struct Analysis {
    pub report: Report,
    /// The recording's meta record (a default one when it has none: the report says so).
    pub meta: Meta,
    /// The userspace records and the last events and stacks ([`Needs::recording`]; else empty).
    pub recording: Recording,
    /// The kernel's names, one table for the report, the flamegraphs and the timeline.
    pub names: Names,
    /// [`Needs::flames`] (empty when not asked for).
    pub flames: Flames,
    /// [`Needs::pprof`].
    pub samples: Option<samples::Samples>,
    /// The window the flamegraphs folded, when [`Scope`] was not `All` (CLOCK_MONOTONIC ns).
    pub window: Window,
    /// The scope could not be folded: why (the report is still whole).
    pub scope_error: Option<ScopeError>,
    /// Each request's folded stacks, by request id ([`Needs::per_request`]; requests whose
    /// start was seen).
    pub request_flames: std::collections::BTreeMap<u64, std::collections::BTreeMap<flame::Kind, flame::Folded>>,
}

impl Analysis {
    /// The recording in `dir`, in two streamed passes.
    pub fn of_dir(dir: &Path, needs: Needs) -> Result<Analysis, ReadError> {
        Analysis::of_frames(|| Reader::open(dir), needs)
    }

    /// The bytes of an `events.bin` in memory (watch's window, tests, the fuzz targets).
    pub fn of_bytes(buf: &[u8], needs: Needs) -> Result<Analysis, ReadError> {
        Analysis::of_frames(|| Reader::new(buf, Some(buf.len() as u64), record::FILE_NAME), needs)
    }

    /// The report of the recording in `dir` alone.
    pub fn report_dir(dir: &Path) -> Result<Report, ReadError> {
        Ok(Analysis::of_dir(dir, Needs::REPORT)?.report)
    }

    /// The report of an `events.bin` in memory alone.
    pub fn report_bytes(buf: &[u8]) -> Result<Report, ReadError> {
        Ok(Analysis::of_bytes(buf, Needs::REPORT)?.report)
    }

    /// A recording already in memory (tests, the fuzz targets): its report, names and flames.
    pub fn of_recording(recording: Recording) -> Analysis {
        let report = crate::analysis::report::build(&recording);
        let names = Names::of(&recording);
        let flames = Flames::of(&recording, Window::default());
        let meta = recording.meta().cloned().unwrap_or_default();
        Analysis {
            report,
            meta,
            recording,
            names,
            flames,
            samples: None,
            window: Window::default(),
            scope_error: None,
            request_flames: Default::default(),
        }
    }

    /// The two passes; `open` gives a reader from the start of the recording each time.
    fn of_frames<R: std::io::BufRead>(open: impl Fn() -> Result<Reader<R>, ReadError>, needs: Needs) -> Result<Analysis, ReadError> {
        // The report needs the stacks' user frames counted, not read: flame graphs, pprof and
        // the recording's tail read them.
        let fold = needs.flames || needs.per_request;
        let user_frames = fold || needs.pprof || needs.recording;
        let FirstPass { mut b, wanted, recording, frame_problems, json_undecodable } = first_pass(open()?, needs, fold, user_frames);
        b.prepare();
        let meta = b.meta().cloned().unwrap_or_default();
        let names = b.kernel_names().clone();
        // Between the passes: what pass 2 charges stacks to.
        let (window, scope_error) = scope_window(needs.scope, b.requests(), &meta);
        let symbols = fold.then(|| Symbols::of(wanted, names.clone()));
        let mut folder = symbols.as_ref().filter(|_| scope_error.is_none() && needs.flames).map(|s| Folder::new(s, Some(&meta), window));
        let (mut per_request, by_time) = match (needs.per_request, symbols.as_ref()) {
            (true, Some(syms)) => request_folders(b.requests(), syms, &meta),
            _ => (Vec::new(), crate::analysis::report::WindowIndex::new(&[])),
        };
        let mut samples = needs.pprof.then(|| samples::Samples::new(b.requests(), meta.start_ns));
        // Pass 2: the kernel records in time order, the stacks charged and folded.
        let mut pass2 = open()?;
        pass2.user_frames = user_frames;
        let mut stack = |b: &mut Builder, s: &record::StackRecord| {
            b.stack(s);
            if let Some(f) = folder.as_mut() {
                f.add(s);
            }
            if !per_request.is_empty() {
                // An off-CPU wait belongs to the windows its end falls in; any other sample to
                // the windows its time falls in.
                let t = if s.what == record::StackKind::Offcpu { s.ts_ns.saturating_add(s.blocked_ns.unwrap_or(0)) } else { s.ts_ns };
                for &i in by_time.at(t) {
                    per_request[i].1.add(s);
                }
            }
            if let Some(p) = samples.as_mut() {
                p.add(s, &names);
            }
        };
        second_pass(&mut pass2, &mut b, &mut stack);
        pass2.undecodable += json_undecodable;
        let problems = pass2.finish();
        debug_assert!(problems.starts_with(&frame_problems), "{problems:?} vs {frame_problems:?}");
        let by_kind = folder.map(Folder::finish);
        let request_flames = per_request.into_iter().map(|(id, f)| (id, f.finish())).collect();
        let flames = symbols.map(|symbols| Flames { symbols, by_kind: by_kind.unwrap_or_default() }).unwrap_or_default();
        Ok(Analysis { report: b.finish(problems), meta, recording, names, flames, samples, window, scope_error, request_flames })
    }

    /// One kind's folded stacks (empty when there are none or flames were not asked for).
    pub fn folded(&self, kind: flame::Kind) -> flame::Folded {
        self.flames.get(kind)
    }
}

/// What pass 1 leaves for pass 2: the builder (its first pass read), the frames the flame graphs
/// want, the recording's kept tail, the frames' problems and the JSON records that did not decode.
struct FirstPass {
    b: Builder,
    wanted: Wanted,
    recording: Recording,
    frame_problems: Vec<record::problem::Problem>,
    json_undecodable: u64,
}

/// Pass 1: the userspace records, the file mappings, the stacks' frames. Without the
/// recording's tail to keep, the only kernel records it needs are the mappings: the others
/// are checked and skipped, not decoded (pass 2 decodes them, and counts what does not).
fn first_pass<R: std::io::BufRead>(mut pass1: Reader<R>, needs: Needs, fold: bool, user_frames: bool) -> FirstPass {
    let mut b = Builder::new();
    let mut wanted = Wanted::default();
    let mut keep = needs.recording.then(|| record::Keeper::new(record::KEEP_EVENTS, record::KEEP_STACKS));
    if !needs.recording {
        pass1.kinds = 1 << probe_common::EventKind::Mmap as u32;
    }
    pass1.user_frames = user_frames;
    let mut json_undecodable = 0u64;
    while let Some(f) = pass1.next_frame() {
        match f {
            Frame::Kernel(ev) => {
                if let Event::Mmap(m) = &ev {
                    b.mapping(m);
                }
                if let Some(k) = keep.as_mut() {
                    k.kernel(ev);
                }
            }
            Frame::Stack(s) => {
                b.stack_seen(&s);
                if fold {
                    wanted.stack(&s);
                }
                if let Some(k) = keep.as_mut() {
                    k.stack(s);
                }
            }
            Frame::Json(bytes) => match record::user_record(&bytes) {
                Some(rec) => {
                    if let Ok(r) = &rec
                        && fold
                    {
                        match r {
                            record::records::UserRecord::Stack(s) => wanted.stack(s),
                            r => wanted.record(r),
                        }
                    }
                    if let Some(k) = keep.as_mut() {
                        k.record(rec.clone());
                    }
                    b.user(rec);
                }
                None => json_undecodable += 1,
            },
        }
    }
    // Torn tails and corrupt frames are the same in both passes; what did not decode is
    // counted where it was decoded (JSON records here, kernel records and stacks in pass 2).
    let frame_problems = std::mem::take(&mut pass1.problems);
    let recording = keep
        .map(|k| {
            let n = pass1.undecodable + json_undecodable;
            let mut p = frame_problems.clone();
            if n > 0 {
                p.push(crate::record::problem::Problem::Undecodable(n));
            }
            k.finish(p, n)
        })
        .unwrap_or_default();
    FirstPass { b, wanted, recording, frame_problems, json_undecodable }
}

/// The window the flame graphs fold for `scope` (a request's: arrival to last byte), or why a
/// request's cannot be.
fn scope_window(scope: Scope, requests: &[report::Request], meta: &Meta) -> (Window, Option<ScopeError>) {
    match scope {
        Scope::All => (Window::default(), None),
        Scope::Window(w) => (w, None),
        Scope::Request(id) => match requests.iter().find(|q| q.id == id) {
            None => (Window::default(), Some(ScopeError::NoRequest(id))),
            Some(q) => match q.arrival_ms {
                None => (Window::default(), Some(ScopeError::InFlightAtAttach(id))),
                Some(a) => {
                    let from = meta.start_ns.saturating_add((a * 1e6) as u64);
                    let to = meta.start_ns.saturating_add(((a + q.end_ms.unwrap_or(0.0)) * 1e6) as u64);
                    (Window { from_ns: Some(from), to_ns: Some(to), request: true }, None)
                }
            },
        },
    }
}

/// One folder per request whose start was seen (its window, as `Scope::Request`), and the
/// index that finds them by time.
fn request_folders<'a>(
    requests: &[report::Request],
    syms: &'a Symbols,
    meta: &'a Meta,
) -> (Vec<(u64, Folder<'a>)>, crate::analysis::report::WindowIndex) {
    let mut per_request: Vec<(u64, Folder)> = Vec::new();
    let mut spans: Vec<Option<(u64, u64)>> = Vec::new();
    for q in requests.iter().filter(|q| !q.probe_poll) {
        let Some(a) = q.arrival_ms else { continue };
        let from = meta.start_ns.saturating_add((a * 1e6) as u64);
        let to = meta.start_ns.saturating_add(((a + q.end_ms.unwrap_or(0.0)) * 1e6) as u64);
        spans.push(Some((from, to)));
        per_request.push((q.id, Folder::new(syms, Some(meta), Window { from_ns: Some(from), to_ns: Some(to), request: true })));
    }
    (per_request, crate::analysis::report::WindowIndex::new(&spans))
}

/// Pass 2: the kernel records put back in time order into the builder, the stacks to `stack`.
fn second_pass<R: std::io::BufRead>(pass2: &mut Reader<R>, b: &mut Builder, stack: &mut impl FnMut(&mut Builder, &record::StackRecord)) {
    let mut order = Reorder::default();
    while let Some(f) = pass2.next_frame() {
        match f {
            Frame::Kernel(ev) => order.push(ev, &mut |e| b.kernel(e)),
            Frame::Stack(s) => stack(b, &s),
            // v1 recordings kept stacks as JSON records; nothing else matters in this pass.
            Frame::Json(bytes) => {
                if is_v1_stack(&bytes)
                    && let Ok(s) = serde_json::from_slice::<record::StackRecord>(&bytes)
                {
                    stack(b, &s);
                }
            }
        }
    }
    order.drain(&mut |e| b.kernel(e));
}

/// A JSON frame that holds a v1 stack record (peeks at the type before parsing the rest).
fn is_v1_stack(bytes: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Peek<'a> {
        #[serde(rename = "type", borrow)]
        ty: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Peek>(bytes).is_ok_and(|p| p.ty.as_deref() == Some("stack"))
}
