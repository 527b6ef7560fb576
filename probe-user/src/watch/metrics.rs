//! `probe watch --metrics-addr`: Prometheus text exposition (format 0.0.4) of what the watcher
//! saw. Names and units follow Prometheus conventions (`_seconds`, `_total`, `_ratio`); every
//! label value comes from a closed set (stop causes, slow causes, incident causes, a fixed list
//! of API paths and "other"), so a scrape stays small whatever the clients send.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener},
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::{
    analysis::verdict::{SlowCause, StopCause},
    record::samples::Sample,
};

/// TTFT histogram bucket bounds, seconds.
pub const TTFT_BUCKETS: [f64; 12] = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

/// API paths shown as themselves; any other is "other" (query strings never reach a label).
const PATHS: [&str; 14] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/chat/completions",
    "/completions",
    "/completion",
    "/infill",
    "/embedding",
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
];

/// The path label of a request path.
pub fn path_label(path: Option<&str>) -> &'static str {
    let p = path.unwrap_or_default();
    let p = p.split(['?', '#']).next().unwrap_or_default();
    PATHS.iter().copied().find(|k| *k == p).unwrap_or("other")
}

#[derive(Default)]
struct State {
    requests: BTreeMap<(&'static str, &'static str), u64>,
    ttft_buckets: [u64; TTFT_BUCKETS.len()],
    ttft_count: u64,
    ttft_sum: f64,
    ttft_cause: BTreeMap<crate::analysis::verdict::SplitPart, f64>,
    slow: BTreeMap<SlowCause, u64>,
    analysed: u64,
    output_tokens: u64,
    incidents: BTreeMap<&'static str, u64>,
    suppressed: BTreeMap<&'static str, u64>,
    lost: u64,
    lost_before: u64,
    bpf_ns: u64,
    bpf_before: u64,
    residency: Option<f64>,
    sleeping: Option<bool>,
    target: Option<u32>,
    restarts: u64,
    /// Where the server runs (`place::labels`), on every sample.
    labels: Vec<(String, String)>,
    /// One server of the node agent's: the process's CPU and the programs' run time are the
    /// agent's, counted once in its own samples, not in each server's.
    shared_process: bool,
    /// The OTLP sender's counters (sent, dropped), with `--otlp`.
    otlp: Option<(Arc<std::sync::atomic::AtomicU64>, Arc<std::sync::atomic::AtomicU64>)>,
}

/// The counters, shared by the watcher (writes) and the metrics thread (reads).
#[derive(Default)]
pub struct Metrics {
    s: Mutex<State>,
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut State)) {
        if let Ok(mut s) = self.s.lock() {
            f(&mut s);
        }
    }

    /// A finished request: its stop cause, path, TTFT and output tokens.
    pub fn request(&self, stop: StopCause, path: Option<&str>, ttft_s: Option<f64>, tokens: u64) {
        self.with(|s| {
            *s.requests.entry((stop.name(), path_label(path))).or_default() += 1;
            if let Some(t) = ttft_s.filter(|t| t.is_finite() && *t >= 0.0) {
                for (i, b) in TTFT_BUCKETS.iter().enumerate() {
                    if t <= *b {
                        s.ttft_buckets[i] += 1;
                    }
                }
                s.ttft_count += 1;
                s.ttft_sum += t;
            }
            s.output_tokens += tokens;
        });
    }

    /// A request's verdict: its TTFT split (ms) by cause, and what made it slow.
    pub fn verdict(&self, v: &crate::analysis::verdict::Verdict) {
        self.with(|s| {
            s.analysed += 1;
            *s.slow.entry(v.slow_cause).or_default() += 1;
            if let Some(t) = &v.ttft_ms {
                for (k, ms) in t.by_part() {
                    *s.ttft_cause.entry(k).or_default() += ms.max(0.0) / 1e3;
                }
            }
        });
    }

    /// An incident saved (`written`) or not (the rate limit), counted by its kind's name
    /// (`incident::IncidentKind::name`: the `cause` label).
    pub fn incident(&self, cause: &'static str, written: bool) {
        self.with(|s| *(if written { &mut s.incidents } else { &mut s.suppressed }).entry(cause).or_default() += 1);
    }

    /// Cumulative figures of the current session (each session starts from zero).
    pub fn set_cost(&self, lost: u64, bpf_ns: u64) {
        self.with(|s| {
            s.lost = lost;
            s.bpf_ns = bpf_ns;
        });
    }

    /// A session ended: its figures become part of the totals.
    pub fn set_shared_process(&self) {
        self.with(|s| s.shared_process = true);
    }

    pub fn session_ended(&self) {
        self.with(|s| {
            s.lost_before += std::mem::take(&mut s.lost);
            s.bpf_before += std::mem::take(&mut s.bpf_ns);
        });
    }

    pub fn sample(&self, v: &Sample) {
        self.with(|s| match v {
            Sample::Residency(v) => {
                // The largest file the server maps or has open: its model.
                if let Some(f) = v.files.iter().max_by_key(|f| f.bytes)
                    && f.pages > 0
                {
                    s.residency = Some(f.resident as f64 / f.pages as f64);
                }
            }
            Sample::Endpoint(v) => {
                if let Some(b) = v.sleeping() {
                    s.sleeping = Some(b);
                }
            }
            _ => {}
        });
    }

    pub fn set_target(&self, pid: Option<u32>) {
        self.with(|s| {
            s.target = pid;
            if pid.is_none() {
                s.sleeping = None;
            }
        });
    }

    /// Labels every sample carries (the server's node, container, pod).
    pub fn set_labels(&self, labels: Vec<(String, String)>) {
        self.with(|s| s.labels = labels);
    }

    /// Count the OTLP sender's spans and log records (sent, dropped) in the exposition.
    pub fn set_otlp(&self, sent: Arc<std::sync::atomic::AtomicU64>, dropped: Arc<std::sync::atomic::AtomicU64>) {
        self.with(|s| s.otlp = Some((sent, dropped)));
    }

    pub fn restarted(&self) {
        self.with(|s| s.restarts += 1);
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let Ok(s) = self.s.lock() else { return String::new() };
        let mut o = String::new();
        let head = |o: &mut String, name: &str, ty: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {ty}");
        };
        head(&mut o, "probe_requests_total", "counter", "Requests the watched server finished, by stop cause and API path.");
        for ((stop, path), n) in &s.requests {
            let _ = writeln!(o, "probe_requests_total{{stop_cause=\"{stop}\",path=\"{path}\"}} {n}");
        }
        head(&mut o, "probe_ttft_seconds", "histogram", "Time to first token of finished requests, seconds.");
        for (b, n) in TTFT_BUCKETS.iter().zip(s.ttft_buckets) {
            let _ = writeln!(o, "probe_ttft_seconds_bucket{{le=\"{b}\"}} {n}");
        }
        let _ = writeln!(o, "probe_ttft_seconds_bucket{{le=\"+Inf\"}} {}", s.ttft_count);
        let _ = writeln!(o, "probe_ttft_seconds_sum {}\nprobe_ttft_seconds_count {}", s.ttft_sum, s.ttft_count);
        head(&mut o, "probe_ttft_cause_seconds_total", "counter", "Time to first token of analysed requests, split by cause, seconds.");
        for c in crate::analysis::verdict::SplitPart::ALL {
            let _ = writeln!(o, "probe_ttft_cause_seconds_total{{cause=\"{c}\"}} {}", s.ttft_cause.get(c).copied().unwrap_or(0.0));
        }
        head(&mut o, "probe_analysed_requests_total", "counter", "Analysed requests, by what made the first token slow (none: not slow).");
        for c in SlowCause::ALL {
            let _ = writeln!(o, "probe_analysed_requests_total{{slow_cause=\"{}\"}} {}", c.name(), s.slow.get(c).copied().unwrap_or(0));
        }
        head(&mut o, "probe_output_tokens_total", "counter", "Tokens the server produced in finished requests.");
        let _ = writeln!(o, "probe_output_tokens_total {}", s.output_tokens);
        head(&mut o, "probe_incidents_total", "counter", "Incident directories written, by cause.");
        for (c, n) in &s.incidents {
            let _ = writeln!(o, "probe_incidents_total{{cause=\"{c}\"}} {n}");
        }
        head(&mut o, "probe_incidents_suppressed_total", "counter", "Incidents not written because of the rate limit, by cause.");
        for (c, n) in &s.suppressed {
            let _ = writeln!(o, "probe_incidents_suppressed_total{{cause=\"{c}\"}} {n}");
        }
        head(&mut o, "probe_events_lost_total", "counter", "Kernel events lost (ring buffer full and other drops).");
        let _ = writeln!(o, "probe_events_lost_total {}", s.lost_before + s.lost);
        if !s.shared_process {
            head(&mut o, "probe_cpu_seconds_total", "counter", "CPU time of the probe process (user and system), seconds.");
            let _ = writeln!(o, "probe_cpu_seconds_total {}", crate::collector::own_cpu_ns() as f64 / 1e9);
            head(&mut o, "probe_bpf_run_seconds_total", "counter", "Run time of probe's BPF programs in the kernel, seconds.");
            let _ = writeln!(o, "probe_bpf_run_seconds_total {}", (s.bpf_before + s.bpf_ns) as f64 / 1e9);
        }
        if let Some(r) = s.residency {
            head(&mut o, "probe_model_page_cache_ratio", "gauge", "Share of the model file's pages in the page cache (0 to 1).");
            let _ = writeln!(o, "probe_model_page_cache_ratio {r}");
        }
        if let Some(b) = s.sleeping {
            head(&mut o, "probe_server_sleeping", "gauge", "1 while the server says it sleeps (llama.cpp /props is_sleeping).");
            let _ = writeln!(o, "probe_server_sleeping {}", u8::from(b));
        }
        head(&mut o, "probe_target_up", "gauge", "1 while probe follows a live target process.");
        let _ = writeln!(o, "probe_target_up {}", u8::from(s.target.is_some()));
        head(&mut o, "probe_target_restarts_total", "counter", "Times probe went on with a new target process (restarts).");
        let _ = writeln!(o, "probe_target_restarts_total {}", s.restarts);
        if let Some((sent, dropped)) = &s.otlp {
            use std::sync::atomic::Ordering::Relaxed;
            head(&mut o, "probe_otlp_sent_total", "counter", "Spans and incident log records the OTLP collector accepted.");
            let _ = writeln!(o, "probe_otlp_sent_total {}", sent.load(Relaxed));
            head(
                &mut o,
                "probe_otlp_dropped_total",
                "counter",
                "Spans and incident log records not sent (queue full, or the collector down past the retries).",
            );
            let _ = writeln!(o, "probe_otlp_dropped_total {}", dropped.load(Relaxed));
        }
        relabel(&o, &s.labels)
    }
}

/// A label value as the exposition format writes it (`\`, `"` and newlines escaped).
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Exposition text with `labels` added to every sample (before the sample's own labels).
pub fn relabel(text: &str, labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return text.to_string();
    }
    let add: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    let add = add.join(",");
    let mut o = String::with_capacity(text.len() * 2);
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            o.push_str(line);
        } else if let Some((name, rest)) = line.split_once('{') {
            let _ = write!(o, "{name}{{{add}{}{rest}", if rest.starts_with('}') { "" } else { "," });
        } else if let Some((name, value)) = line.split_once(' ') {
            let _ = write!(o, "{name}{{{add}}} {value}");
        } else {
            o.push_str(line);
        }
        o.push('\n');
    }
    o
}

/// Several expositions as one: each metric family's HELP and TYPE once, then its samples from
/// every text in turn (the format wants a family's samples together).
pub fn merge(texts: &[String]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut heads: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut samples: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for t in texts {
        let mut family = String::new();
        for line in t.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
                let name = rest.split(' ').next().unwrap_or_default().to_string();
                if name != family {
                    family = name.clone();
                    if !heads.contains_key(&name) {
                        order.push(name.clone());
                    }
                }
                let h = heads.entry(name).or_default();
                if !h.contains(line) {
                    h.push_str(line);
                    h.push('\n');
                }
            } else if !line.trim().is_empty() && !line.starts_with('#') {
                let s = samples.entry(family.clone()).or_default();
                s.push_str(line);
                s.push('\n');
            }
        }
    }
    let mut o = String::new();
    for name in &order {
        o.push_str(&heads[name]);
        if let Some(s) = samples.get(name) {
            o.push_str(s);
        }
    }
    o
}

/// The most bytes of a scrape's request read; a longer one is answered 431.
const REQUEST_CAP: usize = 8 << 10;
/// The most time a connection has for its whole request, and again for the answer to go out: a
/// client trickling bytes (slowloris) is cut off, not waited for.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// The most connections served at once; more are closed at once (the scraper retries).
const MAX_CONNECTIONS: usize = 32;

/// Serve `GET /metrics` on `addr` from a thread; returns the address bound (port 0 picks one).
pub fn serve(addr: SocketAddr, m: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    serve_with(addr, Arc::new(move || m.render()))
}

/// Serve `GET /metrics` on `addr`, the text `render` gives at each scrape, and `GET /healthz`
/// (liveness and readiness: answered from memory, whatever `render` costs). Each connection has
/// a thread of its own, at most [`MAX_CONNECTIONS`], and [`REQUEST_DEADLINE`] for its request,
/// so a slow or silent client never holds back a scrape.
pub fn serve_with(addr: SocketAddr, render: Arc<dyn Fn() -> String + Send + Sync>) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let bound = l.local_addr()?;
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new().name("probe-metrics".into()).spawn(move || {
        use std::sync::atomic::Ordering::SeqCst;
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            if active.fetch_add(1, SeqCst) >= MAX_CONNECTIONS {
                active.fetch_sub(1, SeqCst);
                drop(s);
                continue;
            }
            let (render, active) = (render.clone(), active.clone());
            let spawned = std::thread::Builder::new().name("probe-scrape".into()).spawn({
                let active = active.clone();
                move || {
                    answer(s, &*render);
                    active.fetch_sub(1, SeqCst);
                }
            });
            if spawned.is_err() {
                active.fetch_sub(1, SeqCst);
            }
        }
    })?;
    Ok(bound)
}

/// Read one request (within the deadline and the cap) and answer it.
fn answer(mut s: std::net::TcpStream, render: &(dyn Fn() -> String + Send + Sync)) {
    let until = std::time::Instant::now() + REQUEST_DEADLINE;
    let mut req = Vec::new();
    let mut b = [0u8; 1024];
    let whole = |r: &[u8]| r.windows(4).any(|w| w == b"\r\n\r\n");
    while req.len() < REQUEST_CAP && !whole(&req) {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match s.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&b[..n]),
        }
    }
    let line = req.split(|&c| c == b'\n').next().unwrap_or_default();
    let target = line.split(|&c| c == b' ').nth(1).unwrap_or_default();
    let path = target.split(|&c| c == b'?').next().unwrap_or_default();
    let text = "text/plain; charset=utf-8";
    let (status, ty, body) = match (line.starts_with(b"GET "), path) {
        _ if !whole(&req) => ("431 Request Header Fields Too Large", text, "request too large\n".into()),
        (true, b"/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render()),
        (true, b"/healthz") => ("200 OK", text, "ok\n".into()),
        (true, b"/") => ("200 OK", text, "probe watch: metrics at /metrics, liveness at /healthz\n".into()),
        _ => ("404 Not Found", text, "not found: probe serves /metrics and /healthz\n".into()),
    };
    let _ = s.set_write_timeout(Some(REQUEST_DEADLINE));
    let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Type: {ty}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_added_and_families_merged() {
        let a = "# HELP x_total X.\n# TYPE x_total counter\nx_total{c=\"a\"} 1\n# HELP up Up.\n# TYPE up gauge\nup 1\n";
        let l = |pod: &str| vec![("node".to_string(), "n1".to_string()), ("pod".to_string(), pod.to_string())];
        let one = relabel(a, &l("p\"0"));
        assert!(one.contains("x_total{node=\"n1\",pod=\"p\\\"0\",c=\"a\"} 1\n"), "{one}");
        assert!(one.contains("up{node=\"n1\",pod=\"p\\\"0\"} 1\n"), "{one}");
        let m = merge(&[relabel(a, &l("a")), relabel(a, &l("b"))]);
        assert_eq!(m.matches("# TYPE x_total counter").count(), 1, "{m}");
        let x = m.find("x_total{node=\"n1\",pod=\"b\"").unwrap();
        assert!(x < m.find("# HELP up").unwrap(), "a family's samples stay together: {m}");
        assert_eq!(m.lines().filter(|l| l.starts_with("up{")).count(), 2);
    }

    #[test]
    fn labels_are_closed_and_the_histogram_is_cumulative() {
        assert_eq!(path_label(Some("/v1/chat/completions?api_key=x")), "/v1/chat/completions");
        assert_eq!(path_label(Some("/secret/user/123")), "other");
        assert_eq!(path_label(None), "other");
        let m = Metrics::default();
        m.request(StopCause::Eos, Some("/completion"), Some(0.3), 5);
        m.request(StopCause::ClientDisconnect, Some("/x"), Some(3.0), 2);
        let t = m.render();
        assert!(t.contains("probe_requests_total{stop_cause=\"eos\",path=\"/completion\"} 1"), "{t}");
        assert!(t.contains("probe_requests_total{stop_cause=\"client_disconnect\",path=\"other\"} 1"), "{t}");
        assert!(t.contains("probe_ttft_seconds_bucket{le=\"0.25\"} 0\n"), "{t}");
        assert!(t.contains("probe_ttft_seconds_bucket{le=\"0.5\"} 1\n"), "{t}");
        assert!(t.contains("probe_ttft_seconds_bucket{le=\"5\"} 2\n"), "{t}");
        assert!(t.contains("probe_ttft_seconds_bucket{le=\"+Inf\"} 2\n"), "{t}");
        assert!(t.contains("probe_output_tokens_total 7\n"), "{t}");
        // Every sample line is `name{labels} value` with a finite number.
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let v = l.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok_and(f64::is_finite), "{l}");
        }
    }
}
