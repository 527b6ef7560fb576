//! The warm baseline: each request set against this server's own warm requests of a similar
//! prompt size (in the trace, and the ones `probe watch` kept), and what that comparison says
//! about its slow cause.
use super::Request;
use crate::{analysis::verdict::SlowCause, stream::RequestRecord};

/// A request's prompt size for the warm baseline, as the work it was: the prompt tokens the
/// server computed (llama.cpp's `timings.prompt_n`, which leaves out the `cache_n` it reused;
/// Ollama's `prompt_eval_count`; OpenAI-style `usage.prompt_tokens` less
/// `prompt_tokens_details.cached_tokens`), else its prompt tokens when the server does not say
/// what it reused, else the request's bytes (a server that reports no tokens). A warm request
/// that reused most of its prompt is then the baseline for prompts that reused as much.
pub(crate) fn prompt_size(q: &RequestRecord) -> (u64, &'static str) {
    let t = q.stop.server_timings.as_ref();
    if let Some(n) = t.and_then(|t| t["prompt_n"].as_u64().or(t["prompt_eval_count"].as_u64())) {
        return (n, COMPUTED);
    }
    let u = q.stop.usage.as_ref();
    match u.and_then(|u| u["prompt_tokens"].as_u64()) {
        Some(n) => match u.and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64()) {
            Some(c) => (n.saturating_sub(c), COMPUTED),
            None => (n, "token"),
        },
        None => (q.request_bytes, "byte"),
    }
}

/// Two prompt sizes of one unit are alike: within 2× of each other, or within
/// [`ALIKE_TOKENS`] (a few tokens more or less are no more work on a small prompt).
pub(crate) fn similar_size(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= ALIKE_TOKENS || (a <= b.max(1) * 2 && b <= a.max(1) * 2)
}

const ALIKE_TOKENS: u64 = 16;

/// The unit of [`prompt_size`] for prompt tokens the server computed.
pub(crate) const COMPUTED: &str = "computed token";

/// "a 250-byte prompt", "240 computed prompt tokens".
pub(crate) fn size_words(size: u64, unit: &str) -> String {
    if unit == COMPUTED { format!("{size} computed prompt tokens") } else { format!("a {size}-{unit} prompt") }
}

/// Against this server's own warm requests in the trace: a request of a similar prompt size
/// (computed prompt tokens within 2× or 16 tokens: [`similar_size`]) whose verdict found nothing
/// but its own work. Each other request with a verdict
/// gets "N× this server's warm TTFT for a P-token prompt" when it took at least 1.5× their
/// median, or, when it has a slow cause and there is no such request, "no warm baseline in this
/// trace" (the absolute rules stand alone). More than 20% of a TTFT unexplained is a
/// data-quality line.
pub(crate) fn against_warm(requests: &mut [Request], kept: &[crate::record::records::Warm]) {
    let warm: Vec<(u64, (u64, &str), f64)> = requests
        .iter()
        .filter_map(|q| {
            let v = q.verdict.as_ref().filter(|_| !q.record.probe_poll)?;
            let ttft = q.record.ttft_ms.filter(|_| matches!(v.slow_cause, SlowCause::None | SlowCause::Compute))?;
            Some((q.record.id, prompt_size(&q.record), ttft))
        })
        .collect();
    for q in requests.iter_mut() {
        let (Some(ttft), Some(v)) = (q.record.ttft_ms.filter(|_| !q.record.probe_poll), q.verdict.as_mut()) else { continue };
        if let Some(s) = &v.ttft_ms
            && ttft > 0.0
            && s.unexplained > 0.2 * ttft
        {
            v.data_quality.push(format!("{:.0}% of the TTFT is unexplained ({:.0} ms)", s.unexplained * 100.0 / ttft, s.unexplained));
        }
        let (size, unit) = prompt_size(&q.record);
        // Sizes in the same unit only (tokens with tokens, bytes with bytes).
        let similar = |n: u64, u: &str| u == unit && similar_size(n, size);
        let mut peers: Vec<f64> = warm.iter().filter(|(id, (n, u), _)| *id != q.record.id && similar(*n, u)).map(|w| w.2).collect();
        let here = peers.len();
        peers.extend(kept.iter().filter(|k| similar(k.size, &k.unit)).map(|k| k.ttft_ms));
        if peers.is_empty() {
            if !matches!(v.slow_cause, SlowCause::None | SlowCause::Compute) {
                v.evidence.push(
                    "no warm baseline in this trace (no fast request of a similar prompt size): the cause rests on the absolute rules"
                        .into(),
                );
            }
            continue;
        }
        peers.sort_by(f64::total_cmp);
        let median = peers[peers.len() / 2];
        if median > 0.0 && ttft >= 1.5 * median {
            let of = match peers.len() - here {
                0 => format!("the median of {here} warm request(s) in this trace"),
                k if here == 0 => format!("the median of {k} warm request(s) probe watch kept from earlier sessions"),
                k => {
                    format!("the median of {} warm request(s): {here} in this trace, {k} probe watch kept from earlier sessions", here + k)
                }
            };
            v.evidence.push(format!("{:.1}× this server's warm TTFT for {} ({median:.0} ms, {of})", ttft / median, size_words(size, unit)));
            growth_is_contention(v, ttft, median);
            if v.slow_cause == SlowCause::None {
                beyond_warm(v, ttft - median);
            }
        }
    }
}

/// The server's own work grew over its warm baseline for as much work while other processes held
/// the CPUs its threads waited for: the growth is cpu_contention, not compute. A pool's threads
/// meet at a barrier after every step; one preempted by another process leaves the others spinning
/// (running, to the scheduler) or parked until it runs again, so the run-queue wait counts only
/// part of what the other process took. Growth under 20% (caches shared with the other job) stays
/// compute; without competitors (the CPUs were the server's) it is compute too. Contention in all
/// is at most what the others held (the sum of every server thread's waits they were charged
/// with): the pool is held back only while at least one of its threads waits for a CPU. Growth
/// past that has another cause (a request faulting its memory back in runs slower after it,
/// however little the others ran).
fn growth_is_contention(v: &mut crate::analysis::verdict::Verdict, ttft: f64, warm: f64) {
    const GREW: f64 = 1.2;
    let held: f64 = v.competitors.iter().map(|c| c.ms).sum();
    let Some(s) = v.ttft_ms.as_mut() else { return };
    if held < 10.0 || s.compute < GREW * warm {
        return;
    }
    let room = (held - s.cpu_contention).max(0.0);
    let moved = (s.compute - warm).min(ttft - warm).min(room).max(0.0);
    if moved < 1.0 {
        return;
    }
    s.compute -= moved;
    s.cpu_contention += moved;
    let names: Vec<String> = v.competitors.iter().take(3).map(|c| format!("{} {:.0} ms", c.who(), c.held())).collect();
    v.evidence.push(format!(
        "its own work took {:.0} ms against {warm:.0} ms warm for as much work, while other processes held the CPUs its threads waited for ({}): the {moved:.0} ms it grew is cpu_contention (a pool's threads wait at each step for a peer that another process preempted, spinning or parked)",
        s.compute + moved,
        names.join(", ")
    ));
    let (cause, ms) = s.largest_stall();
    if ms >= 0.25 * ttft && ms >= s.compute {
        v.slow_cause = cause;
    }
}

/// A request well over its warm baseline is not `none`: the part that explains at least half of
/// the excess is its cause (its own work, when that grew), else a data-quality line says that
/// nothing probe saw explains it.
fn beyond_warm(v: &mut crate::analysis::verdict::Verdict, excess: f64) {
    let Some(s) = &v.ttft_ms else { return };
    let (cause, ms) = s.largest_stall();
    if ms >= 0.5 * excess && ms >= s.compute {
        v.slow_cause = cause;
    } else if s.compute >= 0.5 * excess && s.unexplained < 0.5 * excess {
        v.slow_cause = SlowCause::Compute;
    } else {
        v.data_quality.push(format!(
            "{excess:.0} ms slower than this server's warm requests, and what probe saw explains under half of it ({:.0} ms unexplained)",
            s.unexplained
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The baseline compares work: a warm request that reused 230 of its 231 prompt tokens from
    /// the cache computed one, so it is no baseline for a request that computed all 231 (the
    /// demo's morning request read "12.5× this server's warm TTFT"); one that computed as many is.
    #[test]
    fn the_warm_baseline_counts_computed_prompt_tokens() {
        use crate::{analysis::verdict::Verdict, stream::payload::Stop};
        let mk = |id: u64, ttft: f64, timings: serde_json::Value| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(timings), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict { slow_cause: SlowCause::Compute, ttft_ms: Some(Default::default()), ..Default::default() }),
            engine: None,
        };
        let cached = mk(1, 79.0, serde_json::json!({"prompt_n": 1, "cache_n": 230}));
        let morning = mk(2, 986.0, serde_json::json!({"prompt_n": 231, "cache_n": 0}));
        let mut rs = vec![cached.clone(), morning.clone()];
        against_warm(&mut rs, &[]);
        assert!(rs[1].verdict.as_ref().unwrap().evidence.is_empty(), "{:?}", rs[1].verdict);
        // A warm request that computed 231 tokens in 300 ms is its baseline.
        let mut rs = vec![cached, morning, mk(3, 300.0, serde_json::json!({"prompt_n": 231, "cache_n": 0}))];
        rs[1].verdict.as_mut().unwrap().slow_cause = SlowCause::Load;
        against_warm(&mut rs, &[]);
        let said = &rs[1].verdict.as_ref().unwrap().evidence;
        assert!(said.iter().any(|e| e.starts_with("3.3× this server's warm TTFT for 231 computed prompt tokens (300 ms")), "{said:?}");
        // OpenAI-style usage: prompt tokens less the cached ones.
        let q = RequestRecord {
            stop: Stop {
                usage: Some(serde_json::json!({"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 480}})),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(prompt_size(&q), (20, COMPUTED));
    }

    /// A slow request is set against the same server's warm requests of a similar prompt size;
    /// with none, it says so.
    #[test]
    fn slow_requests_are_measured_against_the_warm_ones() {
        use crate::{
            analysis::verdict::{Split, Verdict},
            stream::payload::Stop,
        };
        let mk = |id: u64, ttft: f64, prompt_n: u64, cause: SlowCause, unexplained: f64| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(serde_json::json!({"prompt_n": prompt_n, "cache_n": 0})), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict { slow_cause: cause, ttft_ms: Some(Split { unexplained, ..Default::default() }), ..Default::default() }),
            engine: None,
        };
        let mut rs = vec![
            mk(1, 100.0, 250, SlowCause::None, 0.0),
            mk(2, 120.0, 240, SlowCause::Compute, 0.0),
            mk(3, 340.0, 250, SlowCause::CpuContention, 0.0),
            // Ten times the prompt: no peer.
            mk(4, 900.0, 2500, SlowCause::Disk, 300.0),
        ];
        against_warm(&mut rs, &[]);
        let said = |i: usize| rs[i].verdict.as_ref().unwrap().evidence.clone();
        assert!(
            said(2).iter().any(|e| e
                == "2.8× this server's warm TTFT for 250 computed prompt tokens (120 ms, the median of 2 warm request(s) in this trace)"),
            "{:?}",
            said(2)
        );
        assert!(said(3).iter().any(|e| e.starts_with("no warm baseline in this trace")), "{:?}", said(3));
        assert!(rs[3].verdict.as_ref().unwrap().data_quality.iter().any(|d| d == "33% of the TTFT is unexplained (300 ms)"));
        // The warm ones are near their own baseline: nothing said.
        assert!(said(0).is_empty() && said(1).is_empty(), "{:?} {:?}", said(0), said(1));
        // Far over it with no cause by the absolute rules: not none. Queue explains the excess
        // in one; nothing does in the other.
        let mut queued = mk(5, 400.0, 250, SlowCause::None, 0.0);
        let split = queued.verdict.as_mut().unwrap().ttft_ms.as_mut().unwrap();
        (split.queue, split.compute) = (200.0, 110.0);
        let mut rs2 = vec![
            mk(1, 100.0, 250, SlowCause::None, 0.0),
            mk(2, 120.0, 240, SlowCause::Compute, 0.0),
            queued,
            mk(6, 500.0, 250, SlowCause::None, 350.0),
        ];
        against_warm(&mut rs2, &[]);
        assert_eq!(rs2[2].verdict.as_ref().unwrap().slow_cause, SlowCause::Queue);
        let v = rs2[3].verdict.as_ref().unwrap();
        assert_eq!(v.slow_cause, SlowCause::None);
        assert!(v.data_quality.iter().any(|d| d.contains("380 ms slower than this server's warm requests")), "{:?}", v.data_quality);
    }

    /// Per-token time that grew over the warm baseline while other processes held the CPUs is
    /// cpu_contention (a pool spinning at barriers for a preempted peer); the same growth on
    /// CPUs nobody else held is the server's own work.
    #[test]
    fn grown_work_beside_other_processes_is_contention() {
        use crate::{
            analysis::verdict::{Competitor, Split, Verdict},
            stream::payload::Stop,
        };
        let mk = |id: u64, ttft: f64, split: Split, held: f64| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(serde_json::json!({"prompt_n": 280, "cache_n": 0})), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict {
                slow_cause: SlowCause::Compute,
                ttft_ms: Some(split),
                competitors: if held > 0.0 {
                    vec![Competitor { pid: 42, comm: Some("backup".into()), cgroup: None, ms: held, held_ms: None }]
                } else {
                    vec![]
                },
                ..Default::default()
            }),
            engine: None,
        };
        let warm = || mk(1, 800.0, Split { compute: 800.0, ..Default::default() }, 0.0);
        let warm2 = || mk(1, 50.0, Split { compute: 50.0, ..Default::default() }, 0.0);
        // The critical path waited 815 ms; the pool's threads 2900 ms in all.
        let busy = mk(2, 3560.0, Split { compute: 2745.0, cpu_contention: 815.0, ..Default::default() }, 2900.0);
        let mut rs = vec![warm(), busy.clone()];
        against_warm(&mut rs, &[]);
        let v = rs[1].verdict.as_ref().unwrap();
        let s = v.ttft_ms.as_ref().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (800.0, 2760.0), "{v:?}");
        assert_eq!(v.slow_cause, SlowCause::CpuContention);
        assert!(
            v.evidence.iter().any(|e| e.contains("the 1945 ms it grew is cpu_contention") && e.contains("backup (pid 42)")),
            "{:?}",
            v.evidence
        );
        // Others held the CPUs 13 ms in all while the request faulted its memory back in from swap
        // and ran slower after: 13 ms is contention at most, the rest stays its own work (CI: the
        // whole growth was called contention, and the verdict lost `memory`).
        let mut swapped = mk(4, 490.0, Split { compute: 267.0, memory: 220.0, cpu_contention: 12.0, ..Default::default() }, 12.7);
        swapped.verdict.as_mut().unwrap().slow_cause = SlowCause::Memory;
        let mut rs = vec![warm2(), swapped];
        against_warm(&mut rs, &[]);
        let v = rs[1].verdict.as_ref().unwrap();
        assert_eq!(v.slow_cause, SlowCause::Memory, "{v:?}");
        assert!(v.ttft_ms.as_ref().unwrap().cpu_contention <= 12.7 + 1e-9, "{v:?}");
        // Nobody else held the CPUs: the growth stays the server's own work.
        let alone = mk(3, 3560.0, Split { compute: 3560.0, ..Default::default() }, 0.0);
        let mut rs = vec![warm(), alone];
        against_warm(&mut rs, &[]);
        let s = rs[1].verdict.as_ref().unwrap().ttft_ms.clone().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (3560.0, 0.0));
        // Under 20% grown: caches shared with the other job, still compute.
        let near = mk(4, 1300.0, Split { compute: 900.0, cpu_contention: 400.0, ..Default::default() }, 400.0);
        let mut rs = vec![warm(), near];
        against_warm(&mut rs, &[]);
        let s = rs[1].verdict.as_ref().unwrap().ttft_ms.clone().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (900.0, 400.0));
    }
}
