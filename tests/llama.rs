//! Request-stream tests against a real llama-server with a real model (SmolLM2-135M), traced by
//! the real probe. `cargo xtask test` builds both (scripts/llama.sh) and passes their paths in
//! LLAMA_SERVER and LLAMA_MODEL. One server is shared; each test traces it with its own probe
//! and finds its own requests by the client's local address.
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

mod common;
use common::{env_path, probe_bin, shared_llama_server};

/// One test at a time: the verdicts now see the CPUs (cpu_contention), and a control request
/// asserts a quiet box, so no other test's server, client or busy loop may run beside it.
static CPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn shared_cpus() -> std::sync::MutexGuard<'static, ()> {
    CPUS.lock().unwrap_or_else(|e| e.into_inner())
}

struct Server {
    child: Child,
    addr: SocketAddr,
}

/// llama-server -c 2048 -np 2: 1024 tokens per slot.
fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let (child, addr) = shared_llama_server(&["-c", "2048", "-np", "2", "-t", "1", "--seed", "42"]);
        Server { child, addr }
    })
}

/// A probe trace of the shared server, stopped with SIGINT.
struct Trace {
    child: Child,
    out: PathBuf,
    /// probe's stderr after "armed in".
    lines: std::sync::mpsc::Receiver<String>,
}

impl Trace {
    fn start(name: &str, extra: &[&str]) -> Trace {
        Trace::start_env(name, extra, &[])
    }

    fn start_env(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Trace {
        let s = server();
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let pid = s.child.id().to_string();
        let mut args = vec!["--pid", &pid, "--duration", "120s", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (child, lines, armed) = common::start_trace_env(&args, env);
        assert!(armed.contains("stream"), "the stream probe is not live: {armed}");
        Trace { child, out, lines }
    }

    fn stop(self) -> Value {
        self.stop_with_stderr().0
    }

    /// The report, and what probe printed to stderr after it armed.
    fn stop_with_stderr(mut self) -> (Value, String) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let st = self.child.wait().unwrap();
        assert_eq!(st.code(), Some(0), "probe exit");
        // The reader thread ends with probe's stderr.
        let stderr: Vec<String> = self.lines.iter().collect();
        (common::read_report(&self.out), stderr.join("\n"))
    }
}

/// The request this test made: the one whose peer is our socket's local address.
fn find(report: &Value, client: SocketAddr) -> Vec<&Value> {
    let reqs = report["requests"].as_array().unwrap();
    let mine: Vec<&Value> = reqs.iter().filter(|r| r["peer"] == client.to_string()).collect();
    assert!(!mine.is_empty(), "no request from {client} among {}", serde_json::to_string_pretty(reqs).unwrap());
    mine
}

fn send_request(mut s: &TcpStream, method: &str, path: &str, body: Option<&Value>) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
}

/// Read one response: (status, body bytes, and for SSE the time each content event arrived).
struct Response {
    status: u16,
    events: Vec<(Instant, Value)>,
    body: Vec<u8>,
    pending: Vec<u8>,
}

fn read_response(r: &mut BufReader<&TcpStream>, limit_events: Option<usize>) -> Response {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (mut chunked, mut length) = (false, None);
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        chunked |= l.starts_with("transfer-encoding:") && l.contains("chunked");
        if let Some(v) = l.strip_prefix("content-length:") {
            length = v.trim().parse::<usize>().ok();
        }
    }
    let mut resp = Response { status, events: Vec::new(), body: Vec::new(), pending: Vec::new() };
    if let Some(n) = length {
        resp.body.resize(n, 0);
        r.read_exact(&mut resp.body).unwrap();
        return resp;
    }
    assert!(chunked, "expected a chunked or sized response");
    read_chunks(r, &mut resp, limit_events);
    resp
}

/// Read chunks of an SSE response until its end, or until `limit_events` content events.
fn read_chunks(r: &mut BufReader<&TcpStream>, resp: &mut Response, limit_events: Option<usize>) {
    let mut line = String::new();
    let pending = &mut resp.pending;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let size = usize::from_str_radix(line.trim(), 16).unwrap();
        let mut data = vec![0; size + 2];
        r.read_exact(&mut data).unwrap();
        if size == 0 {
            return;
        }
        let now = Instant::now();
        pending.extend_from_slice(&data[..size]);
        resp.body.extend_from_slice(&data[..size]);
        while let Some(i) = pending.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = pending.drain(..i + 2).collect();
            let text = String::from_utf8_lossy(&ev);
            if let Some(d) = text.trim().strip_prefix("data: ")
                && let Ok(v) = serde_json::from_str::<Value>(d)
            {
                resp.events.push((now, v));
            }
        }
        if limit_events.is_some_and(|n| resp.events.iter().filter(|(_, v)| has_content(v)).count() >= n) {
            return;
        }
    }
}

fn has_content(v: &Value) -> bool {
    v["choices"][0]["delta"]["content"].as_str().is_some_and(|s| !s.is_empty())
        || (v["content"].as_str().is_some_and(|s| !s.is_empty()) && v.get("choices").is_none())
}

fn request_once(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> std::io::Result<(u16, Vec<u8>)> {
    let s = TcpStream::connect(addr)?;
    send_request(&s, method, path, body);
    let r = read_response(&mut BufReader::new(&s), None);
    Ok((r.status, r.body))
}

fn chat(max_tokens: u64, prompt: &str) -> Value {
    json!({"messages": [{"role": "user", "content": prompt}], "stream": true, "max_tokens": max_tokens, "seed": 1, "temperature": 0})
}

#[test]
fn streamed_chat_matches_the_server_and_the_client() {
    let _cpus = shared_cpus();
    let t = Trace::start("chat", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    let sent = Instant::now();
    send_request(&s, "POST", "/v1/chat/completions", Some(&chat(40, "Write one sentence about the sea.")));
    let resp = read_response(&mut BufReader::new(&s), None);
    // Who closed the connection first, as the client saw it: the server's FIN reads as the end
    // of the stream at once (llama-server may close after its answer); else the client closes
    // first, when it drops the socket.
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let server_closed = matches!(std::io::Read::read(&mut &s, &mut [0u8; 1]), Ok(0));
    drop(s);
    let r = t.stop();
    let q = find(&r, client)[0];
    let last = resp.events.iter().rev().find(|(_, v)| v["choices"][0]["finish_reason"].is_string()).expect("final chunk").1.clone();
    let timings = resp.events.iter().rev().find_map(|(_, v)| v.get("timings")).expect("timings").clone();
    let predicted = timings["predicted_n"].as_i64().unwrap();
    assert!((q["chunks"].as_i64().unwrap() - predicted).abs() <= 1, "chunks {} vs predicted_n {predicted}", q["chunks"]);
    assert_eq!(q["finish_reason"], last["choices"][0]["finish_reason"]);
    assert_eq!(q["status"], 200);
    assert_eq!(q["method"], "POST");
    assert_eq!(q["path"], "/v1/chat/completions");
    assert_eq!(q["max_tokens"], 40);
    assert_eq!(q["stream"], true);
    assert_eq!((q["content_complete"].clone(), q["transport_complete"].clone()), (json!(true), json!(true)), "{q}");
    // The connection's close, as the client saw it (and as the TCP table says): the request was
    // its last, so the close is this request's end.
    assert_eq!(q["closed_by"], if server_closed { "server" } else { "client" }, "{q}");
    let want = if last["choices"][0]["finish_reason"] == "length" { "requested_limit" } else { "eos" };
    assert_eq!(q["verdict"]["stop_cause"], want, "{q}");
    assert_eq!(q["server_timings"]["predicted_n"], predicted);
    let client_ttft = resp.events.iter().find(|(_, v)| has_content(v)).unwrap().0.duration_since(sent).as_secs_f64() * 1e3;
    let probe_ttft = q["ttft_ms"].as_f64().unwrap();
    assert!((client_ttft - probe_ttft).abs() < 5.0, "TTFT: client {client_ttft:.2} ms, probe {probe_ttft:.2} ms");
}

#[test]
fn max_tokens_8_stops_at_length_after_8_chunks() {
    let _cpus = shared_cpus();
    let t = Trace::start("len8", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&chat(8, "Write a long story about a dragon who learns to cook.")));
    let resp = read_response(&mut BufReader::new(&s), None);
    assert_eq!(resp.events.iter().filter(|(_, v)| has_content(v)).count(), 8);
    let r = t.stop();
    let q = find(&r, client)[0];
    assert_eq!(q["finish_reason"], "length");
    assert_eq!(q["chunks"], 8);
    assert_eq!(q["verdict"]["stop_cause"], "requested_limit");
    assert_eq!(q["done_marker"], true);
    assert_eq!(q["chunk_times_ms"].as_array().unwrap().len(), 8);
    assert!(q["chunk_gaps"]["max_ms"].as_f64().unwrap() >= q["chunk_gaps"]["p50_ms"].as_f64().unwrap());
}

#[test]
fn client_disconnect_after_5_chunks_is_closed_by_client() {
    let _cpus = shared_cpus();
    let t = Trace::start("cut", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    let mut body = chat(2000, "Tell a long story about a lighthouse keeper.");
    body["ignore_eos"] = json!(true);
    send_request(&s, "POST", "/v1/chat/completions", Some(&body));
    let resp = read_response(&mut BufReader::new(&s), Some(5));
    assert_eq!(resp.status, 200);
    // Open long enough for probe's lookup of the other end (a request in flight for 0.8 s, looked
    // for every 0.5 s): the client is this test process, no gateway.
    std::thread::sleep(Duration::from_millis(2000));
    drop(s);
    std::thread::sleep(Duration::from_millis(800));
    let r = t.stop();
    let q = find(&r, client)[0];
    assert_eq!(q["peer_process"]["pid"], std::process::id(), "{q}");
    let said = q["verdict"]["evidence"].to_string();
    assert!(said.contains(&format!("the client, {} (pid {}", q["peer_process"]["comm"].as_str().unwrap(), std::process::id())), "{said}");
    assert_eq!(q["closed_by"], "client", "{q}");
    assert_eq!((q["content_complete"].clone(), q["transport_complete"].clone()), (json!(false), json!(false)), "{q}");
    assert_eq!(q["verdict"]["stop_cause"], "client_disconnect", "{q}");
    assert!(q["finish_reason"].is_null(), "{q}");
    assert!(q["chunks"].as_u64().unwrap() >= 5, "{q}");
}

#[test]
fn native_completion_with_n_predict_stops_at_limit() {
    let _cpus = shared_cpus();
    let t = Trace::start("native", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(
        &s,
        "POST",
        "/completion",
        Some(&json!({"prompt": "The capital of France is", "n_predict": 6, "stream": true, "temperature": 0})),
    );
    let resp = read_response(&mut BufReader::new(&s), None);
    let fin = resp.events.iter().find(|(_, v)| v["stop"] == true).expect("final event").1.clone();
    let r = t.stop();
    let q = find(&r, client)[0];
    assert_eq!(q["stop_type"], fin["stop_type"]);
    assert_eq!(q["stop_type"], "limit");
    assert_eq!(q["max_tokens"], 6);
    assert_eq!(q["truncated"], fin["truncated"]);
    assert_eq!(q["server_timings"]["predicted_n"], fin["timings"]["predicted_n"]);
}

#[test]
fn concurrent_streams_and_keep_alive_requests_are_kept_apart() {
    let _cpus = shared_cpus();
    let t = Trace::start("apart", &[]);
    // Two concurrent streams with different lengths.
    let handles: Vec<_> = [5u64, 11]
        .into_iter()
        .map(|n| {
            std::thread::spawn(move || {
                let s = TcpStream::connect(server().addr).unwrap();
                let client = s.local_addr().unwrap();
                send_request(&s, "POST", "/v1/chat/completions", Some(&chat(n, "Write a long story about a dragon who learns to cook.")));
                let resp = read_response(&mut BufReader::new(&s), None);
                (n, client, resp.events.iter().filter(|(_, v)| has_content(v)).count())
            })
        })
        .collect();
    let streams: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Two non-streamed requests on one keep-alive connection.
    let s = TcpStream::connect(server().addr).unwrap();
    let ka = s.local_addr().unwrap();
    let mut reader = BufReader::new(&s);
    let mut usage = Vec::new();
    for n in [3u64, 7] {
        send_request(
            &s,
            "POST",
            "/v1/chat/completions",
            Some(&json!({"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": n, "temperature": 0})),
        );
        let resp = read_response(&mut reader, None);
        assert_eq!(resp.status, 200);
        let v: Value = serde_json::from_slice(&resp.body).unwrap();
        usage.push(v["usage"]["completion_tokens"].clone());
    }
    // Who closed first, as the client saw it (see streamed_chat_matches_the_server_and_the_client).
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let server_closed = matches!(reader.read(&mut [0u8; 1]), Ok(0));
    drop(reader);
    drop(s);
    let r = t.stop();
    for (n, client, seen) in streams {
        let q = find(&r, client);
        assert_eq!(q.len(), 1);
        assert_eq!(q[0]["max_tokens"], n);
        assert_eq!(q[0]["chunks"].as_u64().unwrap() as usize, seen, "{}", q[0]);
    }
    let q = find(&r, ka);
    assert_eq!(q.len(), 2, "two requests on one connection");
    assert_eq!((q[0]["max_tokens"].clone(), q[1]["max_tokens"].clone()), (json!(3), json!(7)));
    // The control: the client sent its second request on the connection the first answer left
    // open, so the first is "kept open"; the close belongs to the last request alone.
    assert_eq!(q[0]["closed_by"], "none", "{}", q[0]);
    // The last takes the close the client saw, once the TCP table has it closed (the server may
    // finish its side of the close after the trace stopped: then it is still "none").
    let conn = r["connections"].as_array().unwrap().iter().find(|c| c["peer"] == ka.to_string()).expect("the keep-alive connection");
    let want = if conn["closed_ms"].is_null() {
        "none"
    } else if server_closed {
        "server"
    } else {
        "client"
    };
    assert_eq!(q[1]["closed_by"], want, "{} / {conn}", q[1]);
    for (q, u) in q.iter().zip(&usage) {
        assert_eq!(q["stream"], false);
        assert_eq!(q["status"], 200);
        assert_eq!((q["content_complete"].clone(), q["transport_complete"].clone()), (json!(true), json!(true)), "{q}");
        assert_eq!(&q["usage"]["completion_tokens"], u);
    }
}

#[test]
fn non_streamed_and_rejected_requests_keep_their_status() {
    let _cpus = shared_cpus();
    let t = Trace::start("status", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let ok_client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})));
    let ok = read_response(&mut BufReader::new(&s), None);
    drop(s);
    // A prompt larger than the 1024-token slot context.
    let long = "lighthouse ".repeat(3000);
    let s = TcpStream::connect(server().addr).unwrap();
    let bad_client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&json!({"messages": [{"role": "user", "content": long}], "max_tokens": 4})));
    let bad = read_response(&mut BufReader::new(&s), None);
    drop(s);
    let r = t.stop();
    assert_eq!(ok.status, 200);
    assert_eq!(bad.status, 400, "{}", String::from_utf8_lossy(&bad.body));
    let q = find(&r, ok_client)[0];
    assert_eq!((q["status"].clone(), q["stream"].clone(), q["transport_complete"].clone()), (json!(200), json!(false), json!(true)));
    assert!(q["finish_reason"].is_string());
    let q = find(&r, bad_client)[0];
    assert_eq!(q["status"], 400);
    assert!(q["error"].is_object(), "{q}");
    assert_eq!(q["max_tokens"], 4, "max_tokens after a long body: {q}");
    // The refusal names the prompt's size and the slot's, as the server's own body says them.
    let said: Value = serde_json::from_slice(&bad.body).unwrap();
    let (n, ctx) = (said["error"]["n_prompt_tokens"].as_u64().unwrap(), said["error"]["n_ctx"].as_u64().unwrap());
    let evidence = q["verdict"]["evidence"].to_string();
    assert!(evidence.contains(&format!("its {n} tokens do not fit the slot's context of {ctx}")), "server said {said}; probe: {evidence}");
}

#[test]
fn prompt_text_stays_out_of_the_recording() {
    let _cpus = shared_cpus();
    let secret = "zebra-quartz-4711-lighthouse";
    let t = Trace::start("privacy", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&chat(6, &format!("Repeat this word: {secret}"))));
    let resp = read_response(&mut BufReader::new(&s), None);
    assert!(!resp.events.is_empty());
    drop(s);
    let out = t.out.clone();
    let r = t.stop();
    assert!(find(&r, client)[0]["chunks"].as_u64().unwrap() >= 1);
    // The bundle for an issue: no prompt text in it either.
    let bundle = out.with_extension("tar.gz");
    let st = Command::new(probe_bin()).arg("bundle").arg(&out).arg("-o").arg(&bundle).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let listing = Command::new("tar").arg("xzOf").arg(&bundle).output().unwrap();
    assert!(listing.status.success() && listing.stdout.len() > 1000);
    assert!(!listing.stdout.windows(secret.len()).any(|w| w == secret.as_bytes()), "prompt text in the bundle");
    for e in std::fs::read_dir(&out).unwrap() {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "prompt text in the recording");
        assert!(!bytes.windows(11).any(|w| w == b"\"content\":\""), "response text in the recording");
    }
}

#[test]
fn attaching_mid_stream_marks_the_request_partly_seen() {
    let _cpus = shared_cpus();
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&chat(60, "Write a long story about a dragon who learns to cook.")));
    let mut reader = BufReader::new(&s);
    let mut resp = read_response(&mut reader, Some(3));
    let before = resp.events.iter().filter(|(_, v)| has_content(v)).count();
    let t = Trace::start("midstream", &[]);
    read_chunks(&mut reader, &mut resp, None);
    let total = resp.events.iter().filter(|(_, v)| has_content(v)).count();
    let fin = resp.events.iter().rev().find_map(|(_, v)| v["choices"][0]["finish_reason"].as_str().map(String::from)).unwrap();
    drop(reader);
    drop(s);
    let r = t.stop();
    let q = find(&r, client)[0];
    assert_eq!(q["partial"], true, "{q}");
    assert_eq!((q["content_complete"].clone(), q["transport_complete"].clone()), (json!(true), json!(true)), "{q}");
    assert_eq!(q["finish_reason"], fin.as_str());
    let seen = q["chunks"].as_u64().unwrap() as usize;
    // Chunks sent while probe was still attaching (~100 ms, ~10 tokens here) are not seen.
    assert!(seen <= total - before && seen * 2 >= total - before, "probe saw {seen} of the {} chunks after attach", total - before);
    // Found by the kernel's TCP state at attach, named from its response; its first tokens came
    // before attach, so it has no TTFT (the new rule: null only where the first token was not seen).
    assert_eq!(q["arrival_by"], "tcp_state", "{q}");
    assert_eq!((q["path"].as_str(), q["path_inferred"].as_bool()), (Some("/v1/chat/completions"), Some(true)), "{q}");
    assert_eq!(q["arrival_by"], "tcp_state", "the request was in flight at attach: {q}");
    assert!(q["ttft_ms"].is_null(), "no TTFT when the first token came before attach: {q}");
}

/// A llama-server of the test's own (not the shared one), healthy, on a free loopback port.
fn own_server(model: &std::path::Path, args: &[&str]) -> (common::Killed, SocketAddr) {
    own_server_in(None, model, args)
}

/// A llama-server of its own, started inside the cgroup directory `cgroup` when given (it is
/// charged there from its first page).
fn own_server_in(cgroup: Option<&std::path::Path>, model: &std::path::Path, args: &[&str]) -> (common::Killed, SocketAddr) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut cmd = match cgroup {
        // The shell joins the group, then becomes the server (same pid).
        Some(cg) => {
            let mut c = Command::new("sh");
            c.args(["-c", "echo $$ > \"$0\" && exec \"$@\""]).arg(cg.join("cgroup.procs")).arg(env_path("LLAMA_SERVER"));
            c
        }
        None => Command::new(env_path("LLAMA_SERVER")),
    };
    cmd.arg("-m").arg(model).args(args).args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    let srv = common::spawn_owned(cmd.stdout(Stdio::null()).stderr(Stdio::null()));
    let t = Instant::now();
    while !matches!(request_once(addr, "GET", "/health", None), Ok((200, _))) {
        assert!(t.elapsed() < Duration::from_secs(60), "server not healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
    (srv, addr)
}

/// The slow morning request: llama-server unloads the model when idle (--sleep-idle-seconds);
/// with the model file dropped from the page cache, the next request reads it back from disk.
/// The report must name the model file, with the bytes read, and show the model mapped again.
#[test]
fn cold_model_reload_is_named_in_the_report() {
    let _cpus = shared_cpus();
    // A copy of the model that no other server maps (a mapped file cannot be evicted).
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cold-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.gguf");
    std::fs::copy(env_path("LLAMA_MODEL"), &model).unwrap();
    // Written pages are dirty and DONTNEED leaves dirty pages in the cache: write them out.
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    let (mut srv, addr) = own_server(&model, &["-c", "1024", "-np", "1", "--no-repack", "--sleep-idle-seconds", "1"]);
    let (st, _) = request_once(addr, "POST", "/completion", Some(&json!({"prompt": "Hello", "n_predict": 2}))).unwrap();
    assert_eq!(st, 200);
    // Let it fall asleep, then drop the model from the page cache.
    common::sleep_then_evict(addr, &model);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-cold-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut p = Command::new(probe_bin())
        .args(["trace", "--pid", &srv.id().to_string(), "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !out.join("events.bin").exists() {
        assert!(t.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    // Each answer is whole (not streamed): the client's clock from send to answer is its TTFT.
    let t = Instant::now();
    let (st, _) = request_once(addr, "POST", "/completion", Some(&json!({"prompt": "Good morning", "n_predict": 2}))).unwrap();
    let cold_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(st, 200);
    // The warm control: the same request again, model resident.
    let t = Instant::now();
    let (st, _) = request_once(addr, "POST", "/completion", Some(&json!({"prompt": "Good morning", "n_predict": 2}))).unwrap();
    let warm_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(st, 200);
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    assert!(p.wait().unwrap().success());
    let _ = srv.kill();
    let _ = srv.wait();
    let r: Value = common::read_report(&out);
    let size = std::fs::metadata(&model).unwrap().len();
    let files = r["files"].as_array().unwrap();
    let top = &files[0];
    assert_eq!(top["path"], model.to_str().unwrap(), "the model is not the largest file read: {files:?}");
    assert!(top["read_bytes"].as_u64().unwrap() >= size / 2, "read {} of {size} bytes", top["read_bytes"]);
    assert!(r["blockio"]["read_bytes"].as_u64().unwrap() >= size / 2);
    assert!(
        r["mmaps"].as_array().unwrap().iter().any(|m| m["op"] == "mmap" && m["path"] == model.to_str().unwrap()),
        "model mmap not named"
    );
    let reqs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/completion").collect();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    // The cold one: its TTFT is model load and disk, and the verdict names the model file.
    let (cold, warm) = (reqs[0], reqs[1]);
    let v = &cold["verdict"];
    let ttft = cold["ttft_ms"].as_f64().unwrap();
    let split = &v["ttft_ms"];
    assert!(["load", "disk"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    assert!(split["load"].as_f64().unwrap() + split["disk"].as_f64().unwrap() >= 0.5 * ttft, "{v}");
    assert!(v["evidence"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().contains(model.to_str().unwrap())), "{v}");
    assert_eq!(v["stop_cause"], "requested_limit");
    // The warm control: no load, (almost) no disk.
    let w = &warm["verdict"];
    assert_eq!(w["ttft_ms"]["load"], 0.0, "{w}");
    assert!(w["ttft_ms"]["disk"].as_f64().unwrap() < 0.1 * warm["ttft_ms"].as_f64().unwrap(), "{w}");
    assert!(["none", "compute"].contains(&w["slow_cause"].as_str().unwrap()), "{w}");
    // `probe diff` of the recording: its slowest request against its warm baseline (the warm
    // one) names the model file and the load/disk time, within 10% of what the client's clock
    // says the morning cost; the off-CPU differential flamegraph is red on the reload's waits.
    let run = Command::new(probe_bin()).arg("diff").arg(&out).output().unwrap();
    let said = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "probe diff: {}{said}", String::from_utf8_lossy(&run.stderr));
    let d: Value = serde_json::from_slice(&std::fs::read(out.join("diff.json")).unwrap()).unwrap();
    assert_eq!(d["b"]["requests"], json!([cold["id"]]), "{}", d["b"]);
    assert_eq!(d["a"]["requests"], json!([warm["id"]]), "{}", d["a"]);
    assert!(["load", "disk"].contains(&d["explained_by"].as_str().unwrap_or("")), "{}", d["headline"]);
    let part = |p: &str| d["split"].as_array().unwrap().iter().find(|x| x["part"] == p).unwrap()["delta"].as_f64().unwrap();
    let (moved, client) = (part("load") + part("disk"), cold_ms - warm_ms);
    eprintln!("probe diff: load+disk {moved:+.0} ms; the client's clock {cold_ms:.0} - {warm_ms:.0} = {client:+.0} ms; {}", d["headline"]);
    // The truth's own spread: the warm request's time is in the client's difference, and a warm
    // request slowed by something else (72 ms against its usual 15-30, once in about 20 runs
    // here) moves that difference by as much.
    assert!(
        (moved - client).abs() <= 0.10 * client + warm_ms,
        "load+disk {moved:.0} ms against the client's {client:.0} ms (the warm request took {warm_ms:.0} ms)"
    );
    let headline = d["headline"].as_str().unwrap();
    assert!(headline.contains(model.to_str().unwrap()), "{headline}");
    assert!(said.contains(headline), "the summary does not lead with the headline: {said}");
    let file =
        d["files"].as_array().unwrap().iter().find(|f| f["path"] == model.to_str().unwrap()).expect("the model file among the files read");
    assert!(file["b_bytes"].as_f64().unwrap() >= size as f64 / 2.0 && file["a_bytes"].as_f64().unwrap() < 1e6, "{file}");
    let off = d["flames"].as_array().unwrap().iter().find(|f| f["kind"] == "offcpu").expect("an off-CPU differential flamegraph");
    // The reload's waits grew: the threads that waited for it (the HTTP thread in
    // wait_until_no_sleep, the workers on their condition variable), and the loader's IO wait
    // when the disk is slow enough to be more than noise (a disk behind the host's cache read the
    // 94 MiB in 43 ms here: 5% of the off-CPU total, under the share a frame must move by).
    let grew: Vec<&str> = off["grew"].as_array().unwrap().iter().map(|f| f["frame"].as_str().unwrap()).collect();
    assert!(!grew.is_empty(), "no off-CPU wait grew: {}", off["grew"]);
    let waits = ["[page-fault wait]", "[io wait]"];
    // inferno colours a stack's innermost frame by its change (flamegraph.pl's differential
    // rule): the frames inside the tower of each wait that grew must be red (more in B).
    let svg = std::fs::read_to_string(out.join(off["svg"].as_str().unwrap())).unwrap();
    let frames: Vec<(String, f64, f64, bool)> = svg
        .split("<g><title>")
        .skip(1)
        .map(|g| {
            let attr = |name: &str| g.split(&format!("{name}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or("");
            let pct = |v: &str| v.trim_end_matches('%').parse::<f64>().unwrap_or(-1.0);
            (g.split(" (").next().unwrap().to_string(), pct(attr("x")), pct(attr("width")), attr("fill").starts_with("rgb(255,"))
        })
        .collect();
    let unescape = |s: &str| s.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&").replace("&quot;", "\"");
    for wait in grew.iter().take(1).chain(grew.iter().filter(|f| waits.contains(f))) {
        let (_, x, w, _) = frames.iter().find(|f| unescape(&f.0) == *wait).unwrap_or_else(|| panic!("{wait} not drawn"));
        let red = frames.iter().any(|f| f.3 && f.1 >= x - 1e-6 && f.1 + f.2 <= x + w + 1e-6);
        assert!(red, "nothing inside {wait} is drawn red in {}", off["svg"]);
    }
    assert!(std::fs::read_to_string(out.join("diff.md")).unwrap().starts_with("## probe diff"));
}

/// The CPU flamegraph of a generating llama-server (release build, no frame pointers) names
/// llama.cpp/ggml functions, and the decoding thread's stacks are deep (unwound through DRAP
/// frames); a flamegraph can be cut to one request.
/// What `PROBE_COUNT_PASSES=1` makes probe print at exit: its whole passes over events.bin.
fn passes(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix("probe: passes over events.bin: "))
        .unwrap_or_else(|| panic!("no pass count in {stderr}"));
    line.trim().parse().unwrap()
}

#[test]
fn generation_flamegraph_names_ggml_functions() {
    let _cpus = shared_cpus();
    let t = Trace::start_env("flame", &["--no-poll"], &[("PROBE_COUNT_PASSES", "1")]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(
        &s,
        "POST",
        "/completion",
        Some(&json!({"prompt": "Write a long story about a dragon who learns to cook.", "n_predict": 200, "stream": true})),
    );
    let resp = read_response(&mut BufReader::new(&s), None);
    assert_eq!(resp.status, 200);
    drop(s);
    let out = t.out.clone();
    let (r, stderr) = t.stop_with_stderr();
    // One analysis for every output of the trace (report.json, report.html, flamegraphs): two
    // passes over the recording, not five.
    assert_eq!(passes(&stderr), 2, "{stderr}");
    let text = std::fs::read_to_string(out.join("flame-cpu.folded")).expect("cpu flamegraph");
    let stacks: Vec<(Vec<&str>, u64)> = text
        .lines()
        .map(|l| {
            let (s, n) = l.rsplit_once(' ').unwrap();
            (s.split(';').collect(), n.parse().unwrap())
        })
        .collect();
    let has = |name: &str| stacks.iter().any(|(s, _)| s.iter().any(|f| f.contains(name)));
    assert!(has("ggml_graph_compute"), "no ggml_graph_compute in {text}");
    assert!(has("llama_context::decode"), "no llama_context::decode in {text}");
    // Depth of the decoding thread's samples (the thread that calls llama_context::decode).
    let mut depths: Vec<usize> = stacks
        .iter()
        .filter(|(s, _)| s.iter().any(|f| f.contains("llama_context::decode")))
        .flat_map(|(s, n)| std::iter::repeat_n(s.len(), *n as usize))
        .collect();
    depths.sort_unstable();
    assert!(depths[depths.len() / 2] >= 8, "median depth {} of the decoding thread", depths[depths.len() / 2]);
    assert!(r["unwind"]["samples"].as_u64().unwrap() > 0);
    // Where cut stacks stop is named, by a function the server's binary defines (its symbol
    // table, read by nm: the truth), and the summary says it.
    let cpu = &r["stacks"]["cpu"];
    if cpu["complete"].as_u64() == cpu["stacks"].as_u64() {
        assert!(cpu.get("cut_under").is_none(), "no stack was cut, yet a cut frame is named: {cpu}");
    } else {
        let under = r["stacks"]["cpu"]["cut_under"][0]["frame"].as_str().unwrap_or_else(|| panic!("no cut_under: {}", r["stacks"]));
        let nm = Command::new("nm").args(["-C", "--defined-only"]).arg(env_path("LLAMA_SERVER")).output().unwrap();
        let libs = std::fs::read_dir(env_path("LLAMA_SERVER").parent().unwrap())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".so"));
        let mut symbols = String::from_utf8_lossy(&nm.stdout).to_string();
        for l in libs {
            let o = Command::new("nm").args(["-C", "--defined-only", "-D"]).arg(l.path()).output().unwrap();
            symbols.push_str(&String::from_utf8_lossy(&o.stdout));
        }
        assert!(symbols.contains(under), "cut stacks stop under `{under}`, which nm does not list");
        let summary = Command::new(probe_bin()).arg("report").arg(&out).output().unwrap();
        assert!(String::from_utf8_lossy(&summary.stdout).contains(&format!("cut cpu stacks stop under {under}")));
    }
    // One request's window.
    let id = find(&r, client)[0]["id"].as_u64().unwrap();
    let svg = out.join("request.svg");
    let st = Command::new(probe_bin())
        .env("PROBE_COUNT_PASSES", "1")
        .args(["flamegraph", "--kind", "cpu", "--request", &id.to_string(), "-o"])
        .arg(&svg)
        .arg(&out)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert!(passes(&String::from_utf8_lossy(&st.stderr)) <= 2, "{}", String::from_utf8_lossy(&st.stderr));
    let folded = std::fs::read_to_string(svg.with_extension("folded")).unwrap();
    assert!(folded.contains("ggml"), "{folded}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    // Its off-CPU graph keeps the threads on its path. The whole trace's graph is dominated by
    // the accept loop and the idle pool workers (waiting for work past any request's end); the
    // request's keeps only their waits that ended inside it (the accept of a poll's connection).
    let share = |folded: &str| {
        let (mut all, mut accept, mut idle) = (0u64, 0u64, 0u64);
        for l in folded.lines() {
            let Some(n) = l.rsplit_once(' ').and_then(|(_, n)| n.parse::<u64>().ok()) else { continue };
            all += n;
            accept += if l.contains("accept4") { n } else { 0 };
            idle += if l.contains("ThreadPool::worker") && !l.contains("process_and_close_socket") { n } else { 0 };
        }
        (accept as f64 / all.max(1) as f64, idle as f64 / all.max(1) as f64)
    };
    let whole = std::fs::read_to_string(out.join("flame-offcpu.folded")).expect("offcpu flamegraph");
    let (accept, idle) = share(&whole);
    assert!(accept + idle >= 0.2, "the trace's off-CPU graph is not the idle threads' ({accept:.2}, {idle:.2}): not the case checked");
    let off = out.join("request-offcpu.svg");
    let st = Command::new(probe_bin())
        .args(["flamegraph", "--kind", "offcpu", "--request", &id.to_string(), "-o"])
        .arg(&off)
        .arg(&out)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let folded = std::fs::read_to_string(off.with_extension("folded")).unwrap();
    let (accept, idle) = share(&folded);
    assert!(accept < 0.02 && idle < 0.02, "idle threads in the request's off-CPU graph: accept {accept:.3}, idle workers {idle:.3}");
    // Without -o, a request's graph gets its own name: the trace's whole graph stays as written.
    let whole_svg = std::fs::read(out.join("flame-offcpu.svg")).unwrap();
    let st = Command::new(probe_bin()).args(["flamegraph", "--kind", "offcpu", "--request", &id.to_string()]).arg(&out).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert!(out.join(format!("flame-offcpu-req{id}.svg")).is_file() && out.join(format!("flame-offcpu-req{id}.folded")).is_file());
    assert!(std::fs::read(out.join("flame-offcpu.svg")).unwrap() == whole_svg, "the trace's flame-offcpu.svg was replaced");
    // No thread waits longer than the request lasted.
    let q = find(&r, client)[0];
    let span_us = q["end_ms"].as_f64().unwrap() * 1e3;
    let threads = std::fs::read_dir(format!("/proc/{}/task", server().child.id())).unwrap().count() as f64;
    let weight: u64 = folded.lines().filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok()).sum();
    assert!((weight as f64) <= threads * span_us * 1.01, "{weight} µs of waits in a {span_us:.0} µs request");
    // Every command that reads a recording reads it at most twice.
    let bundle = out.with_extension("tar.gz");
    for args in [
        vec!["report", "--html"],
        vec!["report", "--json"],
        vec!["bundle", "--force", "-o", bundle.to_str().unwrap()],
        vec!["export", "--format", "pprof"],
        vec!["export", "--format", "otlp-json", "--force"],
        vec!["timeline"],
    ] {
        let st = Command::new(probe_bin()).env("PROBE_COUNT_PASSES", "1").args(&args).arg(&out).output().unwrap();
        let err = String::from_utf8_lossy(&st.stderr);
        assert!(st.status.code().is_some_and(|c| c <= 1), "probe {args:?}: {err}");
        assert!(passes(&err) <= 2, "probe {args:?} read the recording {} times", passes(&err));
    }
    let _ = std::fs::remove_file(&bundle);
    // The timeline has this request's track with its first token and tokens.
    let st = Command::new(probe_bin()).arg("timeline").arg(&out).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let tl: Value = serde_json::from_slice(&std::fs::read(out.join("timeline.json")).unwrap()).unwrap();
    let ev = tl["traceEvents"].as_array().unwrap();
    assert!(ev.iter().any(|e| e["pid"] == 1 && e["tid"] == id && e["name"] == "first token"));
    let chunks = find(&r, client)[0]["chunks"].as_u64().unwrap() as usize;
    assert_eq!(ev.iter().filter(|e| e["pid"] == 1 && e["tid"] == id && e["name"] == "token").count(), chunks - 1);
    // The server's thread lanes carry their names (llama-server names its threads, e.g. the
    // HTTP workers), not bare tids.
    let lanes: Vec<&str> = ev
        .iter()
        .filter(|e| e["name"] == "thread_name" && e["pid"].as_u64() == r["target"]["pid"].as_u64())
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(!lanes.is_empty() && lanes.iter().all(|l| !l.starts_with("thread ")), "thread lanes: {lanes:?}");
    assert!(lanes.iter().any(|l| l.starts_with("llama-server (")), "thread lanes: {lanes:?}");
}

/// A generation longer than the slot's context (-c 2048 -np 2: 1024 tokens a slot) stops at a
/// limit the server imposed, below the one requested.
#[test]
fn slot_context_limit_is_a_server_limit() {
    let _cpus = shared_cpus();
    let t = Trace::start("slotlimit", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(
        &s,
        "POST",
        "/completion",
        Some(&json!({"prompt": "Write a very long story.", "n_predict": 4000, "stream": true, "ignore_eos": true})),
    );
    let resp = read_response(&mut BufReader::new(&s), None);
    assert_eq!(resp.status, 200);
    drop(s);
    let r = t.stop();
    let q = find(&r, client)[0];
    assert!(q["chunks"].as_u64().unwrap() < 1100, "{q}");
    assert_eq!(q["verdict"]["stop_cause"], "server_limit", "{q}");
}

/// `-np 1` and four requests at once: the later ones wait in the server's queue.
#[test]
fn waiting_for_the_only_slot_is_queueing() {
    let _cpus = shared_cpus();
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "1024", "-np", "1"]);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-queue-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut p = Command::new(probe_bin())
        .args(["trace", "--pid", &srv.id().to_string(), "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while !out.join("events.bin").exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                request_once(addr, "POST", "/completion", Some(&json!({"prompt": "Tell a story.", "n_predict": 64, "ignore_eos": true})))
                    .unwrap()
                    .0
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 200);
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    assert!(p.wait().unwrap().success());
    let _ = srv.kill();
    let _ = srv.wait();
    let r: Value = common::read_report(&out);
    let reqs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/completion").collect();
    assert_eq!(reqs.len(), 4);
    let queued = reqs.iter().filter(|q| q["verdict"]["slow_cause"] == "queue").count();
    assert!(queued >= 2, "{}", serde_json::to_string_pretty(&reqs.iter().map(|q| &q["verdict"]).collect::<Vec<_>>()).unwrap());
    // The last served waited behind the three ahead: each is credited (under 10% unexplained).
    let last = reqs.iter().max_by(|a, b| a["ttft_ms"].as_f64().unwrap_or(0.0).total_cmp(&b["ttft_ms"].as_f64().unwrap_or(0.0))).unwrap();
    let (ttft, split) = (last["ttft_ms"].as_f64().unwrap(), &last["verdict"]["ttft_ms"]);
    eprintln!("the last of four: TTFT {ttft:.0} ms, queue {}, unexplained {}", split["queue"], split["unexplained"]);
    assert!(split["unexplained"].as_f64().unwrap() < 0.1 * ttft, "{}", last["verdict"]);
}

/// Start `probe trace` on `pid` writing to a fresh directory named `name`; returns once armed.
fn trace_pid(pid: u32, name: &str, env: &[(&str, &str)]) -> (Child, PathBuf) {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = Command::new(probe_bin());
    cmd.args(["trace", "--pid", &pid.to_string(), "--out"]).arg(&out).stdout(Stdio::null()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("armed in") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "probe exited before arming");
        assert!(!line.contains("error"), "{line}");
    }
    // The rest of its log, beside the output, for a failure to show.
    let mut log = std::fs::File::create(stderr_log(&out)).unwrap();
    std::thread::spawn(move || std::io::copy(&mut err, &mut log));
    (child, out)
}

fn stderr_log(out: &std::path::Path) -> PathBuf {
    out.with_extension("stderr")
}

fn stop_trace(mut p: Child, out: &std::path::Path) -> Value {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    let st = p.wait().unwrap();
    if !st.success() {
        // The copying thread sees the pipe close when probe is gone; give it a moment to write.
        std::thread::sleep(Duration::from_millis(200));
        panic!("probe trace ended with {st}; its log after arming:\n{}", std::fs::read_to_string(stderr_log(out)).unwrap_or_default());
    }
    common::read_report(out)
}

/// A GPU whose SM clock is low (P8) when a request arrives and ramps about 100 ms later: the verdict
/// gives that time to power, with the clock in its evidence; once clocks are up, power is 0.
/// These machines have no GPU, so the GPU is the scripted source behind the same trait as NVML
/// (PROBE_FAKE_GPU); everything else (server, request, probes, report) is real.
#[test]
fn low_gpu_clock_at_arrival_is_power() {
    let _cpus = shared_cpus();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let script = dir.join(format!("fake-gpu-{}.json", std::process::id()));
    let low = json!({"index": 0, "sm_mhz": 210, "mem_mhz": 405, "pstate": 8, "power_w": 30.0, "util_gpu": 0, "reasons": ["gpu_idle"]});
    let high = json!({"index": 0, "sm_mhz": 1980, "mem_mhz": 2619, "pstate": 0, "power_w": 300.0, "util_gpu": 95});
    let dev = json!({"index": 0, "name": "Scripted GPU", "uuid": "GPU-test", "driver": "test", "max_sm_mhz": 1980, "max_mem_mhz": 2619});
    let spec = json!({"devices": [dev], "samples": [{"after_ms": 0, "gpus": [low]}, {"after_ms": 1100, "gpus": [high]}]});
    std::fs::write(&script, spec.to_string()).unwrap();
    let (p, out) = trace_pid(server().child.id(), "power", &[("PROBE_FAKE_GPU", script.to_str().unwrap())]);
    let armed = Instant::now();
    std::thread::sleep(Duration::from_millis(1000).saturating_sub(armed.elapsed()));
    // A long prompt: prefill takes a few hundred ms here.
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/completion", Some(&json!({"prompt": prompt, "n_predict": 16, "stream": true, "cache_prompt": false})));
    assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
    drop(s);
    std::thread::sleep(Duration::from_millis(300));
    let s2 = TcpStream::connect(server().addr).unwrap();
    let warm = s2.local_addr().unwrap();
    send_request(&s2, "POST", "/completion", Some(&json!({"prompt": prompt, "n_predict": 4, "stream": true, "cache_prompt": false})));
    assert_eq!(read_response(&mut BufReader::new(&s2), None).status, 200);
    drop(s2);
    let r = stop_trace(p, &out);
    assert_eq!(r["system"]["gpu"]["devices"][0]["name"], "Scripted GPU");
    assert!(r["system"]["gpu"]["samples"].as_u64().unwrap() >= 10, "{}", r["system"]["gpu"]);
    let q = find(&r, client)[0];
    let v = &q["verdict"];
    let power = v["ttft_ms"]["power"].as_f64().unwrap();
    assert!(power >= 50.0 && power <= q["ttft_ms"].as_f64().unwrap(), "{q}");
    assert!(
        v["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("GPU 0 SM clock at 11%") && e.as_str().unwrap().contains("P8")),
        "{v}"
    );
    let w = &find(&r, warm)[0]["verdict"];
    assert_eq!(w["ttft_ms"]["power"], 0.0, "{w}");
    // The server's own view came from its endpoints; probe's polls (of any probe instance
    // tracing this shared server) are not among its requests.
    let srv = &r["system"]["server"][0];
    assert_eq!(
        (srv["kind"].as_str(), srv["n_ctx_slot"].as_u64(), srv["total_slots"].as_u64()),
        (Some("llama.cpp"), Some(1024), Some(2)),
        "{srv}"
    );
    assert!(r["probe_polls"].as_u64().unwrap() >= 2, "{}", r["probe_polls"]);
    let reqs = r["requests"].as_array().unwrap();
    assert!(reqs.iter().all(|q| q["path"] != "/props" && q["path"] != "/metrics"), "{reqs:?}");
    assert!(r["system"]["model_files"][0]["resident_end"].as_f64().unwrap() > 0.9, "{}", r["system"]["model_files"]);
}

/// nginx in front with `proxy_read_timeout 2s`; the server is paused (SIGSTOP) mid-stream. The
/// gateway gives up after 2 s without a byte: the verdict says deadline, with the idle time.
#[test]
fn gateway_timeout_is_a_deadline() {
    let _cpus = shared_cpus();
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "1024", "-np", "1", "-t", "1"]);
    let gw = common::Nginx::start(addr, 2);
    let (gw_addr, gw_pid) = (gw.addr, gw.pid());
    let (p, out) = trace_pid(srv.id(), "gateway", &[]);
    let s = TcpStream::connect(gw_addr).unwrap();
    send_request(
        &s,
        "POST",
        "/completion",
        Some(&json!({"prompt": "Tell a long story.", "n_predict": 2000, "stream": true, "ignore_eos": true})),
    );
    let mut rd = BufReader::new(&s);
    let resp = read_response(&mut rd, Some(5));
    assert_eq!(resp.status, 200);
    // SAFETY: signalling our own child: pause the server mid-stream, resume after the gateway gave up.
    unsafe { libc::kill(srv.id() as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(3500));
    unsafe { libc::kill(srv.id() as i32, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(1000));
    drop(rd);
    drop(s);
    let r = stop_trace(p, &out);
    drop(gw);
    let _ = srv.kill();
    let _ = srv.wait();
    let reqs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/completion").collect();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    let v = &reqs[0]["verdict"];
    assert_eq!(v["stop_cause"], "deadline", "{}", reqs[0]);
    let why = v["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find(|e| e.contains("without a chunk"))
        .unwrap_or_else(|| panic!("{v}"))
        .to_string();
    let secs: f64 = why.split("after ").nth(1).and_then(|x| x.split(' ').next()).and_then(|x| x.parse().ok()).unwrap();
    assert!((1.5..3.5).contains(&secs), "idle {secs} s: {why}");
    // The gateway is named: the owner of the connection's other end (the kernel's word, checked
    // against the pid we started), and what keeps the stream open on this server.
    assert!(why.contains(&format!("nginx (pid {gw_pid}, ")), "{why}");
    assert_eq!(reqs[0]["peer_process"]["pid"], gw_pid, "{}", reqs[0]);
    assert!(reqs[0]["peer_process"]["exe"].as_str().is_some_and(|e| e.ends_with("/nginx")), "{}", reqs[0]);
    assert!(v["evidence"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().contains("--sse-ping-interval")), "{v}");
}

/// The server in a memory cgroup (v1) limited below the model size: decode faults the model back
/// in, so the request's TTFT has disk and memory shares, the cgroup reclaims, and the report counts
/// major faults on the model file.
#[test]
fn memory_cgroup_squeeze_is_disk_and_memory() {
    memcg_case(false);
}

/// The model's pages thrash in the tight memory cgroup while a compile runs on the same cores
/// (gcc in a loop, outside the cgroup): the stalls are disk, memory and the wait for a CPU,
/// never the server's own compute. Truth: the server's major faults (/proc/PID/stat) and its
/// threads' run-queue time (schedstat) both grew while the request was served.
#[test]
fn memory_thrash_under_a_compile_is_not_compute() {
    memcg_case(true);
}

fn memcg_case(compile: bool) {
    let _cpus = shared_cpus();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("memcg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.gguf");
    std::fs::copy(env_path("LLAMA_MODEL"), &model).unwrap();
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    {
        let f = std::fs::File::open(&model).unwrap();
        // SAFETY: valid fd; nobody maps this private copy yet.
        unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    let cg = PathBuf::from(format!("/sys/fs/cgroup/memory/probe-test-{}", std::process::id()));
    assert!(std::path::Path::new("/sys/fs/cgroup/memory").exists(), "no cgroup v1 memory controller at /sys/fs/cgroup/memory");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("memory.limit_in_bytes"), (80u64 << 20).to_string()).unwrap();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {} -m {} -c 512 -np 1 --no-repack -t 1 --host 127.0.0.1 --port {port}",
        cg.display(),
        env_path("LLAMA_SERVER").display(),
        model.display()
    );
    let mut srv = common::spawn_owned(Command::new("sh").args(["-c", &script]).stdout(Stdio::null()).stderr(Stdio::null()));
    let t = Instant::now();
    while !matches!(request_once(addr, "GET", "/health", None), Ok((200, _))) {
        assert!(t.elapsed() < Duration::from_secs(60), "server in the cgroup did not become healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The compile: gcc -O2 over a generated C file, again and again, on both cores.
    let mut cc: Vec<common::KilledGroup> = Vec::new();
    if compile {
        let src = dir.join("big.c");
        let body: String = (0..400)
            .map(|i| format!("int f{i}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += k * {i} % 7; return s; }}\n"))
            .collect();
        std::fs::write(&src, body).unwrap();
        let lp = format!("while :; do cc -O2 -c -o /dev/null {}; done", src.display());
        let run = || common::KilledGroup::spawn(Command::new("sh").args(["-c", &lp]).stdout(Stdio::null()).stderr(Stdio::null()));
        cc = (0..2).map(|_| run()).collect();
        std::thread::sleep(Duration::from_millis(500));
    }
    let pid = srv.id();
    let majflt = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap()
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .nth(9)
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let runq = || schedstat(pid).iter().map(|t| t.1).sum::<u64>();
    let (p, out) = trace_pid(srv.id(), "memcg", &[]);
    let (f0, q0) = (majflt(), runq());
    let s = TcpStream::connect(addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/completion", Some(&json!({"prompt": "Hello there", "n_predict": 4, "stream": true})));
    assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
    drop(s);
    let (faults, waited) = (majflt() - f0, (runq() - q0) as f64 / 1e6);
    // The loops' shells and the compilers they run: their process groups.
    drop(cc);
    let r = stop_trace(p, &out);
    let _ = srv.kill();
    let _ = srv.wait();
    let _ = std::fs::remove_dir(&cg);
    // Its disk share rests on off-CPU stacks classified by kernel symbols: the same report
    // without kallsyms (another user, another boot, another machine).
    common::assert_report_is_the_same_offline(&out);
    let q = find(&r, client)[0];
    let v = &q["verdict"];
    let split = &v["ttft_ms"];
    let (disk, memory) = (split["disk"].as_f64().unwrap(), split["memory"].as_f64().unwrap());
    eprintln!("{faults} major faults, {waited:.0} ms in the run queue (kernel); verdict {v}");
    assert!(faults > 0, "the model did not thrash: not the case this test is about");
    assert!(disk > 0.0 && memory > 0.0, "{v}");
    if compile {
        let ttft = q["ttft_ms"].as_f64().unwrap();
        let stalls = disk + memory + split["cpu_contention"].as_f64().unwrap();
        assert!(["disk", "memory", "cpu_contention"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
        assert!(stalls >= 0.5 * ttft && split["compute"].as_f64().unwrap() < 0.5 * ttft, "{v}");
        assert!(waited > 0.0, "the compile never held the server's CPU: not the case this test is about");
    } else {
        assert!(["disk", "memory"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    }
    let m = &r["system"]["memory"];
    assert!(m["memcg_reclaim"]["count"].as_u64().unwrap() > 0, "{m}");
    assert_eq!(m["cgroup_limit"], 80u64 << 20, "{m}");
    let f =
        r["files"].as_array().unwrap().iter().find(|f| f["path"] == model.to_str().unwrap()).unwrap_or_else(|| panic!("{}", r["files"]));
    assert!(f["major_faults"].as_u64().unwrap() >= 5, "{f}");
}

/// A long prompt makes llama.cpp's last message bigger than one capture (it echoes the prompt
/// and settings before `stop_type` and `timings`): the kernel sends that write's last bytes too,
/// so the stop reason and the server's timings are still read, streamed or not.
#[test]
fn long_prompt_keeps_its_stop_reason() {
    let _cpus = shared_cpus();
    let t = Trace::start("longprompt", &[]);
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(80);
    let mut clients = Vec::new();
    for stream in [true, false] {
        let s = TcpStream::connect(server().addr).unwrap();
        clients.push((s.local_addr().unwrap(), stream));
        send_request(&s, "POST", "/completion", Some(&json!({"prompt": prompt, "n_predict": 8, "stream": stream, "ignore_eos": true})));
        let resp = read_response(&mut BufReader::new(&s), None);
        assert_eq!(resp.status, 200);
        if !stream {
            assert!(resp.body.len() > 4095, "the response fits one capture ({} bytes): the test needs a longer prompt", resp.body.len());
        }
    }
    let r = t.stop();
    for (client, stream) in clients {
        let q = find(&r, client)[0];
        assert_eq!(q["stop_type"], "limit", "stream={stream}: {q}");
        let t = &q["server_timings"];
        assert!(t["prompt_n"].as_u64().unwrap() + t["cache_n"].as_u64().unwrap() > 300, "stream={stream}: {q}");
        // The prompt cache as the server counted it, in the verdict's words.
        let cache = format!("{} prompt tokens computed, {} reused from the server's prompt cache", t["prompt_n"], t["cache_n"]);
        assert!(q["verdict"]["evidence"].as_array().unwrap().iter().any(|e| e == &Value::String(cache.clone())), "{cache}: {q}");
        assert_eq!(q["verdict"]["stop_cause"], "requested_limit", "stream={stream}: {q}");
        assert!(q["response_bytes"].as_u64().unwrap() > 4095, "{q}");
    }
}

/// (tid, time waiting on a run queue, time running) of every thread of `pid`, ns
/// (/proc/PID/task/TID/schedstat: the kernel's own count, the truth here).
fn schedstat(pid: u32) -> Vec<(u32, u64, u64)> {
    let mut v = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(tid) = t.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else { continue };
        let f: Vec<u64> = s.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        if f.len() >= 2 {
            v.push((tid, f[1], f[0]));
        }
    }
    v
}

/// Truth from schedstat snapshots taken around a request: each thread's (tid, run-queue ns, run
/// ns) growth, the most running first, and the run-queue ms of the `workers` busiest threads (the
/// ones doing the request's work): the largest and the sum.
fn run_queue_grew(before: &[(u32, u64, u64)], after: &[(u32, u64, u64)], workers: u32) -> (Vec<(u32, u64, u64)>, f64, f64) {
    let mut grew: Vec<(u32, u64, u64)> =
        after.iter().filter_map(|&(t, q, run)| before.iter().find(|b| b.0 == t).map(|b| (t, q - b.1, run - b.2))).collect();
    grew.sort_by_key(|x| std::cmp::Reverse(x.2));
    let busy = &grew[..workers as usize];
    let busiest = busy.iter().map(|w| w.1).max().unwrap() as f64 / 1e6;
    let sum = busy.iter().map(|w| w.1).sum::<u64>() as f64 / 1e6;
    (grew, busiest, sum)
}

/// Another job holds both CPUs while a request is served: its first token waits for a CPU.
/// The verdict says `cpu_contention`, its time agrees with the run-queue wait the kernel counted
/// for the thread doing the work (schedstat, within 15% or 50 ms), and the competitors are named
/// by their command. The same server, traced the same way, without the job: no contention.
#[test]
fn a_cpu_hog_is_cpu_contention_and_named() {
    cpu_hog_case(Some(1));
}

/// The same with two worker threads, which block and are woken between the steps of the prompt
/// (ggml's thread pool): the wait after each wake-up counts too (sched_wakeup). The request waits
/// when either thread waits, so the union lies between the busiest thread's run-queue wait and the
/// sum over both (schedstat, with the same tolerance).
#[test]
fn a_cpu_hog_with_two_worker_threads_counts_their_wakeups() {
    cpu_hog_case(Some(2));
}

/// The server's own choice of threads (no `-t`: llama.cpp takes the cores it finds).
#[test]
fn a_cpu_hog_with_the_default_threads_is_cpu_contention() {
    cpu_hog_case(None);
}

/// A 250-token chat prompt, computed in full (no prompt cache), 4 tokens out, not streamed: a
/// request whose first token is mostly prompt work. The client's address.
fn story_request(addr: SocketAddr) -> SocketAddr {
    story_request_as(addr, false)
}

/// The same, streamed or not.
fn story_request_as(addr: SocketAddr, stream: bool) -> SocketAddr {
    let body = json!({
        "messages": [{"role": "user", "content": "Tell me a long story about a cat and a dog. ".repeat(25)}],
        "max_tokens": 4, "cache_prompt": false, "stream": stream,
    });
    let s = TcpStream::connect(addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", "/v1/chat/completions", Some(&body));
    assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
    client
}

fn cpu_hog_case(threads: Option<u32>) {
    let _cpus = shared_cpus();
    let mut args = vec!["-c".to_string(), "2048".into(), "-np".into(), "1".into()];
    args.extend(threads.iter().flat_map(|t| ["-t".to_string(), t.to_string()]));
    let (srv, addr) = own_server(&env_path("LLAMA_MODEL"), &args.iter().map(String::as_str).collect::<Vec<_>>());
    let pid = srv.id();
    let ask = |_: u32| story_request(addr);
    ask(0); // warm: the model is loaded and paged in
    hog_case(pid, &format!("cpuhog-{}", threads.map_or("default".into(), |t| t.to_string())), threads, ask, true);
    drop(srv);
}

/// probe started after the request was sent, on a server with its default threads, beside the
/// same job: the part watched after attach that waited for a CPU is cpu_contention, within the
/// tolerance of the run-queue wait schedstat counted for the workers from the moment probe armed
/// to the answer; the part before attach is its own. The control (the same request, no job,
/// probe again started after it was sent) has no contention and no slow cause but none/compute.
#[test]
fn a_cpu_hog_at_attach_is_cpu_contention_with_default_threads() {
    let _cpus = shared_cpus();
    let (srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "2048", "-np", "1"]);
    let pid = srv.id();
    story_request(addr); // warm: the model is loaded and paged in
    let calm_before = schedstat(pid);
    story_request(addr);
    let (grew, _, _) = run_queue_grew(&calm_before, &schedstat(pid), 1);
    let workers = grew.iter().filter(|g| g.2 * 4 >= grew[0].2).count() as u32;
    // One request, probe attached 200 ms after it was sent; the truth from the moment probe armed.
    let case = |name: &str| {
        let (tx, rx) = std::sync::mpsc::channel();
        let asked = std::thread::spawn(move || {
            let client = story_request(addr);
            let _ = tx.send(Instant::now());
            client
        });
        std::thread::sleep(Duration::from_millis(200));
        let (p, out) = trace_pid(pid, name, &[]);
        let armed = Instant::now();
        let before = schedstat(pid);
        let answered = rx.recv_timeout(Duration::from_secs(120)).expect("no answer");
        let after = schedstat(pid);
        let client = asked.join().unwrap();
        assert!(armed < answered, "probe armed after the answer: the case did not happen");
        std::thread::sleep(Duration::from_millis(200));
        let r = stop_trace(p, &out);
        let q = find(&r, client)[0].clone();
        (q, run_queue_grew(&before, &after, workers), (answered - armed).as_secs_f64() * 1e3)
    };
    let hogs = common::Hog::start();
    std::thread::sleep(Duration::from_millis(300));
    let (q, (_, busiest, sum), watched_ms) = case("hog-at-attach");
    drop(hogs);
    let v = &q["verdict"];
    assert_eq!(q["arrival_by"], "tcp_state", "the request was in flight at attach: {q}");
    let cpu = v["ttft_ms"]["cpu_contention"].as_f64().unwrap_or(0.0);
    eprintln!(
        "at attach beside the job ({workers} workers): cpu_contention {cpu:.0} ms, schedstat after arming {busiest:.0}..{sum:.0} ms, {watched_ms:.0} ms watched; {}",
        v["ttft_ms"]
    );
    assert_eq!(v["slow_cause"], "cpu_contention", "{v}");
    common::assert_cpu_wait_agrees(cpu, busiest, sum, v);
    assert!(v["ttft_ms"]["before_attach"].as_f64().unwrap_or(0.0) > 0.0, "no part before attach: {v}");
    // The control: no job.
    let (q, (_, calm_busiest, calm_sum), _) = case("calm-at-attach");
    let v = &q["verdict"];
    let cpu = v["ttft_ms"]["cpu_contention"].as_f64().unwrap_or(0.0);
    eprintln!("control at attach: cpu_contention {cpu:.0} ms, schedstat {calm_busiest:.0}..{calm_sum:.0} ms; {}", v["ttft_ms"]);
    assert!(["none", "compute"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    // The request waits when any worker waits: at most the sum of theirs (as under the job).
    assert!(
        cpu <= calm_sum + (0.15 * calm_sum).max(50.0),
        "control: cpu_contention {cpu:.0} ms vs schedstat {calm_busiest:.0}..{calm_sum:.0} ms: {v}"
    );
    drop(srv);
}

/// The same job beside llama-cpp-python's server (two threads): a second server, its prompt timed
/// by the engine probe (no server timings). Each request's prompt differs in its first words (the
/// server reuses a prefix it computed before), the same size.
#[test]
fn a_cpu_hog_beside_llama_cpp_python_is_cpu_contention() {
    let _cpus = shared_cpus();
    let s = common::PyServer::start();
    let addr = s.addr;
    let ask = move |i: u32| {
        let words = ["Once", "Long ago", "Today", "Tonight"][i as usize % 4];
        let body = json!({
            "messages": [{"role": "user", "content": format!("{words}, tell me a long story about a cat and a dog. {}", "The cat and the dog were friends. ".repeat(24))}],
            "max_tokens": 4, "stream": false, "temperature": 0,
        });
        let c = TcpStream::connect(addr).unwrap();
        let client = c.local_addr().unwrap();
        send_request(&c, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(read_response(&mut BufReader::new(&c), None).status, 200);
        client
    };
    ask(3); // warm
    hog_case(s.child.id(), "cpuhog-python", Some(2), ask, false);
}

/// Trace `pid` through a calm request (`ask(1)`) and one under busy loops (`ask(2)`), and check
/// the verdicts against schedstat and the client's clock; `path`: check the critical path too
/// (llama-server's threads, whose hops the verdict names).
fn hog_case(pid: u32, name: &str, threads: Option<u32>, ask: impl Fn(u32) -> SocketAddr, path_checks: bool) {
    let (p, out) = trace_pid(pid, name, &[]);
    let calm_before = schedstat(pid);
    let t = Instant::now();
    let calm = ask(1);
    let calm_ms = t.elapsed().as_secs_f64() * 1e3;
    let calm_after = schedstat(pid);
    // The threads doing the work: as many as asked for, else those the server chose (each ran
    // at least a quarter of the busiest one's time for the calm request, by schedstat).
    let threads = threads.unwrap_or_else(|| {
        let (grew, _, _) = run_queue_grew(&calm_before, &calm_after, 1);
        let most = grew[0].2;
        let n = grew.iter().filter(|g| g.2 * 4 >= most).count() as u32;
        eprintln!("the server's own thread count: {n} threads worked ({grew:?})");
        n
    });
    // The job: busy loops under a name of their own, three for every CPU (common::Hog): the
    // server's threads get about a quarter of a core each, a slowdown no noisy machine hides.
    let hogs = common::Hog::start();
    std::thread::sleep(Duration::from_millis(300));
    let before = schedstat(pid);
    let t = Instant::now();
    let busy = ask(2);
    let busy_ms = t.elapsed().as_secs_f64() * 1e3;
    let after = schedstat(pid);
    let hog_pids = hogs.pids();
    drop(hogs);
    let r = stop_trace(p, &out);
    let (grew, busiest, sum) = run_queue_grew(&before, &after, threads);
    let q = find(&r, busy)[0];
    let v = &q["verdict"];
    let cpu = v["ttft_ms"]["cpu_contention"].as_f64().unwrap();
    eprintln!(
        "cpu_contention {cpu:.0} ms, schedstat run-queue wait of the workers: busiest {busiest:.0} ms, sum {sum:.0} ms; TTFT {:.0} ms",
        q["ttft_ms"]
    );
    assert_eq!(v["slow_cause"], "cpu_contention", "{v}");
    common::assert_cpu_wait_agrees(cpu, busiest, sum, v);
    let said = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).find(|e| e.contains("waiting for a CPU")).unwrap();
    assert!(hog_pids.iter().any(|h| said.contains(&format!("cpuhog (pid {h}"))), "the competitors are not named: {said}");
    if path_checks {
        critical_path_checks(v, &grew);
    }
    // Against the warm request of the same trace: the ratio the client's own clock saw (the
    // verdict names it from 1.5× on; the case needs the job to have slowed the request more).
    let clock = busy_ms / calm_ms;
    assert!(clock >= 1.7, "the job slowed the request only {clock:.2}× ({busy_ms:.0} / {calm_ms:.0} ms): the case did not happen");
    let warm = v["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find(|e| e.contains("× this server's warm TTFT"))
        .unwrap_or_else(|| panic!("{clock:.2}× the warm request by the client's clock, and no comparison with it: {v}"));
    let ratio: f64 = warm.split('×').next().unwrap().parse().unwrap();
    assert!((ratio - clock).abs() <= 0.15 * clock, "{warm} vs the client's {busy_ms:.0} / {calm_ms:.0} ms");
    // The control: same server, same request, no job beside it. Its wait for a CPU (probe's own
    // work, the kernel's threads) is what schedstat counted, with the same tolerance, and small.
    let (_, calm_busiest, calm_sum) = run_queue_grew(&calm_before, &calm_after, threads);
    let q = find(&r, calm)[0];
    let v = &q["verdict"];
    let ttft = q["ttft_ms"].as_f64().unwrap();
    let split = &v["ttft_ms"];
    let calm_cpu = split["cpu_contention"].as_f64().unwrap();
    eprintln!("control: cpu_contention {calm_cpu:.0} ms, schedstat {calm_busiest:.0}..{calm_sum:.0} ms; TTFT {ttft:.0} ms");
    assert!(["none", "compute"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    assert!(calm_busiest < 0.1 * ttft, "the control waited {calm_busiest:.0} ms for a CPU by schedstat: the machine was not idle");
    common::assert_cpu_wait_agrees(calm_cpu, calm_busiest, calm_sum, v);
    assert!(split["unexplained"].as_f64().unwrap() < 0.1 * ttft, "{v}");
    // Its thread waited on the server's working thread too, which ran: no stall to name unless
    // the kernel counted one (the verdict names a thread that stalled for 5% of the TTFT).
    if calm_sum < 0.04 * ttft {
        assert!(!v["evidence"].to_string().contains("on server thread"), "{v}");
    }
}

/// The scheduler's view: the critical path runs through the server's own threads, and its wait
/// for a CPU is what the kernel counted for the threads on it (schedstat growth `grew`).
fn critical_path_checks(v: &Value, grew: &[(u32, u64, u64)]) {
    let path = &v["critical_path"];
    let on_path: Vec<u64> = path["threads"].as_array().unwrap().iter().filter_map(|t| t["tid"].as_u64()).collect();
    let path_truth: Vec<f64> = grew.iter().filter(|g| on_path.contains(&u64::from(g.0))).map(|g| g.1 as f64 / 1e6).collect();
    let path_cpu = path["states"]["cpu_wait"].as_f64().unwrap();
    eprintln!("critical path {path}; schedstat run-queue wait of its threads: {path_truth:?}");
    assert!(!path_truth.is_empty() && path_truth.len() == on_path.len(), "the path's threads are the server's: {path} vs {grew:?}");
    assert!(
        path_cpu >= path_truth.iter().copied().fold(0.0, f64::max) * 0.85 - 50.0
            && path_cpu <= path_truth.iter().sum::<f64>() * 1.15 + 50.0,
        "critical path's wait for a CPU {path_cpu:.0} ms vs schedstat {path_truth:?}"
    );
    // ...and the evidence says which server thread the request's thread waited on, and that it
    // was waiting for a CPU meanwhile.
    let evidence: Vec<&str> = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    let hop = evidence.iter().find(|e| e.contains("on server thread ")).unwrap_or_else(|| panic!("no wait on a server thread: {v}"));
    assert!(hop.contains("waiting for a CPU"), "{hop}");
}

/// Bytes the process made the kernel read from storage (/proc/PID/io `read_bytes`, the truth).
fn read_bytes(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("read_bytes:")).unwrap().trim().parse().unwrap()
}

/// Woken from `--sleep-idle-seconds` with the model still in the page cache: the verdict says
/// `load`, not `none`. Nothing came from disk (the server's own /proc/PID/io), and the load is
/// most of what the morning request took over the warm one (the client's own clock).
#[test]
fn waking_from_sleep_with_the_model_cached_is_load() {
    sleep_case(&["-np", "1"], "/completion", &json!({"prompt": "Good morning", "n_predict": 2, "stream": false}));
}

/// The second setup: two slots and two threads, and a streamed chat request.
#[test]
fn waking_from_sleep_with_the_model_cached_is_load_for_a_streamed_chat() {
    let chat = json!({"messages": [{"role": "user", "content": "Good morning"}], "max_tokens": 2, "stream": true});
    sleep_case(&["-np", "2", "-t", "2"], "/v1/chat/completions", &chat);
}

fn sleep_case(args: &[&str], path: &str, body: &Value) {
    let _cpus = shared_cpus();
    let mut all = vec!["-c", "1024", "--sleep-idle-seconds", "1"];
    all.extend_from_slice(args);
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &all);
    let pid = srv.id();
    let ask = || {
        let t = Instant::now();
        let s = TcpStream::connect(addr).unwrap();
        let client = s.local_addr().unwrap();
        send_request(&s, "POST", path, Some(body));
        assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
        (client, t.elapsed().as_secs_f64() * 1e3)
    };
    ask();
    common::wait_asleep(addr);
    let (p, out) = trace_pid(pid, "wake", &[]);
    // The endpoint poller's first look at the server (asleep) lands before the request.
    std::thread::sleep(Duration::from_millis(1000));
    let io = read_bytes(pid);
    let (cold, cold_ms) = ask();
    let from_disk = read_bytes(pid) - io;
    let (warm, warm_ms) = ask();
    let r = stop_trace(p, &out);
    let _ = srv.kill();
    let _ = srv.wait();
    let q = find(&r, cold)[0];
    let v = &q["verdict"];
    let split = &v["ttft_ms"];
    let (load, disk) = (split["load"].as_f64().unwrap(), split["disk"].as_f64().unwrap());
    eprintln!("morning {cold_ms:.0} ms, warm {warm_ms:.0} ms (client); load {load:.0} ms; {from_disk} bytes read from storage");
    assert!(from_disk < 1 << 20, "the model was read from disk ({from_disk} bytes): not the case this test is about");
    assert_eq!(v["slow_cause"], "load", "{v}");
    assert!(load >= 0.5 * (cold_ms - warm_ms), "load {load:.0} ms of {cold_ms:.0} - {warm_ms:.0} ms: {v}");
    assert!(disk < 0.1 * q["ttft_ms"].as_f64().unwrap(), "{v}");
    let said: Vec<&str> = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(said.iter().any(|e| e.contains("from the page cache")), "{said:?}");
    let w = &find(&r, warm)[0]["verdict"];
    assert_eq!(w["ttft_ms"]["load"], 0.0, "{w}");
    assert!(["none", "compute"].contains(&w["slow_cause"].as_str().unwrap()), "{w}");
}

/// A CFS bandwidth limit on a cgroup (v1 `cpu` controller): `cpu.cfs_quota_us` of every
/// `cpu.cfs_period_us`. The group goes away (its processes back to the root) when dropped.
struct CpuQuota {
    dir: PathBuf,
}

impl CpuQuota {
    fn new(pid: u32) -> CpuQuota {
        let root = PathBuf::from("/sys/fs/cgroup/cpu");
        assert!(root.join("cpu.cfs_quota_us").exists(), "no cgroup v1 cpu controller with CFS bandwidth at {}", root.display());
        let dir = root.join(format!("probe-quota-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // cgroup.procs moves every thread of the process.
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        CpuQuota { dir }
    }

    fn limit(&self, quota_us: i64) {
        std::fs::write(self.dir.join("cpu.cfs_quota_us"), quota_us.to_string()).unwrap();
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        let root = self.dir.parent().unwrap().join("cgroup.procs");
        for p in std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default().lines() {
            let _ = std::fs::write(&root, p);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The server's cgroup gets a CPU quota of a quarter of a CPU: its first token waits for a CPU
/// with nobody else running. The verdict says `cpu_contention`, its time agrees with the
/// kernel's run-queue wait of the working thread (schedstat, 15% or 50 ms), and the quota is
/// said with its cpu.stat. The control, before the quota, in the same trace: none of it.
#[test]
fn a_cpu_quota_is_cpu_contention_and_said() {
    quota_case(1, false);
}

/// The second setup: two worker threads, and a streamed request. The truth is then between the
/// busiest worker's run-queue wait and the sum over the workers (as under a CPU hog).
#[test]
fn a_cpu_quota_on_two_worker_threads_and_a_stream_is_cpu_contention() {
    quota_case(2, true);
}

fn quota_case(threads: u32, stream: bool) {
    let _cpus = shared_cpus();
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "2048", "-np", "1", "-t", &threads.to_string()]);
    let pid = srv.id();
    let ask = || story_request_as(addr, stream);
    ask();
    let quota = CpuQuota::new(pid);
    let (p, out) = trace_pid(pid, "quota", &[]);
    let calm = ask();
    quota.limit(25_000);
    std::thread::sleep(Duration::from_millis(300));
    let before = schedstat(pid);
    let busy = ask();
    let after = schedstat(pid);
    quota.limit(-1);
    // The sampler's reading after the request.
    std::thread::sleep(Duration::from_millis(300));
    let r = stop_trace(p, &out);
    drop(quota);
    let _ = srv.kill();
    let _ = srv.wait();
    let (_, busiest, sum) = run_queue_grew(&before, &after, threads);
    let q = find(&r, busy)[0];
    let v = &q["verdict"];
    let cpu = v["ttft_ms"]["cpu_contention"].as_f64().unwrap();
    eprintln!(
        "cpu_contention {cpu:.0} ms, schedstat run-queue wait of the workers: busiest {busiest:.0}, sum {sum:.0} ms; TTFT {:.0} ms",
        q["ttft_ms"]
    );
    assert_eq!(v["slow_cause"], "cpu_contention", "{v}");
    common::assert_cpu_wait_agrees(cpu, busiest, sum, v);
    let said: Vec<&str> = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(said.iter().any(|e| e.contains("its CPU quota ran out")), "{said:?}");
    assert!(said.iter().any(|e| e.contains("CPU quota throttled it") && e.contains("0.25 CPU, 25000 of every 100000 µs")), "{said:?}");
    let v = &find(&r, calm)[0]["verdict"];
    assert!(["none", "compute"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    assert!(!v["evidence"].to_string().contains("quota"), "{v}");
}

/// A swap file, on for the life of the value (swapoff and removed when dropped).
struct SwapFile {
    path: PathBuf,
}

impl SwapFile {
    fn on(mib: u64) -> SwapFile {
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("swapfile-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let run = |cmd: &mut Command| assert!(cmd.status().unwrap().success(), "{cmd:?}");
        run(Command::new("fallocate").args(["-l", &format!("{mib}M")]).arg(&path));
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        run(Command::new("mkswap").arg(&path).stdout(Stdio::null()));
        run(Command::new("swapon").arg(&path));
        SwapFile { path }
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.path).status();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The server's own memory in swap (weights loaded into anonymous memory with `--load-mode none`,
/// then its memory cgroup squeezed with a swap file on): the next request faults it back in. The
/// verdict says `memory`, names the swap file, and the MiB it says came back agree with the
/// server's VmSwap (10%). The next request, with nothing left in swap, is the control.
#[test]
fn swapped_out_memory_is_memory_and_names_the_swap_file() {
    swap_case(&["-np", "1", "-t", "1"], "/completion", &json!({"prompt": "Hello there", "n_predict": 4, "stream": false}));
}

/// The second setup: two slots, two threads, and a streamed chat request.
#[test]
fn swapped_out_memory_under_a_streamed_chat_is_memory() {
    let chat = json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "stream": true});
    swap_case(&["-np", "2", "-t", "2"], "/v1/chat/completions", &chat);
}

fn swap_case(args: &[&str], path: &str, body: &Value) {
    let _cpus = shared_cpus();
    let swap = SwapFile::on(512);
    // A memory cgroup that prefers swap, the server charged to it from the start.
    let cg = PathBuf::from(format!("/sys/fs/cgroup/memory/probe-swap-{}", std::process::id()));
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("memory.swappiness"), "100").unwrap();
    let mut all = vec!["-c", "512", "--load-mode", "none"];
    all.extend_from_slice(args);
    // The model file read into the page cache from this (root) cgroup first: its pages are then
    // charged here, not to the server's cgroup, and the squeeze below swaps out the server's own
    // memory without also evicting the model (which would make the cold request disk as well,
    // e.g. right after a build pushed the model out of the cache).
    let model = env_path("LLAMA_MODEL");
    std::io::copy(&mut std::fs::File::open(&model).unwrap(), &mut std::io::sink()).unwrap();
    let (mut srv, addr) = own_server_in(Some(&cg), &model, &all);
    let pid = srv.id();
    let ask = || {
        let s = TcpStream::connect(addr).unwrap();
        let client = s.local_addr().unwrap();
        send_request(&s, "POST", path, Some(body));
        assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
        client
    };
    ask();
    let vm_swap = || {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines().find_map(|l| l.strip_prefix("VmSwap:")).unwrap().trim().trim_end_matches(" kB").trim().parse::<u64>().unwrap()
    };
    // Squeeze: the limit lowered below the server's use, then lifted (the pages stay in swap
    // until touched).
    let _ = std::fs::write(cg.join("memory.limit_in_bytes"), (24u64 << 20).to_string());
    std::fs::write(cg.join("memory.limit_in_bytes"), "-1").unwrap();
    let swapped = vm_swap();
    assert!(swapped >= 32 << 10, "only {swapped} KiB went to swap: not the case this test is about");
    let (p, out) = trace_pid(pid, "swap", &[]);
    std::thread::sleep(Duration::from_millis(1200));
    let before = vm_swap();
    let cold = ask();
    let after_cold = vm_swap();
    let back_kib = before.saturating_sub(after_cold);
    let warm = ask();
    let warm_back_kib = after_cold.saturating_sub(vm_swap());
    std::thread::sleep(Duration::from_millis(300));
    let r = stop_trace(p, &out);
    let _ = std::fs::write("/sys/fs/cgroup/memory/cgroup.procs", pid.to_string());
    let _ = srv.kill();
    let _ = srv.wait();
    let _ = std::fs::remove_dir(&cg);
    drop(swap);
    let q = find(&r, cold)[0];
    let v = &q["verdict"];
    eprintln!("{} KiB back from swap by VmSwap; verdict {v}", back_kib);
    assert_eq!(v["slow_cause"], "memory", "{v}");
    let said = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).find(|e| e.contains("back in from swap")).unwrap();
    assert!(said.contains("swapfile-"), "the swap file is not named: {said}");
    let mib: f64 = said.split(": ").nth(1).unwrap().split(" MiB").next().unwrap().parse().unwrap();
    let truth = back_kib as f64 / 1024.0;
    assert!((mib - truth).abs() <= 0.1 * truth, "{mib} MiB said, {truth:.1} MiB by VmSwap: {said}");
    assert!(!v["evidence"].to_string().contains("no file"), "{v}");
    let cold_memory = v["ttft_ms"]["memory"].as_f64().unwrap();
    let v = &find(&r, warm)[0]["verdict"];
    assert!(["none", "compute"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    // The control: by VmSwap the warm request faulted little or nothing back in (pages the cold
    // one did not touch may still come back: then a small memory part is the truth, not noise).
    let memory = v["ttft_ms"]["memory"].as_f64().unwrap();
    let ttft = find(&r, warm)[0]["ttft_ms"].as_f64().unwrap();
    assert!(warm_back_kib * 10 < back_kib, "the warm request swapped {warm_back_kib} KiB back in: not a control");
    if warm_back_kib == 0 {
        assert!(memory < 0.1 * ttft, "nothing came back from swap by VmSwap, yet {memory:.1} ms of memory: {v}");
    } else {
        assert!(
            memory < 0.1 * cold_memory,
            "{warm_back_kib} KiB back by VmSwap: {memory:.1} ms of memory against the cold request's {cold_memory:.1} ms: {v}"
        );
    }
}

/// One request, not streamed: the client's address and the server's answer (JSON).
fn ask_json(addr: SocketAddr, path: &str, body: &Value) -> (SocketAddr, Value) {
    let s = TcpStream::connect(addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(&s, "POST", path, Some(body));
    let resp = read_response(&mut BufReader::new(&s), None);
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    (client, serde_json::from_slice(&resp.body).unwrap())
}

/// `-np 1` without the host-memory prompt cache: a prompt asked again after another prompt took
/// the only slot is computed again. The verdict says its prompt cache was lost, naming the earlier
/// request and the tokens computed and reused exactly as the server's answer to the client gave
/// them (its `timings`), on the native and the OpenAI chat endpoint; the same prompt asked once
/// more, from the cache, is the control.
#[test]
fn a_lost_prompt_cache_names_the_recomputed_tokens() {
    let _cpus = shared_cpus();
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "2048", "-np", "1", "--cache-ram", "0"]);
    let (p, out) = trace_pid(srv.id(), "promptcache", &[]);
    let story = |what: &str| {
        format!("{} Please summarise the story in one line.", format!("Once upon a time a {what} lived by the sea. ").repeat(20))
    };
    let native = |what: &str| json!({"prompt": story(what), "n_predict": 2, "cache_prompt": true, "stream": false});
    let chat = |what: &str| json!({"messages": [{"role": "user", "content": story(what)}], "max_tokens": 2, "cache_prompt": true, "stream": false});
    let mut cases = Vec::new();
    for (path, body) in [("/completion", &native as &dyn Fn(&str) -> Value), ("/v1/chat/completions", &chat)] {
        let (first, _) = ask_json(addr, path, &body("cat"));
        ask_json(addr, path, &body("dog")); // takes the slot
        let (lost, t) = ask_json(addr, path, &body("cat"));
        let (kept, k) = ask_json(addr, path, &body("cat"));
        cases.push((path, first, lost, t["timings"].clone(), kept, k["timings"].clone()));
    }
    let r = stop_trace(p, &out);
    let _ = srv.kill();
    let _ = srv.wait();
    for (path, first, lost, t, kept, k) in cases {
        let id = find(&r, first)[0]["id"].as_u64().unwrap();
        let v = &find(&r, lost)[0]["verdict"];
        let said = v["evidence"].as_array().unwrap().iter().filter_map(Value::as_str).find(|e| e.contains("prompt cache was lost"));
        let said = said.unwrap_or_else(|| panic!("{path}: no lost cache said: {v}"));
        let (n, c) = (t["prompt_n"].as_u64().unwrap(), t["cache_n"].as_u64().unwrap());
        eprintln!("{path}: server timings prompt_n {n} cache_n {c}; {said}");
        assert!(n > 4 * c, "{path}: the server reused its cache ({t}): not the case this test is about");
        assert!(said.contains(&format!("request #{id} (")), "{path}: {said}");
        assert!(said.contains(&format!("{n} tokens were computed again and {c} reused")), "{path}: {said} vs the server's {t}");
        assert_eq!(v["slow_cause"], "prompt_cache", "{path}: {v}");
        let v = &find(&r, kept)[0]["verdict"];
        assert!(k["cache_n"].as_u64().unwrap() > k["prompt_n"].as_u64().unwrap(), "{path}: the control missed the cache: {k}");
        assert!(!v["evidence"].to_string().contains("was lost"), "{path}: {v}");
        assert_ne!(v["slow_cause"], "prompt_cache", "{path}: {v}");
    }
}

/// A prompt that fills a small context with context shift on: llama.cpp drops part of it to keep
/// generating and says `truncated: true` to the client. The verdict and the summary say the prompt
/// was cut; a short prompt on the same server is not.
#[test]
fn a_prompt_cut_by_the_context_is_said() {
    let _cpus = shared_cpus();
    let (mut srv, addr) = own_server(&env_path("LLAMA_MODEL"), &["-c", "256", "-np", "1", "--context-shift"]);
    let (p, out) = trace_pid(srv.id(), "promptcut", &[]);
    let long = json!({"prompt": "The cat sat on the mat. ".repeat(30), "n_predict": 120, "stream": false, "ignore_eos": true});
    let (cut, answer) = ask_json(addr, "/completion", &long);
    let (whole, short) = ask_json(addr, "/completion", &json!({"prompt": "Hello", "n_predict": 4, "stream": false}));
    let r = stop_trace(p, &out);
    let _ = srv.kill();
    let _ = srv.wait();
    assert_eq!(answer["truncated"], true, "the server did not cut it: {answer}");
    assert_eq!(short["truncated"], false, "{short}");
    let q = find(&r, cut)[0];
    assert_eq!(q["verdict"]["prompt_cut"], true, "{}", q["verdict"]);
    assert!(q["verdict"]["evidence"][0].as_str().unwrap().starts_with("prompt cut:"), "{}", q["verdict"]);
    let summary = Command::new(probe_bin()).arg("report").arg(&out).output().unwrap();
    let summary = String::from_utf8_lossy(&summary.stdout);
    assert!(summary.contains(&format!("#{} POST /completion", q["id"])) && summary.contains("prompt cut by the server"), "{summary}");
    assert!(find(&r, whole)[0]["verdict"].get("prompt_cut").is_none(), "{}", find(&r, whole)[0]["verdict"]);
}

/// probe on a front (nginx) that asks its runner (llama-server) for each answer: the front is the
/// client of that connection, and the runner closes it after its final message (nginx asks for
/// `Connection: close`). The front's record of the runner's answer stops at the runner's own
/// word, as the client saw it, and never reads as the runner closing before its final message.
#[test]
fn a_front_records_its_runners_complete_answers() {
    let _cpus = shared_cpus();
    let srv = server();
    let gw = common::Nginx::start(srv.addr, 30);
    let (p, out) = trace_pid(gw.pid(), "front", &[]);
    let mut saw = Vec::new();
    for (n, stream) in [(3u64, true), (5, false), (4, true)] {
        let body = json!({"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": n, "stream": stream, "temperature": 0});
        let s = TcpStream::connect(gw.addr).unwrap();
        send_request(&s, "POST", "/v1/chat/completions", Some(&body));
        let resp = read_response(&mut BufReader::new(&s), None);
        assert_eq!(resp.status, 200);
        // The client's own view of the stop: the last finish_reason it read.
        let finish = if stream {
            resp.events.iter().rev().find_map(|(_, e)| e["choices"][0]["finish_reason"].as_str().map(String::from))
        } else {
            serde_json::from_slice::<Value>(&resp.body).unwrap()["choices"][0]["finish_reason"].as_str().map(String::from)
        };
        saw.push(finish.unwrap());
    }
    std::thread::sleep(Duration::from_millis(300));
    let r = stop_trace(p, &out);
    drop(gw);
    let runner: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["role"] == "client").collect();
    assert_eq!(runner.len(), saw.len(), "the front's requests to its runner: {}", r["requests"]);
    for (q, finish) in runner.iter().zip(&saw) {
        let v = &q["verdict"];
        let want = if finish == "length" { "requested_limit" } else { "eos" };
        assert_eq!(v["stop_cause"], want, "the client saw finish_reason {finish}: {q}");
        assert!(!v["evidence"].to_string().contains("closed the connection before its final message"), "{v}");
    }
}

/// probe killed (SIGKILL) while a request streams: the recording is torn, and the report made from
/// it afterwards still lists the request, marked cut where the recording ended, never dropped.
#[test]
fn a_torn_recording_keeps_the_request_in_flight() {
    let _cpus = shared_cpus();
    let mut t = Trace::start("torn", &[]);
    let s = TcpStream::connect(server().addr).unwrap();
    let client = s.local_addr().unwrap();
    send_request(
        &s,
        "POST",
        "/completion",
        Some(&json!({"prompt": "Write a long story about a sailor.", "n_predict": 400, "stream": true})),
    );
    let mut r = BufReader::new(&s);
    let mut resp = Response { status: 200, events: Vec::new(), body: Vec::new(), pending: Vec::new() };
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 2 {
        line.clear();
    }
    read_chunks(&mut r, &mut resp, Some(3));
    // Past the snapshot age, and a flush.
    std::thread::sleep(Duration::from_millis(1600));
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    drop(r);
    drop(s);
    let out = Command::new(probe_bin()).args(["report", "--json"]).arg(&t.out).output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let q = find(&report, client);
    assert_eq!(q.len(), 1, "the request in flight is not in the torn recording's report: {}", report["requests"]);
    let v = &q[0]["verdict"];
    assert_eq!(v["stop_cause"], "unknown", "{v}");
    assert!(v["evidence"][0].as_str().unwrap().starts_with("cut: the recording ended while it was in flight"), "{v}");
    assert!(report["problems"].to_string().contains("no end record"), "{}", report["problems"]);
}

/// A server whose process tree also listens on ports that never answer HTTP (vLLM's worker holds
/// a dozen for torch's gloo): the server's own endpoint is polled at the busy pace from the start,
/// not after each silent port has timed out in turn (13 ports took 20 s there), and each silent
/// port is asked once, then left alone. The silent ports' parent counts the connections itself.
#[test]
fn silent_ports_beside_the_server_do_not_hold_its_polls_back() {
    let _cpus = shared_cpus();
    const SILENT: usize = 12;
    let script = r#"
import os, socket, subprocess, sys, threading
ports = []
def silent(s):
    held = []
    while True:
        c, _ = s.accept()
        held.append(c)
        os.write(1, b"accepted %d\n" % s.getsockname()[1])
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
    threading.Thread(target=silent, args=(s,), daemon=True).start()
    ports.append(s.getsockname()[1])
child = subprocess.Popen(sys.argv[2:])
print("ports", *ports, flush=True)
child.wait()
"#;
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut parent = common::KilledGroup::spawn(
        Command::new("python3")
            .args(["-c", script, &SILENT.to_string()])
            .arg(env_path("LLAMA_SERVER"))
            .arg("-m")
            .arg(env_path("LLAMA_MODEL"))
            .args(["-c", "1024", "-np", "1", "-t", "1", "--metrics", "--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut lines = BufReader::new(parent.0.stdout.take().unwrap()).lines();
    let silent: Vec<u16> = lines.next().unwrap().unwrap().split(' ').skip(1).map(|p| p.parse().unwrap()).collect();
    assert_eq!(silent.len(), SILENT);
    let accepted = std::thread::spawn(move || {
        lines.map_while(Result::ok).filter_map(|l| l.strip_prefix("accepted ")?.parse::<u16>().ok()).collect::<Vec<u16>>()
    });
    common::wait_healthy(addr);
    let (p, out) = trace_pid(parent.0.id(), "silent-ports", &[]);
    // Eight seconds of requests one after another: busy throughout, polled every 2 s.
    let t = Instant::now();
    let mut served = 0;
    while t.elapsed() < Duration::from_secs(8) {
        let body = json!({"prompt": "Once upon a time", "n_predict": 16, "cache_prompt": false});
        let (status, _) = request_once(addr, "POST", "/completion", Some(&body)).unwrap();
        assert_eq!(status, 200);
        served += 1;
    }
    let r = stop_trace(p, &out);
    // The parent and its llama-server: their process group.
    drop(parent);
    let accepted = accepted.join().unwrap();
    let servers = r["system"]["server"].as_array().unwrap();
    let llama = servers.iter().find(|s| s["addr"] == addr.to_string()).unwrap_or_else(|| panic!("{addr} not polled: {servers:?}"));
    assert_eq!(llama["kind"], "llama.cpp", "{llama}");
    let polls = llama["polls"].as_u64().unwrap();
    assert!(polls >= 3, "{served} requests over 8 s, the server polled {polls} times (every 2 s while busy): {servers:?}");
    for port in &silent {
        let n = accepted.iter().filter(|p| *p == port).count();
        assert!(n <= 1, "silent port {port} was connected to {n} times");
    }
    assert_eq!(accepted.len(), SILENT, "probe asked {} of {SILENT} silent ports: {accepted:?}", accepted.len());
}

/// Gross regressions of probe's own cost only (the figures come from `cargo xtask bench --cost`):
/// armed within 500 ms of its start, and under 5% of a core while the server generates, counted
/// from outside probe: its threads' time on a CPU (/proc/PID/task/*/schedstat) plus its BPF
/// programs' run time (their fdinfo, with kernel.bpf_stats_enabled on for the test).
#[test]
fn probe_costs_under_five_percent_and_arms_within_half_a_second() {
    let _cpus = shared_cpus();
    let srv = server();
    let stats = "/proc/sys/kernel/bpf_stats_enabled";
    let before_stats = std::fs::read_to_string(stats).unwrap();
    std::fs::write(stats, "1").unwrap();
    struct Restore(&'static str, String);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = std::fs::write(self.0, self.1.trim());
        }
    }
    let _restore = Restore(stats, before_stats);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    // Arming right after another trace exited waits on the kernel tearing that one's programs
    // down (0.4-1 s for about 10 s: README, probe's own footprint): start once no probe object
    // has been loaded for 10 s (the previous test binary's last trace, another test's).
    let (waited, mut quiet) = (Instant::now(), Instant::now());
    while quiet.elapsed() < Duration::from_secs(10) && waited.elapsed() < Duration::from_secs(60) {
        if common::bpf::probe_programs() > 0 {
            quiet = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (child, _lines, armed) = common::start_trace(&["--pid", &srv.child.id().to_string(), "--out", out.to_str().unwrap()]);
    let ms: f64 = armed.split("armed in ").nth(1).and_then(|r| r.split(" ms").next()).and_then(|n| n.trim().parse().ok()).unwrap();
    assert!(ms <= 500.0, "armed in {ms} ms: over 500 ms ({armed})");
    let pid = child.id();
    let cpu = |pid: u32| -> f64 {
        let mut ns = 0u64;
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
            let s = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            ns += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
        let mut bpf = 0u64;
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:bpf-prog") {
                let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())).unwrap_or_default();
                bpf += info.lines().find_map(|l| l.strip_prefix("run_time_ns:")).and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
            }
        }
        (ns + bpf) as f64 / 1e9
    };
    // Past the first second (unwind tables, the first /proc snapshots: once per trace).
    std::thread::sleep(Duration::from_secs(2));
    let (c0, t0) = (cpu(pid), Instant::now());
    for _ in 0..2 {
        let body =
            json!({"prompt": "Write a long story about a lighthouse keeper.", "n_predict": 128, "cache_prompt": false, "ignore_eos": true});
        let s = TcpStream::connect(srv.addr).unwrap();
        send_request(&s, "POST", "/completion", Some(&body));
        assert_eq!(read_response(&mut BufReader::new(&s), None).status, 200);
    }
    let pct = (cpu(pid) - c0) / t0.elapsed().as_secs_f64() * 100.0;
    eprintln!("armed in {ms:.0} ms; {pct:.2}% of a core while generating ({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(pct < 5.0, "probe took {pct:.2}% of a core while the server generated: over 5%");
    let r = stop_trace(child, &out);
    let lost: u64 = r["lost_events"].as_object().map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    assert_eq!(lost, 0, "events lost at idle priority: {}", r["lost_events"]);
}
