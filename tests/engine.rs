//! The engine probe (issue 25): llama.cpp's decode steps by uprobe, joined to each request, checked
//! against the engines' own numbers on two real servers with two API generations:
//! - llama-server (static libllama, `llama_process` with `llama_batch_ext`): its `timings`
//!   (prompt_n, predicted_n) and `id_slot` per request;
//! - llama-cpp-python's server (libllama.so through ctypes, classic `llama_decode(llama_batch)`):
//!   its `usage` per request.
//!
//! Ground truth comes from the servers' responses and the clients' clocks, never from probe.
mod common;

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};

/// A trace of `pid`, stopped with SIGINT.
struct Trace {
    child: Child,
    out: PathBuf,
    armed: String,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Trace {
    fn start(name: &str, pid: u32, extra: &[&str]) -> Trace {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let pid = pid.to_string();
        let mut args = vec!["--pid", &pid, "--duration", "300s", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (child, lines, armed) = common::start_trace(&args);
        Trace { child, out, armed, lines }
    }

    /// The report, the summary probe printed, what it said on stderr, and its folder.
    fn stop(self) -> (Value, String, String, PathBuf) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let out = self.child.wait_with_output().unwrap();
        let stderr: Vec<String> = self.lines.iter().collect();
        let stderr = format!("{}\n{}", self.armed, stderr.join("\n"));
        assert!(out.status.code().is_some_and(|c| c <= 1), "probe exit {:?}: {stderr}", out.status);
        (common::read_report(&self.out), String::from_utf8_lossy(&out.stdout).into_owned(), stderr, self.out)
    }
}

fn completion(addr: std::net::SocketAddr, body: Value) -> Value {
    let (status, out) = common::http(addr, "POST", "/completion", Some(&body), &[]).unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    serde_json::from_slice(&out).unwrap()
}

/// The report's requests with an engine view, by the order they arrived.
fn engines(r: &Value) -> Vec<(Value, Value)> {
    r["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/completion").map(|q| (q.clone(), q["engine"].clone())).collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn llama_server_steps_prompt_batches_sharing_and_context() {
    // Slot actions (the cache erase below) need a save path.
    let saves = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine-slots");
    std::fs::create_dir_all(&saves).unwrap();
    let saves = saves.to_str().unwrap();
    let (mut server, addr) = common::shared_llama_server(&["-c", "8192", "-np", "4", "-t", "2", "--seed", "42", "--slot-save-path", saves]);
    let pid = server.id();
    let t = Trace::start("llama", pid, &[]);
    assert!(t.armed.contains("engine"), "the engine probe is not live: {}", t.armed);
    // 1. One request alone: the server's own prompt_n and predicted_n.
    let alone = completion(
        addr,
        json!({"prompt": "The lighthouse keeper wrote in his log", "n_predict": 24, "ignore_eos": true, "temperature": 0}),
    );
    // 2. Four at once on four slots; then one alone again.
    let together: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                s.spawn(move || {
                    completion(
                        addr,
                        json!({"prompt": format!("Story number {i}: once upon a time"), "n_predict": 40 + i, "ignore_eos": true}),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let lone = completion(addr, json!({"prompt": "A lone request about the sea", "n_predict": 20, "ignore_eos": true}));
    // 3. Context: a long prompt (~1700 tokens of the slot's 2048) then a short one, the same number of steps each.
    let long_prompt = "The keeper counted the waves and wrote each one down in his book. ".repeat(120);
    let long = completion(addr, json!({"prompt": long_prompt, "n_predict": 48, "ignore_eos": true, "id_slot": 0, "cache_prompt": false}));
    let short = completion(addr, json!({"prompt": "Short.", "n_predict": 49, "ignore_eos": true, "id_slot": 1, "cache_prompt": false}));
    // 4. A cache clear: erase slot 2's cache (llama_memory_seq_rm of the whole sequence).
    let (status, body) = common::http(addr, "POST", "/slots/2?action=erase", Some(&json!({})), &[]).unwrap();
    assert_eq!(status, 200, "slot erase: {}", String::from_utf8_lossy(&body));
    std::thread::sleep(Duration::from_millis(300));
    let (r, summary, _stderr, dir) = t.stop();
    let _ = server.kill();
    let _ = server.wait();

    let qs = engines(&r);
    assert_eq!(qs.len(), 8, "requests: {}", r["requests"]);
    // Every request was matched to its engine sequence; the wire named the slot.
    for (q, e) in &qs {
        assert!(e.is_object(), "request {} has no engine view: {q}", q["id"]);
    }
    // The report's requests by max_tokens (concurrent ones arrive in any order).
    let all = [&alone].into_iter().chain(&together).chain([&lone, &long, &short]).collect::<Vec<_>>();
    let qs: Vec<(Value, Value)> = all
        .iter()
        .map(|t| {
            let n = t["generation_settings"]["n_predict"].as_u64().unwrap();
            qs.iter().find(|(q, _)| q["max_tokens"].as_u64() == Some(n)).unwrap_or_else(|| panic!("no request with max_tokens {n}")).clone()
        })
        .collect();
    for (truth, (q, e)) in all.iter().zip(&qs) {
        let t = &truth["timings"];
        // The server's own slot and counts.
        assert_eq!(e["seq"], truth["id_slot"], "slot: engine {e}, server {truth}");
        // The wire names the slot (a body too long for probe's parse window falls back to order).
        assert!(
            e["matched_by"] == "id_slot" || (e["matched_by"] == "order" && truth["prompt"].as_str().is_some_and(|p| p.len() > 4096)),
            "{e}"
        );
        let prompt_n = t["prompt_n"].as_u64().unwrap();
        assert_eq!(e["prompt_tokens"].as_u64().unwrap(), prompt_n, "prompt tokens of #{}: engine {e}, server timings {t}", q["id"]);
        let predicted = t["predicted_n"].as_i64().unwrap();
        let steps = e["decode_steps"].as_i64().unwrap();
        assert!((steps - predicted).abs() <= 1, "#{}: {steps} decode steps for {predicted} tokens predicted: {e}", q["id"]);
        // Queue and prompt time fit inside the client's own view of the request (TTFT).
        let ttft = f(&q["ttft_ms"]);
        assert!(f(&e["queue_ms"]) + f(&e["prompt_ms"]) <= ttft + 1.0, "#{}: queue + prompt beyond TTFT {ttft}: {e}", q["id"]);
    }
    // Alone: one sequence a step, none shared. Together: the overlapped ones shared steps.
    assert_eq!(f(&qs[0].1["mean_batch_seqs"]), 1.0, "{}", qs[0].1);
    assert_eq!(qs[0].1["shared_steps"], 0, "{}", qs[0].1);
    assert_eq!(f(&qs[5].1["mean_batch_seqs"]), 1.0, "the lone request: {}", qs[5].1);
    let shared: Vec<f64> = qs[1..5].iter().map(|(_, e)| f(&e["mean_batch_seqs"])).collect();
    assert!(shared.iter().filter(|&&m| m >= 2.0).count() >= 3, "four requests at once: mean batch {shared:?}");
    // Context: the long prompt's steps are slower than the short one's, by a ratio measured here.
    let (lp, sp) = (f(&qs[6].1["step_ms_p50"]), f(&qs[7].1["step_ms_p50"]));
    eprintln!("step p50 at KV ~{} tokens: {lp} ms; at KV ~{}: {sp} ms; ratio {:.2}", qs[6].1["kv_len"], qs[7].1["kv_len"], lp / sp);
    assert!(lp > sp * 1.1, "a long context's decode steps ({lp} ms) are not slower than a short one's ({sp} ms)");
    let kv_long = qs[6].1["kv_len"].as_u64().unwrap();
    let truth_kv = long["timings"]["prompt_n"].as_u64().unwrap() + long["timings"]["predicted_n"].as_u64().unwrap();
    assert!(kv_long.abs_diff(truth_kv) <= 2, "KV length {kv_long}, the server's prompt + predicted {truth_kv}");
    // The cache clear: a removal of slot 2's whole sequence, in the summary and the timeline.
    let engine = &r["engine"];
    assert!(engine["seq_removals"].as_u64().unwrap() >= 8, "{engine}");
    let st = Command::new(common::probe_bin()).arg("timeline").arg(&dir).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let timeline: Value = serde_json::from_slice(&std::fs::read(dir.join("timeline.json")).unwrap()).unwrap();
    let erased = timeline["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "cache: sequence removed" && e["args"]["seq"] == 2 && e["args"]["p0"] == -1);
    assert!(erased, "slot 2's erase is not on the timeline's engine track");
    let steps = timeline["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("process ")))
        .count();
    assert!(steps > 100, "{steps} engine steps on the timeline");
    // The summary line names the engine's view of each request.
    assert!(summary.contains("engine: queued"), "the summary has no engine line:\n{summary}");
}

/// The classic API through libllama.so: llama-cpp-python's server calls `llama_decode` with a
/// `llama_batch` it fills itself. Each request's prompt tokens and decode steps against the
/// server's `usage`; one sequence a step (the server runs one request at a time).
#[test]
fn llama_cpp_python_classic_batches_through_libllama() {
    let s = common::PyServer::start();
    let t = Trace::start("python", s.child.id(), &[]);
    assert!(t.armed.contains("engine"), "the engine probe is not live on llama-cpp-python: {}", t.armed);
    let first = s.complete("The lighthouse keeper looked at the sea and said", 16);
    // A second prompt sharing the first's words: the binding keeps the common prefix.
    let second = s.complete("The lighthouse keeper looked at the sea and wrote", 12);
    let (r, _summary, _stderr, _dir) = t.stop();
    let engine = r["probes"].as_array().unwrap().iter().find(|p| p["name"] == "engine").expect("engine probe status");
    assert!(
        engine["attached"].to_string().contains("llama_decode in libllama"),
        "the engine probe did not attach to libllama.so's llama_decode: {engine}"
    );
    let qs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/v1/completions").collect();
    assert_eq!(qs.len(), 2, "{}", r["requests"]);
    for (q, truth) in qs.iter().zip([&first, &second]) {
        let e = &q["engine"];
        assert!(e.is_object(), "no engine view: {q}");
        let usage = &truth["usage"];
        let (prompt, completion) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_i64().unwrap());
        let processed = e["prompt_tokens"].as_u64().unwrap();
        let cached = e["cached_tokens"].as_u64().unwrap_or(0);
        // The engine processed the prompt less what the binding kept from the request before.
        assert!(processed <= prompt && processed + cached >= prompt.saturating_sub(1), "prompt: engine {e}, server usage {usage}");
        let steps = e["decode_steps"].as_i64().unwrap();
        assert!((steps - completion).abs() <= 1, "{steps} decode steps for {completion} completion tokens: {e}");
        assert_eq!(f(&e["mean_batch_seqs"]), 1.0, "{e}");
        assert!(e["kv_len"].as_u64().is_some_and(|k| k >= prompt), "KV length from the batch's positions: {e}");
    }
    // The first request's prompt is all new: the engine's count is the server's.
    assert_eq!(qs[0]["engine"]["prompt_tokens"].as_u64(), first["usage"]["prompt_tokens"].as_u64(), "{}", qs[0]["engine"]);
}

/// A build whose entry points are not all there: llama-server with `llama_memory_seq_rm` taken
/// out of its symbol table (objcopy). The probe says what it could not find, and traces on:
/// steps still come. And a process with no llama.cpp at all says so and traces on.
#[test]
fn a_missing_entry_point_is_named_and_the_trace_carries_on() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-nosym-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("llama-server-nosym");
    let st = Command::new("objcopy")
        .args(["--strip-symbol=llama_memory_seq_rm", "--strip-symbol=llama_kv_self_seq_rm"])
        .arg(common::env_path("LLAMA_SERVER"))
        .arg(&bin)
        .status()
        .expect("objcopy (binutils)");
    assert!(st.success(), "objcopy failed");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = common::spawn_owned(
        Command::new(&bin)
            .arg("-m")
            .arg(common::env_path("LLAMA_MODEL"))
            .args(["-c", "1024", "-np", "1", "-t", "1", "--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    common::wait_healthy(addr);
    let t = Trace::start("nosym", server.id(), &[]);
    let answer = completion(addr, json!({"prompt": "Hello", "n_predict": 8, "ignore_eos": true}));
    let (r, _summary, stderr, _dir) = t.stop();
    let _ = server.kill();
    let _ = server.wait();
    let engine = r["probes"].as_array().unwrap().iter().find(|p| p["name"] == "engine").expect("engine probe status");
    let said = engine.to_string();
    assert!(said.contains("llama_memory_seq_rm not found in llama-server-nosym"), "{said}");
    assert_eq!(engine["live"], true, "{said}");
    let q = &engines(&r)[0].1;
    let predicted = answer["timings"]["predicted_n"].as_i64().unwrap();
    assert!((q["decode_steps"].as_i64().unwrap() - predicted).abs() <= 1, "{q}");
    assert!(stderr.contains("armed in"), "{stderr}");

    // No llama.cpp at all: a plain process.
    let mut plain = Command::new("sleep").arg("60").spawn().unwrap();
    let t = Trace::start("plain", plain.id(), &[]);
    let (r, _summary, stderr, _dir) = t.stop();
    let _ = plain.kill();
    let _ = plain.wait();
    let engine = r["probes"].as_array().unwrap().iter().find(|p| p["name"] == "engine").expect("engine probe status");
    assert_eq!(engine["live"], false);
    assert!(
        engine["skipped"].to_string().contains("engine probes: no llama.cpp entry point")
            && stderr.contains("engine probes: no llama.cpp entry point"),
        "{engine}\n{stderr}"
    );
    assert!(r.get("engine").is_none(), "{}", r["engine"]);
}

/// The engine probe follows objects mapped after attach: a Python process that imports the
/// binding (and so maps libllama.so) only once the trace runs, then decodes 12 tokens. probe
/// searches new mappings on its once-a-second turn: steps in the first second after a mapping
/// can be missed, so the script waits 2 s before its first.
#[test]
fn a_library_mapped_after_attach_is_followed() {
    let script = r#"
import sys, time
time.sleep(3)
import llama_cpp
# probe searches new mappings once a second: give it that before the first step.
time.sleep(2)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
out = llm.create_completion("The sea was calm and", max_tokens=12, temperature=0)
print(out["usage"]["completion_tokens"], flush=True)
time.sleep(1)
"#;
    let py = Command::new(common::env_path("LLAMA_PYTHON"))
        .args(["-c", script])
        .arg(common::env_path("LLAMA_MODEL"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Trace::start("follow", py.id(), &[]);
    assert!(!t.armed.contains("engine"), "libllama was mapped before the script imported it: {}", t.armed);
    let out = py.wait_with_output().unwrap();
    assert!(out.status.success());
    let completion: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let (r, _summary, stderr, _dir) = t.stop();
    assert!(stderr.contains("engine probes: attached llama_decode in libllama"), "{stderr}");
    let engine = &r["engine"];
    // The prompt's batch, then one step a token but the first.
    let steps = engine["steps"].as_u64().unwrap_or(0);
    assert!(steps >= completion && steps <= completion + 2, "{steps} steps for {completion} tokens: {engine}");
}
