//! `results-vllm.jsonl`: each level of a run as the result `vllm bench serve --save-result`
//! writes (one JSON object a line, as its `--append-result` does), with its key names and
//! statistic sets: mean, median, std (population) and p99 of TTFT, TPOT, ITL and E2EL in ms,
//! over the requests that completed; throughputs per second of the level's duration. So a run
//! of probe bench and a run of vLLM's benchmark can be put side by side with the same tools.
//! probe's own facts are added under `probe_*` keys (sweep, level, stop causes); the detailed
//! per-request lists are left out, as vLLM does without `--save-detailed`, and never any text.
use std::collections::BTreeMap;

use serde::Serialize;

use super::{
    api::Api,
    metrics::{Level, Row},
    results::Results,
};
use crate::util::stats::percentile;

/// vLLM's name of the endpoint type probe's `--api` drives.
fn backend(api: Api) -> &'static str {
    match api {
        Api::Openai => "openai",
        Api::Chat => "openai-chat",
        Api::Llamacpp => "llama.cpp",
        Api::Ollama => "ollama",
    }
}

/// `YYYYMMDD-HHMMSS` (UTC) of a Unix time, as vLLM dates its results.
fn date(unix_s: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_s);
    // 2026-12-01T12:56:14Z → 20261201-125614
    humantime::format_rfc3339_seconds(t).to_string().replace(['-', ':', 'Z'], "").replace('T', "-")
}

/// mean, median, std and p99 of one latency (ms), as vLLM's statistic set.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Stats {
    mean: f64,
    median: Option<f64>,
    std: f64,
    p99: Option<f64>,
}

/// mean, median, std and p99 of `v` (ms); zeros for no values, as numpy's `np.mean(v or 0)` gives.
fn stats(v: &[f64]) -> Stats {
    let v = if v.is_empty() { vec![0.0] } else { v.to_vec() };
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    Stats { mean, median: percentile(&v, 50.0), std, p99: percentile(&v, 99.0) }
}

/// One level as vLLM's result object. vLLM's keys, written in their sorted order (as a JSON map
/// of them was), then probe's own under `probe_*`; `label` and `tokenizer_id` are always null.
#[derive(Debug, Serialize)]
pub struct VllmResult {
    backend: &'static str,
    burstiness: f64,
    completed: usize,
    date: String,
    duration: f64,
    endpoint_type: &'static str,
    failed: usize,
    label: Option<String>,
    max_concurrency: u64,
    max_concurrent_requests: u64,
    max_output_tokens_per_s: f64,
    mean_e2el_ms: f64,
    mean_itl_ms: f64,
    mean_tpot_ms: f64,
    mean_ttft_ms: f64,
    median_e2el_ms: Option<f64>,
    median_itl_ms: Option<f64>,
    median_tpot_ms: Option<f64>,
    median_ttft_ms: Option<f64>,
    model_id: Option<String>,
    num_prompts: usize,
    output_throughput: f64,
    p99_e2el_ms: Option<f64>,
    p99_itl_ms: Option<f64>,
    p99_tpot_ms: Option<f64>,
    p99_ttft_ms: Option<f64>,
    probe_level: String,
    probe_stops: BTreeMap<String, u64>,
    probe_sweep: super::metrics::Sweep,
    #[serde(skip_serializing_if = "Option::is_none")]
    probe_token_counts: Option<String>,
    request_goodput: Option<f64>,
    request_rate: &'static str,
    request_throughput: f64,
    rtfx: f64,
    std_e2el_ms: f64,
    std_itl_ms: f64,
    std_tpot_ms: f64,
    std_ttft_ms: f64,
    tokenizer_id: Option<String>,
    total_input_tokens: u64,
    total_output_tokens: u64,
    total_token_throughput: f64,
}

/// A request vLLM would count as completed: a 2xx answer that ended without an error.
fn completed(r: &Row) -> bool {
    r.status.is_some_and(|s| (200..300).contains(&s))
        && r.error.is_none()
        && !r.deadline_hit
        && !r.disconnected
        && r.stop != super::metrics::RowStop::Cause(crate::analysis::verdict::StopCause::ClientDisconnect)
}

/// Per-second buckets of token arrivals and of requests in flight, as vLLM counts its peaks:
/// the highest tokens in a second, and the most requests in flight in one.
fn peaks(ok: &[&&Row]) -> (u64, u64) {
    let start = ok.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let (mut tokens, mut inflight) = (BTreeMap::<i64, u64>::new(), BTreeMap::<i64, u64>::new());
    for q in ok {
        if let Some(t) = q.ttft_ms {
            let mut at = q.sent_ms + t;
            *tokens.entry(((at - start) / 1e3) as i64).or_default() += 1;
            for gap in &q.itl {
                at += gap;
                *tokens.entry(((at - start) / 1e3) as i64).or_default() += 1;
            }
        }
        let end = q.sent_ms + q.e2e_ms.unwrap_or(0.0);
        for s in ((q.sent_ms - start) / 1e3) as i64..=((end - start) / 1e3) as i64 {
            *inflight.entry(s).or_default() += 1;
        }
    }
    (tokens.values().max().copied().unwrap_or(0), inflight.values().max().copied().unwrap_or(0))
}

/// One level as a vLLM result object.
pub fn level(r: &Results, l: &Level, rows: &[&Row]) -> VllmResult {
    // As vLLM: goodput is null unless goodput targets were given (--goodput-ttft-ms / --goodput-tpot-ms).
    let slo = r.config.goodput_ttft_ms.is_some() || r.config.goodput_tpot_ms.is_some();
    result(r.api, r.started_unix_s, (r.server.model.clone(), r.server.tokenizer.clone()), slo, l, rows)
}

/// One level as a vLLM result object, from the run's facts: its API, start, the server's model
/// and tokenizer, whether goodput targets were given.
fn result(
    api: Api,
    started_unix_s: u64,
    (model, tokenizer): (Option<String>, Option<String>),
    slo: bool,
    l: &Level,
    rows: &[&Row],
) -> VllmResult {
    let ok: Vec<&&Row> = rows.iter().filter(|r| completed(r)).collect();
    let dur = l.duration_s.max(1e-9);
    let input: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let output: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let (max_tokens_s, max_inflight) = peaks(&ok);
    let ttft = stats(&ok.iter().filter_map(|r| r.ttft_ms).collect::<Vec<_>>());
    let tpot = stats(&ok.iter().filter_map(|r| r.tpot_ms).collect::<Vec<_>>());
    let itl = stats(&ok.iter().flat_map(|r| r.itl.iter().copied()).collect::<Vec<_>>());
    let e2el = stats(&ok.iter().filter_map(|r| r.e2e_ms).collect::<Vec<_>>());
    VllmResult {
        date: date(started_unix_s),
        endpoint_type: backend(api),
        backend: backend(api),
        label: None,
        model_id: model,
        // probe counts tokens with the server's own tokenizer (its /tokenize), not a named one.
        tokenizer_id: None,
        num_prompts: rows.len(),
        // probe sends a level's requests at once, kept at its concurrency: vLLM's `inf` rate.
        request_rate: "inf",
        burstiness: 1.0,
        max_concurrency: l.concurrency,
        duration: l.duration_s,
        completed: ok.len(),
        failed: rows.len() - ok.len(),
        total_input_tokens: input,
        total_output_tokens: output,
        request_throughput: ok.len() as f64 / dur,
        request_goodput: l.goodput_rps.filter(|_| slo),
        output_throughput: output as f64 / dur,
        total_token_throughput: (input + output) as f64 / dur,
        max_output_tokens_per_s: max_tokens_s as f64,
        max_concurrent_requests: max_inflight,
        // The real-time factor of speech models: 0 for text, as vLLM writes it.
        rtfx: 0.0,
        mean_ttft_ms: ttft.mean,
        median_ttft_ms: ttft.median,
        std_ttft_ms: ttft.std,
        p99_ttft_ms: ttft.p99,
        mean_tpot_ms: tpot.mean,
        median_tpot_ms: tpot.median,
        std_tpot_ms: tpot.std,
        p99_tpot_ms: tpot.p99,
        mean_itl_ms: itl.mean,
        median_itl_ms: itl.median,
        std_itl_ms: itl.std,
        p99_itl_ms: itl.p99,
        mean_e2el_ms: e2el.mean,
        median_e2el_ms: e2el.median,
        std_e2el_ms: e2el.std,
        p99_e2el_ms: e2el.p99,
        probe_sweep: l.sweep,
        probe_level: l.level.clone(),
        probe_stops: l.stops.clone(),
        probe_token_counts: tokenizer,
    }
}

/// Every level of a run, one vLLM result a line.
pub fn jsonl(r: &Results) -> String {
    let mut s = String::new();
    for l in &r.levels {
        let rows: Vec<&Row> = r.rows.iter().filter(|x| x.seq == l.seq).collect();
        s.push_str(&serde_json::to_string(&level(r, l, &rows)).unwrap_or_default());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_as_vllm_writes_them() {
        assert_eq!(date(0), "19700101-000000");
        assert_eq!(date(1_796_129_774), "20261201-125614");
        assert_eq!(date(951_782_400), "20000229-000000");
    }

    #[test]
    fn statistics_as_numpy_computes_them() {
        let o = stats(&[75.39, 132.64]);
        // np.std([75.39, 132.64]) = 28.625, np.percentile(.., 99) = 132.0675
        assert!((o.std - 28.625).abs() < 1e-9);
        assert!((o.p99.unwrap() - 132.0675).abs() < 1e-9);
        assert!((o.median.unwrap() - 104.015).abs() < 1e-9);
        assert_eq!(stats(&[]).mean, 0.0);
    }

    #[test]
    fn a_result_is_written_in_sorted_key_order_as_a_json_map_was() {
        let l = Level { level: "1".into(), concurrency: 1, duration_s: 2.0, ..Default::default() };
        let row = Row {
            status: Some(200),
            ttft_ms: Some(10.0),
            e2e_ms: Some(30.0),
            itl: vec![10.0, 10.0],
            output_tokens: 3,
            ..Default::default()
        };
        let v = result(Api::Openai, 0, (None, None), false, &l, &[&row]);
        let written = serde_json::to_string(&v).unwrap();
        // A serde_json map sorts its keys: the same text means the same key order.
        assert_eq!(written, serde_json::to_value(&v).unwrap().to_string());
        assert!(written.starts_with(r#"{"backend":"openai","burstiness":1.0,"completed":1,"date":"19700101-000000","#), "{written}");
        assert!(written.contains(r#""label":null,"#) && !written.contains("probe_token_counts"), "{written}");
    }
}
