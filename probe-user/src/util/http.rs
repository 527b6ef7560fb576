//! HTTP/1.1 message framing over a captured byte stream: heads parsed with httparse, bodies
//! delimited by Content-Length, chunked encoding or the connection's end. Bytes the kernel did
//! not capture arrive as gaps; a gap inside a body is skipped, a gap anywhere else loses sync.

/// How a body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Chunk {
    /// Reading a chunk-size line.
    Size(Vec<u8>),
    /// In chunk data, this many bytes left.
    Data(u64),
    /// The CRLF after chunk data, this many bytes left.
    DataEnd(u8),
    /// After the last (0) chunk: trailers until an empty line.
    Trailer(Vec<u8>),
}

/// Incremental body decoder.
#[derive(Clone, Debug)]
pub struct Body {
    framing: Framing,
    left: u64,
    chunk: Chunk,
    /// Trailer bytes after the last chunk (capped at [`MAX_TRAILERS`]).
    trailer_bytes: u64,
    pub done: bool,
}

/// A chunk-size line longer than this is not chunked encoding.
const MAX_CHUNK_LINE: usize = 1024;
/// Trailers past this many bytes are not HTTP (servers cap them far lower: nginx 8 KiB heads).
const MAX_TRAILERS: u64 = 64 << 10;

impl Body {
    pub fn new(framing: Framing) -> Self {
        let left = if let Framing::Length(n) = framing { n } else { 0 };
        Body {
            framing,
            left,
            chunk: Chunk::Size(Vec::new()),
            trailer_bytes: 0,
            done: matches!(framing, Framing::None | Framing::Length(0)),
        }
    }

    /// Decode from `input`, appending body bytes to `out`. Returns bytes consumed (input after
    /// the end of the message is left for the next message), or None when the framing is broken.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Option<usize> {
        let mut i = 0;
        while i < input.len() && !self.done {
            match self.framing {
                Framing::None => self.done = true,
                Framing::UntilClose => {
                    out.extend_from_slice(&input[i..]);
                    i = input.len();
                }
                Framing::Length(_) => {
                    let n = (self.left as usize).min(input.len() - i);
                    out.extend_from_slice(&input[i..i + n]);
                    i += n;
                    self.left -= n as u64;
                    self.done = self.left == 0;
                }
                Framing::Chunked => match &mut self.chunk {
                    Chunk::Size(line) => {
                        let b = input[i];
                        i += 1;
                        if b == b'\n' {
                            let text = String::from_utf8_lossy(line);
                            let hex = text.trim().split(';').next().unwrap_or("").trim();
                            let size = u64::from_str_radix(hex, 16).ok()?;
                            self.chunk = if size == 0 { Chunk::Trailer(Vec::new()) } else { Chunk::Data(size) };
                        } else {
                            line.push(b);
                            if line.len() > MAX_CHUNK_LINE {
                                return None;
                            }
                        }
                    }
                    Chunk::Data(left) => {
                        let n = (*left as usize).min(input.len() - i);
                        out.extend_from_slice(&input[i..i + n]);
                        i += n;
                        *left -= n as u64;
                        if *left == 0 {
                            self.chunk = Chunk::DataEnd(2);
                        }
                    }
                    Chunk::DataEnd(left) => {
                        let b = input[i];
                        i += 1;
                        if b == b'\n' || *left == 1 {
                            self.chunk = Chunk::Size(Vec::new());
                        } else if b == b'\r' {
                            *left = 1;
                        } else {
                            return None;
                        }
                    }
                    Chunk::Trailer(line) => {
                        let b = input[i];
                        i += 1;
                        if b == b'\n' {
                            if line.iter().all(|&c| c == b'\r') {
                                self.done = true;
                            }
                            line.clear();
                        } else {
                            // Only whether the line is empty matters: its bytes are not kept,
                            // so an endless trailer line costs nothing but stays bounded.
                            if line.len() < 2 {
                                line.push(b);
                            } else {
                                line[1] = b;
                            }
                            self.trailer_bytes += 1;
                            if self.trailer_bytes > MAX_TRAILERS {
                                return None;
                            }
                        }
                    }
                },
            }
        }
        Some(i)
    }

    /// `n` bytes were not captured. True when they fell inside body data (skipped), false
    /// when the framing around them is lost.
    pub fn gap(&mut self, n: u64) -> bool {
        match self.framing {
            Framing::UntilClose => true,
            Framing::Length(_) if n <= self.left => {
                self.left -= n;
                self.done = self.left == 0;
                true
            }
            // A gap may run to the end of the chunk's CRLF (one write per chunk ends there).
            Framing::Chunked => match &mut self.chunk {
                Chunk::Data(left) if n <= *left + 2 => {
                    self.chunk = match n.checked_sub(*left) {
                        None => Chunk::Data(*left - n),
                        Some(0) => Chunk::DataEnd(2),
                        Some(1) => Chunk::DataEnd(1),
                        Some(_) => Chunk::Size(Vec::new()),
                    };
                    true
                }
                Chunk::DataEnd(left) if n <= *left as u64 => {
                    self.chunk = if n == *left as u64 { Chunk::Size(Vec::new()) } else { Chunk::DataEnd(*left - n as u8) };
                    true
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// Bytes this decoder holds (its line buffers).
    pub fn held(&self) -> usize {
        match &self.chunk {
            Chunk::Size(l) | Chunk::Trailer(l) => l.capacity(),
            _ => 0,
        }
    }

    /// The connection ended: a body delimited by the close is complete now.
    pub fn close(&mut self) {
        if self.framing == Framing::UntilClose {
            self.done = true;
        }
    }
}

/// A parsed request head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub framing: Option<Framing>,
    /// Sent by probe's own endpoint poller (any probe instance): not the server's traffic.
    pub probe_poll: bool,
}

/// The User-Agent of probe's endpoint polls.
pub const POLL_USER_AGENT: &str = "probe-poll";

/// Local ports of this process's own polls (the last [`OWN_PORTS`]), noted by crate::util::httpc as it
/// connects, before it sends a byte.
static OWN_POLL_PORTS: std::sync::Mutex<std::collections::VecDeque<u16>> = std::sync::Mutex::new(std::collections::VecDeque::new());
const OWN_PORTS: usize = 4096;

/// A poll of this process leaves from `port` (crate::util::httpc, right after connecting).
pub fn note_own_poll(port: u16) {
    let mut p = OWN_POLL_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    if p.len() >= OWN_PORTS {
        p.pop_front();
    }
    p.push_back(port);
}

/// Whether a request whose head says [`POLL_USER_AGENT`], on the server connection `local` ⇄
/// `peer` of `server`, really is probe's: the User-Agent alone would let any client hide its
/// requests. It is when its client port is one of this process's polls, or when its client
/// socket belongs to a process running probe's own executable (`probe bench` beside its trace,
/// another probe following the same server). A client socket already gone (a short request,
/// closed before this look) cannot be checked: the head is believed.
pub fn poll_is_probes(local: &str, peer: &str, server: u32) -> bool {
    let (Ok(server_addr), Ok(client)) = (local.parse::<std::net::SocketAddr>(), peer.parse::<std::net::SocketAddr>()) else {
        return false;
    };
    if OWN_POLL_PORTS.lock().unwrap_or_else(|e| e.into_inner()).contains(&client.port()) {
        return true;
    }
    // The client's socket (its local end is the client's address), looked up in the server's
    // namespace; gone already: the head is believed.
    crate::os::procfs::held_by_own_executable(server, client, server_addr).unwrap_or(true)
}

/// A parsed response head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub content_type: String,
    pub chunked: bool,
    pub content_length: Option<u64>,
}

pub enum Parsed<T> {
    /// The head and its length in bytes.
    Done(T, usize),
    Partial,
    Invalid,
}

fn header<'a>(headers: &'a [httparse::Header<'a>], name: &str) -> Option<&'a str> {
    headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).and_then(|h| std::str::from_utf8(h.value).ok())
}

fn framing_of(headers: &[httparse::Header<'_>]) -> (bool, Option<u64>) {
    let chunked = header(headers, "transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let length = header(headers, "content-length").and_then(|v| v.trim().parse().ok());
    (chunked, length)
}

#[cfg(test)]
thread_local! {
    /// Heads parsed by this thread (tests check that parsing stays linear).
    pub static PARSES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

pub fn parse_request(buf: &[u8]) -> Parsed<RequestHead> {
    #[cfg(test)]
    PARSES.with(|n| n.set(n.get() + 1));
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let (chunked, length) = framing_of(req.headers);
            let framing = if chunked { Framing::Chunked } else { length.map_or(Framing::None, Framing::Length) };
            Parsed::Done(
                RequestHead {
                    method: req.method.unwrap_or("").into(),
                    path: req.path.unwrap_or("").into(),
                    framing: Some(framing),
                    probe_poll: header(req.headers, "user-agent").is_some_and(|u| u.starts_with(POLL_USER_AGENT)),
                },
                n,
            )
        }
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(_) => Parsed::Invalid,
    }
}

pub fn parse_response(buf: &[u8]) -> Parsed<ResponseHead> {
    #[cfg(test)]
    PARSES.with(|n| n.set(n.get() + 1));
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let (chunked, content_length) = framing_of(resp.headers);
            Parsed::Done(
                ResponseHead {
                    status: resp.code.unwrap_or(0),
                    content_type: header(resp.headers, "content-type").unwrap_or("").to_ascii_lowercase(),
                    chunked,
                    content_length,
                },
                n,
            )
        }
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(_) => Parsed::Invalid,
    }
}

impl ResponseHead {
    /// How this response's body ends, given the request method.
    pub fn framing(&self, method: &str) -> Framing {
        if method == "HEAD" || self.status == 204 || self.status == 304 || (100..200).contains(&self.status) {
            Framing::None
        } else if self.chunked {
            Framing::Chunked
        } else if let Some(n) = self.content_length {
            Framing::Length(n)
        } else {
            Framing::UntilClose
        }
    }
}

const METHODS: [&[u8]; 7] = [b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"OPTIONS ", b"PATCH "];

/// Whether bytes look like the start of an HTTP request (for resynchronising mid-stream).
pub fn looks_like_request(b: &[u8]) -> bool {
    METHODS.iter().any(|m| b.starts_with(m))
}

/// Whether bytes may begin a request whose head arrives in pieces: a whole method and its
/// space, or the first bytes of one (a client that writes `POST` and the rest separately, as
/// formatted writes do, is read by the server in several calls).
pub fn may_start_request(b: &[u8]) -> bool {
    looks_like_request(b) || (!b.is_empty() && METHODS.iter().any(|m| m.starts_with(b)))
}

/// Bytes that begin a request and cannot begin a response (`H` may be either).
pub fn only_a_request_start(b: &[u8]) -> bool {
    may_start_request(b) && !b"HTTP/".starts_with(&b[..b.len().min(5)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(framing: Framing, parts: &[&[u8]]) -> (Vec<u8>, bool, usize) {
        let mut b = Body::new(framing);
        let mut out = Vec::new();
        let mut used = 0;
        for p in parts {
            used += b.feed(p, &mut out).unwrap();
        }
        (out, b.done, used)
    }

    #[test]
    fn chunked_across_any_split() {
        let wire = b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\nGET /next";
        for cut in 0..wire.len() {
            let (out, done, used) = decode(Framing::Chunked, &[&wire[..cut], &wire[cut..]]);
            assert_eq!(out, b"helloabcdefghijklmnopqrstuvwxyz", "cut {cut}");
            assert!(done);
            assert_eq!(&wire[used..], b"GET /next", "cut {cut}");
        }
    }

    #[test]
    fn gaps_inside_chunks_are_skipped() {
        let mut b = Body::new(Framing::Chunked);
        let mut out = Vec::new();
        b.feed(b"a\r\n0123", &mut out).unwrap();
        assert!(b.gap(4));
        b.feed(b"89\r\n0\r\n\r\n", &mut out).unwrap();
        assert_eq!(out, b"012389");
        assert!(b.done);
        // A write cut at the capture limit: the gap ends with the chunk's CRLF.
        let mut b = Body::new(Framing::Chunked);
        b.feed(b"a\r\n0123", &mut out).unwrap();
        assert!(b.gap(8));
        b.feed(b"3\r\nxyz\r\n0\r\n\r\n", &mut out).unwrap();
        assert!(b.done);
        let mut b = Body::new(Framing::Chunked);
        b.feed(b"a\r\n0123456789", &mut out).unwrap();
        assert!(!b.gap(5), "a gap over a chunk header loses sync");
        assert!(Body::new(Framing::Chunked).feed(b"zz\r\n", &mut out).is_none());
    }

    #[test]
    fn trailers_are_bounded() {
        let mut b = Body::new(Framing::Chunked);
        let mut out = Vec::new();
        assert!(b.feed(b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\n", &mut out).is_some());
        let endless = vec![b'a'; 4096];
        let mut fed = 0;
        while b.feed(&endless, &mut out).is_some() {
            fed += endless.len();
            assert!(fed <= 2 * MAX_TRAILERS as usize, "an endless trailer was accepted");
            assert!(b.held() <= 16, "trailer bytes are kept: {}", b.held());
        }
        let mut b = Body::new(Framing::Chunked);
        b.feed(b"0\r\nA: b\r\n\r\nGET", &mut out).unwrap();
        assert!(b.done);
    }

    #[test]
    fn heads() {
        let Parsed::Done(h, n) = parse_request(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n{}") else {
            panic!()
        };
        assert_eq!((h.method.as_str(), h.path.as_str(), h.framing, n), ("POST", "/v1/chat/completions", Some(Framing::Length(12)), 67));
        assert!(matches!(parse_request(b"POST /x HTTP/1.1\r\nHost"), Parsed::Partial));
        assert!(matches!(parse_request(b"\x00\x01garbage\r\n\r\n"), Parsed::Invalid));
        let Parsed::Done(r, _) =
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        else {
            panic!()
        };
        assert_eq!(r.framing("POST"), Framing::Chunked);
        assert_eq!(r.content_type, "text/event-stream");
        let Parsed::Done(r, _) = parse_response(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\n") else { panic!() };
        assert_eq!((r.status, r.framing("POST")), (400, Framing::Length(5)));
    }
}
