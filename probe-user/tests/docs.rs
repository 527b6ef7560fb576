//! docs/recording.md against the code: every kernel record kind with its number, name and size,
//! every userspace record type, every field of a stack sample. The page cannot drift from the
//! types without this test failing.
use probe_common::EventKind;
use probe_user::recording::{StackRecord, USER_RECORD_TYPES, VERSION};

fn page() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/recording.md")).unwrap()
}

#[test]
fn kernel_record_kinds_and_sizes() {
    let doc = page();
    assert!(doc.starts_with(&format!("# Recording format, version {VERSION}\n")), "the title names another version");
    assert!(doc.contains(&format!("version: u32 = {VERSION}")));
    for k in EventKind::ALL {
        let row = format!("| {} | {} | {} |", k as u32, k.name(), k.record_size());
        assert!(doc.contains(&row), "docs/recording.md has no row `{row}`");
    }
    let rows = doc.lines().filter(|l| l.starts_with("| ") && l.split('|').nth(1).is_some_and(|c| c.trim().parse::<u32>().is_ok())).count();
    assert_eq!(rows, EventKind::ALL.len(), "the kinds table lists kinds the code does not have");
}

#[test]
fn userspace_record_types() {
    let doc = page();
    let listed: Vec<String> =
        doc.lines().filter_map(|l| l.strip_prefix("- `")).filter_map(|l| l.split('`').next()).map(String::from).collect();
    assert_eq!(listed, USER_RECORD_TYPES, "the userspace record types in docs/recording.md differ from recording::USER_RECORD_TYPES");
}

#[test]
fn stack_sample_fields() {
    let doc = page();
    let s = StackRecord { wait: Some("[io wait]".into()), blocked_ns: Some(1), still_blocked: true, ..Default::default() };
    let v = serde_json::to_value(&s).unwrap();
    for key in v.as_object().unwrap().keys() {
        assert!(doc.contains(&format!("`{key}`")), "docs/recording.md does not describe the stack field `{key}`");
    }
}
