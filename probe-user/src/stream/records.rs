//! What the tracker writes and shows: a request as seen on the wire ([`RequestRecord`]), the
//! words it is told in ([`Role`], [`ClosedBy`], [`Reset`], [`Arrival`]), what the tracker gave up
//! ([`Limits`]), and the connections found in flight at attach ([`Seed`]).
use serde::{Deserialize, Serialize};

use super::payload::Stop;
use crate::util::Lenient;

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
    /// (`default`: a recording's reader takes the word itself, [`Stored`].)
    #[serde(default)]
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

    /// A request record from its JSON text, as recordings hold it ([`Stored`]): an older record
    /// reads with today's fields and words.
    pub fn read(text: &str) -> serde_json::Result<RequestRecord> {
        use serde::de::{Error as _, Unexpected, value::StrDeserializer};
        let Stored { mut record, transport_complete, complete, closed_by } = serde_json::from_str(text)?;
        let word = |w: &str| ClosedBy::deserialize(StrDeserializer::<serde_json::Error>::new(w));
        if let Some(transport) = transport_complete {
            record.transport_complete = transport;
            record.closed_by = match closed_by {
                Some(Lenient::Is(w)) => word(&w)?,
                Some(Lenient::Not(_)) => {
                    return Err(serde_json::Error::invalid_type(Unexpected::Other("not a string"), &"a ClosedBy word"));
                }
                None => return Err(serde_json::Error::missing_field("closed_by")),
            };
            return Ok(record);
        }
        let complete = complete.and_then(Lenient::ok).unwrap_or(false);
        record.transport_complete = complete;
        // Stop fields in a record cut short were most likely read before the close.
        record.content_complete = complete || record.stop.is_final();
        record.closed_by = match closed_by.and_then(Lenient::ok).as_deref() {
            Some("server") => ClosedBy::None,
            Some("server_abort") => ClosedBy::Server,
            Some(other) => word(other)?,
            None => ClosedBy::Open,
        };
        Ok(record)
    }
}

/// A request record as recordings hold it, today's or older: probes before the two completeness
/// fields wrote one `complete` and called closes "server" (the response ended and the
/// connection stayed open) and "server_abort" (the server closed). The words are taken here, not
/// by `record`, for [`RequestRecord::read`] to read them by the record's age.
#[derive(Deserialize)]
struct Stored {
    #[serde(flatten)]
    record: RequestRecord,
    /// Written since the two completeness fields: its presence tells today's records from older ones.
    #[serde(default, deserialize_with = "present")]
    transport_complete: Option<bool>,
    /// An older record's one completeness fact (anything but `true` is false).
    #[serde(default)]
    complete: Option<Lenient<bool>>,
    /// Absent or not a word in an older record: open at the end.
    #[serde(default)]
    closed_by: Option<Lenient<String>>,
}

/// A field that is there (`null` too: then it is not a bool).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    bool::deserialize(d).map(Some)
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
