//! `probe diff` for people: the differential flamegraphs (inferno), diff.md and the terminal
//! text, all from the [`Diff`] that `analysis::diff` compared.
use crate::analysis::{
    diff::{Count, Delta, Diff, FRAME_SHARE, FlameDiff, FrameDelta, Input, gather, mib},
    flame::{self, Folded, Kind},
};

/// Files drawn for a diff: (name, bytes).
pub type Drawn = Vec<(String, Vec<u8>)>;

/// The differential flamegraphs of a diff [`compare`] made of the same sides: each kind's
/// folded text and SVG, under the names `diff.flames` gives them. `clean` renames frames (the
/// bundle's masking; identity otherwise).
pub fn draw(d: &Diff, a: &Input<'_>, b: &Input<'_>, clean: &dyn Fn(&str) -> String) -> std::io::Result<Drawn> {
    let recordings = d.mode == crate::analysis::diff::Mode::Recordings;
    let mut out = vec![];
    for f in &d.flames {
        let Some(kind) = Kind::parse(&f.kind) else { continue };
        let cleaned = |x: Folded| {
            x.into_iter().fold(Folded::new(), |mut m, (k, w)| {
                *m.entry(clean(&k)).or_default() += w;
                m
            })
        };
        let (fa, fb) = (cleaned(gather(a, kind, recordings)), cleaned(gather(b, kind, recordings)));
        let title = format!("probe diff: {} stacks, {} (red: more in B, blue: less)", kind.name(), f.normalised);
        let (folded, svg) = differential(&fa, &fb, f.a_n, f.b_n, kind, &title)?;
        out.push((f.folded.clone(), folded.into_bytes()));
        out.push((f.svg.clone(), svg));
    }
    Ok(out)
}

/// A's weights scaled to B's denominator (`w · nb / na`), rounded: inferno takes integers.
fn scaled(f: &Folded, na: f64, nb: f64) -> Folded {
    f.iter().map(|(k, &w)| (k.clone(), (w as f64 * nb / na).round() as u64)).filter(|(_, w)| *w > 0).collect()
}

/// The differential folded text (`stack A B`, inferno's differential format) and its SVG: the
/// width is B's weight, red where B spends more than A, blue where less.
pub fn differential(fa: &Folded, fb: &Folded, na: f64, nb: f64, kind: Kind, title: &str) -> std::io::Result<(String, Vec<u8>)> {
    let (ta, tb) = (flame::folded_text(&scaled(fa, na, nb)), flame::folded_text(fb));
    let mut folded = Vec::new();
    inferno::differential::from_readers(inferno::differential::Options::default(), ta.as_bytes(), tb.as_bytes(), &mut folded)?;
    let folded = String::from_utf8_lossy(&folded).into_owned();
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = title.to_string();
    opts.count_name = kind.unit().to_string();
    opts.deterministic = true;
    let mut svg = Vec::new();
    inferno::flamegraph::from_lines(&mut opts, folded.lines(), &mut svg)?;
    Ok((folded, svg))
}

/// diff.md: GitHub-ready, the verdict delta first.
pub fn markdown(d: &Diff) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "## probe diff\n\n**{}**\n", d.headline);
    let _ = writeln!(s, "- **A** (baseline): {} — `{}`", d.a.label, d.a.dir);
    let _ = writeln!(s, "- **B**: {} — `{}`\n", d.b.label, d.b.dir);
    if !d.mismatch.is_empty() {
        let _ = writeln!(s, "> Compared with --force: {}.\n", d.mismatch.join("; "));
    }
    let _ = writeln!(s, "| | A | B | B − A |\n|---|---:|---:|---:|");
    let row = |s: &mut String, name: &str, x: &Option<Delta>, unit: &str, prec: usize| {
        if let Some(x) = x {
            let _ = writeln!(s, "| {name} | {:.p$} {unit} | {:.p$} {unit} | {:+.p$} {unit} |", x.a, x.b, x.delta, p = prec);
        }
    };
    row(&mut s, "**TTFT** (mean)", &d.ttft_ms, "ms", 0);
    for p in &d.split {
        if p.ms.a.abs() >= 0.5 || p.ms.b.abs() >= 0.5 {
            let name = if d.explained_by == Some(p.part) { format!("↳ **{}**", p.part) } else { format!("↳ {}", p.part) };
            row(&mut s, &name, &Some(p.ms), "ms", 0);
        }
    }
    row(&mut s, "decode per token", &d.per_token_ms, "ms", 2);
    row(&mut s, "token gap p99", &d.gap_p99_ms, "ms", 1);
    row(&mut s, "end to end", &d.e2e_ms, "ms", 0);
    row(&mut s, "output tokens", &d.tokens, "", 0);
    let counts = |s: &mut String, title: &str, v: &[Count]| {
        if v.iter().any(|c| c.a != c.b) || v.len() > 1 {
            let l = |f: &dyn Fn(&Count) -> u64| {
                v.iter().filter(|c| f(c) > 0).map(|c| format!("{} {}", c.cause, f(c))).collect::<Vec<_>>().join(", ")
            };
            let _ = writeln!(s, "| {title} | {} | {} | |", l(&|c| c.a), l(&|c| c.b));
        }
    };
    counts(&mut s, "slow causes", &d.slow_causes);
    counts(&mut s, "stop causes", &d.stop_causes);
    let _ = writeln!(s);
    if !d.files.is_empty() || !d.model_resident.is_empty() || !d.competitors.is_empty() || !d.faults.is_empty() || !d.setup.is_empty() {
        let _ = writeln!(s, "### What was different\n\n| | A | B |\n|---|---|---|");
        for f in &d.files {
            let _ = writeln!(s, "| read from disk before the first token: `{}` | {} | {} |", f.path, mib(f.a_bytes), mib(f.b_bytes));
        }
        for r in &d.model_resident {
            let p = |x: Option<f64>| x.map_or("?".into(), |x| format!("{:.0}%", x * 100.0));
            let _ = writeln!(s, "| page-cache residency before: `{}` | {} | {} |", r.path, p(r.a), p(r.b));
        }
        for c in &d.competitors {
            let _ = writeln!(s, "| held a CPU the server waited for: {} | {:.0} ms | {:.0} ms |", c.who, c.a_ms, c.b_ms);
        }
        for c in d.faults.iter().chain(&d.setup) {
            let _ = writeln!(s, "| {} | `{}` | `{}` |", c.what, c.a, c.b);
        }
        let _ = writeln!(s);
    }
    if !d.flames.is_empty() {
        let _ = writeln!(s, "### Differential flamegraphs\n");
        for f in &d.flames {
            let _ = writeln!(s, "- **{}** ({}, {}): {}", f.kind, f.unit, f.normalised, flame_words(f));
            let _ = writeln!(
                s,
                "  `{}` (red: more in B, blue: less; the width is B), `{}` (inferno's differential format: stack, A, B)",
                f.svg, f.folded
            );
        }
        let _ = writeln!(s);
    }
    if let Some(w) = &d.no_flames {
        let _ = writeln!(s, "No differential flamegraph: {w}.\n");
    }
    for n in &d.notes {
        let _ = writeln!(s, "- {n}");
    }
    s
}

/// "4.1 → 4.3 samples per token (+5%): nearly unchanged", or what grew and shrank.
pub fn flame_words(f: &FlameDiff) -> String {
    let pct = f.total.pct().map(|p| format!(" ({p:+.0}%)")).unwrap_or_default();
    let unit = if f.normalised == crate::analysis::diff::Normalised::PerGeneratedToken { "per token" } else { "per request" };
    let total = format!("{:.1} → {:.1} {} {unit}{pct}", f.total.a, f.total.b, f.unit);
    if f.nearly_unchanged {
        return format!("{total}: nearly unchanged, no frame moved by {:.0}% of the total or more", FRAME_SHARE * 100.0);
    }
    let l = |v: &[FrameDelta]| v.iter().take(4).map(|x| format!("{} {:.1} → {:.1}", x.frame, x.a, x.b)).collect::<Vec<_>>().join(", ");
    let mut parts = vec![total];
    if !f.grew.is_empty() {
        parts.push(format!("grew: {}", l(&f.grew)));
    }
    if !f.shrank.is_empty() {
        parts.push(format!("shrank: {}", l(&f.shrank)));
    }
    if f.grew.is_empty() && f.shrank.is_empty() {
        parts.push("the change is spread over many frames, none of them beyond noise".into());
    }
    parts.join("; ")
}

/// The terminal summary.
pub fn text(d: &Diff) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "{}\n", d.headline);
    let _ = writeln!(s, "  A: {} ({})\n  B: {} ({})", d.a.label, d.a.dir, d.b.label, d.b.dir);
    let line = |s: &mut String, name: &str, x: &Option<Delta>, unit: &str, p: usize| {
        if let Some(x) = x {
            let _ = writeln!(s, "  {name:<22} {:>10.p$} {unit:<3} {:>10.p$} {unit:<3} {:>+10.p$} {unit}", x.a, x.b, x.delta, p = p);
        }
    };
    let _ = writeln!(s, "\n  {:<22} {:>14} {:>14} {:>13}", "", "A", "B", "B − A");
    line(&mut s, "TTFT (mean)", &d.ttft_ms, "ms", 0);
    for p in d.split.iter().filter(|p| p.ms.a.abs() >= 0.5 || p.ms.b.abs() >= 0.5) {
        line(&mut s, &format!("  {}", p.part), &Some(p.ms), "ms", 0);
    }
    line(&mut s, "decode per token", &d.per_token_ms, "ms", 2);
    line(&mut s, "token gap p99", &d.gap_p99_ms, "ms", 1);
    line(&mut s, "output tokens", &d.tokens, "", 0);
    for f in &d.files {
        let _ = writeln!(s, "  read from disk: {} {} → {}", f.path, mib(f.a_bytes), mib(f.b_bytes));
    }
    for c in &d.competitors {
        let _ = writeln!(s, "  on the CPU meanwhile: {} {:.0} → {:.0} ms", c.who, c.a_ms, c.b_ms);
    }
    for c in d.faults.iter().chain(&d.setup) {
        let _ = writeln!(s, "  {}: {} → {}", c.what, c.a, c.b);
    }
    for f in &d.flames {
        let _ = writeln!(s, "  flamegraph {}: {}", f.kind, flame_words(f));
    }
    if let Some(w) = &d.no_flames {
        let _ = writeln!(s, "  no differential flamegraph: {w}");
    }
    s
}
