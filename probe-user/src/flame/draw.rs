//! Folded stacks → text and an interactive SVG (inferno).
use std::collections::BTreeMap;

use super::Kind;

pub fn folded_text(f: &BTreeMap<String, u64>) -> String {
    f.iter().map(|(k, v)| format!("{k} {v}\n")).collect()
}

/// An interactive SVG (inferno), deterministic for the same input.
pub fn svg(f: &BTreeMap<String, u64>, kind: Kind, title: &str) -> std::io::Result<Vec<u8>> {
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = title.to_string();
    opts.count_name = kind.unit().to_string();
    opts.deterministic = true;
    opts.hash = true;
    if kind == Kind::Offcpu {
        opts.colors = inferno::flamegraph::color::Palette::Basic(inferno::flamegraph::color::BasicPalette::Blue);
    }
    let text = folded_text(f);
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut opts, text.lines(), &mut out)?;
    Ok(out)
}
