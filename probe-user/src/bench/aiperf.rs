//! `--compare-with aiperf`: AIPerf's own CLI run against the same server and workload as the
//! concurrency sweep (each level's concurrency, request count, prompt size and output length,
//! the same sampling), its exported figures read back and printed beside probe's with the ratio.
//! AIPerf is run niced and lean (one worker, one record processor): on a small machine its own
//! processes otherwise slow the server it measures. The server's own per-token time (its
//! `timings`, when it reports them) is printed beside both, so a gap between the tools can be told
//! from the server running slower under the other tool's load.
use std::{path::Path, process::Command};

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::Value;

use super::{Run, args::BenchArgs, metrics::Level};

/// One level, both tools.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Pair {
    pub level: String,
    pub concurrency: u64,
    pub requests: u64,
    pub probe_ttft_ms_mean: Option<f64>,
    pub aiperf_ttft_ms_mean: Option<f64>,
    pub probe_ttft_ms_p50: Option<f64>,
    pub aiperf_ttft_ms_p50: Option<f64>,
    pub probe_itl_ms_mean: Option<f64>,
    pub aiperf_itl_ms_mean: Option<f64>,
    pub probe_output_tps: Option<f64>,
    pub aiperf_output_tps: Option<f64>,
    pub probe_output_tokens_mean: Option<f64>,
    pub aiperf_output_tokens_mean: Option<f64>,
    /// The server's own prompt time per request (its `timings.prompt_ms`, llama.cpp), mean,
    /// while each tool ran: a TTFT gap the server's prompt time also shows is the server running
    /// slower under the other tool's load, not a measuring difference.
    pub probe_server_prompt_ms: Option<f64>,
    pub aiperf_server_prompt_ms: Option<f64>,
    /// The server's own time per output token (`timings.predicted_per_token_ms`), mean, while
    /// each tool ran: the same check for ITL and output tokens/s.
    pub probe_server_tpot_ms: Option<f64>,
    pub aiperf_server_tpot_ms: Option<f64>,
    /// When the TTFTs differ by more than 10%: why, in numbers (None: they agree, or no reason
    /// was found).
    pub explained: Option<String>,
    /// The same for ITL and output tokens/s, by the server's own per-token time.
    pub explained_itl: Option<String>,
    /// CPU AIPerf's processes used while it ran, cores.
    pub aiperf_cores: Option<f64>,
    /// Where AIPerf's export lies.
    pub export: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SideBySide {
    pub tool: String,
    pub command: Vec<String>,
    pub levels: Vec<Pair>,
    pub notes: Vec<String>,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.2}", b / a),
        _ => "-".into(),
    }
}

fn f(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
}

impl SideBySide {
    pub fn table(&self) -> String {
        let mut o = format!("probe bench beside {} (same server and workload; ratio = {} / probe)\n", self.tool, self.tool);
        o.push_str("  level  TTFT mean (probe / aiperf / ratio)   TTFT p50              ITL mean              output tok/s          output tokens\n");
        for p in &self.levels {
            let cell = |a: Option<f64>, b: Option<f64>| format!("{:>7} {:>7} {:>5}", f(a), f(b), ratio(a, b));
            o.push_str(&format!(
                "  {:<5}  {}        {}   {}   {}   {}\n",
                p.level,
                cell(p.probe_ttft_ms_mean, p.aiperf_ttft_ms_mean),
                cell(p.probe_ttft_ms_p50, p.aiperf_ttft_ms_p50),
                cell(p.probe_itl_ms_mean, p.aiperf_itl_ms_mean),
                cell(p.probe_output_tps, p.aiperf_output_tps),
                cell(p.probe_output_tokens_mean, p.aiperf_output_tokens_mean),
            ));
        }
        for n in &self.notes {
            o.push_str(&format!("  note: {n}\n"));
        }
        o
    }

    pub fn words(&self) -> Vec<String> {
        self.levels
            .iter()
            .map(|p| {
                let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) if a > 0.0 => format!("{:+.0}%", (b - a) / a * 100.0),
                    _ => "n/a".into(),
                };
                format!(
                    "{} at concurrency {}: TTFT mean {} ms against probe's {} ms ({}), output {} tok/s against {} ({}){}{}{}",
                    self.tool,
                    p.concurrency,
                    f(p.aiperf_ttft_ms_mean),
                    f(p.probe_ttft_ms_mean),
                    pct(p.probe_ttft_ms_mean, p.aiperf_ttft_ms_mean),
                    f(p.aiperf_output_tps),
                    f(p.probe_output_tps),
                    pct(p.probe_output_tps, p.aiperf_output_tps),
                    p.aiperf_cores.map(|c| format!("; aiperf itself used {c:.2} cores")).unwrap_or_default(),
                    p.explained.as_ref().map(|e| format!("; the TTFT gap: {e}")).unwrap_or_default(),
                    p.explained_itl.as_ref().map(|e| format!("; the ITL gap: {e}")).unwrap_or_default()
                )
            })
            .collect()
    }
}

/// A metric of AIPerf's summary export (`profile_export_aiperf.json`): a top-level
/// `{"<tag>": {"unit": "ms", "avg": .., "p50": ..}}`; times in other units are brought to ms.
pub fn metric(v: &Value, tag: &str, stat: &str) -> Option<f64> {
    let m = &v[tag];
    let x = m[stat].as_f64()?;
    Some(match m["unit"].as_str() {
        Some("ns") => x / 1e6,
        Some("us") => x / 1e3,
        Some("s") | Some("sec") => x * 1e3,
        _ => x,
    })
}

/// A number of the server's `timings` (e.g. `prompt_ms`) in AIPerf's raw export, one per
/// request (the answers are kept there as JSON text, so the key appears escaped:
/// `prompt_ms\":341.6`); the last occurrence on each line (the final message's).
pub fn server_timing(raw: &str, key: &str) -> Vec<f64> {
    let mut out = Vec::new();
    let quoted = format!("\"{key}");
    let escaped = format!("\\\"{key}");
    for line in raw.lines() {
        if let Some(i) = line.rfind(&escaped).map(|i| i + escaped.len()).or_else(|| line.rfind(&quoted).map(|i| i + quoted.len())) {
            let rest = line[i..].trim_start_matches(['\\', '"', ':', ' ']);
            let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
            if let Ok(v) = rest[..end].parse::<f64>() {
                out.push(v);
            }
        }
    }
    out
}

/// Why the tools' TTFTs differ by more than 10%, when the server says: its own prompt time
/// differed by about as much (the other tool's load slowed it), and what is left of TTFT after
/// the server's prompt time (the client's and the network's share) agrees.
pub fn explain(p: &Pair) -> Option<String> {
    let (a, b) = (p.probe_ttft_ms_mean?, p.aiperf_ttft_ms_mean?);
    if a <= 0.0 || ((b - a) / a).abs() <= 0.10 {
        return None;
    }
    let (pa, pb) = (p.probe_server_prompt_ms?, p.aiperf_server_prompt_ms?);
    let (rest_a, rest_b) = (a - pa, b - pb);
    if (rest_b - rest_a).abs() > (0.10 * a).max(20.0) {
        return None;
    }
    Some(format!(
        "the server itself took {:.0} ms {} to process the prompts while AIPerf ran (its timings.prompt_ms: {pb:.0} against {pa:.0}{}); TTFT less the server's prompt time agrees ({rest_b:.0} against {rest_a:.0} ms)",
        (pb - pa).abs(),
        if pb >= pa { "longer" } else { "less" },
        p.aiperf_cores.map(|c| format!("; AIPerf used {c:.2} cores")).unwrap_or_default()
    ))
}

/// Why ITL and output tokens/s differ by more than 10%, when the server says: its own time per
/// output token differed by about as much (within 10% of the ratio the clients saw).
pub fn explain_itl(p: &Pair) -> Option<String> {
    let (a, b) = (p.probe_itl_ms_mean?, p.aiperf_itl_ms_mean?);
    // Output tokens per second move with the ITL (and the TTFT, explained on its own): a 9% ITL
    // gap with a 2% TTFT gap is an 11% throughput gap (CI), said the same way.
    let tps_gap = match (p.probe_output_tps, p.aiperf_output_tps) {
        (Some(x), Some(y)) if x > 0.0 => ((y - x) / x).abs() > 0.10,
        _ => false,
    };
    if a <= 0.0 || (((b - a) / a).abs() <= 0.10 && !tps_gap) {
        return None;
    }
    let (sa, sb) = (p.probe_server_tpot_ms?, p.aiperf_server_tpot_ms?);
    if sa <= 0.0 || ((b / a) / (sb / sa) - 1.0).abs() > 0.10 {
        return None;
    }
    Some(format!(
        "the server itself generated at {sb:.1} ms per token while AIPerf ran against {sa:.1} while probe did (its timings.predicted_per_token_ms): the clients' ITL ratio {:.2} is the server's {:.2}",
        b / a,
        sb / sa
    ))
}

crate::closed_set! {
    /// AIPerf's `--endpoint-type`: the OpenAI route probe's `--api` sends to.
    Endpoint {
        #[default]
        Completions = "completions",
        Chat = "chat",
    }
}

/// CPU seconds of this process's children that ended and were waited for (AIPerf and the
/// processes it waited for), so far.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage writes into the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

pub(super) fn compare(run: &Run, args: &BenchArgs) -> anyhow::Result<SideBySide> {
    let levels: Vec<&Level> = run.levels.iter().filter(|l| l.sweep == crate::bench::metrics::Sweep::Concurrency).collect();
    if levels.is_empty() {
        bail!("it compares the concurrency sweep: add --sweep concurrency");
    }
    let tokenizer =
        args.tokenizer.clone().context("AIPerf needs a local tokenizer folder (holding tokenizer.json): pass --tokenizer DIR")?;
    if !tokenizer.join("tokenizer.json").is_file() {
        bail!("--tokenizer {}: no tokenizer.json in it", tokenizer.display());
    }
    let model = run.info.model.clone().or(args.model.clone()).unwrap_or_else(|| "model".into());
    let endpoint = match args.api {
        super::api::Api::Openai => Endpoint::Completions,
        super::api::Api::Chat => Endpoint::Chat,
        other => bail!("AIPerf speaks the OpenAI routes: run with --api openai or chat (not {other:?})"),
    };
    let top = args.levels.iter().copied().max().unwrap_or(1);
    let n_prompts = args.requests_per_level.unwrap_or(top) as usize;
    let prompts = super::sweep::instruction_prompts(&run.url, n_prompts, run.info.model.as_deref(), false, &run.own_prompts);
    let mut out = SideBySide { tool: "aiperf".into(), ..Default::default() };
    for l in levels {
        let rows: Vec<&super::metrics::Row> = run.rows.iter().filter(|r| r.seq == l.seq).collect();
        let dir = args.out.join(format!("aiperf-{}", l.level));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        // The prompts probe sent at this level, in the order it sent them (request i: prompt
        // i mod N), as AIPerf's single-turn input file; deleted after the run with AIPerf's copy
        // of the request bodies (prompt text is not kept in the outputs).
        let input = dir.join("prompts.jsonl");
        let mut lines = String::new();
        for i in 0..l.requests as usize {
            let p = &prompts[i % prompts.len()];
            let text = if endpoint == Endpoint::Chat { p.text.split("\n\n").next().unwrap_or(&p.text) } else { p.text.as_str() };
            lines.push_str(&serde_json::json!({"text": text, "output_length": args.max_tokens}).to_string());
            lines.push('\n');
        }
        crate::util::output::write_file(&input, lines.as_bytes(), true)?;
        let cmd = command(args, &model, endpoint, l, &input, &tokenizer, &dir);
        if out.command.is_empty() {
            out.command = cmd.clone();
        }
        let before = children_cpu_s();
        let t = std::time::Instant::now();
        let o = Command::new(&cmd[0])
            .args(&cmd[1..])
            .current_dir(&dir)
            // A set HF_HUB_OFFLINE makes AIPerf take the folder for a Hub name.
            .env_remove("HF_HUB_OFFLINE")
            .output()
            .with_context(|| format!("cannot run {} (install it: scripts/aiperf.sh, or pass --aiperf PATH)", args.aiperf))?;
        let secs = t.elapsed().as_secs_f64();
        let cores = (children_cpu_s() - before) / secs;
        let log = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(dir.join("inputs.json"));
        let _ = std::fs::write(dir.join("aiperf.log"), &log);
        if !o.status.success() {
            let tail: String = log.lines().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            bail!(
                "aiperf failed at concurrency {} ({}); its log is {}:\n{tail}",
                l.concurrency,
                o.status,
                dir.join("aiperf.log").display()
            );
        }
        let file = dir.join("profile_export_aiperf.json");
        let bytes = std::fs::read(&file)
            .with_context(|| format!("aiperf wrote no {} (its log: {})", file.display(), dir.join("aiperf.log").display()))?;
        let v: Value = serde_json::from_slice(&bytes).with_context(|| format!("{} is not JSON", file.display()))?;
        let raw = dir.join("profile_export_raw.jsonl");
        let raw_text = std::fs::read_to_string(&raw).unwrap_or_default();
        let aiperf_prompt = super::metrics::mean(&server_timing(&raw_text, "prompt_ms"));
        let aiperf_tpot = super::metrics::mean(&server_timing(&raw_text, "predicted_per_token_ms"));
        let _ = std::fs::remove_file(&raw);
        out.levels.push(pair(l, &rows, &v, aiperf_prompt, aiperf_tpot, cores, &file));
    }
    for p in out.levels.iter_mut() {
        p.explained = explain(p);
        p.explained_itl = explain_itl(p);
    }
    out.notes.push(format!(
        "aiperf ran after probe's sweep, niced, one worker and one record processor, with the prompts probe sent (an input file deleted after the run, with AIPerf's inputs.json), {} output tokens and the server's token counts (--use-server-token-count); its exports are under {}/aiperf-*",
        args.max_tokens,
        args.out.display()
    ));
    Ok(out)
}

/// AIPerf's command line for one level: the level's concurrency and request count, the prompts
/// in `input`, probe's sampling, the server's token counts, its exports into `dir`.
fn command(args: &BenchArgs, model: &str, endpoint: Endpoint, l: &Level, input: &Path, tokenizer: &Path, dir: &Path) -> Vec<String> {
    let mut cmd: Vec<String> = vec![
        "nice".into(),
        "-n".into(),
        "10".into(),
        args.aiperf.clone(),
        "profile".into(),
        "--model".into(),
        model.to_string(),
        "--url".into(),
        args.url.clone(),
        "--endpoint-type".into(),
        endpoint.name().into(),
        "--streaming".into(),
        "--concurrency".into(),
        l.concurrency.to_string(),
        "--request-count".into(),
        l.requests.to_string(),
        "--input-file".into(),
        input.display().to_string(),
        "--custom-dataset-type".into(),
        "single_turn".into(),
        // Output tokens as the server counts them (probe's source too), not re-tokenized text.
        "--use-server-token-count".into(),
        "--extra-inputs".into(),
        "cache_prompt:false".into(),
        "--extra-inputs".into(),
        format!("seed:{}", args.seed),
        "--extra-inputs".into(),
        format!("temperature:{}", args.temperature),
        "--random-seed".into(),
        args.seed.to_string(),
        "--tokenizer".into(),
        tokenizer.display().to_string(),
        "--artifact-dir".into(),
        dir.display().to_string(),
        "--workers-max".into(),
        "1".into(),
        "--record-processor-service-count".into(),
        "1".into(),
        "--no-gpu-telemetry".into(),
        "--no-server-metrics".into(),
        "--ui-type".into(),
        "none".into(),
        // The raw export holds the server's answers, its `timings` among them (read, then
        // deleted: it holds the answers' text too).
        "--export-level".into(),
        "raw".into(),
    ];
    if endpoint == Endpoint::Chat {
        cmd.push("--use-legacy-max-tokens".into());
    }
    if args.ignore_eos {
        cmd.extend(["--extra-inputs".into(), "ignore_eos:true".into()]);
    }
    cmd
}

/// One level's figures side by side: probe's from its level and rows, AIPerf's from its export
/// `v` and the server timings of its raw export.
fn pair(
    l: &Level,
    rows: &[&super::metrics::Row],
    v: &Value,
    aiperf_prompt: Option<f64>,
    aiperf_tpot: Option<f64>,
    cores: f64,
    file: &Path,
) -> Pair {
    let itl: Vec<f64> = rows.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let probe_prompt = super::metrics::mean(&rows.iter().filter_map(|r| r.prompt_ms).collect::<Vec<_>>());
    let probe_tpot = super::metrics::mean(&rows.iter().filter_map(|r| r.server_tpot_ms).collect::<Vec<_>>());
    Pair {
        level: l.level.clone(),
        concurrency: l.concurrency,
        requests: l.requests,
        probe_ttft_ms_mean: l.ttft_ms_mean,
        aiperf_ttft_ms_mean: metric(v, "time_to_first_token", "avg"),
        probe_ttft_ms_p50: l.ttft_ms_p50,
        aiperf_ttft_ms_p50: metric(v, "time_to_first_token", "p50"),
        probe_itl_ms_mean: super::metrics::mean(&itl),
        aiperf_itl_ms_mean: metric(v, "inter_token_latency", "avg"),
        probe_output_tps: l.throughput_output_tps,
        aiperf_output_tps: metric(v, "output_token_throughput", "avg"),
        probe_output_tokens_mean: l.output_tokens_mean,
        aiperf_output_tokens_mean: metric(v, "output_sequence_length", "avg"),
        probe_server_prompt_ms: probe_prompt,
        aiperf_server_prompt_ms: aiperf_prompt,
        probe_server_tpot_ms: probe_tpot,
        aiperf_server_tpot_ms: aiperf_tpot,
        explained: None,
        explained_itl: None,
        aiperf_cores: (cores > 0.0).then_some(cores),
        export: file.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_metrics_in_any_unit_and_layout() {
        let v = serde_json::json!({"time_to_first_token": {"unit": "ms", "avg": 120.5, "p50": 118.0},
            "inter_token_latency": {"unit": "ns", "avg": 9_500_000.0}});
        assert_eq!(metric(&v, "time_to_first_token", "avg"), Some(120.5));
        assert_eq!(metric(&v, "time_to_first_token", "p50"), Some(118.0));
        assert_eq!(metric(&v, "inter_token_latency", "avg"), Some(9.5));
        assert_eq!(metric(&v, "output_token_throughput", "avg"), None);
        assert_eq!(ratio(Some(100.0), Some(110.0)), "1.10");
        let raw = r#"{"metadata":{},"responses":[{"text":"data: {\"timings\":{\"cache_n\":0,\"prompt_n\":32,\"prompt_ms\":341.622,\"prompt_per_token_ms\":10.6}}"}]}"#;
        assert_eq!(server_timing(&format!("{raw}\n{raw}\n{{}}"), "prompt_ms"), vec![341.622, 341.622]);
        assert_eq!(server_timing(raw, "prompt_per_token_ms"), vec![10.6]);
        assert_eq!(server_timing(r#"{"timings":{"prompt_ms":5.5}}"#, "prompt_ms"), vec![5.5], "unescaped");
        let mut p = Pair { probe_ttft_ms_mean: Some(240.0), aiperf_ttft_ms_mean: Some(300.0), ..Default::default() };
        assert_eq!(explain(&p), None, "no server timings: not explained");
        p.probe_server_prompt_ms = Some(220.0);
        p.aiperf_server_prompt_ms = Some(282.0);
        assert!(explain(&p).unwrap().contains("62 ms longer"), "{:?}", explain(&p));
        p.aiperf_server_prompt_ms = Some(220.0);
        assert_eq!(explain(&p), None, "the gap is on the client side: not explained");
        let mut q = Pair { probe_itl_ms_mean: Some(25.8), aiperf_itl_ms_mean: Some(21.2), ..Default::default() };
        q.probe_server_tpot_ms = Some(25.5);
        q.aiperf_server_tpot_ms = Some(21.0);
        assert!(explain_itl(&q).is_some());
        q.aiperf_server_tpot_ms = Some(25.5);
        assert_eq!(explain_itl(&q), None);
        // CI's case: ITL 9.9% apart, output tokens per second 11%: the server's own per-token time
        // moved as much, so the throughput gap is said too.
        let mut t = Pair { probe_itl_ms_mean: Some(11.78), aiperf_itl_ms_mean: Some(12.95), ..Default::default() };
        (t.probe_server_tpot_ms, t.aiperf_server_tpot_ms) = (Some(11.78), Some(12.96));
        assert_eq!(explain_itl(&t), None, "within 10% and no throughput gap: nothing to explain");
        (t.probe_output_tps, t.aiperf_output_tps) = (Some(68.4), Some(60.7));
        assert!(explain_itl(&t).is_some());
        t.aiperf_server_tpot_ms = Some(10.5);
        assert_eq!(explain_itl(&t), None, "the server ran faster, the client saw it slower: not explained");
    }
}
