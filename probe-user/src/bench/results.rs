//! A benchmark run's results: the one model every output of `probe bench` renders (the
//! terminal tables, results.json/csv, summary.txt, the charts in bench::output, and
//! results-vllm.jsonl in bench::vllm).
use std::collections::BTreeMap;

use serde::Serialize;

use super::{
    api::{Api, ServerInfo},
    metrics::{Level, Row},
};

#[derive(Serialize)]
pub struct Results {
    pub tool: String,
    pub url: String,
    pub api: Api,
    pub started_unix_s: u64,
    pub config: serde_json::Value,
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
