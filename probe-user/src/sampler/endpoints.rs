//! The server's own view, polled over HTTP on the ports the target listens on: llama.cpp
//! `/metrics` (with `--metrics`) and `/props`, vLLM `/metrics`, Ollama `/api/ps`. Only endpoints
//! that neither wake a sleeping llama-server nor reset its idle timer are polled (`/metrics` and
//! `/props` bypass sleep and do not count as activity; `/slots` would wake the model, so it is
//! never polled). Every poll's local port is recorded so the report leaves these requests out.
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use serde_json::{Value, json};

/// One HTTP/1.1 GET with `Connection: close`: (status, body, our local port).
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, Vec<u8>, u16)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    let local = s.local_addr()?.port();
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let ua = crate::stream::http::POLL_USER_AGENT;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: {ua}/{}\r\nAccept: */*\r\nConnection: close\r\n\r\n", env!("CARGO_PKG_VERSION"))?;
    let mut buf = Vec::new();
    s.take(4 << 20).read_to_end(&mut buf)?;
    let (status, body) = parse_response(&buf).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response"))?;
    Ok((status, body, local))
}

/// Status and body of a whole HTTP/1.x response (Content-Length, chunked or until close).
pub fn parse_response(buf: &[u8]) -> Option<(u16, Vec<u8>)> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(n) = resp.parse(buf).ok()? else { return None };
    let status = resp.code?;
    let chunked = resp.headers.iter().any(|h| h.name.eq_ignore_ascii_case("transfer-encoding") && String::from_utf8_lossy(h.value).to_ascii_lowercase().contains("chunked"));
    let rest = &buf[n..];
    if !chunked {
        return Some((status, rest.to_vec()));
    }
    let (mut out, mut at) = (Vec::new(), 0);
    while at < rest.len() {
        let line_end = rest[at..].windows(2).position(|w| w == b"\r\n")? + at;
        let size_text = String::from_utf8_lossy(&rest[at..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            break;
        }
        out.extend_from_slice(rest.get(at..at + size)?);
        at += size + 2;
    }
    Some((status, out))
}

/// Prometheus text → {"name{labels}": value}, histogram buckets left out, at most `max` series.
pub fn parse_prometheus(text: &str, max: usize) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for l in text.lines() {
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        let (series, value) = match l.rfind('}') {
            Some(i) => (&l[..=i], l[i + 1..].split_whitespace().next()),
            None => {
                let mut it = l.split_whitespace();
                (it.next().unwrap_or(""), it.next())
            }
        };
        let name = series.split('{').next().unwrap_or("");
        if name.ends_with("_bucket") || name.ends_with("_created") {
            continue;
        }
        if let Some(v) = value.and_then(|v| v.parse::<f64>().ok()).filter(|v| v.is_finite()) {
            out.insert(series.to_string(), json!(v));
            if out.len() >= max {
                break;
            }
        }
    }
    out
}

/// What a port answers as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    LlamaCpp,
    Vllm,
    Ollama,
    /// Answers HTTP but none of the known endpoints.
    Other,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::LlamaCpp => "llama.cpp",
            Kind::Vllm => "vllm",
            Kind::Ollama => "ollama",
            Kind::Other => "other",
        }
    }
}

/// One port being polled.
pub struct Endpoint {
    pub addr: SocketAddr,
    pub kind: Option<Kind>,
    /// /metrics answered 404/501 once (llama-server without --metrics): not asked again.
    no_metrics: Option<u16>,
    pub local_ports: Vec<u16>,
    timeout: Duration,
}

impl Endpoint {
    pub fn new(addr: SocketAddr) -> Endpoint {
        Endpoint { addr, kind: None, no_metrics: None, local_ports: Vec::new(), timeout: Duration::from_millis(800) }
    }

    fn fetch(&mut self, path: &str) -> Option<(u16, Vec<u8>)> {
        match get(self.addr, path, self.timeout) {
            Ok((s, b, port)) => {
                self.local_ports.push(port);
                Some((s, b))
            }
            Err(_) => None,
        }
    }

    /// Poll once: a JSON record for the recording (None when the port does not answer HTTP).
    pub fn poll(&mut self) -> Option<Value> {
        self.local_ports.clear();
        let mut rec = json!({"type": "endpoint", "addr": self.addr.to_string()});
        let metrics = match self.no_metrics {
            Some(st) => Some((st, Vec::new())),
            None => self.fetch("/metrics"),
        };
        if let Some((st @ (404 | 501), _)) = metrics {
            self.no_metrics = Some(st);
        }
        let metrics_text = metrics.as_ref().filter(|(s, _)| *s == 200).map(|(_, b)| String::from_utf8_lossy(b).to_string());
        if self.kind.is_none() {
            self.kind = Some(match &metrics_text {
                Some(t) if t.contains("llamacpp:") => Kind::LlamaCpp,
                Some(t) if t.contains("vllm:") => Kind::Vllm,
                _ => match self.fetch("/props") {
                    Some((200, b)) if serde_json::from_slice::<Value>(&b).is_ok_and(|v| v.get("default_generation_settings").is_some()) => Kind::LlamaCpp,
                    Some(_) => match self.fetch("/api/version") {
                        Some((200, b)) if serde_json::from_slice::<Value>(&b).is_ok_and(|v| v.get("version").is_some()) => Kind::Ollama,
                        _ => Kind::Other,
                    },
                    None if metrics.is_none() => return None,
                    None => Kind::Other,
                },
            });
        }
        let kind = self.kind.unwrap_or(Kind::Other);
        rec["kind"] = json!(kind.name());
        match &metrics {
            Some((200, _)) => rec["metrics"] = Value::Object(parse_prometheus(metrics_text.as_deref().unwrap_or(""), 200)),
            Some((s, _)) => rec["metrics_status"] = json!(s),
            None => {}
        }
        match kind {
            Kind::LlamaCpp => {
                if let Some((200, b)) = self.fetch("/props") {
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    let g = &v["default_generation_settings"];
                    rec["props"] = json!({
                        "is_sleeping": v.get("is_sleeping"), "total_slots": v.get("total_slots"),
                        "n_ctx_slot": g.get("n_ctx"), "model_path": v.get("model_path"),
                        "build_info": v.get("build_info"),
                    });
                }
            }
            Kind::Ollama => {
                if let Some((200, b)) = self.fetch("/api/ps") {
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    let models: Vec<Value> = v["models"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|m| json!({"name": m.get("name"), "size": m.get("size"), "size_vram": m.get("size_vram"), "expires_at": m.get("expires_at")}))
                        .collect();
                    rec["ps"] = json!(models);
                }
            }
            _ => {}
        }
        rec["local_ports"] = json!(self.local_ports);
        Some(rec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_chunked_and_plain_responses() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(parse_response(plain), Some((200, b"hello".to_vec())));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=1\r\nlo\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Some((200, b"hello".to_vec())));
        assert_eq!(parse_response(b"garbage\r\n\r\n"), None);
    }

    #[test]
    fn reads_prometheus_series() {
        let t = "# HELP x\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 0\nvllm:num_preemptions_total{model_name=\"m\"} 3.0\nvllm:e2e_bucket{le=\"1\"} 4\nbad line\n";
        let m = parse_prometheus(t, 10);
        assert_eq!(m["llamacpp:requests_processing"], json!(2.0));
        assert_eq!(m["vllm:num_preemptions_total{model_name=\"m\"}"], json!(3.0));
        assert!(!m.keys().any(|k| k.contains("_bucket")));
        assert_eq!(m.len(), 3);
    }
}
