//! `probe flamegraph DIR`: one kind's stacks as SVG and folded text.
use std::path::PathBuf;

use anyhow::Context as _;

use crate::{
    analysis::{Analysis, Needs, Scope, flame},
    exit, record,
    util::output,
};

#[derive(clap::Args)]
pub struct Args {
    /// The recording directory (what `probe trace --out` wrote).
    pub dir: PathBuf,
    /// cpu (on-CPU samples), offcpu (blocked time, µs), faults (major faults), io (block requests).
    #[arg(long, default_value = "cpu")]
    pub kind: String,
    /// Only the stacks inside this request's time window (an id from the report).
    #[arg(long)]
    pub request: Option<u64>,
    /// Only stacks from this many seconds after the trace started.
    #[arg(long)]
    pub from: Option<f64>,
    /// Only stacks until this many seconds after the trace started.
    #[arg(long)]
    pub to: Option<f64>,
    /// Output SVG (default DIR/flame-KIND.svg); the folded text goes beside it (.folded).
    #[arg(short, long = "out", visible_alias = "output")]
    pub output: Option<PathBuf>,
    /// Replace --out if it exists (never through a symbolic link).
    #[arg(long)]
    pub force: bool,
}

/// `probe flamegraph DIR`: one kind's stacks, of the whole recording, a time window or a request.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let Args { dir, kind, request, from, to, output, force } = args;
    let kind = flame::Kind::parse(&kind).with_context(|| format!("unknown kind `{kind}`: choose cpu, offcpu, faults or io"))?;
    let meta = record::read_meta(&dir).with_context(|| super::cannot_read(&dir))?;
    let start = meta.map_or(0, |m| m.start_ns);
    let secs = |s: f64| start + (s * 1e9) as u64;
    let scope = match request {
        Some(id) => Scope::Request(id),
        None => Scope::Window(flame::Window { from_ns: from.map(secs), to_ns: to.map(secs), request: false }),
    };
    // Streamed: every stack of the recording, however long (two passes: the request's
    // window is known only once its record was read).
    let a = Analysis::of_dir(&dir, Needs { flames: true, scope, ..Needs::REPORT }).with_context(|| super::cannot_read(&dir))?;
    if let Some(e) = &a.scope_error {
        anyhow::bail!("{e} (see `probe report {}`)", dir.display());
    }
    let folded = a.folded(kind);
    if folded.is_empty() {
        anyhow::bail!("no {} stacks in {} for this window", kind.name(), dir.display());
    }
    let title = match request {
        Some(id) => format!("probe: {} stacks of request {id}", kind.name()),
        None => format!("probe: {} stacks", kind.name()),
    };
    let (svg, text) = (crate::render::flame::svg(&folded, kind, &title)?, flame::folded_text(&folded));
    let out = match output {
        Some(out) => {
            output::write_file(&out, &svg, force)?;
            output::write_file(&out.with_extension("folded"), text.as_bytes(), force)?;
            out
        }
        None => {
            // A request's or a window's graph gets a name of its own: the trace's whole-recording
            // flame-<kind>.svg stays as it was written.
            let name = match (request, from, to) {
                (Some(id), ..) => format!("flame-{}-req{id}", kind.name()),
                (None, None, None) => format!("flame-{}", kind.name()),
                (None, f, t) => format!("flame-{}-{}s-{}s", kind.name(), f.unwrap_or(0.0), t.map_or("end".into(), |t| t.to_string())),
            };
            let d = output::OutDir::open(&dir)?;
            d.write(&format!("{name}.folded"), text.as_bytes())?;
            d.write(&format!("{name}.svg"), &svg)?
        }
    };
    println!("{} ({} stacks, weight {})", out.display(), folded.len(), folded.values().sum::<u64>());
    Ok(exit::OK)
}
