//! What differs between servers: the generation request body per API, the health route, the
//! server's own counters (Prometheus `/metrics`, llama.cpp `/slots` and `/props`, Ollama
//! `/api/ps`), its tokenizer endpoint, and where the output token count comes from.
use std::{collections::BTreeMap, time::Duration};

use serde_json::{Value, json};

use super::client::{Url, request};
use crate::stream::payload::Stop;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// OpenAI-compatible `/v1/completions` (vLLM, llama-server, Ollama, LM Studio).
    Openai,
    /// OpenAI-compatible `/v1/chat/completions`: the prompt as one user message, through the
    /// model's chat template (answers end at EOS as in real use).
    Chat,
    /// llama.cpp's native `/completion`.
    Llamacpp,
    /// Ollama's native `/api/generate` (NDJSON).
    Ollama,
}

/// Sampling and limits that stay fixed across a sweep.
#[derive(Clone, Debug)]
pub struct Sampling {
    pub max_tokens: u64,
    pub seed: u64,
    pub temperature: f64,
    pub ignore_eos: bool,
    pub model: Option<String>,
    /// Let the server reuse its prompt cache (the shared-prefix and multi-turn workloads);
    /// otherwise every request is prefilled in full (llama-server `cache_prompt: false`).
    pub cache_prompt: bool,
}

/// A generation request's body, every API's fields in one: a field an API does not send stays
/// None (left out). Declared in sorted order: the bodies are byte for byte what a JSON map of
/// the same keys (sorted) wrote before.
#[derive(Debug, Default, serde::Serialize)]
struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_prompt: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<Vec<Message<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_predict: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    options: Option<OllamaOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    raw: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
}

impl Body<'_> {
    /// What every OpenAI-style and llama.cpp body carries: the fixed sampling, streamed.
    fn sampled(s: &Sampling) -> Self {
        Body { seed: Some(s.seed), temperature: Some(s.temperature), stream: true, ..Default::default() }
    }
}

/// One chat message (keys in sorted order, as above).
#[derive(Debug, serde::Serialize)]
struct Message<'a> {
    content: &'a str,
    role: &'a str,
}

#[derive(Debug, serde::Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// Ollama's sampling `options` (keys in sorted order).
#[derive(Debug, serde::Serialize)]
struct OllamaOptions {
    num_predict: u64,
    seed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<Vec<String>>,
    temperature: f64,
}

impl Api {
    /// The `--api` value and what it speaks: "openai: /v1/completions".
    pub fn describe(self) -> &'static str {
        match self {
            Api::Openai => "openai: /v1/completions",
            Api::Chat => "chat: /v1/chat/completions",
            Api::Llamacpp => "llamacpp: /completion",
            Api::Ollama => "ollama: /api/generate",
        }
    }

    /// The route and JSON body of one streamed generation request.
    pub fn generate(self, prompt: &str, s: &Sampling) -> (&'static str, String) {
        // The instruction only: the answer openers of PROMPTS are for raw completion routes.
        let instruction = prompt.split("\n\n").next().unwrap_or(prompt);
        self.request(prompt, vec![Message { role: "user", content: instruction }], s)
    }

    /// The route and body: `prompt` on the completion routes, `messages` on the chat route.
    fn request(self, prompt: &str, messages: Vec<Message<'_>>, s: &Sampling) -> (&'static str, String) {
        let ignore_eos = s.ignore_eos.then_some(true);
        let body = match self {
            // The two OpenAI routes differ only in `prompt` (completions) or `messages` (chat).
            Api::Openai | Api::Chat => Body {
                prompt: (self == Api::Openai).then_some(prompt),
                messages: (self == Api::Chat).then_some(messages),
                max_tokens: Some(s.max_tokens),
                stream_options: Some(StreamOptions { include_usage: true }),
                model: s.model.as_deref(),
                ignore_eos,
                // llama-server: no prompt cache reuse between the same prompts at different levels
                // (unless the workload is about the cache).
                cache_prompt: Some(s.cache_prompt),
                ..Body::sampled(s)
            },
            Api::Llamacpp => Body {
                prompt: Some(prompt),
                n_predict: Some(s.max_tokens),
                ignore_eos,
                cache_prompt: Some(s.cache_prompt),
                ..Body::sampled(s)
            },
            Api::Ollama => Body {
                model: Some(s.model.as_deref().unwrap_or_default()),
                prompt: Some(prompt),
                raw: Some(true),
                options: Some(OllamaOptions {
                    num_predict: s.max_tokens,
                    seed: s.seed,
                    // Ollama has no ignore_eos; dropping the stop words is the closest it offers.
                    stop: s.ignore_eos.then(Vec::new),
                    temperature: s.temperature,
                }),
                stream: true,
                ..Default::default()
            },
        };
        let path = match self {
            Api::Openai => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Llamacpp => "/completion",
            Api::Ollama => "/api/generate",
        };
        (path, serde_json::to_string(&body).unwrap_or_default())
    }

    /// A conversation (role, text) as one request: messages on the chat route, a plain
    /// transcript ("System: …\n\nUser: …\nAssistant:") on the completion routes.
    pub fn generate_messages(self, messages: &[(&str, &str)], s: &Sampling) -> (&'static str, String) {
        if self == Api::Chat {
            return self.request("", messages.iter().map(|&(role, content)| Message { role, content }).collect(), s);
        }
        let mut text = String::new();
        for (role, t) in messages {
            match *role {
                "system" => text.push_str(&format!("{t}\n\n")),
                "user" => text.push_str(&format!("User: {t}\n")),
                _ => text.push_str(&format!("Assistant: {t}\n")),
            }
        }
        text.push_str("Assistant:");
        self.generate(&text, s)
    }

    pub fn health_path(self) -> &'static str {
        match self {
            Api::Ollama => "/api/version",
            _ => "/health",
        }
    }
}

pub use crate::stream::payload::output_tokens;

/// Prompt tokens the server took from its cache: `usage.prompt_tokens_details.cached_tokens`
/// (OpenAI, vLLM, newer llama-server), else llama.cpp's `timings.cache_n`.
pub fn cached_tokens(stop: &Stop) -> Option<u64> {
    stop.usage
        .as_ref()
        .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
        .or_else(|| stop.server_timings.as_ref().and_then(|t| t["cache_n"].as_u64()))
}

/// Prompt tokens and the server's prompt processing time (ms), when it reports them.
pub fn prompt_stats(stop: &Stop) -> (Option<u64>, Option<f64>) {
    let t = stop.server_timings.as_ref();
    let n = stop
        .usage
        .as_ref()
        .and_then(|u| u["prompt_tokens"].as_u64())
        .or_else(|| t.and_then(|t| t["prompt_n"].as_u64().map(|n| n + t["cache_n"].as_u64().unwrap_or(0))))
        .or_else(|| t.and_then(|t| t["prompt_eval_count"].as_u64()));
    let ms = t.and_then(|t| t["prompt_ms"].as_f64().or_else(|| t["prompt_eval_duration"].as_f64().map(|ns| ns / 1e6)));
    (n, ms)
}

/// What the server says about itself before a run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ServerInfo {
    /// Context per slot (llama.cpp /slots or /props), tokens.
    pub slot_ctx: Option<u64>,
    pub slots: Option<u64>,
    pub model: Option<String>,
    /// The model file the server reports (llama.cpp /props model_path).
    pub model_path: Option<String>,
    pub tokenizer: Option<String>,
    pub notes: Vec<String>,
}

const T: Duration = Duration::from_secs(10);

fn get_json(url: &Url, path: &str) -> Result<Value, String> {
    match request(url, "GET", path, None, T)? {
        (200, b) => serde_json::from_slice(&b).map_err(|_| format!("{path}: not JSON")),
        (st, _) => Err(format!("{path}: HTTP {st}")),
    }
}

pub fn server_info(url: &Url, api: Api, model: Option<String>) -> ServerInfo {
    let mut info = ServerInfo { model, ..Default::default() };
    // /props first: it answers without waking a sleeping llama-server; /slots would reload the
    // model, so it is read only when /props did not give the slots' context.
    match get_json(url, "/props") {
        Ok(p) => {
            info.slot_ctx = p["default_generation_settings"]["n_ctx"].as_u64();
            info.slots = p["total_slots"].as_u64();
            info.model_path = p["model_path"].as_str().map(String::from);
        }
        Err(_) => info.notes.push("no /props".into()),
    }
    if info.slot_ctx.is_none() {
        match get_json(url, "/slots") {
            Ok(Value::Array(slots)) => {
                info.slots = info.slots.or(Some(slots.len() as u64));
                info.slot_ctx = slots.first().and_then(|s| s["n_ctx"].as_u64());
            }
            _ => info.notes.push("no /slots (per-slot context unknown from it)".into()),
        }
    }
    if tokenize(url, "hello", info.model.as_deref()).is_some() {
        info.tokenizer = Some("POST /tokenize".into());
    } else {
        info.notes.push("no tokenizer endpoint: prompt sizes are estimated at 4 characters a token".into());
    }
    if info.model.is_none() {
        info.model = match api {
            Api::Openai | Api::Chat => get_json(url, "/v1/models").ok().and_then(|m| m["data"][0]["id"].as_str().map(String::from)),
            Api::Ollama => get_json(url, "/api/ps")
                .ok()
                .and_then(|m| m["models"][0]["name"].as_str().map(String::from))
                .or_else(|| get_json(url, "/api/tags").ok().and_then(|m| m["models"][0]["name"].as_str().map(String::from))),
            Api::Llamacpp => None,
        };
    }
    info
}

/// Token count of `text` by the server's tokenizer: llama.cpp `POST /tokenize {"content"}`,
/// vLLM `POST /tokenize {"prompt"}`. None when the server has no tokenizer endpoint.
pub fn tokenize(url: &Url, text: &str, model: Option<&str>) -> Option<u64> {
    let body = json!({"content": text}).to_string();
    if let Ok((200, b)) = request(url, "POST", "/tokenize", Some(&body), T)
        && let Some(n) = serde_json::from_slice::<Value>(&b).ok().and_then(|v| v["tokens"].as_array().map(|t| t.len() as u64))
    {
        return Some(n);
    }
    let mut body = json!({"prompt": text});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    match request(url, "POST", "/tokenize", Some(&body.to_string()), T) {
        Ok((200, b)) => {
            serde_json::from_slice::<Value>(&b).ok().and_then(|v| v["count"].as_u64().or(v["tokens"].as_array().map(|t| t.len() as u64)))
        }
        _ => None,
    }
}

/// Prometheus text: sum of each series' samples by metric name (labels summed over).
pub fn parse_prometheus(text: &str) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for (name, _, value) in crate::sampler::endpoints::prometheus_samples(text) {
        *m.entry(name.to_string()).or_insert(0.0) += value;
    }
    m
}

/// Counters worth a before/after per level: preemptions, KV cache use, waiting/deferred
/// requests, tokens; and free VRAM where NVML sees a GPU.
pub fn wanted(name: &str) -> bool {
    let keys = [
        "preempt",
        "kv_cache",
        "cache_usage",
        "deferred",
        "waiting",
        "running",
        "processing",
        "tokens_total",
        "predicted_total",
        "n_tokens_max",
        "busy_slots",
    ];
    (name.starts_with("llamacpp:") || name.starts_with("vllm:"))
        && !name.contains("spec_decode")
        && !name.ends_with("_bucket")
        && !name.ends_with("_created")
        && keys.iter().any(|k| name.contains(k))
}

/// A snapshot of the server's own counters; `notes` says which endpoints did not answer.
pub fn counters(url: &Url, api: Api) -> (BTreeMap<String, f64>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut notes = Vec::new();
    match request(url, "GET", "/metrics", None, T) {
        Ok((200, b)) => out.extend(parse_prometheus(&String::from_utf8_lossy(&b)).into_iter().filter(|(k, _)| wanted(k))),
        Ok((st, _)) => notes.push(format!("/metrics answered HTTP {st} (llama-server needs --metrics)")),
        Err(e) => notes.push(format!("/metrics: {e}")),
    }
    if api == Api::Ollama {
        match get_json(url, "/api/ps") {
            Ok(ps) => {
                let models = ps["models"].as_array().cloned().unwrap_or_default();
                out.insert("ollama:models_loaded".into(), models.len() as f64);
                out.insert("ollama:size_vram_bytes".into(), models.iter().filter_map(|m| m["size_vram"].as_f64()).sum());
                out.insert("ollama:size_bytes".into(), models.iter().filter_map(|m| m["size"].as_f64()).sum());
            }
            Err(e) => notes.push(format!("/api/ps: {e}")),
        }
    }
    if let Some(free) = free_vram_mib() {
        out.insert("gpu:free_vram_mib".into(), free);
    }
    (out, notes)
}

/// Free VRAM over all GPUs (MiB), through the same NVML source `probe trace` samples with
/// (sampler::gpu). NVML is opened once and kept; no NVIDIA GPU → None.
fn free_vram_mib() -> Option<f64> {
    use std::sync::{Mutex, OnceLock};
    type Source = Option<Mutex<Box<dyn crate::sampler::gpu::GpuSource>>>;
    static GPU: OnceLock<Source> = OnceLock::new();
    let gpu = GPU.get_or_init(|| crate::sampler::gpu::open().ok().map(Mutex::new)).as_ref()?;
    let samples = gpu.lock().ok()?.sample(&[]);
    let free: Vec<f64> = samples.iter().filter_map(|g| g.vram_free).map(|b| b as f64 / (1u64 << 20) as f64).collect();
    (!free.is_empty()).then(|| free.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_sums_labels_and_skips_comments() {
        let text = "# HELP x\nllamacpp:requests_deferred 2\nvllm:num_preemptions_total{model=\"a\"} 3\nvllm:num_preemptions_total{model=\"b\"} 4\nvllm:kv_cache_usage_perc{m=\"a\"} 0.5 1700000000\nbad line here x\n";
        let m = parse_prometheus(text);
        assert_eq!(m["llamacpp:requests_deferred"], 2.0);
        assert_eq!(m["vllm:num_preemptions_total"], 7.0);
        assert_eq!(m["vllm:kv_cache_usage_perc"], 0.5);
        assert!(wanted("vllm:num_preemptions_total") && wanted("llamacpp:requests_deferred") && !wanted("process_cpu_seconds_total"));
    }

    #[test]
    fn output_token_sources() {
        let mut s = Stop::default();
        assert_eq!(output_tokens(&s, 7), (7, "chunks"));
        s.server_timings = Some(json!({"predicted_n": 9, "prompt_n": 5, "cache_n": 1, "prompt_ms": 12.5}));
        assert_eq!(output_tokens(&s, 7), (9, "timings"));
        assert_eq!(prompt_stats(&s), (Some(6), Some(12.5)));
        s.usage = Some(json!({"completion_tokens": 10, "prompt_tokens": 6}));
        assert_eq!(output_tokens(&s, 7), (10, "usage"));
        let o = Stop {
            server_timings: Some(json!({"eval_count": 4, "prompt_eval_count": 3, "prompt_eval_duration": 2e6})),
            ..Default::default()
        };
        assert_eq!(output_tokens(&o, 1), (4, "eval_count"));
        assert_eq!(prompt_stats(&o), (Some(3), Some(2.0)));
    }

    #[test]
    fn bodies_fix_sampling() {
        let s = Sampling { max_tokens: 32, seed: 7, temperature: 0.0, ignore_eos: true, model: Some("m".into()), cache_prompt: false };
        let (p, b) = Api::Llamacpp.generate("hi", &s);
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(
            (p, v["n_predict"].as_u64(), v["seed"].as_u64(), v["ignore_eos"].as_bool()),
            ("/completion", Some(32), Some(7), Some(true))
        );
        let (p, b) = Api::Ollama.generate("hi", &s);
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!((p, v["options"]["num_predict"].as_u64(), v["model"].as_str()), ("/api/generate", Some(32), Some("m")));
        let (p, b) = Api::Openai.generate("hi", &s);
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!((p, v["max_tokens"].as_u64(), v["stream"].as_bool()), ("/v1/completions", Some(32), Some(true)));
        let (p, b) = Api::Chat.generate("Write a story.\n\nOnce upon a time,", &s);
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!((p, v["messages"][0]["content"].as_str()), ("/v1/chat/completions", Some("Write a story.")));
    }

    #[test]
    fn bodies_are_written_in_sorted_key_order_as_a_json_map_was() {
        for ignore_eos in [false, true] {
            let s = Sampling { max_tokens: 8, seed: 1, temperature: 0.5, ignore_eos, model: Some("m".into()), cache_prompt: true };
            for api in [Api::Openai, Api::Chat, Api::Llamacpp, Api::Ollama] {
                let (_, b) = api.generate("hi", &s);
                // A serde_json map sorts its keys: the same text means the same bytes as before.
                assert_eq!(b, serde_json::from_str::<Value>(&b).unwrap().to_string(), "{api:?}");
            }
            let (_, b) = Api::Chat.generate_messages(&[("system", "a"), ("user", "b")], &s);
            assert_eq!(b, serde_json::from_str::<Value>(&b).unwrap().to_string());
            assert!(b.contains(r#""messages":[{"content":"a","role":"system"},{"content":"b","role":"user"}]"#), "{b}");
        }
        let s = Sampling { max_tokens: 8, seed: 1, temperature: 0.0, ignore_eos: true, model: None, cache_prompt: false };
        assert_eq!(
            Api::Ollama.generate("hi", &s).1,
            r#"{"model":"","options":{"num_predict":8,"seed":1,"stop":[],"temperature":0.0},"prompt":"hi","raw":true,"stream":true}"#
        );
    }
}
