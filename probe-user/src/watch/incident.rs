//! The watcher of one trace session: it counts finished requests in the metrics, keeps the
//! window of segment files, analyses requests once their segment is closed (the verdict and its
//! TTFT split), and writes an incident directory for a request that was slow or stopped
//! abnormally, or for the server's exit.
use std::{
    collections::{HashMap, VecDeque},
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use super::{Link, Msg, Segment, SlowTtft, log_line, metrics::Metrics};
use crate::{
    analysis::verdict::{self, SlowCause, StopCause},
    stream::RequestRecord,
};

/// Recent TTFTs kept for the `Nx` rule's median.
const MEDIAN_OF: usize = 100;
/// Before a request that is only counted (not an incident), this much of the window is read
/// for its verdict: its own events are inside its arrival..end.
const VERDICT_LEAD_MS: f64 = 1000.0;

/// The stops that make an incident: not the server's normal end of an answer.
fn abnormal(stop: StopCause) -> bool {
    use StopCause::*;
    matches!(stop, ServerLimit | ClientDisconnect | Deadline | Oom | Crash | ServerError)
}

/// What an incident is about. Its name is in the incident directory's name, the log, the
/// `probe_incidents_total` cause label and the OTLP log record, as it always was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IncidentKind {
    /// The first token came later than `--slow-ttft`: `slow_ttft`.
    SlowTtft,
    /// The request stopped abnormally (see [`abnormal`]): the stop cause's name.
    Stop(StopCause),
    /// The server exited: `server_exit`.
    ServerExit,
}

impl IncidentKind {
    pub fn name(self) -> &'static str {
        match self {
            IncidentKind::SlowTtft => "slow_ttft",
            IncidentKind::Stop(c) => c.name(),
            IncidentKind::ServerExit => "server_exit",
        }
    }

    /// What the incident is put down to, for the rate limit and the log: a slow request's slow
    /// cause (none and compute are both its own work, one cause: the threshold between them is
    /// not a new problem; `unknown` without a verdict), else the kind itself.
    pub fn cause(self, slow: Option<SlowCause>) -> &'static str {
        match (self, slow) {
            (IncidentKind::SlowTtft, Some(SlowCause::None | SlowCause::Compute)) => "own work",
            (IncidentKind::SlowTtft, Some(slow)) => slow.name(),
            (IncidentKind::SlowTtft, None) => "unknown",
            (kind, _) => kind.name(),
        }
    }
}

impl std::fmt::Display for IncidentKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request waiting for its segment to close.
struct Pending {
    q: Box<RequestRecord>,
    /// The incidents it makes (slow, an abnormal stop), none for most.
    incidents: Vec<IncidentKind>,
}

pub struct Watcher {
    pid: u32,
    dir: PathBuf,
    metrics: Arc<Metrics>,
    link: Arc<Link>,
    window_ms: f64,
    window_bytes: u64,
    slow: SlowTtft,
    keep: u64,
    gap: Duration,
    segments: VecDeque<Segment>,
    pending: Vec<Pending>,
    ttfts: VecDeque<f64>,
    /// When an incident of each (kind, cause) was last saved: one per pair per `--incident-gap`.
    last_incident: HashMap<(IncidentKind, &'static str), Instant>,
    otlp: Option<Arc<crate::render::export::otlp::Sender>>,
    /// The server's warm requests of earlier sessions, kept in the watch directory.
    baseline: super::baseline::Baseline,
    /// Where the server runs (node, container, pod): on each incident and span.
    labels: Vec<(String, String)>,
}

impl Watcher {
    pub fn new(
        o: &super::Options,
        pid: u32,
        dir: PathBuf,
        metrics: Arc<Metrics>,
        link: Arc<Link>,
        otlp: Option<Arc<crate::render::export::otlp::Sender>>,
        server: &str,
    ) -> Watcher {
        let baseline = super::baseline::Baseline::load(&o.dir, server);
        if !baseline.is_empty() {
            log_line!("probe watch: warm baseline of {} request(s) from earlier sessions", baseline.len());
        }
        Watcher {
            pid,
            dir,
            metrics,
            link,
            window_ms: o.window.as_secs_f64() * 1e3,
            window_bytes: o.window_bytes,
            slow: o.slow_ttft,
            keep: o.keep,
            gap: o.incident_gap,
            segments: VecDeque::new(),
            pending: Vec::new(),
            ttfts: VecDeque::new(),
            last_incident: HashMap::new(),
            otlp,
            baseline,
            labels: o.labels.clone(),
        }
    }

    /// Take the session's messages until it ends (the channel closes).
    pub fn run(mut self, rx: mpsc::Receiver<Msg>) {
        // The session's last message is `Ended` (the main thread sends one when a session fails).
        while let Ok(m) = rx.recv() {
            match m {
                Msg::Request(q) => self.request(q),
                Msg::Sample(v) => self.metrics.sample(&v),
                Msg::Segment(s) => {
                    self.segments.push_back(s);
                    self.analyse();
                    self.prune();
                }
                Msg::Ended { reason, target_exited, lost } => {
                    self.analyse();
                    if target_exited {
                        let what = format!("pid {} exited ({reason}); {lost} events lost in the session", self.pid);
                        let kind = IncidentKind::ServerExit;
                        self.incident(kind, kind.cause(None), None, None, &what);
                    }
                    self.metrics.session_ended();
                    break;
                }
            }
        }
    }

    fn median_ms(&self) -> Option<f64> {
        if self.ttfts.len() < super::MEDIAN_MIN {
            return None;
        }
        let mut v: Vec<f64> = self.ttfts.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    fn request(&mut self, q: Box<RequestRecord>) {
        // probe's own endpoint polls, and requests the target sent (a gateway's upstream, an
        // Ollama server to its runner) are not the server's answers.
        if q.probe_poll || q.role != crate::stream::Role::Server {
            return;
        }
        let (stop, _) = verdict::stop_cause(&q);
        let tokens = q.produced();
        // The TTFT every output states (the report's, the span's, the log's); only the slow rule
        // discounts a whole answer's generation time, so a long non-streamed answer is not slow.
        self.metrics.request(stop, q.path.as_deref(), q.ttft_ms.map(|t| t / 1e3), tokens);
        let first = verdict::first_token_ms(&q);
        let slow_at = self.slow.threshold_ms(self.median_ms());
        // Slow and stopped abnormally: an incident of each kind.
        let mut incidents = Vec::new();
        if first.is_some_and(|t| t > slow_at) {
            incidents.push(IncidentKind::SlowTtft);
        }
        if abnormal(stop) {
            incidents.push(IncidentKind::Stop(stop));
        }
        if let Some(t) = first {
            if self.ttfts.len() >= MEDIAN_OF {
                self.ttfts.pop_front();
            }
            self.ttfts.push_back(t);
        }
        if !incidents.is_empty() {
            // Its events are in the segment being written: close it now.
            self.link.rotate_soon();
        }
        self.pending.push(Pending { q, incidents });
    }

    /// The closed segments joined, those that reach past `from_ms`; the meta record says
    /// where the window begins.
    fn joined(&self, from_ms: f64) -> Vec<u8> {
        let mut buf = Vec::new();
        let mut first = None;
        for s in self.segments.iter().filter(|s| s.to_ms >= from_ms) {
            first.get_or_insert(s.from_ms);
            match read_segment(&s.path) {
                Ok(b) => buf.extend_from_slice(&b),
                Err(e) => log::warn!("segment {}: {e}", s.path.display()),
            }
        }
        let window = |m: &mut crate::record::records::Meta| {
            if let Some(from) = first.filter(|f| *f > 0.0) {
                m.window_start_ns = Some(m.start_ns + (from * 1e6) as u64);
            }
        };
        let mut buf = crate::record::with_meta(&buf, window).unwrap_or(buf);
        if !buf.is_empty()
            && let Some(warm) = self.baseline.record()
        {
            buf.extend_from_slice(&warm);
        }
        buf
    }

    /// Verdicts for the requests whose segments are closed; incidents for those that make one.
    fn analyse(&mut self) {
        if self.pending.is_empty() || self.segments.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let from = pending.iter().filter_map(|p| p.q.arrival_ms).fold(f64::INFINITY, f64::min);
        let from = if from.is_finite() { from - VERDICT_LEAD_MS } else { 0.0 };
        let joined = self.joined(from);
        let report = match crate::analysis::Analysis::report_bytes(&joined) {
            Ok(r) => r,
            Err(e) => {
                log_line!("probe watch: cannot analyse the window: {e}");
                return;
            }
        };
        if let Some(otlp) = &self.otlp
            && let Some(meta) = crate::record::first_meta(&joined)
        {
            let ids: Vec<u64> = pending.iter().map(|p| p.q.id).collect();
            let mut export = crate::render::export::otlp::from_report(&report, &meta, Some(&ids));
            for (k, v) in &self.labels {
                export.resource.push((super::place::otel_name(k).to_string(), crate::render::export::otlp::Val::S(v.clone())));
            }
            otlp.send(export);
        }
        let ids: Vec<(u32, u64)> = pending.iter().map(|p| (p.q.pid, p.q.id)).collect();
        if self.baseline.learn(&report, &ids) {
            self.baseline.save();
        }
        for p in pending {
            let v = report.requests.iter().find(|r| r.id == p.q.id && r.pid == p.q.pid).and_then(|r| r.verdict.clone());
            if let Some(v) = &v {
                self.metrics.verdict(v);
            }
            for &kind in &p.incidents {
                let slow_cause = v.as_ref().map(|v| v.slow_cause);
                let slow = slow_cause.map_or("unknown", SlowCause::name);
                let what = format!(
                    "request {} {} {}: ttft {}, stop {}, slow cause {slow}{}",
                    p.q.id,
                    p.q.method.as_deref().unwrap_or("?"),
                    crate::util::redact::scrub(p.q.path.as_deref().unwrap_or("?")),
                    p.q.ttft_ms.map_or("none".into(), |t| format!("{t:.0} ms")),
                    verdict::stop_cause(&p.q).0,
                    v.as_ref().map(|v| evidence(&v.evidence)).unwrap_or_default(),
                );
                // A slow request's cause is its slow cause; a stop's, the stop.
                self.incident(kind, kind.cause(slow_cause), Some(&p.q), v.as_ref(), &what);
            }
        }
    }

    /// Save an incident of `kind` (unless one of the same kind and cause was saved within the
    /// gap: a different cause is another incident).
    fn incident(&mut self, kind: IncidentKind, cause: &'static str, q: Option<&RequestRecord>, v: Option<&verdict::Verdict>, what: &str) {
        let key = (kind, cause);
        if self.last_incident.get(&key).is_some_and(|t| t.elapsed() < self.gap) {
            self.metrics.incident(kind.name(), false);
            log_line!(
                "probe watch: incident {kind} ({cause}) not saved (another within {} s; --incident-gap): {}",
                self.gap.as_secs(),
                crate::util::text::terminal(what)
            );
            return;
        }
        self.last_incident.insert(key, Instant::now());
        let from = q.and_then(|q| q.arrival_ms).map_or(f64::NEG_INFINITY, |a| a - self.window_ms);
        let mut bytes = self.joined(from);
        if bytes.is_empty() {
            return;
        }
        let end = crate::record::records::End { ts_ns: crate::monotonic_ns(), reason: format!("incident: {kind}") };
        bytes.extend_from_slice(&crate::record::standalone(&crate::record::records::UserRecord::End(end)));
        match write_incident(&self.dir, kind.name(), q.map(|q| q.id), &bytes, &self.labels) {
            Ok(dir) => {
                self.metrics.incident(kind.name(), true);
                log_line!("probe watch: incident {kind}: {}; saved {}", crate::util::text::terminal(what), dir.display());
                self.rotate_incidents(&dir);
                if let Some(otlp) = &self.otlp {
                    otlp.send(self.incident_log(kind, cause, q, v, what, &dir));
                }
            }
            Err(e) => log_line!("probe watch: incident {kind} not saved: {e:#}"),
        }
    }

    /// An incident as an OTLP log record (WARN), its verdict and evidence as attributes, the
    /// server and where it runs as the resource.
    fn incident_log(
        &self,
        kind: IncidentKind,
        cause: &str,
        q: Option<&RequestRecord>,
        v: Option<&verdict::Verdict>,
        what: &str,
        dir: &Path,
    ) -> crate::render::export::otlp::Export {
        use crate::render::export::otlp::{Export, LogRecord, Val};
        let s = |x: &str| Val::S(x.to_string());
        let mut resource = vec![
            ("service.name".to_string(), s(&crate::os::procfs::comm(self.pid))),
            ("process.pid".to_string(), Val::I(i64::from(self.pid))),
            ("host.name".to_string(), s(&super::place::node())),
            ("telemetry.sdk.name".to_string(), s("probe")),
        ];
        for (k, v) in &self.labels {
            resource.push((super::place::otel_name(k).to_string(), s(v)));
        }
        let mut attrs = vec![
            ("probe.incident.kind".to_string(), s(kind.name())),
            ("probe.incident.cause".to_string(), s(cause)),
            ("probe.incident.dir".to_string(), s(&dir.display().to_string())),
        ];
        if let Some(q) = q {
            attrs.push(("probe.request.id".into(), Val::I(q.id as i64)));
            if let Some(t) = q.ttft_ms {
                attrs.push(("gen_ai.server.time_to_first_token".into(), Val::D(t / 1e3)));
            }
        }
        if let Some(v) = v {
            attrs.push(("probe.slow_cause".into(), s(v.slow_cause.name())));
            attrs.push(("probe.stop_cause".into(), s(v.stop_cause.name())));
            attrs.push(("probe.evidence".into(), Val::A(v.evidence.iter().map(|e| s(e)).collect())));
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let body = format!("incident {kind} ({cause}): {what}");
        Export { resource, spans: vec![], logs: vec![LogRecord { time_unix_ns: now, severity: (13, "WARN"), body, attrs }] }
    }

    /// Keep the incidents within `--keep` bytes: the oldest go first, never the newest.
    fn rotate_incidents(&self, newest: &Path) {
        let mut all: Vec<(PathBuf, u64)> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| (e.path(), dir_bytes(&e.path())))
            .collect();
        all.sort();
        let mut total: u64 = all.iter().map(|(_, b)| b).sum();
        for (p, b) in all {
            if total <= self.keep || p == newest {
                break;
            }
            if std::fs::remove_dir_all(&p).is_ok() {
                total -= b;
                log_line!("probe watch: removed the oldest incident {} (--keep {} MiB)", p.display(), self.keep >> 20);
            }
        }
    }

    /// Drop the segments older than the window, and the oldest past the window's bytes.
    fn prune(&mut self) {
        let Some(last) = self.segments.back().map(|s| s.to_ms) else { return };
        let mut bytes: u64 = self.segments.iter().map(|s| s.bytes).sum();
        while self.segments.len() > 1 {
            let s = &self.segments[0];
            if s.to_ms >= last - self.window_ms && bytes <= self.window_bytes {
                break;
            }
            bytes -= s.bytes;
            let _ = std::fs::remove_file(&s.path);
            self.segments.pop_front();
        }
    }
}

/// The verdict's evidence for one log line: the facts about the first token first, at most
/// 600 characters.
fn evidence(lines: &[String]) -> String {
    let (stop, slow): (Vec<&String>, Vec<&String>) =
        lines.iter().partition(|l| l.starts_with("the server stopped") || l.starts_with("the client"));
    let mut s: String = slow.into_iter().chain(stop).map(String::as_str).collect::<Vec<_>>().join("; ");
    if s.len() > 600 {
        let cut = (0..=600).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push('…');
    }
    if s.is_empty() { s } else { format!(": {s}") }
}

/// A segment file's bytes (never through a link, never a FIFO).
fn read_segment(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut f = crate::util::output::open_recording_file(path)?;
    let mut b = Vec::new();
    f.read_to_end(&mut b)?;
    Ok(b)
}

fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p).into_iter().flatten().flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

/// `20261201T070212Z`: UTC, sortable, no characters a shell or a file manager minds.
pub fn stamp(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string().replace(['-', ':'], "")
}

/// Write `DIR/TIME-CAUSE[-reqID]/`: events.bin, report.json, report.html, the flamegraphs and
/// a ready bundle.tar.gz (what a bug report attaches).
fn write_incident(dir: &Path, cause: &str, id: Option<u64>, bytes: &[u8], labels: &[(String, String)]) -> anyhow::Result<PathBuf> {
    let base = format!("{}-{cause}{}", stamp(std::time::SystemTime::now()), id.map(|i| format!("-req{i}")).unwrap_or_default());
    let mut path = dir.join(&base);
    let mut n = 1;
    while path.exists() {
        n += 1;
        path = dir.join(format!("{base}-{n}"));
    }
    let out = crate::util::output::OutDir::create_recording(&path, false)?;
    out.write(crate::record::FILE_NAME, bytes)?;
    // Where it happened (node, container, pod), for incidents pulled from many nodes.
    if !labels.is_empty() {
        // Sorted by name, a later duplicate winning (as fleet::labels_of reads it back).
        let m: std::collections::BTreeMap<&str, &str> = labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        out.write(super::place::LABELS_FILE, &serde_json::to_vec_pretty(&m)?)?;
    }
    let a = crate::analysis::Analysis::of_dir(&path, crate::analysis::Needs::ALL)?;
    out.write("report.json", &serde_json::to_vec_pretty(&a.report)?)?;
    let drawn = crate::render::flame::draw_all(&a.flames);
    crate::render::html::write_for(&a, &drawn, &out)?;
    crate::render::flame::write_defaults(&a.flames, &drawn, &out)?;
    crate::render::bundle::write(&a, &path.join("bundle.tar.gz"), false, false)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incident_kinds_keep_their_names_and_causes() {
        let (slow, stop, exit) = (IncidentKind::SlowTtft, IncidentKind::Stop(StopCause::ClientDisconnect), IncidentKind::ServerExit);
        assert_eq!([slow.name(), stop.name(), exit.name()], ["slow_ttft", "client_disconnect", "server_exit"]);
        assert_eq!(stop.to_string(), "client_disconnect");
        assert_eq!(slow.cause(Some(SlowCause::None)), "own work");
        assert_eq!(slow.cause(Some(SlowCause::Compute)), "own work");
        assert_eq!(slow.cause(Some(SlowCause::Disk)), "disk");
        assert_eq!(slow.cause(None), "unknown");
        assert_eq!(stop.cause(Some(SlowCause::Disk)), "client_disconnect");
        assert_eq!(exit.cause(None), "server_exit");
    }
}
