//! `--baseline OLD/results.json`: this run's levels against an earlier run's, figure by figure.
//! A figure is called changed only when both runs have intervals (--repeat >= 2) and the
//! intervals are apart; single runs are listed with their change but not judged. The machine
//! state of both runs is compared too: a level that ran under contention here and not there, a
//! different governor or clock, is named beside the figures it may explain.
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::{
    machine::Machine,
    metrics::{Figure, INTERVAL_FIGURES, Level},
};
use crate::util::stats::Interval;

/// A figure is called changed only when it also moved by at least this much, %. Three runs'
/// intervals measure the spread inside one invocation, not the drift between two: identical sweeps
/// of an idle server, back to back on a 2-core VM, differed by 7% in output tokens/s at
/// concurrency 2 with intervals 0.1 wide, and by 10.6% in ITL p50 at concurrency 1 (12.4 ±0.3 ms,
/// then 11.1 ±0.7: CI, twice). A CPU hog moves the same figures by 50% and more.
pub const MIN_CHANGE_PCT: f64 = 20.0;

#[derive(Clone, Debug, Serialize)]
pub struct Change {
    pub sweep: crate::bench::metrics::Sweep,
    pub level: String,
    pub figure: Figure,
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

/// An earlier run: where its results.json is, and its levels as it wrote them.
#[derive(Clone, Debug)]
pub struct Baseline {
    pub path: PathBuf,
    pub levels: Vec<Level>,
}

/// The part of a results.json a comparison reads (the rest is not looked at).
#[derive(Deserialize)]
struct Earlier {
    levels: Option<Vec<Level>>,
}

/// The earlier run's results.json (the file, or the directory holding it).
pub fn load(path: &Path) -> anyhow::Result<Baseline> {
    let file = if path.is_dir() { path.join("results.json") } else { path.to_path_buf() };
    let bytes = std::fs::read(&file).with_context(|| format!("--baseline: cannot read {}", file.display()))?;
    let earlier: Earlier = match serde_json::from_slice(&bytes) {
        Ok(e) => e,
        // JSON, but its levels are not a probe bench run's.
        Err(e) if e.is_data() => Earlier { levels: None },
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context(format!("--baseline: {} is not a probe bench results.json (not JSON)", file.display()))
            );
        }
    };
    let Some(levels) = earlier.levels else {
        anyhow::bail!("--baseline: {} has no levels: not a probe bench results.json", file.display());
    };
    Ok(Baseline { path: file, levels })
}

pub fn nice(figure: Figure) -> &'static str {
    figure.nice()
}

pub fn compare(base: &Baseline, levels: &[Level]) -> Comparison {
    let mut c = Comparison {
        path: base.path.display().to_string(),
        compared: 0,
        levels: 0,
        unmatched: Vec::new(),
        figures: Vec::new(),
        machine: Vec::new(),
    };
    for l in levels {
        let Some(o) = base.levels.iter().find(|o| o.sweep == l.sweep && o.level == l.level) else {
            c.unmatched.push(format!("{} {}", l.sweep, l.level));
            continue;
        };
        c.levels += 1;
        for &f in INTERVAL_FIGURES {
            let (Some(before), Some(after)) = (o.figure(f), l.figure(f)) else { continue };
            let bi = o.intervals.get(f.name()).cloned();
            let ai = l.intervals.get(f.name()).cloned();
            let change_pct = if before.abs() > 1e-9 { (after - before) / before * 100.0 } else { 0.0 };
            // Apart, and by more than MIN_CHANGE_PCT: with few runs an interval can come out
            // narrow by chance, and a 1% shift between two tight intervals is not a regression.
            let beyond = matches!((&bi, &ai), (Some(b), Some(a)) if a.apart(b)) && change_pct.abs() >= MIN_CHANGE_PCT;
            let worse = if f.lower_is_better() { after > before } else { after < before };
            c.compared += 1;
            c.figures.push(Change {
                sweep: l.sweep,
                level: l.level.clone(),
                figure: f,
                before,
                after,
                change_pct,
                before_interval: bi,
                after_interval: ai,
                beyond_intervals: beyond,
                worse,
            });
        }
        if let Some(m) = &l.machine {
            c.machine.extend(machine_differences(l, m, o.machine.as_ref(), &c.machine));
        }
    }
    c
}

/// The machine: contention here and not there, the clock, the governor (`said`: the
/// differences already found, so that the governor is named once).
fn machine_differences(l: &Level, m: &Machine, om: Option<&Machine>, said: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let was = om.is_some_and(|o| o.contended());
    if m.contended() && !was {
        out.push(format!("{} {} ran under contention in this run and not in the baseline: {}", l.sweep, l.level, m.why.join("; ")));
    } else if !m.contended() && was {
        out.push(format!(
            "{} {} ran under contention in the baseline and not in this run: {}",
            l.sweep,
            l.level,
            om.map(|o| o.why.join("; ")).unwrap_or_default()
        ));
    }
    if let (Some(a), Some(b)) = (m.cpu_mhz_mean, om.and_then(|o| o.cpu_mhz_mean))
        && (a - b).abs() > 0.1 * b
    {
        out.push(format!("{} {}: CPU clock {:.2} GHz against {:.2} GHz in the baseline", l.sweep, l.level, a / 1e3, b / 1e3));
    }
    if let (Some(a), Some(b)) = (m.governor.as_deref(), om.and_then(|o| o.governor.as_deref()))
        && a != b
        && !said.iter().chain(&out).any(|x| x.contains("governor"))
    {
        out.push(format!("CPU governor {a} against {b} in the baseline"));
    }
    out
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
            .map(|f| format!("{} {} {} {:.1} against {:.1} ({:+.0}%)", f.sweep, f.level, nice(f.figure), f.after, f.before, f.change_pct))
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
                        nice(f.figure),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_earlier_results_json_is_read_typed_and_compared() {
        let dir = std::env::temp_dir().join(format!("probe-baseline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // An older file: fields missing, others unknown; only the levels are read.
        let old = r#"{"tool":"probe bench 0.0.1","levels":[{"sweep":"concurrency","level":"1","ttft_ms_p50":100.0,
            "throughput_output_tps":50.0,"machine":{"why":["other processes used 1.00 cores"],"governor":"powersave"},"new_field":1}]}"#;
        std::fs::write(dir.join("results.json"), old).unwrap();
        let b = load(&dir).unwrap();
        assert_eq!((b.levels.len(), b.levels[0].level.as_str(), b.levels[0].ttft_ms_p50), (1, "1", Some(100.0)));
        let now = Level {
            sweep: crate::bench::metrics::Sweep::Concurrency,
            level: "1".into(),
            ttft_ms_p50: Some(150.0),
            throughput_output_tps: Some(60.0),
            machine: Some(Machine { governor: Some("performance".into()), ..Default::default() }),
            ..Default::default()
        };
        let c = compare(&b, &[now]);
        assert_eq!((c.levels, c.compared), (1, 2));
        let worse: Vec<(Figure, bool)> = c.figures.iter().map(|f| (f.figure, f.worse)).collect();
        assert_eq!(worse, [(Figure::TtftMsP50, true), (Figure::ThroughputOutputTps, false)]);
        assert_eq!(c.machine.len(), 2, "{:?}", c.machine);
        assert!(c.machine[1].contains("governor performance against powersave"));
        std::fs::write(dir.join("results.json"), r#"{"levels": 3}"#).unwrap();
        assert!(format!("{:#}", load(&dir).unwrap_err()).contains("has no levels"));
        std::fs::write(dir.join("results.json"), "not json").unwrap();
        assert!(format!("{:#}", load(&dir).unwrap_err()).contains("(not JSON)"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
