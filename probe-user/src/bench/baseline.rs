//! `--baseline OLD/results.json`: this run's levels against an earlier run's, figure by figure.
//! A figure is called changed only when both runs have intervals (--repeat >= 2) and the
//! intervals are apart; single runs are listed with their change but not judged. The machine
//! state of both runs is compared too: a level that ran under contention here and not there, a
//! different governor or clock, is named beside the figures it may explain.
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;

use super::metrics::{INTERVAL_FIGURES, Level};
use crate::util::stats::Interval;

/// A figure is called changed only when it also moved by at least this much, %. Three runs'
/// intervals measure the spread inside one invocation, not the drift between two: identical sweeps
/// of an idle server, back to back on a 2-core VM, differed by 7% in output tokens/s at
/// concurrency 2 with intervals 0.1 wide (CI). A CPU hog moves the same figures by 50% and more.
pub const MIN_CHANGE_PCT: f64 = 10.0;

#[derive(Clone, Debug, Serialize)]
pub struct Change {
    pub sweep: crate::bench::metrics::Sweep,
    pub level: String,
    pub figure: String,
    pub before: f64,
    pub after: f64,
    pub change_pct: f64,
    pub before_interval: Option<Interval>,
    pub after_interval: Option<Interval>,
    /// Both intervals exist, are apart, and the figure moved by at least MIN_CHANGE_PCT.
    pub beyond_intervals: bool,
    /// The change is for the worse (higher latency, fewer tokens or requests a second).
    pub worse: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub path: String,
    /// Figures compared, over how many levels found in both runs.
    pub compared: usize,
    pub levels: usize,
    /// This run's levels the baseline does not have.
    pub unmatched: Vec<String>,
    /// Every figure compared (changed or not).
    pub figures: Vec<Change>,
    /// Machine-state differences between the runs.
    pub machine: Vec<String>,
}

/// The earlier run's results.json (the file, or the directory holding it).
pub fn load(path: &Path) -> anyhow::Result<(PathBuf, Value)> {
    let file = if path.is_dir() { path.join("results.json") } else { path.to_path_buf() };
    let bytes = std::fs::read(&file).with_context(|| format!("--baseline: cannot read {}", file.display()))?;
    let v: Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("--baseline: {} is not a probe bench results.json (not JSON)", file.display()))?;
    if !v["levels"].is_array() {
        anyhow::bail!("--baseline: {} has no levels: not a probe bench results.json", file.display());
    }
    Ok((file, v))
}

fn worse_when_higher(figure: &str) -> bool {
    figure.contains("_ms")
}

pub fn nice(figure: &str) -> &str {
    match figure {
        "ttft_ms_mean" => "TTFT mean",
        "ttft_ms_p50" => "TTFT p50",
        "ttft_ms_p99" => "TTFT p99",
        "tpot_ms_mean" => "TPOT",
        "itl_ms_p50" => "ITL p50",
        "e2e_ms_mean" => "E2E mean",
        "output_tokens_mean" => "output tokens",
        "throughput_output_tps" => "output tok/s",
        "goodput_rps" => "goodput req/s",
        f => f,
    }
}

pub fn compare(base: &(PathBuf, Value), levels: &[Level]) -> Comparison {
    let (path, v) = base;
    let old = v["levels"].as_array().cloned().unwrap_or_default();
    let mut c = Comparison {
        path: path.display().to_string(),
        compared: 0,
        levels: 0,
        unmatched: Vec::new(),
        figures: Vec::new(),
        machine: Vec::new(),
    };
    for l in levels {
        let Some(o) = old.iter().find(|o| o["sweep"] == l.sweep.name() && o["level"] == l.level.as_str()) else {
            c.unmatched.push(format!("{} {}", l.sweep, l.level));
            continue;
        };
        c.levels += 1;
        for f in INTERVAL_FIGURES {
            let (Some(before), Some(after)) = (o[*f].as_f64(), l.figure(f)) else { continue };
            let bi: Option<Interval> = serde_json::from_value(o["intervals"][*f].clone()).ok();
            let ai = l.intervals.get(*f).cloned();
            let change_pct = if before.abs() > 1e-9 { (after - before) / before * 100.0 } else { 0.0 };
            // Apart, and by more than MIN_CHANGE_PCT: with few runs an interval can come out
            // narrow by chance, and a 1% shift between two tight intervals is not a regression.
            let beyond = matches!((&bi, &ai), (Some(b), Some(a)) if a.apart(b)) && change_pct.abs() >= MIN_CHANGE_PCT;
            let worse = if worse_when_higher(f) { after > before } else { after < before };
            c.compared += 1;
            c.figures.push(Change {
                sweep: l.sweep,
                level: l.level.clone(),
                figure: f.to_string(),
                before,
                after,
                change_pct,
                before_interval: bi,
                after_interval: ai,
                beyond_intervals: beyond,
                worse,
            });
        }
        // The machine: contention here and not there, the clock, the governor.
        let om = &o["machine"];
        if let Some(m) = &l.machine {
            let was = om["why"].as_array().is_some_and(|w| !w.is_empty());
            if m.contended() && !was {
                c.machine.push(format!(
                    "{} {} ran under contention in this run and not in the baseline: {}",
                    l.sweep,
                    l.level,
                    m.why.join("; ")
                ));
            } else if !m.contended() && was {
                c.machine.push(format!(
                    "{} {} ran under contention in the baseline and not in this run: {}",
                    l.sweep,
                    l.level,
                    om["why"].as_array().map(|w| w.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join("; ")).unwrap_or_default()
                ));
            }
            if let (Some(a), Some(b)) = (m.cpu_mhz_mean, om["cpu_mhz_mean"].as_f64())
                && (a - b).abs() > 0.1 * b
            {
                c.machine.push(format!("{} {}: CPU clock {:.2} GHz against {:.2} GHz in the baseline", l.sweep, l.level, a / 1e3, b / 1e3));
            }
            if let (Some(a), Some(b)) = (m.governor.as_deref(), om["governor"].as_str())
                && a != b
                && !c.machine.iter().any(|x| x.contains("governor"))
            {
                c.machine.push(format!("CPU governor {a} against {b} in the baseline"));
            }
        }
    }
    c
}

impl Comparison {
    pub fn changed(&self) -> impl Iterator<Item = &Change> {
        self.figures.iter().filter(|f| f.beyond_intervals)
    }

    /// Figures that got worse by more than `pct`%: beyond their intervals when both runs have
    /// them (a single run on either side is judged by the change alone).
    pub fn regressions(&self, pct: f64) -> Vec<&Change> {
        let judged = |f: &Change| f.before_interval.is_some() && f.after_interval.is_some();
        self.figures.iter().filter(|f| f.worse && f.change_pct.abs() > pct && (f.beyond_intervals || !judged(f))).collect()
    }

    /// The gate's verdict: None when it passes.
    pub fn gate(&self, pct: f64) -> Option<String> {
        let r = self.regressions(pct);
        if r.is_empty() {
            return None;
        }
        let what: Vec<String> = r
            .iter()
            .take(6)
            .map(|f| format!("{} {} {} {:.1} against {:.1} ({:+.0}%)", f.sweep, f.level, nice(&f.figure), f.after, f.before, f.change_pct))
            .collect();
        let machine = if self.machine.is_empty() {
            "no machine-state difference seen between the runs".to_string()
        } else {
            format!("the machine differed: {}", self.machine.join("; "))
        };
        Some(format!(
            "--fail-on-regression {pct}: {} figure(s) got worse by more than {pct}% against {}: {}{}; {machine}",
            r.len(),
            self.path,
            what.join("; "),
            if r.len() > 6 { format!(" and {} more", r.len() - 6) } else { String::new() }
        ))
    }

    pub fn words(&self) -> Vec<String> {
        let mut out = Vec::new();
        let judged = self.figures.iter().filter(|f| f.before_interval.is_some() && f.after_interval.is_some()).count();
        let changed: Vec<&Change> = self.changed().collect();
        let iv = |i: &Option<Interval>| i.as_ref().map(|i| format!(" [{:.1}, {:.1}]", i.lo, i.hi)).unwrap_or_default();
        if self.levels == 0 {
            out.push(format!("against the baseline {}: no level in common (nothing compared)", self.path));
        } else if judged == 0 {
            out.push(format!(
                "against the baseline {}: {} figures over {} levels, but single runs on one side or both: changes are listed in results.json, not judged (run both with --repeat 3 or more)",
                self.path, self.compared, self.levels
            ));
        } else if changed.is_empty() {
            out.push(format!(
                "against the baseline {}: no figure changed beyond its interval ({judged} compared over {} levels)",
                self.path, self.levels
            ));
        } else {
            let words: Vec<String> = changed
                .iter()
                .take(6)
                .map(|f| {
                    format!(
                        "{} {} {} {:.1}{} against {:.1}{} ({:+.0}%, {})",
                        f.sweep,
                        f.level,
                        nice(&f.figure),
                        f.after,
                        iv(&f.after_interval),
                        f.before,
                        iv(&f.before_interval),
                        f.change_pct,
                        if f.worse { "worse" } else { "better" }
                    )
                })
                .collect();
            let more = changed.len().saturating_sub(6);
            out.push(format!(
                "against the baseline {}: {} of {judged} figures changed beyond their intervals: {}{}",
                self.path,
                changed.len(),
                words.join("; "),
                if more > 0 { format!("; and {more} more") } else { String::new() }
            ));
        }
        out.extend(self.machine.iter().map(|m| format!("against the baseline: {m}")));
        out
    }
}
