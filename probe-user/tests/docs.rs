//! docs/recording.md against the code: every kernel record kind with its number, name and size,
//! every userspace record type, every field of a stack sample. The page cannot drift from the
//! types without this test failing.
use probe_common::EventKind;
use probe_user::record::{StackRecord, USER_RECORD_TYPES, VERSION};

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
    assert_eq!(listed, USER_RECORD_TYPES, "the userspace record types in docs/recording.md differ from record::USER_RECORD_TYPES");
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

#[test]
fn userspace_record_fields() {
    use probe_user::record::records::*;
    let doc = page();
    let keys = |v: serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    let all = [
        ("meta", keys(serde_json::to_value(Meta::default()).unwrap())),
        ("maps", keys(serde_json::to_value(Maps::default()).unwrap())),
        ("files", keys(serde_json::to_value(Files::default()).unwrap())),
        ("module", keys(serde_json::to_value(Module::default()).unwrap())),
        ("ksyms", keys(serde_json::to_value(Ksyms::default()).unwrap())),
        ("threads", keys(serde_json::to_value(Threads::default()).unwrap())),
        ("stats", keys(serde_json::to_value(Stats::default()).unwrap())),
        ("stats.unwind", keys(serde_json::to_value(UnwindCounters::default()).unwrap())),
        ("end", keys(serde_json::to_value(End::default()).unwrap())),
    ];
    for (ty, fields) in all {
        let section = ty.split('.').next().unwrap();
        let at = doc.find(&format!("- `{section}`")).unwrap_or_else(|| panic!("no `{section}` bullet"));
        let bullet = &doc[at..doc[at + 3..].find("\n- `").map_or(doc.len(), |e| at + 3 + e)];
        for f in fields {
            assert!(bullet.contains(&format!("`{f}`")), "docs/recording.md's `{section}` does not describe the field `{f}`");
        }
    }
}
