//! A small HTTP/1.1 client over std TCP for the benchmark: plain `http://` only (no TLS; local
//! servers and their gateways speak plain HTTP on loopback). One connection per request
//! (`Connection: close`), so each request has its own local port, the key that joins it to a
//! traced request. Heads and bodies are framed with the same code that reads traced streams
//! (`stream::http`), and bodies are read with `stream::payload`, so the client and the tracer
//! agree on what a content chunk and a stop reason are. Response text is never kept.
use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use serde_json::Value;

pub use crate::util::httpc::{POLL_AGENT, Url, request};
use crate::{
    stream::payload::{self, Kind, Msg, Splitter, Stop},
    util::{
        http::{Body, Parsed, parse_response},
        httpc::head,
    },
};

/// One streamed request as the client saw it. Times in ms from the moment the request was sent.
#[derive(Clone, Debug, Default)]
pub struct Exchange {
    pub local_port: Option<u16>,
    pub status: Option<u16>,
    pub ttfb_ms: Option<f64>,
    /// First message carrying content.
    pub ttft_ms: Option<f64>,
    /// Last byte.
    pub e2e_ms: Option<f64>,
    /// When each content message arrived.
    pub content_ms: Vec<f64>,
    pub stop: Stop,
    /// The error message of a 4xx/5xx body or a mid-stream error (server text, never the prompt).
    pub error_message: Option<String>,
    /// The client's deadline passed before the response ended.
    pub deadline_hit: bool,
    /// The server closed the connection before the response ended.
    pub disconnected: bool,
    /// The client gave up (Ctrl-C grace period over) before the response ended.
    pub aborted: bool,
    /// Could not connect, write, or read a valid HTTP response.
    pub transport_error: Option<String>,
    /// The response ended as its framing says (terminal chunk or full length).
    pub complete: bool,
    /// The answer's text, kept in memory for the next turn of a conversation (multi-turn);
    /// never written to an output.
    pub text: String,
}

/// User-Agent of the generation requests the benchmark measures.
pub const BENCH_AGENT: &str = "probe-bench";

/// Send a generation request and read its (streamed) answer until the end, the deadline, or
/// the Ctrl-C grace period, timing each content message.
pub fn stream(url: &Url, path: &str, body: &str, deadline: Duration) -> Exchange {
    let mut x = Exchange::default();
    let addr = match url.addr() {
        Ok(a) => a,
        Err(e) => {
            x.transport_error = Some(e);
            return x;
        }
    };
    let t0 = Instant::now();
    let ms = |t0: Instant| t0.elapsed().as_secs_f64() * 1e3;
    let mut s = match TcpStream::connect_timeout(&addr, deadline.min(Duration::from_secs(10))) {
        Ok(s) => s,
        Err(e) => {
            x.transport_error = Some(format!("cannot connect to {addr}: {e}"));
            return x;
        }
    };
    x.local_port = s.local_addr().ok().map(|a| a.port());
    let _ = s.set_nodelay(true);
    let t0 = if s.write_all(head(url, "POST", path, Some(body), BENCH_AGENT).as_bytes()).is_ok() {
        t0.max(Instant::now())
    } else {
        x.transport_error = Some(format!("cannot send the request to {addr}"));
        return x;
    };
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 65536];
    let mut headed: Option<(Body, Splitter, usize)> = None;
    let mut body_bytes = Vec::new();
    let mut msgs = Vec::new();
    loop {
        // Short read timeouts so the deadline and Ctrl-C are noticed while the server is silent.
        let left = deadline.saturating_sub(t0.elapsed());
        if left.is_zero() {
            x.deadline_hit = true;
            break;
        }
        if super::interrupt_grace_over() {
            x.aborted = true;
            break;
        }
        let _ = s.set_read_timeout(Some(left.min(Duration::from_millis(200))));
        let n = match s.read(&mut chunk) {
            Ok(n) => n,
            Err(e)
                if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) =>
            {
                continue;
            }
            Err(e) => {
                x.disconnected = true;
                x.transport_error = Some(format!("connection to {addr} failed while reading: {e}"));
                break;
            }
        };
        let now = ms(t0);
        if n == 0 {
            if let Some((dec, _, _)) = headed.as_mut() {
                dec.close();
                x.complete = dec.done;
                if !dec.done {
                    x.disconnected = true;
                }
            } else {
                x.disconnected = true;
                x.transport_error = Some(format!("{addr} closed the connection without an HTTP response"));
            }
            x.e2e_ms = Some(now);
            break;
        }
        x.ttfb_ms.get_or_insert(now);
        x.e2e_ms = Some(now);
        let mut input = &chunk[..n];
        if headed.is_none() {
            buf.extend_from_slice(input);
            match parse_response(&buf) {
                Parsed::Done(h, len) => {
                    x.status = Some(h.status);
                    let kind = Kind::detect(&h.content_type, &buf[len..]);
                    headed = Some((Body::new(h.framing("POST")), Splitter::new(kind), len));
                }
                Parsed::Partial if buf.len() < 64 << 10 => continue,
                _ => {
                    x.transport_error = Some(format!("{addr} did not answer in HTTP/1.x"));
                    break;
                }
            }
            input = &[];
        }
        let Some((dec, split, start)) = headed.as_mut() else { continue };
        let fresh: Vec<u8> = if *start > 0 { buf[std::mem::take(start)..].to_vec() } else { input.to_vec() };
        body_bytes.clear();
        if dec.feed(&fresh, &mut body_bytes).is_none() {
            x.transport_error = Some(format!("{addr} sent a malformed HTTP body"));
            break;
        }
        split.push(&body_bytes, &mut msgs);
        if dec.done {
            split.finish(&mut msgs);
        }
        for m in msgs.drain(..) {
            read_msg(&m, &mut x, now);
        }
        if dec.done {
            x.complete = true;
            break;
        }
    }
    if !x.complete
        && let Some((_, split, _)) = headed.as_mut()
    {
        split.finish(&mut msgs);
        let now = ms(t0);
        for m in msgs.drain(..) {
            read_msg(&m, &mut x, now);
        }
    }
    x
}

fn read_msg(m: &Msg, x: &mut Exchange, now: f64) {
    if let Msg::Json(v) = m {
        if payload::apply(v, &mut x.stop, false) {
            x.ttft_ms.get_or_insert(now);
            x.content_ms.push(now);
        }
        let c = &v["choices"][0];
        for t in [&c["text"], &c["delta"]["content"], &v["content"], &v["response"], &v["message"]["content"]] {
            if let Some(t) = t.as_str() {
                x.text.push_str(t);
                break;
            }
        }
        if let Some(msg) = error_message(v) {
            x.error_message = Some(msg);
        }
    }
}

/// The message of `{"error": {"message": ..}}` or `{"error": ".."}` (vLLM, llama.cpp, Ollama),
/// cut to 200 characters. Server text about the request, not its content.
pub fn error_message(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    let m = e.get("message").and_then(Value::as_str).or(e.as_str()).or(v.get("detail").and_then(Value::as_str))?;
    Some(m.chars().take(200).collect())
}

/// Whether Ctrl-C asked to stop sending (requests in flight still finish for a grace period).
pub fn interrupted() -> bool {
    super::INTERRUPTED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(Url::parse("http://127.0.0.1:8080").unwrap(), Url { host: "127.0.0.1".into(), port: 8080, prefix: "".into() });
        assert_eq!(Url::parse("http://localhost/api/").unwrap(), Url { host: "localhost".into(), port: 80, prefix: "/api".into() });
        assert_eq!(Url::parse("http://[::1]:11434").unwrap().host, "::1");
        assert!(Url::parse("https://x").unwrap_err().contains("only plain http://"));
        assert!(Url::parse("localhost:8080").is_err());
        assert!(Url::parse("http://h:notaport").is_err());
    }

    /// A one-shot server on loopback that answers with `parts`, pausing `pause` between them,
    /// then closes (or stalls for `stall` first).
    fn serve(parts: Vec<String>, pause: Duration, stall: Duration) -> Url {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            for p in parts {
                let _ = c.write_all(p.as_bytes());
                std::thread::sleep(pause);
            }
            std::thread::sleep(stall);
        });
        Url::parse(&format!("http://127.0.0.1:{port}")).unwrap()
    }

    const HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";

    /// One chunk of chunked encoding carrying one SSE event.
    fn event(json: &str) -> String {
        let e = format!("data: {json}\n\n");
        format!("{:x}\r\n{e}\r\n", e.len())
    }

    #[test]
    fn chunked_sse_is_timed_per_content_message() {
        let url = serve(
            vec![
                HEAD.into(),
                event(r#"{"content":"a","stop":false}"#),
                event(r#"{"content":"b","stop":false}"#),
                event(r#"{"content":"","stop":true,"stop_type":"limit","timings":{"predicted_n":2,"prompt_n":3}}"#),
                "0\r\n\r\n".into(),
            ],
            Duration::from_millis(20),
            Duration::ZERO,
        );
        let x = stream(&url, "/completion", "{}", Duration::from_secs(5));
        assert_eq!((x.status, x.complete, x.disconnected, x.deadline_hit), (Some(200), true, false, false), "{x:?}");
        assert_eq!(x.content_ms.len(), 2);
        assert!(x.content_ms[1] - x.content_ms[0] >= 15.0, "{:?}", x.content_ms);
        assert_eq!(x.stop.stop_type.as_deref(), Some("limit"));
        assert_eq!(x.stop.server_timings.as_ref().unwrap()["predicted_n"], 2);
        assert!(x.local_port.is_some() && x.ttft_ms.unwrap() <= x.e2e_ms.unwrap());
    }

    #[test]
    fn a_cut_stream_a_stall_and_a_rejection() {
        let cut = serve(vec![HEAD.into(), event(r#"{"content":"a","stop":false}"#)], Duration::ZERO, Duration::ZERO);
        let x = stream(&cut, "/completion", "{}", Duration::from_secs(5));
        assert!(x.disconnected && !x.complete, "{x:?}");
        assert_eq!(x.content_ms.len(), 1);
        let stall = serve(vec![HEAD.into()], Duration::ZERO, Duration::from_secs(3));
        let t = std::time::Instant::now();
        let x = stream(&stall, "/completion", "{}", Duration::from_millis(300));
        assert!(x.deadline_hit && t.elapsed() < Duration::from_secs(2), "{x:?}");
        let body =
            "{\"error\":{\"code\":400,\"message\":\"the request exceeds the available context size\",\"type\":\"invalid_request_error\"}}";
        let text = format!("HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let x = stream(&serve(vec![text], Duration::ZERO, Duration::ZERO), "/completion", "{}", Duration::from_secs(5));
        assert_eq!((x.status, x.complete), (Some(400), true));
        assert_eq!(x.error_message.as_deref(), Some("the request exceeds the available context size"));
        let junk = serve(vec!["SSH-2.0-OpenSSH_9\r\n".into()], Duration::ZERO, Duration::ZERO);
        assert!(stream(&junk, "/", "{}", Duration::from_secs(5)).transport_error.unwrap().contains("HTTP/1.x"));
    }

    #[test]
    fn errors_keep_only_the_message() {
        let v: Value = serde_json::json!({"error": {"code": 400, "message": "the request exceeds the available context size", "type": "invalid_request_error"}});
        assert_eq!(error_message(&v).unwrap(), "the request exceeds the available context size");
        assert_eq!(error_message(&serde_json::json!({"error": "model not found"})).unwrap(), "model not found");
        assert!(error_message(&serde_json::json!({"content": "x"})).is_none());
    }
}
