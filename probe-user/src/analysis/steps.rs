//! The engine's own view of each request: llama.cpp's decode steps (probe_common::engine) joined
//! to the requests seen on the wire.
//!
//! **Runs.** A sequence's run is the steps it takes part in for one request. A run of sequence S
//! (in one context) begins at a step holding tokens of S when, since S's previous step, the cache
//! dropped S's tail (`llama_memory_seq_rm` of S or of every sequence: llama-server does this as
//! it loads each prompt, keeping the cached prefix), or when other steps ran without S (the slot
//! sat idle). The run's first step and the steps right after it in which S has more than one
//! token are its prompt; the rest are its decode steps.
//!
//! **Matching.** Requests in arrival order each take the first unclaimed run that begins after
//! their arrival and before their last byte: of the sequence the wire names (llama-server's
//! `id_slot`, on its native endpoint), else of any sequence (first come, first served: the
//! order servers start prompts in).
use std::collections::{BTreeMap, HashMap};

use probe_common::engine::{
    ENGINE_CLEAR, ENGINE_CONTEXT_INIT, ENGINE_DECODE, ENGINE_MODEL_LOAD, ENGINE_PROCESS, ENGINE_SEQ_RM, EngineEvent, SEQS,
};
use serde::{Deserialize, Serialize};

/// One decode step, as the report keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub begin: u64,
    pub end: u64,
    pub tid: u32,
    pub ctx: u64,
    pub ret: i32,
    pub n_tokens: u32,
    /// (sequence, tokens, position end or 0), sequences with tokens only.
    pub seqs: Vec<(u32, u32, u32)>,
    /// Tokens of sequences beyond [`SEQS`], or not read (a classic batch over its scan limit).
    pub other_tokens: u32,
    /// The batch's sequences were read (false: a build whose batch probe does not read).
    pub composition: bool,
}

impl Step {
    /// Sequences in the step (those beyond the ones told apart count as one).
    pub fn n_seqs(&self) -> u32 {
        self.seqs.len() as u32 + u32::from(self.other_tokens > 0 && self.composition)
    }
    fn tokens_of(&self, seq: u32) -> u32 {
        self.seqs.iter().find(|s| s.0 == seq).map_or(0, |s| s.1)
    }
    fn ms(&self) -> f64 {
        self.end.saturating_sub(self.begin) as f64 / 1e6
    }
}

/// What the engine probe recorded, in time order.
#[derive(Clone, Debug, Default)]
pub struct Log {
    pub steps: Vec<Step>,
    /// (time, context, sequence, p0, p1).
    pub seq_rm: Vec<(u64, u64, i32, i32, i32)>,
    pub clears: Vec<u64>,
    /// (what, begin, end, succeeded).
    pub inits: Vec<(u32, u64, u64, bool)>,
}

impl Log {
    pub fn add(&mut self, e: &EngineEvent) {
        match e.what {
            ENGINE_DECODE | ENGINE_PROCESS => {
                // llama_process(type 0) encodes: not a decode step.
                if e.what == ENGINE_PROCESS && e.arg == 0 {
                    return;
                }
                let seqs = (0..SEQS)
                    .filter(|&s| e.seq_tokens[s] > 0)
                    .map(|s| (s as u32, u32::from(e.seq_tokens[s]), e.seq_pos_end[s]))
                    .collect::<Vec<_>>();
                self.steps.push(Step {
                    begin: e.begin_ns,
                    end: e.hdr.ts_ns,
                    tid: e.hdr.tid,
                    ctx: e.ctx,
                    ret: e.ret as i32,
                    n_tokens: e.n_tokens,
                    composition: e.scanned > 0 || e.n_tokens == 0,
                    other_tokens: e.other_tokens,
                    seqs,
                });
            }
            ENGINE_SEQ_RM => self.seq_rm.push((e.begin_ns, e.ctx, e.seq, e.p0, e.p1)),
            ENGINE_CLEAR => self.clears.push(e.hdr.ts_ns),
            ENGINE_MODEL_LOAD | ENGINE_CONTEXT_INIT => self.inits.push((e.what, e.begin_ns, e.hdr.ts_ns, e.ret != 0)),
            _ => {}
        }
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.seq_rm.is_empty() && self.clears.is_empty() && self.inits.is_empty()
    }

    /// Sort by time (events arrive in end order from several threads).
    pub fn finish(&mut self) {
        self.steps.sort_by_key(|s| s.begin);
        self.seq_rm.sort_by_key(|s| s.0);
        self.clears.sort_unstable();
        self.inits.sort_by_key(|i| i.1);
    }

    /// Every run, in order of its first step.
    pub fn runs(&self) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        // Open run per (context, sequence): its index in `runs`, and the last step it was in.
        let mut open: HashMap<(u64, u32), (usize, usize)> = HashMap::new();
        // Each sequence's KV length as the steps and removals left it.
        let mut kv: HashMap<(u64, u32), u32> = HashMap::new();
        // Removals since a sequence's last step: the prefix kept, and whether it cut into the
        // sequence's tokens (`p0` below its length) rather than at its end.
        let mut cuts: HashMap<u32, (u32, bool)> = HashMap::new();
        let mut cut_all: Option<(u32, bool)> = None;
        let mut rm = self.seq_rm.iter().peekable();
        let mut clears = self.clears.iter().peekable();
        for (i, st) in self.steps.iter().enumerate() {
            // A whole-cache clear: every sequence starts over, and what ran before was thrown
            // away (a warm-up run after a model load, not a request's).
            while clears.next_if(|&&t| t <= st.begin).is_some() {
                for (_, (r, _)) in open.drain() {
                    runs[r].cleared = true;
                }
                kv.clear();
                cuts.clear();
                cut_all = Some((0, true));
            }
            while let Some(&&(t, _mem, seq, p0, p1)) = rm.peek() {
                if t > st.begin {
                    break;
                }
                rm.next();
                // A removal of a middle range is a context shift, not a new prompt.
                if p1 >= 0 {
                    continue;
                }
                let p0 = p0.max(0) as u32;
                // llama_memory_seq_rm takes the memory, not the context: it applies to the
                // sequence in every context (one per server, as a rule).
                let len = kv.iter().filter(|(k, _)| seq < 0 || k.1 == seq as u32).map(|(_, v)| *v).max();
                let cut = (p0, len.is_none_or(|l| p0 < l));
                if seq < 0 {
                    cut_all = Some(cut);
                    cuts.clear();
                } else {
                    cuts.insert(seq as u32, cut);
                }
            }
            for &(seq, tokens, pos_end) in &st.seqs {
                let key = (st.ctx, seq);
                let cut = cuts.remove(&seq).or(cut_all);
                // A removal at the sequence's end begins a run when a prompt batch follows (a
                // binding that trims the cache before every step removes nothing).
                let cut = cut.filter(|&(_, strict)| strict || tokens > 1);
                let idle = open.get(&key).is_some_and(|&(_, last)| last + 1 < i && self.steps[last + 1..i].iter().any(|s| s.ctx == st.ctx));
                let begins = !open.contains_key(&key) || cut.is_some() || idle;
                let before = match cut {
                    Some((p0, _)) => Some(p0),
                    None => kv.get(&key).copied(),
                };
                let after = if pos_end > 0 { Some(pos_end) } else { before.map(|k| k + tokens) };
                if let Some(a) = after {
                    kv.insert(key, a);
                } else {
                    kv.remove(&key);
                }
                if begins {
                    runs.push(Run {
                        ctx: st.ctx,
                        seq,
                        steps: vec![i],
                        prompt_steps: 1,
                        prompt_tokens: tokens,
                        cached: cut.map(|c| c.0),
                        kv_len: after,
                        cleared: false,
                    });
                    open.insert(key, (runs.len() - 1, i));
                } else if let Some(&(r, _)) = open.get(&key) {
                    let run = &mut runs[r];
                    let in_prompt = run.prompt_steps == run.steps.len() && tokens > 1;
                    run.steps.push(i);
                    if in_prompt {
                        run.prompt_steps += 1;
                        run.prompt_tokens += tokens;
                    }
                    run.kv_len = after;
                    open.insert(key, (r, i));
                }
            }
            cut_all = None;
        }
        runs
    }
}

/// A sequence's steps for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub ctx: u64,
    pub seq: u32,
    /// Indexes into [`Log::steps`].
    pub steps: Vec<usize>,
    pub prompt_steps: usize,
    pub prompt_tokens: u32,
    /// Prompt tokens the cache kept (the p0 of the drop that began the run).
    pub cached: Option<u32>,
    /// The KV length at its last step: positions read from the batch, or the kept prefix plus
    /// the tokens since.
    pub kv_len: Option<u32>,
    /// The whole cache was cleared after it: with no decode step, a warm-up (llama.cpp decodes
    /// once after loading a model, then clears), never a request's.
    pub cleared: bool,
}

/// A request as the engine served it (report.json `requests[].engine`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RequestEngine {
    /// The sequence (llama-server's slot) that served it, and how it was matched.
    pub seq: u32,
    /// `id_slot` (the wire named the slot) or `order` (first unclaimed run after arrival).
    pub matched_by: String,
    /// Arrival to the start of its first prompt batch.
    pub queue_ms: f64,
    /// Prompt tokens the engine processed (the cached prefix is not processed again).
    pub prompt_tokens: u32,
    /// Prompt tokens the cache kept, when the engine said (llama-server drops the rest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
    /// Start of its first prompt batch to the end of its last.
    pub prompt_ms: f64,
    /// Steps after the prompt: one per generated token but the first.
    pub decode_steps: u32,
    /// Sequences per step while it decoded (1: alone).
    pub mean_batch_seqs: f64,
    pub step_ms_p50: f64,
    pub step_ms_p99: f64,
    /// Its steps that carried other sequences too (prompt and decode).
    pub shared_steps: u32,
    /// Time in the steps it was part of, and its share by tokens (its tokens / the step's).
    pub steps_ms: f64,
    pub compute_share_ms: f64,
    /// The KV length at its last step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_len: Option<u32>,
    /// Steps that failed (llama.cpp's return code ≠ 0: 1 no KV slot, 2 aborted, < 0 errors).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_steps: u32,
}

impl RequestEngine {
    /// One line for the text summary and report.html.
    pub fn words(&self) -> String {
        let cached = self.cached_tokens.filter(|&c| c > 0).map(|c| format!(" ({c} cached)")).unwrap_or_default();
        let kv = self.kv_len.map(|k| format!(", KV {k} tokens at the end")).unwrap_or_default();
        let failed = if self.failed_steps > 0 { format!(", {} steps failed", self.failed_steps) } else { String::new() };
        format!(
            "engine: queued {:.0} ms, prompt {} tokens{cached} in {:.0} ms, {} decode steps (batch {:.1} sequences, {} shared; step p50 {:.1} ms, p99 {:.1} ms){kv}{failed}",
            self.queue_ms,
            self.prompt_tokens,
            self.prompt_ms,
            self.decode_steps,
            self.mean_batch_seqs,
            self.shared_steps,
            self.step_ms_p50,
            self.step_ms_p99,
        )
    }
}

impl EngineSummary {
    pub fn words(&self) -> String {
        let init = if self.runtime_init_ms.is_empty() {
            String::new()
        } else {
            format!("; runtime init {} ms", self.runtime_init_ms.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" + "))
        };
        format!(
            "{} decode steps, {:.1} sequences a step, step p50 {:.1} ms, p99 {:.1} ms; cache: {} cleared, {} sequence removals{init}",
            self.steps, self.mean_batch_seqs, self.step_ms_p50, self.step_ms_p99, self.cache_clears, self.seq_removals
        )
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The engine over the whole trace (report.json `engine`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineSummary {
    pub steps: u64,
    pub mean_batch_seqs: f64,
    pub step_ms_p50: f64,
    pub step_ms_p99: f64,
    /// Cache drops: whole-cache clears and sequence removals.
    pub cache_clears: u64,
    pub seq_removals: u64,
    /// Model loads and context creations seen (begin to end, ms each).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runtime_init_ms: Vec<f64>,
    /// Step time against the KV length: (KV length bucket start, steps, p50 ms), decode steps of
    /// one sequence only, so that the batch size does not blur it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_ms_by_kv: Vec<(u32, u64, f64)>,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One request to match: arrival and last byte (ns), the slot the wire named, and the prompt
/// tokens the server said it computed (llama.cpp `timings.prompt_n`).
pub struct Want {
    pub arrival: u64,
    pub until: u64,
    pub slot: Option<u32>,
    pub prompt_tokens: Option<u32>,
}

/// Match requests (in arrival order) to runs; each request's engine view.
pub fn join(log: &Log, wants: &[Want]) -> Vec<Option<RequestEngine>> {
    let runs = log.runs();
    let mut claimed = vec![false; runs.len()];
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| wants[i].arrival);
    let mut out = vec![None; wants.len()];
    for i in order {
        let w = &wants[i];
        let start = |r: &Run| log.steps[r.steps[0]].begin;
        // The first unclaimed run that began while the request was open; of those, one that
        // computed as many prompt tokens as the server said this request did (one slot, requests
        // read in another order than the server took them: the earliest run is another's).
        let pick = |by_slot: bool| {
            let mut fits = runs.iter().enumerate().filter(|(k, r)| {
                // Not claimed, and not a warm-up the cache clear threw away.
                let warm_up = r.cleared && r.steps.len() == r.prompt_steps;
                !claimed[*k] && !warm_up && start(r) >= w.arrival && start(r) <= w.until && (!by_slot || Some(r.seq) == w.slot)
            });
            let first = fits.clone().next();
            w.prompt_tokens.and_then(|n| fits.find(|(_, r)| r.prompt_tokens == n)).or(first)
        };
        let (k, how) = match w.slot.and_then(|_| pick(true)) {
            Some((k, _)) => (k, "id_slot"),
            None => match pick(false) {
                Some((k, _)) => (k, "order"),
                None => continue,
            },
        };
        claimed[k] = true;
        out[i] = Some(view(log, &runs[k], w.arrival, how));
    }
    out
}

fn view(log: &Log, run: &Run, arrival: u64, how: &str) -> RequestEngine {
    let steps: Vec<&Step> = run.steps.iter().map(|&i| &log.steps[i]).collect();
    let prompt = &steps[..run.prompt_steps];
    let decode = &steps[run.prompt_steps..];
    let mut step_ms: Vec<f64> = decode.iter().map(|s| s.ms()).collect();
    let share: f64 = steps.iter().map(|s| s.ms() * f64::from(s.tokens_of(run.seq)) / f64::from(s.n_tokens.max(1))).sum();
    RequestEngine {
        seq: run.seq,
        matched_by: how.to_string(),
        queue_ms: r3(prompt[0].begin.saturating_sub(arrival) as f64 / 1e6),
        prompt_tokens: run.prompt_tokens,
        cached_tokens: run.cached,
        prompt_ms: r3(prompt.last().map_or(0, |s| s.end).saturating_sub(prompt[0].begin) as f64 / 1e6),
        decode_steps: decode.len() as u32,
        mean_batch_seqs: if decode.is_empty() {
            0.0
        } else {
            r3(decode.iter().map(|s| f64::from(s.n_seqs())).sum::<f64>() / decode.len() as f64)
        },
        step_ms_p50: r3(pct(&mut step_ms, 0.5)),
        step_ms_p99: r3(pct(&mut step_ms, 0.99)),
        shared_steps: steps.iter().filter(|s| s.n_seqs() > 1).count() as u32,
        steps_ms: r3(steps.iter().map(|s| s.ms()).sum()),
        compute_share_ms: r3(share),
        kv_len: run.kv_len,
        failed_steps: steps.iter().filter(|s| s.ret != 0).count() as u32,
    }
}

/// The whole trace's engine summary.
pub fn summary(log: &Log) -> EngineSummary {
    let mut ms: Vec<f64> = log.steps.iter().map(Step::ms).collect();
    let seqs: f64 = log.steps.iter().map(|s| f64::from(s.n_seqs())).sum();
    // Step time by KV length: decode steps (one token) of a lone sequence, in buckets of 256.
    let mut by_kv: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for run in log.runs() {
        let mut kv = run.cached.unwrap_or(0);
        for (n, &i) in run.steps.iter().enumerate() {
            let s = &log.steps[i];
            let own = s.tokens_of(run.seq);
            let pos = s.seqs.iter().find(|x| x.0 == run.seq).map_or(0, |x| x.2);
            kv = if pos > 0 { pos } else { kv + own };
            if n >= run.prompt_steps && s.n_seqs() == 1 && s.n_tokens == 1 && (pos > 0 || run.cached.is_some()) {
                by_kv.entry(kv / 256 * 256).or_default().push(s.ms());
            }
        }
    }
    EngineSummary {
        steps: log.steps.len() as u64,
        mean_batch_seqs: if log.steps.is_empty() { 0.0 } else { r3(seqs / log.steps.len() as f64) },
        step_ms_p50: r3(pct(&mut ms, 0.5)),
        step_ms_p99: r3(pct(&mut ms, 0.99)),
        cache_clears: log.clears.len() as u64,
        seq_removals: log.seq_rm.len() as u64,
        runtime_init_ms: log.inits.iter().map(|i| r3(i.2.saturating_sub(i.1) as f64 / 1e6)).collect(),
        step_ms_by_kv: by_kv.into_iter().map(|(k, mut v)| (k, v.len() as u64, r3(pct(&mut v, 0.5)))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(t: u64, seqs: &[(u32, u32)]) -> EngineEvent {
        let mut e = EngineEvent { what: ENGINE_PROCESS, arg: 1, begin_ns: t, ctx: 7, ..Default::default() };
        e.hdr.ts_ns = t + 10_000_000;
        for &(s, n) in seqs {
            e.seq_tokens[s as usize] = n as u16;
            e.n_tokens += n;
        }
        e.scanned = e.n_tokens;
        e
    }

    #[test]
    fn a_warm_up_run_thrown_away_by_a_clear_is_no_requests() {
        let mut log = Log::default();
        // A model load's warm-up (one step, then the cache cleared), then the request's prompt.
        log.add(&step(10 * MS, &[(0, 2)]));
        log.add(&EngineEvent {
            what: ENGINE_CLEAR,
            begin_ns: 25 * MS,
            hdr: probe_common::EventHeader { ts_ns: 25 * MS, ..Default::default() },
            ..Default::default()
        });
        log.add(&step(30 * MS, &[(0, 7)]));
        log.add(&step(40 * MS, &[(0, 1)]));
        log.finish();
        let e = join(&log, &[Want { arrival: 0, until: 100 * MS, slot: Some(0), prompt_tokens: None }])[0].clone().unwrap();
        assert_eq!((e.prompt_tokens, e.decode_steps, e.queue_ms), (7, 1, 30.0));
    }

    fn rm(t: u64, seq: i32, p0: i32) -> EngineEvent {
        EngineEvent { what: ENGINE_SEQ_RM, begin_ns: t, ctx: 9, seq, p0, p1: -1, ..Default::default() }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn two_requests_share_steps_and_a_third_reuses_a_slot() {
        let mut log = Log::default();
        // Request A (slot 0) at 0 ms: prompt 20 tokens at 5 ms, then decodes; B (slot 1) at 12 ms:
        // prompt 30 tokens in the step at 25 ms, decoding beside A after that.
        log.add(&rm(4 * MS, 0, 3));
        log.add(&step(5 * MS, &[(0, 20)]));
        log.add(&step(15 * MS, &[(0, 1)]));
        log.add(&rm(24 * MS, 1, 0));
        log.add(&step(25 * MS, &[(0, 1), (1, 30)]));
        log.add(&step(35 * MS, &[(0, 1), (1, 1)]));
        log.add(&step(45 * MS, &[(1, 1)]));
        // C on slot 0 again at 50 ms, its prefix of 10 tokens cached.
        log.add(&rm(59 * MS, 0, 10));
        log.add(&step(60 * MS, &[(0, 5)]));
        log.add(&step(70 * MS, &[(0, 1)]));
        log.finish();
        let wants = [
            Want { arrival: 0, until: 40 * MS, slot: None, prompt_tokens: None },
            Want { arrival: 12 * MS, until: 50 * MS, slot: Some(1), prompt_tokens: None },
            Want { arrival: 50 * MS, until: 80 * MS, slot: None, prompt_tokens: None },
        ];
        let got = join(&log, &wants);
        let a = got[0].as_ref().unwrap();
        assert_eq!((a.seq, a.prompt_tokens, a.decode_steps, a.shared_steps, a.cached_tokens), (0, 20, 3, 2, Some(3)));
        assert_eq!(a.queue_ms, 5.0);
        assert_eq!(a.kv_len, Some(3 + 20 + 3));
        assert!((a.mean_batch_seqs - 5.0 / 3.0).abs() < 1e-3, "{a:?}");
        let b = got[1].as_ref().unwrap();
        assert_eq!((b.seq, b.matched_by.as_str(), b.prompt_tokens, b.decode_steps, b.queue_ms), (1, "id_slot", 30, 2, 13.0));
        let c = got[2].as_ref().unwrap();
        assert_eq!((c.seq, c.prompt_tokens, c.cached_tokens, c.decode_steps, c.kv_len), (0, 5, Some(10), 1, Some(16)));
        // Its share of a step shared 30:1 is a thirty-first.
        assert!((a.compute_share_ms - (10.0 + 10.0 + 10.0 / 31.0 + 5.0)).abs() < 1e-2, "{a:?}");
    }

    /// One slot, two requests read in the other order than served: each gets the run that
    /// computed its own prompt (the server's prompt_n), not the first after its arrival.
    #[test]
    fn the_run_that_computed_the_prompt_is_the_request_s() {
        let mut log = Log::default();
        log.add(&step(10 * MS, &[(0, 30)]));
        log.add(&step(20 * MS, &[(0, 1)]));
        log.add(&rm(29 * MS, 0, 0));
        log.add(&step(30 * MS, &[(0, 12)]));
        log.add(&step(40 * MS, &[(0, 1)]));
        log.finish();
        // B arrived first (at 0) but was served second (12 prompt tokens); A came at 1 ms.
        let wants = [
            Want { arrival: 0, until: 50 * MS, slot: None, prompt_tokens: Some(12) },
            Want { arrival: MS, until: 25 * MS, slot: None, prompt_tokens: Some(30) },
        ];
        let got = join(&log, &wants);
        assert_eq!(got.iter().map(|e| e.as_ref().map(|e| e.prompt_tokens)).collect::<Vec<_>>(), [Some(12), Some(30)]);
        assert_eq!(got[0].as_ref().unwrap().queue_ms, 30.0);
    }

    #[test]
    fn an_idle_slot_begins_a_new_run_without_a_cache_drop() {
        let mut log = Log::default();
        log.add(&step(0, &[(0, 8)]));
        log.add(&step(10 * MS, &[(0, 1)]));
        log.add(&step(20 * MS, &[(1, 4)]));
        log.add(&step(30 * MS, &[(0, 6)]));
        log.finish();
        let runs = log.runs();
        assert_eq!(runs.iter().map(|r| (r.seq, r.steps.len(), r.prompt_tokens)).collect::<Vec<_>>(), [(0, 2, 8), (1, 1, 4), (0, 1, 6)]);
        // A request that arrives after every run begins gets none.
        assert!(join(&log, &[Want { arrival: 40 * MS, until: 50 * MS, slot: None, prompt_tokens: None }])[0].is_none());
    }

    #[test]
    fn a_binding_that_trims_the_cache_before_every_step_keeps_one_run() {
        // llama-cpp-python: seq_rm(-1, n_past, -1) before each eval; classic batches carry positions.
        let mut log = Log::default();
        let classic = |t: u64, n: u32, pos0: u32| {
            let mut e = step(t, &[(0, n)]);
            e.what = ENGINE_DECODE;
            e.seq_pos_end[0] = pos0 + n;
            e
        };
        log.add(&rm(MS, -1, 0));
        log.add(&classic(2 * MS, 9, 0));
        for k in 0..5u32 {
            log.add(&rm((20 + 10 * k as u64) * MS, -1, (9 + k) as i32));
            log.add(&classic((21 + 10 * k as u64) * MS, 1, 9 + k));
        }
        // The next request keeps 8 of its 9 prompt tokens: a cut into the sequence.
        log.add(&rm(100 * MS, -1, 8));
        log.add(&classic(101 * MS, 1, 8));
        log.add(&rm(120 * MS, -1, 9));
        log.add(&classic(121 * MS, 1, 9));
        log.finish();
        let runs = log.runs();
        assert_eq!(
            runs.iter().map(|r| (r.steps.len(), r.prompt_tokens, r.cached, r.kv_len)).collect::<Vec<_>>(),
            [(6, 9, Some(0), Some(14)), (2, 1, Some(8), Some(10))]
        );
    }
}
