//! Requests → OpenTelemetry traces: one SERVER span per request the target served (arrival →
//! last byte), with an event at the first token and one at the stop, and the verdict as
//! attributes. Names follow the OpenTelemetry semantic conventions where they have one
//! (`gen_ai.operation.name`, `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`,
//! `gen_ai.server.time_to_first_token`, `http.*`, `server.*`, `client.*`); probe's own facts are
//! under `probe.*`. Written as OTLP/JSON (`probe export --format otlp-json`, the OTLP file
//! exporter's layout) or sent as OTLP/HTTP protobuf to a collector (`--otlp URL`).
//!
//! Span and trace ids are derived from the recording's start, the process and the request id,
//! so exporting the same recording twice gives the same ids (a collector sees duplicates, not
//! new traces). No prompt or response text is in a span: the report has none.
use std::time::{Duration, Instant};

use serde::Serialize;

use super::proto::Msg;
use crate::{
    analysis::report::{Report, Request},
    analysis::verdict,
    record::records::Meta,
};

/// An attribute value (the subset of OTLP's AnyValue probe uses).
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    S(String),
    B(bool),
    I(i64),
    D(f64),
    A(Vec<Val>),
}

pub type Attrs = Vec<(String, Val)>;

#[derive(Clone, Debug)]
pub struct Event {
    pub time_ns: u64,
    pub name: String,
    pub attrs: Attrs,
}

#[derive(Clone, Debug)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: Attrs,
    pub events: Vec<Event>,
    /// OTLP status code: 0 unset, 2 error.
    pub status: u32,
    pub status_message: String,
}

/// One export: the traced process as the resource, its requests as spans.
#[derive(Clone, Debug)]
pub struct Export {
    pub resource: Attrs,
    pub spans: Vec<Span>,
    /// Log records (`probe watch`'s incidents), sent to the logs endpoint.
    pub logs: Vec<LogRecord>,
}

/// One OTLP log record: an incident, its verdict and evidence as attributes.
#[derive(Clone, Debug)]
pub struct LogRecord {
    pub time_unix_ns: u64,
    /// OpenTelemetry's severity number (13 = WARN) and text.
    pub severity: (u64, &'static str),
    pub body: String,
    pub attrs: Attrs,
}

/// SpanKind SERVER.
const KIND_SERVER: u64 = 2;

/// `N` id bytes from `parts`: FNV-1a, the same on every build and machine (std's hasher may
/// change between Rust releases), one 64-bit hash per 8 bytes with the chunk's index mixed in.
fn id_bytes<const N: usize>(parts: &[u64]) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in std::iter::once(i as u64).chain(parts.iter().copied()).flat_map(u64::to_le_bytes) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        chunk.copy_from_slice(&h.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// The GenAI operation a path names (None: not an inference route).
fn operation(path: &str) -> Option<&'static str> {
    let p = path.split('?').next().unwrap_or(path);
    Some(match p.rsplit('/').next().unwrap_or("") {
        _ if p.ends_with("/chat/completions") || p.ends_with("/api/chat") => "chat",
        "completions" | "completion" | "infill" => "text_completion",
        "generate" => "generate_content",
        "embeddings" | "embedding" | "embed" => "embeddings",
        _ => return None,
    })
}

fn s(v: impl Into<String>) -> Val {
    Val::S(v.into())
}

/// The spans of a report's requests (the server's, not probe's polls), optionally only `ids`.
pub fn from_report(report: &Report, meta: &Meta, ids: Option<&[u64]>) -> Export {
    let start_unix_ns = meta.start_unix_ms.saturating_mul(1_000_000);
    // A request that arrived before attach starts before the trace (negative ms).
    let at = |ms: f64| (i128::from(start_unix_ns) + (ms * 1e6) as i128).max(0) as u64;
    let served = |q: &&Request| !q.probe_poll && q.role == crate::stream::Role::Server && ids.is_none_or(|ids| ids.contains(&q.id));
    let spans = report.requests.iter().filter(served).filter_map(|q| span(q, meta, &at)).collect();
    Export { resource: resource(meta), spans, logs: vec![] }
}

/// The traced process as OTLP's resource: the service (its command), pid, probe as the SDK,
/// the executable and the host.
fn resource(meta: &Meta) -> Attrs {
    let mut resource = vec![
        ("service.name".to_string(), s(if meta.comm.is_empty() { "llm-server" } else { meta.comm.as_str() })),
        ("process.pid".to_string(), Val::I(i64::from(meta.pid))),
        ("telemetry.sdk.name".to_string(), s("probe")),
        ("telemetry.sdk.version".to_string(), s(meta.probe_version.clone())),
    ];
    if let Some(name) = meta.exe.rsplit('/').next().filter(|n| !n.is_empty()) {
        resource.push(("process.executable.name".into(), s(name)));
    }
    if let Some(h) = meta.hostname.as_deref().filter(|h| !h.is_empty()) {
        resource.push(("host.name".into(), s(h)));
    }
    resource
}

/// One request's span (None: it has no arrival): named by its GenAI operation, or its method
/// and path; from arrival to its end (`at` gives a time after the trace's start in Unix ns);
/// the first token and the stop as events; an error status when it stopped on an error.
fn span(q: &Request, meta: &Meta, at: &dyn Fn(f64) -> u64) -> Option<Span> {
    let arrival = q.arrival_ms?;
    let path = crate::util::redact::scrub(q.path.as_deref().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("").to_string();
    let op = operation(&path);
    let method = q.method.clone().unwrap_or_else(|| "POST".into());
    let name = match op {
        Some(op) => op.to_string(),
        None => format!("{method} {path}"),
    };
    let end_rel = q.end_ms.or(q.closed_ms).or(q.ttft_ms).unwrap_or(0.0);
    let (stop, stop_detail) = q.verdict.as_ref().map_or((verdict::StopCause::Unknown, None), |v| (v.stop_cause, v.stop_detail.clone()));
    let mut a: Attrs = Vec::new();
    http_attrs(&mut a, q, op, method, path);
    token_attrs(&mut a, q);
    verdict_attrs(&mut a, q, stop, stop_detail);
    let mut events = Vec::new();
    if let Some(t) = q.ttft_ms {
        events.push(Event { time_ns: at(arrival + t), name: "gen_ai.first_token".into(), attrs: vec![] });
    }
    events.push(Event {
        time_ns: at(arrival + q.final_ms.unwrap_or(end_rel)),
        name: "probe.stop".into(),
        attrs: vec![("probe.stop_cause".into(), s(stop.name()))],
    });
    use verdict::StopCause;
    let error = matches!(stop, StopCause::ServerError | StopCause::Crash | StopCause::Oom | StopCause::Deadline)
        || q.status.is_some_and(|s| s >= 500);
    Some(Span {
        trace_id: id_bytes::<16>(&[meta.start_unix_ms, u64::from(q.pid), q.id]),
        span_id: id_bytes::<8>(&[meta.start_ns, u64::from(q.pid), q.id]),
        name,
        start_ns: at(arrival),
        end_ns: at(arrival + end_rel),
        attrs: a,
        events,
        status: if error { 2 } else { 0 },
        status_message: if error { stop.words() } else { String::new() },
    })
}

/// The request and its answer as HTTP and GenAI name them: operation, method, path, status,
/// both ends' addresses, why it finished, the tokens asked for.
fn http_attrs(a: &mut Attrs, q: &Request, op: Option<&str>, method: String, path: String) {
    let mut put = |k: &str, v: Val| a.push((k.to_string(), v));
    if let Some(op) = op {
        put("gen_ai.operation.name", s(op));
    }
    put("http.request.method", s(method));
    put("url.path", s(path));
    if let Some(st) = q.status {
        put("http.response.status_code", Val::I(i64::from(st)));
    }
    let addr = |a: &str| a.rsplit_once(':').map(|(h, p)| (h.trim_matches(['[', ']']).to_string(), p.parse::<i64>().unwrap_or(0)));
    if let Some((h, p)) = addr(&q.local) {
        put("server.address", s(h));
        put("server.port", Val::I(p));
    }
    if let Some((h, p)) = addr(&q.peer) {
        put("client.address", s(h));
        put("client.port", Val::I(p));
    }
    let reason = q.stop.finish_reason.clone().or(q.stop.stop_type.clone()).or(q.stop.done_reason.clone()).or(q.stop.stopped.clone());
    if let Some(r) = reason {
        put("gen_ai.response.finish_reasons", Val::A(vec![s(r)]));
    }
    if let Some(m) = q.max_tokens {
        put("gen_ai.request.max_tokens", Val::I(m));
    }
}

/// Where the span's start came from, the tokens in and out, the TTFT, whether it streamed.
fn token_attrs(a: &mut Attrs, q: &Request) {
    let mut put = |k: &str, v: Val| a.push((k.to_string(), v));
    // Where the span's start came from: the request's first byte seen, or the kernel's TCP
    // state at attach (an estimate); a name inferred from the response says so.
    put("probe.arrival_source", s(q.arrival_by.name()));
    if q.path_inferred {
        put("probe.path_inferred", Val::B(true));
    }
    put("gen_ai.usage.output_tokens", Val::I(q.produced() as i64));
    let input = q
        .stop
        .usage
        .as_ref()
        .and_then(|u| u["prompt_tokens"].as_i64())
        .or_else(|| q.stop.server_timings.as_ref().and_then(|t| t["prompt_n"].as_i64().or(t["prompt_eval_count"].as_i64())));
    if let Some(n) = input {
        put("gen_ai.usage.input_tokens", Val::I(n));
    }
    // The report's TTFT (arrival to the first byte of content, as the client saw it): the
    // span's first-token event, the summary and watch's metrics say the same number.
    if let Some(t) = q.ttft_ms {
        put("gen_ai.server.time_to_first_token", Val::D(t / 1e3));
    }
    if let Some(st) = q.stream {
        put("probe.stream", Val::B(st));
    }
}

/// probe's own facts: the request's id, why it stopped, how it closed and whether it was whole,
/// and the verdict (why it was slow, the TTFT split, the evidence).
fn verdict_attrs(a: &mut Attrs, q: &Request, stop: verdict::StopCause, stop_detail: Option<String>) {
    let mut put = |k: &str, v: Val| a.push((k.to_string(), v));
    put("probe.request.id", Val::I(q.id as i64));
    put("probe.stop_cause", s(stop.name()));
    if let Some(d) = stop_detail {
        put("probe.stop_detail", s(d));
    }
    put("probe.closed_by", s(q.closed_by.name()));
    put("probe.content_complete", Val::B(q.content_complete));
    put("probe.transport_complete", Val::B(q.transport_complete));
    put("probe.chunks", Val::I(q.chunks as i64));
    if q.partial {
        put("probe.partial", Val::B(true));
    }
    if let Some(v) = &q.verdict {
        put("probe.slow_cause", s(v.slow_cause.name()));
        if let Some(t) = &v.ttft_ms {
            for (k, ms) in t.by_part() {
                put(&format!("probe.ttft.{k}_ms"), Val::D(ms));
            }
        }
        put("probe.evidence", Val::A(v.evidence.iter().map(|e| s(e.clone())).collect()));
        if !v.data_quality.is_empty() {
            put("probe.data_quality", Val::A(v.data_quality.iter().map(|e| s(e.clone())).collect()));
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// OTLP/JSON's AnyValue: one key naming its type; 64-bit integers are written as strings.
#[derive(Serialize)]
enum AnyValue<'a> {
    #[serde(rename = "stringValue")]
    String(&'a str),
    #[serde(rename = "boolValue")]
    Bool(bool),
    #[serde(rename = "intValue")]
    Int(String),
    #[serde(rename = "doubleValue")]
    Double(f64),
    #[serde(rename = "arrayValue")]
    Array { values: Vec<AnyValue<'a>> },
}

impl<'a> From<&'a Val> for AnyValue<'a> {
    fn from(v: &'a Val) -> Self {
        match v {
            Val::S(x) => AnyValue::String(x),
            Val::B(x) => AnyValue::Bool(*x),
            Val::I(x) => AnyValue::Int(x.to_string()),
            Val::D(x) => AnyValue::Double(*x),
            Val::A(xs) => AnyValue::Array { values: xs.iter().map(AnyValue::from).collect() },
        }
    }
}

/// One attribute in OTLP/JSON.
#[derive(Serialize)]
struct KeyValue<'a> {
    key: &'a str,
    value: AnyValue<'a>,
}

fn attrs_json(a: &Attrs) -> Vec<KeyValue<'_>> {
    a.iter().map(|(k, v)| KeyValue { key: k, value: v.into() }).collect()
}

/// An ExportTraceServiceRequest in OTLP/JSON: the resource, probe as the scope, the spans.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct TracesJson<'a> {
    resource_spans: [ResourceSpansJson<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResourceSpansJson<'a> {
    resource: ResourceJson<'a>,
    scope_spans: [ScopeSpansJson<'a>; 1],
}

#[derive(Serialize)]
struct ResourceJson<'a> {
    attributes: Vec<KeyValue<'a>>,
}

#[derive(Serialize)]
struct ScopeSpansJson<'a> {
    scope: ScopeJson,
    spans: Vec<SpanJson<'a>>,
}

#[derive(Serialize)]
struct ScopeJson {
    name: &'static str,
    version: &'static str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SpanJson<'a> {
    attributes: Vec<KeyValue<'a>>,
    end_time_unix_nano: String,
    events: Vec<EventJson<'a>>,
    kind: u64,
    name: &'a str,
    span_id: String,
    start_time_unix_nano: String,
    status: StatusJson<'a>,
    trace_id: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct EventJson<'a> {
    attributes: Vec<KeyValue<'a>>,
    name: &'a str,
    time_unix_nano: String,
}

/// A span's status: empty when unset, else its code and message.
#[derive(Serialize)]
struct StatusJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<&'a str>,
}

impl<'a> SpanJson<'a> {
    fn of(sp: &'a Span) -> Self {
        let set = sp.status != 0;
        SpanJson {
            trace_id: hex(&sp.trace_id),
            span_id: hex(&sp.span_id),
            name: &sp.name,
            kind: KIND_SERVER,
            start_time_unix_nano: sp.start_ns.to_string(),
            end_time_unix_nano: sp.end_ns.to_string(),
            attributes: attrs_json(&sp.attrs),
            events: sp
                .events
                .iter()
                .map(|e| EventJson { attributes: attrs_json(&e.attrs), name: &e.name, time_unix_nano: e.time_ns.to_string() })
                .collect(),
            status: StatusJson { code: set.then_some(sp.status), message: set.then_some(sp.status_message.as_str()) },
        }
    }
}

fn scope() -> (&'static str, &'static str) {
    ("probe", env!("CARGO_PKG_VERSION"))
}

impl Export {
    /// OTLP/JSON: an ExportTraceServiceRequest, as the OTLP file exporter writes one a line.
    /// Every object's keys are in alphabetical order (the structs' fields are), as otlp.json
    /// has always had them.
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        let (name, version) = scope();
        let traces = TracesJson {
            resource_spans: [ResourceSpansJson {
                resource: ResourceJson { attributes: attrs_json(&self.resource) },
                scope_spans: [ScopeSpansJson { scope: ScopeJson { name, version }, spans: self.spans.iter().map(SpanJson::of).collect() }],
            }],
        };
        serde_json::to_vec(&traces)
    }

    /// OTLP protobuf: an ExportTraceServiceRequest.
    pub fn to_protobuf(&self) -> Vec<u8> {
        let mut scope_spans = Msg::new();
        let (name, version) = scope();
        let mut sc = Msg::new();
        sc.str(1, name).str(2, version);
        scope_spans.msg(1, &sc);
        for sp in &self.spans {
            let mut m = Msg::new();
            m.bytes(1, &sp.trace_id).bytes(2, &sp.span_id).str(5, &sp.name).uint(6, KIND_SERVER);
            m.fixed64(7, sp.start_ns).fixed64(8, sp.end_ns);
            for kv in attrs_pb(&sp.attrs) {
                m.msg(9, &kv);
            }
            for e in &sp.events {
                let mut em = Msg::new();
                em.fixed64(1, e.time_ns).str(2, &e.name);
                for kv in attrs_pb(&e.attrs) {
                    em.msg(3, &kv);
                }
                m.msg(11, &em);
            }
            let mut st = Msg::new();
            if sp.status != 0 {
                st.str(2, &sp.status_message).uint(3, u64::from(sp.status));
            }
            m.msg(15, &st);
            scope_spans.msg(2, &m);
        }
        let mut res = Msg::new();
        for kv in attrs_pb(&self.resource) {
            res.msg(1, &kv);
        }
        let mut rs = Msg::new();
        rs.msg(1, &res).msg(2, &scope_spans);
        let mut req = Msg::new();
        req.msg(1, &rs);
        req.into_bytes()
    }
}

impl Export {
    /// OTLP protobuf: an ExportLogsServiceRequest of the log records.
    pub fn logs_protobuf(&self) -> Vec<u8> {
        let mut scope_logs = Msg::new();
        let (name, version) = scope();
        let mut sc = Msg::new();
        sc.str(1, name).str(2, version);
        scope_logs.msg(1, &sc);
        for l in &self.logs {
            let mut m = Msg::new();
            let mut body = Msg::new();
            body.str(1, &l.body);
            m.fixed64(1, l.time_unix_ns).uint(2, l.severity.0).str(3, l.severity.1).msg(5, &body);
            for kv in attrs_pb(&l.attrs) {
                m.msg(6, &kv);
            }
            m.fixed64(11, l.time_unix_ns);
            scope_logs.msg(2, &m);
        }
        let mut res = Msg::new();
        for kv in attrs_pb(&self.resource) {
            res.msg(1, &kv);
        }
        let mut rl = Msg::new();
        rl.msg(1, &res).msg(2, &scope_logs);
        let mut req = Msg::new();
        req.msg(1, &rl);
        req.into_bytes()
    }
}

fn val_pb(v: &Val) -> Msg {
    let mut m = Msg::new();
    match v {
        Val::S(x) => m.str(1, x),
        // Written even when false or zero: the oneof must say which value it holds.
        Val::B(x) => m.uint_always(2, u64::from(*x)),
        Val::I(x) => m.uint_always(3, *x as u64),
        Val::D(x) => m.double(4, *x),
        Val::A(xs) => {
            let mut arr = Msg::new();
            xs.iter().for_each(|x| {
                arr.msg(1, &val_pb(x));
            });
            m.msg(5, &arr)
        }
    };
    m
}

fn attrs_pb(a: &Attrs) -> Vec<Msg> {
    a.iter()
        .map(|(k, v)| {
            let mut kv = Msg::new();
            kv.str(1, k).msg(2, &val_pb(v));
            kv
        })
        .collect()
}

/// Where OTLP/HTTP traces go: `http://host:4318` (the path `/v1/traces` is added unless the URL
/// has a path of its own).
#[derive(Clone, Debug)]
pub struct Endpoint {
    url: crate::util::httpc::Url,
    path: String,
    /// Where log records go: `/v1/logs`, or the traces path with `traces` turned into `logs`.
    logs_path: String,
}

/// Why a send failed: worth trying again (the collector is down, busy or restarting), or not.
#[derive(Debug)]
pub enum SendError {
    Retry(String),
    Fatal(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Retry(e) | SendError::Fatal(e) => f.write_str(e),
        }
    }
}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Endpoint, String> {
        let url = crate::util::httpc::Url::parse(s)?;
        let path = if url.prefix.is_empty() { "/v1/traces".to_string() } else { url.prefix.clone() };
        let logs_path = match path.strip_suffix("/v1/traces") {
            Some(base) => format!("{base}/v1/logs"),
            None if url.prefix.is_empty() => "/v1/logs".into(),
            None => format!("{}/v1/logs", path.trim_end_matches('/')),
        };
        Ok(Endpoint { url: crate::util::httpc::Url { prefix: String::new(), ..url }, path, logs_path })
    }

    /// POST one export as gzip-compressed protobuf: its spans to the traces path, its log
    /// records to the logs path. Plain HTTP, no credentials of the LLM server (those go to the
    /// server only).
    pub fn send(&self, e: &Export) -> Result<u16, SendError> {
        let mut status = 200;
        if !e.spans.is_empty() {
            status = self.post(&self.path, &e.to_protobuf())?;
        }
        if !e.logs.is_empty() {
            status = self.post(&self.logs_path, &e.logs_protobuf())?;
        }
        Ok(status)
    }

    fn post(&self, path: &str, body: &[u8]) -> Result<u16, SendError> {
        use std::io::Write as _;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let body = gz.write_all(body).and_then(|_| gz.finish()).map_err(|e| SendError::Fatal(e.to_string()))?;
        let (status, _) = crate::util::httpc::post_gzip(&self.url, path, "application/x-protobuf", &body, Duration::from_secs(5))
            .map_err(SendError::Retry)?;
        let said = || format!("{}{path} answered {status}", self.url.host_header());
        match status {
            200..=299 => Ok(status),
            // OTLP/HTTP's retryable statuses.
            429 | 502 | 503 | 504 => Err(SendError::Retry(said())),
            _ => Err(SendError::Fatal(said())),
        }
    }
}

/// Sends exports from a thread of its own, so a slow or absent collector never holds up the
/// caller (`probe watch`'s analysis): at most [`QUEUE`] exports wait; more are dropped and counted.
pub struct Sender {
    tx: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<Export>>>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Spans and log records dropped (queue full, or out of tries) and sent.
    pub dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Set when the sender should stop retrying (finish).
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

const QUEUE: usize = 16;

/// Waits between tries of one export while the collector is unreachable: 1, 2, 4, 8, 16 s,
/// then it is dropped (and counted); meanwhile at most [`QUEUE`] more wait.
const BACKOFF_S: [u64; 5] = [1, 2, 4, 8, 16];

/// The items of an export, as the drop counter counts them (spans and log records).
fn items(e: &Export) -> u64 {
    (e.spans.len() + e.logs.len()) as u64
}

impl Sender {
    pub fn start(ep: Endpoint) -> Sender {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Export>(QUEUE);
        use std::sync::{Arc, atomic::Ordering::Relaxed};
        let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (lost, done, stop) = (dropped.clone(), sent.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("probe-otlp".into())
            .spawn(move || {
                let mut failing = false;
                for e in rx {
                    let mut tries = 0;
                    loop {
                        match ep.send(&e) {
                            Ok(_) => {
                                done.fetch_add(items(&e), Relaxed);
                                if failing {
                                    log::warn!("OTLP: sending again");
                                }
                                failing = false;
                                break;
                            }
                            Err(err) => {
                                // One line when sending starts failing, not one per export.
                                if !failing {
                                    log::warn!("OTLP: cannot send ({err}); retrying with backoff, at most {QUEUE} exports wait");
                                }
                                failing = true;
                                let retry = matches!(err, SendError::Retry(_));
                                if !retry || tries >= BACKOFF_S.len() || stop.load(Relaxed) {
                                    lost.fetch_add(items(&e), Relaxed);
                                    break;
                                }
                                // Sleep in steps, so finish() is not held up by a backoff.
                                let until = Instant::now() + Duration::from_secs(BACKOFF_S[tries]);
                                while Instant::now() < until && !stop.load(Relaxed) {
                                    std::thread::sleep(Duration::from_millis(50));
                                }
                                tries += 1;
                            }
                        }
                    }
                }
            })
            .expect("spawn the OTLP sender");
        Sender { tx: std::sync::Mutex::new(Some(tx)), thread: std::sync::Mutex::new(Some(thread)), dropped, sent, stopping }
    }

    pub fn send(&self, e: Export) {
        if e.spans.is_empty() && e.logs.is_empty() {
            return;
        }
        let n = items(&e);
        let sent = self.tx.lock().ok().and_then(|tx| tx.as_ref().map(|tx| tx.try_send(e).is_ok())).unwrap_or(false);
        if !sent {
            self.dropped.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Send what is queued, for at most `limit` (a collector that does not answer does not
    /// hold up the exit); later sends are counted as dropped. Returns the spans dropped in all.
    pub fn finish(&self, limit: std::time::Duration) -> u64 {
        drop(self.tx.lock().ok().and_then(|mut tx| tx.take()));
        let t = Instant::now();
        // Queued exports get one try each; none waits out a backoff.
        self.stopping.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.thread.lock().ok().and_then(|mut h| h.take()) {
            while !h.is_finished() && t.elapsed() < limit {
                std::thread::sleep(Duration::from_millis(20));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_from_paths() {
        assert_eq!(operation("/v1/chat/completions"), Some("chat"));
        assert_eq!(operation("/api/chat"), Some("chat"));
        assert_eq!(operation("/v1/completions?x=1"), Some("text_completion"));
        assert_eq!(operation("/completion"), Some("text_completion"));
        assert_eq!(operation("/api/generate"), Some("generate_content"));
        assert_eq!(operation("/health"), None);
    }

    #[test]
    fn ids_are_stable_and_distinct() {
        let a: [u8; 16] = id_bytes(&[1, 2, 3]);
        assert_eq!(a, id_bytes::<16>(&[1, 2, 3]));
        assert_ne!(a, id_bytes::<16>(&[1, 2, 4]));
        assert_ne!(&a[..8], &a[8..]);
        // Fixed across builds and machines (FNV-1a of chunk 0 and 7, computed apart).
        assert_eq!(hex(&id_bytes::<8>(&[7])), "028631409eca2f2b");
    }

    #[test]
    fn endpoint_adds_the_traces_path() {
        assert_eq!(Endpoint::parse("http://127.0.0.1:4318").unwrap().path, "/v1/traces");
        assert_eq!(Endpoint::parse("http://c:4318/otlp/v1/traces").unwrap().path, "/otlp/v1/traces");
        assert_eq!(Endpoint::parse("http://127.0.0.1:4318").unwrap().logs_path, "/v1/logs");
        assert_eq!(Endpoint::parse("http://c:4318/otlp/v1/traces").unwrap().logs_path, "/otlp/v1/logs");
    }

    /// otlp.json has its keys in alphabetical order in every object (once written through a
    /// sorted JSON map): the structs keep their fields so.
    #[test]
    fn json_keys_are_sorted() {
        let attrs = vec![("b".to_string(), Val::A(vec![Val::I(1), Val::D(0.5)])), ("a".to_string(), Val::B(true))];
        let span = |status| Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            name: "chat".into(),
            start_ns: 1,
            end_ns: 2,
            attrs: attrs.clone(),
            events: vec![Event { time_ns: 1, name: "first token".into(), attrs: attrs.clone() }],
            status,
            status_message: "stopped".into(),
        };
        let e = Export { resource: attrs.clone(), spans: vec![span(0), span(2)], logs: vec![] };
        let bytes = e.to_json().unwrap();
        let sorted = serde_json::to_vec(&serde_json::from_slice::<serde_json::Value>(&bytes).unwrap()).unwrap();
        assert_eq!(String::from_utf8(bytes).unwrap(), String::from_utf8(sorted).unwrap());
    }
}
