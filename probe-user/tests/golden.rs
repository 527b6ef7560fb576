//! Golden tests: recordings in tests/data/report/<name>/events.bin → report.json and summary.txt
//! beside them. `UPDATE_GOLDEN=1 cargo test -p probe-user --test golden` rewrites the expected files.
use std::path::PathBuf;

use probe_user::{recording, report};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/report")
}

fn check(name: &str) {
    let dir = data().join(name);
    let rec = recording::read_dir(&dir).unwrap();
    let r = report::build(&rec);
    let json = serde_json::to_string_pretty(&r).unwrap() + "\n";
    let text = report::render(&r);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(dir.join("report.json"), &json).unwrap();
        std::fs::write(dir.join("summary.txt"), &text).unwrap();
    }
    let want_json = std::fs::read_to_string(dir.join("report.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&want_json).unwrap();
    let got: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(got, want, "{name}: report.json differs (UPDATE_GOLDEN=1 to accept)");
    assert_eq!(text, std::fs::read_to_string(dir.join("summary.txt")).unwrap(), "{name}: summary differs");
}

/// A real recording of `cargo xtask demo`: 256 major faults on a cold file, two TCP connections
/// (one closed by the peer, one by the workload).
#[test]
fn demo_recording() {
    check("demo");
    let r = report::build(&recording::read_dir(&data().join("demo")).unwrap());
    assert_eq!(r.faults.major, 256);
    assert_eq!(r.files[0].major_faults, 256);
    let closers: Vec<&str> = r.connections.iter().map(|c| c.closed_by.as_str()).collect();
    assert_eq!(closers, ["peer", "local"]);
}

/// The same recording cut mid-frame (as after SIGKILL): every whole record is kept and the
/// torn tail is reported.
#[test]
fn truncated_recording() {
    let bytes = std::fs::read(data().join("demo/events.bin")).unwrap();
    let full = recording::parse(&bytes, "demo").unwrap();
    let cut = recording::parse(&bytes[..bytes.len() * 2 / 3 + 3], "demo").unwrap();
    assert!(cut.events.len() > full.events.len() / 2 && cut.events.len() < full.events.len());
    let r = report::build(&cut);
    assert!(r.problems.iter().any(|p| p.contains("ends mid-record")), "{:?}", r.problems);
    assert!(r.problems.iter().any(|p| p.contains("no end record")), "{:?}", r.problems);
}
