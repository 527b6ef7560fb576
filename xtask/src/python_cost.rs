//! `cargo xtask bench --python`: what Python frames cost. llama-cpp-python's and vLLM's servers
//! with the tests' plugin (tests/data/python/probe_plugin.py) under the same load — a pure-Python
//! route spinning 200 ms, then a 16-token completion, over and over — traced at 99 Hz with Python
//! frames and with `--no-python-frames`, alternately (on, off, on, off), by the same binary.
//! Printed per run: the stack programs' time per run (cpu_sample, sched_switch: the frame walk
//! runs in them), probe's process and its BPF programs as a share of one core, from each
//! recording's report.json (probe's own /proc and bpf_stats accounting).
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::report::Report;

const LOAD: Duration = Duration::from_secs(10);
const RUNS: usize = 2;

struct Server {
    name: &'static str,
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling the process group the server was started in.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn(name: &'static str, mut cmd: Command, port: u16, ready: &str) -> anyhow::Result<Server> {
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid in the child before exec: its own process group, killed as one.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().with_context(|| format!("cannot start {name}"))?;
    let s = Server { name, child, addr: format!("127.0.0.1:{port}") };
    let t = Instant::now();
    while !crate::workload::http_get_ok(&s.addr, ready) {
        if t.elapsed() > Duration::from_secs(300) {
            bail!("{name} did not answer {ready} within 300 s");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok(s)
}

fn plugin_dir() -> PathBuf {
    crate::setup::root().join("tests/data/python")
}

fn llama_cpp_python() -> anyhow::Result<Server> {
    let port = free_port()?;
    let mut cmd = Command::new(crate::setup::llama_python()?);
    cmd.arg(plugin_dir().join("llama_cpp_server.py")).arg(crate::setup::llama()?.1).arg(port.to_string());
    spawn("llama-cpp-python", cmd, port, "/v1/models")
}

fn vllm() -> anyhow::Result<Server> {
    let port = free_port()?;
    let (python, model) = crate::setup::vllm(&crate::setup::llama()?.1)?;
    let mut cmd = Command::new(python);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model", &model, "--served-model-name", "model", "--host", "127.0.0.1"]);
    cmd.args(["--port", &port.to_string(), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256"]);
    cmd.args(["--middleware", "probe_plugin.ProbeTestMiddleware"]);
    cmd.env("PYTHONPATH", plugin_dir()).envs([("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")]);
    cmd.env("VLLM_CACHE_ROOT", crate::setup::root().join("target/tmp/vllm-cache"));
    spawn("vLLM", cmd, port, "/health")
}

/// One request over a fresh connection; the body is read and dropped.
fn request(addr: &str, method: &str, path: &str, body: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    if !out.starts_with(b"HTTP/1.1 200") {
        bail!("{method} {path}: {}", String::from_utf8_lossy(&out[..out.len().min(200)]));
    }
    Ok(())
}

fn load(addr: &str) -> anyhow::Result<()> {
    let body = r#"{"model":"model","prompt":"The capital of France is","max_tokens":16,"temperature":0,"seed":1}"#;
    let t = Instant::now();
    while t.elapsed() < LOAD {
        request(addr, "GET", "/probe-test/spin?ms=200", "")?;
        request(addr, "POST", "/v1/completions", body)?;
    }
    Ok(())
}

/// One traced stretch of load: its report. Python frames without their budget (`--python-budget
/// 0`): the figure is what they cost, and whether it fits the default budget is printed.
fn traced(s: &Server, python: bool, dir: &Path, name: &str) -> anyhow::Result<Report> {
    let rec = dir.join(name);
    let _ = std::fs::remove_dir_all(&rec);
    let mut cmd = Command::new(crate::setup::bin("probe"));
    cmd.args(["trace", "-q", "--hz", "99", "--pid", &s.child.id().to_string(), "--out"]).arg(&rec);
    if python {
        cmd.args(["--python-budget", "0"]);
    } else {
        cmd.arg("--no-python-frames");
    }
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let t = Instant::now();
    while !rec.join("events.bin").exists() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("probe did not start recording in {}", rec.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // The plugin's route and the completion path warm once before the measured stretch.
    request(&s.addr, "GET", "/probe-test/spin?ms=10", "")?;
    load(&s.addr)?;
    // SAFETY: signalling the probe child started here.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait()?;
    Report::read(&rec)
}

pub fn bench_python() -> anyhow::Result<()> {
    let dir = crate::setup::root().join("target/bench/python");
    std::fs::create_dir_all(&dir)?;
    println!("Python frames: cost at 99 Hz, the same load traced with and without (--no-python-frames), alternately");
    println!(
        "{:<18} {:<7} {:>22} {:>24} {:>9} {:>8} {:>8} {:>20} {:>9}",
        "server", "frames", "cpu_sample µs × runs/s", "sched_switch µs × runs/s", "process", "BPF", "total", "walk µs × walks/s", "own"
    );
    for start in [llama_cpp_python as fn() -> anyhow::Result<Server>, vllm] {
        let s = start()?;
        for i in 0..RUNS {
            for python in [true, false] {
                let r = traced(&s, python, &dir, &format!("{}-{}-{i}", s.name, if python { "on" } else { "off" }))?;
                let c = &r.cost;
                // The Python frames' own work, as their budget counts it: the kernel's walks
                // and probe's reading and naming, a share of one core.
                let secs = r.duration_s.max(1e-9);
                let walks = r.counter("python_walks") as f64;
                let walk_ns = r.counter("python_walk_ns") as f64;
                let work_ns = r.python.work_ns as f64;
                let own = (walk_ns + work_ns) / secs / 1e7;
                let (cpu_ns, cpu_rate) = c.program("cpu_sample");
                let (sw_ns, sw_rate) = c.program("sched_switch");
                println!(
                    "{:<18} {:<7} {:>12.1} × {:>7.0} {:>14.1} × {:>7.0} {:>8.2}% {:>7.2}% {:>7.2}% {:>10.1} × {:>7.0} {:>8.2}%",
                    s.name,
                    if python { "python" } else { "native" },
                    cpu_ns / 1e3,
                    cpu_rate,
                    sw_ns / 1e3,
                    sw_rate,
                    c.probe_pct,
                    c.bpf_pct,
                    c.pct_of_core,
                    if walks > 0.0 { walk_ns / walks / 1e3 } else { 0.0 },
                    walks / secs,
                    own
                );
            }
        }
    }
    println!(
        "(each row {} s of load; own: the Python frames' own work, which --python-budget bounds (default 1%); recordings in {})",
        LOAD.as_secs(),
        dir.display()
    );
    Ok(())
}
