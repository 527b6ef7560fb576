//! Python frames in real Python servers: llama-cpp-python's and vLLM's OpenAI servers, each with
//! probe's test plugin (tests/data/python/probe_plugin.py: ASGI middleware with a route that
//! spins in a named pure-Python function and one that blocks in another) traced by the real probe.
//! The truth is the plugin's own clock: the CPU time its function's thread spent in it
//! (`time.thread_time`) and how long its `recv` waited.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

mod common;
use common::{Vllm, env_path, http, probe_bin, serial, start_trace};

/// The CPU sampling rate of `probe trace` (its default).
const CPU_HZ: f64 = 99.0;

fn plugin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/python")
}

fn out_dir(name: &str) -> PathBuf {
    common::out_dir(&format!("python-{name}"))
}

/// llama-cpp-python's server with the plugin around its app (tests/data/python/llama_cpp_server.py).
struct LlamaCppPython(Child, SocketAddr);

impl Drop for LlamaCppPython {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn llama_cpp_python() -> LlamaCppPython {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(env_path("LLAMA_PYTHON"))
        .arg(plugin_dir().join("llama_cpp_server.py"))
        .arg(env_path("LLAMA_MODEL"))
        .arg(port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start llama-cpp-python's server");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let s = LlamaCppPython(child, addr);
    let t = Instant::now();
    while !http(addr, "GET", "/v1/models", None, &[]).is_ok_and(|r| r.0 == 200) {
        assert!(t.elapsed() < Duration::from_secs(120), "llama-cpp-python's server did not answer within 120 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    s
}

fn get(addr: SocketAddr, path: &str) -> Value {
    let (status, body) = http(addr, "GET", path, None, &[]).unwrap();
    assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// What the plugin measured of its own functions while probe traced the server.
struct Measured {
    spin_cpu_s: f64,
    blocked_s: f64,
    /// The blocked thread: its tid and its name in `threading`.
    blocked_thread: (u64, String),
}

/// Trace `pid` while the plugin spins for 3 s and blocks for 0.5 s and `work` runs the server's
/// own requests; returns the recording and the plugin's figures.
fn traced(pid: u32, addr: SocketAddr, name: &str, work: impl FnOnce()) -> (PathBuf, Measured) {
    let out = out_dir(name);
    let (mut p, rx, _armed) = start_trace(&["--pid", &pid.to_string(), "--out", out.to_str().unwrap()]);
    // The route's thread runs once before the figures are taken.
    get(addr, "/probe-test/spin?ms=50");
    let spin_cpu_s = get(addr, "/probe-test/spin?ms=3000")["thread_cpu_s"].as_f64().unwrap();
    let blocked = get(addr, "/probe-test/block?ms=500");
    let blocked_s = blocked["blocked_s"].as_f64().unwrap();
    let blocked_thread = (blocked["native_id"].as_u64().unwrap(), blocked["thread"].as_str().unwrap().to_string());
    work();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signalling the probe child we started.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    let st = p.wait().unwrap();
    let err: Vec<String> = rx.try_iter().collect();
    assert!(st.success(), "probe: {err:?}");
    assert!(!err.iter().any(|l| l.contains("Python frames not read")), "{err:?}");
    (out, Measured { spin_cpu_s, blocked_s, blocked_thread })
}

/// (stack, samples) of a folded flamegraph.
fn folded(path: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.rsplit_once(' ').map(|(s, n)| (s.to_string(), n.parse().unwrap())))
        .collect()
}

fn weight(f: &[(String, u64)], frame: &str) -> u64 {
    f.iter().filter(|(s, _)| s.split(';').any(|x| x.starts_with(frame))).map(|(_, n)| n).sum()
}

/// What every Python server's trace must show: the spin under its function's name for the CPU
/// time the plugin measured (within 10%), the blocking request's own off-CPU window under the
/// function that blocked, with native frames kept above and below.
fn check_plugin(out: &Path, m: &Measured) {
    let cpu = folded(&out.join("flame-cpu.folded"));
    let spun = weight(&cpu, "probe_plugin.probe_plugin_spin (probe_plugin.py:") as f64 / CPU_HZ;
    assert!(
        (spun - m.spin_cpu_s).abs() <= m.spin_cpu_s * 0.10,
        "probe_plugin_spin: {spun:.2} s of CPU samples, the plugin measured {:.2} s in it",
        m.spin_cpu_s
    );
    // Native frames stay between the Python ones (the interpreter's C calls: an await's
    // `PyGen_am_send`, a C function's call).
    assert!(
        cpu.iter().any(|(s, _)| s.contains("probe_plugin.probe_plugin_spin") && s.split(';').skip(1).any(|f| !f.contains(".py"))),
        "no native frames among the Python ones"
    );
    let r = common::read_report(out);
    let q = r["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["path"].as_str().is_some_and(|p| p.starts_with("/probe-test/block")))
        .unwrap_or_else(|| panic!("the blocking request is not in the report"));
    let id = q["id"].as_u64().unwrap();
    // Its critical path says where the thread blocked: the function, under its caller, for the
    // time the plugin's own clock measured the recv waiting.
    let path = &q["verdict"]["critical_path"];
    let waits: Vec<(f64, &str)> = path["threads"]
        .as_array()
        .unwrap_or_else(|| panic!("no critical path: {q}"))
        .iter()
        .flat_map(|t| t["waits"].as_array().into_iter().flatten())
        .map(|w| (w["ms"].as_f64().unwrap(), w["site"].as_str().unwrap()))
        .collect();
    let at_block: f64 = waits
        .iter()
        .filter(|(_, s)| {
            s.contains(" in probe_plugin.probe_plugin_block (probe_plugin.py:")
                && s.contains(" under probe_plugin.ProbeTestMiddleware.__call__ (probe_plugin.py:")
        })
        .map(|w| w.0)
        .sum();
    let want = m.blocked_s * 1e3;
    assert!(
        (at_block - want).abs() <= want * 0.10 + 20.0,
        "critical path blocked {at_block:.0} ms in probe_plugin_block, the plugin waited {want:.0} ms: {waits:?}"
    );
    // It is the thread the plugin ran in, and the timeline names it as `threading` does.
    let (tid, name) = &m.blocked_thread;
    let waited: Vec<u64> = path["threads"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["waits"].as_array().is_some_and(|w| !w.is_empty()))
        .filter_map(|t| t["tid"].as_u64())
        .collect();
    assert_eq!(waited, vec![*tid], "{path}");
    let tl = out.join("python-timeline.json");
    let st = Command::new(probe_bin()).arg("timeline").arg(out).arg("-o").arg(&tl).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let tl = std::fs::read_to_string(&tl).unwrap();
    assert!(tl.contains(&format!(" · {name} ({tid})\"")), "thread {tid} is not named {name:?} in the timeline");
    let svg = out.join("block-offcpu.svg");
    let st = Command::new(probe_bin())
        .args(["flamegraph", "--kind", "offcpu", "--request", &id.to_string(), "-o"])
        .arg(&svg)
        .arg(out)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let off = folded(&svg.with_extension("folded"));
    let blocked_us = weight(&off, "probe_plugin.probe_plugin_block (probe_plugin.py:") as f64;
    assert!(
        blocked_us / 1e6 >= m.blocked_s * 0.9,
        "request {id}'s off-CPU window holds {:.3} s under probe_plugin_block, the plugin waited {:.3} s: {off:?}",
        blocked_us / 1e6,
        m.blocked_s
    );
    // The wait's kernel side is below it (the socket read).
    assert!(off.iter().any(|(s, _)| s.contains("probe_plugin.probe_plugin_block") && s.contains("_[k]")), "{off:?}");
}

/// llama-cpp-python: the plugin's figures, and the server's own Python named as its source names
/// it (llama_cpp/llama.py: `Llama.eval` calls `LlamaContext.decode`, which runs ggml) over the
/// native frames of the model's work.
#[test]
fn llama_cpp_python_stacks_name_the_python_that_ran() {
    let _serial = serial();
    let server = llama_cpp_python();
    let addr = server.1;
    let (out, m) = traced(server.0.id(), addr, "llama-cpp", || {
        for _ in 0..3 {
            let body = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "seed": 1});
            let (status, _) = http(addr, "POST", "/v1/completions", Some(&body), &[]).unwrap();
            assert_eq!(status, 200);
        }
    });
    check_plugin(&out, &m);
    let cpu = folded(&out.join("flame-cpu.folded"));
    let decode: u64 = cpu
        .iter()
        .filter(|(s, _)| {
            let (py, native) = s.split_once("llama_cpp._internals.LlamaContext.decode (_internals.py:").unwrap_or_default();
            py.contains("llama_cpp.llama.Llama.eval (llama.py:") && native.contains("ggml")
        })
        .map(|(_, n)| n)
        .sum();
    assert!(decode > 0, "no ggml work under llama_cpp.llama.Llama.eval → LlamaContext.decode");
}

/// Python frames that cost more than their budget are turned off within its window and the
/// report says so; the trace goes on with native frames. A budget of 0.001% of a core (10 µs a
/// second) is past at the first samples of a pure-Python spin: of its 10 s, at most the first
/// window's 5 s are named (its first look is at the second turn, and a turn may come late).
#[test]
fn python_frames_past_their_budget_are_turned_off() {
    let _serial = serial();
    let server = llama_cpp_python();
    let out = out_dir("budget");
    let (mut p, rx, _armed) =
        start_trace(&["--pid", &server.0.id().to_string(), "--python-budget", "0.001", "--out", out.to_str().unwrap()]);
    let spin_cpu_s = get(server.1, "/probe-test/spin?ms=10000")["thread_cpu_s"].as_f64().unwrap();
    // SAFETY: signalling the probe child we started.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    assert!(p.wait().unwrap().success());
    let err: Vec<String> = rx.try_iter().collect();
    assert!(err.iter().any(|l| l.contains("Python frames turned off")), "{err:?}");
    let r = common::read_report(&out);
    let off = r["python"]["off"].as_str().unwrap_or_else(|| panic!("no python.off in the report: {}", r["python"]));
    assert!(off.contains("over the budget of 0.001%"), "{off}");
    assert!(r["problems"].as_array().unwrap().iter().any(|p| p == off), "{}", r["problems"]);
    assert!(r["counters"]["python_walks"].as_u64().unwrap() > 0 && r["python"]["work_ns"].as_u64().unwrap() > 0, "{}", r["python"]);
    let cpu = folded(&out.join("flame-cpu.folded"));
    let named = weight(&cpu, "probe_plugin.probe_plugin_spin (probe_plugin.py:") as f64 / CPU_HZ;
    assert!(
        named > 0.5 && named <= 8.5 && named < spin_cpu_s - 1.0,
        "{named:.2} s of the spin's {spin_cpu_s:.2} s named after the budget passed"
    );
}

/// vLLM (CPU build): the plugin loaded as its `--middleware`; vLLM's own Python named from its
/// modules, its model forward (in a worker process probe follows as a descendant) over torch's
/// native work.
#[test]
fn vllm_stacks_name_the_python_that_ran() {
    let _serial = serial();
    let path = plugin_dir();
    let v = Vllm::start_env(
        &["--max-model-len", "256", "--middleware", "probe_plugin.ProbeTestMiddleware"],
        &[("PYTHONPATH", path.to_str().unwrap())],
    );
    let addr = v.addr;
    let (out, m) = traced(v.child.id(), addr, "vllm", || {
        for _ in 0..3 {
            let body =
                serde_json::json!({"model": "model", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "seed": 1});
            let (status, _) = http(addr, "POST", "/v1/completions", Some(&body), &[]).unwrap();
            assert_eq!(status, 200);
        }
    });
    check_plugin(&out, &m);
    let cpu = folded(&out.join("flame-cpu.folded"));
    let vllm = weight(&cpu, "vllm.");
    assert!(vllm > 0, "no vLLM Python frame in the CPU graph");
    // The model's forward pass (vllm/model_executor/models/llama.py for this model, in a worker
    // process) over the native work it called (torch's kernels).
    let forward: u64 = cpu
        .iter()
        .filter(|(s, _)| {
            s.split_once("vllm.model_executor.models.").is_some_and(|(_, below)| below.split(';').skip(1).any(|f| !f.contains(".py")))
        })
        .map(|(_, n)| n)
        .sum();
    assert!(
        forward > 0,
        "no native work under vLLM's model forward: {:?}",
        cpu.iter().map(|(s, _)| s.rsplit(';').next().unwrap_or_default()).take(20).collect::<Vec<_>>()
    );
}
