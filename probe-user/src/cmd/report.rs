//! `probe report DIR`: a recording's summary again, its JSON, its HTML page or its sizes.
use std::path::PathBuf;

use anyhow::Context as _;

use crate::{analysis::Analysis, exit, record, util::text::terminal};

#[derive(clap::Args)]
pub struct Args {
    /// The recording directory (what `probe trace --out` wrote).
    pub dir: PathBuf,
    /// Print report.json to stdout instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// Write DIR/report.html (self-contained: verdicts, timeline, flamegraphs) and print its path.
    #[arg(long)]
    pub html: bool,
    /// Print what the recording spends its space on (records and bytes per kind) instead.
    #[arg(long)]
    pub sizes: bool,
}

/// `probe report DIR [--json|--html]`.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let Args { dir, json, html, sizes } = args;
    if sizes {
        let s = record::sizes(&dir).with_context(|| super::cannot_read(&dir))?;
        println!("{:<16} {:>12} {:>14} {:>10}", "kind", "records", "bytes", "per record");
        for (k, (n, b)) in &s {
            println!("{k:<16} {n:>12} {b:>14} {:>10.1}", *b as f64 / (*n).max(1) as f64);
        }
        return Ok(exit::OK);
    }
    use crate::watch::fleet;
    // Incidents pulled from several nodes (a folder per node): listed, each with where.
    if !html && fleet::is_tree(&dir) {
        let all = fleet::list(&dir);
        if json {
            println!("{}", serde_json::to_string_pretty(&all)?);
        } else {
            print!("{}", terminal(&fleet::render(&dir, &all)));
        }
        return Ok(exit::OK);
    }
    let r = if html {
        let (page, r) = crate::render::html::write(&dir)?;
        println!("{}", page.display());
        r
    } else {
        // Streamed: memory does not grow with the recording.
        Analysis::report_dir(&dir).with_context(|| super::cannot_read(&dir))?
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else if !html {
        print!("{}", terminal(&crate::render::text::render(&r)));
        if let Some(l) = fleet::labels_of(&dir) {
            println!("\nWhere: {}", terminal(&fleet::place_words(&l)));
        }
    }
    // A torn or corrupt recording is reported from what was whole, and says so (exit 1).
    Ok(if r.lost_events.values().any(|&n| n > 0) || !r.problems.is_empty() { exit::PARTIAL } else { exit::OK })
}
