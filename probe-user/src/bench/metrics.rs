//! The benchmark's records and their arithmetic, pure: one [`Row`] per request, stop reasons
//! normalized, per-request TTFT/ITL/TPOT/E2E, and per-level summaries ([`Level`]) with pooled
//! percentiles, throughput and goodput. Definitions follow `vllm bench serve` (see DEFINITIONS).
use std::collections::BTreeMap;

use serde::Serialize;

use super::client::Exchange;
use crate::analysis::verdict::{SlowCause, Split, StopCause};

crate::closed_set! {
    /// Which experiment a level belongs to (`--sweep`).
    #[derive(clap::ValueEnum)]
    Sweep {
        /// The same prompts at rising concurrency (--levels).
        #[default]
        Concurrency = "concurrency",
        /// Prompt-length buckets (--buckets), one user then rising concurrency (--prompt-levels).
        Prompt = "prompt",
        /// A fixed short prompt after each idle interval (--idle), with optional layers.
        Idle = "idle",
        /// Open-loop Poisson arrivals at each --rate (requests/s), not a fixed concurrency.
        Rate = "rate",
        /// Requests sharing a long system prompt (--prefix-tokens), the server's prompt cache on:
        /// the cached tokens each request reuses, per --levels concurrency.
        Prefix = "prefix",
        /// Conversations whose turns grow (--turns), each turn carrying the history; --levels
        /// conversations at once.
        Multiturn = "multiturn",
    }
}

/// How a benchmark response ended: the verdict's stop causes (one classifier, `crate::analysis::verdict`),
/// and `rejected`, a 4xx answer before any token, which only the client sees as such.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RowStop {
    Cause(StopCause),
    Rejected,
}

impl Default for RowStop {
    fn default() -> Self {
        RowStop::Cause(StopCause::Unknown)
    }
}

impl RowStop {
    pub fn name(self) -> &'static str {
        match self {
            RowStop::Cause(c) => c.name(),
            RowStop::Rejected => "rejected",
        }
    }
}

impl std::fmt::Display for RowStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RowStop {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "rejected" { Ok(RowStop::Rejected) } else { s.parse().map(RowStop::Cause) }
    }
}

impl Serialize for RowStop {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The definitions every output states.
pub const DEFINITIONS: &[(&str, &str)] = &[
    ("TTFT", "time to first token: request sent -> first streamed message carrying content, client side (ms)"),
    ("E2E", "end-to-end latency: request sent -> last response byte (ms)"),
    (
        "ITL",
        "inter-token latency: gaps between consecutive content messages; level percentiles pool every gap of every request (as vllm bench serve does) (ms)",
    ),
    ("TPOT", "time per output token after the first: (E2E - TTFT) / (output tokens - 1), per request, then averaged (ms)"),
    (
        "output tokens",
        "usage.completion_tokens, else timings.predicted_n (llama.cpp), else eval_count (Ollama), else counted content messages; each row says which",
    ),
    ("prompt tok/s", "prompt tokens / the server's prompt time (timings.prompt_ms or prompt_eval_duration), else prompt tokens / TTFT"),
    ("output tok/s", "per request: (output tokens - 1) / (E2E - TTFT); per level (throughput): all output tokens / the level's wall time"),
    (
        "goodput",
        "requests (goodput_rps) and output tokens (goodput_tps) per second of the level's wall time from requests that completed without error and met every --slo bound (ttft, tpot, e2e; no bound = only 'completed'); goodput_pct: those requests as a share of all the level's requests",
    ),
    (
        "interval",
        "with --repeat N (N >= 2): each figure's mean over the N runs of a level and its 95% confidence interval, mean +/- t(0.975, N-1) * sd / sqrt(N) (Student's t; an interval of the mean, not a prediction for one run). Levels or runs whose intervals overlap are never called different",
    ),
    (
        "cached tokens",
        "prompt tokens the server took from its prompt cache: usage.prompt_tokens_details.cached_tokens, else timings.cache_n (llama.cpp); reuse_pct = cached / prompt tokens, over the level's requests after its first",
    ),
    (
        "contended",
        "a level run during which other processes (not the server's, not probe's) used at least 0.5 CPU on average (/proc/PID/stat), or memory pressure (PSI some) stalled tasks for at least 10% of the time",
    ),
    (
        "queue",
        "with a trace: the verdict's queue share of TTFT (waiting while other requests were served); servers do not report a per-request queue time in their streams",
    ),
];

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RowVerdict {
    /// The trace directory and the request's id in its report.json.
    pub trace: String,
    pub request_id: u64,
    pub slow_cause: SlowCause,
    pub stop_cause: StopCause,
    pub ttft_ms: Option<Split>,
    pub evidence: Vec<String>,
    /// The engine's own view of the request (llama.cpp's steps), when the engine probe saw it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::analysis::steps::RequestEngine>,
}

/// One request of the benchmark. No prompt or response text: the prompt's hash and token count.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Row {
    pub sweep: crate::bench::metrics::Sweep,
    /// The level's label: concurrency ("4"), bucket ("2048 @1"), idle interval ("10s").
    pub level: String,
    pub concurrency: u64,
    pub bucket_tokens: Option<u64>,
    pub idle_s: Option<f64>,
    /// Idle layers applied before this request: restart, drop_cache, keep_warm.
    pub layers: Vec<String>,
    pub index: u64,
    pub prompt_hash: String,
    pub prompt_tokens: Option<u64>,
    /// server | tokenizer | estimate (4 characters a token)
    pub prompt_tokens_source: String,
    pub max_tokens: u64,
    pub output_tokens: u64,
    pub output_tokens_source: String,
    /// The server's own words: finish_reason, stop_type or done_reason.
    pub finish_reason: Option<String>,
    pub truncated: Option<bool>,
    /// eos | requested_limit | server_limit | stop_word | client_disconnect | deadline | server_error | rejected | unknown
    pub stop: RowStop,
    pub stop_detail: String,
    /// For server_limit: which limit, by the tokens in the slot: "slot_context" (prompt + output
    /// reached the slot's context) or "kv_pool" (they stopped well below it: a KV pool shared by
    /// the slots ran out).
    pub server_limit: Option<String>,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_max_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub queue_ms: Option<f64>,
    /// The server's prompt processing time.
    pub prompt_ms: Option<f64>,
    /// The server's own time per output token (llama.cpp `timings.predicted_per_token_ms`).
    pub server_tpot_ms: Option<f64>,
    pub prompt_tps: Option<f64>,
    pub output_tps: Option<f64>,
    pub deadline_hit: bool,
    pub disconnected: bool,
    /// When it was sent, ms from the start of the benchmark.
    pub sent_ms: f64,
    pub local_port: Option<u16>,
    pub server_pid: Option<u32>,
    pub process_age_s: Option<f64>,
    pub server_rss_mib: Option<f64>,
    /// Share of the model file in the page cache just before the request (idle sweep).
    pub model_resident_pct: Option<f64>,
    /// Prompt tokens served from the server's prompt cache (see DEFINITIONS).
    pub cached_tokens: Option<u64>,
    /// Met every --slo bound (None: it did not complete).
    pub met_slo: Option<bool>,
    /// Multi-turn workload: the conversation and its turn (1-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<u64>,
    /// Which repeat of its level (0-based; --repeat) and that run's position in `runs`.
    pub repeat: u64,
    pub run_seq: usize,
    pub verdict: Option<RowVerdict>,
    #[serde(skip)]
    pub itl: Vec<f64>,
    /// Which level (its position in the run's `levels`) this row belongs to.
    #[serde(rename = "level_seq")]
    pub seq: usize,
}

pub use crate::stream::payload::context_exceeded;

/// Normalize the stop: what ended this response, and a sentence with the numbers behind it.
pub fn normalize_stop(x: &Exchange, output: u64, max_tokens: u64, slot_ctx: Option<u64>) -> (RowStop, String) {
    use StopCause::*;
    let c = RowStop::Cause;
    let s = &x.stop;
    let ctx = slot_ctx.map(|n| format!(" ({n}-token slot context)")).unwrap_or_default();
    let err = x.error_message.clone().or_else(|| s.error.as_ref().map(|e| e.to_string())).unwrap_or_default();
    if x.deadline_hit {
        return (c(Deadline), format!("the client deadline passed after {output} tokens"));
    }
    if x.aborted {
        return (c(ClientDisconnect), format!("the client left (Ctrl-C) after {output} tokens"));
    }
    if let Some(st) = x.status.filter(|&c| c >= 400) {
        return if (400..500).contains(&st) {
            (RowStop::Rejected, format!("rejected by the server: HTTP {st} {err}").trim_end().to_string())
        } else if context_exceeded(&err) {
            (c(ServerLimit), format!("HTTP {st} before any token: {err}{ctx}"))
        } else {
            (c(ServerError), format!("HTTP {st} {err}").trim_end().to_string())
        };
    }
    if let Some(e) = &x.transport_error
        && x.status.is_none()
    {
        return (c(ServerError), e.clone());
    }
    if !err.is_empty() {
        return if context_exceeded(&err) {
            (c(ServerLimit), format!("server-imposed limit{ctx}: stopped with \"{err}\" after {output} of {max_tokens} tokens"))
        } else {
            (c(ServerError), format!("mid-stream error after {output} tokens: {err}"))
        };
    }
    if x.disconnected && !x.complete {
        return (c(ServerError), format!("the server closed the connection after {output} tokens, before the response ended"));
    }
    if s.truncated == Some(true) {
        return (c(ServerLimit), format!("server-imposed limit{ctx}: truncated after {output} of {max_tokens} tokens (context ran out)"));
    }
    match crate::analysis::verdict::server_word(s, output, Some(max_tokens)) {
        Some(ServerLimit) => (c(ServerLimit), format!("server-imposed limit{ctx}: length after {output} of {max_tokens} requested tokens")),
        Some(RequestedLimit) => (c(RequestedLimit), format!("the requested limit ({max_tokens} tokens)")),
        Some(StopWord) => (c(StopWord), format!("a stop word after {output} tokens")),
        Some(Eos) => (c(Eos), format!("end of sequence after {output} tokens")),
        _ => (c(Unknown), format!("no stop information after {output} tokens")),
    }
}

crate::closed_set! {
    /// Which server limit stopped a response (a row's `server_limit`).
    ServerLimit {
        #[default]
        SlotContext = "slot_context",
        KvPool = "kv_pool",
    }
}

/// Which server limit stopped a response: the slot's own context when prompt + output filled at
/// least 90% of it, else a KV pool shared between slots (llama-server --kv-unified, vLLM).
pub fn which_limit(prompt_tokens: Option<u64>, output: u64, slot_ctx: Option<u64>) -> Option<ServerLimit> {
    let (p, c) = (prompt_tokens?, slot_ctx?);
    Some(if (p + output) * 10 >= c * 9 { ServerLimit::SlotContext } else { ServerLimit::KvPool })
}

pub use crate::util::stats::{mean, percentile};

/// Per-request latency numbers from the content arrival times.
pub fn fill_latency(row: &mut Row, x: &Exchange) {
    row.ttft_ms = x.ttft_ms;
    row.e2e_ms = x.e2e_ms;
    row.itl = x.content_ms.windows(2).map(|w| w[1] - w[0]).collect();
    row.itl_p50_ms = percentile(&row.itl, 50.0);
    row.itl_max_ms = row.itl.iter().copied().reduce(f64::max);
    if let (Some(t), Some(e)) = (x.ttft_ms, x.e2e_ms)
        && row.output_tokens > 1
        && e > t
    {
        row.tpot_ms = Some((e - t) / (row.output_tokens - 1) as f64);
        row.output_tps = Some((row.output_tokens - 1) as f64 / ((e - t) / 1e3));
    }
    row.prompt_tps = match (row.prompt_tokens, row.prompt_ms, row.ttft_ms) {
        (Some(n), Some(ms), _) if ms > 0.0 => Some(n as f64 / (ms / 1e3)),
        (Some(n), None, Some(t)) if t > 0.0 => Some(n as f64 / (t / 1e3)),
        _ => None,
    };
}

/// One level of one sweep, summarized (written to results.json, and read back from an earlier
/// run's as a baseline: a field an older file lacks is left at its default).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Level {
    pub sweep: crate::bench::metrics::Sweep,
    pub level: String,
    pub concurrency: u64,
    pub bucket_tokens: Option<u64>,
    pub idle_s: Option<f64>,
    pub requests: u64,
    pub ok: u64,
    pub rejected: u64,
    pub errors: u64,
    pub deadline_hits: u64,
    pub disconnects: u64,
    pub prompt_tokens_mean: Option<f64>,
    pub output_tokens_mean: Option<f64>,
    pub output_tokens_min: Option<u64>,
    pub output_tokens_max: Option<u64>,
    pub stops: BTreeMap<String, u64>,
    /// Server limits by kind (see Row::server_limit).
    pub server_limits: BTreeMap<String, u64>,
    pub ttft_ms_mean: Option<f64>,
    pub ttft_ms_p50: Option<f64>,
    pub ttft_ms_p99: Option<f64>,
    pub itl_ms_p50: Option<f64>,
    pub itl_ms_p99: Option<f64>,
    pub tpot_ms_mean: Option<f64>,
    pub e2e_ms_mean: Option<f64>,
    pub prompt_tps_mean: Option<f64>,
    pub output_tps_mean: Option<f64>,
    pub throughput_output_tps: Option<f64>,
    pub request_rate: Option<f64>,
    pub goodput_rps: Option<f64>,
    pub goodput_tps: Option<f64>,
    pub goodput_pct: Option<f64>,
    /// Arrival rate asked for (rate sweep), requests/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_rps: Option<f64>,
    /// Prompt-cache reuse (see DEFINITIONS): mean cached tokens and their share of the prompt
    /// over the level's requests after its first.
    pub cached_tokens_mean: Option<f64>,
    pub reuse_pct: Option<f64>,
    pub duration_s: f64,
    /// How many runs (--repeat) the level's figures pool.
    pub runs: u64,
    /// Each figure's mean over the runs and its 95% interval (see DEFINITIONS), with --repeat >= 2.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub intervals: BTreeMap<String, crate::util::stats::Interval>,
    /// The machine while the level ran (means over its runs).
    pub machine: Option<super::machine::Machine>,
    /// A run of the level ran under contention (see DEFINITIONS and machine.why).
    pub contended: bool,
    /// Traced verdicts: slow causes by count.
    pub slow_causes: BTreeMap<String, u64>,
    /// The engine's steps while the level ran (traced, llama.cpp): sequences per decode step,
    /// the decode step's median time and the KV length at the requests' last steps (means over
    /// the level's requests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_batch_seqs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_step_ms_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_kv_len: Option<f64>,
    pub counters_before: BTreeMap<String, f64>,
    pub counters_after: BTreeMap<String, f64>,
    /// Highest value of each counter sampled while the level ran.
    pub counters_peak: BTreeMap<String, f64>,
    pub notes: Vec<String>,
    /// Its position in the run (rows carry it as level_seq).
    #[serde(rename = "level_seq")]
    pub seq: usize,
}

/// Count the traced slow causes of each level's rows (verdicts arrive when a trace stops);
/// `key` says which level a row belongs to (its pooled level's seq, or its run's).
pub fn tally_verdicts(levels: &mut [Level], rows: &[Row], key: fn(&Row) -> usize) {
    for l in levels.iter_mut() {
        l.slow_causes.clear();
        let mut engine = Vec::new();
        for r in rows.iter().filter(|r| key(r) == l.seq) {
            if let Some(v) = &r.verdict {
                *l.slow_causes.entry(v.slow_cause.name().to_string()).or_insert(0) += 1;
                engine.extend(v.engine.as_ref().filter(|e| e.decode_steps > 0));
            }
        }
        let of = |g: &dyn Fn(&crate::analysis::steps::RequestEngine) -> Option<f64>| {
            mean(&engine.iter().filter_map(|e| g(e)).collect::<Vec<_>>())
        };
        l.engine_batch_seqs = of(&|e| Some(e.mean_batch_seqs));
        l.engine_step_ms_p50 = of(&|e| Some(e.step_ms_p50));
        l.engine_kv_len = of(&|e| e.kv_len.map(f64::from));
    }
}

/// Goodput targets (ms); None = no target on that metric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl Slo {
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2e_ms.is_none()
    }

    /// A completed request met every bound (a one-token answer has no TPOT to miss).
    pub fn met(&self, r: &Row) -> bool {
        self.ttft_ms.is_none_or(|t| r.ttft_ms.is_some_and(|x| x <= t))
            && self.tpot_ms.is_none_or(|t| r.tpot_ms.is_none_or(|x| x <= t))
            && self.e2e_ms.is_none_or(|t| r.e2e_ms.is_some_and(|x| x <= t))
    }

    /// "ttft=500ms,tpot=50ms" (the --slo syntax).
    pub fn words(&self) -> String {
        let parts: Vec<String> = [("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2e", self.e2e_ms)]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={}ms", (v * 1000.0).round() / 1000.0)))
            .collect();
        parts.join(",")
    }
}

/// `--slo ttft=500ms,tpot=50ms,e2e=10s`: bounds on TTFT, TPOT and E2E (a bare number is ms).
pub fn parse_slo(s: &str) -> Result<Slo, String> {
    let mut slo = Slo::default();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}`: expected NAME=TIME, e.g. ttft=500ms"))?;
        let d = crate::parse_duration_or(v, std::time::Duration::from_millis(1))?;
        let ms = d.as_secs_f64() * 1e3;
        if ms <= 0.0 {
            return Err(format!("`{part}`: the bound must be above 0"));
        }
        match k.trim().to_ascii_lowercase().as_str() {
            "ttft" => slo.ttft_ms = Some(ms),
            "tpot" => slo.tpot_ms = Some(ms),
            "e2e" => slo.e2e_ms = Some(ms),
            other => return Err(format!("`{other}`: --slo bounds are ttft, tpot and e2e")),
        }
    }
    if slo.is_empty() {
        return Err("--slo: no bound given (e.g. ttft=500ms,tpot=50ms)".into());
    }
    Ok(slo)
}

/// The figures a level's repeated runs get intervals for (Level field names).
pub const INTERVAL_FIGURES: &[Figure] = Figure::ALL;

crate::closed_set! {
    /// The figures a level is compared by (between its runs, against a baseline), by their
    /// results.json names.
    Figure {
        #[default]
        TtftMsMean = "ttft_ms_mean",
        TtftMsP50 = "ttft_ms_p50",
        TtftMsP99 = "ttft_ms_p99",
        TpotMsMean = "tpot_ms_mean",
        ItlMsP50 = "itl_ms_p50",
        E2eMsMean = "e2e_ms_mean",
        OutputTokensMean = "output_tokens_mean",
        ThroughputOutputTps = "throughput_output_tps",
        GoodputRps = "goodput_rps",
    }
}

impl Figure {
    /// What the figure counts in.
    pub fn unit(self) -> &'static str {
        use Figure::*;
        match self {
            TtftMsMean | TtftMsP50 | TtftMsP99 | TpotMsMean | ItlMsP50 | E2eMsMean => "ms",
            OutputTokensMean => "tokens",
            ThroughputOutputTps => "tokens/s",
            GoodputRps => "requests/s",
        }
    }

    /// Latencies are better lower; token counts and rates higher.
    pub fn lower_is_better(self) -> bool {
        use Figure::*;
        matches!(self, TtftMsMean | TtftMsP50 | TtftMsP99 | TpotMsMean | ItlMsP50 | E2eMsMean)
    }

    /// Its name for people.
    pub fn nice(self) -> &'static str {
        use Figure::*;
        match self {
            TtftMsMean => "TTFT mean",
            TtftMsP50 => "TTFT p50",
            TtftMsP99 => "TTFT p99",
            TpotMsMean => "TPOT",
            ItlMsP50 => "ITL p50",
            E2eMsMean => "E2E mean",
            OutputTokensMean => "output tokens",
            ThroughputOutputTps => "output tok/s",
            GoodputRps => "goodput req/s",
        }
    }
}

impl Level {
    /// A figure of the level.
    pub fn figure(&self, f: Figure) -> Option<f64> {
        use Figure::*;
        match f {
            TtftMsMean => self.ttft_ms_mean,
            TtftMsP50 => self.ttft_ms_p50,
            TtftMsP99 => self.ttft_ms_p99,
            TpotMsMean => self.tpot_ms_mean,
            ItlMsP50 => self.itl_ms_p50,
            E2eMsMean => self.e2e_ms_mean,
            OutputTokensMean => self.output_tokens_mean,
            ThroughputOutputTps => self.throughput_output_tps,
            GoodputRps => self.goodput_rps,
        }
    }

    /// Whether this level's figure differs from another's: with intervals on both sides, only
    /// when they are apart; otherwise by `fallback` (single runs keep the older thresholds).
    pub fn differs(&self, o: &Level, f: Figure, fallback: impl Fn(f64, f64) -> bool) -> bool {
        match (self.intervals.get(f.name()), o.intervals.get(f.name())) {
            (Some(a), Some(b)) => a.apart(b),
            _ => match (self.figure(f), o.figure(f)) {
                (Some(a), Some(b)) => fallback(a, b),
                _ => false,
            },
        }
    }
}

/// Pool the runs of one level (--repeat): the figures over every row of every run, their
/// durations summed, and each figure's interval over the runs' own values.
pub fn pool(runs: &[&Level], rows: &[&Row], slo: Slo) -> Level {
    let duration: f64 = runs.iter().map(|l| l.duration_s).sum();
    let mut l = summarize(rows, duration, slo);
    let first = runs[0];
    l.sweep = first.sweep;
    l.level = first.level.clone();
    l.concurrency = first.concurrency;
    l.bucket_tokens = first.bucket_tokens;
    l.idle_s = first.idle_s;
    l.rate_rps = first.rate_rps;
    l.runs = runs.len() as u64;
    l.counters_before = first.counters_before.clone();
    l.counters_after = runs[runs.len() - 1].counters_after.clone();
    for r in runs {
        for (k, v) in &r.counters_peak {
            let e = l.counters_peak.entry(k.clone()).or_insert(*v);
            *e = e.max(*v);
        }
        for n in &r.notes {
            if !l.notes.contains(n) {
                l.notes.push(n.clone());
            }
        }
    }
    if runs.len() >= 2 {
        for f in INTERVAL_FIGURES {
            let v: Vec<f64> = runs.iter().filter_map(|r| r.figure(*f)).collect();
            if v.len() == runs.len()
                && let Some(i) = crate::util::stats::interval(&v)
            {
                l.intervals.insert(f.name().to_string(), i);
            }
        }
    }
    let machines: Vec<&super::machine::Machine> = runs.iter().filter_map(|r| r.machine.as_ref()).collect();
    l.machine = super::machine::Machine::mean(&machines);
    l.contended = runs.iter().any(|r| r.contended);
    l
}

pub fn summarize(rows: &[&Row], duration_s: f64, slo: Slo) -> Level {
    let first = rows.first().copied().cloned().unwrap_or_default();
    // Completed: a 2xx answer that ended without an error, deadline or disconnect.
    let ok: Vec<&&Row> = rows
        .iter()
        .filter(|r| {
            r.status.is_some_and(|s| (200..300).contains(&s))
                && r.error.is_none()
                && !r.deadline_hit
                && !r.disconnected
                && r.stop != RowStop::Cause(StopCause::ClientDisconnect)
        })
        .collect();
    let f = |g: &dyn Fn(&Row) -> Option<f64>| -> Vec<f64> { rows.iter().filter_map(|r| g(r)).collect() };
    let served: Vec<&&Row> = rows.iter().filter(|r| r.status.is_some_and(|s| s < 400)).collect();
    let outs: Vec<f64> = served.iter().map(|r| r.output_tokens as f64).collect();
    let itl: Vec<f64> = rows.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let ttft = f(&|r| r.ttft_ms);
    let mut stops = BTreeMap::new();
    let mut slow = BTreeMap::new();
    let mut limits = BTreeMap::new();
    for r in rows {
        if let Some(l) = &r.server_limit {
            *limits.entry(l.clone()).or_insert(0) += 1;
        }
        *stops.entry(r.stop.name().to_string()).or_insert(0) += 1;
        if let Some(v) = &r.verdict {
            *slow.entry(v.slow_cause.name().to_string()).or_insert(0) += 1;
        }
    }
    let good: Vec<&&&Row> = ok.iter().filter(|r| slo.met(r)).collect();
    // fold from +0.0: an empty f64 sum is -0.0, printed "-0.0".
    let good_tokens: f64 = good.iter().map(|r| r.output_tokens as f64).fold(0.0, |a, b| a + b);
    let good = good.len();
    // Prompt-cache reuse over the requests after the first (the first fills the cache).
    let later: Vec<&&Row> = rows.iter().filter(|r| r.turn.map_or(r.index > 0, |t| t > 1) && r.cached_tokens.is_some()).collect();
    let cached: Vec<f64> = later.iter().filter_map(|r| r.cached_tokens.map(|n| n as f64)).collect();
    let reuse: Vec<f64> =
        later.iter().filter_map(|r| Some(r.cached_tokens? as f64 * 100.0 / r.prompt_tokens.filter(|&p| p > 0)? as f64)).collect();
    let per_s = |n: f64| (duration_s > 0.0).then(|| n / duration_s);
    Level {
        sweep: first.sweep,
        level: first.level.clone(),
        concurrency: first.concurrency,
        bucket_tokens: first.bucket_tokens,
        idle_s: first.idle_s,
        requests: rows.len() as u64,
        ok: ok.len() as u64,
        rejected: rows.iter().filter(|r| r.stop == RowStop::Rejected).count() as u64,
        errors: rows.iter().filter(|r| r.stop == RowStop::Cause(StopCause::ServerError)).count() as u64,
        deadline_hits: rows.iter().filter(|r| r.deadline_hit).count() as u64,
        disconnects: rows.iter().filter(|r| r.disconnected).count() as u64,
        prompt_tokens_mean: mean(&f(&|r| r.prompt_tokens.map(|n| n as f64))),
        output_tokens_mean: mean(&outs),
        output_tokens_min: served.iter().map(|r| r.output_tokens).min(),
        output_tokens_max: served.iter().map(|r| r.output_tokens).max(),
        stops,
        server_limits: limits,
        ttft_ms_mean: mean(&ttft),
        ttft_ms_p50: percentile(&ttft, 50.0),
        ttft_ms_p99: percentile(&ttft, 99.0),
        itl_ms_p50: percentile(&itl, 50.0),
        itl_ms_p99: percentile(&itl, 99.0),
        tpot_ms_mean: mean(&f(&|r| r.tpot_ms)),
        e2e_ms_mean: mean(&f(&|r| r.e2e_ms)),
        prompt_tps_mean: mean(&f(&|r| r.prompt_tps)),
        output_tps_mean: mean(&f(&|r| r.output_tps)),
        throughput_output_tps: per_s(outs.iter().fold(0.0, |a, b| a + b)),
        request_rate: per_s(rows.len() as f64),
        goodput_rps: per_s(good as f64),
        goodput_tps: per_s(good_tokens),
        goodput_pct: (!rows.is_empty()).then(|| good as f64 * 100.0 / rows.len() as f64),
        cached_tokens_mean: mean(&cached),
        reuse_pct: mean(&reuse),
        runs: 1,
        duration_s,
        slow_causes: slow,
        ..Default::default()
    }
}

/// CSV of the rows (one line per request; verdict columns empty without a trace).
pub fn csv(rows: &[Row]) -> String {
    let cols = [
        "sweep",
        "level",
        "concurrency",
        "bucket_tokens",
        "idle_s",
        "layers",
        "index",
        "prompt_hash",
        "prompt_tokens",
        "prompt_tokens_source",
        "max_tokens",
        "output_tokens",
        "output_tokens_source",
        "finish_reason",
        "truncated",
        "stop",
        "server_limit",
        "status",
        "error",
        "ttft_ms",
        "itl_p50_ms",
        "itl_max_ms",
        "tpot_ms",
        "e2e_ms",
        "queue_ms",
        "prompt_ms",
        "prompt_tps",
        "output_tps",
        "deadline_hit",
        "disconnected",
        "sent_ms",
        "local_port",
        "server_pid",
        "model_resident_pct",
        "cached_tokens",
        "met_slo",
        "conversation",
        "turn",
        "repeat",
        "slow_cause",
        "verdict_stop_cause",
        "ttft_disk_ms",
        "ttft_load_ms",
        "ttft_queue_ms",
        "ttft_compute_ms",
    ];
    let mut out = cols.join(",");
    out.push('\n');
    let o = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
    let n = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_default();
    for r in rows {
        let split = r.verdict.as_ref().and_then(|v| v.ttft_ms.clone());
        let fields = [
            r.sweep.name().to_string(),
            r.level.clone(),
            r.concurrency.to_string(),
            n(r.bucket_tokens),
            o(r.idle_s),
            r.layers.join("+"),
            r.index.to_string(),
            r.prompt_hash.clone(),
            n(r.prompt_tokens),
            r.prompt_tokens_source.clone(),
            r.max_tokens.to_string(),
            r.output_tokens.to_string(),
            r.output_tokens_source.clone(),
            r.finish_reason.clone().unwrap_or_default(),
            r.truncated.map(|t| t.to_string()).unwrap_or_default(),
            r.stop.name().to_string(),
            r.server_limit.clone().unwrap_or_default(),
            n(r.status.map(u64::from)),
            r.error.clone().unwrap_or_default(),
            o(r.ttft_ms),
            o(r.itl_p50_ms),
            o(r.itl_max_ms),
            o(r.tpot_ms),
            o(r.e2e_ms),
            o(r.queue_ms),
            o(r.prompt_ms),
            o(r.prompt_tps),
            o(r.output_tps),
            r.deadline_hit.to_string(),
            r.disconnected.to_string(),
            format!("{:.3}", r.sent_ms),
            n(r.local_port.map(u64::from)),
            n(r.server_pid.map(u64::from)),
            o(r.model_resident_pct),
            n(r.cached_tokens),
            r.met_slo.map(|b| b.to_string()).unwrap_or_default(),
            n(r.conversation),
            n(r.turn),
            r.repeat.to_string(),
            r.verdict.as_ref().map(|v| v.slow_cause.name().to_string()).unwrap_or_default(),
            r.verdict.as_ref().map(|v| v.stop_cause.name().to_string()).unwrap_or_default(),
            o(split.as_ref().map(|s| s.disk)),
            o(split.as_ref().map(|s| s.load)),
            o(split.as_ref().map(|s| s.queue)),
            o(split.as_ref().map(|s| s.compute)),
        ];
        out.push_str(&fields.iter().map(|f| csv_field(f)).collect::<Vec<_>>().join(","));
        out.push('\n');
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_better_lower_when_they_are_times() {
        // As the baseline judged them by name: a figure in ms is worse when higher.
        for f in Figure::ALL {
            assert_eq!(f.lower_is_better(), f.name().contains("_ms"), "{f}");
        }
        assert_eq!((Figure::GoodputRps.unit(), Figure::GoodputRps.nice()), ("requests/s", "goodput req/s"));
        let l = Level { tpot_ms_mean: Some(12.5), ..Default::default() };
        assert_eq!((l.figure(Figure::TpotMsMean), l.figure(Figure::GoodputRps)), (Some(12.5), None));
    }
    use crate::stream::payload::Stop;

    fn x(stop: Stop) -> Exchange {
        Exchange { status: Some(200), complete: true, stop, ..Default::default() }
    }

    #[test]
    fn stops_are_normalized() {
        let length = Stop { finish_reason: Some("length".into()), ..Default::default() };
        assert_eq!(normalize_stop(&x(length.clone()), 64, 64, None).0.name(), "requested_limit");
        let (s, d) = normalize_stop(&x(length), 200, 400, Some(256));
        assert_eq!(s.name(), "server_limit");
        assert!(d.contains("256-token slot context") && d.contains("200 of 400"), "{d}");
        let limit = Stop { stop_type: Some("limit".into()), truncated: Some(true), ..Default::default() };
        assert_eq!(normalize_stop(&x(limit), 10, 10, None).0.name(), "server_limit");
        assert_eq!(normalize_stop(&x(Stop { stop_type: Some("eos".into()), ..Default::default() }), 5, 64, None).0.name(), "eos");
        assert_eq!(normalize_stop(&x(Stop { done_reason: Some("stop".into()), ..Default::default() }), 5, 64, None).0.name(), "eos");
        assert_eq!(normalize_stop(&x(Stop { stop_type: Some("word".into()), ..Default::default() }), 5, 64, None).0.name(), "stop_word");
        assert_eq!(normalize_stop(&x(Stop::default()), 5, 64, None).0.name(), "unknown");
        let mut mid = x(Stop::default());
        mid.error_message = Some("Context size has been exceeded.".into());
        assert_eq!(normalize_stop(&mid, 248, 300, Some(1024)).0.name(), "server_limit");
        mid.error_message = Some("boom".into());
        assert_eq!(normalize_stop(&mid, 3, 300, None).0.name(), "server_error");
        let mut rej = x(Stop::default());
        rej.status = Some(400);
        rej.error_message = Some("the request exceeds the available context size".into());
        let (s, d) = normalize_stop(&rej, 0, 16, None);
        assert_eq!(s.name(), "rejected");
        assert!(d.contains("HTTP 400"), "{d}");
        rej.status = Some(503);
        rej.error_message = Some("Loading model".into());
        assert_eq!(normalize_stop(&rej, 0, 16, None).0.name(), "server_error");
        let mut dl = x(Stop::default());
        dl.deadline_hit = true;
        assert_eq!(normalize_stop(&dl, 3, 16, None).0.name(), "deadline");
        let mut cut = x(Stop::default());
        cut.complete = false;
        cut.disconnected = true;
        assert_eq!(normalize_stop(&cut, 3, 16, None).0.name(), "server_error");
        let refused = Exchange { transport_error: Some("cannot connect to 127.0.0.1:9: Connection refused".into()), ..Default::default() };
        assert_eq!(
            normalize_stop(&refused, 0, 16, None),
            (RowStop::Cause(StopCause::ServerError), "cannot connect to 127.0.0.1:9: Connection refused".into())
        );
        assert_eq!(which_limit(Some(9), 248, Some(1024)), Some(ServerLimit::KvPool));
        assert_eq!(which_limit(Some(30), 226, Some(256)), Some(ServerLimit::SlotContext));
        assert_eq!(which_limit(None, 226, Some(256)), None);
    }

    #[test]
    fn latency_math() {
        let ex =
            Exchange { ttft_ms: Some(100.0), e2e_ms: Some(1000.0), content_ms: vec![100.0, 200.0, 400.0, 1000.0], ..Default::default() };
        let mut r = Row { output_tokens: 10, prompt_tokens: Some(50), prompt_ms: Some(25.0), ..Default::default() };
        fill_latency(&mut r, &ex);
        assert_eq!(r.tpot_ms, Some(100.0));
        assert_eq!(r.itl, vec![100.0, 200.0, 600.0]);
        assert_eq!(r.itl_p50_ms, Some(200.0));
        assert_eq!(r.itl_max_ms, Some(600.0));
        assert_eq!(r.prompt_tps, Some(2000.0));
        assert_eq!(r.output_tps, Some(10.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), Some(2.5));
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn levels_pool_itl_and_count_goodput() {
        let mk = |ttft: f64, stop: &str, itl: Vec<f64>| Row {
            sweep: crate::bench::metrics::Sweep::Concurrency,
            level: "2".into(),
            concurrency: 2,
            status: Some(200),
            stop: stop.parse().unwrap(),
            ttft_ms: Some(ttft),
            tpot_ms: Some(10.0),
            output_tokens: 8,
            itl,
            ..Default::default()
        };
        let a = mk(100.0, "eos", vec![1.0, 2.0]);
        let b = mk(300.0, "requested_limit", vec![3.0]);
        let mut c = mk(50.0, "server_error", vec![]);
        c.status = Some(500);
        c.error = Some("x".into());
        let l = summarize(&[&a, &b, &c], 2.0, Slo { ttft_ms: Some(200.0), ..Default::default() });
        assert_eq!((l.requests, l.ok, l.errors), (3, 2, 1));
        assert_eq!(l.itl_ms_p50, Some(2.0));
        assert_eq!(l.goodput_rps, Some(0.5));
        assert_eq!(l.goodput_tps, Some(4.0));
        assert!((l.goodput_pct.unwrap() - 100.0 / 3.0).abs() < 1e-9);
        // Tighter bounds: fewer good requests, never more.
        let tight = summarize(&[&a, &b, &c], 2.0, Slo { ttft_ms: Some(50.0), ..Default::default() });
        assert_eq!(tight.goodput_rps, Some(0.0));
        assert_eq!(format!("{:.1}", tight.goodput_tps.unwrap()), "0.0");
        let e2e = summarize(&[&a, &b], 2.0, Slo { e2e_ms: Some(1.0), ..Default::default() });
        assert_eq!(e2e.goodput_rps, Some(0.0), "no E2E measured: not met");
        assert_eq!(l.throughput_output_tps, Some(8.0));
        assert_eq!(l.stops["eos"], 1);
        assert_eq!(l.output_tokens_mean, Some(8.0));
    }

    #[test]
    fn slo_syntax() {
        let s = parse_slo("ttft=500ms, tpot=50,e2e=2s").unwrap();
        assert_eq!((s.ttft_ms, s.tpot_ms, s.e2e_ms), (Some(500.0), Some(50.0), Some(2000.0)));
        assert_eq!(s.words(), "ttft=500ms,tpot=50ms,e2e=2000ms");
        assert_eq!(Slo { tpot_ms: Some(36.790000000000006), ..Default::default() }.words(), "tpot=36.79ms");
        assert!(parse_slo("ttfb=1s").unwrap_err().contains("ttft, tpot and e2e"));
        assert!(parse_slo("ttft").is_err() && parse_slo("").is_err() && parse_slo("ttft=0ms").is_err());
    }

    #[test]
    fn repeated_runs_pool_and_get_intervals() {
        let run = |ttft: f64, seq: usize| {
            let r = Row {
                sweep: crate::bench::metrics::Sweep::Concurrency,
                level: "1".into(),
                status: Some(200),
                ttft_ms: Some(ttft),
                output_tokens: 4,
                run_seq: seq,
                ..Default::default()
            };
            let mut l = summarize(&[&r], 1.0, Slo::default());
            l.seq = seq;
            (r, l)
        };
        let (r1, l1) = run(100.0, 0);
        let (r2, l2) = run(110.0, 1);
        let (r3, l3) = run(120.0, 2);
        let p = pool(&[&l1, &l2, &l3], &[&r1, &r2, &r3], Slo::default());
        assert_eq!((p.runs, p.requests, p.duration_s), (3, 3, 3.0));
        let i = &p.intervals["ttft_ms_p50"];
        assert_eq!((i.mean, i.n), (110.0, 3));
        assert!(i.lo < 100.0 && i.hi > 120.0, "{i:?}");
        let (r4, l4) = run(300.0, 3);
        let (r5, l5) = run(310.0, 4);
        let q = pool(&[&l4, &l5], &[&r4, &r5], Slo::default());
        assert!(p.differs(&q, Figure::TtftMsP50, |_, _| false));
        // One run alone has no interval: the caller's rule decides.
        assert!(l1.differs(&l4, Figure::TtftMsP50, |a, b| b > 2.0 * a));
        assert!(!l1.differs(&l2, Figure::TtftMsP50, |a, b| b > 2.0 * a));
    }

    #[test]
    fn csv_quotes_and_has_one_line_per_row() {
        let r = Row {
            sweep: crate::bench::metrics::Sweep::Prompt,
            level: "512 @1".into(),
            error: Some("a, \"b\"".into()),
            ..Default::default()
        };
        let text = csv(&[r.clone(), r]);
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains("\"a, \"\"b\"\"\""), "{text}");
        let header = text.lines().next().unwrap().split(',').count();
        assert_eq!(header, 45);
    }
}
