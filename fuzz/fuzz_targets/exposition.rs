//! What the node agent reads from listeners nobody vets (issue 39): `httpc`'s response reader fed
//! in arbitrary pieces (the same answer however the reads split, never more body than its cap),
//! and the Prometheus text the agent parses and merges from its followers.
//!
//! Input: a mode byte (modulo 2), then
//! - 0 a response: cap u16, method u8 (GET, HEAD, POST), cut count u8, cuts (u16 each), a
//!   close flag u8, then the bytes a server sends
//! - 1 exposition text: max u8, then the text (twice: as one follower's and, relabelled, another's)
#![no_main]

use libfuzzer_sys::fuzz_target;
use probe_fuzz::{Input, cuts};
use probe_user::{sampler::endpoints::parse_prometheus, util::httpc::Response, watch::metrics};

type Got = Result<Option<(u16, Vec<u8>)>, String>;

/// Feed `wire` cut at `at`, stopping at the first answer or error; close at the end if asked.
fn read(method: &str, cap: usize, wire: &[u8], at: &[usize], close: bool) -> Got {
    let mut r = Response::new(method, cap);
    for w in at.windows(2) {
        match r.feed(&wire[w[0]..w[1]]) {
            Ok(None) => {}
            done => return done,
        }
    }
    if close { r.close() } else { Ok(None) }
}

fn response(inp: &mut Input) {
    let cap = usize::from(inp.u16());
    let method = ["GET", "HEAD", "POST"][usize::from(inp.u8() % 3)];
    let raw: Vec<u16> = (0..inp.u8() % 16).map(|_| inp.u16()).collect();
    let close = inp.u8() & 1 == 1;
    let wire = inp.rest();
    let split = read(method, cap, wire, &cuts(&raw, wire.len()), close);
    let whole = read(method, cap, wire, &[0, wire.len()], close);
    if let Ok(Some((_, body))) = &split {
        assert!(body.len() <= cap, "a body of {} bytes passed the cap of {cap}", body.len());
    }
    // The same answer whatever the reads (errors may be met at another byte, never instead of one).
    match (&split, &whole) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "the answer depends on how the reads split"),
        (Err(_), Err(_)) => {}
        _ => panic!("split {split:?} but whole {whole:?}"),
    }
}

fn exposition(inp: &mut Input) {
    let max = usize::from(inp.u8());
    let text = String::from_utf8_lossy(inp.rest()).into_owned();
    assert!(parse_prometheus(&text, max).len() <= max, "more series than the cap");
    let labels = vec![("node".to_string(), "n\"1\n".to_string()), ("port".to_string(), "8080".to_string())];
    let relabelled = metrics::relabel(&text, &labels);
    assert_eq!(relabelled.lines().count(), text.lines().count(), "relabelling adds or drops lines");
    let merged = metrics::merge(&[text.clone(), relabelled.clone()]);
    // Merging only regroups: every line it writes was in one of the texts (compared without their
    // trailing CRs: `lines()` strips one CR before a LF, and a line merge ends with a LF of its own
    // may have had another).
    let bare = |l: &str| l.trim_end_matches('\r').to_string();
    let given: std::collections::HashSet<String> = text.lines().chain(relabelled.lines()).map(bare).collect();
    for l in merged.lines() {
        assert!(given.contains(&bare(l)), "merge wrote a line of its own: {l:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    match inp.u8() % 2 {
        0 => response(&mut inp),
        _ => exposition(&mut inp),
    }
});
