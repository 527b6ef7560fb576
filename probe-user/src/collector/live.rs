//! The live view of `probe trace` on a terminal: once a second, every request in flight and what
//! it waits on right now, from what the armed probes saw in that second (the target's block reads
//! and the files they belong to, its threads' run-queue waits and who held the CPU, the engine's
//! steps) and the kernel's state of its threads; a line for each request that finished. Without a
//! terminal (or with `--quiet`) none of it is made.
//!
//! [`Live`] keeps the second's figures and words the lines ([`Live::frame`], pure but for the
//! threads' state it reads from /proc); [`Screen`] draws them below what was printed before, with
//! crossterm's cursor commands: finished lines stay, the in-flight block is redrawn in place.
use std::{
    collections::{HashMap, HashSet},
    io::Write as _,
};

use probe_common::{blockio::BlockIoEvent, engine::EngineEvent};

use crate::{
    record::samples::{IoLimit, ResidencyReading},
    stream::{InFlight, RequestRecord, Role},
};

/// A second in which the target's threads waited this long for a CPU (summed) says so.
const CPU_WAIT_SAYS_NS: u64 = 100_000_000;
/// Most in-flight lines drawn (then "+N more").
const MAX_LINES: usize = 12;
/// Files and competitors kept per second (the largest are named).
const MAX_KEYS: usize = 256;

/// What a request waited on in one second, for its finished line.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Wait {
    Reading(String),
    Cpu(String),
    Queued,
    Prompt,
    Blocked(String),
    NoToken,
}

impl Wait {
    fn words(&self) -> String {
        match self {
            Wait::Reading(f) => format!("reading {f}"),
            Wait::Cpu(c) => format!("waiting for a CPU behind {c}"),
            Wait::Queued => "queued".into(),
            Wait::Prompt => "the prompt".into(),
            Wait::Blocked(w) => format!("blocked in {w}"),
            Wait::NoToken => "no token yet".into(),
        }
    }
}

#[derive(Default)]
pub struct Live {
    /// Block reads for the target this second: bytes by (inode, device).
    reads: HashMap<(u64, u32), u64>,
    /// Run-queue waits of target threads this second, by the process that held the CPU.
    cpu_wait: HashMap<u32, u64>,
    /// Engine steps this second: prompt tokens (batches of more than one token per sequence),
    /// and the sequences that had tokens (slots busy).
    prompt_tokens: u64,
    seqs: HashSet<usize>,
    engine_seen: bool,
    /// The latest residency of each model file, by inode: (path, share resident).
    files: HashMap<u64, (String, f64)>,
    /// The cgroup's read limits, by device (major << 20 | minor).
    limits: HashMap<u32, u64>,
    /// Each request's messages at the last frame (its rate) and what it waited on, second by
    /// second, by its client's address (a request found at attach is numbered only later).
    last_tokens: HashMap<String, u64>,
    waited: HashMap<String, Vec<(Wait, u32)>>,
    /// Lines of requests that finished since the last frame.
    finished: Vec<String>,
    names: HashMap<u32, String>,
    last_frame_ns: u64,
}

/// One frame: lines to print once (finished requests), and the in-flight block.
#[derive(Debug, Default, PartialEq)]
pub struct Frame {
    pub finished: Vec<String>,
    pub live: Vec<String>,
}

impl Live {
    pub fn new(limits: &[IoLimit], now_ns: u64) -> Live {
        let limits = limits
            .iter()
            .filter_map(|l| {
                let (ma, mi) = l.dev.split_once(':')?;
                Some(((ma.parse::<u32>().ok()? << 20) | mi.parse::<u32>().ok()?, l.read_bps?))
            })
            .collect();
        Live { limits, last_frame_ns: now_ns, ..Default::default() }
    }

    /// A block request the target's (matched by the kernel by issuer, cgroup or file).
    pub fn block(&mut self, b: &BlockIoEvent) {
        if b.rwbs[0] != b'R' || b.error != 0 {
            return;
        }
        let key = (b.ino, b.dev);
        if self.reads.len() < MAX_KEYS || self.reads.contains_key(&key) {
            *self.reads.entry(key).or_default() += u64::from(b.bytes);
        }
    }

    /// A target thread waited `ns` in the run queue while `other` (a pid; 0: idle) held the CPU.
    pub fn cpu_wait(&mut self, other: u32, ns: u64) {
        if self.cpu_wait.len() < MAX_KEYS || self.cpu_wait.contains_key(&other) {
            *self.cpu_wait.entry(other).or_default() += ns;
        }
    }

    pub fn engine(&mut self, e: &EngineEvent) {
        use probe_common::engine::{ENGINE_DECODE, ENGINE_PROCESS};
        // A decode step (llama_process of type 0 encodes), as the engine view counts them.
        if !(e.what == ENGINE_DECODE || e.what == ENGINE_PROCESS && e.arg != 0) {
            return;
        }
        self.engine_seen = true;
        for (seq, &n) in e.seq_tokens.iter().enumerate().filter(|(_, n)| **n > 0) {
            self.seqs.insert(seq);
            if n > 1 {
                self.prompt_tokens += u64::from(n);
            }
        }
    }

    pub fn residency(&mut self, r: &ResidencyReading) {
        for f in r.files.iter().filter(|f| f.inode != 0) {
            if self.files.len() < MAX_KEYS || self.files.contains_key(&f.inode) {
                let name = std::path::Path::new(&f.path).file_name().map_or(f.path.clone(), |n| n.to_string_lossy().into_owned());
                self.files.insert(f.inode, (crate::util::text::terminal(&name).into_owned(), f.share()));
            }
        }
    }

    /// A request that finished: its line, with what it waited on while probe watched.
    pub fn done(&mut self, r: &RequestRecord) {
        self.last_tokens.remove(&r.peer);
        let waited = self.waited.remove(&r.peer).unwrap_or_default();
        if r.role != Role::Server || r.probe_poll {
            return;
        }
        let mut l = format!("#{} {}", r.id, name(r.method.as_deref(), r.path.as_deref(), r.path_inferred));
        if let Some(s) = r.status {
            l += &format!(" {s}");
        }
        // end_ms and ttft_ms count from the arrival.
        match (r.end_ms, r.ttft_ms) {
            (Some(e), Some(t)) => l += &format!(" done in {}: first token {}", secs(e), secs(t)),
            (Some(e), None) => l += &format!(" done in {}", secs(e)),
            _ => l += " done",
        }
        let (cause, _) = crate::analysis::verdict::stop_cause(r);
        l += &format!(", {} tokens, stop {}", r.produced().max(r.chunks), cause.name());
        // The longest first; of equal ones the earliest.
        let mut w: Vec<&(Wait, u32)> = waited.iter().filter(|(w, _)| *w != Wait::NoToken).collect();
        w.sort_by_key(|w| std::cmp::Reverse(w.1));
        if !w.is_empty() {
            let parts: Vec<String> = w.iter().take(2).map(|(w, n)| format!("{} {n} s", w.words())).collect();
            l += &format!("; before its first token: {}", parts.join(", "));
        }
        self.finished.push(l);
    }

    /// The lines of this second, for the requests in flight (`now_ns` on the recording's clock,
    /// `start_ns` its start), and the header before them. Resets the second's figures.
    pub fn frame(
        &mut self,
        header: String,
        in_flight: &[InFlight],
        now_ns: u64,
        start_ns: u64,
        threads: &dyn Fn() -> Vec<String>,
    ) -> Frame {
        let second = (now_ns.saturating_sub(self.last_frame_ns) as f64 / 1e9).max(0.05);
        self.last_frame_ns = now_ns;
        let now_ms = now_ns.saturating_sub(start_ns) as f64 / 1e3 / 1e3;
        let mut reqs: Vec<&InFlight> = in_flight.iter().filter(|q| q.role == Role::Server && !q.probe_poll).collect();
        reqs.sort_by(|a, b| a.arrival_ms.unwrap_or(now_ms).total_cmp(&b.arrival_ms.unwrap_or(now_ms)).then(a.id.cmp(&b.id)));
        // The engine's slots: requests beyond the sequences it stepped this second wait for one.
        let busy = self.seqs.len();
        let waiting_for_slot = if self.engine_seen && reqs.len() > busy { reqs.len() - busy } else { 0 };
        let reading = self.reading(second);
        let cpu = self.cpu(second);
        let mut blocked: Option<Option<String>> = None;
        let mut live = vec![header];
        for (i, q) in reqs.iter().enumerate() {
            let age = q.arrival_ms.map(|a| now_ms - a);
            let number = if q.id == 0 { "#?".to_string() } else { format!("#{}", q.id) };
            let mut l = match (&q.method, &q.path) {
                // Read before attach and not answered yet: nothing names it but its client.
                (None, None) if q.headers_only => {
                    format!(
                        "  {number} request from {} (its head and answer's headers came before attach)",
                        crate::util::text::terminal(&q.peer)
                    )
                }
                (None, None) => format!("  {number} request from {} (its head came before attach)", crate::util::text::terminal(&q.peer)),
                _ => format!("  {number} {}", name(q.method.as_deref(), q.path.as_deref(), q.inferred)),
            };
            if let Some(a) = age {
                l += &format!(", {}", secs(a));
            }
            let before = self.last_tokens.insert(q.peer.clone(), q.tokens).unwrap_or(q.tokens);
            if q.tokens > 0 {
                let rate = q.tokens.saturating_sub(before) as f64 / second;
                l += &format!(": generating at {rate:.0} tok/s ({} tokens so far)", q.tokens);
                if q.began_before_attach {
                    l += ", streaming before attach";
                }
                live.push(l);
                continue;
            }
            l += ", no token yet: ";
            let queued = i >= reqs.len() - waiting_for_slot;
            let wait = if queued && i > 0 {
                l += &format!("queued behind {} ({} of the server's slots busy)", crate::util::text::count(i as u64, "request"), busy);
                Wait::Queued
            } else if let Some((file, words)) = &reading {
                l += words;
                Wait::Reading(file.clone())
            } else if let Some((comm, words)) = &cpu {
                l += words;
                Wait::Cpu(comm.clone())
            } else if self.prompt_tokens > 0 {
                l += &format!("the prompt ({} tokens in the last second)", self.prompt_tokens);
                Wait::Prompt
            } else if let Some(w) = blocked.get_or_insert_with(|| uninterruptible(&threads())) {
                l += &format!("a thread blocked in {w}");
                Wait::Blocked(w.clone())
            } else {
                l += "computing or waiting (no IO, no CPU wait)";
                Wait::NoToken
            };
            let seen = self.waited.entry(q.peer.clone()).or_default();
            match seen.iter_mut().find(|(w, _)| *w == wait) {
                Some((_, n)) => *n += 1,
                None => seen.push((wait, 1)),
            }
            live.push(l);
        }
        if live.len() > MAX_LINES + 1 {
            let more = live.len() - MAX_LINES - 1;
            live.truncate(MAX_LINES + 1);
            live.push(format!("  +{more} more"));
        }
        self.reads.clear();
        self.cpu_wait.clear();
        self.seqs.clear();
        self.prompt_tokens = 0;
        self.engine_seen = false;
        Frame { finished: std::mem::take(&mut self.finished), live }
    }

    /// "reading FILE (R% resident, X MB/s, throttled: the cgroup allows L MB/s)", for the file
    /// read most this second.
    fn reading(&self, second: f64) -> Option<(String, String)> {
        let total: u64 = self.reads.values().sum();
        let (&(ino, dev), _) = self.reads.iter().max_by_key(|(k, b)| (**b, **k))?;
        if total == 0 {
            return None;
        }
        let rate = total as f64 / second / 1e6;
        let (file, mut words) = match self.files.get(&ino).filter(|_| ino != 0) {
            Some((path, share)) => (path.clone(), format!("reading {path} ({:.0}% resident, {rate:.1} MB/s", share * 100.0)),
            None => {
                let d = format!("{}:{}", dev >> 20, dev & 0xfffff);
                (format!("device {d}"), format!("reading from device {d} ({rate:.1} MB/s"))
            }
        };
        if let Some(&limit) = self.limits.get(&dev) {
            let mb = limit as f64 / 1e6;
            if rate >= 0.7 * mb {
                words += &format!(", throttled: the cgroup allows {mb:.1} MB/s");
            } else {
                words += &format!("; the cgroup allows {mb:.1} MB/s");
            }
        }
        words.push(')');
        Some((file, words))
    }

    /// "waiting for a CPU behind COMM (N ms of run-queue wait in the last second)".
    fn cpu(&mut self, second: f64) -> Option<(String, String)> {
        let total: u64 = self.cpu_wait.values().sum();
        if (total as f64) < CPU_WAIT_SAYS_NS as f64 * second {
            return None;
        }
        let (&pid, _) = self.cpu_wait.iter().max_by_key(|(p, n)| (**n, **p))?;
        let comm = if pid == 0 {
            "nothing (the hypervisor or an interrupt)".to_string()
        } else {
            let c =
                self.names.entry(pid).or_insert_with(|| crate::util::text::terminal(&crate::os::procfs::comm(pid)).into_owned()).clone();
            format!("{c} (pid {pid})")
        };
        let ms = total as f64 / 1e6 / second;
        Some((comm.clone(), format!("waiting for a CPU behind {comm} ({ms:.0} ms of run-queue wait a second)")))
    }
}

/// The kernel's wait of the first thread in uninterruptible sleep (D) that names one, from the
/// waits of those threads.
fn uninterruptible(threads: &[String]) -> Option<String> {
    threads.iter().find(|w| !w.is_empty()).cloned()
}

fn name(method: Option<&str>, path: Option<&str>, inferred: bool) -> String {
    let n = format!("{} {}", crate::util::text::terminal(method.unwrap_or("?")), crate::util::text::terminal(path.unwrap_or("?")));
    if inferred { format!("{n} (inferred)") } else { n }
}

fn secs(ms: f64) -> String {
    if ms.abs() < 1000.0 { format!("{ms:.0} ms") } else { format!("{:.1} s", ms / 1e3) }
}

/// Draws frames on a terminal (stderr): the finished lines stay, the in-flight block is redrawn.
#[derive(Default)]
pub struct Screen {
    drawn: u16,
}

impl Screen {
    pub fn draw(&mut self, f: &Frame) {
        use crossterm::{
            QueueableCommand as _,
            cursor::MoveToColumn,
            terminal::{Clear, ClearType},
        };
        let (width, height) = crossterm::terminal::size().unwrap_or((80, 24));
        let width = usize::from(width.max(20)) - 1;
        let mut e = std::io::stderr().lock();
        self.erase(&mut e);
        let _ = e.queue(MoveToColumn(0)).and_then(|e| e.queue(Clear(ClearType::FromCursorDown)));
        for l in &f.finished {
            let _ = writeln!(e, "{l}");
        }
        let room = usize::from(height.saturating_sub(1)).max(1);
        let lines: Vec<&String> = f.live.iter().take(room).collect();
        for l in &lines {
            let _ = writeln!(e, "{}", cut(l, width));
        }
        self.drawn = lines.len() as u16;
        let _ = e.flush();
    }

    /// Take the in-flight block off the screen (before the summary).
    pub fn clear(&mut self) {
        use crossterm::{
            QueueableCommand as _,
            terminal::{Clear, ClearType},
        };
        let mut e = std::io::stderr().lock();
        self.erase(&mut e);
        let _ = e.queue(Clear(ClearType::FromCursorDown));
        let _ = e.flush();
    }

    fn erase(&mut self, e: &mut impl std::io::Write) {
        use crossterm::{
            QueueableCommand as _,
            cursor::{MoveToColumn, MoveUp},
        };
        if self.drawn > 0 {
            let _ = e.queue(MoveUp(self.drawn)).and_then(|e| e.queue(MoveToColumn(0)));
        }
        self.drawn = 0;
    }
}

/// `l` in at most `width` characters.
fn cut(l: &str, width: usize) -> String {
    if l.chars().count() <= width { l.to_string() } else { l.chars().take(width.saturating_sub(1)).chain(['…']).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(id: u64, arrival_ms: f64, tokens: u64) -> InFlight {
        InFlight {
            id,
            peer: format!("127.0.0.1:{}", 50000 + id),
            role: Role::Server,
            probe_poll: false,
            method: Some("POST".into()),
            path: Some("/v1/chat/completions".into()),
            inferred: false,
            arrival_ms: Some(arrival_ms),
            tokens,
            began_before_attach: false,
            headers_only: false,
        }
    }

    fn read(ino: u64, bytes: u32) -> BlockIoEvent {
        let mut b = BlockIoEvent { dev: (8 << 20) | 16, bytes, ino, ..Default::default() };
        b.rwbs[0] = b'R';
        b
    }

    fn reading(ino: u64, share: f64) -> ResidencyReading {
        let f = crate::record::samples::Residency {
            path: "/models/m.gguf".into(),
            pages: 1000,
            resident: (share * 1000.0) as u64,
            inode: ino,
            ..Default::default()
        };
        ResidencyReading { ts_ns: 0, why: Default::default(), files: vec![f] }
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_request_waiting_on_a_throttled_read_names_the_file_and_the_limit() {
        let limits = [IoLimit { dev: "8:16".into(), read_bps: Some(16_000_000), ..Default::default() }];
        let mut l = Live::new(&limits, 0);
        l.residency(&reading(42, 0.43));
        for _ in 0..60 {
            l.block(&read(42, 256 << 10));
        }
        let f = l.frame("h".into(), &[q(1, -1500.0, 0)], S, 0, &Vec::new);
        assert_eq!(f.live.len(), 2, "{f:?}");
        let line = &f.live[1];
        assert!(line.starts_with("  #1 POST /v1/chat/completions, 2.5 s, no token yet: reading m.gguf (43% resident, 15.7 MB/s"), "{line}");
        assert!(line.contains("throttled: the cgroup allows 16.0 MB/s"), "{line}");
        // The next second nothing was read and nothing else is known: no IO is claimed.
        let f = l.frame("h".into(), &[q(1, -1500.0, 0)], 2 * S, 0, &Vec::new);
        assert!(f.live[1].ends_with("computing or waiting (no IO, no CPU wait)"), "{f:?}");
        let f = l.frame("h".into(), &[q(1, -1500.0, 0)], 3 * S, 0, &|| vec!["folio_wait_bit".into()]);
        assert!(f.live[1].ends_with("a thread blocked in folio_wait_bit"), "{f:?}");
        // Its head was read before attach and nothing was answered yet: named by its client.
        let unnamed = InFlight { method: None, path: None, ..q(1, -1500.0, 0) };
        let f = l.frame("h".into(), &[unnamed], 4 * S, 0, &Vec::new);
        assert!(f.live[1].starts_with("  #1 request from 127.0.0.1:50001 (its head came before attach), 5.5 s, no token yet: "), "{f:?}");
    }

    #[test]
    fn rates_queues_and_cpu_waits() {
        let mut l = Live::new(&[], 0);
        l.frame("h".into(), &[q(1, 0.0, 10)], S, 0, &Vec::new);
        // One slot stepped by the engine, two requests: the later one is queued behind the first.
        let mut e = EngineEvent { what: probe_common::engine::ENGINE_DECODE, ..Default::default() };
        e.seq_tokens[0] = 1;
        l.engine(&e);
        l.cpu_wait(std::process::id(), 400_000_000);
        let f = l.frame("h".into(), &[q(1, 0.0, 40), q(2, 500.0, 0)], 2 * S, 0, &Vec::new);
        assert!(f.live[1].ends_with("generating at 30 tok/s (40 tokens so far)"), "{f:?}");
        assert!(f.live[2].contains("no token yet: queued behind 1 request (1 of the server's slots busy)"), "{f:?}");
        // No engine: the CPU wait is what is said, naming who held it.
        l.cpu_wait(std::process::id(), 400_000_000);
        let f = l.frame("h".into(), &[q(2, 500.0, 0)], 3 * S, 0, &Vec::new);
        assert!(
            f.live[1].contains(&format!(
                "waiting for a CPU behind {} (pid {})",
                crate::os::procfs::comm(std::process::id()),
                std::process::id()
            )),
            "{f:?}"
        );
        assert!(f.live[1].ends_with("(400 ms of run-queue wait a second)"), "{f:?}");
        // It finishes: one line, with what it waited on.
        let r = RequestRecord {
            id: 2,
            peer: "127.0.0.1:50002".into(),
            role: Role::Server,
            method: Some("POST".into()),
            path: Some("/v1/chat/completions".into()),
            status: Some(200),
            arrival_ms: Some(500.0),
            end_ms: Some(2900.0),
            ttft_ms: Some(2700.0),
            chunks: 12,
            ..Default::default()
        };
        l.done(&r);
        let f = l.frame("h".into(), &[], 4 * S, 0, &Vec::new);
        assert_eq!(f.live, vec!["h".to_string()]);
        assert_eq!(f.finished.len(), 1, "{f:?}");
        let line = &f.finished[0];
        assert!(line.starts_with("#2 POST /v1/chat/completions 200 done in 2.9 s: first token 2.7 s, 12 tokens, stop "), "{line}");
        assert!(line.contains("before its first token: queued 1 s, waiting for a CPU behind"), "{line}");
    }

    #[test]
    fn lines_fit_the_terminal() {
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(cut("abc", 4), "abc");
    }
}
