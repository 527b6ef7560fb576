//! A benchmark run's results: the one model every output of `probe bench` renders (the
//! terminal tables, results.json/csv, summary.txt, the charts in bench::output, and
//! results-vllm.jsonl in bench::vllm).
use std::collections::BTreeMap;

use serde::Serialize;

use super::{
    api::{Api, ServerInfo},
    args::Sweep,
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
    pub levels: Vec<Level>,
    pub conclusions: Vec<String>,
    pub notes: Vec<String>,
    pub traces: Vec<String>,
}
