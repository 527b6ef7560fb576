//! A benchmark run's results: the one model every output of `probe bench` renders (the
//! terminal tables, results.json/csv, summary.txt, the charts in bench::output, and
//! results-vllm.jsonl in bench::vllm).
use std::collections::BTreeMap;

use serde::Serialize;

use super::{
    api::{Api, ServerInfo},
    metrics::Sweep,
    metrics::{Level, Row},
};

/// How the run was asked for (results.json's `config`; fields in the order it has always had).
#[derive(Clone, Debug, Serialize)]
pub struct Config {
    pub bucket_max_tokens: u64,
    pub buckets: Vec<u64>,
    pub drop_cache: bool,
    pub goodput_ttft_ms: Option<f64>,
    pub goodput_tpot_ms: Option<f64>,
    pub idle_max_tokens: u64,
    pub idle_s: Vec<f64>,
    pub ignore_eos: bool,
    pub keep_warm: bool,
    pub keep_warm_every_s: f64,
    pub levels: Vec<u64>,
    pub max_tokens: u64,
    pub model: Option<String>,
    pub prompt_levels: Option<Vec<u64>>,
    pub requests_per_level: Option<u64>,
    pub restart_cmd: bool,
    pub seed: u64,
    pub stop_cmd: bool,
    pub sweeps: Vec<Sweep>,
    pub temperature: f64,
    pub timeout_s: f64,
    pub trace: bool,
    pub repeat: u64,
    pub slo: Option<super::metrics::Slo>,
    pub goodput_pct: f64,
    pub rates: Vec<f64>,
    pub prefix_tokens: u64,
    pub prefix_requests: u64,
    pub turns: u64,
}

#[derive(Serialize)]
pub struct Results {
    pub tool: String,
    pub url: String,
    pub api: Api,
    pub started_unix_s: u64,
    pub config: Config,
    pub definitions: BTreeMap<String, String>,
    pub server: ServerInfo,
    /// Ctrl-C stopped the run: what was gathered until then.
    pub interrupted: bool,
    pub rows: Vec<Row>,
    /// One summary per level, pooling its runs (with --repeat, intervals over them).
    pub levels: Vec<Level>,
    /// Every run of every level in the order they ran (rows carry run_seq).
    pub runs: Vec<Level>,
    pub conclusions: Vec<String>,
    pub notes: Vec<String>,
    pub traces: Vec<String>,
    /// --baseline: each level's figures against the earlier run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<super::baseline::Comparison>,
    /// --compare-with: the other tool's figures beside probe's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compared_with: Option<super::aiperf::SideBySide>,
}
