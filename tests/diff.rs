//! `probe diff` between two recordings of real llama-servers: the same prompts on `-t 1` and on
//! `-t 2`. The truth is the servers' own word (`timings.predicted_per_token_ms` in each final
//! stream message, read by this client) and the command lines the test gave; never probe's.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::{Value, json};

mod common;
use common::probe_bin;

/// The same streamed prompts, one at a time; the server's per-token time of each.
fn ask(addr: std::net::SocketAddr) -> Vec<f64> {
    (0..4)
        .map(|i| {
            let body = json!({"prompt": format!("Tell me story number {i} about a cat and a boat."), "n_predict": 48, "stream": true,
                "ignore_eos": true, "seed": 42 + i, "temperature": 0.0, "cache_prompt": false});
            let (st, bytes) = common::http(addr, "POST", "/completion", Some(&body), &[]).unwrap();
            assert_eq!(st, 200);
            // The final SSE message carries the server's timings.
            let text = String::from_utf8_lossy(&bytes).into_owned();
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find_map(|v| v["timings"]["predicted_per_token_ms"].as_f64())
                .unwrap_or_else(|| panic!("no timings in the stream: {text}"))
        })
        .collect()
}

/// CPU time the process has used, ms (/proc/PID/stat utime + stime: the kernel's own count).
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<f64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11] + f[12]) * 1e3 / hz
}

/// A recording of a fresh llama-server (`exe`) started with `threads`, serving [`ask`]'s
/// prompts: the directory, the server's per-token times and the CPU time it used while serving
/// them (the kernel's count).
fn record(exe: &Path, threads: &str) -> (PathBuf, Vec<f64>, f64) {
    let (mut srv, addr) = common::llama_server_from(exe, &["-c", "1024", "-np", "1", "-t", threads, "--seed", "42"]);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("diff-t{threads}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let pid = srv.id().to_string();
    let (mut child, _lines, _) = common::start_trace(&["--pid", &pid, "--duration", "120s", "--out", out.to_str().unwrap()]);
    let before = cpu_ms(srv.id());
    let server = ask(addr);
    let cpu = cpu_ms(srv.id()) - before;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(0), "probe exit");
    let _ = srv.kill();
    let _ = srv.wait();
    (out, server, cpu)
}

/// A copy of llama-server that is another build: one byte of its GNU build id flipped (readelf
/// names the id; the code is the same).
fn another_build() -> PathBuf {
    let exe = common::env_path("LLAMA_SERVER");
    let notes = Command::new("readelf").arg("-n").arg(&exe).output().expect("readelf (binutils)");
    let text = String::from_utf8_lossy(&notes.stdout).into_owned();
    let hex =
        text.lines().find_map(|l| l.trim().strip_prefix("Build ID: ")).unwrap_or_else(|| panic!("no build id: {text}")).trim().to_string();
    let id: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let mut bytes = std::fs::read(&exe).unwrap();
    let at = bytes.windows(id.len()).position(|w| w == id.as_slice()).expect("the build id's bytes");
    bytes[at + id.len() - 1] ^= 0xff;
    let copy = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llama-server-other-build-{}", std::process::id()));
    std::fs::write(&copy, &bytes).unwrap();
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    copy
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn two_thread_counts_differ_by_their_flag_and_decode_time() {
    // A: the built llama-server with one thread; B: another build of it with two.
    let (a, ta, cpu_a) = record(&common::env_path("LLAMA_SERVER"), "1");
    let other = another_build();
    let (b, tb, cpu_b) = record(&other, "2");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("diff-t-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let diff = |force: bool| {
        let mut c = Command::new(probe_bin());
        c.arg("diff").arg(&a).arg(&b).arg("--out").arg(&out);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    // Two builds are compared only with --force: the refusal names the build ids.
    let refused = diff(false);
    let why = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert_eq!(refused.status.code(), Some(2), "{why}");
    assert!(why.contains("build id") && why.contains("--force"), "{why}");
    assert!(!out.join("diff.json").exists(), "a refused diff wrote its output");
    let run = diff(true);
    let said = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "probe diff: {}{said}", String::from_utf8_lossy(&run.stderr));
    let d: Value = serde_json::from_slice(&std::fs::read(out.join("diff.json")).unwrap()).unwrap();
    assert_eq!(d["mode"], "recordings");
    // The changed flag is named, with both values; the headline says it.
    let setup = d["setup"].as_array().unwrap();
    assert!(setup.iter().any(|c| c["what"] == "command line -t" && c["a"] == "1" && c["b"] == "2"), "{setup:?}");
    assert!(d["headline"].as_str().unwrap().contains("-t 1 → 2"), "{}", d["headline"]);
    // The decode time per token changed as the servers' own timings say, within 10%.
    let (pa, pb) = (d["per_token_ms"]["a"].as_f64().unwrap(), d["per_token_ms"]["b"].as_f64().unwrap());
    let (sa, sb) = (mean(&ta), mean(&tb));
    let (probe_ratio, server_ratio) = (pb / pa, sb / sa);
    eprintln!("per token: probe {pa:.2} → {pb:.2} ms ({probe_ratio:.3}×), servers {sa:.2} → {sb:.2} ms ({server_ratio:.3}×)");
    assert!((probe_ratio / server_ratio - 1.0).abs() <= 0.10, "probe {probe_ratio:.3}× against the servers' {server_ratio:.3}×");
    // The on-CPU graph is per generated token, and its total moved as the kernel's count of the
    // servers' CPU time did (the same prompts and tokens on both: within 15%).
    let cpu = d["flames"].as_array().unwrap().iter().find(|f| f["kind"] == "cpu").expect("an on-CPU differential flamegraph");
    assert_eq!(cpu["normalised"], "per generated token");
    let (sa_cpu, sb_cpu) = (cpu["total"]["a"].as_f64().unwrap(), cpu["total"]["b"].as_f64().unwrap());
    let grew: Vec<&str> = cpu["grew"].as_array().unwrap().iter().map(|f| f["frame"].as_str().unwrap()).collect();
    eprintln!(
        "cpu: {sa_cpu:.2} → {sb_cpu:.2} samples per token ({:.3}×), the kernel's count {cpu_a:.0} → {cpu_b:.0} ms ({:.3}×); moved {:.2}, grew {grew:?}",
        sb_cpu / sa_cpu,
        cpu_b / cpu_a,
        cpu["moved"]
    );
    assert!(((sb_cpu / sa_cpu) / (cpu_b / cpu_a) - 1.0).abs() <= 0.15, "on-CPU samples per token against /proc/PID/stat: {cpu}");
    // Where the CPU went is compared by function (a thread pool moves the work to other stacks,
    // not to other functions): a kernel of the model's (ggml's) is named as grown only by what
    // the servers really spent more (their CPU time per token, the kernel's count; 5 points of
    // A's total for sampling noise).
    let grown_by = (cpu_b / cpu_a - 1.0).max(0.0);
    for f in cpu["grew"].as_array().unwrap() {
        let name = f["frame"].as_str().unwrap();
        if name.starts_with("ggml_vec_dot") || name.starts_with("ggml_compute_forward") {
            let by = (f["b"].as_f64().unwrap() - f["a"].as_f64().unwrap()) / sa_cpu;
            assert!(
                by <= grown_by + 0.05,
                "{name} grew by {:.0}% of A's CPU, the servers' CPU by {:.0}%: {f}",
                by * 100.0,
                grown_by * 100.0
            );
        }
    }
    // inferno's own reader takes the folded diff back (stack, A, B) and draws it.
    let folded = std::fs::read_to_string(out.join(cpu["folded"].as_str().unwrap())).unwrap();
    assert!(folded.lines().all(|l| l.rsplitn(3, ' ').count() == 3), "not the differential format");
    let mut opts = inferno::flamegraph::Options::default();
    let mut svg = Vec::new();
    inferno::flamegraph::from_reader(&mut opts, folded.as_bytes(), &mut svg).unwrap();
    let svg = String::from_utf8(svg).unwrap();
    assert!(svg.contains("ggml_vec_dot"), "the redrawn SVG does not name the model's kernels");
    // ... and every frame the diff says grew (as the SVG escapes text).
    let escape = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    for f in &grew {
        assert!(svg.contains(&escape(f)), "the redrawn SVG does not name {f}, which grew");
    }
    assert!(out.join("diff.md").exists() && out.join("diff-cpu.svg").exists());
    assert!(d["mismatch"].as_array().unwrap().iter().any(|m| m.as_str().unwrap().contains("build id")), "{}", d["mismatch"]);
    let _ = std::fs::remove_file(other);
}
