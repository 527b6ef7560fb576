//! Stack tests: real programs without frame pointers, sampled and unwound by the real probe.
//! The C workload (tests/data/stacks/stacks.c) is compiled here with `cc -O2 -fomit-frame-pointer`.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
};

mod common;

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("stacks-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The C workload, built once per test run.
fn workload() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("stacks-workload");
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/stacks/stacks.c");
        let st = Command::new("cc").args(["-O2", "-fomit-frame-pointer", "-pthread", "-o"]).arg(&out).arg(&src).status().expect("cc");
        assert!(st.success(), "cannot compile {}", src.display());
        out
    })
}

/// One workload at a time: each is timed against the kernel's own counters, and what a thread's
/// stacks need is learned from its first records (a loaded box delays that).
static CPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run a workload mode under `probe trace` (started once the workload is ready, stopped by the
/// workload's exit); returns the workload's `done` line and the recording directory.
fn traced(name: &str, args: &[&str]) -> (String, PathBuf) {
    traced_with(name, args, &[])
}

/// [`traced`] with more options for `probe trace`.
fn traced_with(name: &str, args: &[&str], opts: &[&str]) -> (String, PathBuf) {
    let (done, rec, _, _) = traced_env(name, args, opts, &[]);
    (done, rec)
}

/// [`traced_with`] with variables added to probe's environment; also probe's stderr after
/// "armed" and the workload's pid.
fn traced_env(name: &str, args: &[&str], opts: &[&str], env: &[(&str, &str)]) -> (String, PathBuf, Vec<String>, String) {
    let _cpus = CPUS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp(name);
    let mut w: Child = Command::new(workload()).args(args).current_dir(&dir).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(w.stdout.take().unwrap()).lines();
    let ready = lines.next().unwrap().unwrap();
    let pid = ready.strip_prefix("ready ").unwrap().to_string();
    let rec = dir.join("rec");
    let mut targs = vec!["--pid", &pid, "--duration", "60s", "--out", rec.to_str().unwrap()];
    targs.extend_from_slice(opts);
    let (mut p, rx, armed) = common::start_trace_env(&targs, env);
    assert!(armed.contains("cpu") && armed.contains("offcpu"), "stack probes not live: {armed}");
    writeln!(w.stdin.take().unwrap(), "go").unwrap();
    let done = lines.next().unwrap().unwrap();
    assert!(w.wait().unwrap().success());
    let ok = p.wait().unwrap().success();
    // Its stderr to the end (the reader thread ends with the pipe; 5 s of quiet at most).
    let log: Vec<String> = std::iter::from_fn(|| rx.recv_timeout(std::time::Duration::from_secs(5)).ok()).collect();
    assert!(ok, "probe: {log:?}");
    (done, rec, log, pid)
}

fn folded(rec: &Path, kind: &str) -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string(rec.join(format!("flame-{kind}.folded"))).unwrap_or_else(|e| panic!("no {kind} flamegraph: {e}"));
    assert!(rec.join(format!("flame-{kind}.svg")).exists());
    text.lines()
        .map(|l| {
            let (stack, n) = l.rsplit_once(' ').unwrap();
            (stack.to_string(), n.parse().unwrap())
        })
        .collect()
}

#[test]
fn cpu_stacks_unwind_without_frame_pointers() {
    let (_, rec) = traced("spin", &["spin", "2"]);
    let f = folded(&rec, "cpu");
    let total: u64 = f.values().sum();
    let chain: u64 = f.iter().filter(|(s, _)| s.contains("main;outer;middle;inner")).map(|(_, n)| n).sum();
    // 2 s at 99 Hz gives ~198 samples when the spinning thread has a CPU to itself.
    assert!(total >= 100, "2 s of spinning at 99 Hz gave only {total} samples");
    assert!(chain * 10 >= total * 9, "outer;middle;inner in {chain} of {total} samples: {f:?}");
}

/// A thread under a frame with 40 KiB of locals (llama-server's `main` is like it): its stack's
/// mapping ends less than the largest copy (64 KiB) above its frames, so that copy faults; the
/// next (32 KiB) cut every stack under the large frame. Once the collector has told the kernel
/// where the mapping ends, the largest copy reads up to there: the stacks come out whole, along
/// each of the two call paths the workload takes by turns (its source is the truth).
#[test]
fn stacks_of_a_thread_near_its_stacks_end_are_whole() {
    let (_, rec) = traced("deep", &["deep", "3"]);
    assert_deep_stacks_whole(&rec);
    // The user's choice of cheaper samples: copies of at most 16 KiB cut every stack under the
    // 40 KiB frame.
    let (_, rec) = traced_with("deep-16", &["deep", "2"], &["--stack-kib", "16"]);
    let f = folded(&rec, "cpu");
    let total: u64 = f.values().sum();
    let whole: u64 = f.iter().filter(|(s, _)| s.contains("deep_thread;big_frame;")).map(|(_, n)| n).sum();
    assert!(total >= 100 && whole * 10 <= total, "--stack-kib 16: {whole} of {total} stacks reached the thread's start: {f:?}");
}

/// The `deep` workload's 3 s of CPU stacks come out whole along both call paths it takes by turns
/// (its source is the truth): each path in at least a quarter, both in at least 80%.
fn assert_deep_stacks_whole(rec: &Path) {
    let f = folded(rec, "cpu");
    let total: u64 = f.values().sum();
    let path = |p: &str| -> u64 { f.iter().filter(|(s, _)| s.contains(p)).map(|(_, n)| n).sum() };
    let (a, b) = (path("deep_thread;big_frame;outer;middle;inner"), path("deep_thread;big_frame;side;inner"));
    assert!(total >= 150, "3 s of spinning at 99 Hz gave only {total} samples");
    assert!(a * 4 >= total && b * 4 >= total, "outer;middle;inner {a}, side;inner {b} of {total}: {f:?}");
    assert!((a + b) * 10 >= total * 8, "whole stacks in {} of {total}: {f:?}", a + b);
}

/// The same thread, once its whole stacks are known: a stack cut by a short copy at a frame its
/// last whole stacks passed at the same place and stack pointer takes its outer frames from them,
/// and the kernel is told to copy only what the frames below take (from 64 KiB to a few KiB: the
/// 40 KiB frame is no longer copied). The stacks stay whole along both call paths (the source is
/// the truth); what the collector told the kernel is its log's.
#[test]
fn stitched_stacks_copy_less_and_stay_whole() {
    let (_, rec, log, pid) = traced_env("deep-stitched", &["deep", "3"], &[], &[("RUST_LOG", "probe_user::collector::stacks=debug")]);
    // "thread TID: user stacks need N bytes" for the thread other than the main one.
    let told: Vec<(String, u64)> = log
        .iter()
        .filter_map(|l| {
            let rest = l.split("thread ").nth(1)?;
            let (tid, rest) = rest.split_once(": user stacks need ")?;
            Some((tid.to_string(), rest.split(' ').next()?.parse().ok()?))
        })
        .filter(|(tid, _)| *tid != pid)
        .collect();
    let most = told.iter().map(|t| t.1).max().unwrap_or(0);
    let last = told.last().map_or(0, |t| t.1);
    assert!(most >= 40 << 10, "the whole stack (under a 40 KiB frame) was never copied: {told:?}");
    assert!(last <= 16 << 10, "the copy did not shrink below the 40 KiB frame once stacks were stitched: {told:?}");
    assert_deep_stacks_whole(&rec);
}

/// The off-CPU graph weighs a wait by the time the thread was blocked, until its wake-up (the
/// wait for a CPU after it is cpu_contention, not IO): the workload's own count is its wall time
/// less its CPU time and its run-queue time (schedstat). On a VM that count also holds what the
/// hypervisor stole while the thread ran (the kernel leaves it out of the thread's CPU time): the
/// machine's steal over the same stretch (/proc/stat, whole ticks, so up to one more) is the most
/// it can be short by. Every time the thread blocked (its voluntary context switches) is a stack.
#[test]
fn blocked_read_shows_io_wait_with_its_time() {
    let (done, rec) = traced("offcpu", &["read-cold", "cold.bin", "160"]);
    let field = |k: &str| -> f64 { done.split(' ').find_map(|f| f.strip_prefix(k)?.strip_prefix('=')).unwrap().parse().unwrap() };
    let (blocked_ns, steal_ticks, blocks, hz) = (field("blocked_ns"), field("steal_ticks"), field("blocks"), field("ticks_per_s"));
    let f = folded(&rec, "offcpu");
    let io: u64 = f.iter().filter(|(s, _)| s.contains("[io wait]") && s.contains(";read_cold;")).map(|(_, n)| n).sum();
    let io_ns = io as f64 * 1e3;
    let stolen_at_most = (steal_ticks + 1.0) * 1e9 / hz;
    assert!(
        io_ns <= blocked_ns * 1.10 && io_ns >= blocked_ns * 0.90 - stolen_at_most,
        "probe: {io_ns:.0} ns blocked in IO under read_cold, workload measured {blocked_ns:.0} ns (of which up to {stolen_at_most:.0} ns stolen): {f:?}"
    );
    let stacks = common::read_report(&rec)["stacks"]["offcpu"]["stacks"].as_f64().unwrap();
    assert!(stacks >= blocks, "the thread blocked {blocks} times, probe has {stacks} off-CPU stacks");
    assert!(f.keys().any(|s| s.contains("read_cold") && s.contains("io_schedule")), "no io_schedule kernel frame: {f:?}");
    let io = folded(&rec, "io");
    assert!(io.keys().all(|s| s.contains(";read_cold;")), "block IO issued outside read_cold: {io:?}");
    // The wait classes come from the recording, not from the machine that reads it.
    common::assert_report_is_the_same_offline(&rec);
}

/// The hypervisor's steal while a thread ran, measured by probe at every context switch, against
/// what the thread measured itself (each burst's wall time less its CPU time and run-queue wait:
/// the kernel's own counters). On a host that steals nothing both are near 0; under a busy host
/// they grow together.
#[test]
fn steal_while_running_is_what_the_thread_lost() {
    let (done, rec) = traced("steal", &["bursts", "3"]);
    let field = |k: &str| -> f64 { done.split(' ').find_map(|f| f.strip_prefix(k)?.strip_prefix('=')).unwrap().parse().unwrap() };
    let (truth_ms, tid, ticks, hz) = (field("stolen_ns") / 1e6, field("tid") as u32, field("steal_ticks"), field("ticks_per_s"));
    let report = common::read_report(&rec);
    let probe_ms = report["steal_running_ms"][tid.to_string()].as_f64().unwrap_or(0.0);
    eprintln!("steal while running: probe {probe_ms:.2} ms, the thread {truth_ms:.2} ms; /proc/stat steal {ticks} ticks over the CPUs");
    assert!((probe_ms - truth_ms).abs() <= 0.10 * truth_ms + 2.0, "probe {probe_ms:.2} ms, the thread measured {truth_ms:.2} ms");
    // The machine's steal over every CPU bounds both (whole ticks: one more per CPU at most).
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get()) as f64;
    assert!(probe_ms <= (ticks + cpus) * 1e3 / hz + 2.0, "probe {probe_ms:.2} ms against /proc/stat's {ticks} ticks");
}

#[test]
fn major_faults_are_charged_to_the_touching_function() {
    let (_, rec) = traced("faults", &["touch-cold", "cold.bin", "40"]);
    let f = folded(&rec, "faults");
    let n: u64 = f.iter().filter(|(s, _)| s.ends_with("main;touch_cold") || s.contains(";touch_cold;")).map(|(_, n)| n).sum();
    assert_eq!(n, 40, "{f:?}");
    // Each fault's block IO comes from the same place (the same user registers): its stack is the
    // fault's, and so is the thread's wait for it; one load instruction faults 40 times over. The
    // kernel sends such a stack once per place and the rest as the same: every one of the 120 is
    // still there and charged to touch_cold, most of them not copied or unwound again.
    let io = folded(&rec, "io");
    let n: u64 = io.iter().filter(|(s, _)| s.contains("main;touch_cold")).map(|(_, n)| n).sum();
    assert!(n >= 40 && io.keys().all(|s| s.contains("main;touch_cold")), "{io:?}");
    let r = common::read_report(&rec);
    assert_eq!(r["stacks"]["io"]["complete"], r["stacks"]["io"]["stacks"], "{}", r["stacks"]);
    let (unwound, reused) = (r["unwind"]["samples"].as_u64().unwrap(), r["unwind"]["reused"].as_u64().unwrap());
    assert!(reused >= 2 * unwound, "{unwound} stacks unwound, {reused} reused: {}", r["unwind"]);
}

/// 100 000 short-lived threads: each thread's last switch (as it exits) must not leave an entry
/// in the kernel's off-CPU map (it would fill up, and later waits would go unmeasured).
#[test]
fn thread_churn_leaves_off_cpu_waits_measured() {
    let (done, rec) = traced("churn", &["churn", "100000"]);
    let slept_ns: f64 = done.split("slept_ns=").nth(1).unwrap().parse().unwrap();
    let report = common::read_report(&rec);
    assert_eq!(report["counters"]["map_full"], 0, "a kernel map filled up: {}", report["counters"]);
    let f = folded(&rec, "offcpu");
    let slept: u64 = f.iter().filter(|(s, _)| s.contains(";churn_sleep;")).map(|(_, n)| n).sum();
    let slept_us = slept as f64;
    assert!(
        (slept_us * 1e3 - slept_ns).abs() <= slept_ns * 0.10,
        "probe: {slept_us:.0} us blocked under churn_sleep after the churn, the workload slept {:.0} us",
        slept_ns / 1e3
    );
}
