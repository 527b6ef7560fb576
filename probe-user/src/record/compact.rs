//! The compact form of kernel records in v2 frames: header fields as varints, a fixed-size
//! body as 8-byte words XOR the previous record of its kind ([`Chain`]).
use probe_common::EventKind;

use super::{HEADER, decode, put_varint, take_varint, unzigzag, zigzag};

/// Fixed-size records are stored word by word, XOR the previous record of their kind; the
/// variable-length ones (a fixed part then a tail whose length the fixed part gives) whole, and
/// the engine's steps (272 bytes, mostly per-sequence arrays, one per decode step) whole too.
pub(super) fn chained(kind: EventKind) -> bool {
    !matches!(kind, EventKind::Data | EventKind::Stack | EventKind::Engine | EventKind::PyStack)
}

/// What a compact record is relative to: the previous kernel record's time, and per kind the
/// previous record's body. Writer and reader keep the same chain.
#[derive(Default)]
pub struct Chain {
    ts: u64,
    prev: Vec<Vec<u8>>,
}

impl Chain {
    fn prev(&mut self, kind: EventKind) -> &mut Vec<u8> {
        let i = kind as usize;
        if self.prev.len() <= i {
            self.prev.resize(i + 1, vec![]);
        }
        let p = &mut self.prev[i];
        p.resize(kind.record_size() - HEADER, 0);
        p
    }
}

/// The most 8-byte words a fixed-size record's body has (mmap: 128 bytes).
const MAX_WORDS: usize = 16;
const _: () = {
    let mut i = 0;
    while i < EventKind::ALL.len() {
        let k = EventKind::ALL[i];
        assert!(
            matches!(k, EventKind::Data | EventKind::Stack | EventKind::Engine | EventKind::PyStack)
                || k.record_size() - HEADER <= MAX_WORDS * 8
        );
        i += 1;
    }
};

fn word(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    let part = &b[(i * 8).min(b.len())..((i + 1) * 8).min(b.len())];
    w[..part.len()].copy_from_slice(part);
    u64::from_ne_bytes(w)
}

/// The compact form of one raw kernel record, appended to `out`; the chain moves on.
pub fn compact(record: &[u8], chain: &mut Chain, out: &mut Vec<u8>) -> Option<()> {
    let kind = decode::kind_of(record).ok()?;
    let hdr = record.get(..HEADER)?;
    let field = |i: usize| u32::from_ne_bytes(hdr[i..i + 4].try_into().unwrap_or_default());
    let (pid, tid, cpu) = (field(4), field(8), field(12));
    let ts = u64::from_ne_bytes(hdr[16..24].try_into().unwrap_or_default());
    out.push(kind as u32 as u8);
    put_varint(out, zigzag(ts.wrapping_sub(chain.ts) as i64));
    put_varint(out, u64::from(pid));
    put_varint(out, zigzag(i64::from(tid) - i64::from(pid)));
    put_varint(out, u64::from(cpu));
    chain.ts = ts;
    let body = &record[HEADER..];
    if !chained(kind) {
        out.extend_from_slice(body);
        return Some(());
    }
    if body.len() != kind.record_size() - HEADER {
        return None;
    }
    let prev = chain.prev(kind);
    // On the collector's path for every event: no allocation.
    let mut words = [0u64; MAX_WORDS];
    let nw = body.len().div_ceil(8);
    for (i, w) in words[..nw].iter_mut().enumerate() {
        *w = word(body, i) ^ word(prev, i);
    }
    let n = words[..nw].iter().rposition(|&w| w != 0).map_or(0, |i| i + 1);
    put_varint(out, n as u64);
    for &w in &words[..n] {
        put_varint(out, w);
    }
    prev.copy_from_slice(body);
    Some(())
}

/// A compact record's header fields (kind, time delta, pid, tid, cpu) and its body.
type Compact<'a> = (EventKind, u64, u64, u64, u64, &'a [u8]);

pub(super) fn compact_header(b: &[u8]) -> Option<Compact<'_>> {
    let (&kind, b) = b.split_first()?;
    let kind = EventKind::try_from(u32::from(kind)).ok()?;
    let (dts, b) = take_varint(b)?;
    let (pid, b) = take_varint(b)?;
    let (dtid, b) = take_varint(b)?;
    let (cpu, body) = take_varint(b)?;
    Some((kind, dts, pid, dtid, cpu, body))
}

/// A chained body's XOR words (how many, and their values); None when it is not one.
pub(super) fn compact_words(kind: EventKind, mut body: &[u8]) -> Option<(usize, [u64; MAX_WORDS])> {
    let size = kind.record_size() - HEADER;
    let (n, rest) = take_varint(body)?;
    let n = usize::try_from(n).ok().filter(|&n| n <= size.div_ceil(8))?;
    body = rest;
    let mut words = [0u64; MAX_WORDS];
    for w in &mut words[..n] {
        let (v, rest) = take_varint(body)?;
        *w = v;
        body = rest;
    }
    body.is_empty().then_some((n, words))
}

/// A record's thread id from its pid and the zigzagged difference: None where it is no u32 (a
/// corrupt record: the difference may be anything, and the sum must not overflow).
fn tid_of(pid: u64, dtid: u64) -> Option<u32> {
    i64::try_from(pid).ok()?.checked_add(unzigzag(dtid)).and_then(|t| u32::try_from(t).ok())
}

/// The raw record back from its compact form; the chain moves on.
#[cfg(test)]
pub(super) fn expand(b: &[u8], chain: &mut Chain) -> Option<Vec<u8>> {
    let mut rec = Vec::new();
    expand_into(b, chain, &mut rec).then_some(rec)
}

/// [`expand`] into `rec` (cleared first): false when the record is not whole.
pub(super) fn expand_into(b: &[u8], chain: &mut Chain, rec: &mut Vec<u8>) -> bool {
    let Some((kind, dts, pid, dtid, cpu, body)) = compact_header(b) else { return false };
    let ts = chain.ts.wrapping_add(unzigzag(dts) as u64);
    let (Some(tid), Ok(pid32), Ok(cpu)) = (tid_of(pid, dtid), u32::try_from(pid), u32::try_from(cpu)) else {
        return false;
    };
    rec.clear();
    rec.extend_from_slice(&(kind as u32).to_ne_bytes());
    rec.extend_from_slice(&pid32.to_ne_bytes());
    rec.extend_from_slice(&tid.to_ne_bytes());
    rec.extend_from_slice(&cpu.to_ne_bytes());
    rec.extend_from_slice(&ts.to_ne_bytes());
    if !chained(kind) {
        rec.extend_from_slice(body);
        chain.ts = ts;
        return true;
    }
    let Some((_, words)) = compact_words(kind, body) else { return false };
    let size = kind.record_size() - HEADER;
    chain.ts = ts;
    let prev = chain.prev(kind);
    for (i, x) in words[..size.div_ceil(8)].iter().enumerate() {
        let w = (word(prev, i) ^ x).to_ne_bytes();
        let at = i * 8;
        let len = 8.min(size - at);
        prev[at..at + len].copy_from_slice(&w[..len]);
    }
    rec.extend_from_slice(prev);
    true
}

/// A compact record of a kind the reader skips: checked as [`expand`] checks it, the time chain
/// moved on, nothing built. Its kind's XOR chain is left behind: no record of that kind is
/// expanded by this reader. The kind, when the record is whole.
pub(super) fn skip_compact(b: &[u8], chain: &mut Chain) -> Option<EventKind> {
    let (kind, dts, pid, dtid, cpu, body) = compact_header(b)?;
    let ok = tid_of(pid, dtid).is_some() && u32::try_from(pid).is_ok() && u32::try_from(cpu).is_ok();
    if !ok || (chained(kind) && compact_words(kind, body).is_none()) {
        return None;
    }
    chain.ts = chain.ts.wrapping_add(unzigzag(dts) as u64);
    Some(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corrupt record's thread difference can be anything (the fuzzer found one near
    /// i64::MAX that overflowed the sum): refused, not a panic.
    #[test]
    fn a_thread_id_out_of_range_is_refused() {
        assert_eq!(tid_of(5, zigzag(2)), Some(7));
        assert_eq!(tid_of(7, zigzag(-2)), Some(5));
        assert_eq!(tid_of(u64::from(u32::MAX), u64::MAX - 1), None);
        assert_eq!(tid_of(u64::MAX, 0), None);
        assert_eq!(tid_of(0, zigzag(-1)), None);
    }
}
