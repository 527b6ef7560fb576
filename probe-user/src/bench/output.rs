//! What a benchmark leaves behind: a table per sweep for the terminal, results.json,
//! results.csv, results-vllm.jsonl (bench::vllm), summary.txt (definitions, tables, conclusions) and hand-written SVG bar charts:
//! TTFT and output tokens by level, the stop-reason mix by level, prompt and output tokens/s by
//! bucket, TTFT by idle interval split into its causes.
use std::{fmt::Write as _, path::Path};

use super::{
    metrics::{DEFINITIONS, Figure, Level, Row, csv},
    results::Results,
};

fn f(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}")).unwrap_or_else(|| "-".into())
}

/// The terminal table of one sweep.
pub fn table(levels: &[Level], sweep: crate::bench::metrics::Sweep) -> String {
    let ls: Vec<&Level> = levels.iter().filter(|l| l.sweep == sweep).collect();
    if ls.is_empty() {
        return String::new();
    }
    // The traced slow causes only when a level has some (a run without --trace has none); the
    // engine's columns only when the engine probe saw steps (a traced llama.cpp server).
    let traced = ls.iter().any(|l| !l.slow_causes.is_empty());
    let engine = ls.iter().any(|l| l.engine_step_ms_p50.is_some());
    let cached = ls.iter().any(|l| l.cached_tokens_mean.is_some());
    let machine = ls.iter().any(|l| l.machine.is_some());
    // Each column and whether it is shown.
    let columns = [
        ("level", true),
        ("reqs", true),
        ("ok", true),
        ("prompt tok", true),
        ("out tok", true),
        ("stops", true),
        ("TTFT p50", true),
        ("TTFT p99", true),
        ("ITL p50", true),
        ("TPOT", true),
        ("E2E", true),
        ("prompt t/s", true),
        ("out t/s", true),
        ("goodput/s", true),
        ("good %", true),
        ("cached", cached),
        ("others CPU", machine),
        ("batch", engine),
        ("step ms", engine),
        ("KV", engine),
        ("slow (traced)", traced),
    ];
    // "412.0 ±13.2": the half-width of the figure's 95% interval, with --repeat.
    let pm = |l: &Level, v: Option<f64>, figure: Figure, prec: usize| match l.intervals.get(figure.name()) {
        Some(i) => format!("{} ±{:.prec$}", f(v, prec), (i.hi - i.lo) / 2.0),
        None => f(v, prec),
    };
    let keep: Vec<usize> = (0..columns.len()).filter(|&i| columns[i].1).collect();
    let head: Vec<&str> = keep.iter().map(|&i| columns[i].0).collect();
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for l in &ls {
        lines.push(vec![
            l.level.clone(),
            l.requests.to_string(),
            l.ok.to_string(),
            f(l.prompt_tokens_mean, 0),
            match (l.output_tokens_min, l.output_tokens_max) {
                (Some(a), Some(b)) if a != b => format!("{} ({a}-{b})", f(l.output_tokens_mean, 0)),
                _ => f(l.output_tokens_mean, 0),
            },
            super::conclude::mix(l),
            pm(l, l.ttft_ms_p50, Figure::TtftMsP50, 1),
            pm(l, l.ttft_ms_p99, Figure::TtftMsP99, 1),
            pm(l, l.itl_ms_p50, Figure::ItlMsP50, 1),
            pm(l, l.tpot_ms_mean, Figure::TpotMsMean, 1),
            pm(l, l.e2e_ms_mean, Figure::E2eMsMean, 0),
            f(l.prompt_tps_mean, 0),
            pm(l, l.throughput_output_tps, Figure::ThroughputOutputTps, 1),
            pm(l, l.goodput_rps, Figure::GoodputRps, 2),
            f(l.goodput_pct, 0),
            f(l.cached_tokens_mean, 0),
            l.machine.as_ref().map(|m| format!("{:.2}{}", m.others_cores, if l.contended { " !" } else { "" })).unwrap_or_default(),
            f(l.engine_batch_seqs, 1),
            f(l.engine_step_ms_p50, 1),
            f(l.engine_kv_len, 0),
            l.slow_causes.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join(", "),
        ]);
        let row = lines.pop().unwrap_or_default();
        lines.push(keep.iter().map(|&i| row[i].clone()).collect());
    }
    let widths: Vec<usize> = (0..head.len()).map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0)).collect();
    let runs = ls.iter().map(|l| l.runs).max().unwrap_or(1);
    let mut out = format!(
        "{sweep} sweep (times in ms{}{})\n",
        if runs > 1 { format!("; ± half the 95% interval over {runs} runs") } else { String::new() },
        if machine { "; others CPU: cores other processes used, ! contended" } else { "" }
    );
    for l in lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "  {}", cells.join("  ").trim_end());
    }
    out
}

/// summary.txt: definitions, tables, counters, conclusions and notes.
pub fn summary(r: &Results) -> String {
    let mut o = format!(
        "probe bench against {} (--api {}){}\n\n",
        r.url,
        r.api.describe(),
        if r.interrupted { " — INTERRUPTED: partial results" } else { "" }
    );
    o.push_str("Definitions\n");
    for (k, v) in DEFINITIONS {
        let _ = writeln!(o, "  {k}: {v}");
    }
    o.push('\n');
    for s in super::SWEEPS {
        let t = table(&r.levels, s);
        if !t.is_empty() {
            o.push_str(&t);
            o.push('\n');
        }
    }
    let counters: Vec<&Level> = r.levels.iter().filter(|l| !l.counters_after.is_empty()).collect();
    if !counters.is_empty() {
        o.push_str("Server counters per level (before -> after, peak while running)\n");
        for l in counters {
            let parts: Vec<String> = l
                .counters_after
                .iter()
                .map(|(k, a)| {
                    let b = l.counters_before.get(k).map(|b| format!("{b}")).unwrap_or_else(|| "?".into());
                    // A peak only where it says more than the ends (a gauge that rose and fell;
                    // a counter's sampled peak is never above its end).
                    let ends = l.counters_before.get(k).copied().unwrap_or(f64::MIN).max(*a);
                    let p = l.counters_peak.get(k).filter(|&&p| p > ends).map(|p| format!(", peak {p}")).unwrap_or_default();
                    format!("{k} {b} -> {a}{p}")
                })
                .collect();
            let _ = writeln!(o, "  {} {}: {}", l.sweep, l.level, parts.join("; "));
        }
        o.push('\n');
    }
    let machines: Vec<&Level> = r.levels.iter().filter(|l| l.machine.is_some()).collect();
    if !machines.is_empty() {
        o.push_str("The machine per level (means over its runs)\n");
        for l in machines {
            let m = l.machine.as_ref().map(|m| m.words()).unwrap_or_default();
            let _ = writeln!(o, "  {} {}{}: {m}", l.sweep, l.level, if l.contended { " [contended]" } else { "" });
        }
        o.push('\n');
    }
    if let Some(x) = &r.compared_with {
        o.push_str(&x.table());
        o.push('\n');
    }
    o.push_str("Conclusions\n");
    if r.conclusions.is_empty() {
        o.push_str("  (no level finished)\n");
    }
    for c in &r.conclusions {
        let _ = writeln!(o, "  - {c}");
    }
    if !r.notes.is_empty() {
        o.push_str("\nNotes\n");
        for n in &r.notes {
            let _ = writeln!(o, "  - {n}");
        }
    }
    o
}

const COLORS: &[(&str, &str)] = &[
    ("eos", "#4e79a7"),
    ("requested_limit", "#59a14f"),
    ("server_limit", "#e15759"),
    ("stop_word", "#76b7b2"),
    ("client_disconnect", "#b07aa1"),
    ("deadline", "#f28e2b"),
    ("server_error", "#9c755f"),
    ("rejected", "#bab0ac"),
    ("unknown", "#d3d3d3"),
    ("queue", "#f28e2b"),
    ("disk", "#e15759"),
    ("memory", "#b07aa1"),
    ("load", "#ff9da7"),
    ("power", "#edc948"),
    ("compute", "#4e79a7"),
    ("unexplained", "#bab0ac"),
    ("other", "#bab0ac"),
];

fn color(name: &str, i: usize) -> &'static str {
    COLORS.iter().find(|c| c.0 == name).map(|c| c.1).unwrap_or(["#4e79a7", "#59a14f", "#f28e2b", "#e15759"][i % 4])
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// One bar chart panel at `at` = (x, y, width, height): grouped or stacked bars per category.
pub fn panel(at: (f64, f64, f64, f64), title: &str, cats: &[String], series: &[(String, Vec<f64>)], stacked: bool) -> String {
    panel_with(at, title, cats, series, stacked, &[])
}

/// [`panel`] of one series with a whisker per bar: its 95% interval (--repeat), where it has one.
pub fn panel_ci(at: (f64, f64, f64, f64), title: &str, cats: &[String], series: (String, Vec<f64>), ci: &[Option<(f64, f64)>]) -> String {
    panel_with(at, title, cats, &[series], false, ci)
}

fn panel_with(
    at: (f64, f64, f64, f64),
    title: &str,
    cats: &[String],
    series: &[(String, Vec<f64>)],
    stacked: bool,
    whiskers: &[Option<(f64, f64)>],
) -> String {
    let (x, y, w, h) = at;
    let mut o = String::new();
    let (left, top, bottom) = (58.0, 24.0, 52.0);
    let (pw, ph) = (w - left - 10.0, h - top - bottom);
    let max = if stacked {
        (0..cats.len()).map(|c| series.iter().map(|s| s.1.get(c).copied().unwrap_or(0.0)).sum::<f64>()).fold(0.0, f64::max)
    } else {
        series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0, f64::max)
    };
    let max = whiskers.iter().flatten().map(|w| w.1).fold(max, f64::max);
    // Round ticks (1, 2 or 5 times a power of ten), whole ones for counts ("(requests)").
    let counts = title.contains("(requests)");
    let (max, step) = nice_ticks(if max > 0.0 { max * 1.05 } else { 1.0 }, counts);
    let _ = write!(
        o,
        r#"<g transform="translate({x},{y})"><text x="{}" y="16" font-size="13" text-anchor="middle" font-weight="bold">{}</text>"#,
        w / 2.0,
        esc(title)
    );
    let _ = write!(
        o,
        r##"<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="#333"/><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#333"/>"##,
        top + ph,
        top + ph,
        left + pw,
        top + ph
    );
    let ticks = (max / step).round() as usize;
    for t in 0..=ticks {
        let v = step * t as f64;
        let ty = top + ph - ph * v / max;
        let label = if step >= 1.0 { format!("{v:.0}") } else { format!("{v:.1}") };
        let _ = write!(
            o,
            r##"<text x="{}" y="{}" font-size="10" text-anchor="end">{label}</text><line x1="{left}" y1="{ty}" x2="{}" y2="{ty}" stroke="#eee"/>"##,
            left - 4.0,
            ty + 3.0,
            left + pw
        );
    }
    // Axis labels: what the bars measure (the title's unit, else the series) and the sweep.
    let unit = title.split_once(" (").and_then(|(_, u)| u.split(')').next()).unwrap_or_else(|| title.split(" by ").next().unwrap_or(title));
    let sweep = title.rsplit_once(" by ").map_or("", |(_, x)| x.split(" (").next().unwrap_or(x));
    let _ = write!(
        o,
        r##"<text x="12" y="{}" font-size="10" text-anchor="middle" transform="rotate(-90 12 {})">{}</text><text x="{}" y="{}" font-size="10" text-anchor="middle" fill="#555">{}</text>"##,
        top + ph / 2.0,
        top + ph / 2.0,
        esc(unit),
        left + pw / 2.0,
        top + ph + 26.0,
        esc(sweep)
    );
    let n = cats.len().max(1) as f64;
    let slot = pw / n;
    for (c, cat) in cats.iter().enumerate() {
        let cx = left + slot * c as f64;
        let _ =
            write!(o, r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{}</text>"#, cx + slot / 2.0, top + ph + 14.0, esc(cat));
        let mut base = 0.0;
        let k = series.len().max(1) as f64;
        for (i, (name, vals)) in series.iter().enumerate() {
            let v = vals.get(c).copied().unwrap_or(0.0);
            if v <= 0.0 {
                continue;
            }
            let bh = ph * v / max;
            let (bx, bw, by) = if stacked {
                (cx + slot * 0.2, slot * 0.6, top + ph - ph * base / max - bh)
            } else {
                (cx + slot * 0.1 + slot * 0.8 * i as f64 / k, slot * 0.8 / k, top + ph - bh)
            };
            base += v;
            let _ = write!(
                o,
                r#"<rect x="{bx:.1}" y="{by:.1}" width="{bw:.1}" height="{bh:.1}" fill="{}"><title>{}: {v:.1}</title></rect>"#,
                color(name, i),
                esc(name)
            );
        }
        if let Some(Some((lo, hi))) = whiskers.get(c) {
            let (mx, y1, y2) = (cx + slot / 2.0, top + ph - ph * lo.max(0.0) / max, top + ph - ph * hi / max);
            let _ = write!(
                o,
                r##"<g class="ci" stroke="#222"><line x1="{mx:.1}" y1="{y1:.1}" x2="{mx:.1}" y2="{y2:.1}"/><line x1="{:.1}" y1="{y1:.1}" x2="{:.1}" y2="{y1:.1}"/><line x1="{:.1}" y1="{y2:.1}" x2="{:.1}" y2="{y2:.1}"/><title>95% interval {lo:.1} - {hi:.1}</title></g>"##,
                mx - 5.0,
                mx + 5.0,
                mx - 5.0,
                mx + 5.0
            );
        }
    }
    for (i, (name, _)) in series.iter().enumerate() {
        let lx = left + (i as f64) * (pw / series.len().max(1) as f64);
        let _ = write!(
            o,
            r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}" font-size="10">{}</text>"#,
            h - 14.0,
            color(name, i),
            lx + 13.0,
            h - 5.0,
            esc(name)
        );
    }
    o.push_str("</g>");
    o
}

/// A round axis: (top, step) with top = step × (at most 5) ≥ `max`; the step is 1, 2 or 5 times a
/// power of ten, and at least 1 for counts.
pub fn nice_ticks(max: f64, counts: bool) -> (f64, f64) {
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|&s| s >= raw).unwrap_or(10.0 * mag);
    if counts {
        step = step.max(1.0).round();
    }
    ((max / step).ceil().max(1.0) * step, step)
}

/// An SVG document of panels side by side.
pub fn svg(panels: &[String], w: f64, h: f64) -> String {
    let total = w * panels.len() as f64;
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="{h}" viewBox="0 0 {total} {h}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{}</svg>
"#,
        panels.join("")
    )
}

/// The charts for the sweeps present: (file name, SVG).
pub fn charts(levels: &[Level], rows: &[Row]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let of = |s: crate::bench::metrics::Sweep| -> Vec<&Level> { levels.iter().filter(|l| l.sweep == s).collect() };
    let c = of(crate::bench::metrics::Sweep::Concurrency);
    if !c.is_empty() {
        concurrency_charts(&c, &mut out);
    }
    let r = of(crate::bench::metrics::Sweep::Rate);
    if !r.is_empty() {
        out.push(("rate-latency.svg".into(), rate_chart(&r)));
    }
    let x = of(crate::bench::metrics::Sweep::Prefix);
    if !x.is_empty() {
        out.push(("prefix-cache.svg".into(), prefix_chart(&x)));
    }
    let m = of(crate::bench::metrics::Sweep::Multiturn);
    if !m.is_empty() {
        out.push(("multiturn-turns.svg".into(), multiturn_chart(rows)));
    }
    let p = of(crate::bench::metrics::Sweep::Prompt);
    if !p.is_empty() {
        prompt_charts(&p, &mut out);
    }
    // The engine's steps (a traced llama.cpp server): sequences per step by concurrency, and the
    // decode step's time by prompt bucket: the context's cost, measured inside the engine.
    let engine = |ls: &[&Level]| ls.iter().any(|l| l.engine_step_ms_p50.is_some());
    if engine(&c) || engine(&p) {
        out.push(("engine-steps.svg".into(), engine_chart(&c, engine(&c), &p, engine(&p))));
    }
    let i = of(crate::bench::metrics::Sweep::Idle);
    if !i.is_empty() {
        out.push(("idle-ttft.svg".into(), idle_chart(&i, rows)));
    }
    out
}

/// A chart panel's size, px (charts put panels side by side).
const W: f64 = 420.0;
const H: f64 = 300.0;

/// The levels' names: a panel's categories.
fn cats(ls: &[&Level]) -> Vec<String> {
    ls.iter().map(|l| l.level.clone()).collect()
}

/// A figure of each level (0 where a level has none).
fn vals(ls: &[&Level], g: &dyn Fn(&Level) -> Option<f64>) -> Vec<f64> {
    ls.iter().map(|l| g(l).unwrap_or(0.0)).collect()
}

/// The stop reasons' counts by level, one series a reason (sorted by name).
fn mix(ls: &[&Level]) -> Vec<(String, Vec<f64>)> {
    let mut names: Vec<String> = ls.iter().flat_map(|l| l.stops.keys().cloned()).collect();
    names.sort();
    names.dedup();
    names.into_iter().map(|n| (n.clone(), ls.iter().map(|l| l.stops.get(&n).copied().unwrap_or(0) as f64).collect())).collect()
}

/// Each level's 95% interval of figure `f` (with --repeat).
fn ci(ls: &[&Level], f: &str) -> Vec<Option<(f64, f64)>> {
    ls.iter().map(|l| l.intervals.get(f).map(|i| (i.lo, i.hi))).collect()
}

/// The concurrency sweep: TTFT and output length, then the stop reasons.
fn concurrency_charts(c: &[&Level], out: &mut Vec<(String, String)>) {
    let (w, h) = (W, H);
    let a = panel_ci(
        (0.0, 0.0, w, h),
        "TTFT p50 (ms) by concurrency",
        &cats(c),
        ("TTFT p50".into(), vals(c, &|l| l.ttft_ms_p50)),
        &ci(c, "ttft_ms_p50"),
    );
    let b = panel_ci(
        (w, 0.0, w, h),
        "output tokens (mean) by concurrency",
        &cats(c),
        ("output tokens".into(), vals(c, &|l| l.output_tokens_mean)),
        &ci(c, "output_tokens_mean"),
    );
    out.push(("concurrency-ttft-output.svg".into(), svg(&[a, b], w, h)));
    out.push((
        "concurrency-stops.svg".into(),
        svg(&[panel((0.0, 0.0, w, h), "stop reasons by concurrency (requests)", &cats(c), &mix(c), true)], w, h),
    ));
}

/// The rate sweep: TTFT, TPOT, and requests served against goodput.
fn rate_chart(r: &[&Level]) -> String {
    let (w, h) = (W, H);
    let a = panel_ci(
        (0.0, 0.0, w, h),
        "TTFT p50 (ms) by arrival rate",
        &cats(r),
        ("TTFT p50".into(), vals(r, &|l| l.ttft_ms_p50)),
        &ci(r, "ttft_ms_p50"),
    );
    let b = panel_ci(
        (w, 0.0, w, h),
        "TPOT (ms) by arrival rate",
        &cats(r),
        ("TPOT".into(), vals(r, &|l| l.tpot_ms_mean)),
        &ci(r, "tpot_ms_mean"),
    );
    let g = panel(
        (2.0 * w, 0.0, w, h),
        "requests/s by arrival rate",
        &cats(r),
        &[("served".into(), vals(r, &|l| l.request_rate)), ("goodput".into(), vals(r, &|l| l.goodput_rps))],
        false,
    );
    svg(&[a, b, g], w, h)
}

/// The shared-prefix workload: cached against prompt tokens, and TTFT.
fn prefix_chart(x: &[&Level]) -> String {
    let (w, h) = (W, H);
    let a = panel(
        (0.0, 0.0, w, h),
        "prompt tokens after the first (mean) by concurrency",
        &cats(x),
        &[("cached".into(), vals(x, &|l| l.cached_tokens_mean)), ("prompt".into(), vals(x, &|l| l.prompt_tokens_mean))],
        false,
    );
    let b = panel_ci(
        (w, 0.0, w, h),
        "TTFT p50 (ms) by concurrency",
        &cats(x),
        ("TTFT p50".into(), vals(x, &|l| l.ttft_ms_p50)),
        &ci(x, "ttft_ms_p50"),
    );
    svg(&[a, b], w, h)
}

/// The multi-turn workload, by turn over its rows: TTFT, and prompt against cached tokens.
fn multiturn_chart(rows: &[Row]) -> String {
    let (w, h) = (W, H);
    let turns: Vec<u64> = {
        let mut t: Vec<u64> = rows.iter().filter(|r| r.sweep == crate::bench::metrics::Sweep::Multiturn).filter_map(|r| r.turn).collect();
        t.sort();
        t.dedup();
        t
    };
    let tcats: Vec<String> = turns.iter().map(|t| format!("turn {t}")).collect();
    let by = |g: &dyn Fn(&Row) -> Option<f64>| -> Vec<f64> {
        turns
            .iter()
            .map(|t| {
                super::metrics::mean(
                    &rows
                        .iter()
                        .filter(|r| r.sweep == crate::bench::metrics::Sweep::Multiturn && r.turn == Some(*t))
                        .filter_map(g)
                        .collect::<Vec<_>>(),
                )
                .unwrap_or(0.0)
            })
            .collect()
    };
    let a = panel((0.0, 0.0, w, h), "TTFT (ms, mean) by turn", &tcats, &[("TTFT".into(), by(&|r| r.ttft_ms))], false);
    let b = panel(
        (w, 0.0, w, h),
        "prompt tokens (mean) by turn",
        &tcats,
        &[("prompt".into(), by(&|r| r.prompt_tokens.map(|n| n as f64))), ("cached".into(), by(&|r| r.cached_tokens.map(|n| n as f64)))],
        false,
    );
    svg(&[a, b], w, h)
}

/// The prompt sweep: prompt and output tokens/s and TTFT by bucket, then the stop reasons.
fn prompt_charts(p: &[&Level], out: &mut Vec<(String, String)>) {
    let (w, h) = (W, H);
    let a =
        panel((0.0, 0.0, w, h), "prompt tokens/s by bucket", &cats(p), &[("prompt tok/s".into(), vals(p, &|l| l.prompt_tps_mean))], false);
    let b = panel(
        (w, 0.0, w, h),
        "output tokens/s by bucket",
        &cats(p),
        &[("output tok/s".into(), vals(p, &|l| l.throughput_output_tps))],
        false,
    );
    let t = panel((2.0 * w, 0.0, w, h), "TTFT p50 (ms) by bucket", &cats(p), &[("TTFT p50".into(), vals(p, &|l| l.ttft_ms_p50))], false);
    out.push(("prompt-throughput.svg".into(), svg(&[a, b, t], w, h)));
    out.push((
        "prompt-stops.svg".into(),
        svg(&[panel((0.0, 0.0, w, h), "stop reasons by bucket (requests)", &cats(p), &mix(p), true)], w, h),
    ));
}

/// The engine's steps: batch and step time by concurrency (`by_c`), step time by bucket (`by_p`).
fn engine_chart(c: &[&Level], by_c: bool, p: &[&Level], by_p: bool) -> String {
    let (w, h) = (W, H);
    let mut panels = Vec::new();
    if by_c {
        let x = panels.len() as f64 * w;
        panels.push(panel(
            (x, 0.0, w, h),
            "engine: sequences per decode step by concurrency",
            &cats(c),
            &[("batch".into(), vals(c, &|l| l.engine_batch_seqs))],
            false,
        ));
        let x = panels.len() as f64 * w;
        panels.push(panel(
            (x, 0.0, w, h),
            "engine: decode step p50 (ms) by concurrency",
            &cats(c),
            &[("step ms".into(), vals(c, &|l| l.engine_step_ms_p50))],
            false,
        ));
    }
    if by_p {
        let x = panels.len() as f64 * w;
        let kv: Vec<String> =
            p.iter().map(|l| l.engine_kv_len.map_or_else(|| l.level.clone(), |k| format!("{} (KV {k:.0})", l.level))).collect();
        panels.push(panel(
            (x, 0.0, w, h),
            "engine: decode step p50 (ms) by prompt bucket",
            &kv,
            &[("step ms".into(), vals(p, &|l| l.engine_step_ms_p50))],
            false,
        ));
    }
    let n = panels.len() as f64;
    svg(&panels, n * w, h)
}

/// The idle sweep: TTFT by interval, split by traced cause (or server prompt time + the rest).
fn idle_chart(i: &[&Level], rows: &[Row]) -> String {
    let (w, h) = (W, H);
    use crate::analysis::verdict::SplitPart as P;
    let names = [P::Queue, P::Disk, P::Memory, P::CpuContention, P::Load, P::Compute, P::Unexplained];
    let traced = rows.iter().any(|r| r.sweep == crate::bench::metrics::Sweep::Idle && r.verdict.is_some());
    let series: Vec<(String, Vec<f64>)> = if traced {
        names
            .iter()
            .map(|n| {
                let v = i
                    .iter()
                    .map(|l| {
                        let parts: Vec<f64> = rows
                            .iter()
                            .filter(|r| r.seq == l.seq)
                            .filter_map(|r| {
                                r.verdict.as_ref()?.ttft_ms.as_ref().map(|s| match *n {
                                    P::Queue => s.queue,
                                    P::Disk => s.disk,
                                    P::Memory => s.memory,
                                    P::CpuContention => s.cpu_contention,
                                    P::Load => s.load,
                                    P::Compute => s.compute,
                                    _ => s.unexplained + s.power,
                                })
                            })
                            .collect();
                        super::metrics::mean(&parts).unwrap_or(0.0)
                    })
                    .collect();
                (n.name().to_string(), v)
            })
            .collect()
    } else {
        let per = |g: &dyn Fn(&Row) -> Option<f64>| -> Vec<f64> {
            i.iter()
                .map(|l| super::metrics::mean(&rows.iter().filter(|r| r.seq == l.seq).filter_map(g).collect::<Vec<_>>()).unwrap_or(0.0))
                .collect()
        };
        vec![
            ("compute".into(), per(&|r| r.prompt_ms.zip(r.ttft_ms).map(|(p, t)| p.min(t)))),
            ("other".into(), per(&|r| r.ttft_ms.map(|t| (t - r.prompt_ms.unwrap_or(0.0)).max(0.0)))),
        ]
    };
    let title = if traced {
        "TTFT (ms) by idle interval, split by traced cause"
    } else {
        "TTFT (ms) by idle interval (server prompt time + rest; --trace splits it)"
    };
    svg(&[panel((0.0, 0.0, 2.0 * w, h), title, &cats(i), &series, true)], 2.0 * w, h)
}

/// Write results.json, results.csv, summary.txt and the charts into `dir`.
pub fn write_all(dir: &Path, r: &Results) -> anyhow::Result<Vec<String>> {
    let d = crate::util::output::OutDir::create_or_open(dir)?;
    let mut files = vec!["results.json".to_string(), "results.csv".into(), "summary.txt".into()];
    d.write("results.json", &serde_json::to_vec_pretty(r)?)?;
    d.write("results.csv", csv(&r.rows).as_bytes())?;
    d.write("summary.txt", summary(r).as_bytes())?;
    d.write("results-vllm.jsonl", super::vllm::jsonl(r).as_bytes())?;
    files.push("results-vllm.jsonl".into());
    for (name, text) in charts(&r.levels, &r.rows) {
        d.write(&name, text.as_bytes())?;
        files.push(name);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Count axes tick in whole numbers (a chart of 3 requests once read 0.6, 1.1, 1.7); others
    /// in 1, 2 or 5 times a power of ten.
    #[test]
    fn ticks_are_round_and_whole_for_counts() {
        assert_eq!(nice_ticks(3.3, true), (4.0, 1.0));
        assert_eq!(nice_ticks(880.0, false), (1000.0, 200.0));
        assert_eq!(nice_ticks(0.9, false), (1.0, 0.2));
        let (top, step) = nice_ticks(57.0, true);
        assert!(step.fract() == 0.0 && top >= 57.0 && top / step <= 6.0, "{top} {step}");
        let svg = panel(
            (0.0, 0.0, 420.0, 300.0),
            "stop reasons by concurrency (requests)",
            &["1".into(), "2".into()],
            &[("eos".into(), vec![1.0, 3.0])],
            true,
        );
        assert!(svg.contains(">requests<") && svg.contains(">concurrency<"), "axis labels: {svg}");
        assert!(!svg.contains(">0.5<") && !svg.contains(">1.5<"), "{svg}");
    }

    #[test]
    fn panels_draw_one_rect_per_nonzero_value_and_escape_names() {
        let p = panel(
            (0.0, 0.0, 400.0, 300.0),
            "a < b",
            &["1".into(), "2".into()],
            &[("eos".into(), vec![3.0, 0.0]), ("server_limit".into(), vec![1.0, 4.0])],
            true,
        );
        assert_eq!(p.matches("<rect x=").count(), 3 + 2, "{p}"); // 3 bars + 2 legend swatches
        assert!(p.contains("a &lt; b"));
        assert!(p.contains("#e15759"));
        let doc = svg(&[p], 400.0, 300.0);
        assert!(doc.starts_with("<?xml") && doc.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn tables_align_columns() {
        let l = Level {
            sweep: crate::bench::metrics::Sweep::Concurrency,
            level: "4".into(),
            requests: 4,
            ok: 4,
            output_tokens_mean: Some(12.0),
            output_tokens_min: Some(10),
            output_tokens_max: Some(14),
            ..Default::default()
        };
        let t = table(&[l], crate::bench::metrics::Sweep::Concurrency);
        assert!(t.contains("12 (10-14)"), "{t}");
        assert_eq!(t.lines().count(), 3);
        assert!(table(&[], crate::bench::metrics::Sweep::Idle).is_empty());
    }
}
