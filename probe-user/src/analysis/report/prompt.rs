//! What happened to each request's prompt, across the trace: a prompt cache lost (an earlier
//! request began the same way, yet this one computed its prompt again) and a prompt the server
//! cut to fit its context. Both read the server's own counts (llama.cpp `timings.prompt_n` /
//! `cache_n` / `truncated`, Ollama `prompt_eval_count`, OpenAI `usage.prompt_tokens`) and the
//! prompt fingerprints the collector kept (no text).
use super::Request;
use crate::{analysis::verdict::SlowCause, stream::payload::shared_prefix};

/// Fewer bytes shared than this is not a prefix worth a cache (a system prompt of a few words).
const SHARED_MIN: u64 = 256;
/// More prompt bytes per processed token than this: the server did not process all of it.
/// Text runs at 3 to 6 bytes a token in any script, token ids at about 6.
const BYTES_PER_TOKEN_MAX: f64 = 16.0;

/// (tokens computed, tokens reused from the server's prompt cache), when the server says.
fn prompt_tokens(q: &Request) -> Option<(u64, u64)> {
    let t = q.record.stop.server_timings.as_ref()?;
    Some((t["prompt_n"].as_u64()?, t["cache_n"].as_u64().unwrap_or(0)))
}

/// All the prompt tokens the server processed or reused, by whichever count it gives.
fn tokens_seen(q: &Request) -> Option<u64> {
    let s = &q.record.stop;
    prompt_tokens(q)
        .map(|(n, c)| n + c)
        .or_else(|| s.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()))
        .or_else(|| s.server_timings.as_ref().and_then(|t| t["prompt_eval_count"].as_u64()))
}

/// Evidence (and the slow cause, when it dominates) for every request that recomputed a prefix
/// an earlier request of the trace had computed; and a line for every prompt the server cut.
pub(crate) fn prompts(requests: &mut [Request]) {
    for i in 0..requests.len() {
        let lost = cache_lost(&requests[..i], &requests[i]);
        let cut = cut(&requests[i]);
        let Some(v) = requests[i].verdict.as_mut() else { continue };
        if let Some((line, share)) = lost {
            v.evidence.push(line);
            // The recomputed prefix dominates the wait: the lost cache is the cause (its time is
            // the server's own work, so only a compute verdict gives way).
            let ttft = requests[i].record.ttft_ms.unwrap_or(0.0);
            let compute = v.ttft_ms.as_ref().map_or(0.0, |s| s.compute);
            if matches!(v.slow_cause, SlowCause::Compute | SlowCause::None) && compute * share >= 0.5 * ttft && ttft >= 20.0 {
                v.slow_cause = SlowCause::PromptCache;
            }
        }
        if let Some(line) = cut {
            v.evidence.insert(0, line);
            v.prompt_cut = true;
        }
    }
}

/// "its prompt cache was lost: ...", and the share of its computed tokens that an earlier
/// request had computed already.
fn cache_lost(before: &[Request], q: &Request) -> Option<(String, f64)> {
    // The client asked the server not to cache this prompt: nothing was lost.
    if q.record.cache_prompt == Some(false) {
        return None;
    }
    let (computed, reused) = prompt_tokens(q)?;
    let bytes = q.record.prompt_bytes.filter(|&b| b > 0)?;
    let arrival = q.record.arrival_ms?;
    // The earlier request, finished before this one arrived, that shares the longest prefix.
    let (a, shared) = before
        .iter()
        .filter(|a| a.record.arrival_ms.zip(a.record.end_ms).is_some_and(|(t, e)| t + e <= arrival))
        .map(|a| (a, shared_prefix(&a.record.prompt_prefix, &q.record.prompt_prefix)))
        .max_by_key(|(a, n)| (*n, a.record.id))?;
    if shared < SHARED_MIN || shared * 2 < bytes {
        return None;
    }
    // The shared bytes' share of the prompt, in tokens: what the cache could have held.
    let could = ((computed + reused) as f64 * shared as f64 / bytes as f64).round() as u64;
    if could == 0 || reused * 2 >= could {
        return None;
    }
    let ago = arrival - (a.record.arrival_ms.unwrap_or(0.0) + a.record.end_ms.unwrap_or(0.0));
    let share = (could.saturating_sub(reused) as f64 / computed.max(1) as f64).min(1.0);
    Some((
        format!(
            "its prompt cache was lost: request #{} ({:.1} s before) began with the same {shared} bytes of prompt (about {could} tokens), yet {computed} tokens were computed again and {reused} reused (another request took the slot, the cache was evicted, or the server slept)",
            a.record.id,
            ago / 1e3
        ),
        share,
    ))
}

/// "the server cut the prompt ...", when it says it did (llama.cpp `truncated`) or processed far
/// fewer tokens than a prompt of that size holds.
fn cut(q: &Request) -> Option<String> {
    if q.record.stop.truncated == Some(true) {
        let n = tokens_seen(q).map(|n| format!(" ({n} prompt tokens processed)")).unwrap_or_default();
        return Some(format!(
            "prompt cut: the server dropped part of the prompt to fit its context{n} (llama.cpp truncated: true): the answer did not see all of it"
        ));
    }
    let (bytes, tokens) = (q.record.prompt_bytes?, tokens_seen(q)?);
    (tokens > 0 && bytes >= 4096 && bytes as f64 / tokens as f64 > BYTES_PER_TOKEN_MAX).then(|| {
        format!(
            "prompt cut: the server processed {tokens} prompt tokens of a {bytes}-byte prompt (about {} tokens): it kept only what fit its context",
            bytes / 4
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analysis::verdict::Verdict, stream::RequestRecord};

    fn req(id: u64, arrival: f64, end: f64, prefix: &[(u32, u64)], bytes: u64, timings: serde_json::Value) -> Request {
        let mut r = RequestRecord {
            id,
            arrival_ms: Some(arrival),
            end_ms: Some(end),
            ttft_ms: Some(end),
            prompt_bytes: Some(bytes),
            prompt_prefix: prefix.to_vec(),
            ..Default::default()
        };
        r.stop.server_timings = Some(timings);
        let split = crate::analysis::verdict::Split { compute: end, ..Default::default() };
        Request {
            record: r,
            verdict: Some(Verdict { ttft_ms: Some(split), slow_cause: SlowCause::Compute, ..Default::default() }),
            engine: None,
        }
    }

    #[test]
    fn a_shared_prefix_computed_again_is_a_lost_cache() {
        let p = [(64, 1), (128, 2), (256, 3), (512, 4), (1024, 5), (1500, 6)];
        let mut other = p;
        other[3..].copy_from_slice(&[(512, 9), (1024, 10), (1500, 11)]);
        let mut rs = vec![
            req(1, 0.0, 400.0, &p, 1500, serde_json::json!({"prompt_n": 350, "cache_n": 0})),
            req(2, 500.0, 400.0, &[(64, 20), (128, 21), (1500, 22)], 1500, serde_json::json!({"prompt_n": 350, "cache_n": 0})),
            // The same prompt again, computed in full.
            req(3, 1000.0, 400.0, &p, 1500, serde_json::json!({"prompt_n": 350, "cache_n": 0})),
            // The same again, from the cache: nothing lost.
            req(4, 1500.0, 20.0, &p, 1500, serde_json::json!({"prompt_n": 1, "cache_n": 349})),
            // Sharing only 256 of 1500 bytes: too little to say.
            req(5, 2000.0, 400.0, &other, 1500, serde_json::json!({"prompt_n": 350, "cache_n": 0})),
        ];
        prompts(&mut rs);
        let v = |i: usize| rs[i].verdict.as_ref().unwrap();
        let lost = v(2).evidence.iter().find(|e| e.contains("prompt cache was lost")).unwrap();
        assert!(lost.contains("request #1 (0.6 s before)") && lost.contains("350 tokens were computed again and 0 reused"), "{lost}");
        assert_eq!(v(2).slow_cause, SlowCause::PromptCache);
        for i in [0, 1, 3, 4] {
            assert!(!v(i).evidence.iter().any(|e| e.contains("lost")), "#{}: {:?}", i + 1, v(i).evidence);
            assert_eq!(v(i).slow_cause, SlowCause::Compute);
        }
    }

    #[test]
    fn a_prompt_the_server_cut_is_said() {
        let mut rs = vec![
            req(1, 0.0, 100.0, &[], 300, serde_json::json!({"prompt_n": 60, "cache_n": 0})),
            req(2, 200.0, 100.0, &[], 40_000, serde_json::json!({"prompt_eval_count": 2048})),
            req(3, 400.0, 100.0, &[], 300, serde_json::json!({"prompt_n": 60})),
        ];
        rs[2].record.stop.truncated = Some(true);
        prompts(&mut rs);
        let v = |i: usize| rs[i].verdict.as_ref().unwrap();
        assert!(!v(0).prompt_cut);
        assert!(v(1).prompt_cut && v(1).evidence[0].contains("processed 2048 prompt tokens of a 40000-byte prompt"), "{:?}", v(1));
        assert!(v(2).prompt_cut && v(2).evidence[0].contains("truncated: true"), "{:?}", v(2));
    }
}
