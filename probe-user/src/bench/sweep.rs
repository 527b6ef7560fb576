//! Running a level: `concurrency` workers (closed loop, like `vllm bench serve
//! --max-concurrency`) send `n` requests from a fixed prompt list, each recorded as a [`Row`];
//! the server's counters are read before, after, and every 500 ms in between (peaks). Also the
//! fixed prompts: seeded text sized to a token count with the server's tokenizer.
use std::{
    collections::BTreeMap,
    io::{IsTerminal, Write},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    api::{self, Api, Sampling},
    client::{self, Url},
    metrics::{Level, Row, Slo, fill_latency, normalize_stop, summarize},
};

/// A prompt of the benchmark: its text (never written out), token count and hash.
#[derive(Clone, Debug, Default)]
pub struct Prompt {
    pub text: String,
    /// A conversation in place of `text` (shared-prefix and multi-turn workloads): (role, text).
    pub messages: Vec<(String, String)>,
    pub tokens: Option<u64>,
    /// Where `tokens` came from.
    pub source: PromptSource,
    pub hash: String,
}

crate::closed_set! {
    /// Where a prompt's token count came from: the server's tokenizer, an estimate at 4
    /// characters a token, or the server's own count (a conversation's later turns).
    PromptSource {
        #[default]
        Tokenizer = "tokenizer",
        Estimate = "estimate",
        Server = "server",
    }
}

/// FNV-1a 64, hex: names a prompt in the outputs without its text.
pub fn hash(s: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Instructions that invite long answers, each with the start of its answer so that a raw
/// completion route (llama.cpp /completion, Ollama raw) continues instead of ending at once.
/// Request i uses PROMPTS[i % n].
pub const PROMPTS: &[&str] = &[
    "Write a long story about a lighthouse keeper who finds a message in a bottle.\n\nOnce upon a time, on a rocky island far from the coast,",
    "Explain in detail how a steam engine works, step by step.\n\nA steam engine turns heat into motion. First,",
    "Describe a journey across a desert, day by day, in great detail.\n\nDay one. We left the oasis before dawn and",
    "Write a long letter from a sailor to his family about life at sea.\n\nDear mother and father, the ship left the harbor on Monday and",
    "Tell the full history of an imaginary city from its founding to today.\n\nThe city was founded by fishermen who",
    "Write a detailed guide to growing tomatoes in a small garden.\n\nStep 1: Choose a sunny spot. Tomatoes need",
    "Describe the four seasons in a mountain village, one after another.\n\nIn spring, the snow melts and",
    "Write a long fairy tale about a clockmaker and a talking cat.\n\nThere once was an old clockmaker who",
];

/// The fixed short prompt of the idle sweep (a continuation, so every server answers with text).
pub const IDLE_PROMPT: &str = "Good morning! The weather today is";

const WORDS: &[&str] = &[
    "river", "stone", "garden", "window", "morning", "silver", "quiet", "market", "winter", "paper", "bridge", "lantern", "forest",
    "letter", "harbor", "candle", "meadow", "thunder", "copper", "orchard", "village", "mirror", "feather", "valley", "engine", "ribbon",
    "island", "compass", "shadow", "kettle", "saddle", "glacier",
];

/// Deterministic text of `words` words from `seed` (a fixed word list, an LCG).
pub fn words_text(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if i > 0 {
            out.push_str(if i % 12 == 0 { ". " } else { " " });
        }
        out.push_str(WORDS[((x >> 33) as usize) % WORDS.len()]);
    }
    out.push('.');
    out
}

/// A prompt of about `target` tokens, sized with the server's tokenizer when it has one
/// (a few rounds of rescaling the word count), else estimated at 4 characters a token.
pub fn sized_prompt(url: &Url, target: u64, seed: u64, model: Option<&str>) -> Prompt {
    let mut words = (target as usize * 3 / 4).max(1);
    let mut best: Option<(u64, String)> = None;
    for _ in 0..6 {
        let text = words_text(seed, words);
        let Some(n) = api::tokenize(url, &text, model) else { break };
        let better = best.as_ref().is_none_or(|(b, _)| n.abs_diff(target) < b.abs_diff(target));
        if better {
            best = Some((n, text));
        }
        if n == target || n.abs_diff(target) * 200 < target {
            break;
        }
        let next = ((words as f64) * target as f64 / n.max(1) as f64).round() as usize;
        words = if next == words { if n > target { words - 1 } else { words + 1 } } else { next.max(1) };
    }
    match best {
        Some((n, text)) => Prompt { hash: hash(&text), text, tokens: Some(n), source: PromptSource::Tokenizer, ..Default::default() },
        None => {
            let mut text = String::new();
            let mut w = target as usize / 4;
            while text.len() < target as usize * 4 {
                text = words_text(seed, w.max(1));
                w = w * 5 / 4 + 1;
            }
            text.truncate(target as usize * 4);
            Prompt { hash: hash(&text), tokens: Some(target), source: PromptSource::Estimate, text, ..Default::default() }
        }
    }
}

/// The instruction prompts, with their token counts when the server can tell.
/// `own`: the user's prompts (--prompts), used in place of the built-in ones, cycled.
pub fn instruction_prompts(url: &Url, n: usize, model: Option<&str>, idle: bool, own: &[String]) -> Vec<Prompt> {
    let builtin: Vec<&str> = if idle { vec![IDLE_PROMPT] } else { PROMPTS.to_vec() };
    let pool: Vec<&str> = if own.is_empty() { builtin } else { own.iter().map(String::as_str).collect() };
    let count = if idle { 1 } else { n.max(1) };
    let texts: Vec<&str> = (0..count).map(|i| pool[i % pool.len()]).collect();
    texts
        .into_iter()
        .map(|t| match api::tokenize(url, t, model) {
            Some(k) => Prompt { text: t.into(), tokens: Some(k), source: PromptSource::Tokenizer, hash: hash(t), ..Default::default() },
            None => Prompt {
                text: t.into(),
                tokens: Some(t.len().div_ceil(4) as u64),
                source: PromptSource::Estimate,
                hash: hash(t),
                ..Default::default()
            },
        })
        .collect()
}

/// A live progress bar on a terminal (requests done of those planned), plain lines otherwise.
pub struct Progress {
    tty: bool,
    start: Instant,
    pub done: AtomicUsize,
    pub total: AtomicUsize,
}

impl Progress {
    pub fn new() -> Self {
        Progress { tty: std::io::stderr().is_terminal(), start: Instant::now(), done: AtomicUsize::new(0), total: AtomicUsize::new(0) }
    }

    pub fn update(&self, what: &str) {
        if self.tty {
            eprint!(
                "\r\x1b[2K{}",
                bar(self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed), what, self.start.elapsed().as_secs_f64())
            );
            let _ = std::io::stderr().flush();
        }
    }

    /// A line that stays (level done, notes).
    pub fn line(&self, what: &str) {
        if self.tty {
            eprint!("\r\x1b[2K");
        }
        eprintln!("probe bench: {}", crate::util::text::terminal(what));
    }
}

/// `[#####---------------] 12/48 requests  concurrency 4: 3/8  [35 s]`
pub fn bar(done: usize, total: usize, what: &str, secs: f64) -> String {
    let total = total.max(done).max(1);
    let filled = done * 20 / total;
    format!("[{}{}] {done}/{total} requests  {what}  [{secs:.0} s]", "#".repeat(filled), "-".repeat(20 - filled))
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

/// What a level needs to send and record requests.
pub struct Ctx<'a> {
    pub url: &'a Url,
    pub api: Api,
    pub timeout: Duration,
    pub slot_ctx: Option<u64>,
    pub t0: Instant,
    pub slo: Slo,
    /// Poll /metrics while the level runs (it answered before the run; not while tracing).
    pub metrics: bool,
    pub progress: &'a Progress,
    /// The server's pid (its CPU is not a competitor's), when known.
    pub server_pid: Option<u32>,
    /// Sample GPU clocks (NVML) while levels run.
    pub gpu: bool,
}

/// How a level sends its requests.
#[derive(Clone, Debug)]
pub enum Schedule {
    /// `n` requests, at most `concurrency` in flight (closed loop); with `first_alone`, the first
    /// is sent and answered before the others start (it fills a shared prompt cache).
    Closed { n: usize, concurrency: usize, first_alone: bool },
    /// Open loop: request i is sent `at_ms[i]` after the level starts, whatever is in flight.
    Open { at_ms: Vec<f64> },
    /// `conversations` at once, each `turns` requests in a row, every turn carrying the
    /// conversation so far (the prompts are the conversations' first user messages).
    Conversations { conversations: usize, turns: usize },
}

/// splitmix64: the benchmark's one seeded generator (run order, arrival gaps); well mixed from
/// the first draw whatever the seed.
pub fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Exponential gaps of a Poisson process at `rate` per second from `seed`, as send times (ms
/// from the start; the first request at 0).
pub fn poisson_ms(rate: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed;
    let mut t = 0.0;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i > 0 {
            // Uniform in (0, 1]: never ln(0).
            let u = ((splitmix64(&mut x) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            t += -u.ln() / rate * 1e3;
        }
        out.push(t);
    }
    out
}

/// One request, recorded: the row template gives sweep, level and layers.
pub fn one(ctx: &Ctx, template: &Row, index: u64, prompt: &Prompt, s: &Sampling) -> Row {
    one_answer(ctx, template, index, prompt, s).0
}

/// [`one`], with the answer's text (kept in memory for a conversation's next turn).
pub fn one_answer(ctx: &Ctx, template: &Row, index: u64, prompt: &Prompt, s: &Sampling) -> (Row, String) {
    let (path, body) = if prompt.messages.is_empty() {
        ctx.api.generate(&prompt.text, s)
    } else {
        let m: Vec<(&str, &str)> = prompt.messages.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
        ctx.api.generate_messages(&m, s)
    };
    let sent_ms = ctx.t0.elapsed().as_secs_f64() * 1e3;
    let x = client::stream(ctx.url, path, &body, ctx.timeout);
    let chunks = x.content_ms.len();
    let (output, source) = api::output_tokens(&x.stop, chunks);
    let (server_prompt, prompt_ms) = api::prompt_stats(&x.stop);
    let (stop, detail) = normalize_stop(&x, output, s.max_tokens, ctx.slot_ctx);
    let mut row = Row {
        index,
        prompt_hash: prompt.hash.clone(),
        prompt_tokens: server_prompt.or(prompt.tokens),
        prompt_tokens_source: if server_prompt.is_some() { "server".into() } else { prompt.source.name().into() },
        max_tokens: s.max_tokens,
        output_tokens: output,
        output_tokens_source: source.into(),
        finish_reason: x.stop.finish_reason.clone().or(x.stop.stop_type.clone()).or(x.stop.done_reason.clone()).or(x.stop.stopped.clone()),
        truncated: x.stop.truncated,
        stop,
        stop_detail: detail,
        status: x.status,
        error: x.error_message.clone().or(x.transport_error.clone()),
        prompt_ms,
        deadline_hit: x.deadline_hit,
        disconnected: x.disconnected,
        sent_ms,
        local_port: x.local_port,
        ..template.clone()
    };
    if row.stop == super::metrics::RowStop::Cause(crate::analysis::verdict::StopCause::ServerLimit)
        && let Some(kind) = super::metrics::which_limit(row.prompt_tokens, output, ctx.slot_ctx)
    {
        let used = row.prompt_tokens.unwrap_or(0) + output;
        let c = ctx.slot_ctx.unwrap_or(0);
        if kind == super::metrics::ServerLimit::KvPool {
            row.stop_detail.push_str(&format!(
                "; prompt + output = {used} tokens, well below the {c}-token slot context: a KV pool shared by the slots ran out"
            ));
        }
        row.server_limit = Some(kind.name().into());
    }
    row.cached_tokens = api::cached_tokens(&x.stop);
    row.server_tpot_ms = x.stop.server_timings.as_ref().and_then(|t| t["predicted_per_token_ms"].as_f64());
    fill_latency(&mut row, &x);
    let completed = row.status.is_some_and(|s| (200..300).contains(&s)) && row.error.is_none() && !row.deadline_hit && !row.disconnected;
    row.met_slo = completed.then(|| ctx.slo.met(&row));
    (row, x.text)
}

/// Run one level: `n` requests, at most `concurrency` in flight; stops early on Ctrl-C.
pub fn level(ctx: &Ctx, template: &Row, prompts: &[Prompt], n: usize, concurrency: usize, s: &Sampling) -> (Vec<Row>, Level) {
    run_level(ctx, template, prompts, &Schedule::Closed { n, concurrency, first_alone: false }, s)
}

/// Run one level as `schedule` says; stops early on Ctrl-C. The machine is watched meanwhile.
pub fn run_level(ctx: &Ctx, template: &Row, prompts: &[Prompt], schedule: &Schedule, s: &Sampling) -> (Vec<Row>, Level) {
    let (n, concurrency) = match schedule {
        Schedule::Closed { n, concurrency, .. } => (*n, *concurrency),
        Schedule::Open { at_ms } => (at_ms.len(), at_ms.len()),
        Schedule::Conversations { conversations, turns } => (conversations * turns, *conversations),
    };
    let (before, mut notes) = api::counters(ctx.url, ctx.api);
    let watch = super::machine::Watch::start(ctx.server_pid, ctx.gpu);
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let finished = AtomicBool::new(false);
    let rows = Mutex::new(Vec::new());
    let peak = Mutex::new(BTreeMap::<String, f64>::new());
    let start = Instant::now();
    let record = |row: Row| {
        rows.lock().unwrap_or_else(|e| e.into_inner()).push(row);
        let d = done.fetch_add(1, Ordering::Relaxed) + 1;
        ctx.progress.done.fetch_add(1, Ordering::Relaxed);
        ctx.progress.update(&format!("{} {}: {d}/{n} requests", template.sweep, template.level));
    };
    let record = &record;
    std::thread::scope(|sc| {
        // Not at concurrency 1: a poll during a lone request is another request the server
        // serves (and a traced verdict would count it as queueing).
        if ctx.metrics && concurrency > 1 {
            sc.spawn(|| poll_peaks(ctx, &finished, &peak));
        }
        let mut workers = Vec::new();
        match schedule {
            Schedule::Closed { first_alone, .. } => {
                if *first_alone && n > 0 && !client::interrupted() {
                    next.store(1, Ordering::Relaxed);
                    record(one(ctx, template, 0, &prompts[0], s));
                }
                for _ in 0..concurrency.max(1) {
                    workers.push(sc.spawn(|| {
                        loop {
                            if client::interrupted() {
                                break;
                            }
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= n {
                                break;
                            }
                            record(one(ctx, template, i as u64, &prompts[i % prompts.len()], s));
                        }
                    }));
                }
            }
            Schedule::Open { at_ms } => {
                for (i, &at) in at_ms.iter().enumerate() {
                    // Sleep until this request's time (in steps: Ctrl-C ends the wait).
                    loop {
                        let left = at - start.elapsed().as_secs_f64() * 1e3;
                        if left <= 0.0 || client::interrupted() {
                            break;
                        }
                        std::thread::sleep(Duration::from_secs_f64((left / 1e3).min(0.05)));
                    }
                    if client::interrupted() {
                        break;
                    }
                    let p = &prompts[i % prompts.len()];
                    workers.push(sc.spawn(move || record(one(ctx, template, i as u64, p, s))));
                }
            }
            Schedule::Conversations { conversations, turns } => {
                for c in 0..*conversations {
                    let opener = &prompts[c % prompts.len()];
                    workers.push(sc.spawn(move || converse(ctx, template, opener, c, *turns, s, record)));
                }
            }
        }
        for w in workers {
            let _ = w.join();
        }
        finished.store(true, Ordering::Relaxed);
    });
    let duration = start.elapsed().as_secs_f64();
    let (after, more) = api::counters(ctx.url, ctx.api);
    for m in more {
        if !notes.contains(&m) {
            notes.push(m);
        }
    }
    let mut rows = rows.into_inner().unwrap_or_else(|e| e.into_inner());
    rows.sort_by_key(|r| r.index);
    let refs: Vec<&Row> = rows.iter().collect();
    let mut l = summarize(&refs, duration, ctx.slo);
    l.counters_before = before;
    l.counters_after = after;
    l.counters_peak = peak.into_inner().unwrap_or_else(|e| e.into_inner());
    l.notes = notes;
    let m = watch.stop();
    l.contended = m.contended();
    l.machine = Some(m);
    (rows, l)
}

/// Poll the server's counters every 500 ms until `finished`, keeping each counter's highest value.
fn poll_peaks(ctx: &Ctx, finished: &AtomicBool, peak: &Mutex<BTreeMap<String, f64>>) {
    while !finished.load(Ordering::Relaxed) {
        let (now, _) = api::counters(ctx.url, ctx.api);
        let mut p = peak.lock().unwrap_or_else(|e| e.into_inner());
        for (k, v) in now {
            let e = p.entry(k).or_insert(v);
            *e = e.max(v);
        }
        drop(p);
        for _ in 0..5 {
            if finished.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Conversation `c` of the multi-turn workload: `turns` turns opened by `opener`, each sending
/// the conversation so far; it ends early at a failed turn or Ctrl-C.
fn converse(ctx: &Ctx, template: &Row, opener: &Prompt, c: usize, turns: usize, s: &Sampling, record: &(dyn Fn(Row) + Sync)) {
    let mut history: Vec<(String, String)> = opener.messages.clone();
    for t in 0..turns {
        if client::interrupted() {
            break;
        }
        let ask = if t == 0 {
            // The instruction only (PROMPTS carry an answer opener for raw routes).
            opener.text.split("\n\n").next().unwrap_or(&opener.text).to_string()
        } else {
            format!("Thank you. Now continue with part {} of it, in as much detail.", t + 1)
        };
        history.push(("user".into(), ask));
        let text: String = history.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n");
        let p = Prompt { hash: hash(&text), text, messages: history.clone(), tokens: None, source: PromptSource::Server };
        let mut tpl = template.clone();
        tpl.conversation = Some(c as u64);
        tpl.turn = Some(t as u64 + 1);
        let (row, answer) = one_answer(ctx, &tpl, (c * turns + t) as u64, &p, s);
        let failed = row.status.is_none_or(|s| s >= 400) || row.error.is_some();
        record(row);
        if failed {
            break;
        }
        history.push(("assistant".into(), answer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_deterministic_and_hashed() {
        assert_eq!(words_text(42, 30), words_text(42, 30));
        assert_ne!(words_text(42, 30), words_text(43, 30));
        assert_eq!(words_text(1, 13).split(' ').count(), 13);
        assert_eq!(hash("abc"), hash("abc"));
        assert_eq!(hash(""), "cbf29ce484222325");
    }

    #[test]
    fn poisson_gaps_are_seeded_and_have_the_rate() {
        let a = poisson_ms(4.0, 2001, 42);
        assert_eq!(a, poisson_ms(4.0, 2001, 42));
        assert_ne!(a, poisson_ms(4.0, 2001, 43));
        assert_eq!(a[0], 0.0);
        let mean_gap = a[2000] / 2000.0;
        assert!((mean_gap - 250.0).abs() < 15.0, "mean gap {mean_gap} ms at 4/s");
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
    }

    #[test]
    fn progress_bar() {
        assert_eq!(bar(5, 20, "idle 3/5 s", 12.4), "[#####---------------] 5/20 requests  idle 3/5 s  [12 s]");
        assert!(bar(3, 0, "x", 0.0).starts_with("[####################] 3/3"));
    }

    #[test]
    fn own_prompts_replace_the_builtin_ones_and_cycle() {
        let url = Url::parse("http://127.0.0.1:9").unwrap();
        let own = vec!["a b c d".to_string(), "e".to_string()];
        let p = instruction_prompts(&url, 3, None, false, &own);
        assert_eq!(p.iter().map(|p| p.text.as_str()).collect::<Vec<_>>(), ["a b c d", "e", "a b c d"]);
        assert_eq!((p[0].tokens, p[0].source), (Some(2), PromptSource::Estimate));
        assert_eq!(instruction_prompts(&url, 3, None, true, &[])[0].text, IDLE_PROMPT);
        assert_eq!(instruction_prompts(&url, 2, None, false, &[])[1].text, PROMPTS[1]);
    }

    #[test]
    fn without_a_tokenizer_prompts_are_estimated() {
        // Nothing listens on port 9 of loopback: no tokenizer.
        let url = Url::parse("http://127.0.0.1:9").unwrap();
        let p = sized_prompt(&url, 100, 7, None);
        assert_eq!((p.source, p.tokens, p.text.len()), (PromptSource::Estimate, Some(100), 400));
    }
}
