//! The client matrix: every stop cause llama-server produces here, each driven by real clients
//! that end a stream in different ways (tests/clients/client.py: the openai SDK breaking out of
//! its loop at the final chunk, httpx leaving at the final event, requests and curl reading to the
//! end, a raw socket closing right after the final event, a keep-alive client reusing its
//! connection). The verdict must be the cause the cell produced, whatever the client did at the
//! end; what each client saw is printed next to it. Nothing in probe keys on a client.
use std::{
    collections::BTreeMap,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

mod common;
use common::{Vllm, env_path, serial, start_trace, wait_healthy};

const CLIENTS: [&str; 6] = ["openai", "httpx", "requests", "curl", "raw", "keepalive"];

/// One row of the matrix: how to make the server stop for `cause`.
#[derive(Clone, Copy)]
struct Cell {
    cause: &'static str,
    api: &'static str,
    prompt: &'static str,
    /// Each client gets `max_tokens = base + its index` (the keep-alive client's second request
    /// `+ 10`): the report's requests are told apart by it.
    base: u64,
    stop: Option<&'static str>,
    ignore_eos: bool,
    leave_after: u64,
}

fn python() -> PathBuf {
    common::clients_python()
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/client.py")
}

/// Start every client on `cell` at once against `url`.
fn start_clients(cell: &Cell, url: &str) -> Vec<Child> {
    start_clients_ready(cell, url, None)
}

/// Same; each client creates `<ready>/<index>` when its first content event arrives. With
/// `ready`, the clients load their libraries first and all send once every one has: a stream that
/// ended before the slowest interpreter started (a fast server) would never be cut.
fn start_clients_ready(cell: &Cell, url: &str, ready: Option<&Path>) -> Vec<Child> {
    let kids = spawn_clients(cell, url, ready);
    if let Some(d) = ready {
        let t = Instant::now();
        while (0..CLIENTS.len()).any(|i| !d.join(format!("armed-{i}")).exists()) {
            assert!(t.elapsed() < Duration::from_secs(120), "not every client loaded within 120 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::write(d.join("go"), b"").unwrap();
    }
    kids
}

fn spawn_clients(cell: &Cell, url: &str, ready: Option<&Path>) -> Vec<Child> {
    CLIENTS
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut cmd = Command::new(python());
            cmd.arg(script()).args(["--client", c, "--url", url, "--api", cell.api, "--prompt", cell.prompt]);
            if let Some(d) = ready {
                cmd.arg("--ready-file").arg(d.join(i.to_string()));
                cmd.arg("--armed-file").arg(d.join(format!("armed-{i}")));
                cmd.arg("--go-file").arg(d.join("go"));
            }
            cmd.args(["--max-tokens", &(cell.base + i as u64).to_string()]);
            if let Some(s) = cell.stop {
                cmd.args(["--stop", s]);
            }
            if cell.ignore_eos {
                cmd.arg("--ignore-eos");
            }
            if cell.leave_after > 0 {
                cmd.args(["--leave-after", &cell.leave_after.to_string()]);
            }
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start a client")
        })
        .collect()
}

/// A fresh directory for ready files.
fn ready_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("matrix-ready-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Wait until every client's stream is flowing.
fn wait_ready(dir: &Path) {
    let t = Instant::now();
    while (0..CLIENTS.len()).any(|i| !dir.join(i.to_string()).exists()) {
        assert!(t.elapsed() < Duration::from_secs(120), "not every client got a token within 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A few more tokens, so each stream has a rhythm before it is cut.
    std::thread::sleep(Duration::from_millis(300));
}

/// What the clients saw, by max_tokens.
fn finish_clients(children: Vec<Child>) -> BTreeMap<u64, Value> {
    let mut seen = BTreeMap::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.trim().is_empty(), "a client printed nothing: {}", String::from_utf8_lossy(&out.stderr));
        for l in text.lines() {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("client line {l}: {e}"));
            seen.insert(v["max_tokens"].as_u64().unwrap(), v);
        }
    }
    seen
}

/// The report's requests on `path`, by max_tokens.
fn by_max_tokens(r: &Value, path: &str) -> BTreeMap<u64, Value> {
    r["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["path"] == path)
        .filter_map(|q| Some((q["max_tokens"].as_u64()?, q.clone())))
        .collect()
}

/// Compare every client's request with `want` (a cause, or a function of what the client saw);
/// returns the table rows.
fn check(cell: &Cell, r: &Value, seen: &BTreeMap<u64, Value>, want: impl Fn(&Value) -> &'static str) -> Vec<String> {
    // llama.cpp's native endpoint is /completion, also served as /completions (the openai SDK's path).
    let paths: &[&str] = if cell.api == "chat" { &["/v1/chat/completions"] } else { &["/completion", "/completions"] };
    let reqs: BTreeMap<u64, Value> = paths.iter().flat_map(|p| by_max_tokens(r, p)).collect();
    let mut rows = Vec::new();
    let mut wrong = Vec::new();
    for (max, saw) in seen {
        let q = reqs.get(max).unwrap_or_else(|| {
            panic!(
                "{}: no request with max_tokens {max} in the report (client saw {saw}); requests: {:?}",
                cell.cause,
                reqs.keys().collect::<Vec<_>>()
            )
        });
        let v = &q["verdict"];
        let expected = want(saw);
        let row = format!(
            "{:<18} {:<10} max {:>4}: verdict {:<17} (content_complete {}, transport_complete {}, closed_by {}, reset {}) client saw {}",
            cell.cause,
            saw["client"].as_str().unwrap_or("?"),
            max,
            v["stop_cause"].as_str().unwrap_or("?"),
            q["content_complete"],
            q["transport_complete"],
            q["closed_by"],
            q["reset"],
            saw
        );
        if v["stop_cause"] != expected {
            wrong.push(format!("{row}\n    want {expected}; evidence {}", v["evidence"]));
        }
        rows.push(row);
    }
    eprintln!("{}", rows.join("\n"));
    assert!(wrong.is_empty(), "{} of {} cells wrong:\n{}", wrong.len(), rows.len(), wrong.join("\n"));
    rows
}

/// A llama-server of our own, killed when dropped (also when a test fails).
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A llama-server of our own with `args`, optionally started inside a memory cgroup.
fn server(args: &[&str], cgroup: Option<&Path>) -> Server {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let cmd = format!(
        "{}exec {} -m {} {} --host 127.0.0.1 --port {port}",
        cgroup.map(|c| format!("echo $$ > {}/cgroup.procs && ", c.display())).unwrap_or_default(),
        env_path("LLAMA_SERVER").display(),
        env_path("LLAMA_MODEL").display(),
        args.join(" ")
    );
    let child = Command::new("sh").args(["-c", &cmd]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let srv = Server { child, addr };
    wait_healthy(addr);
    srv
}

struct Trace {
    child: Child,
    out: PathBuf,
}

impl Trace {
    fn start(pid: u32, name: &str) -> Trace {
        Self::start_with(pid, name, &[])
    }

    fn start_with(pid: u32, name: &str, extra: &[&str]) -> Trace {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("matrix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let pid = pid.to_string();
        let mut args = vec!["--pid", &pid, "--duration", "300s", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (child, _, armed) = start_trace(&args);
        assert!(armed.contains("stream") && armed.contains("sock"), "stream probes not live: {armed}");
        Trace { child, out }
    }

    /// Stop with SIGINT (unless the target's exit already stopped it) and read report.json.
    fn stop(&mut self) -> Value {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let st = self.child.wait().unwrap();
        assert!(st.code().is_some_and(|c| c <= 1), "probe exit {st:?}");
        let r: Value = common::read_report(&self.out);
        let lost: u64 = r["lost_events"].as_object().unwrap().values().filter_map(Value::as_u64).sum();
        assert_eq!(lost, 0, "events were lost: {}", r["lost_events"]);
        r
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn finish_is(saw: &Value, words: &[&str]) -> bool {
    words.iter().any(|w| saw["finish_reason"] == *w || saw["stop_type"] == *w)
}

/// Ground truth first: every client saw the stop its cell is made for (llama.cpp native says
/// `stop_type`, OpenAI routes `finish_reason`; vLLM names the stop string in `stop_reason`).
fn assert_client_saw(cell: &Cell, saw: &BTreeMap<u64, Value>) {
    for s in saw.values() {
        let ok = match cell.cause {
            "eos" => finish_is(s, &["stop", "eos"]) && s["stop_reason"].is_null(),
            "requested_limit" => finish_is(s, &["length", "limit"]),
            "stop_word" => finish_is(s, &["word"]) || (s["finish_reason"] == "stop" && s["stop_reason"].is_string()),
            "client_disconnect" => s["left_early"] == true,
            "deadline" => s["finish_reason"].is_null() && s["stop_type"].is_null() && s["left_early"] == false,
            other => panic!("no ground truth for {other}"),
        };
        assert!(ok, "{}: the client did not see what the cell is made for: {s}", cell.cause);
    }
}

/// The gateway: nginx with a `timeout_s` read timeout in front of `upstream`; once every client's
/// stream flows, the server (`pid`) is paused for 1.5 s longer than that. What the clients saw.
/// A deadline is a silence of at least 3 token gaps: a slow server (vLLM on a loaded CPU: up to a
/// second a token) needs a longer timeout than the gaps it makes.
fn gateway_deadline(cell: &Cell, upstream: SocketAddr, pid: u32, name: &str, timeout_s: u32) -> BTreeMap<u64, Value> {
    let gw = common::Nginx::start(upstream, timeout_s);
    let ready = ready_dir(&format!("{name}-deadline"));
    let kids = start_clients_ready(cell, &format!("http://{}", gw.addr), Some(&ready));
    wait_ready(&ready);
    // SAFETY: signalling our own child: pause the server, resume after the gateway gave up.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(u64::from(timeout_s) * 1000 + 1500));
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    finish_clients(kids)
}

/// Causes from one server with six slots: EOS, the requested limit, a stop word, a reader that
/// leaves mid-stream, and (through nginx, the server paused) a gateway deadline.
#[test]
fn one_server_eos_limit_stop_word_leaver_and_gateway_deadline() {
    let _serial = serial();
    let srv = server(&["-c", "4096", "-np", "6", "-t", "2", "--seed", "42"], None);
    let (addr, pid) = (srv.addr, srv.child.id());
    let url = format!("http://{addr}");
    let mut t = Trace::start(pid, "llama");
    let cells = [
        Cell { cause: "eos", api: "chat", prompt: "short", base: 300, stop: None, ignore_eos: false, leave_after: 0 },
        Cell { cause: "requested_limit", api: "chat", prompt: "long", base: 6, stop: None, ignore_eos: true, leave_after: 0 },
        Cell { cause: "stop_word", api: "native", prompt: "count", base: 200, stop: Some(","), ignore_eos: false, leave_after: 0 },
        Cell { cause: "client_disconnect", api: "chat", prompt: "long", base: 400, stop: None, ignore_eos: true, leave_after: 3 },
    ];
    let mut seen = Vec::new();
    for cell in &cells {
        seen.push(finish_clients(start_clients(cell, &url)));
    }
    let deadline = Cell { cause: "deadline", api: "chat", prompt: "long", base: 2000, stop: None, ignore_eos: true, leave_after: 0 };
    let seen_deadline = gateway_deadline(&deadline, addr, pid, "llama", 3);
    std::thread::sleep(Duration::from_millis(500));
    let r = t.stop();
    drop(srv);
    let mut rows = Vec::new();
    for (cell, saw) in cells.iter().zip(&seen).chain([(&deadline, &seen_deadline)]) {
        assert_client_saw(cell, saw);
        rows.extend(check(cell, &r, saw, |_| cell.cause));
    }
    // The keep-alive client makes two requests, except where its first was left or cut.
    assert_eq!(rows.len(), 3 * (CLIENTS.len() + 1) + 2 * CLIENTS.len());
}

/// Server-imposed limits: a slot's own context (-c 768 -np 6: 128 tokens a slot), and one KV pool
/// the slots share (--kv-unified) running out with six streams at once. Every request asks for
/// more tokens than either holds.
#[test]
fn server_limits_per_slot_and_shared_kv_pool() {
    let _serial = serial();
    for (name, args) in
        [("slot", vec!["-c", "768", "-np", "6", "-t", "2"]), ("kvpool", vec!["-c", "768", "-np", "6", "-t", "2", "--kv-unified"])]
    {
        let srv = server(&args, None);
        let mut t = Trace::start(srv.child.id(), name);
        let cell = Cell { cause: "server_limit", api: "chat", prompt: "long", base: 1000, stop: None, ignore_eos: true, leave_after: 0 };
        let seen = finish_clients(start_clients(&cell, &format!("http://{}", srv.addr)));
        let r = t.stop();
        drop(srv);
        // Ground truth: every client saw its stream end at a length stop below its request, or
        // (one KV pool, llama-server) an error saying the context ran out.
        for s in seen.values() {
            assert!(s["finish_reason"] == "length" || s["context_exceeded"] == true, "{name}: {s}");
        }
        check(&cell, &r, &seen, |_| "server_limit");
    }
}

/// The server is killed by the OOM killer mid-stream (its memory cgroup fills; it is the
/// preferred victim): every open stream ends with `oom`.
#[test]
fn oom_kill_mid_stream() {
    let _serial = serial();
    let cg = PathBuf::from(format!("/sys/fs/cgroup/memory/probe-matrix-oom-{}", std::process::id()));
    assert!(Path::new("/sys/fs/cgroup/memory").exists(), "no cgroup v1 memory controller at /sys/fs/cgroup/memory");
    std::fs::create_dir_all(&cg).unwrap();
    let mut srv = server(&["-c", "4096", "-np", "6", "-t", "2"], Some(&cg));
    std::fs::write(format!("/proc/{}/oom_score_adj", srv.child.id()), "1000").unwrap();
    let usage: u64 = std::fs::read_to_string(cg.join("memory.usage_in_bytes")).unwrap().trim().parse().unwrap();
    std::fs::write(cg.join("memory.limit_in_bytes"), (usage + (256 << 20)).to_string()).unwrap();
    let mut t = Trace::start(srv.child.id(), "oom");
    let cell = Cell { cause: "oom", api: "chat", prompt: "long", base: 3000, stop: None, ignore_eos: true, leave_after: 0 };
    let ready = ready_dir("oom");
    let kids = start_clients_ready(&cell, &format!("http://{}", srv.addr), Some(&ready));
    wait_ready(&ready);
    // A process in the same cgroup allocates until the cgroup is out of memory.
    let mut hog = Command::new("sh")
        .args([
            "-c",
            &format!("echo $$ > {}/cgroup.procs && exec python3 -c 'a = []\nwhile True: a.append(bytearray(1 << 20))'", cg.display()),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = srv.child.wait().unwrap();
    let _ = hog.kill();
    let _ = hog.wait();
    let seen = finish_clients(kids);
    let r = t.stop();
    let _ = std::fs::remove_dir(&cg);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "the server was not killed: {status:?}");
    check(&cell, &r, &seen, |_| "oom");
}

/// A second server with its own HTTP stack (vLLM: Python, uvicorn; LF-only SSE; `finish_reason`
/// on the last token's chunk; `stop_reason` names the stop string), the same clients: EOS, the
/// requested limit, a stop word, a reader that leaves (the gateway deadline runs on llama-server
/// only: see the note in the test),
/// and the context limit under a KV cache made small on purpose (16 blocks of 32
/// tokens for six streams), where the server preempts requests: read from its /metrics, in the
/// report as evidence.
#[test]
fn vllm_second_server_same_clients() {
    let _serial = serial();
    // 16 blocks of 32 tokens: six streams' prompts (2 blocks each) fit, their growth to 128
    // tokens (4 blocks each) does not.
    let v = Vllm::start(&["--max-model-len", "128", "--block-size", "32", "--num-gpu-blocks-override", "16"]);
    let pid = v.child.id();
    let url = format!("http://{}", v.addr);
    // The probes verdicts of stop causes rest on. With every probe, the seconds after attach lose
    // stack and switch events on vLLM (the collector loads unwind tables for torch's libraries on
    // its one thread while a hundred threads switch), and with them the first requests' heads.
    let mut t = Trace::start_with(pid, "vllm", &["--probes", "sock,stream,proc,mem"]);
    let cells = [
        // vLLM refuses a max_tokens above max-model-len: every request asks for at most 128.
        Cell { cause: "eos", api: "chat", prompt: "short", base: 70, stop: None, ignore_eos: false, leave_after: 0 },
        Cell { cause: "requested_limit", api: "chat", prompt: "long", base: 6, stop: None, ignore_eos: true, leave_after: 0 },
        Cell { cause: "stop_word", api: "chat", prompt: "count", base: 50, stop: Some(","), ignore_eos: false, leave_after: 0 },
        // vLLM merges a stream's pending tokens into one event when its API server falls behind
        // (2 cores, six streams, preemptions): 32 tokens once came as 4 events, the last sent
        // before the client left after its third. More tokens, and leaving at the first event,
        // keep the server from finishing first.
        Cell { cause: "client_disconnect", api: "chat", prompt: "long", base: 40, stop: None, ignore_eos: true, leave_after: 1 },
    ];
    let mut seen = Vec::new();
    for cell in &cells {
        v.wait_idle();
        seen.push(finish_clients(start_clients(cell, &url)));
    }
    // No gateway deadline here: under these 16 KV blocks the six streams preempt each other, and
    // one finished before the last had its first token (CI); on a vLLM of its own, five of six
    // streams through nginx never started. The deadline is checked on llama-server, above.
    // probe polls an idle server every 10 s, and credits a request with what vLLM's counters grew
    // by only when no request outside its burst was served between the polls around it: a quiet
    // stretch of 11 s before and after the burst leaves a poll in each.
    let idle_poll = Duration::from_millis(5500);
    v.wait_idle();
    std::thread::sleep(2 * idle_poll);
    let before = v.preemptions();
    // Between the room left after the prompt (~80 tokens) and max-model-len: the stream ends at
    // length when the context is full.
    let limit = Cell { cause: "server_limit", api: "chat", prompt: "long", base: 110, stop: None, ignore_eos: true, leave_after: 0 };
    // All six send at once (each loads its libraries first): six streams of ~120 tokens need
    // more than 8 KV blocks only together; started one by one they finished before the last
    // began and vLLM never had to preempt.
    let seen_limit = finish_clients(start_clients_ready(&limit, &url, Some(&ready_dir("vllm-limit"))));
    let preempted = v.preemptions() - before;
    std::thread::sleep(2 * idle_poll);
    // The prefix cache, by vLLM's own counters: one prompt twice, with one of probe's polls
    // between them and another before the next request (an idle server is polled every 10 s:
    // probe credits a request with what the counters grew by only when no other request was
    // served between the two polls around it).
    let story = "Once upon a time a lighthouse keeper wrote in his log every night. ".repeat(4);
    let ask = |max_tokens: u64| {
        v.wait_idle();
        let body = serde_json::json!({"messages": [{"role": "user", "content": story}], "max_tokens": max_tokens, "temperature": 0});
        assert_eq!(common::http(v.addr, "POST", "/v1/chat/completions", Some(&body), &[]).unwrap().0, 200);
    };
    let counters = || (v.metric("vllm:prefix_cache_hits_total"), v.metric("vllm:prefix_cache_queries_total"));
    ask(30);
    std::thread::sleep(idle_poll);
    let (h0, q0) = counters();
    std::thread::sleep(idle_poll);
    ask(31);
    let (h1, q1) = counters();
    // A cut prompt on a second server: 6 KB of prompt, of which vLLM keeps the last 64 tokens
    // (`truncate_prompt_tokens`); the client's usage says how many it kept. After a poll, so
    // that the prefix-cache counters across the request before are its own.
    std::thread::sleep(2 * idle_poll);
    v.wait_idle();
    let long = serde_json::json!({
        "messages": [{"role": "user", "content": "The cat sat on the mat and looked at the door. ".repeat(128)}],
        "max_tokens": 33, "temperature": 0, "truncate_prompt_tokens": 64,
    });
    let (status, body) = common::http(v.addr, "POST", "/v1/chat/completions", Some(&long), &[]).unwrap();
    let kept: Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(status, 200, "vLLM refused truncate_prompt_tokens: {kept}");
    let kept = kept["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(kept <= 64, "vLLM kept {kept} prompt tokens of 64");
    std::thread::sleep(Duration::from_millis(2500));
    let r = t.stop();
    drop(v);
    let q = &by_max_tokens(&r, "/v1/chat/completions")[&31];
    let said = format!("{:.0} of {:.0} prompt tokens hit the server's prefix cache", h1 - h0, q1 - q0);
    assert!(h1 - h0 >= 32.0, "vLLM's prefix cache did not hit ({h0}→{h1} of {q0}→{q1}): not the case checked here");
    assert!(q["verdict"]["evidence"].to_string().contains(&said), "{said} (vLLM's /metrics) not in {}", q["verdict"]);
    let cut = &by_max_tokens(&r, "/v1/chat/completions")[&33]["verdict"];
    assert_eq!(cut["prompt_cut"], true, "vLLM kept {kept} tokens of a 6 KB prompt: {cut}");
    assert!(cut["evidence"][0].as_str().unwrap().starts_with("prompt cut:"), "{cut}");
    assert!(q["verdict"].get("prompt_cut").is_none(), "a whole prompt is not cut: {}", q["verdict"]);
    for (cell, saw) in cells.iter().zip(&seen) {
        assert_client_saw(cell, saw);
        check(cell, &r, saw, |_| cell.cause);
    }
    for s in seen_limit.values() {
        assert!(
            s["finish_reason"] == "length" && s["content_events"].as_u64().unwrap() + 1 < s["max_tokens"].as_u64().unwrap(),
            "vLLM context limit: {s}"
        );
    }
    check(&limit, &r, &seen_limit, |_| "server_limit");
    assert!(preempted >= 1.0, "vLLM did not preempt with 8 KV blocks for six streams");
    // The preemptions reached the report through the endpoint poller, and the verdicts of the
    // streams served meanwhile say so.
    let reqs = by_max_tokens(&r, "/v1/chat/completions");
    let told = seen_limit
        .keys()
        .filter(|m| reqs[m]["verdict"]["evidence"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().contains("preempted")))
        .count();
    assert!(
        told >= 1,
        "no verdict mentions the {preempted} preemptions: {:?}",
        seen_limit.keys().map(|m| &reqs[m]["verdict"]).collect::<Vec<_>>()
    );
}
