//! `probe bench` against a real llama-server with a real model (SmolLM2-135M): the experiments
//! of the issue, run by the real binary, asserted on its results.json. `cargo xtask test` passes
//! LLAMA_SERVER and LLAMA_MODEL. The tests take turns (one lock): they measure latency on a
//! 2-core machine, and the concurrency test needs the server's KV pool to itself.
use std::{
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
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
    common::out_dir(&format!("bench-{name}"))
}

/// Run `probe bench ARGS --out DIR`; it must succeed; returns results.json.
fn bench(out: &Path, args: &[&str]) -> Value {
    let (code, v, text) = bench_exit(out, args);
    assert_eq!(code, Some(0), "probe bench failed: {text}");
    v
}

/// `probe bench` that may exit non-zero (a regression gate): its exit code, results.json and
/// what it printed.
fn bench_exit(out: &Path, args: &[&str]) -> (Option<i32>, Value, String) {
    let t = Instant::now();
    let o = Command::new(probe_bin()).arg("bench").args(args).arg("--out").arg(out).output().expect("run probe bench");
    let text = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprintln!("probe bench {} ({:.1} s):\n{text}", args.join(" "), t.elapsed().as_secs_f64());
    let v: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json")).expect("results.json is JSON");
    assert_eq!(v["interrupted"], false);
    (o.status.code(), v, text)
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
    // The stop-reason chart counts requests: its axis ticks are whole numbers, and both axes say
    // what they are. Chromium draws it (a screenshot is left beside it, for people to look at).
    let stops = std::fs::read_to_string(out.join("concurrency-stops.svg")).unwrap();
    let ticks: Vec<&str> = stops.split("text-anchor=\"end\">").skip(1).map(|t| t.split('<').next().unwrap()).collect();
    assert!(ticks.len() >= 2 && ticks.iter().all(|t| t.parse::<u64>().is_ok()), "count ticks {ticks:?}");
    assert!(stops.contains(">requests<") && stops.contains(">concurrency<"), "axis labels missing");
    let shot = out.join("concurrency-stops.png");
    let st = Command::new("chromium")
        .args(["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=440,320", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", out.join("chromium").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", out.join("concurrency-stops.svg").display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success() && std::fs::metadata(&shot).map_or(0, |m| m.len()) > 2_000, "chromium did not draw the chart");
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert!(summary.contains("(--api llamacpp: /completion)") && !summary.contains("slow (traced)"), "{summary}");
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
    // The engine's steps (llama.cpp, by uprobe) joined to each traced row: one request at a time
    // (the client's own sequencing) decodes alone, a step a token but the first (the client's
    // own count of output tokens); the level and the summary carry them.
    for r in warm_rows {
        let e = &r["verdict"]["engine"];
        assert_eq!(e["mean_batch_seqs"].as_f64(), Some(1.0), "{r}");
        let (steps, out) = (e["decode_steps"].as_i64().unwrap(), r["output_tokens"].as_i64().unwrap());
        assert!((steps - out).abs() <= 1, "{steps} decode steps for {out} output tokens: {r}");
    }
    assert!(warm["levels"].as_array().unwrap().iter().all(|l| l["engine_batch_seqs"].as_f64() == Some(1.0)), "{}", warm["levels"]);
    let summary = std::fs::read_to_string(dir.join("without-layer/summary.txt")).unwrap();
    assert!(summary.contains("step ms") && summary.contains("batch"), "{summary}");
    let read = model_read("without-layer", &warm_rows[0]);
    assert!(read < size / 10, "without the layer the trace saw {read} of {size} model bytes read from disk");
    assert!(dir.join("with-layer/idle-ttft.svg").exists());
    drop(srv);
}

/// `--repeat 3` twice on an idle server: every figure of every level gets an interval, the
/// second run against the first (`--baseline`) changes nothing beyond them. The same sweep with
/// a CPU-bound job beside the server is called different (its TTFT and TPOT beyond the
/// intervals, for the worse), and its levels are flagged as contended, naming the job's pids.
#[test]
fn repeated_sweeps_agree_on_an_idle_server_and_a_cpu_hog_is_called_different() {
    let _t = turn();
    let args = [
        "--url",
        &server().url,
        "--sweep",
        "concurrency",
        "--levels",
        "1,2",
        "--requests-per-level",
        "3",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--repeat",
        "3",
    ];
    let a_dir = out_dir("repeat-a");
    let a = bench(&a_dir, &args);
    let levels = a["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2, "{levels:?}");
    assert_eq!(a["runs"].as_array().unwrap().len(), 6, "2 levels x 3 runs");
    for l in levels {
        assert_eq!(l["runs"], 3);
        assert_eq!(l["requests"], 9, "{l}");
        for f in ["ttft_ms_p50", "tpot_ms_mean", "output_tokens_mean", "throughput_output_tps"] {
            let i = &l["intervals"][f];
            let (lo, hi, mean) = (i["lo"].as_f64().unwrap(), i["hi"].as_f64().unwrap(), i["mean"].as_f64().unwrap());
            assert!(lo <= mean && mean <= hi && i["n"] == 3, "{f}: {i}");
        }
        assert_eq!(l["contended"], false, "an idle box flagged as contended: {}", l["machine"]);
    }
    // The run order was shuffled across levels, and every row says which run it came from.
    let order: Vec<String> = a["runs"].as_array().unwrap().iter().map(|r| r["level"].as_str().unwrap().to_string()).collect();
    assert_ne!(order, ["1", "2", "1", "2", "1", "2"], "runs in plan order: not shuffled");
    let runs_seen: std::collections::BTreeSet<u64> = a["rows"].as_array().unwrap().iter().map(|r| r["repeat"].as_u64().unwrap()).collect();
    assert_eq!(runs_seen.len(), 3);
    let summary = std::fs::read_to_string(a_dir.join("summary.txt")).unwrap();
    assert!(summary.contains("± half the 95% interval over 3 runs"), "{summary}");

    let a_path = a_dir.join("results.json");
    let mut with_base = args.to_vec();
    // The gate (`--fail-on-regression 50`): the rerun on the idle server passes it (`bench`
    // asserts exit 0), the run beside the hog does not.
    with_base.extend(["--baseline", a_path.to_str().unwrap(), "--fail-on-regression", "50"]);
    let b = bench(&out_dir("repeat-b"), &with_base);
    let figures = b["baseline"]["figures"].as_array().unwrap();
    assert!(figures.len() >= 12, "{}", b["baseline"]);
    let beyond: Vec<&Value> = figures.iter().filter(|f| f["beyond_intervals"] == true).collect();
    assert!(beyond.is_empty(), "identical sweeps on an idle server called different: {beyond:?}");
    assert!(b["conclusions"].as_array().unwrap().iter().any(|c| c.as_str().unwrap().contains("no figure changed beyond its interval")));

    let hog = common::Hog::start();
    let pids: Vec<u32> = hog.0.iter().map(|c| c.id()).collect();
    let (code, c, printed) = bench_exit(&out_dir("repeat-c"), &with_base);
    drop(hog);
    assert_eq!(code, Some(3), "the gate let a run beside a CPU hog pass: {printed}");
    let gate = printed.lines().find(|l| l.starts_with("probe bench: --fail-on-regression 50")).unwrap_or_else(|| panic!("{printed}"));
    assert!(gate.contains("got worse by more than 50%") && gate.contains("cpuhog (pid "), "the gate does not name the competitor: {gate}");
    let changed: Vec<&Value> = c["baseline"]["figures"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["beyond_intervals"] == true && f["worse"] == true)
        .filter(|f| ["ttft_ms_p50", "ttft_ms_mean", "tpot_ms_mean", "e2e_ms_mean"].contains(&f["figure"].as_str().unwrap()))
        .collect();
    assert!(!changed.is_empty(), "a CPU hog beside the server changed nothing: {}", c["baseline"]);
    for l in c["levels"].as_array().unwrap() {
        assert_eq!(l["contended"], true, "{}", l["machine"]);
        let named: Vec<u64> = l["machine"]["competitors"].as_array().unwrap().iter().map(|x| x["pid"].as_u64().unwrap()).collect();
        assert!(pids.iter().any(|p| named.contains(&u64::from(*p))), "the hog {pids:?} is not named: {}", l["machine"]);
    }
    let words = c["conclusions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect::<Vec<_>>().join("\n");
    assert!(words.contains("changed beyond their intervals") && words.contains("ran under contention"), "{words}");
}

/// Goodput against an SLO: every request meets a loose bound; under a TPOT bound at the median the
/// client measured, goodput counts exactly the requests whose own TPOT (the client's clock) met
/// it; an impossible bound leaves none; the old flag is the same bound under its alias.
#[test]
fn goodput_falls_as_the_slo_tightens() {
    let _t = turn();
    let base = ["--url", &server().url, "--levels", "1,2", "--requests-per-level", "4", "--max-tokens", "16", "--ignore-eos"];
    let run = |name: &str, extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend(extra);
        bench(&out_dir(name), &a)
    };
    let loose = run("slo-loose", &["--slo", "ttft=60s,tpot=10s,e2e=120s"]);
    let good = |v: &Value| -> f64 {
        v["levels"].as_array().unwrap().iter().map(|l| l["goodput_rps"].as_f64().unwrap() * l["duration_s"].as_f64().unwrap()).sum()
    };
    assert!(loose["levels"].as_array().unwrap().iter().all(|l| l["goodput_pct"] == 100.0), "{}", loose["levels"]);
    let mut tpot: Vec<f64> = loose["rows"].as_array().unwrap().iter().filter_map(|r| r["tpot_ms"].as_f64()).collect();
    tpot.sort_by(f64::total_cmp);
    let median = tpot[tpot.len() / 2];
    let bound = format!("tpot={median:.3}ms");
    let tight = run("slo-tight", &["--slo", &bound]);
    // The rows' own TPOT (the client's clock) against the bound decides each request.
    for r in tight["rows"].as_array().unwrap() {
        assert_eq!(r["met_slo"].as_bool(), Some(r["tpot_ms"].as_f64().unwrap() <= (median * 1000.0).round() / 1000.0), "{r}");
    }
    // Goodput is exactly the requests that met it (a second run has timings of its own: a bound
    // at the first run's median can leave all of it, or none, on one side).
    let rows = |v: &Value| v["rows"].as_array().unwrap().len() as f64;
    let met = tight["rows"].as_array().unwrap().iter().filter(|r| r["met_slo"] == true).count() as f64;
    assert!((good(&tight) - met).abs() < 0.5, "goodput {} requests, {met} met the bound", good(&tight));
    assert!((good(&loose) - rows(&loose)).abs() < 0.5, "goodput {} requests of {} under a loose bound", good(&loose), rows(&loose));
    eprintln!("goodput: {met} of {} requests under {bound}, {:.0} of {} under the loose bound", rows(&tight), good(&loose), rows(&loose));
    let words = tight["conclusions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect::<Vec<_>>().join("\n");
    assert!(words.contains("goodput (tpot="), "{words}");
    let alias = run("slo-alias", &["--goodput-tpot-ms", "0.001"]);
    assert!(alias["levels"].as_array().unwrap().iter().all(|l| l["goodput_pct"] == 0.0), "{}", alias["levels"]);
    assert_eq!(alias["config"]["slo"]["tpot_ms"], 0.001);
}

/// Kolmogorov-Smirnov distance between the gaps and an exponential law of `rate` per second.
fn ks_exponential(gaps_ms: &[f64], rate: f64) -> f64 {
    let mut g = gaps_ms.to_vec();
    g.sort_by(f64::total_cmp);
    let n = g.len() as f64;
    g.iter()
        .enumerate()
        .map(|(i, x)| {
            let f = 1.0 - (-rate * x / 1e3).exp();
            (f - i as f64 / n).abs().max(((i + 1) as f64 / n - f).abs())
        })
        .fold(0.0, f64::max)
}

/// Poisson arrivals: the times the requests were sent (the client's clock) have exponential
/// gaps at the rate asked for (a KS test at 5%), and not at twice that rate.
#[test]
fn poisson_arrivals_fit_their_rate() {
    let _t = turn();
    let dir = out_dir("rate");
    let v = bench(
        &dir,
        &["--url", &server().url, "--sweep", "rate", "--rate", "5", "--requests-per-level", "60", "--max-tokens", "4", "--ignore-eos"],
    );
    let mut sent: Vec<f64> = v["rows"].as_array().unwrap().iter().map(|r| r["sent_ms"].as_f64().unwrap()).collect();
    assert_eq!(sent.len(), 60);
    sent.sort_by(f64::total_cmp);
    let gaps: Vec<f64> = sent.windows(2).map(|w| w[1] - w[0]).collect();
    let critical = 1.36 / (gaps.len() as f64).sqrt();
    let d = ks_exponential(&gaps, 5.0);
    assert!(d < critical, "KS distance {d:.3} >= {critical:.3}: the gaps {gaps:?} are not exponential at 5/s");
    let wrong = ks_exponential(&gaps, 10.0);
    assert!(wrong > critical, "the test cannot tell 5/s from 10/s ({wrong:.3})");
    let l = &v["levels"][0];
    assert_eq!((l["sweep"].as_str(), l["rate_rps"].as_f64()), (Some("rate"), Some(5.0)));
    assert!(l["ok"] == 60, "{l}");
    assert!(std::fs::read_to_string(dir.join("summary.txt")).unwrap().contains("rate sweep"));
    assert!(dir.join("rate-latency.svg").exists());
}

/// The shared-prefix workload: after the first request, the server reports the shared system
/// prompt as cached tokens (its own counts); the multi-turn workload's prompts grow turn by turn
/// and later turns reuse the conversation so far.
#[test]
fn shared_prefix_and_multi_turn_reuse_the_prompt_cache() {
    let _t = turn();
    let url = &server().url;
    let pdir = out_dir("prefix");
    let p = bench(
        &pdir,
        &["--url", url, "--sweep", "prefix", "--levels", "1", "--prefix-tokens", "300", "--prefix-requests", "4", "--max-tokens", "8"],
    );
    let rows = p["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let first = rows.iter().find(|r| r["index"] == 0).unwrap();
    assert!(first["cached_tokens"].as_u64().unwrap_or(0) < 100, "the first request found the prefix cached: {first}");
    for r in rows.iter().filter(|r| r["index"] != 0) {
        let (cached, prompt) = (r["cached_tokens"].as_u64().unwrap(), r["prompt_tokens"].as_u64().unwrap());
        assert!(cached >= 250 && cached < prompt, "{cached} of {prompt} prompt tokens cached: {r}");
    }
    assert!(p["levels"][0]["reuse_pct"].as_f64().unwrap() > 70.0, "{}", p["levels"][0]);
    assert!(pdir.join("prefix-cache.svg").exists());

    let mdir = out_dir("multiturn");
    let m = bench(&mdir, &["--url", url, "--api", "chat", "--sweep", "multiturn", "--levels", "1", "--turns", "3", "--max-tokens", "24"]);
    let mut turns: Vec<(u64, u64, u64)> = m["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["turn"].as_u64().unwrap(), r["prompt_tokens"].as_u64().unwrap(), r["cached_tokens"].as_u64().unwrap_or(0)))
        .collect();
    turns.sort();
    assert_eq!(turns.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(turns[1].1 > turns[0].1 && turns[2].1 > turns[1].1, "prompts do not grow: {turns:?}");
    assert!(turns[1].2 >= turns[0].1 / 2 && turns[2].2 >= turns[1].1 / 2, "later turns did not reuse the conversation: {turns:?}");
    assert!(mdir.join("multiturn-turns.svg").exists());
}

/// `--compare-with aiperf`: AIPerf's own CLI (from PyPI, `AIPERF`) on the same server, prompts
/// and output length at concurrency 1, niced and lean. Both tools' TTFT and output tokens/s
/// agree within 10%, or the gap is the server itself running slower while AIPerf ran: checked
/// against the server's own per-token time (`timings` of a request sent after each tool).
#[test]
fn side_by_side_with_aiperf_agrees() {
    let _t = turn();
    let aiperf = env_path("AIPERF");
    let tokenizer = env_path("VLLM_MODEL");
    let dir = out_dir("aiperf");
    let v = bench(
        &dir,
        &[
            "--url",
            &server().url,
            "--levels",
            "1",
            "--requests-per-level",
            "6",
            "--max-tokens",
            "48",
            "--ignore-eos",
            "--compare-with",
            "aiperf",
            "--aiperf",
            aiperf.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
        ],
    );
    let p = &v["compared_with"]["levels"][0];
    assert!(p.is_object(), "no side-by-side figures: {}", v["notes"]);
    let within = |a: &str, b: &str, tol: f64| {
        let (x, y) = (p[a].as_f64().unwrap(), p[b].as_f64().unwrap());
        ((y - x) / x).abs() <= tol
    };
    assert!(within("probe_output_tokens_mean", "aiperf_output_tokens_mean", 0.02), "the tools counted different outputs: {p}");
    // TTFT within 10%, or the gap is the server's own: its prompt time (timings.prompt_ms, read
    // from each tool's answers) differs by about as much, and what is left agrees.
    if !within("probe_ttft_ms_mean", "aiperf_ttft_ms_mean", 0.10) {
        let why = p["explained"].as_str().unwrap_or_else(|| panic!("TTFT mean differs by more than 10%, unexplained: {p}"));
        let (sa, sb) = (p["probe_server_prompt_ms"].as_f64().unwrap(), p["aiperf_server_prompt_ms"].as_f64().unwrap());
        let (ta, tb) = (p["probe_ttft_ms_mean"].as_f64().unwrap(), p["aiperf_ttft_ms_mean"].as_f64().unwrap());
        assert!((sb - sa).signum() == (tb - ta).signum(), "{why}: {p}");
        assert!(((tb - sb) - (ta - sa)).abs() <= (0.1 * ta).max(20.0), "{why}: {p}");
    }
    // Each tool's ITL against the server's own time per token (timings.predicted_per_token_ms
    // of the answers it got): both measure the server, within 10%.
    assert!(within("probe_server_tpot_ms", "probe_itl_ms_mean", 0.10), "probe's ITL is not the server's per-token time: {p}");
    assert!(within("aiperf_server_tpot_ms", "aiperf_itl_ms_mean", 0.10), "AIPerf's ITL is not the server's per-token time: {p}");
    // Between the tools: within 10%, or the server itself ran at another speed (said, with numbers).
    for (a, b) in [("probe_itl_ms_mean", "aiperf_itl_ms_mean"), ("probe_output_tps", "aiperf_output_tps")] {
        assert!(within(a, b, 0.10) || p["explained_itl"].is_string(), "{a} and {b} differ by more than 10%, unexplained: {p}");
    }
    // AIPerf's own files are there; the prompts it was given are not kept.
    let export = std::path::PathBuf::from(p["export"].as_str().unwrap());
    assert!(export.exists(), "{}", export.display());
    assert!(!dir.join("aiperf-1/prompts.jsonl").exists() && !dir.join("aiperf-1/inputs.json").exists());
    assert!(!dir.join("aiperf-1/profile_export_raw.jsonl").exists(), "the answers' text was kept");
    let summary = std::fs::read_to_string(dir.join("summary.txt")).unwrap();
    assert!(summary.contains("probe bench beside aiperf"), "{summary}");
}
