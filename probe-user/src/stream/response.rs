//! The response side of a connection: heads and bodies framed, the messages of a streamed
//! answer read for their content and stop fields, and the finished request written.
use probe_common::stream::DIR_RECV;

use super::{
    Arrival, ClosedBy, Conn, Ids, MAX_HEAD, Pending, RequestRecord, Role, Side, Tracker, gaps, head_ends,
    payload::{self, Kind, Msg, Splitter},
};
use crate::util::http::{self, Body, Framing, Parsed};

impl Tracker {
    /// Bytes the target's response side moved (`missing` more not captured), `at` (the call's
    /// return, its entry) in ns: the requests whose responses ended.
    pub(super) fn response_bytes(
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
        if !Self::response_start(conn, data, missing, ts, role, id) {
            return finished;
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
                                finished.extend(Self::response_done(conn, ts, sent));
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
                        finished.extend(Self::response_done(conn, ts, sent));
                    }
                }
            }
        }
        if missing > 0 {
            Self::response_gap(conn, missing);
        }
        if let Some(p) = conn.pending.front_mut() {
            end(p, ts);
        }
        finished
    }

    /// Before a response's bytes are read: the request they answer (a stand-in when none waits:
    /// attached mid-response), its bytes counted, its time to first byte. False when there is
    /// nothing to read.
    fn response_start(conn: &mut Conn, data: &[u8], missing: u64, ts: u64, role: Role, id: &mut Ids) -> bool {
        // The response belongs to the oldest request still waiting for one.
        if conn.pending.is_empty() {
            if data.is_empty() && missing == 0 {
                return false;
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
        true
    }

    /// The oldest request's response ended whole (its framing said so): it is done.
    fn response_done(conn: &mut Conn, ts: u64, sent: u64) -> Option<Pending> {
        conn.resp = Side::Head(Vec::new(), 0);
        let mut p = conn.pending.pop_front()?;
        p.rec.transport_complete = true;
        p.final_at.get_or_insert(sent);
        end(&mut p, ts);
        Some(p)
    }

    /// Response bytes not captured: the message being collected is counted unread, the body's
    /// framing goes on over the gap when it can, else the response side is lost.
    fn response_gap(conn: &mut Conn, missing: u64) {
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
}

/// `1a3\r\n` at the start of a write: a chunk-size line.
pub(super) fn looks_like_chunk_start(b: &[u8]) -> bool {
    let hex = b.iter().take_while(|c| c.is_ascii_hexdigit()).count();
    (1..=8).contains(&hex) && b[hex..].starts_with(b"\r\n")
}

pub(super) fn end(p: &mut Pending, ts: u64) {
    if let Some(a) = p.arrival_ns {
        p.rec.end_ms = Some(ts.saturating_sub(a) as f64 / 1e6);
    }
}

/// Feed response body bytes to the message splitter; `last` when the body ended. `at` is (the
/// call's return, its entry), ns.
pub(super) fn messages(p: &mut Pending, body: &[u8], at: (u64, u64), keep_text: bool, last: bool) {
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

pub(super) fn apply_msgs(p: &mut Pending, msgs: Vec<Msg>, at: (u64, u64), keep_text: bool) {
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

pub(super) fn finalize(mut p: Pending, conn: &Conn, closed_by: ClosedBy) -> RequestRecord {
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
