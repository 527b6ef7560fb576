//! `probe bundle DIR`: the tarball to attach to an issue.
use std::path::PathBuf;

use anyhow::Context as _;

use crate::{
    analysis::{Analysis, Needs},
    exit,
    render::bundle,
};

#[derive(clap::Args)]
pub struct Args {
    /// The recording directory (what `probe trace --out` wrote).
    pub dir: PathBuf,
    /// Output file (default DIR.tar.gz beside the recording). Created new, mode 0600.
    #[arg(short, long = "out", visible_alias = "output")]
    pub output: Option<PathBuf>,
    /// Replace the output file if it exists (never through a symbolic link).
    #[arg(long)]
    pub force: bool,
    /// Hide directory names in paths and IP addresses.
    #[arg(long)]
    pub mask: bool,
}

/// `probe bundle DIR`: the tarball to attach to an issue.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let Args { dir, output, mask, force } = args;
    let a = Analysis::of_dir(&dir, Needs::ALL).with_context(|| super::cannot_read(&dir))?;
    let name =
        dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_else(|| "probe".into());
    let out = output.unwrap_or_else(|| dir.with_file_name(format!("{name}.tar.gz")));
    let files = bundle::write(&a, &out, mask, force)?;
    println!("{} ({})", out.display(), files.join(", "));
    Ok(exit::OK)
}
