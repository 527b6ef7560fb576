//! Response bodies of LLM servers: SSE (`data: {...}`), NDJSON (one JSON per line) or one JSON
//! document, split into messages and read for what matters: is this a content token, and what
//! stop information, server timings, usage or error does it carry. Content itself is not kept.
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sse,
    Ndjson,
    Json,
}

impl Kind {
    /// From the response's content type, or by sniffing the first body bytes.
    pub fn detect(content_type: &str, first: &[u8]) -> Kind {
        if content_type.contains("event-stream") {
            Kind::Sse
        } else if content_type.contains("ndjson") || content_type.contains("jsonl") {
            Kind::Ndjson
        } else if first.starts_with(b"data:") || first.starts_with(b"event:") || first.starts_with(b":") {
            Kind::Sse
        } else {
            Kind::Json
        }
    }
}

/// One message of a stream.
#[derive(Debug, PartialEq)]
pub enum Msg {
    Json(Value),
    /// SSE `data: [DONE]`.
    Done,
    /// A message that is not JSON (or was cut by the capture limit).
    Unparsed,
    /// A message with a hole (bytes not captured): the stop fields found in what was captured.
    Partial(Value),
}

/// Splits body bytes into messages as they arrive, in time linear in the bytes: each byte is
/// scanned for a message end once, and a message's bytes are dropped once it is read.
#[derive(Debug)]
pub struct Splitter {
    pub kind: Kind,
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a message end.
    scanned: usize,
    /// Bytes of the message being collected were not captured.
    holed: bool,
}

/// A message longer than this is not read (it is counted as unread).
pub const MAX_MESSAGE: usize = 1 << 20;

impl Splitter {
    pub fn new(kind: Kind) -> Self {
        Splitter { kind, buf: Vec::new(), scanned: 0, holed: false }
    }

    /// Bytes held for the message being collected.
    pub fn held(&self) -> usize {
        self.buf.capacity()
    }

    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<Msg>) {
        // After a hole, bytes that start a new message mean the holed one ended in the hole
        // (servers write one message per call): read what it left, then go on.
        let starts_message = match self.kind {
            Kind::Sse => bytes.starts_with(b"data:") || bytes.starts_with(b"event:"),
            Kind::Ndjson => bytes.starts_with(b"{"),
            Kind::Json => false,
        };
        if self.holed && starts_message {
            self.holed = false;
            out.push(salvaged(trim(&self.buf)));
            self.clear();
        }
        self.buf.extend_from_slice(bytes);
        // Messages read from the front of `buf`; their bytes are dropped once, at the end.
        let mut start = 0;
        match self.kind {
            Kind::Json => {}
            Kind::Ndjson => {
                while let Some(i) = memchr(b'\n', &self.buf[self.scanned.max(start)..]) {
                    let end = self.scanned.max(start) + i;
                    let line = trim(&self.buf[start..end]);
                    if std::mem::take(&mut self.holed) {
                        out.push(salvaged(line));
                    } else if !line.is_empty() {
                        out.push(serde_json::from_slice(line).map(Msg::Json).unwrap_or(Msg::Unparsed));
                    }
                    start = end + 1;
                }
            }
            Kind::Sse => {
                // A separator may straddle two pushes: look back over its first 3 bytes.
                while let Some((end, sep)) = find_event_end(&self.buf, self.scanned.saturating_sub(3).max(start)) {
                    let event = &self.buf[start..end];
                    if std::mem::take(&mut self.holed) {
                        out.push(salvaged(event));
                    } else {
                        sse_event(event, out);
                    }
                    start = end + sep;
                }
            }
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() > MAX_MESSAGE {
            self.clear();
            out.push(Msg::Unparsed);
        } else if self.buf.capacity() > 64 << 10 && self.buf.capacity() > 4 * self.buf.len() {
            // A long message was read: give its memory back.
            self.buf.shrink_to(2 * self.buf.len());
        }
    }

    fn clear(&mut self) {
        self.buf = Vec::new();
        self.scanned = 0;
    }

    /// The body ended: whatever is buffered is the last message.
    pub fn finish(&mut self, out: &mut Vec<Msg>) {
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        let rest = trim(&rest);
        if std::mem::take(&mut self.holed) {
            out.push(salvaged(rest));
            return;
        }
        if rest.is_empty() {
            return;
        }
        match self.kind {
            Kind::Sse => sse_event(rest, out),
            _ => out.push(serde_json::from_slice(rest).map(Msg::Json).unwrap_or(Msg::Unparsed)),
        }
    }

    /// Bytes were not captured: the message they fall in has a hole. What comes after the hole
    /// (the kernel sends the last bytes of a large write) is searched for stop fields.
    pub fn gap(&mut self, _out: &mut Vec<Msg>) {
        // A NUL marks the hole: no JSON value spans it.
        self.buf.push(0);
        self.holed = true;
    }
}

fn salvaged(bytes: &[u8]) -> Msg {
    salvage(bytes).map(Msg::Partial).unwrap_or(Msg::Unparsed)
}

/// Longest value [`salvage`] reads (a `timings`, `usage` or `error` object is a few hundred bytes).
const MAX_VALUE: usize = 8 << 10;

/// The value after each `"key":` in `text`, as raw text up to where a JSON value of that shape
/// ends (strings honour escapes; objects are brace-balanced); values longer than [`MAX_VALUE`]
/// are cut there (and then do not parse).
fn values_of<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    let pat = format!("\"{key}\"");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find(&pat) {
        let at = from + i + pat.len();
        from = at;
        let Some(rest) = text[at..].trim_start().strip_prefix(':') else { continue };
        let rest = rest.trim_start();
        // A stop field's value is short: looking no further than MAX_VALUE keeps a message of
        // many unclosed `"key":{` linear (every occurrence would scan to the end).
        let cut = (0..=rest.len().min(MAX_VALUE)).rev().find(|&i| rest.is_char_boundary(i)).unwrap_or(0);
        let rest = &rest[..cut];
        let end = match rest.as_bytes().first() {
            Some(b'"') => {
                let mut esc = false;
                rest.char_indices()
                    .skip(1)
                    .find(|&(_, c)| {
                        let end = c == '"' && !esc;
                        esc = c == '\\' && !esc;
                        end
                    })
                    .map(|(i, _)| i + 1)
            }
            Some(b'{') => {
                let (mut depth, mut in_str, mut esc) = (0i32, false, false);
                rest.char_indices()
                    .find(|&(_, c)| {
                        if in_str {
                            if c == '"' && !esc {
                                in_str = false;
                            }
                            esc = c == '\\' && !esc;
                            return false;
                        }
                        match c {
                            '"' => in_str = true,
                            '{' => depth += 1,
                            '}' => depth -= 1,
                            _ => {}
                        }
                        depth == 0
                    })
                    .map(|(i, _)| i + 1)
            }
            Some(_) => Some(rest.find([',', '}', ']', '\n']).unwrap_or(rest.len())),
            None => None,
        };
        if let Some(e) = end {
            out.push(rest[..e].trim());
        }
    }
    out
}

/// Stop fields from a fragment of a JSON message (its start was not captured): the last
/// well-formed value of each key that says how a response ended. None when there is none.
pub fn salvage(bytes: &[u8]) -> Option<Value> {
    let text = String::from_utf8_lossy(bytes);
    let mut o = serde_json::Map::new();
    let last = |key: &str, ok: &dyn Fn(&Value) -> bool| {
        values_of(&text, key).into_iter().rev().filter_map(|v| serde_json::from_str::<Value>(v).ok()).find(|v| ok(v))
    };
    for k in ["stop_type", "done_reason", "finish_reason"] {
        if let Some(v) = last(k, &|v| v.is_string()) {
            o.insert(k.into(), v);
        }
    }
    for k in ["stop", "done", "truncated", "stopped_eos", "stopped_word", "stopped_limit"] {
        if let Some(v) = last(k, &|v| v.is_boolean()) {
            o.insert(k.into(), v);
        }
    }
    for k in ["timings", "usage", "error"] {
        if let Some(v) = last(k, &|v| v.is_object()) {
            o.insert(k.into(), v);
        }
    }
    // These appear only in a final message, whose `stop` / `done` flag may be in the hole.
    if o.contains_key("stop_type") {
        o.entry("stop").or_insert(Value::Bool(true));
    }
    if o.contains_key("done_reason") {
        o.entry("done").or_insert(Value::Bool(true));
    }
    if let Some(f) = o.remove("finish_reason") {
        o.insert("choices".into(), serde_json::json!([{"finish_reason": f}]));
    }
    (!o.is_empty()).then_some(Value::Object(o))
}

fn trim(b: &[u8]) -> &[u8] {
    let s = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let e = b.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(s, |e| e + 1);
    &b[s..e]
}

/// Position of the first `c` in `b`.
fn memchr(c: u8, b: &[u8]) -> Option<usize> {
    b.iter().position(|&x| x == c)
}

/// End of the first SSE event (a blank line) at or after `from`, and the separator's length.
fn find_event_end(b: &[u8], from: usize) -> Option<(usize, usize)> {
    let mut i = from;
    while let Some(n) = memchr(b'\n', &b[i.min(b.len())..]) {
        let nl = i + n;
        // The blank line is "\n\n" or "\r\n\r\n" (the event ends before its first byte).
        if b.get(nl + 1) == Some(&b'\n') {
            return Some(if nl >= 1 && b[nl - 1] == b'\r' { (nl - 1, 3) } else { (nl, 2) });
        }
        if b.get(nl + 1) == Some(&b'\r') && b.get(nl + 2) == Some(&b'\n') {
            return Some(if nl >= 1 && b[nl - 1] == b'\r' { (nl - 1, 4) } else { (nl, 3) });
        }
        i = nl + 1;
    }
    None
}

fn sse_event(event: &[u8], out: &mut Vec<Msg>) {
    let text = String::from_utf8_lossy(event);
    let mut data = String::new();
    let mut name = "";
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        } else if let Some(e) = line.strip_prefix("event:") {
            name = e.trim();
        } else if let Some(e) = line.strip_prefix("error:") {
            // llama.cpp has sent errors as `error: {...}` lines.
            out.push(serde_json::from_str::<Value>(e.trim()).map(|v| Msg::Json(serde_json::json!({"error": v}))).unwrap_or(Msg::Unparsed));
        }
    }
    if data.is_empty() {
        return;
    }
    if data.trim() == "[DONE]" {
        out.push(Msg::Done);
        return;
    }
    match serde_json::from_str::<Value>(&data) {
        Ok(v) if name == "error" && v.get("error").is_none() => out.push(Msg::Json(serde_json::json!({"error": v}))),
        Ok(v) => out.push(Msg::Json(v)),
        Err(_) => out.push(Msg::Unparsed),
    }
}

/// What the stream said about why it stopped, and the server's own numbers.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stop {
    /// OpenAI-style `finish_reason` (stop | length | tool_calls | ...).
    pub finish_reason: Option<String>,
    /// vLLM `stop_reason` (the stop string or token id).
    pub stop_reason: Option<Value>,
    /// llama.cpp `/completion`: `stop_type` (none | eos | limit | word), `truncated`, older `stopped_*`.
    pub stop_type: Option<String>,
    pub truncated: Option<bool>,
    pub stopped: Option<String>,
    /// Ollama `done_reason` (stop | length | load | unload).
    pub done_reason: Option<String>,
    /// A terminal message was seen: `[DONE]`, `"stop": true` or `"done": true`.
    pub done_marker: bool,
    pub server_timings: Option<Value>,
    pub usage: Option<Value>,
    /// A mid-stream or body error: its code and type (the message only with --capture-text).
    pub error: Option<Value>,
    /// llama.cpp's `id_slot`: the slot (the engine's sequence id) that served the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_slot: Option<i64>,
}

impl Stop {
    /// The server said it stopped: a stop reason of any server, a terminal marker or an error.
    pub fn is_final(&self) -> bool {
        self.finish_reason.is_some()
            || self.stop_type.is_some()
            || self.stopped.is_some()
            || self.done_reason.is_some()
            || self.done_marker
            || self.error.is_some()
    }

    /// The server's error said its context (a slot's, or the shared KV pool) ran out.
    pub fn context_exceeded(&self) -> bool {
        self.error_reason() == Some(ErrorReason::ContextExceeded)
    }

    /// What probe read in the server's error message ([`apply`] wrote it), if anything.
    pub fn error_reason(&self) -> Option<ErrorReason> {
        self.error.as_ref()?.get(ErrorReason::KEY)?.as_str()?.parse().ok()
    }
}

crate::closed_set! {
    /// What a server's error message says, as probe words it in [`Stop::error`] (under
    /// [`ErrorReason::KEY`]): the message itself stays out unless the user asked for it.
    ErrorReason {
        /// The server's context (a slot's, or the shared KV pool) ran out.
        #[default]
        ContextExceeded = "context_exceeded",
    }
}

impl ErrorReason {
    /// The key it is written under in the error object.
    pub const KEY: &str = "reason";
}

/// Output tokens and where the number came from: the server's usage, its timings, Ollama's
/// eval_count, or the content messages the client counted.
pub fn output_tokens(stop: &Stop, chunks: usize) -> (u64, &'static str) {
    if let Some(n) = stop.usage.as_ref().and_then(|u| u["completion_tokens"].as_u64()) {
        return (n, "usage");
    }
    if let Some(n) = stop.server_timings.as_ref().and_then(|t| t["predicted_n"].as_u64()) {
        return (n, "timings");
    }
    if let Some(n) = stop.server_timings.as_ref().and_then(|t| t["eval_count"].as_u64()) {
        return (n, "eval_count");
    }
    (chunks as u64, "chunks")
}

fn s(v: &Value) -> Option<String> {
    v.as_str().map(String::from)
}

/// Numbers only: keeps server timings/usage objects free of any text.
fn numbers(v: &Value) -> Option<Value> {
    let o = v.as_object()?;
    let m: serde_json::Map<String, Value> = o
        .iter()
        .filter(|(_, x)| x.is_number() || x.is_object())
        .map(|(k, x)| (k.clone(), if x.is_object() { numbers(x).unwrap_or(Value::Null) } else { x.clone() }))
        .collect();
    Some(Value::Object(m))
}

fn nonempty(v: &Value) -> bool {
    match v {
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Null => false,
        _ => true,
    }
}

/// Whether an error message says the server's context (slot or shared KV pool) ran out.
pub fn context_exceeded(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("context") && (m.contains("exceed") || m.contains("too long") || m.contains("full"))
}

/// The API a response message belongs to, by its own shape (the request's head was not seen):
/// OpenAI's `object` names it; llama.cpp's native `/completion` and Ollama's `/api/chat` and
/// `/api/generate` have fields of their own.
pub fn api_of(v: &Value) -> Option<&'static str> {
    match v.get("object").and_then(Value::as_str) {
        Some("chat.completion.chunk" | "chat.completion") => return Some("/v1/chat/completions"),
        Some("text_completion") => return Some("/v1/completions"),
        _ => {}
    }
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        if choice.get("delta").is_some() || choice.get("message").is_some() {
            return Some("/v1/chat/completions");
        }
        if choice.get("text").is_some() {
            return Some("/v1/completions");
        }
    }
    if v.get("done").is_some() {
        if v.get("message").is_some() {
            return Some("/api/chat");
        }
        if v.get("response").is_some() {
            return Some("/api/generate");
        }
    }
    if v.get("content").is_some() && ["stop", "id_slot", "tokens", "stop_type"].iter().any(|k| v.get(*k).is_some()) {
        return Some("/completion");
    }
    None
}

/// Read one message. Returns true when it carries generated content (a token or more).
pub fn apply(v: &Value, stop: &mut Stop, keep_text: bool) -> bool {
    let mut content = false;
    if let Some(err) = v.get("error") {
        let mut e = serde_json::Map::new();
        for k in ["code", "type"] {
            if let Some(x) = err.get(k) {
                e.insert(k.into(), x.clone());
            }
        }
        // The sizes a refusal quotes (llama.cpp's exceed_context_size_error: the prompt's tokens
        // and the slot's context): numbers, never text.
        for k in ["n_prompt_tokens", "n_ctx"] {
            if let Some(x) = err.get(k).filter(|x| x.is_u64()) {
                e.insert(k.into(), x.clone());
            }
        }
        let message = err.get("message").or(Some(err).filter(|e| e.is_string()));
        // What the message says, as a word from a closed set: the text itself stays out unless
        // the user asked for it (it may quote the prompt).
        if message.and_then(Value::as_str).is_some_and(context_exceeded) {
            e.insert(ErrorReason::KEY.into(), Value::String(ErrorReason::ContextExceeded.name().into()));
        }
        if keep_text && let Some(m) = message {
            e.insert("message".into(), m.clone());
        }
        stop.error = Some(Value::Object(e));
    }
    // OpenAI chat/completions (llama-server /v1, vLLM, Ollama /v1, LM Studio).
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        if let Some(d) = choice.get("delta") {
            content |= ["content", "reasoning_content", "tool_calls", "reasoning"].iter().any(|k| d.get(*k).is_some_and(nonempty));
        }
        if let Some(m) = choice.get("message") {
            content |= m.get("content").is_some_and(nonempty) || m.get("tool_calls").is_some_and(nonempty);
        }
        content |= choice.get("text").is_some_and(nonempty);
        if let Some(f) = choice.get("finish_reason").and_then(s) {
            stop.finish_reason = Some(f);
        }
        if let Some(r) = choice.get("stop_reason").filter(|r| !r.is_null()) {
            stop.stop_reason = Some(r.clone());
        }
    }
    // llama.cpp native /completion.
    if v.get("choices").is_none() && v.get("message").is_none() {
        content |= v.get("content").is_some_and(nonempty);
    }
    if v.get("stop") == Some(&Value::Bool(true)) {
        stop.done_marker = true;
        stop.stop_type = v.get("stop_type").and_then(s).or(stop.stop_type.take());
        stop.truncated = v.get("truncated").and_then(Value::as_bool).or(stop.truncated);
        for k in ["stopped_eos", "stopped_word", "stopped_limit"] {
            if v.get(k) == Some(&Value::Bool(true)) {
                stop.stopped = Some(k.trim_start_matches("stopped_").into());
            }
        }
    }
    // Ollama native /api/generate and /api/chat (NDJSON).
    content |= v.get("response").is_some_and(nonempty);
    if let Some(m) = v.get("message") {
        content |= m.get("content").is_some_and(nonempty) || m.get("tool_calls").is_some_and(nonempty);
    }
    if v.get("done") == Some(&Value::Bool(true)) {
        stop.done_marker = true;
        stop.done_reason = v.get("done_reason").and_then(s);
        let keys = ["total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"];
        // Numbers only: a server (or a proxy) may put text anywhere.
        let t: serde_json::Map<String, Value> =
            keys.iter().filter_map(|k| Some((k.to_string(), v.get(*k).filter(|x| x.is_number())?.clone()))).collect();
        if !t.is_empty() {
            stop.server_timings = Some(Value::Object(t));
        }
    }
    if let Some(n) = v.get("id_slot").and_then(Value::as_i64) {
        stop.id_slot = Some(n);
    }
    if let Some(t) = v.get("timings").and_then(numbers) {
        stop.server_timings = Some(t);
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()).and_then(numbers) {
        stop.usage = Some(u);
    }
    content
}

/// The prompt of a request body as one byte string: llama.cpp / OpenAI / Ollama `prompt` (text,
/// or token ids), else the chat `messages` (role and content of each, text parts of a list).
fn prompt_bytes(body: &Value) -> Option<Vec<u8>> {
    fn text(v: &Value, out: &mut Vec<u8>) {
        match v {
            Value::String(s) => out.extend_from_slice(s.as_bytes()),
            Value::Number(n) => {
                out.extend_from_slice(n.to_string().as_bytes());
                out.push(b' ');
            }
            Value::Array(a) => a.iter().for_each(|x| text(x, out)),
            Value::Object(o) => {
                for k in ["role", "content", "text"] {
                    if let Some(x) = o.get(k) {
                        text(x, out);
                        out.push(0);
                    }
                }
            }
            _ => {}
        }
    }
    let v = body.get("prompt").or_else(|| body.get("messages")).filter(|v| !v.is_null())?;
    let mut out = Vec::new();
    text(v, &mut out);
    (!out.is_empty()).then_some(out)
}

/// The shortest prefix fingerprinted (bytes); then twice as long each time.
pub const PREFIX_MIN: usize = 64;

/// Fingerprints of the prompt's prefixes, to tell whether two requests of one trace began the
/// same way without keeping any text: (length, keyed hash) of its first 64, 128, 256, ... bytes
/// and of the whole. The key is random per process, so the hashes mean nothing outside the trace
/// that made them (a short prompt cannot be guessed from its hash). With the prompt's size.
pub fn prompt_prefixes(body: &Value) -> Option<(u64, Vec<(u32, u64)>)> {
    use std::hash::BuildHasher as _;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    let key = KEY.get_or_init(std::collections::hash_map::RandomState::new);
    let p = prompt_bytes(body)?;
    let mut lens: Vec<usize> = std::iter::successors(Some(PREFIX_MIN), |l| l.checked_mul(2)).take_while(|&l| l < p.len()).collect();
    lens.push(p.len());
    Some((p.len() as u64, lens.into_iter().map(|l| (l as u32, key.hash_one(&p[..l]))).collect()))
}

/// How many bytes two fingerprinted prompts share at their start, at the fingerprints' grain.
pub fn shared_prefix(a: &[(u32, u64)], b: &[(u32, u64)]) -> u64 {
    a.iter().filter(|x| b.contains(x)).map(|x| u64::from(x.0)).max().unwrap_or(0)
}

/// Requested output limit from a request body: OpenAI `max_tokens` / `max_completion_tokens`,
/// llama.cpp `n_predict`, Ollama `options.num_predict`.
pub fn max_tokens(body: &Value) -> Option<i64> {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .or_else(|| body.get("n_predict"))
        .or_else(|| body.get("options").and_then(|o| o.get("num_predict")))
        .and_then(Value::as_i64)
}

/// Same as [`max_tokens`] and `stream` for a body cut by the capture limit: a lenient scan for
/// `"key": number` / `"stream": bool` in the bytes that were captured.
pub fn scan_fields(body: &[u8]) -> (Option<i64>, Option<bool>) {
    let text = String::from_utf8_lossy(body);
    let num = |key: &str| -> Option<i64> {
        let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
        let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '-')).unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    let max = ["max_completion_tokens", "max_tokens", "n_predict", "num_predict"].iter().find_map(|k| num(k));
    let stream = text.find("\"stream\"").and_then(|at| {
        let rest = text[at + 8..].trim_start().strip_prefix(':')?.trim_start();
        if rest.starts_with("true") {
            Some(true)
        } else if rest.starts_with("false") {
            Some(false)
        } else {
            None
        }
    });
    (max, stream)
}

#[cfg(test)]
mod salvage_tests {
    use super::*;

    #[test]
    fn reads_stop_fields_from_the_end_of_a_cut_message() {
        // The end of llama.cpp's final /completion chunk after a long prompt echo.
        let tail = br#"ng fox","has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":560,"timings":{"cache_n":0,"prompt_n":545,"prompt_ms":2040.5,"predicted_n":16,"predicted_ms":120.0}}"#;
        let v = salvage(tail).unwrap();
        let mut stop = Stop::default();
        assert!(!apply(&v, &mut stop, false));
        assert_eq!(stop.stop_type.as_deref(), Some("limit"));
        assert_eq!(stop.truncated, Some(false));
        assert_eq!(stop.server_timings.unwrap()["prompt_n"], 545);
        // OpenAI non-streamed answer: finish_reason and usage after the message.
        let tail = br#"e end."},"finish_reason":"length","index":0}],"usage":{"completion_tokens":400,"prompt_tokens":12}}"#;
        let mut stop = Stop::default();
        apply(&salvage(tail).unwrap(), &mut stop, false);
        assert_eq!(stop.finish_reason.as_deref(), Some("length"));
        assert_eq!(stop.usage.unwrap()["completion_tokens"], 400);
        assert_eq!(salvage(b"just some text \"x\": 1"), None);
    }

    /// A context error is kept as probe's word (not the message's text) and read back typed.
    #[test]
    fn context_errors_are_worded() {
        let read = |text: &str| {
            let mut stop = Stop::default();
            apply(&serde_json::from_str(text).unwrap(), &mut stop, false);
            stop
        };
        let stop = read(
            r#"{"error":{"code":400,"type":"exceed_context_size_error","message":"the request exceeds the available context size","n_ctx":4096}}"#,
        );
        assert!(stop.context_exceeded());
        let kept = r#"{"code":400,"n_ctx":4096,"reason":"context_exceeded","type":"exceed_context_size_error"}"#;
        assert_eq!(serde_json::to_string(&stop.error).unwrap(), kept);
        let other = read(r#"{"error":{"code":500,"message":"boom"}}"#);
        assert!(other.error.is_some() && !other.context_exceeded());
    }

    /// Found by fuzzing: Ollama's final message kept whatever its timing fields held.
    #[test]
    fn ollama_timings_keep_numbers_only() {
        let mut stop = Stop::default();
        apply(&serde_json::json!({"done": true, "total_duration": "secret prompt text", "eval_count": 12}), &mut stop, false);
        assert_eq!(stop.server_timings, Some(serde_json::json!({"eval_count": 12})));
    }

    /// Found by fuzzing: thousands of unclosed `"timings":{` made salvage quadratic.
    #[test]
    fn salvage_is_linear_in_unclosed_values() {
        let mut text = br#""stop":true,"stop_type":"eos","#.to_vec();
        text.extend(br#""timings":{"#.repeat(90_000));
        let t = std::time::Instant::now();
        let v = salvage(&text).unwrap();
        assert_eq!(v["stop_type"], "eos");
        assert!(t.elapsed() < std::time::Duration::from_secs(3), "salvage took {:?}", t.elapsed());
    }

    /// Any split of the same bytes gives the same messages; a message split into many small
    /// pushes, or many messages in one push, cost linear time.
    #[test]
    fn splitting_is_linear_and_split_independent() {
        let wire = b"data: {\"a\":1}\r\n\r\nevent: x\ndata: {\"b\":2}\n\ndata: [DONE]\n\r\n: c\n\n";
        let whole = {
            let mut s = Splitter::new(Kind::Sse);
            let mut out = Vec::new();
            s.push(wire, &mut out);
            s.finish(&mut out);
            out
        };
        assert_eq!(whole.len(), 3, "{whole:?}");
        for cut in 0..wire.len() {
            for cut2 in cut..wire.len() {
                let mut s = Splitter::new(Kind::Sse);
                let mut out = Vec::new();
                for part in [&wire[..cut], &wire[cut..cut2], &wire[cut2..]] {
                    s.push(part, &mut out);
                }
                s.finish(&mut out);
                assert_eq!(out, whole, "cuts {cut} {cut2}");
            }
        }
        let t = std::time::Instant::now();
        // One message of almost MAX_MESSAGE bytes, 16 bytes a push.
        let mut s = Splitter::new(Kind::Sse);
        let mut out = Vec::new();
        s.push(b"data: {\"content\":\"", &mut out);
        for _ in 0..(MAX_MESSAGE - 64) / 16 {
            s.push(b"abcdefghijklmnop", &mut out);
        }
        s.push(b"\"}\n\n", &mut out);
        assert!(matches!(&out[..], [Msg::Json(_)]), "{}", out.len());
        // 200 000 NDJSON lines in one push.
        let mut s = Splitter::new(Kind::Ndjson);
        let lines = b"{\"response\":\"x\",\"done\":false}\n".repeat(200_000);
        let mut out = Vec::new();
        s.push(&lines, &mut out);
        assert_eq!(out.len(), 200_000);
        assert!(s.held() < 1 << 20, "a read message's bytes are kept: {}", s.held());
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "splitting took {:?}", t.elapsed());
    }

    #[test]
    fn a_gap_then_the_tail_gives_a_partial_message() {
        let mut sp = Splitter::new(Kind::Sse);
        let mut out = Vec::new();
        sp.push(b"data: {\"content\":\"a\",\"stop\":false}\n\ndata: {\"content\":\"\",\"prompt\":\"long", &mut out);
        sp.gap(&mut out);
        sp.push(b"text\",\"stop\":true,\"stop_type\":\"eos\"}\n\n", &mut out);
        assert_eq!(out.len(), 2);
        assert!(matches!(&out[1], Msg::Partial(v) if v["stop_type"] == "eos" && v["stop"] == true), "{out:?}");
    }
}
