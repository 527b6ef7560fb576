//! A sleeping GPU stays asleep: probe opens NVML only while the traced server is busy and closes
//! every handle when it idles. These machines have no NVIDIA GPU, so NVML is a stand-in library
//! built here (tests/data/gpu/nvml_standin.c) and loaded through the same dlopen path as the
//! driver's (`PROBE_NVML_LIB`); it writes every call with its CLOCK_MONOTONIC time. The device's
//! sysfs directory (vendor, class, runtime PM) is a directory tree made here (`PROBE_PCI_ROOT`):
//! a runtime-power-managed GPU, suspended. The server, its requests and the client's clock are real.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

mod common;
use common::{serial, shared_llama_server, start_trace_env, workload::scratch};

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid pointer to a local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The stand-in library, built from its source into `dir`.
fn standin(dir: &Path) -> PathBuf {
    let so = dir.join("libnvidia-ml.so.1");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/gpu/nvml_standin.c");
    let ok = Command::new("cc").args(["-shared", "-fPIC", "-O2", "-o"]).arg(&so).arg(&src).status().expect("cc");
    assert!(ok.success(), "cannot build the NVML stand-in");
    so
}

/// A sysfs PCI tree with one NVIDIA GPU under runtime power management, suspended in D3cold.
fn suspended_gpu(dir: &Path) -> PathBuf {
    let root = dir.join("pci");
    let dev = root.join("0000:01:00.0");
    std::fs::create_dir_all(dev.join("power")).unwrap();
    for (f, v) in [
        ("vendor", "0x10de"),
        ("class", "0x030000"),
        ("power_state", "D3cold"),
        ("power/runtime_status", "suspended"),
        ("power/control", "auto"),
    ] {
        std::fs::write(dev.join(f), format!("{v}\n")).unwrap();
    }
    root
}

/// The stand-in's calls: (ns, name).
fn calls(log: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (t, n) = l.split_once(' ')?;
            Some((t.parse().ok()?, n.to_string()))
        })
        .collect()
}

/// Open handles (inits not yet shut down) at `t`.
fn open_at(calls: &[(u64, String)], t: u64) -> i64 {
    calls
        .iter()
        .filter(|(ts, _)| *ts <= t)
        .map(|(_, n)| {
            if n.starts_with("nvmlInit") {
                1
            } else if n == "nvmlShutdown" {
                -1
            } else {
                0
            }
        })
        .sum()
}

#[test]
fn nvml_is_open_only_while_the_server_is_busy() {
    let _serial = serial();
    let d = scratch("gpu-standin");
    let so = standin(&d);
    let pci = suspended_gpu(&d);
    let log = d.join("nvml.log");
    let (server, addr) = shared_llama_server(&["-c", "1024", "-np", "1", "--no-repack"]);
    let out = d.join("rec");
    let env =
        [("PROBE_NVML_LIB", so.to_str().unwrap()), ("NVML_STANDIN_LOG", log.to_str().unwrap()), ("PROBE_PCI_ROOT", pci.to_str().unwrap())];
    let (mut p, _lines, _) = start_trace_env(&["--pid", &server.id().to_string(), "--out", out.to_str().unwrap()], &env);
    // Idle first: nothing may touch the device.
    std::thread::sleep(Duration::from_secs(4));
    let sent = monotonic_ns();
    let body = serde_json::json!({"prompt": "Tell me about the sea. ".repeat(20), "n_predict": 96, "cache_prompt": false});
    let (st, _) = common::http(addr, "POST", "/completion", Some(&body), &[]).unwrap();
    assert_eq!(st, 200);
    let answered = monotonic_ns();
    // Idle again: NVML must be closed within a couple of seconds and stay closed.
    std::thread::sleep(Duration::from_secs(7));
    let before_stop = monotonic_ns();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    assert!(p.wait().unwrap().success());
    let c = calls(&log);
    eprintln!("{} NVML calls; request {:.0} ms", c.len(), (answered - sent) as f64 / 1e6);
    assert!(c.iter().all(|(t, _)| *t >= sent), "NVML was called before the request, while the server idled: {:?}", &c[..c.len().min(5)]);
    let inits: Vec<u64> = c.iter().filter(|(_, n)| n.starts_with("nvmlInit")).map(|(t, _)| *t).collect();
    assert!(!inits.is_empty(), "NVML was never opened while the server was busy");
    let queries = c.iter().filter(|(_, n)| n == "nvmlDeviceGetClockInfo").count();
    assert!(queries >= 1, "no clock was read while busy: {c:?}");
    // Closed within 3 s of the answer (the busy flag is set and cleared once a second), then no call.
    let closed_by = answered + 3_000_000_000;
    assert_eq!(open_at(&c, closed_by), 0, "NVML still open 3 s after the request was answered: {c:?}");
    assert!(
        c.iter().all(|(t, _)| *t <= closed_by || *t > before_stop),
        "NVML was called while the server idled after the request: {:?}",
        c.iter().filter(|(t, _)| *t > closed_by).collect::<Vec<_>>()
    );
    assert_eq!(open_at(&c, u64::MAX), 0, "a handle was left open");
    // The device's state came from sysfs, asleep at arrival; NVML named it once opened.
    let r = common::read_report(&out);
    assert_eq!(r["system"]["gpu"]["devices"][0]["name"], "Stand-in GPU", "{}", r["system"]["gpu"]);
    let q = r["requests"].as_array().unwrap().iter().find(|q| q["path"] == "/completion").expect("the request");
    let ev = q["verdict"]["evidence"].as_array().unwrap();
    assert!(ev.iter().any(|e| e.as_str().unwrap().contains("GPU 0000:01:00.0 in D3cold at arrival")), "{ev:?}");
}
