//! `probe diff A [B]`: what changed between requests or recordings.
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::{
    analysis::{Analysis, Needs, diff},
    exit,
    util::{output, text::terminal},
};

#[derive(clap::Args)]
pub struct Args {
    /// The baseline recording (A); alone, the recording whose requests are compared.
    pub a: PathBuf,
    /// The recording compared against A (B). Without it, requests of A are compared.
    pub b: Option<PathBuf>,
    /// The request to explain (B's, else A's; default: the slowest first token).
    #[arg(long)]
    pub request: Option<u64>,
    /// The request(s) to compare it with, comma-separated (A's; default: the warm baseline,
    /// the requests of a similar prompt size served without a slow cause).
    #[arg(long, value_delimiter = ',')]
    pub against: Vec<u64>,
    /// Where to write (default: B's recording, else A's). Files there are replaced.
    #[arg(short, long = "out", visible_alias = "output")]
    pub output: Option<PathBuf>,
    /// Compare recordings of different server builds or model files anyway.
    #[arg(long)]
    pub force: bool,
    /// Print diff.json to stdout instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// What `probe diff` computed, where it goes, and its drawn flamegraphs.
type Compared = (diff::Diff, output::OutDir, crate::render::diff::Drawn);

/// `probe diff A [B]`.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let (d, out_dir, drawn) = match &args.b {
        None => within(&args)?,
        Some(bdir) => between(&args, bdir)?,
    };
    let json = args.json;
    for (name, bytes) in &drawn {
        out_dir.write(name, bytes)?;
    }
    let md = out_dir.write("diff.md", crate::render::diff::markdown(&d).as_bytes())?;
    let js = out_dir.write("diff.json", &serde_json::to_vec_pretty(&d)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", terminal(&crate::render::diff::text(&d)));
        println!("\n{}\n{}", md.display(), js.display());
        for f in &d.flames {
            println!("{}", out_dir.path().join(&f.svg).display());
        }
    }
    Ok(exit::OK)
}

/// A recording read once: the report, and the stacks folded per request (and for the whole
/// recording when two recordings are compared).
fn read(dir: &Path, whole: bool) -> anyhow::Result<Analysis> {
    Analysis::of_dir(dir, Needs { flames: whole, per_request: true, ..Needs::REPORT }).with_context(|| super::cannot_read(dir))
}

/// A recording's name in the diff: a recording with labels (an incident of `watch --all`,
/// pulled from a node) says where.
fn name(d: &Path) -> String {
    match crate::watch::fleet::labels_of(d) {
        Some(l) => format!("{} ({})", d.display(), crate::watch::fleet::place_words(&l)),
        None => d.display().to_string(),
    }
}

/// Request `id` of `dir` can be compared: it is there, and has a first token.
fn one(r: &crate::analysis::report::Report, id: u64, dir: &Path) -> anyhow::Result<()> {
    match r.requests.iter().find(|q| q.id == id && !q.probe_poll) {
        None => anyhow::bail!("no request {id} in {} (see `probe report {}`)", dir.display(), dir.display()),
        Some(q) if q.ttft_ms.is_none() => anyhow::bail!("request {id} in {} has no first token to compare", dir.display()),
        Some(_) => Ok(()),
    }
}

fn ids(v: &[u64]) -> String {
    v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

/// `probe diff A`: requests of one recording, a slow one against others (named, or its warm
/// baseline).
fn within(args: &Args) -> anyhow::Result<Compared> {
    let Args { a, request, against, output, force, .. } = args;
    let (request, force) = (*request, *force);
    let x = read(a, false)?;
    let r = &x.report;
    let (warm, slow) = match (request, against.is_empty()) {
        (Some(n), false) => (against.clone(), n),
        (None, true) => diff::default_pair(r).map_err(anyhow::Error::msg)?,
        (None, false) => (against.clone(), diff::slowest(r).map_err(anyhow::Error::msg)?),
        // A named request against its own warm baseline (its prompt size, not the slowest's).
        (Some(n), true) => {
            one(r, n, a)?;
            (diff::warm_baseline(r, n).map_err(anyhow::Error::msg)?, n)
        }
    };
    one(r, slow, a)?;
    for &w in &warm {
        one(r, w, a)?;
    }
    if warm.is_empty() || warm.contains(&slow) {
        anyhow::bail!("compare request {slow} with another request: --against M");
    }
    let label_b = if request.is_some() { format!("request {slow}") } else { format!("request {slow} (the slowest first token)") };
    let label_a =
        if against.is_empty() { format!("the warm baseline: request(s) {}", ids(&warm)) } else { format!("request(s) {}", ids(&warm)) };
    let out = match output {
        Some(o) => output::OutDir::create_or_open(o)?,
        None => output::OutDir::open(a)?,
    };
    let ia = diff::Input { analysis: &x, dir: name(a), label: label_a, ids: warm };
    let ib = diff::Input { analysis: &x, dir: name(a), label: label_b, ids: vec![slow] };
    let d = diff::compare(&ia, &ib, false, force)?;
    let drawn = crate::render::diff::draw(&d, &ia, &ib, &|s: &str| s.to_string())?;
    Ok((d, out, drawn))
}

/// `probe diff A B`: two recordings, every request of each (or the named ones).
fn between(args: &Args, bdir: &Path) -> anyhow::Result<Compared> {
    let Args { a, request, against, output, force, .. } = args;
    let (request, force) = (*request, *force);
    let by_request = request.is_some() || !against.is_empty();
    let (xa, xb) = (read(a, !by_request)?, read(bdir, !by_request)?);
    let all = |r: &crate::analysis::report::Report| {
        r.requests.iter().filter(|q| !q.probe_poll && q.ttft_ms.is_some()).map(|q| q.id).collect::<Vec<_>>()
    };
    let (ida, idb) = if by_request {
        let (Some(n), false) = (request, against.is_empty()) else {
            anyhow::bail!("with two recordings, give both --request N (of B) and --against M (of A), or neither")
        };
        one(&xb.report, n, bdir)?;
        for &m in against {
            one(&xa.report, m, a)?;
        }
        (against.clone(), vec![n])
    } else {
        (all(&xa.report), all(&xb.report))
    };
    for (ids, dir) in [(&ida, a.as_path()), (&idb, bdir)] {
        if ids.is_empty() {
            anyhow::bail!("{} has no request with a first token: nothing to compare (see `probe report {}`)", dir.display(), dir.display());
        }
    }
    let label = |v: &[u64]| if by_request { format!("request(s) {}", ids(v)) } else { format!("every request ({})", v.len()) };
    let out = match output {
        Some(o) => output::OutDir::create_or_open(o)?,
        None => output::OutDir::open(bdir)?,
    };
    let ia = diff::Input { analysis: &xa, dir: name(a), label: label(&ida), ids: ida.clone() };
    let ib = diff::Input { analysis: &xb, dir: name(bdir), label: label(&idb), ids: idb.clone() };
    let d = diff::compare(&ia, &ib, !by_request, force)?;
    let drawn = crate::render::diff::draw(&d, &ia, &ib, &|s: &str| s.to_string())?;
    Ok((d, out, drawn))
}
