//! HTTP/1.1 framing (`probe_user::util::http`): body decoding fed in arbitrary pieces with gaps,
//! a chunked encoding built from the input decoded across any split (and around a gap inside a
//! chunk), request and response heads, and the credential scrubbing of raw request bytes.
//!
//! Input: a mode byte (modulo 3), then
//! - 0 any body: framing u8 (none, length, chunked, until close), [length u32], then pieces:
//!   u8 n < 0xf0: n bytes; n ≥ 0xf0: a gap of u16 bytes
//! - 1 chunked round trip: chunk count u8, each chunk (u16 + bytes, 1..=64), style u8, cut count u8,
//!   cuts (u16 each), gap: chunk u8, offset u16, length u16
//! - 2 heads: the bytes of a request or response head (and what follows)
#![no_main]

use libfuzzer_sys::fuzz_target;
use probe_fuzz::{Input, cuts};
use probe_user::{
    util::http::{self, Body, Framing, Parsed},
    util::redact,
};

fn any_body(inp: &mut Input) {
    let framing = match inp.u8() % 4 {
        0 => Framing::None,
        1 => Framing::Length(u64::from(inp.u32())),
        2 => Framing::Chunked,
        _ => Framing::UntilClose,
    };
    let mut b = Body::new(framing);
    let (mut out, mut fed, mut skipped) = (Vec::new(), 0u64, 0u64);
    while !inp.is_empty() {
        let n = inp.u8();
        if n >= 0xf0 {
            let gap = u64::from(inp.u16());
            if !b.gap(gap) {
                assert!(framing != Framing::UntilClose, "a body until the close takes any gap");
                return;
            }
            skipped += gap;
            continue;
        }
        let piece = inp.bytes(usize::from(n));
        let before = out.len();
        let Some(used) = b.feed(piece, &mut out) else { return };
        assert!(used <= piece.len(), "used {used} of {}", piece.len());
        assert!(out.len() - before <= used, "more body bytes out than consumed");
        if used < piece.len() {
            assert!(b.done, "input left over while the body is not done");
        }
        fed += used as u64;
        match framing {
            Framing::Length(n) => {
                assert_eq!(out.len() as u64, fed, "a Content-Length body passes its bytes through");
                assert_eq!(b.done, fed + skipped == n, "done exactly at the length ({fed} + {skipped} of {n})");
            }
            Framing::UntilClose => {
                assert_eq!(out.len() as u64, fed);
                assert!(!b.done, "a body until the close is done only at the close");
            }
            Framing::None => assert!(b.done && used == 0),
            Framing::Chunked => {}
        }
    }
    b.close();
    if framing == Framing::UntilClose {
        assert!(b.done);
    }
}

/// A valid chunked encoding of chunks from the input, then the next message: decoded whole
/// across any split, with the next message's bytes left unconsumed.
fn chunked_roundtrip(inp: &mut Input) {
    let chunks: Vec<&[u8]> = (0..inp.u8() % 8).map(|_| inp.blob(63)).filter(|c| !c.is_empty()).collect();
    let style = inp.u8();
    let mut wire = Vec::new();
    let mut data_at = Vec::new(); // (start in wire, start in the decoded body, length) of each chunk
    let mut decoded = 0;
    for c in &chunks {
        let size = if style & 1 != 0 { format!("{:X}", c.len()) } else { format!("{:x}", c.len()) };
        let zeros = "0".repeat(usize::from(style >> 1 & 3));
        let ext = if style & 8 != 0 { ";ext=1" } else { "" };
        wire.extend_from_slice(format!("{zeros}{size}{ext}\r\n").as_bytes());
        data_at.push((wire.len(), decoded, c.len()));
        decoded += c.len();
        wire.extend_from_slice(c);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n");
    if style & 16 != 0 {
        wire.extend_from_slice(b"X-Trailer: 1\r\n");
    }
    wire.extend_from_slice(b"\r\n");
    let end = wire.len();
    wire.extend_from_slice(b"GET /next HTTP/1.1\r\n");
    let want: Vec<u8> = chunks.concat();

    let raw: Vec<u16> = (0..inp.u8() % 16).map(|_| inp.u16()).collect();
    let cuts = cuts(&raw, wire.len());
    let mut b = Body::new(Framing::Chunked);
    let mut out = Vec::new();
    let mut used = 0;
    for w in cuts.windows(2) {
        if b.done {
            break;
        }
        // A body not done yet consumes every byte it is given.
        assert_eq!(used, w[0]);
        used += b.feed(&wire[w[0]..w[1]], &mut out).expect("valid chunked framing");
    }
    assert!(b.done, "terminal chunk not recognised: {:?}", String::from_utf8_lossy(&wire));
    assert_eq!(used, end, "consumed up to the end of the body, not into the next message");
    assert_eq!(out, want, "decoded bytes differ across splits");

    // A gap inside one chunk's data, up to and through its CRLF: the rest still decodes.
    let pick = usize::from(inp.u8());
    let (from, n) = (usize::from(inp.u16()), usize::from(inp.u16()));
    if let Some(&(start, at, len)) = data_at.get(pick % data_at.len().max(1)) {
        let from = start + from % len;
        let n = 1 + n % (start + len + 2 - from);
        let mut b = Body::new(Framing::Chunked);
        let mut out = Vec::new();
        assert_eq!(b.feed(&wire[..from], &mut out), Some(from));
        assert!(b.gap(n as u64), "a gap inside chunk data is skipped");
        let rest = b.feed(&wire[from + n..], &mut out).expect("valid chunked framing after a gap");
        assert!(b.done);
        assert_eq!(from + n + rest, end);
        let mut expect = want.clone();
        let skip = at + (from - start);
        expect.drain(skip..skip + n.min(start + len - from));
        assert_eq!(out, expect, "decoded bytes around a gap");
    }
}

fn heads(buf: &[u8]) {
    if let Parsed::Done(h, n) = http::parse_request(buf) {
        assert!(n <= buf.len());
        assert!(matches!(http::parse_request(&buf[..n]), Parsed::Done(ref h2, n2) if *h2 == h && n2 == n), "a head reparsed alone");
        assert!(h.framing.is_some());
    }
    if let Parsed::Done(h, n) = http::parse_response(buf) {
        assert!(n <= buf.len());
        assert_eq!(h.framing("HEAD"), Framing::None, "a response to HEAD has no body");
        let _ = h.framing("POST");
    }
    // Credentials are overwritten in place, lengths kept, and a second pass changes nothing.
    let mut once = buf.to_vec();
    redact::http_credentials_in_place(&mut once);
    assert_eq!(once.len(), buf.len());
    let mut twice = once.clone();
    redact::http_credentials_in_place(&mut twice);
    assert_eq!(once, twice, "credential scrubbing is not idempotent");
    let _ = http::looks_like_request(buf);
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    match inp.u8() % 3 {
        0 => any_body(&mut inp),
        1 => chunked_roundtrip(&mut inp),
        _ => heads(inp.rest()),
    }
});
