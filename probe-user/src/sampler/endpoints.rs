//! The server's own view, polled over HTTP on the ports the target listens on: llama.cpp
//! `/metrics` (with `--metrics`) and `/props`, vLLM `/metrics`, Ollama `/api/ps`. Only endpoints
//! that neither wake a sleeping llama-server nor reset its idle timer are polled (`/metrics` and
//! `/props` bypass sleep and do not count as activity; `/slots` would wake the model, so it is
//! never polled). Every poll's local port is recorded so the report leaves these requests out.
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

/// One poll (every request to one port) ends by this deadline, however slowly the server
/// answers: a `/metrics` trickled a byte at a time cannot hold the poller (and the trace's end).
pub const POLL_DEADLINE: Duration = Duration::from_secs(2);
/// The largest body read from an endpoint; a larger one is not parsed.
pub const BODY_CAP: usize = 1 << 20;

use std::collections::BTreeMap;

use serde_json::Value;

pub use crate::record::samples::Kind;
use crate::record::samples::{EndpointPoll, LlamaProps, LoadedModel};

/// The samples of Prometheus text: (metric name, series `name{labels}`, value); comments,
/// blank lines and non-finite values left out. Label values may hold spaces.
pub fn prometheus_samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter_map(|l| {
        let l = l.trim();
        if l.is_empty() || l.starts_with('#') {
            return None;
        }
        let (series, rest) = match l.rfind('}') {
            Some(i) => (&l[..=i], &l[i + 1..]),
            None => l.split_once(char::is_whitespace)?,
        };
        let value = rest.split_whitespace().next()?.parse::<f64>().ok().filter(|v| v.is_finite())?;
        Some((series.split('{').next()?.trim(), series.trim(), value))
    })
}

/// Prometheus text → {"name{labels}": value}, histogram buckets left out, at most `max` series.
pub fn parse_prometheus(text: &str, max: usize) -> BTreeMap<String, f64> {
    prometheus_samples(text)
        .filter(|(name, _, _)| !name.ends_with("_bucket") && !name.ends_with("_created"))
        .take(max)
        .map(|(_, series, v)| (series.to_string(), v))
        .collect()
}

/// One port being polled.
pub struct Endpoint {
    pub addr: SocketAddr,
    pub kind: Option<Kind>,
    /// /metrics answered 404/501 once (llama-server without --metrics): not asked again.
    no_metrics: Option<u16>,
    pub local_ports: Vec<u16>,
    timeout: Duration,
    /// The server's network namespace when it is not probe's (/proc/PID/ns/net, held open).
    pub netns: Option<std::sync::Arc<std::fs::File>>,
    /// When the poll under way must end ([`POLL_DEADLINE`] after it started).
    deadline: Option<Instant>,
}

impl Endpoint {
    pub fn new(addr: SocketAddr) -> Endpoint {
        Endpoint {
            addr,
            kind: None,
            no_metrics: None,
            local_ports: Vec::new(),
            timeout: Duration::from_millis(800),
            netns: None,
            deadline: None,
        }
    }

    fn fetch(&mut self, path: &str) -> Option<(u16, Vec<u8>)> {
        let url = crate::util::httpc::Url::of(self.addr);
        match crate::util::httpc::request_bounded(&url, "GET", path, None, self.timeout, self.deadline, BODY_CAP) {
            Ok((s, b, port)) => {
                self.local_ports.push(port);
                Some((s, b))
            }
            Err(_) => None,
        }
    }

    /// Poll once: a record for the recording (None when the port does not answer HTTP).
    /// `ts_ns` is left for the caller, who knows when the poll began.
    pub fn poll(&mut self) -> Option<EndpointPoll> {
        self.local_ports.clear();
        self.deadline = Some(Instant::now() + POLL_DEADLINE);
        let mut rec = EndpointPoll { addr: self.addr.to_string(), netns: self.netns.is_some(), ..Default::default() };
        let metrics = match self.no_metrics {
            Some(st) => Some((st, Vec::new())),
            None => self.fetch("/metrics"),
        };
        if let Some((st @ (404 | 501), _)) = metrics {
            self.no_metrics = Some(st);
        }
        let metrics_text = metrics.as_ref().filter(|(s, _)| *s == 200).map(|(_, b)| String::from_utf8_lossy(b).to_string());
        if self.kind.is_none() && metrics.is_none() {
            // No HTTP answer at all (a port of torch's gloo, a database): asking another path
            // would only wait out the timeout again.
            return None;
        }
        if self.kind.is_none() {
            self.kind = Some(match &metrics_text {
                Some(t) if t.contains("llamacpp:") => Kind::LlamaCpp,
                Some(t) if t.contains("vllm:") => Kind::Vllm,
                _ => match self.fetch("/props") {
                    Some((200, b)) if serde_json::from_slice::<Value>(&b).is_ok_and(|v| v.get("default_generation_settings").is_some()) => {
                        Kind::LlamaCpp
                    }
                    Some(_) => match self.fetch("/api/version") {
                        Some((200, b)) if serde_json::from_slice::<Value>(&b).is_ok_and(|v| v.get("version").is_some()) => Kind::Ollama,
                        _ => Kind::Other,
                    },
                    None => Kind::Other,
                },
            });
        }
        rec.kind = self.kind.unwrap_or(Kind::Other);
        match &metrics {
            Some((200, _)) => rec.metrics = Some(parse_prometheus(metrics_text.as_deref().unwrap_or(""), 200)),
            Some((s, _)) => rec.metrics_status = Some(*s),
            None => {}
        }
        match rec.kind {
            Kind::LlamaCpp => {
                if let Some((200, b)) = self.fetch("/props") {
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    let g = &v["default_generation_settings"];
                    rec.props = Some(LlamaProps {
                        is_sleeping: v["is_sleeping"].as_bool(),
                        total_slots: v["total_slots"].as_u64(),
                        n_ctx_slot: g["n_ctx"].as_u64(),
                        model_path: v["model_path"].as_str().map(String::from),
                        build_info: v["build_info"].as_str().map(String::from),
                    });
                }
            }
            Kind::Ollama => {
                if let Some((200, b)) = self.fetch("/api/ps") {
                    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    let models = v["models"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|m| LoadedModel {
                            name: m["name"].as_str().map(String::from),
                            size: m["size"].as_u64(),
                            size_vram: m["size_vram"].as_u64(),
                            expires_at: m["expires_at"].as_str().map(String::from),
                        })
                        .collect();
                    rec.ps = Some(models);
                }
            }
            _ => {}
        }
        rec.local_ports = self.local_ports.clone();
        Some(rec)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    /// A one-connection server on loopback that answers with `head` and then `body`, written
    /// `step` bytes every `gap`.
    fn server(head: &'static str, body: Vec<u8>, step: usize, gap: Duration) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req);
            let _ = s.write_all(head.as_bytes());
            for c in body.chunks(step) {
                if s.write_all(c).is_err() {
                    return;
                }
                std::thread::sleep(gap);
            }
        });
        addr
    }

    #[test]
    fn a_trickled_answer_ends_at_the_deadline() {
        // A byte every 50 ms, well inside the per-read timeout, for 10 s.
        let addr = server("HTTP/1.1 200 OK\r\n\r\n", vec![b'#'; 200], 1, Duration::from_millis(50));
        let t = Instant::now();
        let deadline = Some(t + Duration::from_millis(400));
        let r = crate::util::httpc::request_bounded(
            &crate::util::httpc::Url::of(addr),
            "GET",
            "/metrics",
            None,
            Duration::from_millis(800),
            deadline,
            BODY_CAP,
        );
        assert!(r.is_err(), "{r:?}");
        assert!(t.elapsed() < Duration::from_millis(900), "took {:?}", t.elapsed());
    }

    #[test]
    fn a_body_over_the_cap_is_refused() {
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 3145728\r\n\r\n";
        let addr = server(head, vec![b'x'; 3 << 20], 64 << 10, Duration::ZERO);
        let url = crate::util::httpc::Url::of(addr);
        let r = crate::util::httpc::request_bounded(&url, "GET", "/metrics", None, Duration::from_millis(800), None, 1 << 20);
        assert!(r.as_ref().is_err_and(|e| e.contains("over 1048576 bytes")), "{:?}", r.map(|(s, b, _)| (s, b.len())));
    }

    #[test]
    fn reads_prometheus_series() {
        let t = "# HELP x\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 0\nvllm:num_preemptions_total{model_name=\"m\"} 3.0\nvllm:e2e_bucket{le=\"1\"} 4\nbad line\n";
        let m = parse_prometheus(t, 10);
        assert_eq!(m["llamacpp:requests_processing"], 2.0);
        assert_eq!(m["vllm:num_preemptions_total{model_name=\"m\"}"], 3.0);
        assert!(!m.keys().any(|k| k.contains("_bucket")));
        assert_eq!(m.len(), 3);
    }
}
