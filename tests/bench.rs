//! `probe bench` against a real llama-server with a real model (SmolLM2-135M): the experiments
//! of the issue, run by the real binary, asserted on its results.json. `cargo xtask test` passes
//! LLAMA_SERVER and LLAMA_MODEL. The tests take turns (one lock): they measure latency on a
//! 2-core machine, and the concurrency test needs the server's KV pool to itself.
use std::{
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::{Mutex, MutexGuard, OnceLock},
    time::Instant,
};

use serde_json::Value;

mod common;
use common::{env_path, probe_bin, shared_llama_server, wait_healthy};

fn turn() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

struct Server {
    _child: Child,
    url: String,
}

/// llama-server -np 4 -c 1024 with one shared KV pool (--kv-unified): 4 slots draw on 1024
/// tokens together. (This build splits the context per slot when -np is explicit, 256 tokens
/// each, and then every level hits the same 256-token wall: concurrency changes nothing. With
/// the shared pool a lone request has room, and concurrent ones run it out together.)
fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let (child, addr) = shared_llama_server(&["-np", "4", "-c", "1024", "--kv-unified", "-t", "1", "--seed", "42", "--metrics"]);
        Server { _child: child, url: format!("http://{addr}") }
    })
}

fn out_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Run `probe bench ARGS --out DIR`; it must succeed; returns results.json.
fn bench(out: &Path, args: &[&str]) -> Value {
    let t = Instant::now();
    let o = Command::new(probe_bin()).arg("bench").args(args).arg("--out").arg(out).output().expect("run probe bench");
    let text = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprintln!("probe bench {} ({:.1} s):\n{text}", args.join(" "), t.elapsed().as_secs_f64());
    assert!(o.status.success(), "probe bench failed ({}): {text}", o.status);
    let v: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json")).expect("results.json is JSON");
    assert_eq!(v["interrupted"], false);
    v
}

fn rows<'a>(v: &'a Value, level: &str) -> Vec<&'a Value> {
    v["rows"].as_array().unwrap().iter().filter(|r| r["level"] == level).collect()
}

fn mean_output(rows: &[&Value]) -> f64 {
    rows.iter().map(|r| r["output_tokens"].as_f64().unwrap()).sum::<f64>() / rows.len() as f64
}

/// Long generations at 1, 2 and 4 concurrent requests: at 1 the request ends at the limit it
/// asked for; at 4 the shared KV pool runs out, outputs are shorter, and the stop reason says
/// it was the server's limit, not EOS.
#[test]
fn shorter_answers_at_concurrency_4_are_a_server_limit() {
    let _t = turn();
    let out = out_dir("concurrency");
    let v = bench(
        &out,
        &[
            "--url",
            &server().url,
            "--api",
            "llamacpp",
            "--sweep",
            "concurrency",
            "--levels",
            "1,2,4",
            "--requests-per-level",
            "1",
            "--max-tokens",
            "280",
            "--ignore-eos",
        ],
    );
    let (one, four) = (rows(&v, "1"), rows(&v, "4"));
    assert_eq!((one.len(), rows(&v, "2").len(), four.len()), (1, 2, 4));
    for r in &one {
        assert!(["eos", "requested_limit"].contains(&r["stop"].as_str().unwrap()), "{r}");
        assert_eq!(r["status"], 200, "{r}");
    }
    assert!(mean_output(&four) < 0.9 * mean_output(&one), "output did not fall: {} at 4 vs {} at 1", mean_output(&four), mean_output(&one));
    let limited: Vec<&&Value> = four.iter().filter(|r| r["stop"] == "server_limit").collect();
    assert!(limited.len() >= 3, "{}", serde_json::to_string_pretty(&four).unwrap());
    for r in &limited {
        assert!(r["output_tokens"].as_u64().unwrap() < 280, "{r}");
        assert!(r["stop_detail"].as_str().unwrap().contains("server-imposed limit"), "{r}");
        // A few hundred tokens in a 1024-token slot: the pool the four slots share ran out.
        assert_eq!(r["server_limit"], "kv_pool", "{r}");
    }
    let c: Vec<&str> = v["conclusions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert!(
        c.iter()
            .any(|c| c.starts_with("output length falls at concurrency 4") && c.contains("server-imposed limit") && c.contains("KV pool")),
        "{c:?}"
    );
    // The server's counters were read around each level, and every output is there.
    let l4 = v["levels"].as_array().unwrap().iter().find(|l| l["level"] == "4").unwrap();
    assert!(
        l4["counters_after"]["llamacpp:tokens_predicted_total"].as_f64().unwrap()
            > l4["counters_before"]["llamacpp:tokens_predicted_total"].as_f64().unwrap(),
        "{l4}"
    );
    for f in ["results.csv", "summary.txt", "concurrency-ttft-output.svg", "concurrency-stops.svg"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 7);
    assert!(std::fs::read_to_string(out.join("summary.txt")).unwrap().contains("TPOT: "));
}

/// The same run twice with the same seed at concurrency 1 gives the same output token counts.
/// Short questions through the chat route end at EOS at lengths the model chooses (not at the
/// limit), so equal counts say the runs generated the same tokens.
#[test]
fn same_seed_twice_gives_identical_output_lengths() {
    let _t = turn();
    let dir_a = out_dir("seed-a");
    std::fs::create_dir_all(&dir_a).unwrap();
    let prompts = dir_a.with_extension("prompts.txt");
    std::fs::write(&prompts, "Say hello.\nReply with one word: yes or no.\nWhat color is the sky?\nName three colors.\nWhat is two plus two?\nGive me a greeting.\n").unwrap();
    let p = prompts.to_str().unwrap();
    let args = [
        "--url",
        &server().url,
        "--api",
        "chat",
        "--prompts",
        p,
        "--sweep",
        "concurrency",
        "--levels",
        "1",
        "--requests-per-level",
        "6",
        "--max-tokens",
        "120",
        "--seed",
        "7",
    ];
    let a = bench(&dir_a, &args);
    let b = bench(&out_dir("seed-b"), &args);
    let counts = |v: &Value| -> Vec<(String, u64, String)> {
        v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["prompt_hash"].as_str().unwrap().to_string(),
                    r["output_tokens"].as_u64().unwrap(),
                    r["stop"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (ca, cb) = (counts(&a), counts(&b));
    assert_eq!(ca.len(), 6);
    assert_eq!(ca, cb, "the same seed gave different output lengths");
    assert!(ca.iter().all(|(_, n, s)| *n > 0 && ["eos", "requested_limit"].contains(&s.as_str())), "{ca:?}");
    // Lengths the model chose: at least three answers ended at EOS, with different lengths.
    let eos: std::collections::BTreeSet<u64> = ca.iter().filter(|c| c.2 == "eos").map(|c| c.1).collect();
    assert!(eos.len() >= 3, "{ca:?}");
    assert!(a["rows"].as_array().unwrap().iter().all(|r| r["output_tokens_source"] == "usage"));
    // Six different prompts, and no prompt text in the outputs.
    assert_eq!(ca.iter().map(|c| &c.0).collect::<std::collections::BTreeSet<_>>().len(), 6);
    let text = std::fs::read_to_string(dir_a.join("results.json")).unwrap() + &std::fs::read_to_string(dir_a.join("results.csv")).unwrap();
    assert!(!text.contains("two plus two") && !text.contains("greeting"), "prompt text leaked into the outputs");
    // The same --out again: refused, the earlier results untouched (like `trace --out`).
    let o = Command::new(probe_bin()).arg("bench").args(args).arg("--out").arg(&dir_a).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("holds an earlier run's results") && err.contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir_a.join("results.json")).unwrap() + &std::fs::read_to_string(dir_a.join("results.csv")).unwrap(),
        text
    );
}

/// Prompt buckets that fit the context report TTFT and prompt tokens/s; one longer than the
/// context is recorded as rejected by the server (HTTP 400), not as a crash.
#[test]
fn prompt_buckets_report_prefill_and_an_overlong_bucket_is_rejected() {
    let _t = turn();
    let out = out_dir("prompt");
    let v = bench(
        &out,
        &[
            "--url",
            &server().url,
            "--api",
            "llamacpp",
            "--sweep",
            "prompt",
            "--buckets",
            "128,512,4096",
            "--prompt-levels",
            "1",
            "--bucket-max-tokens",
            "8",
        ],
    );
    assert_eq!(v["server"]["slot_ctx"], 1024);
    let mut ttft = Vec::new();
    for b in [128u64, 512] {
        let rs = rows(&v, &format!("{b} @1"));
        assert_eq!(rs.len(), 1);
        let r = rs[0];
        assert_eq!(r["status"], 200, "{r}");
        let n = r["prompt_tokens"].as_u64().unwrap();
        assert!(n.abs_diff(b) * 20 <= b, "bucket {b} sized to {n} tokens");
        assert!(r["prompt_tps"].as_f64().unwrap() > 0.0 && r["ttft_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["stop"], "requested_limit", "{r}");
        let l = v["levels"].as_array().unwrap().iter().find(|l| l["level"] == format!("{b} @1")).unwrap();
        assert!(l["prompt_tps_mean"].as_f64().unwrap() > 0.0 && l["ttft_ms_p50"].as_f64().is_some(), "{l}");
        ttft.push(r["ttft_ms"].as_f64().unwrap());
    }
    assert!(ttft[1] > ttft[0], "a 4x longer prompt was not slower to first token: {ttft:?}");
    let over = rows(&v, "4096 @1");
    assert_eq!(over.len(), 1, "the over-long bucket is sent once");
    assert_eq!(over[0]["status"], 400, "{}", over[0]);
    assert_eq!(over[0]["stop"], "rejected", "{}", over[0]);
    let c: Vec<&str> = v["conclusions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert!(c.iter().any(|c| c.contains("prompt bucket 4096 was rejected by the server (HTTP 400)")), "{c:?}");
    assert!(out.join("prompt-throughput.svg").exists());
}

/// A llama-server that a shell script (re)starts on a fixed port, as a user's restart command
/// would; killed when dropped.
struct ScriptServer {
    script: PathBuf,
    pidfile: PathBuf,
    addr: SocketAddr,
}

impl ScriptServer {
    fn new(dir: &Path, model: &Path) -> ScriptServer {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let pidfile = dir.join("server.pid");
        let script = dir.join("restart.sh");
        // --sleep-idle-seconds 1: idle for a second, the server unloads the model (unmaps it),
        // so the page cache of the file can be dropped; --no-repack keeps the weights in the file.
        let text = format!(
            "#!/bin/sh\nP={pid}\nif [ -f $P ]; then kill $(cat $P) 2>/dev/null; while kill -0 $(cat $P) 2>/dev/null; do sleep 0.05; done; fi\n\
             setsid {server} -m {model} --no-repack --sleep-idle-seconds 1 -c 1024 -np 1 -t 1 --seed 42 --host 127.0.0.1 --port {port} >{log} 2>&1 </dev/null &\necho $! > $P\n",
            pid = pidfile.display(),
            server = env_path("LLAMA_SERVER").display(),
            model = model.display(),
            log = dir.join("server.log").display(),
        );
        std::fs::write(&script, text).unwrap();
        let s = ScriptServer { script, pidfile, addr: format!("127.0.0.1:{port}").parse().unwrap() };
        assert!(Command::new("sh").arg(&s.script).status().unwrap().success());
        wait_healthy(s.addr);
        s
    }
}

impl Drop for ScriptServer {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.pidfile).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: killing the server this test started (its pid from the script's pidfile).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The idle sweep with the "restart the server, model dropped from the page cache" layer: the
/// first request after each restart waits for the model to come back from disk (the traced
/// verdict says disk or load, and the trace saw the model read from disk); without the layer,
/// the same intervals do not wait on disk.
///
/// The server stands in for one that loads its model on the first request (Ollama, or
/// llama-server --sleep-idle-seconds, used here): it unloads the model after 1 s idle, so every
/// request after 3 s idle reloads it — from disk with the layer, from the page cache without.
/// A reload from the cache is still a model load: the verdict calls it `load` as soon as a
/// few pages come from disk (this machine's page cache loses scattered pages to reclaim), so
/// without the layer the test asserts what the layer changes: no disk wait to speak of, and
/// (almost) none of the model read from disk.
#[test]
fn idle_restart_with_a_dropped_cache_is_disk_bound_and_without_it_is_not() {
    let _t = turn();
    let dir = out_dir("idle");
    std::fs::create_dir_all(&dir).unwrap();
    // A copy of the model that no other server maps (a mapped file cannot be evicted).
    let model = dir.join("model.gguf");
    std::fs::copy(env_path("LLAMA_MODEL"), &model).unwrap();
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    let srv = ScriptServer::new(&dir, &model);
    let url = format!("http://{}", srv.addr);
    let restart = format!("sh {}", srv.script.display());
    let cold = bench(
        &dir.join("with-layer"),
        &["--url", &url, "--api", "llamacpp", "--sweep", "idle", "--idle", "3s,3s", "--restart-cmd", &restart, "--drop-cache", "--trace"],
    );
    let warm = bench(
        &dir.join("without-layer"),
        &["--url", &url, "--api", "llamacpp", "--sweep", "idle", "--idle", "3s,3s", "--trace", "--model-file", model.to_str().unwrap()],
    );
    let split = |r: &Value| -> (f64, f64, f64) {
        let s = &r["verdict"]["ttft_ms"];
        let total: f64 =
            ["queue", "disk", "memory", "power", "load", "compute", "unexplained"].iter().map(|k| s[k].as_f64().unwrap()).sum();
        (s["disk"].as_f64().unwrap(), s["load"].as_f64().unwrap(), total)
    };
    // Bytes of the model the trace saw read from disk (its report.json, the row's trace).
    let size = std::fs::metadata(&model).unwrap().len();
    let model_read = |run: &str, r: &Value| -> u64 {
        let report: Value = serde_json::from_slice(
            &std::fs::read(dir.join(run).join(r["verdict"]["trace"].as_str().unwrap()).join("report.json")).unwrap(),
        )
        .unwrap();
        report["files"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["path"] == model.to_str().unwrap())
            .map(|f| f["read_bytes"].as_u64().unwrap())
            .sum()
    };
    let cold_rows = cold["rows"].as_array().unwrap();
    assert_eq!(cold_rows.len(), 2);
    assert_ne!(cold_rows[0]["server_pid"], cold_rows[1]["server_pid"], "the server was not restarted");
    assert_eq!(cold["traces"].as_array().unwrap().len(), 2, "one trace per restart");
    for r in cold_rows {
        assert_eq!(r["layers"], serde_json::json!(["restart", "drop_cache"]));
        assert!(r["model_resident_pct"].as_f64().unwrap() < 10.0, "the model was not dropped: {r}");
        assert!(["disk", "load"].contains(&r["verdict"]["slow_cause"].as_str().unwrap()), "{r}");
        let (disk, load, total) = split(r);
        assert!(disk + load >= 0.5 * total, "disk {disk} + load {load} of {total} ms: {r}");
        assert!(model_read("with-layer", r) >= size / 2, "the trace saw {} of {size} model bytes read: {r}", model_read("with-layer", r));
    }
    let warm_rows = warm["rows"].as_array().unwrap();
    assert_eq!(warm_rows.len(), 2);
    assert_eq!(warm_rows[0]["server_pid"], warm_rows[1]["server_pid"]);
    for r in warm_rows {
        assert!(r["layers"].as_array().unwrap().is_empty());
        assert!(r["model_resident_pct"].as_f64().unwrap() > 90.0, "{r}");
        assert_ne!(r["verdict"]["slow_cause"], "disk", "{r}");
        let (disk, _, total) = split(r);
        assert!(disk < 0.1 * total, "disk {disk} of {total} ms without the layer: {r}");
    }
    let read = model_read("without-layer", &warm_rows[0]);
    assert!(read < size / 10, "without the layer the trace saw {read} of {size} model bytes read from disk");
    assert!(dir.join("with-layer/idle-ttft.svg").exists());
    drop(srv);
}
