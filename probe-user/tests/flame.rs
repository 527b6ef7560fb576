//! Golden tests for folding and rendering: stack records (tests/data/flame/stacks.json) →
//! folded text and SVG beside them. Modules point at files that do not exist, so names are the
//! deterministic `file+offset` fallback and no kernel symbols are involved.
//! `UPDATE_GOLDEN=1` rewrites the expected files.
use std::path::PathBuf;

use probe_user::{
    analysis::flame::{self, Kind, Window},
    record::Recording,
};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/flame")
}

fn recording() -> Recording {
    let json: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(data().join("stacks.json")).unwrap()).unwrap();
    Recording::from_json(json)
}

fn golden(name: &str, got: &[u8]) {
    let path = data().join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
    }
    assert!(std::fs::read(&path).unwrap() == got, "{name} differs (UPDATE_GOLDEN=1 to accept)");
}

#[test]
fn folds_root_first_with_weights() {
    let rec = recording();
    let syms = flame::Symbols::resolve(&rec);
    let cpu = flame::folded(&rec, &syms, Kind::Cpu, Window::default());
    assert_eq!(cpu.get("server;libc.so.6+0x5;llama-server+0x10;llama-server+0x20;llama-server+0x30"), Some(&3));
    assert_eq!(cpu.values().sum::<u64>(), 5);
    golden("cpu.folded", flame::folded_text(&cpu).as_bytes());
    // Off-CPU weights are microseconds, under the wait class.
    let off = flame::folded(&rec, &syms, Kind::Offcpu, Window::default());
    assert_eq!(off.get("server;[other wait];libc.so.6+0x5;llama-server+0x50"), Some(&2500));
    // A window keeps only the stacks inside it.
    let late = flame::folded(&rec, &syms, Kind::Cpu, Window { from_ns: Some(4000), to_ns: None, request: false });
    assert_eq!(late.values().sum::<u64>(), 1);
}

/// A request's off-CPU flamegraph keeps the waits that ended inside it, for their part inside
/// it: a thread still waiting when the request ended (an idle worker) is not on its path.
#[test]
fn a_request_keeps_the_waits_on_its_path() {
    let rec = Recording::from_json(
        [
            // Ends inside [10 ms, 20 ms], began before it: 4 ms of it count.
            (6_000_000u64, 8_000_000u64, 0x50u64),
            // Inside, whole: 2 ms.
            (12_000_000, 2_000_000, 0x60),
            // Began inside, still waiting when the request ended: an idle worker.
            (15_000_000, 30_000_000, 0x70),
        ]
        .iter()
        .map(|&(ts, blocked, ip)| {
            serde_json::json!({"type": "stack", "what": "offcpu", "pid": 1, "tid": 1, "ts_ns": ts, "blocked_ns": blocked, "user": [[0, ip]], "kernel": []})
        })
        .collect(),
    );
    let syms = flame::Symbols::resolve(&rec);
    let w = Window { from_ns: Some(10_000_000), to_ns: Some(20_000_000), request: true };
    let off = flame::folded(&rec, &syms, Kind::Offcpu, w);
    let mut weights: Vec<u64> = off.values().copied().collect();
    weights.sort_unstable();
    assert_eq!(weights, [2000, 4000], "{off:?}");
    // The same span as a plain window: the stacks taken in it, whole.
    let plain = flame::folded(&rec, &syms, Kind::Offcpu, Window { request: false, ..w });
    assert_eq!(plain.values().sum::<u64>(), 32_000, "{plain:?}");
}

#[test]
fn svg_is_deterministic() {
    let rec = recording();
    let syms = flame::Symbols::resolve(&rec);
    let cpu = flame::folded(&rec, &syms, Kind::Cpu, Window::default());
    let a = probe_user::render::flame::svg(&cpu, Kind::Cpu, "golden").unwrap();
    let b = probe_user::render::flame::svg(&cpu, Kind::Cpu, "golden").unwrap();
    assert_eq!(a, b);
    golden("cpu.svg", &a);
}

#[test]
fn wait_classes_come_from_the_kernel_stack() {
    let k = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        probe_user::analysis::ksyms::wait_class(&k(&[
            "__schedule",
            "io_schedule",
            "folio_wait_bit_common",
            "filemap_fault",
            "handle_mm_fault"
        ])),
        "[page-fault wait]"
    );
    assert_eq!(probe_user::analysis::ksyms::wait_class(&k(&["__schedule", "io_schedule_timeout", "__iomap_dio_rw"])), "[io wait]");
    assert_eq!(probe_user::analysis::ksyms::wait_class(&k(&["__schedule", "futex_wait"])), "[lock wait]");
    assert_eq!(probe_user::analysis::ksyms::wait_class(&k(&["__schedule", "do_nanosleep", "hrtimer_nanosleep"])), "[sleep]");
    assert_eq!(probe_user::analysis::ksyms::wait_class(&k(&["__schedule", "ep_poll"])), "[poll wait]");
}
