//! The `probe bench` command line: sweeps, levels, buckets, idle intervals and layers, sampling,
//! deadline, goodput targets, tracing and the output directory.
use std::{path::PathBuf, time::Duration};

use super::{api::Api, metrics::Sweep};

/// Which other benchmark `--compare-with` runs on the same server and workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Other {
    /// NVIDIA AIPerf (PyPI `aiperf`), its own CLI.
    Aiperf,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches("/s").trim_end_matches("rps").trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("`{s}` is not a positive rate (requests per second, e.g. 2 or 0.5)")),
    }
}

fn parse_pct(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(x) if (0.0..=100.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a percentage (0-100)")),
    }
}

/// Parse `1,2,4` lists of positive integers.
fn parse_u64(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}` is not a positive integer")),
    }
}

/// Idle intervals: `0`, `30s`, `1m`, `10m`, `1h`, `500ms`; a bare number is minutes (as the
/// experiment's list is written).
pub fn parse_idle(s: &str) -> Result<Duration, String> {
    crate::parse_duration_or(s, Duration::from_secs(60))
}

/// A deadline or period: a bare number is seconds.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    crate::parse_duration_or(s, Duration::from_secs(1))
}

pub fn label(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s == 0.0 {
        "0s".into()
    } else if s >= 3600.0 && s % 3600.0 == 0.0 {
        format!("{}h", s / 3600.0)
    } else if s >= 60.0 && s % 60.0 == 0.0 {
        format!("{}m", s / 60.0)
    } else if s.fract() == 0.0 {
        format!("{s}s")
    } else {
        format!("{}ms", (s * 1e3).round())
    }
}

/// `probe bench`: drive a running LLM server with controlled experiments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server, plain HTTP only: http://HOST:PORT (e.g. http://127.0.0.1:8080).
    #[arg(long)]
    pub url: String,
    #[command(flatten)]
    pub auth: crate::util::httpc::ServerAuth,
    /// Request format: openai (/v1/completions), chat (/v1/chat/completions), llamacpp
    /// (/completion), ollama (/api/generate).
    #[arg(long, value_enum, default_value = "openai")]
    pub api: Api,
    /// Model name for the request body (openai/ollama); default: the server's first model.
    #[arg(long)]
    pub model: Option<String>,
    /// Sweeps to run (comma list or repeated): concurrency, prompt, idle, rate, prefix, multiturn.
    /// Default: concurrency, or rate when --rate is given.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub sweep: Vec<Sweep>,
    /// Concurrency levels of the concurrency sweep.
    #[arg(long, value_delimiter = ',', value_parser = parse_u64, default_value = "1,2,4,8")]
    pub levels: Vec<u64>,
    /// Requests per level: each level sends max(level, N) requests, request i with prompt i mod N,
    /// so every level sends the same prompts. Default: the largest level (concurrency sweep),
    /// 1 (prompt sweep).
    #[arg(long, value_parser = parse_u64)]
    pub requests_per_level: Option<u64>,
    /// Fixed prompts of the concurrency and idle sweeps, one a line (`\n` for a newline), in
    /// place of the built-in ones (long-answer instructions; a short greeting for idle). The
    /// outputs keep their hash and token count, never their text.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Requested output tokens (concurrency sweep).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u64,
    /// Prompt-length buckets, tokens.
    #[arg(long, value_delimiter = ',', value_parser = parse_u64, default_value = "512,2048,8192,16384")]
    pub buckets: Vec<u64>,
    /// Concurrency levels per bucket (default: 1, then --levels).
    #[arg(long, value_delimiter = ',', value_parser = parse_u64)]
    pub prompt_levels: Option<Vec<u64>>,
    /// Requested output tokens per bucket request (controlled output length).
    #[arg(long, default_value_t = 32)]
    pub bucket_max_tokens: u64,
    /// Idle intervals before the fixed short prompt: a bare number is minutes; 5s, 10m, 1h.
    #[arg(long, value_delimiter = ',', value_parser = parse_idle, default_value = "0,1,10,60,480")]
    pub idle: Vec<Duration>,
    /// Requested output tokens of the idle sweep's request.
    #[arg(long, default_value_t = 8)]
    pub idle_max_tokens: u64,
    /// Idle layer: a shell command that restarts the server, run before each idle interval; it
    /// must return once the server is started (probe then waits for its health endpoint).
    #[arg(long)]
    pub restart_cmd: Option<String>,
    /// With --restart-cmd: a shell command that stops the server first; the model's cache is
    /// then dropped while no process maps it, before --restart-cmd starts it again.
    #[arg(long)]
    pub stop_cmd: Option<String>,
    /// Idle layer: drop the model file from the page cache (posix_fadvise DONTNEED) before the
    /// request (and between --stop-cmd and --restart-cmd).
    #[arg(long)]
    pub drop_cache: bool,
    /// The model file for --drop-cache (default: the server's /props model_path, else the largest
    /// file the server process maps).
    #[arg(long)]
    pub model_file: Option<PathBuf>,
    /// Idle layer "pinned worker": a 1-token request every --keep-warm-every during the idle wait.
    #[arg(long)]
    pub keep_warm: bool,
    /// How often --keep-warm sends its 1-token request during an idle wait (e.g. 5s, 1m).
    #[arg(long, value_parser = parse_secs, default_value = "5s")]
    pub keep_warm_every: Duration,
    /// Sampling seed (fixed across every request).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Sampling temperature sent with every request (0: greedy, the same output for a prompt).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Ask the server to ignore end-of-sequence (llama.cpp, vLLM) for generations of fixed length.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Client deadline per request (e.g. 60s, 5m): a request still running then is cut and
    /// recorded as a deadline hit.
    #[arg(long, value_parser = parse_secs, default_value = "300s")]
    pub timeout: Duration,
    /// Run each level N times, the runs of a sweep's levels in a shuffled order (seeded by
    /// --seed); every figure then gets its mean and 95% interval over the N runs, and levels
    /// whose intervals overlap are never called different.
    #[arg(long, default_value_t = 1, value_parser = parse_u64)]
    pub repeat: u64,
    /// Service-level bounds for goodput: ttft=500ms,tpot=50ms,e2e=10s (any of them; a bare
    /// number is ms). Goodput counts the requests (and their tokens) that met every bound.
    #[arg(long, value_parser = super::metrics::parse_slo)]
    pub slo: Option<super::metrics::Slo>,
    /// The conclusions name the highest load whose goodput stays at or above this share of its
    /// requests, %.
    #[arg(long, default_value_t = 90.0, value_parser = parse_pct)]
    pub goodput_pct: f64,
    /// Alias of --slo ttft=MS (kept from earlier releases).
    #[arg(long)]
    pub goodput_ttft_ms: Option<f64>,
    /// Alias of --slo tpot=MS (kept from earlier releases).
    #[arg(long)]
    pub goodput_tpot_ms: Option<f64>,
    /// Poisson arrival rates, requests per second (comma list) of the rate sweep (the default sweep
    /// when --rate is given): one level a
    /// rate, each --requests-per-level requests (default 16) sent at exponential gaps (seeded),
    /// whatever is in flight.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate)]
    pub rate: Vec<f64>,
    /// Shared-prefix workload: tokens of the system prompt the requests share.
    #[arg(long, default_value_t = 1024, value_parser = parse_u64)]
    pub prefix_tokens: u64,
    /// Shared-prefix workload: requests per level (the first alone, to fill the cache).
    #[arg(long, default_value_t = 8, value_parser = parse_u64)]
    pub prefix_requests: u64,
    /// Multi-turn workload: turns per conversation.
    #[arg(long, default_value_t = 4, value_parser = parse_u64)]
    pub turns: u64,
    /// Compare with an earlier run (its results.json, or the directory holding it): each level's
    /// figures against the same level's there, called changed only beyond their intervals.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// With --baseline: exit 3 when a figure got worse by more than PCT% (beyond its interval
    /// when both runs were repeated), naming the machine-state differences (a CI gate).
    #[arg(long, value_name = "PCT", requires = "baseline", value_parser = parse_gate_pct)]
    pub fail_on_regression: Option<f64>,
    /// Also run another benchmark's own CLI on the same server and workload (concurrency sweep
    /// levels, the same prompts and output length) and print both tools' figures side by side.
    #[arg(long, value_enum)]
    pub compare_with: Option<Other>,
    /// The aiperf command for --compare-with aiperf (default: `aiperf` on PATH).
    #[arg(long, default_value = "aiperf")]
    pub aiperf: String,
    /// A local tokenizer folder (holding tokenizer.json) for --compare-with aiperf.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Trace this server pid during the run (root) and attach each request's verdict.
    #[arg(long)]
    pub trace_pid: Option<u32>,
    /// Trace the process listening on the URL's port (found again after every restart).
    #[arg(long)]
    pub trace: bool,
    /// Output directory: results.json, results.csv, summary.txt, *.svg, trace-N/.
    #[arg(short, long, visible_alias = "output", default_value = "probe-bench")]
    pub out: PathBuf,
    /// Replace an earlier run's results in --out (it is refused otherwise, like `trace --out`).
    #[arg(long)]
    pub force: bool,
    /// How long to wait for the server's health endpoint (start and after each restart).
    #[arg(long, value_parser = parse_secs, default_value = "120s")]
    pub health_timeout: Duration,
}

/// A percentage above 0 (a regression gate may allow more than 100%).
fn parse_gate_pct(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if p.is_finite() && p > 0.0 => Ok(p),
        _ => Err(format!("`{s}` is not a percentage above 0 (e.g. 50)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_intervals_default_to_minutes_and_take_seconds() {
        assert_eq!(parse_idle("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_idle("10").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_idle("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_idle("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_idle("5x").is_err());
        assert_eq!(parse_rate("0.5").unwrap(), 0.5);
        assert_eq!(parse_rate("2/s").unwrap(), 2.0);
        assert!(parse_rate("0").is_err() && parse_rate("x").is_err());
        assert_eq!(parse_pct("90%").unwrap(), 90.0);
        assert!(parse_pct("101").is_err());
        assert_eq!(parse_secs("300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_secs("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            (label(Duration::ZERO), label(Duration::from_secs(5)), label(Duration::from_secs(600)), label(Duration::from_millis(1500))),
            ("0s".into(), "5s".into(), "10m".into(), "1500ms".into())
        );
    }
}
