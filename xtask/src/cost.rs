//! `cargo xtask bench --cost`: what tracing a real llama-server costs, probe beside bpftrace running
//! the equivalent script. Cost = the tool's process CPU time (utime + stime, every thread) plus the
//! run time of its BPF programs (kernel.bpf_stats_enabled), per second of wall time, as a
//! percentage of one core.
use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc::{Receiver, channel},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::{
    bench::generate_256,
    report::Report,
    setup::bin,
    soak::cpu_secs,
    workload::{Llama, wait_for},
};

/// Rounds of (probe, bpftrace), interleaved; each round measures both windows.
const ROUNDS: usize = 3;
const IDLE: Duration = Duration::from_secs(10);
/// Measured apart, after armed and before the idle window.
const SETTLE: Duration = Duration::from_secs(3);
/// 256-token requests, back to back, in the generating window (one is 2 s on this machine).
const GENERATIONS: usize = 3;

/// What probe traces with every probe on and `--hz 99`, in bpftrace: CPU stacks at 99 Hz, off-CPU
/// stacks at each switch-out, and counts of page faults, block I/O and the syscalls probe follows.
/// `$1` is the pid. Tracepoints this kernel lacks are dropped (see `bpftrace_script`).
const BPFTRACE_PROBES: [(&str, &str); 9] = [
    ("tracepoint:sched:sched_switch", "/pid == $1/ { @off[ustack, kstack] = count(); }"),
    ("tracepoint:exceptions:page_fault_user", "/pid == $1/ { @pf = count(); }"),
    ("tracepoint:block:block_rq_issue", "{ @bio = count(); }"),
    ("tracepoint:block:block_rq_complete", "{ @bioc = count(); }"),
    ("tracepoint:syscalls:sys_enter_mmap", "/pid == $1/ { @mmap = count(); }"),
    ("tracepoint:syscalls:sys_enter_read", "/pid == $1/ { @r = count(); }"),
    ("tracepoint:syscalls:sys_enter_write", "/pid == $1/ { @w = count(); }"),
    ("tracepoint:syscalls:sys_enter_close", "/pid == $1/ { @c = count(); }"),
    // Not a tracepoint: always there.
    ("profile:hz:99", "/pid == $1/ { @cpu[ustack, kstack] = count(); }"),
];

/// The bpftrace program: a BEGIN line that says it is armed (see `start`), then the probes whose tracepoint exists here; also the names of those dropped.
fn bpftrace_script() -> (String, Vec<&'static str>) {
    let mut script = String::from("BEGIN { printf(\"armed\\n\"); }\n");
    let mut dropped = Vec::new();
    for (probe, body) in BPFTRACE_PROBES {
        if let Some(tp) = probe.strip_prefix("tracepoint:") {
            let rel = tp.replace(':', "/");
            let exists =
                ["/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"].iter().any(|d| Path::new(d).join(&rel).exists());
            if !exists {
                dropped.push(probe);
                continue;
            }
        }
        script.push_str(&format!("{probe} {body}\n"));
    }
    (script, dropped)
}

/// Turns on kernel.bpf_stats_enabled (BPF programs' run_time_ns and run_cnt) while alive, and puts
/// back the value it found when dropped, errors included.
struct BpfStats {
    prev: String,
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    fn enable() -> anyhow::Result<BpfStats> {
        let prev = std::fs::read_to_string(BPF_STATS).with_context(|| format!("cannot read {BPF_STATS}"))?.trim().to_string();
        std::fs::write(BPF_STATS, "1").with_context(|| format!("cannot write {BPF_STATS}"))?;
        Ok(BpfStats { prev })
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(BPF_STATS, &self.prev) {
            eprintln!("bench: could not restore {BPF_STATS} to {}: {e}", self.prev);
        }
    }
}

/// One BPF program's counters, from a tool's fdinfo.
#[derive(Clone)]
struct Prog {
    tag: String,
    run_ns: u64,
    runs: u64,
}

/// A tool's process CPU time and its BPF programs' counters at one instant.
struct Snap {
    at: Instant,
    cpu: f64,
    progs: HashMap<u32, Prog>,
}

/// The BPF programs `pid` holds open (fds whose link is anon_inode:bpf-prog), by prog_id.
fn bpf_progs(pid: u32) -> HashMap<u32, Prog> {
    let mut progs = HashMap::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return progs };
    for fd in fds.flatten() {
        if std::fs::read_link(fd.path()).ok().is_none_or(|l| l.as_os_str() != "anon_inode:bpf-prog") {
            continue;
        }
        let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())) else { continue };
        let field = |k: &str| info.lines().find_map(|l| l.strip_prefix(k)).map(str::trim);
        let num = |k: &str| field(k).and_then(|v| v.parse::<u64>().ok());
        if let (Some(id), Some(run_ns), Some(runs)) = (num("prog_id:"), num("run_time_ns:"), num("run_cnt:")) {
            progs.insert(id as u32, Prog { tag: field("prog_tag:").unwrap_or("?").to_string(), run_ns, runs });
        }
    }
    progs
}

fn snap(pid: u32) -> Snap {
    Snap { at: Instant::now(), cpu: run_secs(pid), progs: bpf_progs(pid) }
}

/// CPU seconds of `pid`'s live threads to the nanosecond (the first field of each thread's
/// schedstat: time on a CPU), where /proc/PID/stat counts 10 ms ticks (0.5% of a core in a 2 s
/// window). Falls back to those ticks where schedstat is absent.
fn run_secs(pid: u32) -> f64 {
    let mut ns = 0u64;
    let mut any = false;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        if let Some(v) =
            std::fs::read_to_string(t.path().join("schedstat")).ok().and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        {
            ns += v;
            any = true;
        }
    }
    if any { ns as f64 / 1e9 } else { cpu_secs(pid) }
}

/// One measured window.
struct Window {
    wall: f64,
    /// CPU seconds of the tool's process.
    proc: f64,
    /// Seconds its BPF programs ran.
    bpf: f64,
    /// Per program (by id): (tag, runs, run ns) during the window.
    progs: Vec<(u32, String, u64, u64)>,
}

impl Window {
    fn between(a: &Snap, b: &Snap) -> Window {
        let progs: Vec<_> = b
            .progs
            .iter()
            .map(|(id, p)| {
                let (runs0, ns0) = a.progs.get(id).map_or((0, 0), |q| (q.runs, q.run_ns));
                (*id, p.tag.clone(), p.runs.saturating_sub(runs0), p.run_ns.saturating_sub(ns0))
            })
            .collect();
        Window {
            wall: b.at.duration_since(a.at).as_secs_f64(),
            proc: b.cpu - a.cpu,
            bpf: progs.iter().map(|p| p.3).sum::<u64>() as f64 / 1e9,
            progs,
        }
    }

    /// (total, process, BPF) in % of one core.
    fn pct(&self) -> (f64, f64, f64) {
        let w = self.wall.max(1e-9);
        ((self.proc + self.bpf) / w * 100.0, self.proc / w * 100.0, self.bpf / w * 100.0)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Tool {
    Probe,
    /// Another probe binary (`PROBE_COST_BASELINE`, e.g. the last release) traced the same way:
    /// the before of a before-and-after, in the same rounds.
    Baseline,
    /// `probe watch` with its defaults (stacks at 19 Hz, samplers at 2 Hz, the window on disk).
    Watch,
    /// `probe trace` in a pseudo-terminal (`script`): the live view on, its cost counted.
    Live,
    Bpftrace,
}

impl Tool {
    fn name(self) -> &'static str {
        match self {
            Tool::Probe => "probe",
            Tool::Baseline => "baseline",
            Tool::Watch => "watch",
            Tool::Live => "live view",
            Tool::Bpftrace => "bpftrace",
        }
    }
}

/// The probe binary to compare with (`PROBE_COST_BASELINE`), when set and present.
fn baseline() -> Option<PathBuf> {
    std::env::var_os("PROBE_COST_BASELINE").map(PathBuf::from).filter(|p| p.is_file())
}

/// A tracing tool running against the server; killed if dropped before `stop`.
struct Tracer {
    child: Child,
    /// The tracer's process when it is not `child` (probe under `script`).
    inner: Option<u32>,
}

impl Tracer {
    fn pid(&self) -> u32 {
        self.inner.unwrap_or(self.child.id())
    }

    /// Stop as Ctrl-C would (probe writes its report, bpftrace prints its maps) and wait.
    fn stop(mut self) -> anyhow::Result<()> {
        // SAFETY: signalling our own child (or the probe it runs), which has not been waited for yet.
        unsafe { libc::kill(self.pid() as i32, libc::SIGINT) };
        let status = self.child.wait()?;
        if !status.success() {
            bail!("{status}");
        }
        Ok(())
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Lines a child writes to a pipe, copied to `log` as they come.
fn lines_to(out: impl std::io::Read + Send + 'static, log: &Path) -> anyhow::Result<Receiver<String>> {
    let mut file = std::fs::File::create(log)?;
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{l}");
            let _ = tx.send(l);
        }
    });
    Ok(rx)
}

/// Start `tool` on `pid` and return once it is armed: probe's recording exists and it said
/// "armed"; bpftrace printed its BEGIN line.
fn start(tool: Tool, pid: u32, dir: &Path, i: usize, script: &str) -> anyhow::Result<Tracer> {
    let limit = Duration::from_secs(60);
    match tool {
        Tool::Probe | Tool::Watch | Tool::Baseline => {
            let rec = dir.join(format!("{}-{i}", tool.name()));
            let args: &[&str] = match tool {
                Tool::Watch => &["watch", "--dir"],
                _ => &["trace", "--hz", "99", "--out"],
            };
            let exe = match tool {
                Tool::Baseline => baseline().context("PROBE_COST_BASELINE is not set")?,
                _ => bin("probe"),
            };
            let mut child = Command::new(exe)
                .args(args)
                .arg(&rec)
                .args(["--pid", &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            let err = lines_to(child.stderr.take().context("probe stderr")?, &dir.join(format!("{}-{i}.log", tool.name())))?;
            let tracer = Tracer { child, inner: None };
            let t = Instant::now();
            loop {
                match err.recv_timeout(limit.saturating_sub(t.elapsed())) {
                    Ok(l) if l.contains("armed in ") => break,
                    Ok(_) => {}
                    Err(_) => bail!(
                        "probe did not say \"armed\" within {limit:?} (see {})",
                        dir.join(format!("{}-{i}.log", tool.name())).display()
                    ),
                }
            }
            if tool != Tool::Watch {
                wait_for(&rec.join("events.bin"), limit.saturating_sub(t.elapsed()))?;
            }
            Ok(tracer)
        }
        Tool::Live => {
            // A real pseudo-terminal: util-linux `script`, probe exec'd as its child.
            let rec = dir.join(format!("live-{i}"));
            let cmd = format!("exec {} trace --hz 99 --out {} --pid {pid}", bin("probe").display(), rec.display());
            let mut child = Command::new("script")
                .args(["-q", "-f", "-e", "-c", &cmd, "/dev/null"])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("script (util-linux) for a pseudo-terminal")?;
            let out = lines_to(child.stdout.take().context("script stdout")?, &dir.join(format!("live-{i}.log")))?;
            let script = child.id();
            let mut tracer = Tracer { child, inner: None };
            let t = Instant::now();
            loop {
                match out.recv_timeout(limit.saturating_sub(t.elapsed())) {
                    Ok(l) if l.contains("armed in ") => break,
                    Ok(_) => {}
                    Err(_) => bail!(
                        "probe in a terminal did not say \"armed\" within {limit:?} (see {})",
                        dir.join(format!("live-{i}.log")).display()
                    ),
                }
            }
            let children = std::fs::read_to_string(format!("/proc/{script}/task/{script}/children")).unwrap_or_default();
            tracer.inner = Some(children.split_whitespace().next().and_then(|p| p.parse().ok()).context("script's child (probe)")?);
            wait_for(&rec.join("events.bin"), limit.saturating_sub(t.elapsed()))?;
            Ok(tracer)
        }
        Tool::Bpftrace => {
            let log = dir.join(format!("bpftrace-{i}.out"));
            let mut child = Command::new("bpftrace")
                .args(["-B", "none", "-e", script, &pid.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            let out = lines_to(child.stdout.take().context("bpftrace stdout")?, &log)?;
            // Its warnings (RLIMIT_MEMLOCK on kernels that no longer need it) beside the output.
            let _err = lines_to(child.stderr.take().context("bpftrace stderr")?, &dir.join(format!("bpftrace-{i}.err")))?;
            let mut tracer = Tracer { child, inner: None };
            let t = Instant::now();
            // BEGIN runs before the other probes attach, but its printf reaches stdout through the
            // perf buffer, which bpftrace polls only once every probe is attached.
            loop {
                match out.recv_timeout(Duration::from_millis(200)) {
                    Ok(l) if l.trim() == "armed" => return Ok(tracer),
                    Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        let status = tracer.child.wait()?;
                        let err = std::fs::read_to_string(dir.join(format!("bpftrace-{i}.err"))).unwrap_or_default();
                        bail!("bpftrace exited ({status}) before it was armed: {}", err.trim());
                    }
                }
                if t.elapsed() > limit {
                    bail!("bpftrace was not armed within {limit:?} (see {})", log.display());
                }
            }
        }
    }
}

/// Program names by id from `bpftool -j prog show`, while the programs are loaded; None without bpftool.
fn bpftool_names() -> Option<HashMap<u32, String>> {
    let out = Command::new("bpftool").args(["-j", "prog", "show"]).stderr(Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    prog_names(&out.stdout)
}

/// Program names by id from bpftool's JSON list; None when it is not one.
fn prog_names(json: &[u8]) -> Option<HashMap<u32, String>> {
    let progs: Vec<BpftoolProg> = serde_json::from_slice(json).ok()?;
    Some(progs.into_iter().filter_map(|p| Some((p.id?, p.name.unwrap_or_else(|| "(no name)".to_string())))).collect())
}

/// A program as `bpftool -j prog show` lists it: the fields read here.
#[derive(Deserialize)]
struct BpftoolProg {
    id: Option<u32>,
    name: Option<String>,
}

/// Per program over every generating window of one tool: label → (runs, run ns, ids seen).
#[derive(Default)]
struct Top {
    wall: f64,
    windows: usize,
    progs: HashMap<String, (u64, u64, HashSet<u32>)>,
}

impl Top {
    fn add(&mut self, w: &Window, names: Option<&HashMap<u32, String>>) {
        self.wall += w.wall;
        self.windows += 1;
        for (id, tag, runs, ns) in &w.progs {
            // Without names, the tag (a hash of the instructions) is the same program across runs.
            let label = names.and_then(|n| n.get(id)).cloned().unwrap_or_else(|| format!("tag {tag}"));
            let e = self.progs.entry(label).or_default();
            e.0 += runs;
            e.1 += ns;
            e.2.insert(*id);
        }
    }

    fn print(&self, tool: &str, named: bool) {
        let mut rows: Vec<_> = self.progs.iter().collect();
        rows.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(b.0)));
        let what = if named { "name (bpftool)" } else { "no bpftool: prog_tag (last prog_id)" };
        println!("  top BPF programs (generating, {tool}, {} windows): {what}  runs/s  ns/run  % core", self.windows);
        let wall = self.wall.max(1e-9);
        for (label, (runs, ns, ids)) in rows.iter().take(6) {
            let label = if named { label.to_string() } else { format!("{label} (id {})", ids.iter().max().copied().unwrap_or(0)) };
            // Programs sharing a label in one run (same name, or same instructions).
            let per_run = ids.len().div_ceil(self.windows.max(1));
            let label = if per_run > 1 { format!("{label} ×{per_run}") } else { label };
            println!(
                "    {label:<44} {:>9.1} {:>7.0} {:>7.3}%",
                *runs as f64 / wall,
                *ns as f64 / (*runs).max(1) as f64,
                *ns as f64 / 1e9 / wall * 100.0
            );
        }
    }
}

/// Median of the totals, with the split of the window that gave it, and the spread.
fn summary(ws: &[Window]) -> String {
    if ws.is_empty() {
        return "-".to_string();
    }
    let mut p: Vec<(f64, f64, f64)> = ws.iter().map(Window::pct).collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (t, pr, bpf) = p[p.len() / 2];
    format!("{t:.2}% [{:.2}–{:.2}] (proc {pr:.2} + bpf {bpf:.2})", p[0].0, p[p.len() - 1].0)
}

/// The tracing-cost section of `cargo xtask bench`: probe and bpftrace (the equivalent script)
/// on a real llama-server, idle for 10 s and generating 256 tokens, in interleaved rounds.
pub(crate) fn bench_cost(dir: &Path) -> anyhow::Result<()> {
    let dir: PathBuf = dir.join("cost");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // Other work on the machine shows in the tokens/s (and in the spread) more than in the cost.
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').next().unwrap_or("?").to_string();
    let (mut tools, script) = tools_to_compare();
    let srv = Llama::start(&["-c", "2048", "-np", "1"], None)?;
    let pid: u32 = srv.pid().parse()?;
    generate_256(&srv.addr)?; // warm up
    let stats = BpfStats::enable()?;
    let mut m = Measured::new();
    for round in 0..ROUNDS {
        for &tool in &tools.clone() {
            let tracer = match start(tool, pid, &dir, round, &script) {
                Ok(t) => t,
                Err(e) if tool == Tool::Bpftrace => {
                    println!("tracing cost: bpftrace failed ({e:#}): its column is left out");
                    tools.retain(|&t| t != Tool::Bpftrace);
                    continue;
                }
                Err(e) => return Err(e),
            };
            m.measure(tool, tracer, &srv.addr)?;
        }
    }
    drop(stats);
    m.print(&tools, &load);
    goals(&dir, pid, &srv.addr, &m.idle, &m.busy, &m.engine_ret)?;
    Ok(())
}

/// The tools compared (a baseline probe with `PROBE_COST_BASELINE`, bpftrace when installed),
/// and the bpftrace script.
fn tools_to_compare() -> (Vec<Tool>, String) {
    let mut tools = vec![Tool::Probe, Tool::Live, Tool::Watch];
    if let Some(b) = baseline() {
        println!("tracing cost: baseline is {} (PROBE_COST_BASELINE)", b.display());
        tools.insert(0, Tool::Baseline);
    }
    let have_bpftrace =
        Command::new("bpftrace").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    let (script, dropped) = bpftrace_script();
    if have_bpftrace {
        tools.push(Tool::Bpftrace);
        if !dropped.is_empty() {
            println!("tracing cost: this kernel lacks {}: left out of the bpftrace script", dropped.join(", "));
        }
    } else {
        println!("tracing cost: bpftrace is not installed (scripts/setup.sh installs it as root): probe only");
    }
    (tools, script)
}

/// What the rounds measured, per tool (by name): idle windows, generating windows, tokens/s,
/// the first seconds after armed, top programs, and engine_ret's (runs, ns).
struct Measured {
    idle: HashMap<&'static str, Vec<Window>>,
    busy: HashMap<&'static str, Vec<Window>>,
    tps: HashMap<&'static str, Vec<f64>>,
    settle: HashMap<&'static str, Vec<Window>>,
    top: HashMap<&'static str, Top>,
    engine_ret: HashMap<&'static str, (u64, u64)>,
    /// bpftool named the programs in every window.
    named: bool,
}

impl Measured {
    fn new() -> Measured {
        Measured {
            idle: HashMap::new(),
            busy: HashMap::new(),
            tps: HashMap::new(),
            settle: HashMap::new(),
            top: HashMap::new(),
            engine_ret: HashMap::new(),
            named: true,
        }
    }

    /// One round of `tool` (running as `tracer`): settle, idle, then generate on the server at
    /// `addr`; the tracer is stopped at the end.
    fn measure(&mut self, tool: Tool, tracer: Tracer, addr: &str) -> anyhow::Result<()> {
        let tp = tracer.pid();
        // The first seconds after armed (unwind tables, the first /proc snapshots) are
        // measured apart: what starting costs, once, not what staying on costs.
        let s0 = snap(tp);
        std::thread::sleep(SETTLE);
        let a = snap(tp);
        self.settle.entry(tool.name()).or_default().push(Window::between(&s0, &a));
        std::thread::sleep(IDLE);
        let b = snap(tp);
        let mut t = 0.0;
        for _ in 0..GENERATIONS {
            t += generate_256(addr)? / GENERATIONS as f64;
        }
        let c = snap(tp);
        let names = bpftool_names();
        self.named &= names.is_some();
        let (wi, wg) = (Window::between(&a, &b), Window::between(&b, &c));
        if wg.progs.iter().all(|p| p.2 == 0) {
            println!("tracing cost: warning: {}'s BPF programs did not run while generating ({} open)", tool.name(), wg.progs.len());
        }
        self.top.entry(tool.name()).or_default().add(&wg, names.as_ref());
        for (id, _, r, t) in &wg.progs {
            if names.as_ref().and_then(|m| m.get(id)).is_some_and(|n| n.starts_with("engine_ret")) {
                let e = self.engine_ret.entry(tool.name()).or_insert((0, 0));
                e.0 += r;
                e.1 += t;
            }
        }
        self.idle.entry(tool.name()).or_default().push(wi);
        self.busy.entry(tool.name()).or_default().push(wg);
        self.tps.entry(tool.name()).or_default().push(t);
        tracer.stop().with_context(|| format!("{} did not exit cleanly", tool.name()))?;
        Ok(())
    }

    /// The table: per tool, idle and generating cost, the traced generation's speed, then the
    /// first seconds after armed and the top programs.
    fn print(&self, tools: &[Tool], load: &str) {
        println!(
            "tracing cost (llama-server SmolLM2-135M, % of one core = process CPU + BPF run time per wall second; median of {ROUNDS} [min–max]; load average {load} at the start on {} cores):",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!(
            "  {:<10} {:<48} {:<48} traced generation (server's tokens/s; request time)",
            "",
            format!("idle {} s", IDLE.as_secs()),
            format!("generating {GENERATIONS} × 256 tokens")
        );
        let empty = Vec::new();
        for tool in tools {
            let n = tool.name();
            let (i, g, t) =
                (self.idle.get(n).unwrap_or(&empty), self.busy.get(n).unwrap_or(&empty), self.tps.get(n).cloned().unwrap_or_default());
            let speed = match (t.iter().cloned().reduce(f64::min), t.iter().cloned().reduce(f64::max)) {
                (Some(lo), Some(hi)) => format!(
                    "{:.1} tok/s [{lo:.1}–{hi:.1}]; {:.1} s",
                    crate::bench::median(t.clone()),
                    crate::bench::median(g.iter().map(|w| w.wall).collect())
                ),
                _ => "-".to_string(),
            };
            println!("  {n:<10} {:<48} {:<48} {speed}", summary(i), summary(g));
        }
        for tool in tools {
            let w = self.settle.get(tool.name()).unwrap_or(&empty);
            let ms: Vec<f64> = w.iter().map(|w| (w.proc + w.bpf) * 1e3).collect();
            if !ms.is_empty() {
                println!(
                    "  {:<10} first {} s after armed (once per trace, not in the windows above): {:.0} ms of CPU, median of {}",
                    tool.name(),
                    SETTLE.as_secs(),
                    crate::bench::median(ms.clone()),
                    ms.len()
                );
            }
        }
        for tool in tools {
            if let Some(t) = self.top.get(tool.name()) {
                t.print(tool.name(), self.named);
            }
        }
    }
}

/// Arming runs: this long apart, as the kernel finishes tearing down the last trace's programs
/// several seconds after it exited (a uprobe or tracepoint attached meanwhile waited 0.4-1 s).
const ARM_GAP: Duration = Duration::from_secs(10);
const ARM_RUNS: usize = 5;

/// `exe trace ARGS --pid PID --out DIR/NAME` started and waited for until it says "armed in N
/// ms": the tracer, N and the recording's directory (its stderr copied to NAME.log).
fn start_armed(exe: &Path, args: &[&str], pid: u32, dir: &Path, name: &str) -> anyhow::Result<(Tracer, f64, PathBuf)> {
    let rec = dir.join(name);
    let mut child = Command::new(exe)
        .arg("trace")
        .args(args)
        .args(["--pid", &pid.to_string(), "--out"])
        .arg(&rec)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let err = lines_to(child.stderr.take().context("probe stderr")?, &dir.join(format!("{name}.log")))?;
    let tracer = Tracer { child, inner: None };
    loop {
        match err.recv_timeout(Duration::from_secs(60)) {
            Ok(l) => {
                if let Some(rest) = l.split("armed in ").nth(1) {
                    let ms = rest.split(" ms").next().and_then(|n| n.trim().parse::<f64>().ok()).context("armed in N ms")?;
                    return Ok((tracer, ms, rec));
                }
            }
            Err(_) => bail!("{} did not arm within 60 s (see {name}.log)", exe.display()),
        }
    }
}

/// `exe trace` on `pid` until it says "armed in N ms": N; then stopped (Ctrl-C) and waited for.
fn armed_once(exe: &Path, pid: u32, dir: &Path, name: &str) -> anyhow::Result<f64> {
    let (tracer, ms, rec) = start_armed(exe, &["-q"], pid, dir, name)?;
    wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
    tracer.stop()?;
    Ok(ms)
}

/// A 3 s trace, as the demo's: started, one 256-token request (about 3 s here), stopped. Its cost
/// from the process's start (arming and unwind tables included) to the stop, and, from its
/// report, the CPU time its verdicts gave to probe as a competitor, per request.
fn short_trace(exe: &Path, pid: u32, addr: &str, dir: &Path, name: &str) -> anyhow::Result<(f64, Vec<f64>)> {
    let t0 = Instant::now();
    let (tracer, _, rec) = start_armed(exe, &["-q", "--hz", "99"], pid, dir, name)?;
    // A program taken from the kept set counts the runs of the traces before: its run time is
    // counted from armed (the few ms between attach and armed are left out).
    let armed = snap(tracer.pid());
    generate_256(addr)?;
    let probe_pid = tracer.pid();
    let s = snap(probe_pid);
    let bpf_ns: u64 = s.progs.iter().map(|(id, p)| p.run_ns.saturating_sub(armed.progs.get(id).map_or(0, |a| a.run_ns))).sum();
    let pct = (s.cpu + bpf_ns as f64 / 1e9) / s.at.duration_since(t0).as_secs_f64() * 100.0;
    tracer.stop()?;
    let report = Report::read(&rec)?;
    // The verdict's competitors for the CPU: probe's own process, by its pid.
    let named = report
        .requests
        .iter()
        .map(|r| {
            r.verdict
                .iter()
                .flat_map(|v| &v.competitors)
                .filter(|c| c.pid == probe_pid)
                // The time probe held the CPU a server thread waited for (the waits it ended,
                // from a binary before the kernel said how long the task replaced had run).
                .filter_map(|c| c.held_ms.or(c.ms))
                .sum::<f64>()
                + 0.0
        })
        .collect();
    Ok((pct, named))
}

/// The figures of issue 40 beside their goals, for probe and the baseline binary measured in the
/// same run: arming (llama-server; llama-cpp-python's server when its venv is built), the cost
/// idle and generating (from the windows above), a 3 s trace, the verdicts' share to probe, the
/// engine's return program per decode step.
fn goals(
    dir: &Path,
    srv_pid: u32,
    addr: &str,
    idle: &HashMap<&str, Vec<Window>>,
    busy: &HashMap<&str, Vec<Window>>,
    engine_ret: &HashMap<&str, (u64, u64)>,
) -> anyhow::Result<()> {
    let mut tools: Vec<(&str, PathBuf)> = vec![("probe", bin("probe"))];
    if let Some(b) = baseline() {
        tools.push(("baseline", b));
    }
    let python = crate::setup::llama_python().ok().filter(|p| Path::new(p).exists());
    let py = python.as_ref().and_then(|py| {
        let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let model = crate::setup::llama().ok()?.1;
        let child = Command::new(py)
            .args([
                "-m",
                "llama_cpp.server",
                "--model",
                &model,
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--n_ctx",
                "2048",
                "--n_threads",
                "2",
                "--verbose",
                "false",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let t = Instant::now();
        while !crate::workload::http_get_ok(&format!("127.0.0.1:{port}"), "/v1/models") && t.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(Tracer { child, inner: None })
    });
    let mut rows: Vec<(String, String, Vec<String>)> = Vec::new();
    let mut armed: Vec<Vec<f64>> = vec![Vec::new(); tools.len()];
    let mut armed_py: Vec<Vec<f64>> = vec![Vec::new(); tools.len()];
    let mut first: Vec<f64> = vec![0.0; tools.len()];
    // Each build's runs together: a trace keeps its verified programs for the next of the same
    // build (one set kept at a time), so runs by turns with another build each verified anew. The
    // first of each build finds nothing kept: the first arming.
    for (k, (name, exe)) in tools.iter().enumerate() {
        // What `--no-keep` removes: the kept sets' pins (bpffs unlinks them; the kernel frees
        // what nothing else holds).
        let _ = std::fs::remove_dir_all("/sys/fs/bpf/probe");
        std::thread::sleep(ARM_GAP);
        first[k] = armed_once(exe, srv_pid, dir, &format!("arm-{name}-first"))?;
        for i in 0..ARM_RUNS {
            std::thread::sleep(ARM_GAP);
            armed[k].push(armed_once(exe, srv_pid, dir, &format!("arm-{name}-{i}"))?);
            if let Some(p) = &py {
                std::thread::sleep(ARM_GAP);
                armed_py[k].push(armed_once(exe, p.child.id(), dir, &format!("arm-py-{name}-{i}"))?);
            }
        }
    }
    let med = |v: &[f64]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{:.0} ms [{:.0}–{:.0}]",
                crate::bench::median(v.to_vec()),
                v.iter().cloned().fold(f64::MAX, f64::min),
                v.iter().cloned().fold(0.0, f64::max)
            )
        }
    };
    rows.push(("start → armed, llama-server (median of 5)".into(), "≤ 50 ms".into(), armed.iter().map(|v| med(v)).collect()));
    rows.push(("first arming (nothing kept), llama-server".into(), "-".into(), first.iter().map(|ms| format!("{ms:.0} ms")).collect()));
    if py.is_some() {
        rows.push(("start → armed, llama-cpp-python (median of 5)".into(), "≤ 50 ms".into(), armed_py.iter().map(|v| med(v)).collect()));
    }
    drop(py);
    let pct = |m: &HashMap<&str, Vec<Window>>, n: &str| summary(m.get(n).map(Vec::as_slice).unwrap_or(&[]));
    rows.push(("cost while generating (process + BPF)".into(), "≤ 1%".into(), tools.iter().map(|(n, _)| pct(busy, n)).collect()));
    rows.push(("cost, idle server".into(), "≤ 0.1%".into(), tools.iter().map(|(n, _)| pct(idle, n)).collect()));
    let mut short = Vec::new();
    let mut named = Vec::new();
    for (name, exe) in &tools {
        std::thread::sleep(ARM_GAP);
        let (p, n) = short_trace(exe, srv_pid, addr, dir, &format!("short-{name}"))?;
        short.push(format!("{p:.2}%"));
        named.push(if n.is_empty() { "-".to_string() } else { n.iter().map(|m| format!("{m:.0} ms")).collect::<Vec<_>>().join(", ") });
    }
    rows.push(("a 3 s trace (one 256-token request), from start".into(), "-".into(), short));
    rows.push(("probe named as a competitor, per request".into(), "< 1 ms".into(), named));
    // The engine's return program, per run, over every generating window of each tool.
    let ret: Vec<String> = tools
        .iter()
        .map(|(n, _)| match engine_ret.get(n) {
            Some(&(runs, ns)) if runs > 0 => format!("{:.1} µs", ns as f64 / runs as f64 / 1e3),
            _ => "- (no runs named engine_ret*: bpftool?)".to_string(),
        })
        .collect();
    rows.push(("engine return program, per decode step".into(), "≤ 2 µs".into(), ret));
    println!("issue 40's figures (this machine; every column measured in this run):");
    let header: Vec<&str> = tools.iter().map(|(n, _)| *n).collect();
    println!("  {:<50} {:<9} {}", "figure", "goal", header.iter().map(|h| format!("{h:<44}")).collect::<String>());
    for (what, goal, vals) in rows {
        println!("  {what:<50} {goal:<9} {}", vals.iter().map(|v| format!("{v:<44}")).collect::<String>());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bpftool's list, as `bpftool -j prog show` prints it: a program without a name is named
    /// so, one without an id is left out.
    #[test]
    fn bpftool_list() {
        let json = br#"[{"id":12,"type":"kprobe","name":"sched_switch","tag":"a1","gpl_compatible":true,"run_time_ns":5,"run_cnt":2},
            {"id":13,"type":"cgroup_skb","tag":"b2"},{"type":"xdp","name":"odd"}]"#;
        let names = prog_names(json).unwrap();
        assert_eq!(names.len(), 2);
        assert_eq!((names[&12].as_str(), names[&13].as_str()), ("sched_switch", "(no name)"));
        assert!(prog_names(b"{}").is_none());
    }
}
