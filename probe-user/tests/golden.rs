//! Golden tests: recordings in tests/data/report/<name>/events.bin → report.json and summary.txt
//! beside them. `UPDATE_GOLDEN=1 cargo test -p probe-user --test golden` rewrites the expected files.
use std::path::PathBuf;

use probe_user::{
    analysis::report,
    analysis::{Analysis, Needs},
    record,
};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/report")
}

fn check(name: &str) {
    let dir = data().join(name);
    let rec = record::read_dir(&dir).unwrap();
    let r = report::build(&rec);
    // The streamed analysis (two passes over the file) says exactly what the one in memory says,
    // and so does the recording rewritten in the compact format.
    assert_eq!(Analysis::report_dir(&dir).unwrap(), r, "{name}: streamed report differs");
    let v2 = std::env::temp_dir().join(format!("probe-golden-v2-{name}-{}", std::process::id()));
    assert!(record::rewrite(&dir, &v2).unwrap().is_empty());
    // Kernel records take at most 48 bytes each on average (v1: 56 to 160).
    let sizes = record::sizes(&v2).unwrap();
    let (n, bytes) = sizes.iter().filter(|(k, _)| !k.contains(':')).fold((0, 0), |a, (_, v)| (a.0 + v.0, a.1 + v.1));
    assert!(n > 0 && bytes <= 48 * n, "{name}: {n} kernel records take {bytes} bytes: {sizes:?}");
    eprintln!(
        "{name}: v1 {} bytes, v2 {} bytes; v2 by kind: {sizes:?}",
        std::fs::metadata(dir.join("events.bin")).unwrap().len(),
        std::fs::metadata(v2.join("events.bin")).unwrap().len()
    );
    assert_eq!(Analysis::report_dir(&v2).unwrap(), r, "{name}: the rewritten recording's report differs");
    std::fs::remove_dir_all(&v2).ok();
    let json = serde_json::to_string_pretty(&r).unwrap() + "\n";
    let text = probe_user::render::text::render(&r);
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
    let r = report::build(&record::read_dir(&data().join("demo")).unwrap());
    assert_eq!(r.faults.major, 256);
    assert_eq!(r.files[0].major_faults, 256);
    let closers: Vec<&str> = r.connections.iter().map(|c| c.closed_by.name()).collect();
    assert_eq!(closers, ["peer", "local"]);
}

/// The same recording cut mid-frame (as after SIGKILL): every whole record is kept and the
/// torn tail is reported.
#[test]
fn truncated_recording() {
    let bytes = std::fs::read(data().join("demo/events.bin")).unwrap();
    let full = record::parse(&bytes, "demo").unwrap();
    let cut = record::parse(&bytes[..bytes.len() * 2 / 3 + 3], "demo").unwrap();
    assert!(cut.events.len() > full.events.len() / 2 && cut.events.len() < full.events.len());
    let r = report::build(&cut);
    use probe_user::record::problem::Problem;
    assert!(r.problems.iter().any(|p| matches!(p, Problem::TornTail { .. })), "{:?}", r.problems);
    assert!(r.problems.contains(&Problem::NoEnd), "{:?}", r.problems);
}

/// The demo recording as a Perfetto timeline: every block request a slice with its latency,
/// every major fault an instant, the TCP state changes, all on named tracks.
#[test]
fn demo_timeline() {
    let rec = record::read_dir(&data().join("demo")).unwrap();
    let t =
        serde_json::to_value(probe_user::render::perfetto::build(&rec, &probe_user::analysis::report::build(&rec), &Default::default()))
            .unwrap();
    let ev = t["traceEvents"].as_array().unwrap();
    let count = |f: &dyn Fn(&serde_json::Value) -> bool| ev.iter().filter(|e| f(e)).count();
    assert_eq!(count(&|e| e["ph"] == "i" && e["name"] == "major fault"), 256);
    assert_eq!(count(&|e| e["ph"] == "X" && e["pid"] == 2 && e["dur"].as_f64().unwrap() > 0.0), 256);
    assert!(count(&|e| e["pid"] == 3 && e["name"].as_str().unwrap().contains("ESTABLISHED")) >= 2);
    assert!(ev.iter().any(|e| e["ph"] == "M" && e["args"]["name"].as_str().unwrap_or("").starts_with("probe-workload")));
    // Every event has the fields the trace-event format requires.
    for e in ev {
        assert!(e["ph"].is_string() && e["pid"].is_number() && e["tid"].is_number(), "{e}");
        assert!(e["ph"] == "M" || e["ts"].as_f64().unwrap() >= 0.0, "{e}");
    }
}

/// A bundle of the demo recording: the derived files, never the event log; masking hides paths.
#[test]
fn demo_bundle() {
    let dir = data().join("demo");
    let a = Analysis::of_recording(record::read_dir(&dir).unwrap());
    let r = &a.report;
    let out = std::env::temp_dir().join(format!("probe-bundle-{}.tar.gz", std::process::id()));
    let names = probe_user::render::bundle::write(&a, &out, false, true).unwrap();
    for want in ["report.md", "report.json", "report.html", "environment.txt", "timeline.json"] {
        assert!(names.iter().any(|n| n == want), "{names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("events")));
    let md = probe_user::render::bundle::markdown(r);
    assert!(md.contains("| `/work/main/target/demo/cold-weights.bin` | 256 | 1.0 MiB |"), "{md}");
    assert!(
        probe_user::util::redact::Masker::new(r.requests.iter().filter_map(|q| q.path.as_deref()))
            .mask(&md)
            .contains("| `<dir>/cold-weights.bin` | 256 |")
    );
    let _ = std::fs::remove_file(out);
}

/// A real llama-server recording (v1, with stack samples): the streamed flamegraphs fold the
/// same stacks as the ones in memory, and the file rewritten in v2 (binary stack samples) gives
/// the same report and flamegraphs.
#[test]
fn llama_recording_streams_and_rewrites_the_same() {
    let dir = data().join("../html/llama-demo");
    let rec = record::read_dir(&dir).unwrap();
    assert!(rec.stacks.len() > 100, "{} stacks", rec.stacks.len());
    let mem = probe_user::analysis::flame::Flames::of(&rec, Default::default());
    let streamed = Analysis::of_dir(&dir, Needs::ALL).unwrap();
    assert_eq!(mem.by_kind, streamed.flames.by_kind);
    assert_eq!(streamed.report, report::build(&rec), "one read gives the report the in-memory build gives");
    assert!(!mem.by_kind.is_empty());
    let v2 = std::env::temp_dir().join(format!("probe-golden-v2-llama-{}", std::process::id()));
    assert!(record::rewrite(&dir, &v2).unwrap().is_empty());
    assert_eq!(Analysis::report_dir(&v2).unwrap(), report::build(&rec));
    assert_eq!(Analysis::of_dir(&v2, Needs::ALL).unwrap().flames.by_kind, mem.by_kind);
    let (old, new) = (std::fs::metadata(dir.join("events.bin")).unwrap().len(), std::fs::metadata(v2.join("events.bin")).unwrap().len());
    assert!(new * 2 < old, "v2 {new} bytes, v1 {old}");
    eprintln!("llama-demo: v1 {old} bytes, v2 {new} bytes; v2 by kind: {:?}", record::sizes(&v2).unwrap());
    std::fs::remove_dir_all(&v2).ok();
}
