//! Folded stacks → text and an interactive SVG (inferno): the last of the flamegraph's three
//! stages (`analysis::flame` names and folds).
use std::collections::BTreeMap;

use crate::analysis::flame::{Flames, Kind, folded_text};

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

/// Every kind's flamegraph that has stacks, drawn once: (kind, SVG) for the files and the page.
pub fn draw_all(flames: &Flames) -> Vec<(Kind, Vec<u8>)> {
    Kind::ALL
        .into_iter()
        .filter_map(|kind| {
            let f = flames.get(kind);
            (!f.is_empty()).then(|| svg(&f, kind, &format!("probe: {} stacks", kind.name())).ok().map(|s| (kind, s))).flatten()
        })
        .collect()
}

/// Write `<dir>/flame-<kind>.svg` (as `drawn`, from [`draw_all`]) and `.folded` for every kind
/// that has stacks; returns what was written (path, stacks weight).
pub fn write_defaults(
    flames: &Flames,
    drawn: &[(Kind, Vec<u8>)],
    dir: &crate::util::output::OutDir,
) -> anyhow::Result<Vec<(std::path::PathBuf, u64)>> {
    let mut written = Vec::new();
    for (kind, svg) in drawn {
        let f = flames.get(*kind);
        let path = dir.write(&format!("flame-{}.svg", kind.name()), svg)?;
        dir.write(&format!("flame-{}.folded", kind.name()), folded_text(&f).as_bytes())?;
        written.push((path, f.values().sum()));
    }
    Ok(written)
}
