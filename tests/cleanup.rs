//! Nothing stays loaded: after `probe trace` ends (cleanly, or refused with an error) no BPF
//! program of probe's is left in the kernel. Its own test binary, so no other probe runs meanwhile.
use std::process::Command;

mod common;
use common::probe_bin;

fn ours() -> usize {
    common::bpf::probe_programs()
}

#[test]
fn no_program_outlives_probe() {
    let t = std::time::Instant::now();
    while ours() != 0 && t.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(ours(), 0, "probe programs loaded before the test");
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let out = std::env::temp_dir().join(format!("probe-cleanup-{}", std::process::id()));
    let mut p = Command::new(probe_bin())
        .args(["trace", "--pid", &sleeper.id().to_string(), "--duration", "3s", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(ours(), 4, "while tracing, the programs are loaded (and this check can see them)");
    assert!(p.wait().unwrap().success());
    // probe exits at once; the child it handed its programs to lets them go right after.
    let t = std::time::Instant::now();
    while ours() != 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(ours(), 0, "programs left loaded 10 s after a clean stop");
    // Ctrl-C: probe is back within a second with its report written (the programs' detach,
    // about 2 s of RCU grace periods on these machines, happens after it exited).
    let out2 = std::env::temp_dir().join(format!("probe-cleanup-int-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out2);
    let mut p = Command::new(probe_bin())
        .args(["trace", "--pid", &sleeper.id().to_string(), "--out"])
        .arg(&out2)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2000));
    assert!(out2.join("events.bin").exists(), "probe did not start recording within 2 s");
    let t = std::time::Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(p.id() as i32, libc::SIGINT) };
    assert!(p.wait().unwrap().success());
    let secs = t.elapsed().as_secs_f64();
    assert!(secs < 1.0 && out2.join("report.json").is_file(), "exit {secs:.2} s after SIGINT");
    let t = std::time::Instant::now();
    while ours() != 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(ours(), 0, "programs left loaded 10 s after Ctrl-C");
    let _ = std::fs::remove_dir_all(&out2);
    // A refused start (a probe that is not known) loads nothing either.
    let st = Command::new(probe_bin()).args(["trace", "--pid", &sleeper.id().to_string(), "--probes", "nosuch"]).output().unwrap();
    assert_eq!(st.status.code(), Some(2));
    assert_eq!(ours(), 0);
    // Not root: one clear line, exit 2, nothing loaded.
    let st = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(probe_bin())
        .args(["trace", "--pid", &sleeper.id().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&st.stderr);
    assert_eq!(st.status.code(), Some(2), "{err}");
    assert!(err.contains("needs root"), "{err}");
    assert_eq!(ours(), 0);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let _ = std::fs::remove_dir_all(out);
}
