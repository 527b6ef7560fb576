//! Blocking HTTP/1.1 requests to local servers over std TCP: plain `http://` only, one connection
//! per request (`Connection: close`). Heads and bodies are framed by `stream::http`, the code that
//! reads traced streams. Used by the endpoint poller (sampler) and `probe bench`.
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream, ToSocketAddrs},
    sync::OnceLock,
    time::{Duration, Instant},
};

use crate::util::http::{Body, Parsed, parse_response};

/// Where the server is: `http://host:port[/prefix]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    /// Path prefix without the trailing slash ("" for the root).
    pub prefix: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, String> {
        let rest = s.strip_prefix("http://").ok_or_else(|| {
            if s.starts_with("https://") {
                format!("`{s}`: only plain http:// is supported (probe bench talks to local servers; put TLS in front, not between)")
            } else {
                format!("`{s}` is not an http:// URL (e.g. http://127.0.0.1:8080)")
            }
        })?;
        let (hostport, prefix) =
            rest.split_once('/').map(|(h, p)| (h, format!("/{}", p.trim_end_matches('/')))).unwrap_or((rest, String::new()));
        let prefix = if prefix == "/" { String::new() } else { prefix };
        let (host, port) = if let Some(h) = hostport.strip_prefix('[') {
            let (h, p) = h.split_once(']').ok_or_else(|| format!("`{s}`: unclosed [ in the host"))?;
            (h.to_string(), p.strip_prefix(':').map(str::to_string))
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p.to_string())),
                None => (hostport.to_string(), None),
            }
        };
        if host.is_empty() {
            return Err(format!("`{s}` has no host"));
        }
        let port = match port {
            Some(p) => p.parse().map_err(|_| format!("`{s}`: bad port `{p}`"))?,
            None => 80,
        };
        Ok(Url { host, port, prefix })
    }

    /// The root of a server listening at `addr`.
    pub fn of(addr: SocketAddr) -> Url {
        Url { host: addr.ip().to_string(), port: addr.port(), prefix: String::new() }
    }

    pub fn addr(&self) -> Result<SocketAddr, String> {
        (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", self.host))?
            .next()
            .ok_or_else(|| format!("{} resolves to no address", self.host))
    }

    pub fn host_header(&self) -> String {
        if self.host.contains(':') { format!("[{}]:{}", self.host, self.port) } else { format!("{}:{}", self.host, self.port) }
    }
}

/// A plain request whose whole body is returned (/health, /metrics, /props, /tokenize...),
/// sent with [`POLL_AGENT`].
pub fn request(url: &Url, method: &str, path: &str, body: Option<&str>, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    request_from(url, method, path, body, timeout).map(|(s, b, _)| (s, b))
}

/// [`request`], also giving the local port the request left from.
pub fn request_from(url: &Url, method: &str, path: &str, body: Option<&str>, timeout: Duration) -> Result<(u16, Vec<u8>, u16), String> {
    request_bounded(url, method, path, body, timeout, None, usize::MAX)
}

/// [`request_from`] that also gives up at `deadline` (however the server trickles its answer)
/// and once the body passes `cap` bytes.
pub fn request_bounded(
    url: &Url,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
    deadline: Option<Instant>,
    cap: usize,
) -> Result<(u16, Vec<u8>, u16), String> {
    exchange(url, method, head(url, method, path, body, POLL_AGENT).as_bytes(), timeout, deadline, cap)
}

/// A GET that carries no credentials (none of `--api-key`/`--header`): for asking a listener
/// that may not be the server the operator meant (`watch --all`'s discovery), bounded by
/// `deadline` however the listener trickles and by `cap` bytes of body.
pub fn get_anonymous(url: &Url, path: &str, timeout: Duration, deadline: Instant, cap: usize) -> Result<(u16, Vec<u8>), String> {
    let msg = head_as(url, "GET", path, None, POLL_AGENT, false);
    exchange(url, "GET", msg.as_bytes(), timeout, Some(deadline), cap).map(|(s, b, _)| (s, b))
}

/// A POST of `body` to a service other than the LLM server (an OTLP collector): its own
/// content type, and none of the server's `--api-key`/`--header` headers.
pub fn post_elsewhere(url: &Url, path: &str, content_type: &str, body: &[u8], timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    post_encoded(url, path, content_type, "", body, timeout)
}

/// [`post_elsewhere`] of a gzip-compressed body (`Content-Encoding: gzip`).
pub fn post_gzip(url: &Url, path: &str, content_type: &str, body: &[u8], timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    post_encoded(url, path, content_type, "Content-Encoding: gzip\r\n", body, timeout)
}

fn post_encoded(
    url: &Url,
    path: &str,
    content_type: &str,
    encoding: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let mut msg = format!(
        "POST {}{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: probe/{}\r\nContent-Type: {content_type}\r\n{encoding}Content-Length: {}\r\nConnection: close\r\n\r\n",
        url.prefix,
        url.host_header(),
        env!("CARGO_PKG_VERSION"),
        body.len()
    )
    .into_bytes();
    msg.extend_from_slice(body);
    exchange(url, "POST", &msg, timeout, Some(Instant::now() + 2 * timeout), 1 << 20).map(|(s, b, _)| (s, b))
}

/// Send `msg` (head and body) and read the response: (status, body, local port).
fn exchange(
    url: &Url,
    method: &str,
    msg: &[u8],
    timeout: Duration,
    deadline: Option<Instant>,
    cap: usize,
) -> Result<(u16, Vec<u8>, u16), String> {
    let addr = url.addr()?;
    // The time one read may wait: the per-read timeout, or what is left before the deadline.
    let left = || -> Result<Duration, String> {
        let Some(d) = deadline else { return Ok(timeout) };
        let rest = d.saturating_duration_since(Instant::now());
        if rest.is_zero() { Err(format!("{addr} took longer than its deadline to answer")) } else { Ok(rest.min(timeout)) }
    };
    let mut s = TcpStream::connect_timeout(&addr, left()?).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let local = s.local_addr().map(|a| a.port()).unwrap_or(0);
    // Before a byte is sent: a trace in this process tells its own polls by this port.
    crate::util::http::note_own_poll(local);
    let _ = s.set_read_timeout(Some(left()?));
    let _ = s.set_write_timeout(Some(left()?));
    let _ = s.set_nodelay(true);
    s.write_all(msg).map_err(|e| format!("cannot send to {addr}: {e}"))?;
    let mut reader = Response::new(method, cap);
    let mut chunk = [0u8; 16384];
    loop {
        let _ = s.set_read_timeout(Some(left()?));
        let n = read_retry(&mut s, &mut chunk).map_err(|e| format!("no answer from {addr}: {e}"))?;
        let got = if n == 0 { reader.close() } else { reader.feed(&chunk[..n]) };
        match got.map_err(|e| format!("{addr} {e}"))? {
            Some((status, body)) => return Ok((status, body, local)),
            None => continue,
        }
    }
}

/// A response read as its bytes come: the head (up to 64 KiB), then the body its framing says,
/// at most `cap` bytes of it. The part of [`request`] that reads, apart from the socket (and
/// fuzzed: fuzz/fuzz_targets/exposition.rs).
pub struct Response {
    method: String,
    cap: usize,
    head: Vec<u8>,
    body: Option<(u16, Body)>,
    out: Vec<u8>,
}

impl Response {
    pub fn new(method: &str, cap: usize) -> Response {
        Response { method: method.to_string(), cap, head: Vec::new(), body: None, out: Vec::new() }
    }

    /// The next bytes: Some((status, body)) once the response is whole, None while more is
    /// wanted, an error (what the server did wrong) for a response probe will not read.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Option<(u16, Vec<u8>)>, String> {
        if self.body.is_none() {
            self.head.extend_from_slice(bytes);
            match parse_response(&self.head) {
                Parsed::Done(h, len) => {
                    self.body = Some((h.status, Body::new(h.framing(&self.method))));
                    // What came after the head is the body's first bytes.
                    let head = std::mem::take(&mut self.head);
                    return self.body_bytes(&head[len..]);
                }
                Parsed::Partial if self.head.len() < 64 << 10 => return Ok(None),
                _ => return Err("did not answer in HTTP/1.x (is this an HTTP server?)".into()),
            }
        }
        self.body_bytes(bytes)
    }

    fn body_bytes(&mut self, bytes: &[u8]) -> Result<Option<(u16, Vec<u8>)>, String> {
        let Some((status, dec)) = &mut self.body else { return Ok(None) };
        if dec.feed(bytes, &mut self.out).is_none() {
            return Err("sent a malformed HTTP body".into());
        }
        if self.out.len() > self.cap {
            return Err(format!("sent a body over {} bytes", self.cap));
        }
        Ok(dec.done.then(|| (*status, std::mem::take(&mut self.out))))
    }

    /// The server closed the connection: a body framed by the close ends here.
    pub fn close(&mut self) -> Result<Option<(u16, Vec<u8>)>, String> {
        match &mut self.body {
            None => Err("closed the connection without an HTTP response".into()),
            Some((status, dec)) => {
                dec.close();
                Ok(Some((*status, std::mem::take(&mut self.out))))
            }
        }
    }
}

/// A read that retries when a signal interrupted it (Ctrl-C is handled by a flag, not EINTR).
pub fn read_retry(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match s.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// User-Agent of probe's own endpoint reads (the trace's poller, the benchmark's /health,
/// /metrics, /props, /slots, /tokenize): traces leave these requests out of their reports, so a
/// verdict does not count them as other requests being served.
pub const POLL_AGENT: &str = crate::util::http::POLL_USER_AGENT;

pub fn head(url: &Url, method: &str, path: &str, body: Option<&str>, agent: &str) -> String {
    head_as(url, method, path, body, agent, true)
}

/// A request head, with the server's headers (`credentials`) or without.
fn head_as(url: &Url, method: &str, path: &str, body: Option<&str>, agent: &str, credentials: bool) -> String {
    let mut h = format!(
        "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: {agent}\r\nAccept: */*\r\nConnection: close\r\n",
        url.prefix,
        url.host_header()
    );
    let own = THREAD_HEADERS.with(|t| t.borrow().clone());
    let headers = match &own {
        Some(h) => h.as_slice(),
        None => HEADERS.get().map(Vec::as_slice).unwrap_or_default(),
    };
    for (name, value) in headers.iter().filter(|_| credentials) {
        h.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(b) = body {
        h.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()));
    } else {
        h.push_str("\r\n");
    }
    h
}

/// Headers every request to the server carries (`--api-key`, `--header`), set once at start: the
/// poller and the benchmark talk to the one server the command was given.
static HEADERS: OnceLock<Vec<(String, String)>> = OnceLock::new();

thread_local! {
    /// Headers for this thread's requests in place of [`HEADERS`]: `watch --all` follows many
    /// servers in one process and sends each only the credentials scoped to it (none: `Some(vec![])`).
    static THREAD_HEADERS: std::cell::RefCell<Option<Vec<(String, String)>>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` with `headers` (when given) in place of the process's on this thread's requests.
pub fn with_headers<R>(headers: Option<Vec<(String, String)>>, f: impl FnOnce() -> R) -> R {
    let Some(h) = headers else { return f() };
    let before = THREAD_HEADERS.with(|t| t.borrow_mut().replace(h));
    let r = f();
    THREAD_HEADERS.with(|t| *t.borrow_mut() = before);
    r
}

/// This thread's own headers, if it has them (to hand to a thread it starts).
pub fn thread_headers() -> Option<Vec<(String, String)>> {
    THREAD_HEADERS.with(|t| t.borrow().clone())
}

/// How probe authenticates to a server started with `--api-key` (llama-server, vLLM) or behind a
/// gateway that wants a header. The values go on the wire and nowhere else: not in a recording,
/// a report, a bundle, a log line or `--help`.
#[derive(clap::Args, Clone, Default)]
pub struct ServerAuth {
    /// The server's API key, sent as `Authorization: Bearer KEY` on every request probe makes to
    /// the server (its endpoint polls; `probe bench`'s requests). Prefer the environment
    /// variable: a command line is visible to every user.
    #[arg(long, env = "PROBE_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Another header on every request probe sends to the server (repeat for more), e.g.
    /// `--header 'X-Api-Key: KEY'`.
    /// PROBE_HEADERS holds more, one a line.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header, env = "PROBE_HEADERS", hide_env_values = true, value_delimiter = '\n')]
    pub headers: Vec<(String, String)>,
}

impl std::fmt::Debug for ServerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("ServerAuth").field("api_key", &self.api_key.as_ref().map(|_| "[redacted]")).field("headers", &names).finish()
    }
}

impl ServerAuth {
    /// Send these headers from now on (the first call wins: one server per command).
    pub fn install(&self) {
        let _ = HEADERS.set(self.all());
    }

    /// Every header probe would send: `--header`s, then the key as `Authorization: Bearer`.
    pub fn all(&self) -> Vec<(String, String)> {
        let mut h = self.headers.clone();
        if let Some(k) = &self.api_key {
            h.push(("Authorization".into(), format!("Bearer {}", k.trim())));
        }
        h
    }
}

/// Give a child probe (`probe bench --trace` runs `probe trace`) the headers this one sends,
/// through its environment rather than its command line (which every user can read).
pub fn pass_headers(cmd: &mut std::process::Command) {
    if let Some(h) = HEADERS.get().filter(|h| !h.is_empty()) {
        cmd.env("PROBE_HEADERS", headers_env(h));
        cmd.env_remove("PROBE_API_KEY");
    }
}

/// Headers as PROBE_HEADERS holds them: `Name: value`, one a line.
pub fn headers_env(h: &[(String, String)]) -> String {
    h.iter().map(|(n, v)| format!("{n}: {v}")).collect::<Vec<_>>().join("\n")
}

/// `Name: value`, a header that cannot smuggle another (no CR/LF, a token for a name).
pub fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s.split_once(':').ok_or("a header is `Name: value`, e.g. `X-Api-Key: KEY`")?;
    let name = name.trim();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) {
        return Err(format!("`{name}` is not a header name (letters, digits and -)"));
    }
    let value = value.trim();
    if value.chars().any(|c| c == '\r' || c == '\n' || c == '\0') {
        return Err(format!("the value of {name} has a line break"));
    }
    if ["host", "content-length", "transfer-encoding", "connection"].contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!("{name} is set by probe itself"));
    }
    Ok((name.to_string(), value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_checked() {
        assert_eq!(parse_header("X-Api-Key:  k1 ").unwrap(), ("X-Api-Key".into(), "k1".into()));
        assert!(parse_header("no colon").is_err());
        assert!(parse_header("Bad Name: v").is_err());
        assert!(parse_header("X: a\r\nEvil: b").is_err());
        assert!(parse_header("Content-Length: 5").is_err());
        let a = ServerAuth { api_key: Some("sk-secret".into()), headers: vec![("X-K".into(), "hidden".into())] };
        let dbg = format!("{a:?}");
        assert!(!dbg.contains("sk-secret") && !dbg.contains("hidden"), "{dbg}");
    }
}
