//! Request streams: rebuilds every HTTP request the target serves (or makes) from the bytes its
//! sockets moved, with timing per content chunk and the stop information from the wire.
//! Bytes are parsed in memory and dropped; only [`RequestRecord`]s (numbers, method, path, stop
//! reasons) are kept. `http` frames messages, `payload` reads SSE / NDJSON / JSON bodies.
pub mod payload;
mod records;
mod request;
mod response;

pub use self::records::*;
use self::response::{apply_msgs, finalize, looks_like_chunk_start, messages};

use std::collections::{HashMap, VecDeque};

use probe_common::{
    sock::{
        SOCK_RESET_RECEIVED, SOCK_RESET_SENT, SOCK_STATE, SockEvent, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_ESTABLISHED, TCP_FIN_WAIT1,
        TCP_SYN_RECV,
    },
    stream::{DATA_TAIL, DIR_RECV, DIR_SEND, DataEvent, tail_len},
};

use self::payload::Splitter;
use crate::util::http::{self, Body, Framing};

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

    /// Requests in flight that someone else sent: probe's own polls of the server's endpoints do
    /// not make it busy (one in flight when the drain looked opened NVML for a second, which on a
    /// sleeping GPU wakes it: the poll that follows a busy one, 2 s after the last request).
    pub fn others_in_flight(&self) -> usize {
        self.conns.values().map(|c| c.pending.iter().filter(|p| !p.rec.probe_poll).count()).sum()
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
        assert_eq!(t.others_in_flight(), 1);
        // The same request, were it probe's own poll: in flight, but the server is not serving.
        for c in t.conns.values_mut() {
            for p in &mut c.pending {
                p.rec.probe_poll = true;
            }
        }
        assert_eq!((t.in_flight(), t.others_in_flight()), (1, 0));
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
