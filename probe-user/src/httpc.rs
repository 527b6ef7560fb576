//! Blocking HTTP/1.1 requests to local servers over std TCP: plain `http://` only, one connection
//! per request (`Connection: close`). Heads and bodies are framed by `stream::http`, the code that
//! reads traced streams. Used by the endpoint poller (sampler) and `probe bench`.
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream, ToSocketAddrs},
    time::{Duration, Instant},
};

use crate::stream::http::{Body, Parsed, parse_response};

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
    let addr = url.addr()?;
    // The time one read may wait: the per-read timeout, or what is left before the deadline.
    let left = || -> Result<Duration, String> {
        let Some(d) = deadline else { return Ok(timeout) };
        let rest = d.saturating_duration_since(Instant::now());
        if rest.is_zero() { Err(format!("{addr} took longer than its deadline to answer")) } else { Ok(rest.min(timeout)) }
    };
    let mut s = TcpStream::connect_timeout(&addr, left()?).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let local = s.local_addr().map(|a| a.port()).unwrap_or(0);
    let _ = s.set_read_timeout(Some(left()?));
    let _ = s.set_write_timeout(Some(left()?));
    let _ = s.set_nodelay(true);
    s.write_all(head(url, method, path, body, POLL_AGENT).as_bytes()).map_err(|e| format!("cannot send to {addr}: {e}"))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let (status, framing, start) = loop {
        let _ = s.set_read_timeout(Some(left()?));
        let n = read_retry(&mut s, &mut chunk).map_err(|e| format!("no answer from {addr}: {e}"))?;
        if n == 0 {
            return Err(format!("{addr} closed the connection without an HTTP response"));
        }
        buf.extend_from_slice(&chunk[..n]);
        match parse_response(&buf) {
            Parsed::Done(h, len) => break (h.status, h.framing(method), len),
            Parsed::Partial if buf.len() < 64 << 10 => continue,
            _ => return Err(format!("{addr} did not answer in HTTP/1.x (is this an HTTP server?)")),
        }
    };
    let mut dec = Body::new(framing);
    let mut out = Vec::new();
    let mut rest = buf[start..].to_vec();
    loop {
        if dec.feed(&rest, &mut out).is_none() {
            return Err(format!("{addr} sent a malformed HTTP body"));
        }
        if out.len() > cap {
            return Err(format!("{addr} sent a body over {cap} bytes"));
        }
        if dec.done {
            break;
        }
        let _ = s.set_read_timeout(Some(left()?));
        let n = read_retry(&mut s, &mut chunk).map_err(|e| format!("reading from {addr}: {e}"))?;
        if n == 0 {
            dec.close();
            break;
        }
        rest = chunk[..n].to_vec();
    }
    Ok((status, out, local))
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
pub const POLL_AGENT: &str = crate::stream::http::POLL_USER_AGENT;

pub fn head(url: &Url, method: &str, path: &str, body: Option<&str>, agent: &str) -> String {
    let mut h = format!(
        "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: {agent}\r\nAccept: */*\r\nConnection: close\r\n",
        url.prefix,
        url.host_header()
    );
    if let Some(b) = body {
        h.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()));
    } else {
        h.push_str("\r\n");
    }
    h
}
