//! Conclusions in words, pure: what changed between levels of a sweep (output length, TTFT,
//! errors) and the stop reasons and verdicts that explain it, e.g. "output length falls at
//! concurrency 4: 4 of 4 requests stopped at a server-imposed limit (256-token slot context), not EOS".
use crate::bench::metrics::Sweep;
use std::collections::BTreeMap;

use super::metrics::{Level, Row, RowStop, ServerLimit};

/// Human names of normalized stop reasons (a results.json key, read at the edge).
pub fn stop_words(stop: &str) -> &'static str {
    use crate::analysis::verdict::StopCause as C;
    match stop.parse::<RowStop>() {
        Ok(RowStop::Cause(C::Eos)) => "at EOS",
        Ok(RowStop::Cause(C::RequestedLimit)) => "at the requested limit",
        Ok(RowStop::Cause(C::ServerLimit)) => "at a server-imposed limit",
        Ok(RowStop::Cause(C::StopWord)) => "at a stop word",
        Ok(RowStop::Cause(C::ClientDisconnect)) => "because the client left",
        Ok(RowStop::Cause(C::Deadline)) => "at the client deadline",
        Ok(RowStop::Cause(C::ServerError)) => "with a server error",
        Ok(RowStop::Rejected) => "rejected by the server",
        _ => "for an unknown reason",
    }
}

/// Whether a results.json stop key is a normal end (EOS or the requested limit).
fn normal_stop(stop: &str) -> bool {
    use crate::analysis::verdict::StopCause as C;
    matches!(stop.parse::<RowStop>(), Ok(RowStop::Cause(C::Eos | C::RequestedLimit)))
}

fn most(m: &BTreeMap<String, u64>) -> Option<(&str, u64)> {
    m.iter().max_by_key(|(_, n)| **n).map(|(k, n)| (k.as_str(), *n))
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.0} ms")).unwrap_or_else(|| "n/a".into())
}

/// Why requests at a level stopped short: the leading non-normal stop reason with its count.
fn short_stop(l: &Level, slot_ctx: Option<u64>) -> Option<String> {
    let abnormal: BTreeMap<String, u64> = l.stops.iter().filter(|(k, _)| !normal_stop(k)).map(|(k, v)| (k.clone(), *v)).collect();
    let (stop, n) = most(&abnormal)?;
    let pool = l.server_limits.get(ServerLimit::KvPool.name()).copied().unwrap_or(0);
    let server_limit = matches!(stop.parse::<RowStop>(), Ok(RowStop::Cause(crate::analysis::verdict::StopCause::ServerLimit)));
    let ctx = match (server_limit, slot_ctx) {
        (true, Some(c)) if pool * 2 > n => {
            format!(" (the KV pool the slots share ran out, well below the {c}-token slot context)")
        }
        (true, Some(c)) => format!(" ({c}-token slot context)"),
        _ => String::new(),
    };
    Some(format!("{n} of {} requests stopped {}{ctx}, not EOS", l.requests, stop_words(stop)))
}

fn verdicts(l: &Level) -> String {
    let slow = |k: &str| k.parse::<crate::analysis::verdict::SlowCause>() != Ok(crate::analysis::verdict::SlowCause::None);
    match most(&l.slow_causes.iter().filter(|(k, _)| slow(k)).map(|(k, v)| (k.clone(), *v)).collect()) {
        Some((cause, n)) => format!("; traced: {n} of {} first tokens were slow for {cause}", l.requests),
        None if !l.slow_causes.is_empty() => "; traced: no slow cause beyond normal work".into(),
        None => String::new(),
    }
}

/// Conclusions for every sweep present, in sweep order.
pub fn conclude(levels: &[Level], rows: &[Row], slot_ctx: Option<u64>) -> Vec<String> {
    let mut out = Vec::new();
    for sweep in super::SWEEPS {
        let ls: Vec<&Level> = levels.iter().filter(|l| l.sweep == sweep).collect();
        if ls.is_empty() {
            continue;
        }
        match sweep {
            Sweep::Concurrency => concurrency(&ls, slot_ctx, &mut out),
            Sweep::Prompt => prompt(&ls, rows, slot_ctx, &mut out),
            Sweep::Rate => rate(&ls, rows, &mut out),
            Sweep::Prefix => prefix(&ls, &mut out),
            Sweep::Multiturn => multiturn(&ls, rows, &mut out),
            Sweep::Idle => idle(&ls, rows, &mut out),
        }
    }
    out
}

fn rate(ls: &[&Level], rows: &[Row], out: &mut Vec<String>) {
    for l in ls {
        let sent: Vec<f64> = {
            let mut v: Vec<f64> = rows.iter().filter(|r| r.seq == l.seq).map(|r| r.sent_ms).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let achieved = if sent.len() >= 2 { (sent.len() - 1) as f64 * 1e3 / (sent[sent.len() - 1] - sent[0]).max(1e-9) } else { 0.0 };
        out.push(format!(
            "rate {}: sent at {achieved:.2} requests/s, served {:.2} requests/s; TTFT median {}, p99 {}, TPOT {}; stops: {}",
            l.rate_rps.map_or("?".into(), |r| format!("{r}/s")),
            l.request_rate.unwrap_or(0.0),
            ms(l.ttft_ms_p50),
            ms(l.ttft_ms_p99),
            ms(l.tpot_ms_mean),
            mix(l)
        ));
    }
}

fn prefix(ls: &[&Level], out: &mut Vec<String>) {
    for l in ls {
        out.push(match (l.cached_tokens_mean, l.reuse_pct) {
            (Some(c), Some(p)) => format!(
                "shared prefix at concurrency {}: after the first request the server reused {c:.0} cached prompt tokens on average ({p:.0}% of the prompt); TTFT median {}",
                l.level,
                ms(l.ttft_ms_p50)
            ),
            _ => format!(
                "shared prefix at concurrency {}: the server reported no cached-token counts (no usage.prompt_tokens_details or timings.cache_n); TTFT median {}",
                l.level,
                ms(l.ttft_ms_p50)
            ),
        });
    }
}

fn multiturn(ls: &[&Level], rows: &[Row], out: &mut Vec<String>) {
    for l in ls {
        // Per turn: TTFTs, prompt tokens, cached tokens.
        type Turn = (Vec<f64>, Vec<f64>, Vec<f64>);
        let mut by_turn: BTreeMap<u64, Turn> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.seq == l.seq) {
            let e = by_turn.entry(r.turn.unwrap_or(0)).or_default();
            e.0.extend(r.ttft_ms);
            e.1.extend(r.prompt_tokens.map(|n| n as f64));
            e.2.extend(r.cached_tokens.map(|n| n as f64));
        }
        let m = |v: &[f64]| super::metrics::mean(v).map_or("?".into(), |x| format!("{x:.0}"));
        let turns: Vec<String> = by_turn
            .iter()
            .map(|(t, (ttft, p, c))| format!("turn {t}: {} prompt tokens ({} cached), TTFT {} ms", m(p), m(c), m(ttft)))
            .collect();
        out.push(format!("multi-turn, {} conversation(s) at once: {}", l.level, turns.join("; ")));
    }
}

fn concurrency(ls: &[&Level], slot_ctx: Option<u64>, out: &mut Vec<String>) {
    let base = ls[0];
    if ls.len() == 1 {
        out.push(format!(
            "concurrency {} only (nothing to compare): {} output tokens on average, TTFT median {}; stop reasons: {}",
            base.level,
            base.output_tokens_mean.map_or("?".into(), |o| format!("{o:.0}")),
            ms(base.ttft_ms_p50),
            mix(base)
        ));
        out.extend(short_stop(base, slot_ctx).map(|s| format!("at concurrency {}: {s}", base.level)));
        return;
    }
    let base_out = base.output_tokens_mean.unwrap_or(0.0);
    let mut changed = false;
    for l in &ls[1..] {
        let o = l.output_tokens_mean.unwrap_or(0.0);
        // With intervals (--repeat), a change inside the noise is never called one.
        let out_differs = l.differs(base, super::metrics::Figure::OutputTokensMean, |_, _| true);
        if base_out > 0.0 && o < 0.9 * base_out && out_differs {
            changed = true;
            let why =
                short_stop(l, slot_ctx).unwrap_or_else(|| format!("stop reasons unchanged ({}): the model chose shorter answers", mix(l)));
            out.push(format!(
                "output length falls at concurrency {}: {o:.0} tokens on average against {base_out:.0} at {}; {why}",
                l.level, base.level
            ));
        } else if l.errors + l.rejected + l.deadline_hits > 0 && base.errors + base.rejected + base.deadline_hits == 0 {
            changed = true;
            out.push(format!("errors appear at concurrency {}: {}", l.level, short_stop(l, slot_ctx).unwrap_or_else(|| mix(l))));
        }
        if let (Some(a), Some(b)) = (base.ttft_ms_p50, l.ttft_ms_p50)
            && b > 2.0 * a
            && b - a >= 20.0
            && l.differs(base, super::metrics::Figure::TtftMsP50, |_, _| true)
        {
            changed = true;
            out.push(format!(
                "TTFT rises at concurrency {}: median {}{} against {}{} at {}{}",
                l.level,
                ms(Some(b)),
                interval(l, "ttft_ms_p50"),
                ms(Some(a)),
                interval(base, "ttft_ms_p50"),
                base.level,
                verdicts(l)
            ));
        }
    }
    if !changed {
        out.push(format!(
            "concurrency {}..{}: output length and TTFT hold ({:.0}..{:.0} tokens); stop reasons at {}: {}",
            base.level,
            ls[ls.len() - 1].level,
            ls.iter().filter_map(|l| l.output_tokens_mean).fold(f64::INFINITY, f64::min),
            ls.iter().filter_map(|l| l.output_tokens_mean).fold(0.0, f64::max),
            base.level,
            mix(base)
        ));
    }
    let base_short = short_stop(base, slot_ctx);
    if let Some(s) = base_short {
        out.push(format!("already at concurrency {}: {s}", base.level));
    }
}

/// " (95% interval 380-420 ms over 3 runs)", when the level has one for the figure.
fn interval(l: &Level, figure: &str) -> String {
    l.intervals.get(figure).map(|i| format!(" (95% interval {:.0}-{:.0} ms over {} runs)", i.lo, i.hi, i.n)).unwrap_or_default()
}

/// The load a level puts on the server, for ordering: concurrency, or the arrival rate.
fn load(l: &Level) -> f64 {
    l.rate_rps.unwrap_or(l.concurrency as f64)
}

fn load_words(l: &Level) -> String {
    match l.rate_rps {
        Some(r) => format!("{r} requests/s"),
        None => format!("concurrency {}", l.concurrency),
    }
}

/// Goodput against the --slo bounds, per sweep that puts load on the server: the highest load
/// whose goodput stays at or above `pct`% of its requests, and where it falls below.
pub fn goodput(levels: &[Level], slo: super::metrics::Slo, pct: f64) -> Vec<String> {
    let mut out = Vec::new();
    if slo.is_empty() {
        return out;
    }
    for sweep in [Sweep::Concurrency, Sweep::Rate, Sweep::Prefix, Sweep::Multiturn] {
        let mut ls: Vec<&Level> = levels.iter().filter(|l| l.sweep == sweep && l.goodput_pct.is_some()).collect();
        if ls.is_empty() {
            continue;
        }
        ls.sort_by(|a, b| load(a).total_cmp(&load(b)));
        let good: Vec<&&Level> = ls.iter().filter(|l| l.goodput_pct.unwrap_or(0.0) >= pct).collect();
        let first_bad = ls.iter().find(|l| l.goodput_pct.unwrap_or(0.0) < pct);
        let g = |l: &Level| {
            format!(
                "{:.0}% of requests, {:.2} req/s, {:.1} tok/s",
                l.goodput_pct.unwrap_or(0.0),
                l.goodput_rps.unwrap_or(0.0),
                l.goodput_tps.unwrap_or(0.0)
            )
        };
        let s = match (good.iter().map(|l| **l).max_by(|a, b| load(a).total_cmp(&load(b))), first_bad) {
            (Some(best), None) => {
                format!("goodput ({}): at or above {pct:.0}% at every level up to {} ({})", slo.words(), load_words(best), g(best))
            }
            (Some(best), Some(bad)) => format!(
                "goodput ({}): the highest load at or above {pct:.0}% is {} ({}); at {} it is {}",
                slo.words(),
                load_words(best),
                g(best),
                load_words(bad),
                g(bad)
            ),
            (None, Some(bad)) => {
                format!("goodput ({}): below {pct:.0}% already at {} ({})", slo.words(), load_words(bad), g(bad))
            }
            (None, None) => continue,
        };
        out.push(format!("{sweep} sweep {s}"));
    }
    out
}

/// Levels that ran under contention: their figures are not the server's alone.
pub fn contention(levels: &[Level]) -> Vec<String> {
    levels
        .iter()
        .filter_map(|l| {
            let m = l.machine.as_ref().filter(|m| m.contended())?;
            Some(format!("{} {} ran under contention ({}): its figures are not the server's alone", l.sweep, l.level, m.why.join("; ")))
        })
        .collect()
}

/// "3 eos, 1 server_limit"
pub fn mix(l: &Level) -> String {
    l.stops.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join(", ")
}

fn prompt(ls: &[&Level], rows: &[Row], slot_ctx: Option<u64>, out: &mut Vec<String>) {
    for l in ls {
        let bucket = l.bucket_tokens.unwrap_or(0);
        if l.rejected == l.requests && l.requests > 0 {
            let status = rows.iter().find(|r| r.seq == l.seq).and_then(|r| r.status).unwrap_or(0);
            let ctx = slot_ctx.map(|c| format!(": longer than the {c}-token slot context")).unwrap_or_default();
            out.push(format!("prompt bucket {bucket} was rejected by the server (HTTP {status}){ctx}"));
        } else if l.concurrency == 1 {
            out.push(format!(
                "prompt bucket {bucket} ({} prompt tokens) at 1 user: TTFT {}, prompt {} tok/s, output {} tok/s{}",
                l.prompt_tokens_mean.map_or("?".into(), |n| format!("{n:.0}")),
                ms(l.ttft_ms_p50),
                l.prompt_tps_mean.map_or("n/a".into(), |x| format!("{x:.0}")),
                l.output_tps_mean.map_or("n/a".into(), |x| format!("{x:.0}")),
                short_stop(l, slot_ctx).map(|s| format!("; {s}")).unwrap_or_default()
            ));
        } else if let Some(one) = ls.iter().find(|o| o.bucket_tokens == l.bucket_tokens && o.concurrency == 1) {
            if let (Some(a), Some(b)) = (one.ttft_ms_p50, l.ttft_ms_p50)
                && b > 1.5 * a
                && b - a >= 20.0
            {
                out.push(format!(
                    "prompt bucket {bucket}: TTFT rises from {} at 1 user to {} at {}{}",
                    ms(Some(a)),
                    ms(Some(b)),
                    l.concurrency,
                    verdicts(l)
                ));
            }
            if let Some(s) = short_stop(l, slot_ctx).filter(|_| short_stop(one, slot_ctx).is_none()) {
                out.push(format!("prompt bucket {bucket} at concurrency {}: {s}", l.concurrency));
            }
        }
    }
}

/// The traced split of a level's first tokens (means over its rows), largest parts first.
fn split_words(rows: &[Row], l: &Level) -> Option<String> {
    let splits: Vec<_> = rows.iter().filter(|r| r.seq == l.seq).filter_map(|r| r.verdict.as_ref()?.ttft_ms.clone()).collect();
    if splits.is_empty() {
        return None;
    }
    let n = splits.len() as f64;
    let avg = |g: &dyn Fn(&crate::analysis::verdict::Split) -> f64| splits.iter().map(g).sum::<f64>() / n;
    let mut parts = [
        ("disk", avg(&|s| s.disk)),
        ("load", avg(&|s| s.load)),
        ("memory", avg(&|s| s.memory)),
        ("cpu_contention", avg(&|s| s.cpu_contention)),
        ("queue", avg(&|s| s.queue)),
        ("compute", avg(&|s| s.compute)),
        ("unexplained", avg(&|s| s.unexplained)),
    ];
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    let words: Vec<String> = parts.iter().filter(|p| p.1 >= 1.0).map(|(k, v)| format!("{k} {v:.0} ms")).collect();
    (!words.is_empty()).then(|| words.join(", "))
}

fn idle(ls: &[&Level], rows: &[Row], out: &mut Vec<String>) {
    // The reference: the shortest interval's TTFT when the intervals differ, else the best.
    let shortest = ls.iter().filter_map(|l| l.idle_s).fold(f64::INFINITY, f64::min);
    let refs: Vec<&&Level> = ls.iter().filter(|l| l.idle_s == Some(shortest)).collect();
    let distinct = ls.iter().any(|l| l.idle_s != Some(shortest));
    let base = if distinct {
        refs.iter().filter_map(|l| l.ttft_ms_p50).fold(f64::INFINITY, f64::min)
    } else {
        ls.iter().filter_map(|l| l.ttft_ms_p50).fold(f64::INFINITY, f64::min)
    };
    let base_label = if distinct { refs.first().map(|l| format!("after {}", l.level)).unwrap_or_default() } else { "at best".into() };
    for l in ls {
        let Some(t) = l.ttft_ms_p50 else {
            out.push(format!("after {} idle: no first token ({})", l.level, mix(l)));
            continue;
        };
        let mut s = if t > 3.0 * base && t - base >= 50.0 {
            format!("after {} idle the first token took {} against {} {base_label}", l.level, ms(Some(t)), ms(Some(base)))
        } else {
            format!("after {} idle: TTFT {}", l.level, ms(Some(t)))
        };
        s.push_str(&verdicts(l));
        if let Some(w) = split_words(rows, l).filter(|_| {
            l.slow_causes.keys().any(|k| k.parse::<crate::analysis::verdict::SlowCause>() != Ok(crate::analysis::verdict::SlowCause::None))
        }) {
            s.push_str(&format!(" ({w})"));
        }
        for n in l.notes.iter().filter(|n| n.contains("page cache")) {
            s.push_str(&format!("; {n}"));
        }
        out.push(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analysis::verdict::Split, bench::metrics::RowVerdict};

    fn level(sweep: &str, name: &str, out: f64, stops: &[(&str, u64)], ttft: f64) -> Level {
        Level {
            sweep: sweep.parse().unwrap(),
            level: name.into(),
            concurrency: name.parse().unwrap_or(1),
            requests: stops.iter().map(|s| s.1).sum(),
            output_tokens_mean: Some(out),
            stops: stops.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ttft_ms_p50: Some(ttft),
            ..Default::default()
        }
    }

    #[test]
    fn falling_output_is_explained_by_its_stop_reason() {
        let ls = vec![
            level("concurrency", "1", 300.0, &[("requested_limit", 4)], 20.0),
            level("concurrency", "4", 120.0, &[("server_limit", 3), ("requested_limit", 1)], 25.0),
        ];
        let c = conclude(&ls, &[], Some(256));
        assert_eq!(
            c,
            vec![
                "output length falls at concurrency 4: 120 tokens on average against 300 at 1; 3 of 4 requests stopped at a server-imposed limit (256-token slot context), not EOS"
            ]
        );
        let mut pooled = ls.clone();
        pooled[1].server_limits.insert("kv_pool".into(), 3);
        let c = conclude(&pooled, &[], Some(1024));
        assert!(c[0].ends_with("3 of 4 requests stopped at a server-imposed limit (the KV pool the slots share ran out, well below the 1024-token slot context), not EOS"), "{c:?}");
    }

    #[test]
    fn steady_levels_say_so_and_rising_ttft_names_the_verdict() {
        let mut l4 = level("concurrency", "4", 64.0, &[("eos", 4)], 400.0);
        l4.slow_causes.insert("queue".into(), 3);
        l4.slow_causes.insert("none".into(), 1);
        let ls = vec![level("concurrency", "1", 64.0, &[("eos", 4)], 20.0), l4];
        let c = conclude(&ls, &[], None);
        assert_eq!(
            c,
            vec!["TTFT rises at concurrency 4: median 400 ms against 20 ms at 1; traced: 3 of 4 first tokens were slow for queue"]
        );
        let steady = vec![level("concurrency", "1", 64.0, &[("eos", 2)], 20.0), level("concurrency", "2", 63.0, &[("eos", 2)], 22.0)];
        assert_eq!(
            conclude(&steady, &[], None),
            vec!["concurrency 1..2: output length and TTFT hold (63..64 tokens); stop reasons at 1: 2 eos"]
        );
    }

    #[test]
    fn rejected_buckets_and_idle_penalties() {
        let mut b = level("prompt", "16384 @1", 0.0, &[("rejected", 1)], 0.0);
        b.bucket_tokens = Some(16384);
        b.rejected = 1;
        b.ttft_ms_p50 = None;
        let rows =
            vec![Row { sweep: crate::bench::metrics::Sweep::Prompt, level: "16384 @1".into(), status: Some(400), ..Default::default() }];
        assert_eq!(
            conclude(&[b], &rows, Some(1024)),
            vec!["prompt bucket 16384 was rejected by the server (HTTP 400): longer than the 1024-token slot context"]
        );
        let mut cold = level("idle", "5s", 8.0, &[("requested_limit", 1)], 700.0);
        cold.idle_s = Some(5.0);
        cold.slow_causes.insert("disk".into(), 1);
        cold.notes.push("model file 0% in the page cache before the request".into());
        let mut warm = level("idle", "0s", 8.0, &[("requested_limit", 1)], 20.0);
        warm.idle_s = Some(0.0);
        let split = Split { disk: 600.0, compute: 40.0, unexplained: 60.0, ..Default::default() };
        cold.seq = 1;
        let rows = vec![Row {
            sweep: crate::bench::metrics::Sweep::Idle,
            level: "5s".into(),
            seq: 1,
            verdict: Some(RowVerdict { ttft_ms: Some(split), slow_cause: crate::analysis::verdict::SlowCause::Disk, ..Default::default() }),
            ..Default::default()
        }];
        let c = conclude(&[warm, cold], &rows, None);
        assert_eq!(c[0], "after 0s idle: TTFT 20 ms");
        assert_eq!(
            c[1],
            "after 5s idle the first token took 700 ms against 20 ms after 0s; traced: 1 of 1 first tokens were slow for disk (disk 600 ms, unexplained 60 ms, compute 40 ms); model file 0% in the page cache before the request"
        );
    }
}
