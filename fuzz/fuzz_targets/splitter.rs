//! Response bodies (`probe_user::stream::payload`): the SSE / NDJSON / JSON splitter fed the same
//! bytes whole and in arbitrary pieces (the same messages when nothing was lost), then with gaps;
//! the stop-field reading of every message (`apply`), the salvage of cut messages and the
//! request-body scan.
//!
//! Input: a mode byte (bit 0: splitting / fragments; bits 1-2: SSE, NDJSON, JSON; bit 3: keep
//! text); for splitting: cut count u8, cuts (u16 each), gap mask u16; then the body (the rest).
#![no_main]

use libfuzzer_sys::fuzz_target;
use probe_fuzz::{Input, cuts};
use probe_user::stream::payload::{self as pl, Kind, Msg, Splitter, Stop};
use serde_json::Value;

fn split(kind: Kind, parts: &[&[u8]], gaps: u16) -> Vec<Msg> {
    let mut s = Splitter::new(kind);
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if gaps & (1 << (i % 16)) != 0 {
            s.gap(&mut out);
        }
        s.push(p, &mut out);
    }
    s.finish(&mut out);
    out
}

/// What `apply` keeps of a message: never the error text without --capture-text, and only
/// numbers of the usage and server timings.
fn read(v: &Value, keep_text: bool) {
    let mut stop = Stop::default();
    pl::apply(v, &mut stop, keep_text);
    if let Some(e) = &stop.error {
        let o = e.as_object().expect("an error is kept as an object");
        assert!(keep_text || !o.contains_key("message"), "error text kept without --capture-text: {e}");
        for (k, x) in o {
            match k.as_str() {
                "code" | "type" | "reason" | "message" => {}
                // The sizes a context refusal quotes (llama.cpp's n_prompt_tokens, n_ctx): numbers only.
                "n_prompt_tokens" | "n_ctx" => assert!(x.is_u64(), "error keeps {k} as {x}"),
                _ => panic!("error keeps {k}"),
            }
        }
    }
    if let Some(u) = &stop.usage {
        assert!(numbers_only(u), "usage keeps text: {u}");
    }
    if let Some(t) = &stop.server_timings {
        assert!(numbers_only(t), "server timings keep text: {t}");
    }
}

fn numbers_only(v: &Value) -> bool {
    match v {
        Value::Number(_) | Value::Null => true,
        Value::Object(o) => o.values().all(numbers_only),
        _ => false,
    }
}

fn read_all(msgs: &[Msg], keep_text: bool) {
    for m in msgs {
        if let Msg::Json(v) | Msg::Partial(v) = m {
            read(v, keep_text);
        }
    }
}

fn splitting(inp: &mut Input, kind: Kind, keep_text: bool) {
    let n = usize::from(inp.u8() % 16);
    let raw: Vec<u16> = (0..n).map(|_| inp.u16()).collect();
    let gaps = inp.u16();
    let body = inp.rest();
    let cuts = cuts(&raw, body.len());
    let parts: Vec<&[u8]> = cuts.windows(2).map(|w| &body[w[0]..w[1]]).collect();
    let whole = split(kind, &[body], 0);
    let pieces = split(kind, &parts, 0);
    assert_eq!(whole, pieces, "{kind:?}: messages depend on how the body was split ({cuts:?})");
    read_all(&whole, keep_text);
    // The same pieces with holes before some of them.
    read_all(&split(kind, &parts, gaps), keep_text);
}

fn fragments(body: &[u8]) {
    if let Some(v) = pl::salvage(body) {
        let o = v.as_object().expect("salvage gives an object");
        assert!(!o.is_empty());
        for k in o.keys() {
            let known = [
                "stop_type",
                "done_reason",
                "choices",
                "stop",
                "done",
                "truncated",
                "stopped_eos",
                "stopped_word",
                "stopped_limit",
                "timings",
                "usage",
                "error",
            ];
            assert!(known.contains(&k.as_str()), "salvage keeps {k}");
        }
        read(&v, false);
    }
    let (_, stream) = pl::scan_fields(body);
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        // One document with `"stream"` once, at its top level: the scan reads what the parser does.
        if let Some(s) = v.get("stream").and_then(Value::as_bool)
            && String::from_utf8_lossy(body).matches("\"stream\"").count() == 1
        {
            assert_eq!(stream, Some(s), "scan_fields misread stream");
        }
        let _ = pl::max_tokens(&v);
        read(&v, false);
        read(&v, true);
    }
    let text = String::from_utf8_lossy(body);
    let _ = pl::context_exceeded(&text);
    let _ = Kind::detect(&text, body);
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mode = inp.u8();
    let kind = [Kind::Sse, Kind::Ndjson, Kind::Json, Kind::Sse][usize::from(mode >> 1 & 3)];
    if mode & 1 == 0 { splitting(&mut inp, kind, mode & 8 != 0) } else { fragments(inp.rest()) }
});
