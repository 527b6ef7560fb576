//! Why a response stopped ([`StopCause`]): the server's own word, the wire's close and its
//! silences, an OOM kill; and what limits a verdict (data quality).
use super::*;

/// A close after a long silence is a deadline: ≥ 1 s since the last chunk before the close (or
/// since arrival if none came) and ≥ 3 times the request's median gap between chunks. A reader
/// that goes away while tokens flow closes within a gap; a slow server (vLLM on CPU: 300 ms a
/// token per stream) cut by a 2 s gateway timeout is silent for under 10 of its gaps.
pub fn idle_before_close_ms(q: &RequestRecord) -> Option<f64> {
    let end = q.closed_ms.or(q.end_ms)?;
    let before: Vec<f64> = q.chunk_times_ms.iter().copied().filter(|t| *t <= end).collect();
    let last = before.last().copied().unwrap_or(0.0);
    let idle = end - last;
    let mut gaps: Vec<f64> = before.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_by(|a, b| a.total_cmp(b));
    let median = crate::util::stats::percentile(&gaps, 50.0).unwrap_or(0.0);
    (idle >= 1000.0 && idle >= 3.0 * median).then_some(idle)
}

/// When the first token was ready, ms after arrival: the TTFT of a streamed answer; for an
/// answer sent whole (`"stream": false`, or one message) its TTFT is the whole answer, so the generation time
/// the server reports (llama.cpp `predicted_ms`, Ollama `eval_duration`) is taken off.
pub fn first_token_ms(q: &RequestRecord) -> Option<f64> {
    let ttft = q.ttft_ms?;
    // Not asked for (`/completion` sends the whole answer unless told otherwise): one message.
    let whole = q.stream == Some(false) || (q.stream.is_none() && q.chunks <= 1);
    if !whole {
        return Some(ttft);
    }
    let t = q.stop.server_timings.as_ref();
    let generated = t.and_then(|t| t["predicted_ms"].as_f64().or_else(|| t["eval_duration"].as_f64().map(|ns| ns / 1e6)));
    Some((ttft - generated.unwrap_or(0.0)).max(0.0))
}

/// The stop the server itself reported, from any server's stop fields.
pub(super) fn server_stop(q: &RequestRecord) -> Option<StopCause> {
    server_word(&q.stop, q.produced(), q.max_tokens.and_then(|m| u64::try_from(m).ok()))
}

/// The stop a server's own fields say (llama.cpp, OpenAI, Ollama, vLLM words), given how many
/// tokens it produced and the limit asked for: a length below the requested limit (one token
/// of slack: servers count the last token differently) is a limit the server imposed. The one
/// classifier of the servers' words: verdicts and `probe bench` both use it.
pub fn server_word(s: &crate::stream::payload::Stop, produced: u64, max_tokens: Option<u64>) -> Option<StopCause> {
    let is = |v: &Option<String>, w: &str| v.as_deref() == Some(w);
    if is(&s.finish_reason, "length") || is(&s.stop_type, "limit") || is(&s.done_reason, "length") || is(&s.stopped, "limit") {
        return Some(match max_tokens {
            Some(m) if m > 0 && produced + 1 < m => StopCause::ServerLimit,
            _ => StopCause::RequestedLimit,
        });
    }
    if is(&s.stop_type, "word") || is(&s.stopped, "word") || s.stop_reason.as_ref().is_some_and(|r| r.is_string()) {
        return Some(StopCause::StopWord);
    }
    if is(&s.finish_reason, "stop") || is(&s.stop_type, "eos") || is(&s.done_reason, "stop") || is(&s.stopped, "eos") {
        return Some(StopCause::Eos);
    }
    None
}

/// Why the response stopped, with the fact it rests on. Precedence: the server's own stop (an
/// error, or its final message sent before the peer left) whoever closes the socket afterwards;
/// then the peer's close before that message (a deadline after a long silence, else a reader
/// that went away) or the server's own close (a crash); then what the transport shows.
pub fn stop_cause(q: &RequestRecord) -> (StopCause, Option<String>) {
    use StopCause::*;
    let n = q.produced();
    let context_ran_out = q.stop.context_exceeded();
    let cause = if context_ran_out {
        // llama-server with one KV pool for all slots ends a stream with an error when the pool
        // is full: a limit the server imposed, not a fault.
        ServerLimit
    } else if q.stop.error.is_some() || q.status.is_some_and(|c| c >= 400) {
        ServerError
    } else if q.content_complete {
        server_stop(q).unwrap_or(Unknown)
    } else if q.closed_by == ClosedBy::Client {
        if idle_before_close_ms(q).is_some() { Deadline } else { ClientDisconnect }
    } else if q.closed_by == ClosedBy::Server {
        Crash
    } else {
        Unknown
    };
    let mut why = match cause {
        Eos => Some(format!("the server stopped at EOS (end of its answer) after {n} tokens")),
        StopWord => Some(format!("the server stopped at a stop word after {n} tokens")),
        ServerLimit if context_ran_out && n == 0 && q.status.is_some_and(|s| (400..500).contains(&s)) => Some(format!(
            "the server refused the request (HTTP {}, {}): the prompt does not fit its context",
            q.status.unwrap_or(0),
            q.stop.error.as_ref().and_then(|e| e["type"].as_str()).unwrap_or("error"),
        )),
        ServerLimit if context_ran_out => Some(format!(
            "the server ended the stream with an error after {n} tokens (HTTP {}, {}): its context (slot or shared KV pool) ran out, below the requested {}",
            q.status.unwrap_or(0),
            q.stop.error.as_ref().and_then(|e| e["type"].as_str()).unwrap_or("error"),
            q.max_tokens.map_or("?".into(), |m| m.to_string())
        )),
        ServerLimit => Some(format!(
            "stopped at length after {n} tokens, below the requested {}: the server's context (slot or KV pool) ran out",
            q.max_tokens.unwrap_or(0)
        )),
        RequestedLimit => {
            Some(match q.max_tokens {
                Some(m) => format!("the server stopped at the requested limit ({m} tokens)"),
                None => format!("the server stopped at the requested limit after {n} tokens (the request itself was not seen)"),
            })
        }
        ClientDisconnect => Some(format!(
            "{} closed the connection after {} chunks, before the server's final message",
            q.peer_process.as_ref().map_or("the client".to_string(), |p| format!("the client, {},", p.describe())),
            q.chunks
        )),
        Deadline => Some(format!(
            "{} closed after {:.1} s without a chunk{}, before the server's final message: a timeout, not a reader that went away",
            q.peer_process.as_ref().map_or("the peer (client or gateway)".to_string(), |p| format!("the peer, {},", p.describe())),
            idle_before_close_ms(q).unwrap_or(0.0) / 1e3,
            if q.chunks == 0 { " (none had come)" } else { "" }
        )),
        Crash => Some("the server closed the connection before its final message".into()),
        ServerError => Some(format!("HTTP {} {}", q.status.unwrap_or(0), q.stop.error.as_ref().map(|e| e.to_string()).unwrap_or_default())),
        Unknown if q.in_flight => Some(
            "cut: the recording ended while it was in flight (probe did not finish the recording: killed, or the disk filled); its end was not seen"
                .into(),
        ),
        Unknown if q.closed_by == ClosedBy::Open => {
            Some(format!("in flight at the end of the trace, after {n} tokens: its end was not seen"))
        }
        _ => None,
    };
    // A prompt refused for the slot's context: the sizes the server quoted, and what to change.
    if let Some((p, c)) = q.stop.error.as_ref().and_then(|e| Some((e["n_prompt_tokens"].as_u64()?, e["n_ctx"].as_u64()?))) {
        let line = format!(
            "its {p} tokens do not fit the slot's context of {c} (llama-server gives each of its -np slots -c / -np tokens: raise -c or lower -np, or send a shorter prompt)"
        );
        why = Some(match why {
            Some(w) => format!("{w}; {line}"),
            None => line,
        });
    }
    // The transport fact, when it differs from the server's word.
    if q.content_complete && !q.transport_complete && q.closed_by != ClosedBy::Open {
        let who = if q.closed_by == ClosedBy::Client { "the client" } else { "the server" };
        let line =
            format!("{who} then closed before the end of the HTTP response, which is harmless: the server's final message had been sent");
        why = Some(match why {
            Some(w) => format!("{w}; {line}"),
            None => line,
        });
    }
    (cause, why)
}

/// What keeps a silent stream open through a gateway's read timeout, for the server at hand
/// (known from its own endpoints, never from a process name).
pub fn keep_open(server_kind: Option<crate::record::samples::Kind>) -> String {
    use crate::record::samples::Kind;
    const TIMEOUT: &str = "the gateway's read timeout (nginx proxy_read_timeout, 60 s by default; see the README's table)";
    match server_kind {
        Some(Kind::LlamaCpp) => format!(
            "to keep it open: llama-server sends an SSE ping after --sse-ping-interval seconds without a token (30 by default, -1 turns it off); set it below {TIMEOUT}, or raise that timeout above the longest silence"
        ),
        Some(Kind::Vllm) => format!(
            "to keep it open: vLLM sends nothing while a stream is silent (it has no ping): raise {TIMEOUT} above the longest silence"
        ),
        Some(Kind::Ollama) => format!(
            "to keep it open: Ollama sends nothing while a stream is silent (it has no ping): raise {TIMEOUT} above the longest silence"
        ),
        _ => format!("to keep it open: raise {TIMEOUT} above the longest silence, or have the server send keep-alives more often than it"),
    }
}

/// The stop cause (an OOM kill in the window outranks the wire) and what limits the verdict.
pub(super) fn stop_and_quality(q: &RequestRecord, w: &Window<'_>, v: &mut Verdict) {
    let (mut stop, mut why) = stop_cause(q);
    if let Some(arrival) = q.arrival_ms.map(|_| w.arrival_ns) {
        let end = arrival + (q.end_ms.unwrap_or(0.0) * 1e6) as u64 + 2_000_000_000;
        if !q.content_complete && w.oom_kills.iter().any(|&t| t >= arrival && (q.closed_by == ClosedBy::Open || t <= end)) {
            stop = StopCause::Oom;
            why = Some("the kernel's OOM killer killed the server process while it served this request".into());
        }
    }
    v.stop_cause = stop;
    v.stop_detail.clone_from(&why);
    v.evidence.extend(why);
    if stop == StopCause::Deadline {
        v.evidence.push(keep_open(w.server_kind));
    }
    if let Some(n) = w.server_preemptions.filter(|&n| n >= 1.0) {
        v.evidence.push(format!(
            "the server preempted {n:.0} request(s) while this one was served (its KV cache was full): a preempted request is recomputed, which adds time, not a shorter answer"
        ));
    }
    if q.arrival_by == crate::stream::Arrival::TcpState {
        let before = w.before_attach_ms;
        v.data_quality.push(if before > 0.0 {
            format!("arrived {before:.0} ms before attach, by the kernel's TCP state (tcp_info: the request's last bytes)")
        } else {
            "its arrival was dated by the kernel's TCP state at attach (tcp_info: the request's last bytes)".into()
        });
        if q.path_inferred {
            v.data_quality.push("method and path inferred from the response (the request's head was read before attach)".into());
        }
        if q.began_before_attach {
            v.data_quality.push("its response had begun before attach: the first token was not seen, so there is no TTFT".into());
        }
    } else if q.partial {
        v.data_quality.push("probe attached while this request was in flight: its start was not seen".into());
    }
    if q.evicted {
        v.data_quality.push(
            "probe stopped following this request's connection before it ended (too many connections, bytes or pipelined requests at once): its end was not seen"
                .into(),
        );
    }
    if w.lost_events > 0 {
        v.data_quality.push(format!("{} events were lost while this request was served (ring buffer full, or program runs the kernel skipped): shares are lower bounds", w.lost_events));
    }
    // A few stacks cut short are normal (deep frames past the copied stack); say so past 10%.
    // A stack cut deep (under the thread's main loop, its entry) still names the functions the
    // request's work ran in: only its outermost callers are missing, as they are in perf's
    // DWARF unwinding of the same server. Warn only past 10% cut shallow, saying why they stop.
    if w.stacks_cut_shallow * 10 > w.stacks {
        let reasons: Vec<String> =
            crate::record::Cut::ALL.iter().zip(w.cut_reasons).filter(|(_, n)| *n > 0).map(|(c, n)| format!("{}: {n}", c.words())).collect();
        let why = if reasons.is_empty() { String::new() } else { format!(" ({})", reasons.join(", ")) };
        let under = w.cut_under.map(|f| format!("; most of the trace's cut stacks stop under {f}")).unwrap_or_default();
        v.data_quality.push(format!(
            "{:.0}% of the stacks in this request's window ({} of {}) stop within {DEEP_ENOUGH} frames of where they were taken{why}{under}: the flamegraph cannot say which function they ran under",
            w.stacks_cut_shallow as f64 * 100.0 / w.stacks as f64,
            w.stacks_cut_shallow,
            w.stacks
        ));
    }
    if !w.offcpu_probe {
        v.data_quality.push("the offcpu probe was not live: disk and memory waits are not measured".into());
    }
    if let Some(why) = &w.power_absent {
        v.data_quality.push(format!("no power data: {why}"));
    }
}
