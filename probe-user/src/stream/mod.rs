//! Request streams: rebuilds every HTTP request the target serves (or makes) from the bytes its
//! sockets moved, with timing per content chunk and the stop information from the wire.
//! Bytes are parsed in memory and dropped; only [`RequestRecord`]s (numbers, method, path, stop
//! reasons) are kept. `http` frames messages, `payload` reads SSE / NDJSON / JSON bodies.
pub mod payload;

use std::collections::{HashMap, VecDeque};

use probe_common::{
    sock::{
        SOCK_RESET_RECEIVED, SOCK_RESET_SENT, SOCK_STATE, SockEvent, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_ESTABLISHED, TCP_FIN_WAIT1,
        TCP_SYN_RECV,
    },
    stream::{DATA_TAIL, DIR_RECV, DIR_SEND, DataEvent, tail_len},
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use self::payload::{Kind, Msg, Splitter, Stop};
use crate::util::http::{self, Body, Framing, Parsed};

/// Request bodies are kept (in memory, to read max_tokens and stream) up to this many bytes.
const MAX_BODY: usize = 256 << 10;
/// A request or response head longer than this is not HTTP.
const MAX_HEAD: usize = 64 << 10;
/// Connections followed at once; past it the least recently active ones are dropped.
pub const MAX_CONNS: usize = 4096;
/// Bytes held for all connections together (heads, request bodies, stream messages being
/// collected); past it the least recently active connections are dropped.
pub const MAX_HELD: usize = 64 << 20;
/// Requests waiting for their response on one connection (HTTP/1.1 pipelining); more means the
/// connection is not followed any further.
pub const MAX_PENDING: usize = 64;
/// A connection with no request in flight and no bytes for this long is forgotten (its next
/// request starts a new one). Time of the events, ns.
const IDLE_NS: u64 = 600_000_000_000;

/// What the tracker had to give up to stay bounded: written in the recording's stats records
/// and reported as data quality.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Limits {
    /// Connections dropped while a request or bytes of one were held (table full, memory budget,
    /// too many pipelined requests).
    pub conns_evicted: u64,
    /// Requests in flight on those connections (written with `evicted: true`).
    pub requests_evicted: u64,
    /// Connections forgotten with nothing in flight (idle, or past bytes that were not HTTP):
    /// nothing was lost.
    pub conns_forgotten: u64,
    /// The most connections followed at once, and the most bytes held for them.
    pub conns_peak: u64,
    pub held_peak: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Gaps {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Request ids: the target's requests number 1, 2, 3… in the order their heads arrive; probe's
/// own endpoint polls (known by their User-Agent once the head is parsed) number from
/// [`POLL_IDS`], apart, so a user's `--request 3` is the third request the server was sent.
#[derive(Debug)]
struct Ids {
    next: u64,
    next_poll: u64,
}

/// Where probe's own polls' ids start.
pub const POLL_IDS: u64 = 1 << 40;

impl Ids {
    fn take(&mut self, poll: bool) -> u64 {
        let n = if poll { &mut self.next_poll } else { &mut self.next };
        *n += 1;
        *n - 1
    }
}

crate::closed_set! {
    /// Which end of the request the target was: it received it (it serves it), or sent it (a
    /// gateway to its upstream, a front to its runner).
    Role {
        #[default]
        Server = "server",
        Client = "client",
    }
}

crate::closed_set! {
    /// Who closed the connection while a request was its current one.
    ClosedBy {
        /// The client (whichever end sent the first FIN or reset).
        Client = "client",
        Server = "server",
        /// The response ended and the connection stayed open (keep-alive).
        #[default]
        None = "none",
        /// In flight when the trace ended.
        Open = "open",
    }
}

crate::closed_set! {
    /// A reset on the connection, and which end sent it.
    Reset {
        #[default]
        None = "none",
        ByClient = "by_client",
        ByServer = "by_server",
    }
}

crate::closed_set! {
    /// Where a request's arrival time came from.
    Arrival {
        /// Its head was read while probe watched.
        #[default]
        Seen = "seen",
        /// It was in flight at attach: the kernel's TCP state dated its last request bytes
        /// (`tcp_info.tcpi_last_data_recv`, jiffy granularity).
        TcpState = "tcp_state",
    }
}

impl Arrival {
    fn is_seen(&self) -> bool {
        *self == Arrival::Seen
    }
}

/// A connection of the target found in the middle of a request right after attach (by
/// `crate::kernel::attach`, from the kernel's TCP state), for the tracker to take up.
#[derive(Clone, Debug, PartialEq)]
pub struct Seed {
    pub pid: u32,
    /// As the tracker writes addresses ("1.2.3.4:80", "[::1]:80").
    pub local: String,
    pub peer: String,
    /// When the request's last bytes arrived (CLOCK_MONOTONIC ns).
    pub arrival_ns: u64,
    pub state: SeedState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeedState {
    /// Request bytes wait unread (in the socket, or the connection in its listener's queue):
    /// the head will be read after attach, and dated by the kernel.
    Unread,
    /// The request was read and nothing was sent since: its response is all to come.
    Waiting,
    /// A response began before attach; `headers_only` when what was sent came right after the
    /// request and nothing since (a server that sends its headers at once). Taken up when the
    /// tracker sees that response go on (an idle keep-alive connection is not a request).
    Responding { headers_only: bool },
}

/// How long after attach a connection found answering is waited for ([`Tracker::expire_seeds`]).
pub const SEED_RESPONDING_NS: u64 = 5_000_000_000;
/// How long after attach one found with a request unread or only headers sent is waited for.
pub const SEED_WAITING_NS: u64 = 120_000_000_000;

/// A request in flight, as the live view shows it ([`Tracker::serving`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InFlight {
    pub id: u64,
    /// The client's address.
    pub peer: String,
    pub role: Role,
    pub probe_poll: bool,
    pub method: Option<String>,
    pub path: Option<String>,
    /// Method and path were inferred from the response (its head came before attach).
    pub inferred: bool,
    /// From the trace's start (negative: before attach).
    pub arrival_ms: Option<f64>,
    /// Messages with content so far.
    pub tokens: u64,
    pub began_before_attach: bool,
    /// Found at attach with its answer's headers sent and nothing since (not numbered yet: 0).
    pub headers_only: bool,
}

/// The owner of a request's peer socket, when it runs on this machine (found by `record::peer`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerProcess {
    pub pid: u32,
    pub comm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    /// Its container (name from the runtime's state files, else the id), when it runs in one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl PeerProcess {
    /// "nginx (pid 123, /usr/sbin/nginx, container web)".
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("pid {}", self.pid)];
        parts.extend(self.exe.clone());
        parts.extend(self.container.as_ref().map(|c| format!("container {c}")));
        format!("{} ({})", self.comm, parts.join(", "))
    }
}

/// One request as seen on the wire. Times in ms; `arrival_ms` from the start of the trace,
/// the others from the request's arrival (its first byte read by the server).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RequestRecord {
    pub id: u64,
    pub pid: u32,
    pub local: String,
    pub peer: String,
    pub role: Role,
    pub method: Option<String>,
    pub path: Option<String>,
    pub status: Option<u16>,
    pub stream: Option<bool>,
    pub max_tokens: Option<i64>,
    /// The prompt's size (bytes of its text, or of its token ids), and fingerprints of its
    /// prefixes (see [`payload::prompt_prefixes`]; no text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_prefix: Vec<(u32, u64)>,
    /// The client's word on the server's prompt cache (llama.cpp `cache_prompt`), when it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_prompt: Option<bool>,
    pub arrival_ms: Option<f64>,
    /// First response byte.
    pub ttfb_ms: Option<f64>,
    /// The target's thread that sent (or, as a client, read) the first response bytes: where
    /// the request's critical path ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer_tid: Option<u32>,
    /// First content chunk (for a non-streamed response: the response).
    pub ttft_ms: Option<f64>,
    /// Last response byte seen.
    pub end_ms: Option<f64>,
    pub chunks: u64,
    pub chunk_times_ms: Vec<f64>,
    pub chunk_gaps: Option<Gaps>,
    #[serde(flatten)]
    pub stop: Stop,
    /// The transport fact: who closed the connection while this request was its current one.
    pub closed_by: ClosedBy,
    pub reset: Reset,
    /// The server sent its final message (a stop reason, `[DONE]`, `"stop"/"done": true`, an
    /// error, or a body without stream messages that ended) before its peer closed.
    #[serde(default)]
    pub content_complete: bool,
    /// The HTTP framing ended cleanly: terminal chunk, full Content-Length, or the close that
    /// ends a body without a length.
    #[serde(default)]
    pub transport_complete: bool,
    /// When the server's final message was sent, ms after arrival.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_ms: Option<f64>,
    /// probe attached while this request was already in flight: its start was not seen.
    pub partial: bool,
    pub request_bytes: u64,
    pub response_bytes: u64,
    /// Bytes moved but not captured (each call captures its first 4095 bytes).
    pub bytes_not_captured: u64,
    /// Stream messages that could not be read (cut by the capture limit, not JSON).
    pub messages_unread: u64,
    /// A request probe's own endpoint poller made (left out of reports).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub probe_poll: bool,
    /// Messages with a hole whose stop fields were read from their captured end.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub messages_partly_read: u64,
    /// When the first close (FIN) or reset of the connection was seen, ms after arrival.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_ms: Option<f64>,
    /// probe stopped following this request's connection before the request ended (too many
    /// connections or bytes held at once, or too many pipelined requests): what came after was
    /// not seen.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub evicted: bool,
    /// A snapshot written while the request was in flight (see [`StreamTracker::snapshots`]): the
    /// request's later record replaces it. One left at the end of a recording was cut there.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_flight: bool,
    /// Where `arrival_ms` came from (an estimate for a request in flight at attach: then it is
    /// before the trace's start, negative).
    #[serde(default, skip_serializing_if = "Arrival::is_seen")]
    pub arrival_by: Arrival,
    /// Method and path were not seen (the head came before attach): inferred from the response.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub path_inferred: bool,
    /// The response had begun before attach with more than its headers: its first token may
    /// have come before, so there is no TTFT.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub began_before_attach: bool,
    /// The process at the other end, when it runs on this machine (a gateway, a chat UI's
    /// backend, a local client): looked up while the connection was open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_process: Option<PeerProcess>,
}

impl RequestRecord {
    /// Tokens the server produced: its usage or timings, else the content chunks seen.
    pub fn produced(&self) -> u64 {
        let s = &self.stop;
        s.usage
            .as_ref()
            .and_then(|u| u["completion_tokens"].as_u64())
            .or_else(|| s.server_timings.as_ref().and_then(|t| t["predicted_n"].as_u64().or(t["eval_count"].as_u64())))
            .unwrap_or(self.chunks)
    }

    /// How the connection ended for this request, in words: who closed, and a reset if there was one.
    pub fn ended(&self) -> String {
        let who = match self.closed_by {
            ClosedBy::Client => "client closed",
            ClosedBy::Server => "server closed",
            ClosedBy::None => "kept open",
            ClosedBy::Open => "open at end",
        };
        match self.reset {
            Reset::None => who.to_string(),
            Reset::ByClient => format!("{who} (reset by client)"),
            Reset::ByServer => format!("{who} (reset by server)"),
        }
    }

    /// The two completeness facts in one word: "yes" (both), "content" (the server's final
    /// message, then the framing was cut), "transport" (framing ended without the server's
    /// final message), "no".
    pub fn completeness(&self) -> &'static str {
        match (self.content_complete, self.transport_complete) {
            (true, true) => "yes",
            (true, false) => "content",
            (false, true) => "transport",
            (false, false) => "no",
        }
    }

    /// A record written by a probe before the two completeness fields (it had one `complete`
    /// and called closes "server" / "server_abort"): read it with today's words.
    pub fn upgrade_legacy(v: &mut Value) {
        let Some(o) = v.as_object_mut() else { return };
        if o.contains_key("transport_complete") {
            return;
        }
        let complete = o.remove("complete").and_then(|c| c.as_bool()).unwrap_or(false);
        o.insert("transport_complete".into(), Value::Bool(complete));
        // Stop fields in a record cut short were most likely read before the close.
        let said =
            ["finish_reason", "stop_type", "stopped", "done_reason", "error"].iter().any(|k| o.get(*k).is_some_and(|x| !x.is_null()))
                || o.get("done_marker") == Some(&Value::Bool(true));
        o.insert("content_complete".into(), Value::Bool(complete || said));
        let by = match o.get("closed_by").and_then(Value::as_str) {
            Some("server") => "none",
            Some("server_abort") => "server",
            Some(other) => other,
            None => "open",
        };
        o.insert("closed_by".into(), Value::String(by.into()));
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug)]
enum Side {
    /// Collecting a head; the time of its first byte.
    Head(Vec<u8>, u64),
    Body(Body),
    /// Framing lost (gap over a head, garbage): wait for something that starts a message.
    Lost,
}

#[derive(Debug)]
struct Pending {
    rec: RequestRecord,
    arrival_ns: Option<u64>,
    body: Vec<u8>,
    body_cut: bool,
    splitter: Option<Splitter>,
    content_type: String,
    response_started: bool,
    /// When the server began sending its final message (syscall entry, ns): a peer that closed
    /// after this left after the server had stopped.
    final_at: Option<u64>,
    /// A snapshot of it was taken (once per request).
    snapshot: bool,
    /// The response's head was sent before attach: its first byte was not seen (no TTFB).
    head_before_attach: bool,
    /// The API its response messages belong to (for a request whose head was not seen).
    api: Option<&'static str>,
}

#[derive(Debug)]
struct Conn {
    pid: u32,
    local: String,
    peer: String,
    /// Request bytes flow in on `recv` when the target is the server.
    req_dir: Option<u8>,
    req: Side,
    resp: Side,
    pending: VecDeque<Pending>,
    seen_any: bool,
    /// Who closed first ("client" / "server_abort") and resets.
    closer: Option<ClosedBy>,
    /// When the first close or reset was seen (ns).
    closed_at: Option<u64>,
    /// When the peer's FIN or reset was first seen (ns).
    peer_closed_at: Option<u64>,
    reset: Reset,
    /// The tail record expected for the last large call: (direction, bytes, its entry time).
    expect_tail: Option<(u8, u32, u64)>,
    /// The last event of this connection (ns).
    last_ts: u64,
    /// The target thread of the call being fed (its response bytes: the request's writer).
    last_tid: u32,
    /// Bytes held, as last counted in `Tracker::held`.
    held: usize,
    /// More pipelined requests than [`MAX_PENDING`]: to be dropped.
    overflow: bool,
    /// The kernel's time for the first request head still to be read (see [`SeedState::Unread`]).
    arrival_hint: Option<u64>,
    /// The owner of the other end, when it is on this machine ([`Tracker::peers_to_name`]).
    peer_process: Option<PeerProcess>,
    peer_asked: bool,
}

impl Conn {
    fn new(pid: u32, local: String, peer: String) -> Conn {
        Conn {
            pid,
            local,
            peer,
            req_dir: None,
            req: Side::Head(Vec::new(), 0),
            resp: Side::Head(Vec::new(), 0),
            pending: VecDeque::new(),
            seen_any: false,
            closer: None,
            closed_at: None,
            peer_closed_at: None,
            reset: Reset::None,
            expect_tail: None,
            last_ts: 0,
            last_tid: 0,
            held: 0,
            overflow: false,
            arrival_hint: None,
            peer_process: None,
            peer_asked: false,
        }
    }

    /// Bytes this connection's parsers hold.
    fn held(&self) -> usize {
        let side = |s: &Side| match s {
            Side::Head(b, _) => b.capacity(),
            Side::Body(b) => b.held(),
            Side::Lost => 0,
        };
        side(&self.req)
            + side(&self.resp)
            + self.pending.iter().map(|p| p.body.capacity() + p.splitter.as_ref().map_or(0, Splitter::held)).sum::<usize>()
    }
}

/// Follows every connection and turns bytes into request records.
pub struct Tracker {
    start_ns: u64,
    keep_text: bool,
    conns: HashMap<u64, Conn>,
    next_id: Ids,
    pub done: Vec<RequestRecord>,
    /// Bytes held by all connections (the sum of their `held`).
    held: usize,
    /// When idle connections were last looked for (ns).
    last_sweep: u64,
    limits: Limits,
    /// Connections in flight at attach not seen yet, by (local, peer): taken up by their first
    /// event ([`Tracker::seed`]).
    seeds: HashMap<(String, String), Seed>,
    /// Connections whose peer has not been looked for ([`Tracker::peers_to_name`]).
    new_conns: Vec<u64>,
    /// Connections in flight at attach followed under a key of their own until their first
    /// event gives the kernel's socket address.
    seeded: HashMap<(String, String), u64>,
}

fn addr(family: u16, a: &[u8; 16], port: u16) -> String {
    if family == probe_common::sock::AF_INET6 {
        format!("[{}]:{port}", std::net::Ipv6Addr::from(*a))
    } else {
        format!("{}.{}.{}.{}:{port}", a[0], a[1], a[2], a[3])
    }
}

fn gaps(times: &[f64]) -> Option<Gaps> {
    let mut g: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    if g.is_empty() {
        return None;
    }
    g.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| crate::util::stats::percentile_sorted(&g, p).unwrap_or(0.0);
    Some(Gaps { p50_ms: at(50.0), p99_ms: at(99.0), max_ms: g[g.len() - 1] })
}

impl Tracker {
    pub fn new(start_ns: u64, keep_text: bool) -> Self {
        Tracker {
            start_ns,
            keep_text,
            conns: HashMap::new(),
            next_id: Ids { next: 1, next_poll: POLL_IDS },
            done: Vec::new(),
            held: 0,
            last_sweep: start_ns,
            limits: Limits::default(),
            seeds: HashMap::new(),
            seeded: HashMap::new(),
            new_conns: Vec::new(),
        }
    }

    /// Take up the connections found mid-request at attach. A request already read and not yet
    /// answered is in flight from now on (the live view, a Ctrl-C, a close all see it); the
    /// others wait for their connection's next bytes.
    pub fn seed(&mut self, seeds: Vec<Seed>) {
        for s in seeds {
            let key = (s.local.clone(), s.peer.clone());
            if s.state != SeedState::Waiting {
                self.seeds.insert(key, s);
                continue;
            }
            // Never a kernel address (those are in the top half of the address space).
            let sk = self.seeded.len() as u64 + 1;
            let mut conn = Conn::new(s.pid, s.local, s.peer);
            conn.req_dir = Some(DIR_RECV);
            conn.seen_any = true;
            let p = Self::pending_at_attach(&conn, &mut self.next_id, s.arrival_ns, self.start_ns, false);
            conn.pending.push_back(p);
            self.conns.insert(sk, conn);
            self.new_conns.push(sk);
            self.seeded.insert(key, sk);
        }
    }

    /// Connections found at attach and not taken up by now are let go: one whose answer was
    /// going on (tokens come every few ms) after [`SEED_RESPONDING_NS`], the others (a request
    /// still unread, or waiting behind its headers) after [`SEED_WAITING_NS`]. An idle keep-alive
    /// connection the kernel's state could not tell from a request is never taken up, and every
    /// data event looks seeds up while some are left.
    pub fn expire_seeds(&mut self, now_ns: u64) {
        if self.seeds.is_empty() {
            return;
        }
        let attach = self.start_ns;
        self.seeds.retain(|_, s| {
            let keep = match s.state {
                SeedState::Responding { headers_only: false } => SEED_RESPONDING_NS,
                _ => SEED_WAITING_NS,
            };
            now_ns < attach.saturating_add(keep)
        });
    }

    /// Connections found at attach are still to be taken up.
    fn seeding(&self) -> bool {
        !self.seeds.is_empty() || !self.seeded.is_empty()
    }

    fn pending_at_attach(conn: &Conn, id: &mut Ids, arrival_ns: u64, start_ns: u64, began: bool) -> Pending {
        let mut p = Self::new_pending(conn, id, Role::Server, true, false);
        p.arrival_ns = Some(arrival_ns);
        p.rec.arrival_ms = Some((i128::from(arrival_ns) - i128::from(start_ns)) as f64 / 1e6);
        p.rec.arrival_by = Arrival::TcpState;
        p.rec.began_before_attach = began;
        p
    }

    /// The first event of connection `sk` (local, peer): a connection found mid-request at
    /// attach is taken up. `sending`: the event is the server sending (a response going on).
    fn adopt(&mut self, sk: u64, local: &str, peer: &str, sending: Option<bool>, payload: &[u8]) {
        if self.seeds.is_empty() && self.seeded.is_empty() {
            return;
        }
        let key = (local.to_string(), peer.to_string());
        if let Some(old) = self.seeded.remove(&key) {
            if let Some(c) = self.conns.remove(&old) {
                self.conns.insert(sk, c);
                self.new_conns.push(sk);
            }
            return;
        }
        let Some(s) = self.seeds.get(&key) else { return };
        let mut conn = Conn::new(s.pid, s.local.clone(), s.peer.clone());
        conn.req_dir = Some(DIR_RECV);
        match s.state {
            SeedState::Unread => conn.arrival_hint = Some(s.arrival_ns),
            SeedState::Responding { headers_only } if sending == Some(true) && !payload.starts_with(b"HTTP/") => {
                let mut p = Self::pending_at_attach(&conn, &mut self.next_id, s.arrival_ns, self.start_ns, !headers_only);
                let framing = if looks_like_chunk_start(payload) { Framing::Chunked } else { Framing::UntilClose };
                conn.resp = Side::Body(Body::new(framing));
                p.response_started = true;
                p.head_before_attach = true;
                conn.pending.push_back(p);
            }
            // A close, or the client's next request: the connection was idle.
            SeedState::Responding { .. } if sending.is_some() => {}
            _ => return,
        }
        self.seeds.remove(&key);
        if conn.arrival_hint.is_some() || !conn.pending.is_empty() {
            self.conns.insert(sk, conn);
            self.new_conns.push(sk);
        }
    }

    /// What was given up to stay bounded, so far.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Connections followed now, and the bytes their parsers hold.
    pub fn usage(&self) -> (usize, usize) {
        (self.conns.len(), self.held)
    }

    /// Requests in flight for at least `age_ns` (at `now_ns`) and not snapshotted yet, as records
    /// marked `in_flight`: written at once, they keep a request that a torn recording (probe
    /// killed, the disk full) would otherwise lose. Its final record replaces the snapshot.
    pub fn snapshots(&mut self, now_ns: u64, age_ns: u64) -> Vec<RequestRecord> {
        let mut out = Vec::new();
        for conn in self.conns.values_mut() {
            for p in conn.pending.iter_mut().filter(|p| !p.snapshot && p.arrival_ns.is_some_and(|a| a + age_ns <= now_ns)) {
                p.snapshot = true;
                out.push(RequestRecord { in_flight: true, closed_by: ClosedBy::Open, ..p.rec.clone() });
            }
        }
        out
    }

    /// The requests in flight as they stand (the live view's), in no order.
    pub fn serving(&self) -> Vec<InFlight> {
        let mut out = Vec::new();
        for p in self.conns.values().flat_map(|c| c.pending.iter()) {
            let r = &p.rec;
            let peer = r.peer.clone();
            let (method, path, inferred) = match (&r.method, p.api) {
                (None, Some(api)) => (Some("POST".to_string()), Some(api.to_string()), true),
                _ => (r.method.clone(), r.path.clone(), r.path_inferred),
            };
            out.push(InFlight {
                id: r.id,
                peer,
                role: r.role,
                probe_poll: r.probe_poll,
                method,
                path,
                inferred,
                arrival_ms: r.arrival_ms,
                tokens: r.chunks,
                began_before_attach: r.began_before_attach,
                headers_only: false,
            });
        }
        // Connections found at attach with a request unread, or an answer begun with its headers
        // only, not taken up yet: in flight by the kernel's state, not numbered until they are.
        for s in self.seeds.values().filter(|s| matches!(s.state, SeedState::Unread | SeedState::Responding { headers_only: true })) {
            out.push(InFlight {
                peer: s.peer.clone(),
                role: Role::Server,
                arrival_ms: Some((i128::from(s.arrival_ns) - i128::from(self.start_ns)) as f64 / 1e6),
                headers_only: s.state != SeedState::Unread,
                ..Default::default()
            });
        }
        out
    }

    /// Requests not finished yet.
    /// Connections with a request in flight for at least `age_ns` at `now_ns` whose other end has
    /// not been looked for yet, once each: (target pid, local, peer). Looked up while open (a
    /// closed socket has no owner); a request answered sooner costs no lookup (a deadline or a
    /// reader that leaves is a request that lasted).
    pub fn peers_to_name(&mut self, now_ns: u64, age_ns: u64) -> Vec<(u32, String, String)> {
        let mut out = Vec::new();
        for sk in std::mem::take(&mut self.new_conns) {
            let Some(c) = self.conns.get_mut(&sk) else { continue };
            if c.peer_asked {
                continue;
            }
            let old_enough = c.pending.front().is_some_and(|p| p.arrival_ns.is_none_or(|a| a + age_ns <= now_ns));
            if !old_enough {
                // No request yet, or a young one: looked at again at the next turn.
                self.new_conns.push(sk);
                continue;
            }
            c.peer_asked = true;
            if c.pending.iter().all(|p| p.rec.probe_poll) {
                continue;
            }
            out.push((c.pid, c.local.clone(), c.peer.clone()));
        }
        out
    }

    /// What `record::peer::resolve` found for connections [`Tracker::peers_to_name`] gave.
    pub fn name_peers(&mut self, found: &HashMap<(String, String), PeerProcess>) {
        if found.is_empty() {
            return;
        }
        for c in self.conns.values_mut() {
            if let Some(p) = found.get(&(c.local.clone(), c.peer.clone())) {
                c.peer_process = Some(p.clone());
                for q in &mut c.pending {
                    q.rec.peer_process = Some(p.clone());
                }
            }
        }
    }

    pub fn in_flight(&self) -> usize {
        self.conns.values().map(|c| c.pending.len()).sum()
    }

    /// Bytes a traced socket call moved (its captured part).
    pub fn on_data(&mut self, ev: &DataEvent, payload: &[u8]) {
        let ts = ev.hdr.ts_ns;
        if !self.conns.contains_key(&ev.sk) && self.conns.len() >= MAX_CONNS {
            // Make room for a sixteenth of the table at once: eviction stays amortized O(log n).
            self.evict_least_recent(MAX_CONNS - MAX_CONNS / 16, usize::MAX);
        }
        self.data(ev, payload);
        if let Some(conn) = self.conns.get_mut(&ev.sk) {
            conn.last_ts = conn.last_ts.max(ts);
            let now = conn.held();
            self.held = self.held + now - conn.held;
            conn.held = now;
            if conn.overflow {
                self.evict(ev.sk);
            }
        }
        self.limits.conns_peak = self.limits.conns_peak.max(self.conns.len() as u64);
        self.limits.held_peak = self.limits.held_peak.max(self.held as u64);
        if self.held > MAX_HELD {
            self.evict_least_recent(usize::MAX, MAX_HELD - MAX_HELD / 4);
        }
        if ts.saturating_sub(self.last_sweep) > IDLE_NS / 10 {
            self.last_sweep = ts;
            self.drop_idle(ts);
        }
    }

    /// Forget connections idle for [`IDLE_NS`] with no request in flight.
    fn drop_idle(&mut self, now: u64) {
        let idle: Vec<u64> =
            self.conns.iter().filter(|(_, c)| c.pending.is_empty() && now.saturating_sub(c.last_ts) > IDLE_NS).map(|(sk, _)| *sk).collect();
        for sk in idle {
            self.remove(sk);
            self.limits.conns_forgotten += 1;
        }
    }

    /// Drop the least recently active connections until at most `conns` are left and they hold
    /// at most `bytes`.
    fn evict_least_recent(&mut self, conns: usize, bytes: usize) {
        let mut by_age: Vec<(u64, u64)> = self.conns.iter().map(|(sk, c)| (c.last_ts, *sk)).collect();
        by_age.sort_unstable();
        for (_, sk) in by_age {
            if self.conns.len() <= conns && self.held <= bytes {
                break;
            }
            self.evict(sk);
        }
    }

    /// Stop following a connection in use: its requests in flight are written as they are,
    /// marked `evicted`.
    fn evict(&mut self, sk: u64) {
        let Some(mut conn) = self.remove(sk) else { return };
        if conn.pending.is_empty() && conn.held == 0 {
            self.limits.conns_forgotten += 1;
            return;
        }
        self.limits.conns_evicted += 1;
        self.limits.requests_evicted += conn.pending.len() as u64;
        self.write_unfinished(&mut conn, true);
    }

    /// Write the requests still in flight on a connection no longer followed, as they are
    /// (their buffered stream messages read for stop fields).
    fn write_unfinished(&mut self, conn: &mut Conn, evicted: bool) {
        let closer = conn.closer.unwrap_or(ClosedBy::Open);
        while let Some(mut p) = conn.pending.pop_front() {
            if let Some(s) = p.splitter.as_mut() {
                let mut msgs = Vec::new();
                s.finish(&mut msgs);
                apply_msgs(&mut p, msgs, (0, 0), self.keep_text);
            }
            let mut rec = finalize(p, conn, closer);
            rec.evicted = evicted;
            self.done.push(rec);
        }
    }

    fn remove(&mut self, sk: u64) -> Option<Conn> {
        let conn = self.conns.remove(&sk)?;
        self.held -= conn.held;
        Some(conn)
    }

    fn data(&mut self, ev: &DataEvent, payload: &[u8]) {
        if self.seeding() && !self.conns.contains_key(&ev.sk) {
            let (local, peer) = (addr(ev.family, &ev.saddr, ev.sport), addr(ev.family, &ev.daddr, ev.dport));
            self.adopt(ev.sk, &local, &peer, Some(ev.dir == DIR_SEND), payload);
        }
        let conn = match self.conns.entry(ev.sk) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                self.new_conns.push(ev.sk);
                e.insert(Conn::new(ev.hdr.pid, addr(ev.family, &ev.saddr, ev.sport), addr(ev.family, &ev.daddr, ev.dport)))
            }
        };
        let ts = ev.hdr.ts_ns;
        conn.last_tid = ev.hdr.tid;
        if ev.syscall & DATA_TAIL != 0 {
            // The last bytes of the call before: what lies between head and tail is a gap.
            match conn.expect_tail.take() {
                Some((dir, n, enter)) if dir == ev.dir && enter == ev.enter_ns => {
                    let missing = (n as u64).saturating_sub(payload.len() as u64);
                    Self::feed(
                        conn,
                        dir,
                        payload,
                        missing,
                        (ts, ev.enter_ns),
                        &mut self.next_id,
                        self.start_ns,
                        self.keep_text,
                        &mut self.done,
                    );
                }
                Some((dir, n, _)) => Self::feed(
                    conn,
                    dir,
                    &[],
                    n as u64,
                    (ts, ev.enter_ns),
                    &mut self.next_id,
                    self.start_ns,
                    self.keep_text,
                    &mut self.done,
                ),
                None => {}
            }
            return;
        }
        if let Some((dir, n, _)) = conn.expect_tail.take() {
            // The tail never came (lost): its bytes are a gap.
            Self::feed(conn, dir, &[], n as u64, (ts, ev.enter_ns), &mut self.next_id, self.start_ns, self.keep_text, &mut self.done);
        }
        let first = !conn.seen_any;
        conn.seen_any = true;
        // Which way do requests flow? The first bytes that parse as a request head decide.
        if conn.req_dir.is_none() {
            if http::looks_like_request(payload) || http::only_a_request_start(payload) {
                conn.req_dir = Some(ev.dir);
            } else if payload.starts_with(b"HTTP/") {
                conn.req_dir = Some(ev.dir ^ 1);
            } else if first {
                // Attached mid-stream: responses are what the server sends.
                conn.req_dir = Some(DIR_RECV);
            }
        }
        let tail = tail_len(ev.syscall, ev.len, ev.captured);
        let missing = ev.len.saturating_sub(ev.captured + tail) as u64;
        Self::feed(conn, ev.dir, payload, missing, (ts, ev.enter_ns), &mut self.next_id, self.start_ns, self.keep_text, &mut self.done);
        if tail > 0 {
            conn.expect_tail = Some((ev.dir, tail, ev.enter_ns));
        }
    }

    /// Bytes that moved in direction `dir`, then `missing` bytes that were not captured; `at` is
    /// (the call's return, its entry) in ns.
    #[allow(clippy::too_many_arguments)]
    fn feed(
        conn: &mut Conn,
        dir: u8,
        payload: &[u8],
        missing: u64,
        at: (u64, u64),
        next_id: &mut Ids,
        start_ns: u64,
        keep_text: bool,
        done: &mut Vec<RequestRecord>,
    ) {
        let Some(req_dir) = conn.req_dir else { return };
        let role = if req_dir == DIR_RECV { Role::Server } else { Role::Client };
        if dir == req_dir {
            Self::request_bytes(conn, payload, missing, at.0, role, next_id, start_ns);
        } else {
            let finished = Self::response_bytes(conn, payload, missing, at, role, next_id, keep_text);
            for p in finished {
                // The response ended while the connection stayed open (unless a close was seen).
                let closer = conn.closer.unwrap_or(ClosedBy::None);
                done.push(finalize(p, conn, closer));
            }
        }
    }

    /// A tail that was expected before a close or the end of the trace is a gap.
    fn flush_tail(&mut self, sk: u64, ts: u64) {
        let Some(conn) = self.conns.get_mut(&sk) else { return };
        if let Some((dir, n, _)) = conn.expect_tail.take() {
            Self::feed(conn, dir, &[], n as u64, (ts, ts), &mut self.next_id, self.start_ns, self.keep_text, &mut self.done);
        }
    }

    fn new_pending(conn: &Conn, id: &mut Ids, role: Role, partial: bool, poll: bool) -> Pending {
        let rec = RequestRecord {
            id: id.take(poll),
            pid: conn.pid,
            local: conn.local.clone(),
            peer: conn.peer.clone(),
            role,
            partial,
            reset: Reset::None,
            peer_process: conn.peer_process.clone(),
            ..Default::default()
        };
        Pending {
            rec,
            arrival_ns: None,
            body: Vec::new(),
            body_cut: false,
            splitter: None,
            content_type: String::new(),
            response_started: false,
            final_at: None,
            snapshot: false,
            head_before_attach: false,
            api: None,
        }
    }

    fn request_bytes(conn: &mut Conn, mut data: &[u8], missing: u64, ts: u64, role: Role, id: &mut Ids, start_ns: u64) {
        if let Some(p) = conn.pending.back_mut().filter(|_| matches!(conn.req, Side::Body(_))) {
            p.rec.request_bytes += data.len() as u64 + missing;
            p.rec.bytes_not_captured += missing;
        }
        while !data.is_empty() {
            match &mut conn.req {
                Side::Lost => {
                    if !http::may_start_request(data) {
                        return;
                    }
                    conn.req = Side::Head(Vec::new(), ts);
                }
                Side::Head(buf, t0) => {
                    if buf.is_empty() {
                        *t0 = ts;
                        if !http::may_start_request(data) {
                            conn.req = Side::Lost;
                            return;
                        }
                    }
                    let before = buf.len();
                    buf.extend_from_slice(data);
                    // Parsed again only when a blank line arrived (and once at the start, to
                    // refuse garbage early): heads cost linear time however they are split.
                    let parsed = if before == 0 || head_ends(buf, before) { http::parse_request(buf) } else { Parsed::Partial };
                    match parsed {
                        Parsed::Done(head, n) => {
                            // A head that waited unread at attach: the kernel dated its arrival.
                            let hint = conn.arrival_hint.take();
                            let t0 = hint.map_or(*t0, |h| h.min(*t0));
                            // A stand-in taken up at attach (the kernel's state said read, nothing
                            // answered) whose head probe then saw read: the read came between
                            // arming and the dump. The head is the stand-in's own, not another
                            // request's (else one request is two: its head without its answer,
                            // its answer without its head).
                            let stand_in = conn.pending.back().is_some_and(|q| {
                                q.rec.method.is_none()
                                    && q.rec.arrival_by == Arrival::TcpState
                                    && q.rec.request_bytes == 0
                                    && !q.response_started
                            });
                            let own_id = if stand_in { conn.pending.pop_back().map(|q| q.rec.id) } else { None };
                            // The User-Agent says probe; on a connection the target serves, the
                            // client's socket must say so too. Where the target is the client (a
                            // gateway relaying probe's poll to its runner), the head is all there is;
                            // the request that came in to the gateway was checked on its own side.
                            let poll = head.probe_poll && (role != Role::Server || http::poll_is_probes(&conn.local, &conn.peer, conn.pid));
                            let mut p = Self::new_pending(conn, id, role, false, poll);
                            if let Some(own) = own_id {
                                // The number just taken goes back: ids stay consecutive.
                                if !poll {
                                    id.next -= 1;
                                }
                                p.rec.id = own;
                            }
                            if hint.is_some() {
                                p.rec.arrival_by = Arrival::TcpState;
                            }
                            p.rec.method = Some(head.method.clone());
                            // A query string can carry a key (`?api_key=`): never kept.
                            p.rec.path = Some(crate::util::redact::scrub(&head.path));
                            p.rec.probe_poll = poll;
                            p.arrival_ns = Some(t0);
                            p.rec.arrival_ms = Some(t0.saturating_sub(start_ns) as f64 / 1e6);
                            let used = n - before;
                            p.rec.request_bytes = n as u64 + missing;
                            p.rec.bytes_not_captured += missing;
                            data = &data[used..];
                            let body = Body::new(head.framing.unwrap_or(Framing::None));
                            let done = body.done;
                            conn.pending.push_back(p);
                            if conn.pending.len() > MAX_PENDING {
                                conn.overflow = true;
                                conn.req = Side::Lost;
                                return;
                            }
                            conn.req = Side::Body(body);
                            if done {
                                Self::request_done(conn);
                            }
                        }
                        Parsed::Partial if buf.len() < MAX_HEAD => return,
                        _ => {
                            conn.req = Side::Lost;
                            return;
                        }
                    }
                }
                Side::Body(body) => {
                    let Some(p) = conn.pending.back_mut() else {
                        conn.req = Side::Lost;
                        return;
                    };
                    let mut out = Vec::new();
                    let Some(used) = body.feed(data, &mut out) else {
                        conn.req = Side::Lost;
                        return;
                    };
                    if p.body.len() + out.len() <= MAX_BODY {
                        p.body.extend_from_slice(&out);
                    } else {
                        p.body_cut = true;
                    }
                    data = &data[used..];
                    if body.done {
                        Self::request_done(conn);
                    }
                }
            }
        }
        if missing > 0 {
            match &mut conn.req {
                Side::Body(body) => {
                    if let Some(p) = conn.pending.back_mut() {
                        p.body_cut = true;
                    }
                    if !body.gap(missing) {
                        conn.req = Side::Lost;
                    } else if body.done {
                        Self::request_done(conn);
                    }
                }
                _ => conn.req = Side::Lost,
            }
        }
    }

    /// The request body is complete: read max_tokens and stream from it, then forget it.
    fn request_done(conn: &mut Conn) {
        conn.req = Side::Head(Vec::new(), 0);
        let Some(p) = conn.pending.back_mut() else { return };
        let body = std::mem::take(&mut p.body);
        match serde_json::from_slice::<Value>(&body) {
            Ok(v) if !p.body_cut => {
                p.rec.max_tokens = payload::max_tokens(&v);
                p.rec.stream = v.get("stream").and_then(Value::as_bool);
                p.rec.cache_prompt = v.get("cache_prompt").and_then(Value::as_bool);
                if let Some((n, prefixes)) = payload::prompt_prefixes(&v) {
                    p.rec.prompt_bytes = Some(n);
                    p.rec.prompt_prefix = prefixes;
                }
            }
            _ => {
                let (max, stream) = payload::scan_fields(&body);
                p.rec.max_tokens = max;
                p.rec.stream = stream;
            }
        }
        // Without a `stream` key, Ollama's native API streams and the others do not.
        let path = p.rec.path.as_deref().unwrap_or("");
        if p.rec.stream.is_none() && !body.is_empty() && !p.body_cut {
            p.rec.stream = Some(path.starts_with("/api/generate") || path.starts_with("/api/chat"));
        }
    }

    fn response_bytes(
        conn: &mut Conn,
        mut data: &[u8],
        missing: u64,
        at: (u64, u64),
        role: Role,
        id: &mut Ids,
        keep_text: bool,
    ) -> Vec<Pending> {
        let (ts, sent) = at;
        let mut finished = Vec::new();
        // The response belongs to the oldest request still waiting for one.
        if conn.pending.is_empty() {
            if data.is_empty() && missing == 0 {
                return finished;
            }
            let mut p = Self::new_pending(conn, id, role, true, false);
            if !data.starts_with(b"HTTP/") {
                // Attached mid-response. Servers that stream write one chunk per call, so a
                // write that starts with a chunk-size line means chunked framing.
                let framing = if looks_like_chunk_start(data) { Framing::Chunked } else { Framing::UntilClose };
                conn.resp = Side::Body(Body::new(framing));
                p.response_started = true;
            }
            conn.pending.push_back(p);
        }
        if let Some(p) = conn.pending.front_mut() {
            p.rec.response_bytes += data.len() as u64 + missing;
            p.rec.bytes_not_captured += missing;
            if p.rec.ttfb_ms.is_none()
                && !p.head_before_attach
                && let Some(a) = p.arrival_ns
            {
                p.rec.ttfb_ms = Some(ts.saturating_sub(a) as f64 / 1e6);
                p.rec.writer_tid = Some(conn.last_tid).filter(|&t| t != 0);
            }
        }
        // A request taken up at attach as not answered yet, whose response head went out all the
        // same (in the same jiffy as the request's last bytes): the body goes on.
        let mid = matches!(&conn.resp, Side::Head(b, _) if b.is_empty())
            && conn.pending.front().is_some_and(|p| p.rec.arrival_by == Arrival::TcpState && !p.response_started)
            && !data.is_empty()
            && !data.starts_with(b"HTTP/");
        if mid && let Some(p) = conn.pending.front_mut() {
            let framing = if looks_like_chunk_start(data) { Framing::Chunked } else { Framing::UntilClose };
            conn.resp = Side::Body(Body::new(framing));
            p.response_started = true;
            p.head_before_attach = true;
            p.rec.ttfb_ms = None;
        }
        while !data.is_empty() {
            let Some(p) = conn.pending.front_mut() else { break };
            match &mut conn.resp {
                Side::Lost => return finished,
                Side::Head(buf, _) => {
                    let before = buf.len();
                    buf.extend_from_slice(data);
                    let parsed = if before == 0 || head_ends(buf, before) { http::parse_response(buf) } else { Parsed::Partial };
                    match parsed {
                        Parsed::Done(head, n) => {
                            data = &data[n - before..];
                            let method = p.rec.method.clone().unwrap_or_default();
                            p.rec.status = Some(head.status);
                            p.content_type = head.content_type.clone();
                            p.response_started = true;
                            let body = Body::new(head.framing(&method));
                            let done = body.done;
                            conn.resp = Side::Body(body);
                            if head.status == 100 {
                                conn.resp = Side::Head(Vec::new(), 0);
                                continue;
                            }
                            if done {
                                conn.resp = Side::Head(Vec::new(), 0);
                                if let Some(mut p) = conn.pending.pop_front() {
                                    p.rec.transport_complete = true;
                                    p.final_at.get_or_insert(sent);
                                    end(&mut p, ts);
                                    finished.push(p);
                                }
                            }
                        }
                        Parsed::Partial if buf.len() < MAX_HEAD => return finished,
                        _ => {
                            conn.resp = Side::Lost;
                            return finished;
                        }
                    }
                }
                Side::Body(body) => {
                    let mut out = Vec::new();
                    let Some(used) = body.feed(data, &mut out) else {
                        conn.resp = Side::Lost;
                        return finished;
                    };
                    data = &data[used..];
                    messages(p, &out, (ts, sent), keep_text, false);
                    if body.done {
                        messages(p, &[], (ts, sent), keep_text, true);
                        conn.resp = Side::Head(Vec::new(), 0);
                        if let Some(mut p) = conn.pending.pop_front() {
                            p.rec.transport_complete = true;
                            p.final_at.get_or_insert(sent);
                            end(&mut p, ts);
                            finished.push(p);
                        }
                    }
                }
            }
        }
        if missing > 0 {
            match (&mut conn.resp, conn.pending.front_mut()) {
                (Side::Body(body), Some(p)) => {
                    if let Some(s) = p.splitter.as_mut() {
                        let mut msgs = Vec::new();
                        s.gap(&mut msgs);
                        p.rec.messages_unread += msgs.len() as u64;
                    }
                    if !body.gap(missing) {
                        conn.resp = Side::Lost;
                    }
                }
                _ => conn.resp = Side::Lost,
            }
        }
        if let Some(p) = conn.pending.front_mut() {
            end(p, ts);
        }
        finished
    }

    /// A TCP state change or reset of a connection.
    pub fn on_sock(&mut self, ev: &SockEvent) {
        if self.seeding() && !self.conns.contains_key(&ev.skaddr) {
            let (local, peer) = (addr(ev.family, &ev.saddr, ev.sport), addr(ev.family, &ev.daddr, ev.dport));
            self.adopt(ev.skaddr, &local, &peer, None, &[]);
        }
        if ev.what == SOCK_STATE && ev.newstate == TCP_CLOSE {
            self.flush_tail(ev.skaddr, ev.hdr.ts_ns);
        }
        let Some(conn) = self.conns.get_mut(&ev.skaddr) else { return };
        let client_side = conn.req_dir == Some(DIR_RECV);
        // "peer" is the other end; for a server that is the client.
        let (peer_word, local_word) = if client_side { (ClosedBy::Client, ClosedBy::Server) } else { (ClosedBy::Server, ClosedBy::Client) };
        let closing = matches!(ev.what, SOCK_RESET_RECEIVED | SOCK_RESET_SENT)
            || (ev.what == SOCK_STATE && matches!(ev.newstate, TCP_CLOSE_WAIT | TCP_FIN_WAIT1 | TCP_CLOSE));
        if closing {
            conn.closed_at.get_or_insert(ev.hdr.ts_ns);
        }
        let peer_left = ev.what == SOCK_RESET_RECEIVED
            || (ev.what == SOCK_STATE && matches!((ev.oldstate, ev.newstate), (TCP_ESTABLISHED | TCP_SYN_RECV, TCP_CLOSE_WAIT)));
        if peer_left {
            conn.peer_closed_at.get_or_insert(ev.hdr.ts_ns);
        }
        match ev.what {
            SOCK_RESET_RECEIVED => {
                conn.closer.get_or_insert(peer_word);
                if conn.reset == Reset::None {
                    conn.reset = if client_side { Reset::ByClient } else { Reset::ByServer };
                }
            }
            SOCK_RESET_SENT => {
                conn.closer.get_or_insert(local_word);
                if conn.reset == Reset::None {
                    conn.reset = if client_side { Reset::ByServer } else { Reset::ByClient };
                }
            }
            SOCK_STATE => {
                match (ev.oldstate, ev.newstate) {
                    (TCP_ESTABLISHED | TCP_SYN_RECV, TCP_CLOSE_WAIT) => {
                        conn.closer.get_or_insert(peer_word);
                    }
                    (TCP_ESTABLISHED | TCP_SYN_RECV, TCP_FIN_WAIT1) => {
                        conn.closer.get_or_insert(local_word);
                    }
                    _ => {}
                }
                if ev.newstate == TCP_CLOSE {
                    let ts = ev.hdr.ts_ns;
                    if let Some(mut conn) = self.remove(ev.skaddr) {
                        // A close with no FIN or reset seen first: the local end closed.
                        let closer = conn.closer.unwrap_or(local_word);
                        while let Some(mut p) = conn.pending.pop_front() {
                            if let Side::Body(b) = &mut conn.resp {
                                b.close();
                                if b.done && p.response_started {
                                    // A body that runs until the close: the close ends it.
                                    messages(&mut p, &[], (ts, ts), self.keep_text, true);
                                    p.rec.transport_complete = true;
                                    p.final_at.get_or_insert(ts);
                                } else if let Some(s) = p.splitter.as_mut() {
                                    // What was buffered is read for stop fields (a last message
                                    // without its blank line).
                                    let mut msgs = Vec::new();
                                    s.finish(&mut msgs);
                                    apply_msgs(&mut p, msgs, (ts, ts), self.keep_text);
                                }
                            }
                            let rec = finalize(p, &conn, closer);
                            self.done.push(rec);
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// The trace ended: requests still in flight are written as they are.
    pub fn finish(&mut self) {
        let sks: Vec<u64> = self.conns.keys().copied().collect();
        for sk in sks {
            self.flush_tail(sk, 0);
        }
        let conns: Vec<Conn> = self.conns.drain().map(|(_, c)| c).collect();
        self.held = 0;
        for mut conn in conns {
            self.write_unfinished(&mut conn, false);
        }
    }

    pub fn take_done(&mut self) -> Vec<RequestRecord> {
        std::mem::take(&mut self.done)
    }
}

/// Whether a head's blank line ("\n\n" or "\n\r\n") ends in `buf` past `before` (the bytes
/// already looked at; a blank line may straddle them).
fn head_ends(buf: &[u8], before: usize) -> bool {
    let from = before.saturating_sub(2);
    buf[from..].windows(2).enumerate().any(|(i, w)| w == b"\n\n" || (w == b"\r\n" && from + i >= 1 && buf[from + i - 1] == b'\n'))
}

/// `1a3\r\n` at the start of a write: a chunk-size line.
fn looks_like_chunk_start(b: &[u8]) -> bool {
    let hex = b.iter().take_while(|c| c.is_ascii_hexdigit()).count();
    (1..=8).contains(&hex) && b[hex..].starts_with(b"\r\n")
}

fn end(p: &mut Pending, ts: u64) {
    if let Some(a) = p.arrival_ns {
        p.rec.end_ms = Some(ts.saturating_sub(a) as f64 / 1e6);
    }
}

/// Feed response body bytes to the message splitter; `last` when the body ended. `at` is (the
/// call's return, its entry), ns.
fn messages(p: &mut Pending, body: &[u8], at: (u64, u64), keep_text: bool, last: bool) {
    if p.splitter.is_none() {
        if body.is_empty() && !last {
            return;
        }
        p.splitter = Some(Splitter::new(Kind::detect(&p.content_type, body)));
    }
    let mut msgs = Vec::new();
    if let Some(s) = p.splitter.as_mut() {
        s.push(body, &mut msgs);
        if last {
            s.finish(&mut msgs);
        }
    }
    apply_msgs(p, msgs, at, keep_text);
}

fn apply_msgs(p: &mut Pending, msgs: Vec<Msg>, at: (u64, u64), keep_text: bool) {
    let (ts, sent) = at;
    for m in msgs {
        if p.api.is_none()
            && p.rec.method.is_none()
            && let Msg::Json(v) | Msg::Partial(v) = &m
        {
            p.api = payload::api_of(v);
        }
        match m {
            Msg::Json(v) => {
                if payload::apply(&v, &mut p.rec.stop, keep_text) {
                    content_at(p, ts);
                }
            }
            Msg::Done => p.rec.stop.done_marker = true,
            Msg::Unparsed => p.rec.messages_unread += 1,
            Msg::Partial(v) => {
                // A message with a hole (a non-streamed answer over the capture size): its
                // content still counts, so such an answer has a first token too.
                if payload::apply(&v, &mut p.rec.stop, keep_text) {
                    content_at(p, ts);
                }
                p.rec.messages_partly_read += 1;
            }
        }
        if p.final_at.is_none() && p.rec.stop.is_final() && ts != 0 {
            p.final_at = Some(sent);
        }
    }
}

/// A message with content completed at `ts`.
fn content_at(p: &mut Pending, ts: u64) {
    p.rec.chunks += 1;
    if let Some(a) = p.arrival_ns.filter(|_| ts != 0) {
        p.rec.chunk_times_ms.push(ts.saturating_sub(a) as f64 / 1e6);
    }
}

fn finalize(mut p: Pending, conn: &Conn, closed_by: ClosedBy) -> RequestRecord {
    let since = |t: u64| p.arrival_ns.map(|a| t.saturating_sub(a) as f64 / 1e6);
    p.rec.closed_ms = conn.closed_at.and_then(since);
    p.rec.final_ms = p.final_at.and_then(since);
    // The server's word counts when it was sent before the peer left: a peer that closed first
    // (a reader that went away, a gateway's deadline) never got it, whatever was sent after.
    // The target as a client (a front talking to its runner): whatever it read, the server sent
    // before it closed (data comes before FIN on the wire), so a server that closes after its
    // final message is normal even when its FIN is seen before the target read that message.
    let target_is_client = conn.req_dir.is_some_and(|d| d != DIR_RECV);
    p.rec.content_complete = p.final_at.is_some_and(|t| target_is_client || conn.peer_closed_at.is_none_or(|c| t <= c));
    p.rec.closed_by = closed_by;
    p.rec.reset = conn.reset;
    if p.rec.peer_process.is_none() {
        p.rec.peer_process = conn.peer_process.clone();
    }
    // An answer sent whole that held no text (EOS at once) was still ready when it was sent.
    let whole = p.rec.stream != Some(true)
        && p.rec.chunk_times_ms.is_empty()
        && p.rec.content_complete
        && p.rec.status.is_some_and(|s| s < 400)
        && p.rec.stop.error.is_none();
    p.rec.ttft_ms = if whole { p.rec.final_ms } else { p.rec.chunk_times_ms.first().copied() };
    if p.rec.began_before_attach {
        p.rec.ttft_ms = None;
    }
    // A request whose head came before attach is named by its response, and says so.
    if p.rec.method.is_none()
        && let Some(path) = p.api
    {
        p.rec.method = Some("POST".into());
        p.rec.path = Some(path.into());
        p.rec.path_inferred = true;
    }
    if p.rec.stream.is_none() && p.rec.arrival_by == Arrival::TcpState {
        p.rec.stream = p.splitter.as_ref().map(|s| s.kind != payload::Kind::Json);
    }
    p.rec.chunk_gaps = gaps(&p.rec.chunk_times_ms);
    p.rec
}

#[cfg(test)]
mod tests {
    use probe_common::{EventHeader, EventKind, stream::DIR_SEND};

    use super::*;

    fn data(sk: u64, dir: u8, ts: u64, bytes: &[u8]) -> DataEvent {
        DataEvent {
            hdr: EventHeader { kind: EventKind::Data as u32, pid: 100, tid: 101, cpu: 0, ts_ns: ts },
            sk,
            enter_ns: ts,
            len: bytes.len() as u32,
            captured: bytes.len() as u32,
            fd: 7,
            dir,
            family: 2,
            sport: 8080,
            dport: 40000,
            ..Default::default()
        }
    }

    fn feed(t: &mut Tracker, sk: u64, dir: u8, ts: u64, bytes: &[u8]) {
        t.on_data(&data(sk, dir, ts, bytes), bytes);
    }

    /// A client that writes its request in pieces (a method, a space, the path, ...: what
    /// formatted writes do): the server reads each piece in its own call, and the request is
    /// still read from its first byte, on both sides of the connection.
    #[test]
    fn a_request_head_written_in_pieces_is_read_whole() {
        let body = br#"{"prompt":"x","n_predict":4}"#;
        let len = body.len().to_string();
        let pieces: [&[u8]; 7] = [b"POST", b" ", b"/completion", b" HTTP/1.1\r\nContent-Length: ", len.as_bytes(), b"\r\n\r\n", body];
        for (sk, dir) in [(1u64, DIR_RECV), (2, DIR_SEND)] {
            let mut t = Tracker::new(0, false);
            for (i, p) in pieces.iter().enumerate() {
                feed(&mut t, sk, dir, 10 + i as u64, p);
            }
            feed(&mut t, sk, dir ^ 1, 1_000_000, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
            let done = t.take_done();
            let q = done.last().expect("a request");
            assert_eq!((q.method.as_deref(), q.path.as_deref(), q.partial), (Some("POST"), Some("/completion"), false), "{q:?}");
            assert_eq!(q.arrival_ms, Some(10.0 / 1e6));
            assert_eq!(q.max_tokens, Some(4));
            assert_eq!(q.request_bytes, pieces.iter().map(|p| p.len() as u64).sum::<u64>());
        }
        assert!(http::may_start_request(b"PO") && !http::may_start_request(b"XPOST") && !http::only_a_request_start(b"H"));
    }

    #[test]
    fn endless_heads_on_many_connections_stay_bounded() {
        let mut t = Tracker::new(0, false);
        let line = [b"GET / HTTP/1.1\r\nX-Pad: ".as_slice(), &[b'a'; 4000]].concat();
        let more = [b'a'; 4000];
        for sk in 0..10_000u64 {
            feed(&mut t, sk, DIR_RECV, sk * 1000, &line);
            for i in 0..14 {
                feed(&mut t, sk, DIR_RECV, sk * 1000 + i, &more);
            }
            let (conns, held) = t.usage();
            assert!(conns <= MAX_CONNS && held <= MAX_HELD + (128 << 10), "{conns} connections hold {held} bytes");
        }
        assert!(t.limits().conns_evicted > 0);
        assert_eq!(t.limits().requests_evicted, 0, "no request had started");
        // A real request after the flood is still followed.
        feed(&mut t, 1 << 40, DIR_RECV, 1 << 34, b"GET /health HTTP/1.1\r\n\r\n");
        feed(&mut t, 1 << 40, DIR_SEND, (1 << 34) + 5, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        let done = t.take_done();
        assert_eq!(done.last().and_then(|r| r.path.as_deref()), Some("/health"));
        assert!(done.last().is_some_and(|r| r.transport_complete && !r.evicted));
    }

    #[test]
    fn pipelined_requests_without_answers_are_capped_and_reported() {
        let mut t = Tracker::new(0, false);
        let req = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".repeat(100);
        for i in 0..1000 {
            feed(&mut t, 7, DIR_RECV, i, &req);
            assert!(t.in_flight() <= MAX_PENDING, "{} requests pending", t.in_flight());
        }
        let evicted = t.take_done();
        assert!(!evicted.is_empty() && evicted.iter().all(|r| r.evicted && r.closed_by == ClosedBy::Open));
        assert_eq!(t.limits().requests_evicted, evicted.len() as u64);
    }

    #[test]
    fn heads_split_into_single_bytes_are_parsed_once() {
        let mut t = Tracker::new(0, false);
        let head = [b"POST /v1/completions HTTP/1.1\r\nX-Long: ".as_slice(), &[b'v'; 60_000], b"\r\nContent-Length: 2\r\n\r\n{}"].concat();
        http::PARSES.with(|n| n.set(0));
        // The first write starts the request (a method is how a request is told from other
        // bytes); the rest arrives a byte at a time.
        feed(&mut t, 9, DIR_RECV, 0, &head[..8]);
        for (i, b) in head.iter().enumerate().skip(8) {
            feed(&mut t, 9, DIR_RECV, i as u64, std::slice::from_ref(b));
        }
        let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
        feed(&mut t, 9, DIR_SEND, 100_000, &resp[..5]);
        for (i, b) in resp.iter().enumerate().skip(5) {
            feed(&mut t, 9, DIR_SEND, 100_000 + i as u64, std::slice::from_ref(b));
        }
        let parses = http::PARSES.with(|n| n.get());
        assert!(parses <= 6, "{parses} head parses for two heads");
        let done = t.take_done();
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].path.as_deref(), done[0].status, done[0].transport_complete), (Some("/v1/completions"), Some(200), true));
    }

    #[test]
    fn idle_connections_are_forgotten() {
        let mut t = Tracker::new(0, false);
        feed(&mut t, 1, DIR_RECV, 1, b"GET / HTTP/1.1\r\n\r\n");
        feed(&mut t, 1, DIR_SEND, 2, b"HTTP/1.1 204 No Content\r\n\r\n");
        feed(&mut t, 2, DIR_RECV, 3, b"GET /slow HTTP/1.1\r\n\r\n");
        assert_eq!(t.usage().0, 2);
        feed(&mut t, 3, DIR_RECV, IDLE_NS + 10, b"GET / HTTP/1.1\r\n");
        // The idle keep-alive connection went; the one with a request in flight stays.
        assert_eq!(t.usage().0, 2);
        assert_eq!(t.limits().conns_forgotten, 1);
        assert_eq!(t.in_flight(), 1);
    }

    /// A connection the kernel's state at attach showed waiting for its answer whose request probe
    /// saw read anyway (the read came between arming and the dump): one request, its head seen.
    #[test]
    fn a_request_read_between_arming_and_the_dump_is_one_request() {
        let s = 1_000_000_000u64;
        let mut t = Tracker::new(10 * s, false);
        t.seed(vec![Seed {
            pid: 100,
            local: "0.0.0.0:8080".into(),
            peer: "0.0.0.0:40000".into(),
            arrival_ns: 10 * s,
            state: SeedState::Waiting,
        }]);
        assert_eq!(t.serving().len(), 1);
        let body = br#"{"prompt":"x","n_predict":4}"#;
        let head = format!("POST /completion HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len());
        feed(&mut t, 77, DIR_RECV, 10 * s + 5, &[head.as_bytes(), body].concat());
        feed(&mut t, 77, DIR_SEND, 11 * s, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        let done: Vec<RequestRecord> = t.take_done().into_iter().filter(|q| !q.in_flight).collect();
        assert_eq!(done.len(), 1, "{done:#?}");
        assert_eq!(
            (done[0].path.as_deref(), done[0].status, done[0].path_inferred),
            (Some("/completion"), Some(200), false),
            "{:?}",
            done[0]
        );
        assert_eq!(done[0].id, 1);
        // The next request is number 2.
        feed(&mut t, 78, DIR_RECV, 12 * s, &[head.as_bytes(), body].concat());
        feed(&mut t, 78, DIR_SEND, 13 * s, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        assert_eq!(t.take_done().iter().map(|q| q.id).collect::<Vec<_>>(), [2]);
    }

    /// Connections found at attach: one waiting for its answer is a request in flight at once;
    /// one unread or behind its headers is shown in flight until taken up, and let go if it
    /// never is (an idle keep-alive connection looks the same to the kernel).
    #[test]
    fn seeds_are_shown_in_flight_and_let_go_when_never_taken_up() {
        let s = 1_000_000_000u64;
        let mut t = Tracker::new(10 * s, false);
        let seed = |peer: &str, state| Seed { pid: 1, local: "127.0.0.1:8080".into(), peer: peer.into(), arrival_ns: 9 * s, state };
        t.seed(vec![
            seed("127.0.0.1:1", SeedState::Waiting),
            seed("127.0.0.1:2", SeedState::Responding { headers_only: true }),
            seed("127.0.0.1:3", SeedState::Responding { headers_only: false }),
            seed("127.0.0.1:4", SeedState::Unread),
        ]);
        let peers = |t: &Tracker| {
            let mut v: Vec<(String, u64, Option<f64>, bool)> =
                t.serving().into_iter().map(|q| (q.peer, q.id, q.arrival_ms, q.headers_only)).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let all = peers(&t);
        assert_eq!(all.len(), 3, "{all:?}");
        assert_eq!(all[0], ("127.0.0.1:1".to_string(), 1, Some(-1000.0), false));
        assert_eq!((all[1].0.as_str(), all[1].1, all[1].3), ("127.0.0.1:2", 0, true));
        assert_eq!((all[2].0.as_str(), all[2].1, all[2].3), ("127.0.0.1:4", 0, false));
        t.expire_seeds(16 * s);
        assert_eq!(t.seeds.len(), 2, "the answering one goes after 5 s");
        t.expire_seeds(10 * s + SEED_WAITING_NS);
        assert!(t.seeds.is_empty());
        assert_eq!(peers(&t).len(), 1, "the request waiting for its answer stays");
    }
}
