//! `probe bundle`: one .tar.gz to attach to an issue on the server's tracker: a GitHub-ready
//! report.md (verdicts first), report.json, report.html (self-contained), the flamegraphs, the
//! Perfetto timeline and the environment. Never the raw event log (it may hold payload with --capture-text), so no prompt
//! or response text. Every file is scrubbed of secrets and raw kernel addresses (`redact`);
//! `--mask` also hides directories, hosts, IP addresses, query strings and GPU UUIDs.
use std::{fmt::Write as _, path::Path};

use anyhow::Context as _;

/// A value as JSON text: absent values read `null`, strings quoted, as in the recording.
fn js<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

use crate::{
    analysis::Analysis,
    analysis::flame,
    analysis::report::Report,
    record::{Recording, samples::Sample},
    render::html,
    util::redact::{self, Masker},
    util::text::{md_block, md_code, md_text},
};

/// The markdown report: verdicts, requests, files, block IO, losses.
pub fn markdown(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## probe report: {} (pid {})\n", md_code(&r.target.comm), r.target.pid);
    let _ = writeln!(
        o,
        "Traced {:.1} s, {}{}.\n",
        r.duration_s,
        r.events_phrase(),
        r.target.end_reason.as_ref().map(|e| format!(", stopped: {}", md_text(e))).unwrap_or_default()
    );
    if !r.requests.is_empty() {
        let _ =
            writeln!(o, "### Verdicts\n\n| # | request | status | TTFT ms | slow | stopped | evidence |\n|---|---|---|---|---|---|---|");
        for q in &r.requests {
            let v = q.verdict.as_ref();
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} |",
                q.id,
                md_code(&format!("{} {}", q.method.as_deref().unwrap_or("?"), q.path.as_deref().unwrap_or("?"))),
                q.status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                q.ttft_ms.map(|t| format!("{t:.0}")).unwrap_or_else(|| "-".into()),
                v.map(|v| v.slow_cause.name()).unwrap_or("-"),
                v.map(|v| v.stop_cause.words()).unwrap_or_else(|| "-".into()),
                v.map(|v| md_text(&v.evidence.join("; "))).unwrap_or_default()
            );
        }
        let _ = writeln!(o);
    }
    let system = crate::render::system::render(&r.system);
    let _ = writeln!(o, "### System\n\n{}\n", md_block(system.trim_start_matches("\nSystem:\n")));
    if r.files.is_empty() {
        let _ = writeln!(o, "### Files read\n\nNone: nothing was read from storage through the page cache.");
    } else {
        let _ = writeln!(o, "### Files read\n\n| path | major faults | read | io time ms |\n|---|---|---|---|");
    }
    for f in r.files.iter().take(20) {
        let _ = writeln!(
            o,
            "| {} | {} | {:.1} MiB | {:.1} |",
            md_code(&f.path),
            f.major_faults,
            f.read_bytes as f64 / (1 << 20) as f64,
            f.io_time_ms
        );
    }
    let _ = writeln!(
        o,
        "\nBlock IO: {}, {:.1} MiB read. Major faults: {}. Lost events: {}.",
        crate::util::text::count(r.blockio.requests, "request"),
        r.blockio.read_bytes as f64 / (1 << 20) as f64,
        r.faults.major,
        r.lost_events.values().sum::<u64>()
    );
    if !r.stacks.is_empty() {
        let _ = writeln!(o, "Stacks unwound to the end: {}.", crate::render::unwound_share(&r.unwind));
    }
    for p in &r.problems {
        let _ = writeln!(o, "\n> note: {}", md_text(&p.to_string()));
    }
    let _ = writeln!(
        o,
        "\nFlamegraphs (`flame-*.svg`), a timeline (`timeline.json`, open in ui.perfetto.dev) and `report.html` (all of it on one page, opens offline) are in this bundle."
    );
    o
}

/// Facts about the machine and the server, for the issue.
fn environment(rec: &Recording) -> String {
    let meta = rec.meta().cloned().unwrap_or_default();
    // The machine the recording was made on (its meta), not the one bundling it.
    let (cpu, mem) = match &meta.machine {
        Some(m) => (format!("cpu {} x {}", m.cpu_model, m.cpus), format!("MemTotal: {} kB", m.mem_total_kib)),
        None => ("cpu not recorded (a recording from an older probe)".to_string(), "memory not recorded".to_string()),
    };
    let sources = rec.samples().find_map(|v| if let Sample::Samplers(s) = v { Some(s) } else { None });
    let mut gpu: Vec<String> = sources
        .and_then(|s| s.gpus.as_ref())
        .into_iter()
        .flatten()
        .map(|g| {
            format!(
                "GPU {}: {} ({}), driver {}, max SM {} MHz, power limit {} W",
                g.index,
                g.name,
                g.uuid,
                g.driver,
                js(&g.max_sm_mhz),
                js(&g.power_limit_w)
            )
        })
        .collect();
    if gpu.is_empty() {
        gpu.push(sources.and_then(|s| s.gpu_absent.clone()).unwrap_or_else(|| {
            meta.machine.as_ref().and_then(|m| m.nvidia_driver.clone()).unwrap_or_else(|| "no NVIDIA GPU driver".into())
        }));
    }
    let gpu = gpu.join("\n    ");
    // The server's own account of itself (llama.cpp /props, first poll that answered).
    let server: Vec<String> = rec
        .samples()
        .filter_map(|v| if let Sample::Endpoint(e) = v { Some(e) } else { None })
        .filter(|e| e.answered())
        .take(1)
        .map(|v| {
            // What it says of itself; a server that says nothing is named by its kind alone.
            let p = v.props.clone().unwrap_or_default();
            let mut said = Vec::new();
            if let Some(b) = &p.build_info {
                said.push(format!("build {b}"));
            }
            if let Some(m) = &p.model_path {
                said.push(format!("model {m}"));
            }
            if let (Some(n), Some(c)) = (p.total_slots, p.n_ctx_slot) {
                said.push(format!("{n} slots x {c} tokens"));
            }
            let said = if said.is_empty() { String::new() } else { format!(" ({})", said.join(", ")) };
            format!("{} at {}{said}", v.kind.name(), v.addr)
        })
        .collect();
    format!(
        "probe {}\nkernel {}\n{cpu}\n{mem}\ngpu {}\ntarget {} (pid {}), binary {}\nserver: {}\ncommand line: {}\nprobes: {}\n",
        env!("CARGO_PKG_VERSION"),
        meta.kernel,
        gpu.trim(),
        meta.comm,
        meta.pid,
        meta.exe,
        if server.is_empty() { "its endpoints did not answer (or polling was off)".to_string() } else { server.join("; ") },
        meta.cmdline,
        serde_json::to_string(&meta.probes).unwrap_or_default()
    )
}

/// Write the bundle; returns the list of files in it.
pub fn write(a: &Analysis, out: &Path, masked: bool, force: bool) -> anyhow::Result<Vec<String>> {
    let (rec, report) = (&a.recording, &a.report);
    // Secrets are scrubbed (always) and paths and hosts masked with --mask: the report and the
    // timeline value by value (their JSON stays whole), the free texts as a whole. Flamegraphs
    // and the page are drawn from cleaned data: masking their markup would open `<dir>` tags
    // and cut into scripts and images.
    let masker = masked.then(|| Masker::new(report.requests.iter().filter_map(|q| q.path.as_deref())));
    let clean = |s: &str| match &masker {
        Some(m) => m.mask(s),
        None => redact::scrub(s),
    };
    let r: Report = redact::clean_values(report, &clean).context("cleaned report")?;
    let t = redact::clean_values(&crate::render::perfetto::of(a), &clean).context("cleaned timeline")?;
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("report.md".into(), clean(&markdown(&r)).into_bytes()),
        ("report.json".into(), serde_json::to_vec_pretty(&r)?),
        ("environment.txt".into(), clean(&environment(rec)).into_bytes()),
        ("timeline.json".into(), serde_json::to_vec(&t)?),
    ];
    let mut flames = Vec::new();
    let mut drawn: Vec<(String, Vec<u8>)> = Vec::new();
    let mut drawn_svgs: Vec<(String, Vec<u8>)> = Vec::new();
    for kind in flame::Kind::ALL {
        let f = a.folded(kind).into_iter().fold(std::collections::BTreeMap::new(), |mut m, (k, w)| {
            *m.entry(clean(&k)).or_default() += w;
            m
        });
        if !f.is_empty() {
            let svg = crate::render::flame::svg(&f, kind, &format!("probe: {} stacks", kind.name()))?;
            flames.push((kind.name().to_string(), String::from_utf8_lossy(&svg).into_owned()));
            drawn.push((format!("flame-{}.svg", kind.name()), svg));
            files.push((format!("flame-{}.folded", kind.name()), flame::folded_text(&f).into_bytes()));
        }
    }
    // The slowest request against its warm baseline, when the recording has both.
    let mut section = None;
    if let Some((d, drawn)) = html::diff_of(a, &clean) {
        let d: crate::analysis::diff::Diff = redact::clean_values(&d, &clean).context("cleaned diff")?;
        files.push(("diff.md".into(), crate::render::diff::markdown(&d).into_bytes()));
        files.push(("diff.json".into(), serde_json::to_vec_pretty(&d)?));
        let mut svgs = vec![];
        for (name, bytes) in drawn {
            if name.ends_with(".svg") {
                svgs.push((name.clone(), String::from_utf8_lossy(&bytes).into_owned()));
                drawn_svgs.push((name, bytes));
            } else {
                files.push((name, bytes));
            }
        }
        section = Some((d, svgs));
    }
    let section = section.as_ref().map(|(d, svgs)| html::DiffSection { diff: d, svgs: svgs.clone() });
    let page = html::render(&r, &t, &flames, section.as_ref());
    drawn.push((html::FILE_NAME.into(), page.into_bytes()));
    let file = crate::util::output::create_file(out, force)?;
    let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(file, flate2::Compression::default()));
    let stem = out.file_name().and_then(|n| n.to_str()).unwrap_or("probe-bundle").trim_end_matches(".tar.gz").to_string();
    let mut names = Vec::new();
    for (name, data) in files.into_iter().chain(drawn).chain(drawn_svgs) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_mtime(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0));
        h.set_cksum();
        tar.append_data(&mut h, format!("{stem}/{name}"), data.as_slice())?;
        names.push(name);
    }
    tar.into_inner()?.finish()?;
    Ok(names)
}
