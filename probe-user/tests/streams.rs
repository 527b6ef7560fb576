//! Golden tests of request-stream parsing for servers that cannot run here (Ollama NDJSON, vLLM
//! SSE): byte streams written from their documented formats in tests/data/stream/<name>/
//! conversation.json, fed to the same Tracker `probe trace` uses, compared with expected.json.
//! `UPDATE_GOLDEN=1` rewrites the expected files.
use std::path::PathBuf;

use probe_common::{
    EventHeader, EventKind,
    sock::{SOCK_RESET_RECEIVED, SOCK_STATE, SockEvent, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_ESTABLISHED, TCP_LAST_ACK},
    stream::{DIR_RECV, DIR_SEND, DataEvent},
};
use probe_user::stream::{RequestRecord, Tracker};
use serde_json::Value;

const SK: u64 = 0xffff_8881_0000_1000;

fn run(name: &str) -> Vec<RequestRecord> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/stream").join(name);
    let segs: Vec<Value> = serde_json::from_slice(&std::fs::read(dir.join("conversation.json")).unwrap()).unwrap();
    let start = 1_000_000_000u64;
    let mut t = Tracker::new(start, false);
    for s in &segs {
        let ts = start + (s["t_ms"].as_f64().unwrap() * 1e6) as u64;
        let hdr = |kind: EventKind| EventHeader { kind: kind as u32, pid: 100, tid: 101, cpu: 0, ts_ns: ts };
        if let Some(what) = s["sock"].as_str() {
            if what == "peer_reset" {
                t.on_sock(&SockEvent { hdr: hdr(EventKind::Sock), skaddr: SK, what: SOCK_RESET_RECEIVED, ..Default::default() });
                continue;
            }
            let (old, new) = match what {
                "peer_fin" => (TCP_ESTABLISHED, TCP_CLOSE_WAIT),
                "close" => (TCP_LAST_ACK, TCP_CLOSE),
                other => panic!("unknown sock step {other}"),
            };
            t.on_sock(&SockEvent {
                hdr: hdr(EventKind::Sock),
                skaddr: SK,
                what: SOCK_STATE,
                oldstate: old,
                newstate: new,
                ..Default::default()
            });
            continue;
        }
        let data = s["data"].as_str().unwrap().as_bytes();
        let cap = s["capture"].as_u64().map_or(data.len(), |c| c as usize).min(data.len());
        let mut ev = DataEvent {
            hdr: hdr(EventKind::Data),
            sk: SK,
            enter_ns: ts,
            len: data.len() as u32,
            captured: cap as u32,
            fd: 7,
            dir: if s["dir"] == "recv" { DIR_RECV } else { DIR_SEND },
            family: 2,
            sport: 11434,
            dport: 50000,
            ..Default::default()
        };
        ev.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        ev.daddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        t.on_data(&ev, &data[..cap]);
    }
    t.finish();
    let mut got = t.take_done();
    // Prompt fingerprints are keyed per process (they mean nothing outside the trace): the golden
    // keeps how many there were.
    for q in &mut got {
        for p in &mut q.prompt_prefix {
            p.1 = 0;
        }
    }
    let json = serde_json::to_string_pretty(&got).unwrap() + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(dir.join("expected.json"), &json).unwrap();
    }
    let want: Value = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&got).unwrap(), want, "{name}: differs from expected.json (UPDATE_GOLDEN=1 to accept)");
    got
}

#[test]
fn ollama_generate_ndjson_stops_at_length() {
    let r = run("ollama-generate");
    assert_eq!(r.len(), 1);
    let q = &r[0];
    assert_eq!((q.method.as_deref(), q.path.as_deref(), q.status), (Some("POST"), Some("/api/generate"), Some(200)));
    assert_eq!(q.max_tokens, Some(3));
    assert_eq!(q.stream, Some(true), "Ollama streams by default");
    assert_eq!(q.chunks, 3);
    assert_eq!(q.stop.done_reason.as_deref(), Some("length"));
    assert_eq!(q.stop.server_timings.as_ref().unwrap()["load_duration"], 2900000000u64);
    assert_eq!(q.ttft_ms, Some(3200.0));
    assert!(q.content_complete && q.transport_complete && q.closed_by.name() == "none", "{q:?}");
}

#[test]
fn ollama_chat_client_gone_mid_stream() {
    let r = run("ollama-chat-client-gone");
    let q = &r[0];
    assert_eq!(q.chunks, 2);
    assert!(!q.content_complete && !q.transport_complete);
    assert_eq!(q.closed_by.name(), "client");
    assert_eq!(probe_user::analysis::verdict::stop_cause(q).0.name(), "client_disconnect");
    assert_eq!(q.stop.done_reason, None);
}

#[test]
fn vllm_chat_sse_with_usage_and_done() {
    let r = run("vllm-chat");
    let q = &r[0];
    assert_eq!(q.chunks, 7, "the role-only first delta is not content");
    assert_eq!(q.max_tokens, Some(64));
    assert_eq!(q.stop.finish_reason.as_deref(), Some("stop"));
    assert!(q.stop.done_marker);
    assert_eq!(q.stop.usage.as_ref().unwrap()["completion_tokens"], 7);
    assert_eq!(q.chunk_gaps.as_ref().unwrap().p50_ms, 8.0);
}

#[test]
fn vllm_midstream_error_and_a_cut_write() {
    let r = run("vllm-midstream-error");
    let q = &r[0];
    assert_eq!(q.stop.error.as_ref().unwrap()["code"], 500);
    assert!(q.stop.error.as_ref().unwrap().get("message").is_none(), "error text is kept only with --capture-text");
    assert!(!q.stop.done_marker);
    assert!(q.bytes_not_captured > 900);
    assert_eq!(q.messages_unread, 1, "the message in the cut write is counted, not guessed");
    assert_eq!(q.chunks, 1);
    assert!(q.transport_complete);
}

/// An SDK loop that breaks at the final event: the client closes before `[DONE]` and the
/// terminal chunk; the server's `[DONE]` write draws a reset. The server's stop stands.
#[test]
fn reader_that_leaves_at_the_final_event_keeps_the_servers_stop() {
    let r = run("llama-chat-reader-leaves-at-final");
    let q = &r[0];
    assert!(q.content_complete && !q.transport_complete, "{q:?}");
    assert_eq!((q.closed_by.name(), q.reset.name()), ("client", "by_client"));
    assert_eq!(q.stop.finish_reason.as_deref(), Some("stop"));
    let (cause, why) = probe_user::analysis::verdict::stop_cause(q);
    assert_eq!(cause.name(), "eos");
    assert!(why.unwrap().contains("harmless"));
}

/// A gateway that gives up after 2.5 s of silence: the server's final message goes out after
/// the gateway's FIN (the first write after a FIN succeeds), so it does not count.
#[test]
fn a_final_message_after_the_peer_left_is_a_deadline() {
    let r = run("llama-chat-gateway-deadline");
    let q = &r[0];
    assert!(!q.content_complete, "{q:?}");
    assert_eq!(q.stop.finish_reason.as_deref(), Some("stop"), "the stop fields are kept as seen");
    assert_eq!(probe_user::analysis::verdict::stop_cause(q).0.name(), "deadline");
}
