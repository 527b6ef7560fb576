//! Samplers that run beside the kernel probes, on the same CLOCK_MONOTONIC clock: GPU clocks and
//! memory (NVML, behind a trait), CPU frequency, memory pressure and the target's RSS (10 Hz by
//! default), page-cache residency of the model files (every second, at the end, and on SIGUSR1),
//! and the server's own endpoints (every 2 s). Each reading becomes a JSON record in the
//! recording; a source the machine lacks is described once in the `samplers` record, never an error.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::{monotonic_ns, procfs};

pub mod endpoints;
pub mod gpu;
pub mod host;
pub mod residency;

/// How often the server's endpoints are polled (each poll is 2-3 small HTTP requests the server
/// answers between decode steps; its counters change slowly).
pub const POLL_EVERY: Duration = Duration::from_secs(2);

/// Files at least this big that the target maps or opens are watched for residency (weights).
pub const MODEL_FILE_MIN_BYTES: u64 = 16 << 20;

#[derive(Clone, Debug)]
pub struct Options {
    pub pid: u32,
    /// The processes being traced, kept current by the collector (forks join, exits leave), so
    /// the samplers never scan /proc for descendants.
    pub targets: Arc<Mutex<Vec<u32>>>,
    /// GPU / CPU-frequency / memory samples per second; 0 turns them off.
    pub hz: f64,
    /// Poll the server's HTTP endpoints.
    pub poll: bool,
}

pub struct Sampler {
    rx: mpsc::Receiver<Value>,
    stop: Arc<AtomicBool>,
    snapshot: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn targets(opts: &Options) -> Vec<u32> {
    opts.targets.lock().map(|t| t.clone()).unwrap_or_else(|_| vec![opts.pid])
}

/// The big-file list is refreshed this often (residency itself is measured every second).
const FILE_SCAN_EVERY: Duration = Duration::from_secs(5);

impl Sampler {
    pub fn start(opts: Options) -> Sampler {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let snapshot = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        {
            let (tx, stop, snapshot, opts) = (tx.clone(), stop.clone(), snapshot.clone(), opts.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("probe-sample".into())
                    .spawn(move || sample_loop(&opts, &tx, &stop, &snapshot))
                    .expect("spawn sampler"),
            );
        }
        if opts.poll {
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new().name("probe-poll".into()).spawn(move || poll_loop(&opts, &tx, &stop)).expect("spawn poller"),
            );
        }
        Sampler { rx, stop, snapshot, threads }
    }

    /// Records gathered since the last call.
    pub fn drain(&self) -> Vec<Value> {
        self.rx.try_iter().collect()
    }

    /// Measure residency now (SIGUSR1).
    pub fn snapshot_now(&self) {
        self.snapshot.store(true, Ordering::Relaxed);
    }

    /// Stop the threads (they take a last residency and memory reading) and return what is
    /// left, waiting at most `within`: a thread still busy then (a read from a stuck server) is
    /// left behind, named in the second list, and ends with the process.
    pub fn stop(mut self, within: Duration) -> (Vec<Value>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let until = Instant::now() + within;
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut abandoned = Vec::new();
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            } else {
                abandoned.push(t.thread().name().unwrap_or("sampler").to_string());
            }
        }
        (self.drain(), abandoned)
    }
}

/// Sleep up to `d` in small steps, returning early when stopped.
fn nap(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= until {
            break;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(20)));
    }
}

fn sample_loop(opts: &Options, tx: &mpsc::Sender<Value>, stop: &AtomicBool, snapshot: &AtomicBool) {
    let mut gpu = gpu::open();
    let freq = host::cpufreq();
    let cgroup = host::memory_cgroup(opts.pid);
    let mut info = json!({
        "type": "samplers", "ts_ns": monotonic_ns(), "hz": opts.hz,
        "cpufreq_max_khz": freq.as_ref().map(|f| f.max_khz.clone()),
        "psi": std::path::Path::new("/proc/pressure/memory").exists(),
        "memory_cgroup": cgroup.as_ref().map(|c| c.display().to_string()),
    });
    match &mut gpu {
        Ok(g) => info["gpus"] = json!(g.devices()),
        Err(why) => info["gpu_absent"] = json!(why),
    }
    if freq.is_none() {
        info["cpufreq_absent"] = json!("no cpufreq in this kernel (VM or driver): CPU clocks not sampled");
    }
    let _ = tx.send(info);
    let mut files: Vec<residency::Watched> = Vec::new();
    let mut pids = targets(opts);
    let mut last_slow: Option<Instant> = None;
    let mut last_file_scan: Option<Instant> = None;
    let period = if opts.hz > 0.0 { Duration::from_secs_f64(1.0 / opts.hz) } else { Duration::from_secs(1) };
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        let slow_due = last_slow.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if slow_due || stopping {
            last_slow = Some(Instant::now());
            pids = targets(opts);
        }
        if opts.hz > 0.0 || stopping {
            if let Ok(g) = &mut gpu {
                let s = g.sample(&pids);
                if !s.is_empty() {
                    let _ = tx.send(json!({"type": "gpu", "ts_ns": monotonic_ns(), "gpus": s}));
                }
            }
            if freq.is_some()
                && let Some(f) = host::cpufreq()
            {
                let _ = tx.send(json!({"type": "cpufreq", "ts_ns": monotonic_ns(), "cur_khz": f.cur_khz}));
            }
            let mut m = host::mem(opts.pid, cgroup.as_deref());
            // Children (Ollama's runner) count towards the target's memory.
            for &p in pids.iter().filter(|&&p| p != opts.pid) {
                let c = host::mem(p, None);
                for (a, b) in [(&mut m.rss_kib, c.rss_kib), (&mut m.rss_file_kib, c.rss_file_kib), (&mut m.rss_anon_kib, c.rss_anon_kib)] {
                    *a = Some(a.unwrap_or(0) + b.unwrap_or(0));
                }
            }
            let mut v = serde_json::to_value(&m).unwrap_or(Value::Null);
            v["type"] = json!("mem");
            v["ts_ns"] = json!(monotonic_ns());
            let _ = tx.send(v);
        }
        let on_demand = snapshot.swap(false, Ordering::Relaxed);
        if (slow_due || stopping)
            && let Some(c) = host::cpuidle()
        {
            let mut v = serde_json::to_value(&c).unwrap_or(Value::Null);
            v["type"] = json!("cpuidle");
            v["ts_ns"] = json!(monotonic_ns());
            let _ = tx.send(v);
        }
        if slow_due || stopping || on_demand {
            if last_file_scan.is_none_or(|t| t.elapsed() >= FILE_SCAN_EVERY) || stopping || on_demand {
                last_file_scan = Some(Instant::now());
                for &p in &pids {
                    let known: Vec<_> = files.iter().map(|f| f.ident).collect();
                    files.extend(residency::big_files(p, MODEL_FILE_MIN_BYTES, &known));
                }
            }
            if !files.is_empty() {
                let r: Vec<residency::Residency> = files.iter().filter_map(residency::Watched::measure).collect();
                let why = if stopping {
                    "end"
                } else if on_demand {
                    "on_demand"
                } else {
                    "periodic"
                };
                let _ = tx.send(json!({"type": "residency", "ts_ns": monotonic_ns(), "why": why, "files": r}));
            }
        }
        if stopping {
            break;
        }
        nap(period, stop);
    }
}

fn poll_loop(opts: &Options, tx: &mpsc::Sender<Value>, stop: &AtomicBool) {
    let mut eps: Vec<endpoints::Endpoint> = Vec::new();
    let mut dead: Vec<std::net::SocketAddr> = Vec::new();
    // Reading /proc/net/tcp walks the kernel's whole TCP hash table (most of this thread's CPU
    // when done every poll): listeners are looked up when the target set changes, else every 30 s.
    let (mut scanned_for, mut scanned_at): (Vec<u32>, Option<Instant>) = (Vec::new(), None);
    while !stop.load(Ordering::Relaxed) {
        let pids = targets(opts);
        if pids != scanned_for || scanned_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
            for &pid in &pids {
                for addr in procfs::listen_addrs(pid) {
                    // One endpoint per port (a dual-stack server lists two addresses).
                    if !eps.iter().any(|e| e.addr.port() == addr.port()) && !dead.contains(&addr) {
                        eps.push(endpoints::Endpoint::new(addr));
                    }
                }
            }
            (scanned_for, scanned_at) = (pids, Some(Instant::now()));
        }
        let mut i = 0;
        while i < eps.len() {
            let t = monotonic_ns();
            match eps[i].poll() {
                Some(mut rec) => {
                    rec["ts_ns"] = json!(t);
                    let _ = tx.send(rec);
                    i += 1;
                }
                None if eps[i].kind.is_none() => {
                    // Not HTTP (or not on loopback): stop asking.
                    let _ = tx.send(json!({"type": "endpoint", "ts_ns": t, "addr": eps[i].addr.to_string(), "kind": "none", "local_ports": eps[i].local_ports}));
                    dead.push(eps.remove(i).addr);
                }
                None => i += 1,
            }
        }
        nap(POLL_EVERY, stop);
    }
}
