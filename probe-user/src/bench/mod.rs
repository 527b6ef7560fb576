//! `probe bench`: the controlled experiments that separate a serving defect from noise. It
//! drives a running server with fixed prompts, a fixed seed and fixed sampling, changing one
//! thing per sweep (concurrency, prompt length, idle time), records every request (TTFT, ITL,
//! TPOT, E2E, output tokens, stop reason), reads the server's counters per level, optionally
//! traces the server (`probe trace`) and attaches each request's verdict, and writes tables,
//! JSON, CSV, SVG charts and conclusions.
//!
//! client (HTTP/1.1 over std TCP) → api (per-server bodies, counters, tokenizer) → sweep (levels)
//! → metrics (rows, stop reasons, summaries) → conclude (words) → output (files); trace joins
//! traced verdicts.
pub mod aiperf;
pub mod api;
pub mod args;
pub mod baseline;
pub mod client;
pub mod conclude;
mod idle;
pub mod machine;
pub mod metrics;
pub mod output;
pub mod results;
pub mod sweep;
pub mod trace;
pub mod vllm;

use std::{
    process::Command,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use self::{
    api::{Api, Sampling, ServerInfo},
    args::label,
    client::Url,
    idle::{IdleSetup, idle_one, idle_setup},
    metrics::{Level, Row, Slo},
    results::Results,
    sweep::{Ctx, Progress},
};
pub use self::{args::BenchArgs, metrics::Sweep};

/// Set by SIGINT: stop sending; requests in flight get [`GRACE`] to finish.
pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static INTERRUPTED_AT_NS: AtomicU64 = AtomicU64::new(0);
const GRACE: Duration = Duration::from_secs(3);

extern "C" fn on_sigint(_: libc::c_int) {
    // Async-signal-safe: atomics and clock_gettime only.
    if !INTERRUPTED.swap(true, Ordering::SeqCst) {
        INTERRUPTED_AT_NS.store(crate::monotonic_ns(), Ordering::SeqCst);
    }
}

/// Ctrl-C came more than the grace period ago: in-flight requests are abandoned.
pub(crate) fn interrupt_grace_over() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
        && crate::monotonic_ns().saturating_sub(INTERRUPTED_AT_NS.load(Ordering::Relaxed)) > GRACE.as_nanos() as u64
}

/// A running trace: the fixed pid, or none to find it by port.
struct Tracing {
    fixed: Option<u32>,
    seg: Option<trace::Segment>,
    n: usize,
}

struct Run {
    args: BenchArgs,
    url: Url,
    info: ServerInfo,
    t0: Instant,
    rows: Vec<Row>,
    /// Every run of every level, in the order they ran (pooled into `levels` at the end).
    runs: Vec<Level>,
    levels: Vec<Level>,
    notes: Vec<String>,
    slo: Slo,
    traces: Vec<String>,
    tracing: Option<Tracing>,
    metrics: bool,
    progress: Progress,
    /// --prompts: the user's fixed prompts (never written to the outputs).
    own_prompts: Vec<String>,
    /// NVML answered: GPU clocks are sampled per level.
    gpu: bool,
    /// Which repeat is running (tags rows and runs).
    repeat: u64,
}

impl Run {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            url: &self.url,
            api: self.args.api,
            timeout: self.args.timeout,
            slot_ctx: self.info.slot_ctx,
            t0: self.t0,
            slo: self.slo,
            metrics: self.metrics && self.tracing.is_none(),
            progress: &self.progress,
            server_pid: self.server_pid(),
            gpu: self.gpu,
        }
    }

    fn sampling(&self, max_tokens: u64) -> Sampling {
        Sampling {
            max_tokens,
            seed: self.args.seed,
            temperature: self.args.temperature,
            ignore_eos: self.args.ignore_eos,
            model: self.info.model.clone(),
            cache_prompt: false,
        }
    }

    fn push(&mut self, mut rows: Vec<Row>, mut level: Level) {
        level.seq = self.runs.len();
        for r in rows.iter_mut() {
            r.run_seq = level.seq;
            r.repeat = self.repeat;
        }
        let of = if self.args.repeat > 1 { format!(" (run {}/{})", self.repeat + 1, self.args.repeat) } else { String::new() };
        self.progress.line(&format!(
            "{} {}{of}: {}, output {} tokens, TTFT p50 {}, stops: {}{}",
            level.sweep,
            level.level,
            crate::util::text::count(level.requests, "request"),
            level.output_tokens_mean.map_or("-".into(), |x| format!("{x:.0}")),
            level.ttft_ms_p50.map_or("-".into(), |x| format!("{x:.0} ms")),
            conclude::mix(&level),
            level.machine.as_ref().filter(|m| m.contended()).map(|m| format!("; contended: {}", m.why.join("; "))).unwrap_or_default()
        ));
        let first = self.rows.len();
        self.rows.extend(rows);
        if let Some(seg) = self.tracing.as_mut().and_then(|t| t.seg.as_mut()) {
            seg.rows.extend(first..self.rows.len());
        }
        self.runs.push(level);
    }

    /// Pool the runs into one level per (sweep, level) in the order the plans list them.
    fn pool(&mut self, order: &[(Sweep, String)]) {
        let mut levels = Vec::new();
        let mut seen = std::collections::HashSet::new();
        // A label given twice (`--idle 3s,3s`) is one level run twice: its runs pool.
        for (sweep, label) in order.iter().filter(|k| seen.insert((*k).clone())) {
            let runs: Vec<&Level> = self.runs.iter().filter(|l| &l.sweep == sweep && &l.level == label).collect();
            if runs.is_empty() {
                continue;
            }
            let seqs: Vec<usize> = runs.iter().map(|l| l.seq).collect();
            let rows: Vec<&Row> = self.rows.iter().filter(|r| seqs.contains(&r.run_seq)).collect();
            let mut l = metrics::pool(&runs, &rows, self.slo);
            l.seq = levels.len();
            levels.push(l);
        }
        for r in self.rows.iter_mut() {
            let run = &self.runs[r.run_seq];
            if let Some(l) = levels.iter().find(|l: &&Level| l.sweep == run.sweep && l.level == run.level) {
                r.seq = l.seq;
            }
        }
        self.levels = levels;
    }

    fn server_pid(&self) -> Option<u32> {
        self.tracing.as_ref().and_then(|t| t.fixed).or_else(|| trace::pid_listening(self.url.port))
    }

    /// Start a trace segment unless one is running (or tracing is off).
    fn start_trace(&mut self) -> anyhow::Result<()> {
        let Some(t) = self.tracing.as_ref() else { return Ok(()) };
        if t.seg.is_some() {
            return Ok(());
        }
        let pid = match t.fixed {
            Some(p) => p,
            None => trace::pid_listening(self.url.port)
                .with_context(|| format!("--trace: no process listens on port {} (or /proc is not readable)", self.url.port))?,
        };
        let n = t.n + 1;
        let out = self.args.out.join(format!("trace-{n}"));
        let seg = trace::start(pid, &out)?;
        self.progress.line(&format!("tracing pid {pid} into {}", out.display()));
        if let Some(t) = self.tracing.as_mut() {
            t.n = n;
            t.seg = Some(seg);
        }
        Ok(())
    }

    fn stop_trace(&mut self) {
        let Some(seg) = self.tracing.as_mut().and_then(|t| t.seg.take()) else { return };
        // Let the trace see the last responses' ends before it stops.
        std::thread::sleep(Duration::from_millis(300));
        match trace::stop(seg) {
            Ok((seg, report)) => {
                let name = seg.out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let found = trace::join(&mut self.rows, &seg.rows, &report, &name);
                if found < seg.rows.len() {
                    self.notes.push(format!("{name}: {found} of {} requests found in the trace (pid {})", seg.rows.len(), seg.pid));
                }
                self.traces.push(seg.out.display().to_string());
            }
            Err(e) => self.notes.push(format!("trace failed: {e:#}")),
        }
    }

    fn wait_healthy(&self) -> anyhow::Result<()> {
        let t = Instant::now();
        loop {
            if let Ok((200, _)) = client::request(&self.url, "GET", self.args.api.health_path(), None, Duration::from_secs(5)) {
                return Ok(());
            }
            if t.elapsed() > self.args.health_timeout {
                bail!("{} did not answer {} with 200 within {:?}", self.args.url, self.args.api.health_path(), self.args.health_timeout);
            }
            if client::interrupted() {
                bail!("interrupted while waiting for the server");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn shell(cmd: &str, what: &str) -> anyhow::Result<()> {
    let st = Command::new("sh").arg("-c").arg(cmd).status().with_context(|| format!("cannot run the {what} command"))?;
    if !st.success() {
        bail!("the {what} command `{cmd}` failed: {st}");
    }
    Ok(())
}

pub fn run(args: BenchArgs) -> anyhow::Result<i32> {
    args.auth.install();
    let url = Url::parse(&args.url).map_err(anyhow::Error::msg)?;
    let tracing = check_flags(&args)?;
    let sweeps = sweeps_asked(&args);
    // Reach the server first: a clear error rather than a table of failed rows.
    match client::request(&url, "GET", args.api.health_path(), None, Duration::from_secs(10)) {
        Ok(_) => {}
        Err(e) => bail!("cannot reach the server at {}: {e}", args.url),
    }
    let out = crate::util::output::OutDir::create_or_open(&args.out)?;
    // One rule for existing outputs: an earlier run's results are replaced only when asked.
    if out.names()?.iter().any(|n| n == "results.json") && !args.force {
        bail!("{} holds an earlier run's results (results.json); choose a new --out, or add --force to replace them", args.out.display());
    }
    // SAFETY: installing an async-signal-safe handler (atomics only).
    unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
    let own_prompts = read_prompts(&args)?;
    let info = api::server_info(&url, args.api, args.model.clone());
    if matches!(args.api, Api::Ollama) && info.model.is_none() {
        bail!("--api ollama needs a model: pass --model (no model is loaded or listed)");
    }
    let (_, metric_notes) = api::counters(&url, args.api);
    let metrics = metric_notes.iter().all(|n| !n.starts_with("/metrics"));
    let started_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let slo = {
        let mut slo = args.slo.unwrap_or_default();
        slo.ttft_ms = slo.ttft_ms.or(args.goodput_ttft_ms);
        slo.tpot_ms = slo.tpot_ms.or(args.goodput_tpot_ms);
        slo
    };
    let baseline = match &args.baseline {
        Some(p) => Some(baseline::load(p)?),
        None => None,
    };
    let gpu = crate::sampler::gpu::open().is_ok();
    let mut run = Run {
        url,
        info,
        t0: Instant::now(),
        rows: Vec::new(),
        runs: Vec::new(),
        levels: Vec::new(),
        notes: metric_notes,
        slo,
        traces: Vec::new(),
        tracing: tracing.then_some(Tracing { fixed: args.trace_pid, seg: None, n: 0 }),
        metrics,
        progress: Progress::new(),
        own_prompts,
        args: args.clone(),
        gpu,
        repeat: 0,
    };
    run.setup_notes(tracing);
    let mut order_all = Vec::new();
    let result = run_sweeps(&mut run, &sweeps, &mut order_all);
    run.stop_trace();
    run.pool(&order_all);
    if let Err(e) = &result {
        run.notes.push(format!("stopped early: {e:#}"));
    }
    let interrupted = client::interrupted();
    metrics::tally_verdicts(&mut run.runs, &run.rows, |r| r.run_seq);
    metrics::tally_verdicts(&mut run.levels, &run.rows, |r| r.seq);
    let mut conclusions = conclude::conclude(&run.levels, &run.rows, run.info.slot_ctx);
    conclusions.extend(conclude::goodput(&run.levels, slo, args.goodput_pct));
    conclusions.extend(conclude::contention(&run.levels));
    let compared = baseline.as_ref().map(|b| baseline::compare(b, &run.levels));
    if let Some(c) = &compared {
        conclusions.extend(c.words());
    }
    let gate = compared.as_ref().zip(args.fail_on_regression).and_then(|(c, pct)| c.gate(pct));
    if let Some(g) = &gate {
        conclusions.push(g.clone());
    }
    let other = match args.compare_with {
        Some(args::Other::Aiperf) if !interrupted => match aiperf::compare(&run, &args) {
            Ok(c) => Some(c),
            Err(e) => {
                run.notes.push(format!("--compare-with aiperf: {e:#}"));
                None
            }
        },
        _ => None,
    };
    if let Some(o) = &other {
        conclusions.extend(o.words());
    }
    let results = Results {
        tool: format!("probe bench {}", env!("CARGO_PKG_VERSION")),
        url: args.url.clone(),
        api: args.api,
        started_unix_s,
        config: config(&args, sweeps, slo, tracing, run.info.model.clone()),
        definitions: metrics::DEFINITIONS.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        server: run.info.clone(),
        interrupted,
        rows: run.rows,
        levels: run.levels,
        runs: run.runs,
        conclusions,
        notes: run.notes,
        traces: run.traces,
        baseline: compared,
        compared_with: other,
    };
    let files = output::write_all(&args.out, &results)?;
    run.progress.line(&format!("wrote {} in {}", files.join(", "), args.out.display()));
    print_results(&results, &args);
    result?;
    if let Some(g) = gate {
        eprintln!("probe bench: {}", crate::util::text::terminal(&g));
        return Ok(crate::exit::REGRESSION);
    }
    Ok(if interrupted { crate::exit::PARTIAL } else { crate::exit::OK })
}

/// The flag combinations clap cannot check (and root for tracing); true when the run traces.
fn check_flags(args: &BenchArgs) -> anyhow::Result<bool> {
    if args.trace_pid.is_some() && args.trace {
        bail!("--trace-pid and --trace: choose one (--trace finds the pid by the URL's port)");
    }
    if args.trace_pid.is_some() && args.restart_cmd.is_some() {
        bail!("--trace-pid with --restart-cmd: the pid changes at each restart; use --trace to follow the server by its port");
    }
    if args.stop_cmd.is_some() && args.restart_cmd.is_none() {
        bail!("--stop-cmd needs --restart-cmd (which starts the server again)");
    }
    let tracing = args.trace || args.trace_pid.is_some();
    // SAFETY: geteuid has no preconditions.
    if tracing && unsafe { libc::geteuid() } != 0 {
        bail!("--trace/--trace-pid load BPF programs: run probe bench as root (or drop the tracing flags)");
    }
    Ok(tracing)
}

/// The sweeps to run, each once, in the order asked (default: concurrency, or rate with --rate).
fn sweeps_asked(args: &BenchArgs) -> Vec<Sweep> {
    let asked =
        if args.sweep.is_empty() { vec![if args.rate.is_empty() { Sweep::Concurrency } else { Sweep::Rate }] } else { args.sweep.clone() };
    asked.iter().fold(Vec::new(), |mut v, s| {
        if !v.contains(s) {
            v.push(*s);
        }
        v
    })
}

/// --prompts: the user's prompts, one a line (`\n` for a newline); none without the flag.
fn read_prompts(args: &BenchArgs) -> anyhow::Result<Vec<String>> {
    let own_prompts: Vec<String> = match &args.prompts {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read --prompts {}", f.display()))?
            .lines()
            .map(|l| l.replace("\\n", "\n"))
            .filter(|l| !l.trim().is_empty())
            .collect(),
        None => Vec::new(),
    };
    if args.prompts.is_some() && own_prompts.is_empty() {
        bail!("--prompts {}: no prompts in it (one a line)", args.prompts.as_deref().unwrap_or(std::path::Path::new("")).display());
    }
    Ok(own_prompts)
}

impl Run {
    /// The notes every run states up front: counters, request form, repeats, machine state.
    fn setup_notes(&mut self, tracing: bool) {
        self.notes.extend(self.info.notes.iter().map(|n| format!("server: {n}")));
        if self.metrics {
            self.notes.push(format!(
                "server counters: /metrics read before and after each level{}",
                if tracing {
                    " (not polled during levels while tracing: a poll is a request the verdicts would count)"
                } else {
                    ", and every 500 ms during levels above concurrency 1 (peaks)"
                }
            ));
        }
        self.notes.push("requests are plain HTTP/1.1, one connection each (Connection: close); prompts and answers are not stored (prompt hash and token count only)".into());
        if self.args.api != Api::Ollama {
            self.notes.push("cache_prompt=false on every request, so the same prompt at another level is prefilled again (llama-server); the prefix and multiturn workloads turn the cache on (they are about it)".into());
        }
        if self.args.repeat > 1 {
            self.notes.push(format!(
                "--repeat {}: each level ran {} times, the runs of a sweep's levels in a shuffled order (seed {}); figures pool every run, intervals are over the runs' own figures",
                self.args.repeat, self.args.repeat, self.args.seed
            ));
        }
        self.notes.push(format!(
            "machine state per level: CPU frequency{}, idle states, PSI, other processes' CPU (/proc){}",
            if crate::sampler::host::cpufreq().is_some() { "" } else { " (no cpufreq here)" },
            if self.gpu { ", GPU clocks and power (NVML)" } else { "; no GPU clocks (NVML did not answer)" }
        ));
    }
}

/// Plan and run every sweep, its levels in the scheduled order, until done, an error or Ctrl-C;
/// `order_all` gets every planned (sweep, level), for pooling, even when the run stops early.
fn run_sweeps(run: &mut Run, sweeps: &[Sweep], order_all: &mut Vec<(Sweep, String)>) -> anyhow::Result<()> {
    for s in sweeps {
        if client::interrupted() {
            break;
        }
        let planned = plan(run, *s)?;
        order_all.extend(planned.plans.iter().map(|(l, _)| (*s, l.clone())));
        // The idle sweep with restarts starts its own segments (one per server process).
        if *s != Sweep::Idle || run.args.restart_cmd.is_none() {
            run.start_trace()?;
        }
        let total: usize = planned.plans.iter().map(|(_, p)| p.requests()).sum::<usize>() * run.args.repeat as usize;
        run.progress.total.fetch_add(total, std::sync::atomic::Ordering::Relaxed);
        for (i, r) in schedule(planned.plans.len(), run.args.repeat, run.args.seed ^ *s as u64) {
            if client::interrupted() {
                break;
            }
            run.repeat = r;
            execute(run, &planned, i)?;
        }
    }
    Ok(())
}

/// The run's settings as results.json's `config` records them.
fn config(args: &BenchArgs, sweeps: Vec<Sweep>, slo: Slo, tracing: bool, model: Option<String>) -> results::Config {
    results::Config {
        sweeps,
        levels: args.levels.clone(),
        requests_per_level: args.requests_per_level,
        max_tokens: args.max_tokens,
        buckets: args.buckets.clone(),
        prompt_levels: args.prompt_levels.clone(),
        bucket_max_tokens: args.bucket_max_tokens,
        idle_s: args.idle.iter().map(|d| d.as_secs_f64()).collect(),
        idle_max_tokens: args.idle_max_tokens,
        restart_cmd: args.restart_cmd.is_some(),
        stop_cmd: args.stop_cmd.is_some(),
        drop_cache: args.drop_cache,
        keep_warm: args.keep_warm,
        keep_warm_every_s: args.keep_warm_every.as_secs_f64(),
        seed: args.seed,
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
        timeout_s: args.timeout.as_secs_f64(),
        goodput_ttft_ms: slo.ttft_ms,
        goodput_tpot_ms: slo.tpot_ms,
        trace: tracing,
        model,
        repeat: args.repeat,
        slo: (!slo.is_empty()).then_some(slo),
        goodput_pct: args.goodput_pct,
        rates: args.rate.clone(),
        prefix_tokens: args.prefix_tokens,
        prefix_requests: args.prefix_requests,
        turns: args.turns,
    }
}

/// The terminal's part: each sweep's table, the other tool's, the conclusions.
fn print_results(results: &Results, args: &BenchArgs) {
    for s in SWEEPS {
        print!("{}", crate::util::text::terminal(&output::table(&results.levels, s)));
    }
    if let Some(o) = &results.compared_with {
        print!("{}", crate::util::text::terminal(&o.table()));
    }
    println!("\nconclusions:");
    for c in &results.conclusions {
        println!("  - {}", crate::util::text::terminal(c));
    }
    println!("\n(definitions and notes in {})", args.out.join("summary.txt").display());
}

/// Every sweep's name, in the order outputs list them.
pub const SWEEPS: [Sweep; 6] = [Sweep::Concurrency, Sweep::Rate, Sweep::Prompt, Sweep::Prefix, Sweep::Multiturn, Sweep::Idle];

fn template(sweep: Sweep, level: String, concurrency: u64) -> Row {
    Row { sweep, level, concurrency, ..Default::default() }
}

/// One level of a sweep, ready to run (again, with --repeat).
#[derive(Clone, Debug)]
enum Plan {
    Concurrency { c: u64, n: usize },
    Prompt { bucket: u64, c: u64, n: usize },
    Idle { d: Duration },
    Rate { rate: f64, n: usize },
    Prefix { c: u64, n: usize },
    Multiturn { c: u64, turns: usize },
}

impl Plan {
    fn requests(&self) -> usize {
        match self {
            Plan::Concurrency { n, .. } | Plan::Prompt { n, .. } | Plan::Rate { n, .. } | Plan::Prefix { n, .. } => *n,
            Plan::Idle { .. } => 1,
            Plan::Multiturn { c, turns } => *c as usize * turns,
        }
    }
}

/// A sweep's levels with what they share: prompts, sized bucket prompts, the idle setup.
struct Planned {
    plans: Vec<(String, Plan)>,
    prompts: Vec<sweep::Prompt>,
    buckets: std::collections::BTreeMap<u64, sweep::Prompt>,
    idle: Option<IdleSetup>,
}

/// The run order: each of `n` plans `repeat` times; shuffled (Fisher-Yates, seeded) when
/// repeated, so that a drift over the run (a warming cache, a neighbour starting) spreads over
/// the levels instead of landing on the last.
fn schedule(n: usize, repeat: u64, seed: u64) -> Vec<(usize, u64)> {
    let mut v: Vec<(usize, u64)> = (0..repeat).flat_map(|r| (0..n).map(move |i| (i, r))).collect();
    if repeat > 1 {
        let mut x = seed;
        for i in (1..v.len()).rev() {
            v.swap(i, (sweep::splitmix64(&mut x) % (i as u64 + 1)) as usize);
        }
    }
    v
}

fn plan(run: &mut Run, s: Sweep) -> anyhow::Result<Planned> {
    let mut p = Planned { plans: Vec::new(), prompts: Vec::new(), buckets: Default::default(), idle: None };
    let top = run.args.levels.iter().copied().max().unwrap_or(1);
    match s {
        Sweep::Concurrency => {
            let n_prompts = run.args.requests_per_level.unwrap_or(top) as usize;
            p.prompts = sweep::instruction_prompts(&run.url, n_prompts, run.info.model.as_deref(), false, &run.own_prompts);
            for &c in &run.args.levels {
                p.plans.push((c.to_string(), Plan::Concurrency { c, n: (c as usize).max(n_prompts) }));
            }
        }
        Sweep::Rate => {
            if run.args.rate.is_empty() {
                bail!("--sweep rate needs --rate R[,R...] (requests per second)");
            }
            let n = run.args.requests_per_level.unwrap_or(16) as usize;
            p.prompts = sweep::instruction_prompts(&run.url, n, run.info.model.as_deref(), false, &run.own_prompts);
            for &rate in &run.args.rate {
                p.plans.push((format!("{rate} rps"), Plan::Rate { rate, n }));
            }
            run.notes.push(format!(
                "rate sweep: {n} requests a level, sent at exponential gaps (a Poisson process, seeded) whatever is in flight (open loop); sent_ms is each request's send time on the client's clock"
            ));
        }
        Sweep::Prefix => {
            for &c in &run.args.levels {
                p.plans.push((c.to_string(), Plan::Prefix { c, n: (run.args.prefix_requests as usize).max(c as usize + 1) }));
            }
            run.notes.push(format!(
                "prefix workload: each level's requests share a {}-token system prompt of their own (a new one per level and run), the first sent alone to fill the cache, the prompt cache on; reuse from the server's cached-token counts",
                run.args.prefix_tokens
            ));
        }
        Sweep::Multiturn => {
            let c_max = top as usize;
            p.prompts = sweep::instruction_prompts(&run.url, c_max, run.info.model.as_deref(), false, &run.own_prompts);
            for &c in &run.args.levels {
                p.plans.push((c.to_string(), Plan::Multiturn { c, turns: run.args.turns as usize }));
            }
            run.notes.push(format!(
                "multiturn workload: --levels conversations at once, {} turns each, every turn sending the conversation so far (answers kept in memory only), the prompt cache on",
                run.args.turns
            ));
        }
        Sweep::Prompt => {
            let levels = run.args.prompt_levels.clone().unwrap_or_else(|| {
                let mut v = vec![1];
                v.extend(run.args.levels.iter().filter(|&&l| l != 1));
                v
            });
            let per = run.args.requests_per_level.unwrap_or(1) as usize;
            let ctx_tokens = run.info.slot_ctx;
            for &b in &run.args.buckets.clone() {
                if client::interrupted() {
                    break;
                }
                run.progress.update(&format!("sizing a {b}-token prompt"));
                let pr = sweep::sized_prompt(&run.url, b, run.args.seed, run.info.model.as_deref());
                if pr.source == sweep::PromptSource::Estimate && !run.notes.iter().any(|n| n.contains("no tokenizer")) {
                    run.notes.push("the server has no tokenizer endpoint: prompt buckets are estimated at 4 characters a token".into());
                }
                let tokens = pr.tokens.unwrap_or(b);
                let over = ctx_tokens.is_some_and(|c| tokens >= c);
                if over {
                    run.notes.push(format!(
                        "bucket {b} ({tokens} tokens) does not fit the server's {}-token slot context: sent once, to record the server's answer",
                        ctx_tokens.unwrap_or(0)
                    ));
                    p.plans.push((format!("{b} @1"), Plan::Prompt { bucket: b, c: 1, n: 1 }));
                } else {
                    if let Some(c) = ctx_tokens.filter(|c| tokens + run.args.bucket_max_tokens > *c) {
                        run.notes.push(format!(
                            "bucket {b}: prompt + {} output tokens exceed the {c}-token slot context: expect a server-imposed limit",
                            run.args.bucket_max_tokens
                        ));
                    }
                    for &c in &levels {
                        p.plans.push((format!("{b} @{c}"), Plan::Prompt { bucket: b, c, n: (c as usize).max(per) }));
                    }
                }
                p.buckets.insert(b, pr);
            }
        }
        Sweep::Idle => {
            p.idle = Some(idle_setup(run)?);
            for &d in &run.args.idle {
                p.plans.push((label(d), Plan::Idle { d }));
            }
        }
    }
    Ok(p)
}

/// Run one planned level once (the run's current repeat).
fn execute(run: &mut Run, planned: &Planned, i: usize) -> anyhow::Result<()> {
    let (label, plan) = &planned.plans[i];
    let seed = run.args.seed ^ (i as u64 + 1).wrapping_mul(0x51_7cc1_b727_220a) ^ run.repeat.wrapping_mul(0x2545_f491_4f6c_dd1d);
    match plan {
        Plan::Concurrency { c, n } => {
            let s = run.sampling(run.args.max_tokens);
            let (rows, level) =
                sweep::level(&run.ctx(), &template(Sweep::Concurrency, label.clone(), *c), &planned.prompts, *n, *c as usize, &s);
            run.push(rows, level);
        }
        Plan::Rate { rate, n } => {
            let s = run.sampling(run.args.max_tokens);
            let at_ms = sweep::poisson_ms(*rate, *n, seed);
            let (rows, mut level) = sweep::run_level(
                &run.ctx(),
                &template(Sweep::Rate, label.clone(), 0),
                &planned.prompts,
                &sweep::Schedule::Open { at_ms },
                &s,
            );
            level.rate_rps = Some(*rate);
            run.push(rows, level);
        }
        Plan::Prompt { bucket, c, n } => {
            let s = run.sampling(run.args.bucket_max_tokens);
            let mut t = template(Sweep::Prompt, label.clone(), *c);
            t.bucket_tokens = Some(*bucket);
            let p = planned.buckets[bucket].clone();
            let (rows, level) = sweep::level(&run.ctx(), &t, std::slice::from_ref(&p), *n, *c as usize, &s);
            run.push(rows, level);
        }
        Plan::Prefix { c, n } => {
            run.progress.update(&format!("sizing a {}-token shared prefix", run.args.prefix_tokens));
            let prefix = sweep::sized_prompt(&run.url, run.args.prefix_tokens, seed, run.info.model.as_deref());
            let system = format!("You answer questions about the following notes.\n\n{}", prefix.text);
            let prompts: Vec<sweep::Prompt> = (0..*n)
                .map(|k| {
                    let q = format!(
                        "Question {}: write a long story that uses the word \"{}\" from the notes.",
                        k + 1,
                        sweep::words_text(seed ^ k as u64, 1).trim_end_matches('.')
                    );
                    let text = format!("{system}\n\n{q}");
                    sweep::Prompt {
                        hash: sweep::hash(&text),
                        tokens: prefix.tokens.map(|t| t + 24),
                        source: prefix.source,
                        messages: vec![("system".into(), system.clone()), ("user".into(), q)],
                        text,
                    }
                })
                .collect();
            let s = Sampling { cache_prompt: true, ..run.sampling(run.args.max_tokens) };
            let t = template(Sweep::Prefix, label.clone(), *c);
            let sched = sweep::Schedule::Closed { n: *n, concurrency: *c as usize, first_alone: true };
            let (rows, level) = sweep::run_level(&run.ctx(), &t, &prompts, &sched, &s);
            run.push(rows, level);
        }
        Plan::Multiturn { c, turns } => {
            let s = Sampling { cache_prompt: true, ..run.sampling(run.args.max_tokens) };
            let t = template(Sweep::Multiturn, label.clone(), *c);
            let sched = sweep::Schedule::Conversations { conversations: *c as usize, turns: *turns };
            let (rows, level) = sweep::run_level(&run.ctx(), &t, &planned.prompts, &sched, &s);
            run.push(rows, level);
        }
        Plan::Idle { d } => {
            let setup = planned.idle.as_ref().context("idle sweep without its setup")?;
            idle_one(run, setup, *d)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_shuffled_by_seed_and_complete() {
        let one = schedule(3, 1, 42);
        assert_eq!(one, vec![(0, 0), (1, 0), (2, 0)], "a single run keeps the plan's order");
        let a = schedule(3, 4, 42);
        assert_eq!(a, schedule(3, 4, 42));
        assert_ne!(a, schedule(3, 4, 43));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..3).flat_map(|i| (0..4).map(move |r| (i, r))).collect::<Vec<_>>());
        assert_ne!(a, (0..4).flat_map(|r| (0..3).map(move |i| (i, r))).collect::<Vec<_>>(), "not shuffled");
        // The levels' order, as the real-server test runs it (2 levels x 3, seed 42).
        let levels: Vec<usize> = schedule(2, 3, 42).iter().map(|x| x.0).collect();
        assert_ne!(levels, [0, 1, 0, 1, 0, 1]);
    }
}
