//! `probe export DIR`: pprof profiles, OTLP/JSON, OTLP/HTTP.
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
    /// pprof: DIR/pprof-KIND.pb.gz per kind of stack (cpu, offcpu, faults, io);
    /// otlp-json: DIR/otlp.json (one OTLP ExportTraceServiceRequest). With --otlp alone, otlp-json.
    #[arg(long, value_enum, required_unless_present = "otlp")]
    pub format: Option<ExportFormat>,
    /// Where to write: a directory for pprof, a file for otlp-json (default: DIR).
    #[arg(short, long = "out", visible_alias = "output")]
    pub output: Option<PathBuf>,
    /// Replace the --out file of otlp-json if it exists (never through a symbolic link;
    /// files written into a recording or an --out directory are always replaced).
    #[arg(long)]
    pub force: bool,
    /// Also send the spans to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318).
    #[arg(long, value_parser = crate::render::export::otlp::Endpoint::parse)]
    pub otlp: Option<crate::render::export::otlp::Endpoint>,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ExportFormat {
    Pprof,
    OtlpJson,
}

/// `probe export DIR`: pprof profiles, OTLP/JSON, OTLP/HTTP.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let Args { dir, format, output, force, otlp } = args;
    // clap asks for --format unless --otlp is given: sending spans is exporting them as OTLP.
    let format = format.unwrap_or(ExportFormat::OtlpJson);
    let read = || super::cannot_read(&dir);
    let pprof = matches!(format, ExportFormat::Pprof);
    let a = Analysis::of_dir(&dir, Needs { flames: pprof, pprof, ..Needs::REPORT }).with_context(read)?;
    let (r, meta) = (&a.report, &a.meta);
    match format {
        ExportFormat::Pprof => {
            let profiles =
                a.samples.as_ref().map(|s| crate::render::export::pprof::profiles(s, &a.flames.symbols, meta)).unwrap_or_default();
            if profiles.is_empty() {
                anyhow::bail!("{} has no stacks to export (was it traced with --probes without cpu/offcpu?)", dir.display());
            }
            let out = match &output {
                Some(o) => output::OutDir::create_or_open(o)?,
                None => output::OutDir::open(&dir)?,
            };
            for (kind, bytes) in profiles {
                let p = out.write(&format!("pprof-{}.pb.gz", kind.name()), &bytes)?;
                println!("{}  (go tool pprof -http=: {})", p.display(), p.display());
            }
        }
        ExportFormat::OtlpJson => {
            let e = crate::render::export::otlp::from_report(r, meta, None);
            let bytes = e.to_json()?;
            let p = match output {
                Some(o) => {
                    output::write_file(&o, &bytes, force)?;
                    o
                }
                None => output::OutDir::open(&dir)?.write("otlp.json", &bytes)?,
            };
            println!("{} ({} spans)", p.display(), e.spans.len());
        }
    }
    if let Some(ep) = otlp {
        let e = crate::render::export::otlp::from_report(r, meta, None);
        let st = ep.send(&e).map_err(anyhow::Error::msg).context("cannot send the spans")?;
        println!("sent {} spans (collector answered {st})", e.spans.len());
    }
    Ok(exit::OK)
}
