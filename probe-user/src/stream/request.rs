//! The request side of a connection: heads parsed as their bytes come (however they are
//! split), bodies kept up to [`MAX_BODY`] to read `max_tokens` and `stream`.
use serde_json::Value;

use super::{Arrival, Conn, Ids, MAX_BODY, MAX_HEAD, MAX_PENDING, Role, Side, Tracker, head_ends, payload};
use crate::util::http::{self, Body, Framing, Parsed};

impl Tracker {
    /// Bytes the target's request side moved (`missing` more not captured): heads parsed, bodies
    /// kept, requests begun.
    pub(super) fn request_bytes(conn: &mut Conn, mut data: &[u8], missing: u64, ts: u64, role: Role, id: &mut Ids, start_ns: u64) {
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
                            let t0 = *t0;
                            data = &data[n - before..];
                            if !Self::request_head(conn, &head, t0, n, missing, role, id, start_ns) {
                                return;
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
            Self::request_gap(conn, missing);
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

    /// A request head parsed whole (`n` bytes, its first at `t0`): its request begins (or a
    /// stand-in taken up at attach gets its head), then its body. False when the connection has
    /// more pipelined requests than [`MAX_PENDING`] and is no longer followed.
    #[allow(clippy::too_many_arguments)]
    fn request_head(
        conn: &mut Conn,
        head: &http::RequestHead,
        t0: u64,
        n: usize,
        missing: u64,
        role: Role,
        id: &mut Ids,
        start_ns: u64,
    ) -> bool {
        // A head that waited unread at attach: the kernel dated its arrival.
        let hint = conn.arrival_hint.take();
        let t0 = hint.map_or(t0, |h| h.min(t0));
        // A stand-in taken up at attach (the kernel's state said read, nothing
        // answered) whose head probe then saw read: the read came between
        // arming and the dump. The head is the stand-in's own, not another
        // request's (else one request is two: its head without its answer,
        // its answer without its head).
        let stand_in = conn.pending.back().is_some_and(|q| {
            q.rec.method.is_none() && q.rec.arrival_by == Arrival::TcpState && q.rec.request_bytes == 0 && !q.response_started
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
        p.rec.request_bytes = n as u64 + missing;
        p.rec.bytes_not_captured += missing;
        let body = Body::new(head.framing.unwrap_or(Framing::None));
        let done = body.done;
        conn.pending.push_back(p);
        if conn.pending.len() > MAX_PENDING {
            conn.overflow = true;
            conn.req = Side::Lost;
            return false;
        }
        conn.req = Side::Body(body);
        if done {
            Self::request_done(conn);
        }
        true
    }

    /// Request bytes not captured: the body's framing goes on over the gap when it can (the body
    /// is then cut), else the request side is lost until a new head.
    fn request_gap(conn: &mut Conn, missing: u64) {
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
