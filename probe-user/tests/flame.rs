//! Golden tests for folding and rendering: stack records (tests/data/flame/stacks.json) →
//! folded text and SVG beside them. Modules point at files that do not exist, so names are the
//! deterministic `file+offset` fallback and no kernel symbols are involved.
//! `UPDATE_GOLDEN=1` rewrites the expected files.
use std::path::PathBuf;

use probe_user::{
    flame::{self, Kind, Window},
    recording::Recording,
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
    let late = flame::folded(&rec, &syms, Kind::Cpu, Window { from_ns: Some(4000), to_ns: None });
    assert_eq!(late.values().sum::<u64>(), 1);
}

#[test]
fn svg_is_deterministic() {
    let rec = recording();
    let syms = flame::Symbols::resolve(&rec);
    let cpu = flame::folded(&rec, &syms, Kind::Cpu, Window::default());
    let a = flame::svg(&cpu, Kind::Cpu, "golden").unwrap();
    let b = flame::svg(&cpu, Kind::Cpu, "golden").unwrap();
    assert_eq!(a, b);
    golden("cpu.svg", &a);
}

#[test]
fn wait_classes_come_from_the_kernel_stack() {
    let k = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        probe_user::ksyms::wait_class(&k(&["__schedule", "io_schedule", "folio_wait_bit_common", "filemap_fault", "handle_mm_fault"])),
        "[page-fault wait]"
    );
    assert_eq!(probe_user::ksyms::wait_class(&k(&["__schedule", "io_schedule_timeout", "__iomap_dio_rw"])), "[io wait]");
    assert_eq!(probe_user::ksyms::wait_class(&k(&["__schedule", "futex_wait"])), "[lock wait]");
    assert_eq!(probe_user::ksyms::wait_class(&k(&["__schedule", "do_nanosleep", "hrtimer_nanosleep"])), "[sleep]");
    assert_eq!(probe_user::ksyms::wait_class(&k(&["__schedule", "ep_poll"])), "[poll wait]");
}
