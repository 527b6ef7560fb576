//! `results-vllm.jsonl`: each level of a run as the result `vllm bench serve --save-result`
//! writes (one JSON object a line, as its `--append-result` does), with its key names and
//! statistic sets: mean, median, std (population) and p99 of TTFT, TPOT, ITL and E2EL in ms,
//! over the requests that completed; throughputs per second of the level's duration. So a run
//! of probe bench and a run of vLLM's benchmark can be put side by side with the same tools.
//! probe's own facts are added under `probe_*` keys (sweep, level, stop causes); the detailed
//! per-request lists are left out, as vLLM does without `--save-detailed`, and never any text.
use serde_json::{Value, json};

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

/// mean, median, std and p99 of `v` (ms) under vLLM's names; zeros for no values, as numpy's
/// `np.mean(v or 0)` gives.
fn stats(name: &str, v: &[f64], out: &mut serde_json::Map<String, Value>) {
    let v = if v.is_empty() { vec![0.0] } else { v.to_vec() };
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    out.insert(format!("mean_{name}_ms"), json!(mean));
    out.insert(format!("median_{name}_ms"), json!(percentile(&v, 50.0)));
    out.insert(format!("std_{name}_ms"), json!(std));
    out.insert(format!("p99_{name}_ms"), json!(percentile(&v, 99.0)));
}

/// A request vLLM would count as completed: a 2xx answer that ended without an error.
fn completed(r: &Row) -> bool {
    r.status.is_some_and(|s| (200..300).contains(&s))
        && r.error.is_none()
        && !r.deadline_hit
        && !r.disconnected
        && r.stop != super::metrics::RowStop::Cause(crate::analysis::verdict::StopCause::ClientDisconnect)
}

/// One level as a vLLM result object.
pub fn level(r: &Results, l: &Level, rows: &[&Row]) -> Value {
    let ok: Vec<&&Row> = rows.iter().filter(|r| completed(r)).collect();
    let dur = l.duration_s.max(1e-9);
    let input: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let output: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let mut o = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        o.insert(k.to_string(), v);
    };
    put("date", json!(date(r.started_unix_s)));
    put("endpoint_type", json!(backend(r.api)));
    put("backend", json!(backend(r.api)));
    put("label", Value::Null);
    put("model_id", json!(r.server.model));
    // probe counts tokens with the server's own tokenizer (its /tokenize), not a named one.
    put("tokenizer_id", Value::Null);
    put("num_prompts", json!(rows.len()));
    // probe sends a level's requests at once, kept at its concurrency: vLLM's `inf` rate.
    put("request_rate", json!("inf"));
    put("burstiness", json!(1.0));
    put("max_concurrency", json!(l.concurrency));
    put("duration", json!(l.duration_s));
    put("completed", json!(ok.len()));
    put("failed", json!(rows.len() - ok.len()));
    put("total_input_tokens", json!(input));
    put("total_output_tokens", json!(output));
    put("request_throughput", json!(ok.len() as f64 / dur));
    // As vLLM: null unless goodput targets were given (--goodput-ttft-ms / --goodput-tpot-ms).
    let slo = r.config.goodput_ttft_ms.is_some() || r.config.goodput_tpot_ms.is_some();
    put("request_goodput", l.goodput_rps.filter(|_| slo).map_or(Value::Null, |g| json!(g)));
    put("output_throughput", json!(output as f64 / dur));
    put("total_token_throughput", json!((input + output) as f64 / dur));
    // Per-second buckets of token arrivals and requests in flight, as vLLM counts its peaks.
    let start = ok.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let (mut tokens, mut inflight) = (std::collections::BTreeMap::<i64, u64>::new(), std::collections::BTreeMap::<i64, u64>::new());
    for q in &ok {
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
    put("max_output_tokens_per_s", json!(tokens.values().max().copied().unwrap_or(0) as f64));
    put("max_concurrent_requests", json!(inflight.values().max().copied().unwrap_or(0)));
    // The real-time factor of speech models: 0 for text, as vLLM writes it.
    put("rtfx", json!(0.0));
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_ms).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let e2el: Vec<f64> = ok.iter().filter_map(|r| r.e2e_ms).collect();
    for (name, v) in [("ttft", &ttft), ("tpot", &tpot), ("itl", &itl), ("e2el", &e2el)] {
        stats(name, v, &mut o);
    }
    o.insert("probe_sweep".into(), json!(l.sweep));
    o.insert("probe_level".into(), json!(l.level));
    o.insert("probe_stops".into(), json!(l.stops));
    if let Some(t) = &r.server.tokenizer {
        o.insert("probe_token_counts".into(), json!(t));
    }
    Value::Object(o)
}

/// Every level of a run, one vLLM result a line.
pub fn jsonl(r: &Results) -> String {
    let mut s = String::new();
    for l in &r.levels {
        let rows: Vec<&Row> = r.rows.iter().filter(|x| x.seq == l.seq).collect();
        s.push_str(&level(r, l, &rows).to_string());
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
        let mut o = serde_json::Map::new();
        stats("ttft", &[75.39, 132.64], &mut o);
        // np.std([75.39, 132.64]) = 28.625, np.percentile(.., 99) = 132.0675
        assert!((o["std_ttft_ms"].as_f64().unwrap() - 28.625).abs() < 1e-9);
        assert!((o["p99_ttft_ms"].as_f64().unwrap() - 132.0675).abs() < 1e-9);
        assert!((o["median_ttft_ms"].as_f64().unwrap() - 104.015).abs() < 1e-9);
        let mut e = serde_json::Map::new();
        stats("itl", &[], &mut e);
        assert_eq!(e["mean_itl_ms"], 0.0);
    }
}
