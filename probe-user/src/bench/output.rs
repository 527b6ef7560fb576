//! What a benchmark leaves behind: a table per sweep for the terminal, results.json,
//! results.csv, results-vllm.jsonl (bench::vllm), summary.txt (definitions, tables, conclusions) and hand-written SVG bar charts:
//! TTFT and output tokens by level, the stop-reason mix by level, prompt and output tokens/s by
//! bucket, TTFT by idle interval split into its causes.
use std::{fmt::Write as _, path::Path};

use super::{
    metrics::{DEFINITIONS, Level, Row, csv},
    results::Results,
};

fn f(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}")).unwrap_or_else(|| "-".into())
}

/// The terminal table of one sweep.
pub fn table(levels: &[Level], sweep: &str) -> String {
    let ls: Vec<&Level> = levels.iter().filter(|l| l.sweep == sweep).collect();
    if ls.is_empty() {
        return String::new();
    }
    let head = [
        "level",
        "reqs",
        "ok",
        "prompt tok",
        "out tok",
        "stops",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "TPOT",
        "E2E",
        "prompt t/s",
        "out t/s",
        "goodput/s",
        "slow (traced)",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for l in ls {
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
            f(l.ttft_ms_p50, 1),
            f(l.ttft_ms_p99, 1),
            f(l.itl_ms_p50, 1),
            f(l.tpot_ms_mean, 1),
            f(l.e2e_ms_mean, 0),
            f(l.prompt_tps_mean, 0),
            f(l.throughput_output_tps, 1),
            f(l.goodput_rps, 2),
            l.slow_causes.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join(", "),
        ]);
    }
    let widths: Vec<usize> = (0..head.len()).map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = format!("{sweep} sweep (times in ms)\n");
    for l in lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "  {}", cells.join("  ").trim_end());
    }
    out
}

/// summary.txt: definitions, tables, counters, conclusions and notes.
pub fn summary(r: &Results) -> String {
    let mut o = format!(
        "probe bench against {} ({:?} API){}\n\n",
        r.url,
        r.api,
        if r.interrupted { " — INTERRUPTED: partial results" } else { "" }
    );
    o.push_str("Definitions\n");
    for (k, v) in DEFINITIONS {
        let _ = writeln!(o, "  {k}: {v}");
    }
    o.push('\n');
    for s in ["concurrency", "prompt", "idle"] {
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
                    let p = l.counters_peak.get(k).map(|p| format!(", peak {p}")).unwrap_or_default();
                    format!("{k} {b} -> {a}{p}")
                })
                .collect();
            let _ = writeln!(o, "  {} {}: {}", l.sweep, l.level, parts.join("; "));
        }
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
    let (x, y, w, h) = at;
    let mut o = String::new();
    let (left, top, bottom) = (50.0, 24.0, 40.0);
    let (pw, ph) = (w - left - 10.0, h - top - bottom);
    let max = if stacked {
        (0..cats.len()).map(|c| series.iter().map(|s| s.1.get(c).copied().unwrap_or(0.0)).sum::<f64>()).fold(0.0, f64::max)
    } else {
        series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0, f64::max)
    };
    let max = if max > 0.0 { max * 1.1 } else { 1.0 };
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
    for t in 0..=4 {
        let v = max * t as f64 / 4.0;
        let ty = top + ph - ph * t as f64 / 4.0;
        let _ = write!(
            o,
            r##"<text x="{}" y="{}" font-size="10" text-anchor="end">{}</text><line x1="{left}" y1="{ty}" x2="{}" y2="{ty}" stroke="#eee"/>"##,
            left - 4.0,
            ty + 3.0,
            if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") },
            left + pw
        );
    }
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
    let (w, h) = (420.0, 300.0);
    let mut out = Vec::new();
    let of = |s: &str| -> Vec<&Level> { levels.iter().filter(|l| l.sweep == s).collect() };
    let cats = |ls: &[&Level]| -> Vec<String> { ls.iter().map(|l| l.level.clone()).collect() };
    let vals = |ls: &[&Level], g: &dyn Fn(&Level) -> Option<f64>| -> Vec<f64> { ls.iter().map(|l| g(l).unwrap_or(0.0)).collect() };
    let mix = |ls: &[&Level]| -> Vec<(String, Vec<f64>)> {
        let mut names: Vec<String> = ls.iter().flat_map(|l| l.stops.keys().cloned()).collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| (n.clone(), ls.iter().map(|l| l.stops.get(&n).copied().unwrap_or(0) as f64).collect())).collect()
    };
    let c = of("concurrency");
    if !c.is_empty() {
        let a =
            panel((0.0, 0.0, w, h), "TTFT p50 (ms) by concurrency", &cats(&c), &[("TTFT p50".into(), vals(&c, &|l| l.ttft_ms_p50))], false);
        let b = panel(
            (w, 0.0, w, h),
            "output tokens (mean) by concurrency",
            &cats(&c),
            &[("output tokens".into(), vals(&c, &|l| l.output_tokens_mean))],
            false,
        );
        out.push(("concurrency-ttft-output.svg".into(), svg(&[a, b], w, h)));
        out.push((
            "concurrency-stops.svg".into(),
            svg(&[panel((0.0, 0.0, w, h), "stop reasons by concurrency (requests)", &cats(&c), &mix(&c), true)], w, h),
        ));
    }
    let p = of("prompt");
    if !p.is_empty() {
        let a = panel(
            (0.0, 0.0, w, h),
            "prompt tokens/s by bucket",
            &cats(&p),
            &[("prompt tok/s".into(), vals(&p, &|l| l.prompt_tps_mean))],
            false,
        );
        let b = panel(
            (w, 0.0, w, h),
            "output tokens/s by bucket",
            &cats(&p),
            &[("output tok/s".into(), vals(&p, &|l| l.throughput_output_tps))],
            false,
        );
        let t =
            panel((2.0 * w, 0.0, w, h), "TTFT p50 (ms) by bucket", &cats(&p), &[("TTFT p50".into(), vals(&p, &|l| l.ttft_ms_p50))], false);
        out.push(("prompt-throughput.svg".into(), svg(&[a, b, t], w, h)));
        out.push((
            "prompt-stops.svg".into(),
            svg(&[panel((0.0, 0.0, w, h), "stop reasons by bucket (requests)", &cats(&p), &mix(&p), true)], w, h),
        ));
    }
    let i = of("idle");
    if !i.is_empty() {
        let names = ["queue", "disk", "memory", "cpu_contention", "load", "compute", "unexplained"];
        let traced = rows.iter().any(|r| r.sweep == "idle" && r.verdict.is_some());
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
                                        "queue" => s.queue,
                                        "disk" => s.disk,
                                        "memory" => s.memory,
                                        "cpu_contention" => s.cpu_contention,
                                        "load" => s.load,
                                        "compute" => s.compute,
                                        _ => s.unexplained + s.power,
                                    })
                                })
                                .collect();
                            super::metrics::mean(&parts).unwrap_or(0.0)
                        })
                        .collect();
                    (n.to_string(), v)
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
        out.push(("idle-ttft.svg".into(), svg(&[panel((0.0, 0.0, 2.0 * w, h), title, &cats(&i), &series, true)], 2.0 * w, h)));
    }
    out
}

/// Write results.json, results.csv, summary.txt and the charts into `dir`.
pub fn write_all(dir: &Path, r: &Results) -> anyhow::Result<Vec<String>> {
    let d = crate::output::OutDir::create_or_open(dir)?;
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
            sweep: "concurrency".into(),
            level: "4".into(),
            requests: 4,
            ok: 4,
            output_tokens_mean: Some(12.0),
            output_tokens_min: Some(10),
            output_tokens_max: Some(14),
            ..Default::default()
        };
        let t = table(&[l], "concurrency");
        assert!(t.contains("12 (10-14)"), "{t}");
        assert_eq!(t.lines().count(), 3);
        assert!(table(&[], "idle").is_empty());
    }
}
