//! `probe timeline DIR`: timeline.json for the Perfetto UI.
use std::path::PathBuf;

use anyhow::Context as _;

use crate::{
    analysis::{Analysis, Needs},
    exit,
    util::output,
};

#[derive(clap::Args)]
pub struct Args {
    /// The recording directory (what `probe trace --out` wrote).
    pub dir: PathBuf,
    /// Output file (default DIR/timeline.json).
    #[arg(short, long = "out", visible_alias = "output")]
    pub output: Option<PathBuf>,
    /// Replace --out if it exists (never through a symbolic link).
    #[arg(long)]
    pub force: bool,
}

/// `probe timeline DIR`: timeline.json for the Perfetto UI.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let Args { dir, output, force } = args;
    let a = Analysis::of_dir(&dir, Needs { recording: true, ..Needs::REPORT }).with_context(|| super::cannot_read(&dir))?;
    let trace = crate::render::perfetto::of(&a);
    let bytes = serde_json::to_vec(&trace)?;
    let out = match output {
        Some(out) => {
            output::write_file(&out, &bytes, force)?;
            out
        }
        None => output::OutDir::open(&dir)?.write("timeline.json", &bytes)?,
    };
    println!("{} ({} events; open it in the Perfetto UI)", out.display(), trace.events.len());
    Ok(exit::OK)
}
