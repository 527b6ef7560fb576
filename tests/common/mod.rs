//! Helpers shared by the test binaries: where `probe` is, and starting a trace that is armed.
#![allow(dead_code)]
use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// The `probe` binary: $PROBE_BIN (set by `cargo xtask test`) or target/release/probe.
pub fn probe_bin() -> PathBuf {
    let p = std::env::var_os("PROBE_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/probe"));
    assert!(p.exists(), "{} not found: run `cargo xtask test` (builds it) or set PROBE_BIN", p.display());
    p
}

/// A running `probe trace`, started with `args` and returned once it printed "armed in":
/// the child, its later stderr lines, and the armed line (which lists the live probes).
pub fn start_trace(args: &[&str]) -> (Child, mpsc::Receiver<String>, String) {
    let mut child = Command::new(probe_bin()).arg("trace").args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn probe");
    let err = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    loop {
        let l = rx.recv_timeout(Duration::from_secs(30)).expect("probe did not arm within 30 s");
        assert!(!l.contains("error"), "probe failed to start: {l}");
        if l.contains("armed in") {
            return (child, rx, l);
        }
    }
}
