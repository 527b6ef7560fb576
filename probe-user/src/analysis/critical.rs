//! A request's critical path in the scheduler's view: walked back in time from the server thread
//! that sent its first response bytes, through the wake-ups between the server's own threads.
//!
//! Every traced thread's time off the CPU is known interval by interval: blocked (with the wait
//! class of its kernel stack, until its wake-up, and the traced thread that woke it when one
//! did: `sched_waking` runs in the waker) and waiting for a CPU (until it ran). Between those
//! intervals a thread ran. Walking back from the first response bytes, the time of the thread
//! being walked is running, waiting for a CPU, blocked on disk, blocked on memory, or idle
//! (waiting for something outside the server: the network, a timer, a poll). A futex wait (a
//! lock or condition variable) ended by another server thread is the one exception: that thread
//! is what the request waited for, so the walk goes on in its timeline from the wake-up back.
//! The time is then the waker's, and the hop is kept to say who it was and what it was doing.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// What a thread was doing off the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Off {
    /// Runnable, not running: `other` (a pid) had the CPU when it got it back.
    CpuWait { other: u32 },
    /// Blocked in a wait of this class; `waker` is the traced thread that ended it.
    Blocked { class: Class, waker: Option<u32> },
}

/// Off-CPU wait classes as the path counts them (from `crate::analysis::ksyms::WAITS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Disk,
    Memory,
    /// A futex: a lock or a condition variable, another thread's to end.
    Lock,
    /// Anything else: the network, a poll, a sleep, a pipe.
    Outside,
}

impl Class {
    pub fn of(wait: crate::analysis::ksyms::Wait) -> Class {
        use crate::analysis::ksyms::Wait;
        match wait {
            Wait::Io | Wait::PageFault => Class::Disk,
            Wait::Memory | Wait::Swap => Class::Memory,
            Wait::Lock => Class::Lock,
            _ => Class::Outside,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Interval {
    from: u64,
    to: u64,
    off: Off,
    /// Where a blocked thread waited ([`Threads::site`]).
    site: Option<u32>,
}

/// Each traced thread's off-CPU intervals, by tid, and the on-CPU time it spent in memory work
/// (swap-in, estimated from CPU samples).
#[derive(Default)]
pub struct Threads {
    by_tid: HashMap<u32, Vec<Interval>>,
    memory_on_cpu: HashMap<u32, Vec<(u64, u64)>>,
    sorted: bool,
    /// Where waits were, interned: "[network wait] in mod.f (f.py:3) under mod.g (g.py:9)".
    sites: Vec<String>,
    site_ids: HashMap<String, u32>,
}

/// Time on the critical path by state, ms.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct States {
    pub running: f64,
    pub cpu_wait: f64,
    pub disk: f64,
    pub memory: f64,
    /// Waiting for something outside the server (the request itself, a timer, the network).
    pub idle: f64,
}

impl States {
    fn add(&mut self, s: State, ms: f64) {
        match s {
            State::Running => self.running += ms,
            State::CpuWait => self.cpu_wait += ms,
            State::Disk => self.disk += ms,
            State::Memory => self.memory += ms,
            State::Idle => self.idle += ms,
        }
    }

    /// "running 700 ms, waiting for a CPU 150 ms": the states of at least 1 ms, largest first.
    pub fn words(&self) -> String {
        let mut parts = [
            (self.running, "running"),
            (self.cpu_wait, "waiting for a CPU"),
            (self.disk, "blocked on disk"),
            (self.memory, "in reclaim or swap-in"),
            (self.idle, "waiting for input"),
        ];
        parts.sort_by(|a, b| b.0.total_cmp(&a.0));
        let said: Vec<String> = parts.iter().filter(|p| p.0 >= 1.0).map(|(ms, w)| format!("{w} {ms:.0} ms")).collect();
        if said.is_empty() { "running".into() } else { said.join(", ") }
    }
}

/// A stretch of the path: from, to, state, thread, where it waited.
type Seg = (u64, u64, State, u32, Option<u32>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    CpuWait,
    Disk,
    Memory,
    Idle,
}

/// A server thread's share of the critical path.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct OnPath {
    pub tid: u32,
    /// Time the path spent in this thread's timeline, ms, by state.
    pub ms: f64,
    pub states: States,
    /// Where it was blocked on the path (waits of at least 1 ms, the longest first, at most
    /// [`MAX_SITES`]): the wait's class and, in an interpreter, the code it blocked under.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<Wait>,
}

/// Time the critical path spent blocked at one place.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Wait {
    pub ms: f64,
    /// The wait's class (`crate::analysis::ksyms::WAITS`) and, where the stack held Python frames, the
    /// innermost one and its caller: "[network wait] in mod.f (f.py:3) under mod.g (g.py:9)".
    pub site: String,
}

/// Places named per thread on a path.
pub const MAX_SITES: usize = 3;

/// A request's critical path from its arrival to its first response bytes.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Path {
    /// The thread that sent the first response bytes, where the walk began.
    pub writer: u32,
    /// The threads it went through, the longest first (the writer among them).
    pub threads: Vec<OnPath>,
    pub states: States,
    /// Waits on another server thread the walk followed (futex wake-ups between the threads).
    pub hops: u32,
    /// The walk stopped early (a wake-up loop, or too many steps): time not attributed, ms.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub not_walked_ms: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Times of one switch taken microseconds apart (a wait for a CPU can seem to begin a little
/// before the wake-up that ended the wait before it, in records from before the two shared one
/// clock reading): the thread ran for none of it.
const TIE_NS: u64 = 100_000;

/// More steps than a path through a trace's worth of waits should take.
const MAX_STEPS: usize = 200_000;

impl Threads {
    /// A thread was blocked from `from` until its wake-up at `to`.
    /// `site` says where ([`Threads::site`]).
    pub fn blocked(&mut self, tid: u32, from: u64, to: u64, class: Class, waker: Option<u32>, site: Option<u32>) {
        self.push(tid, Interval { from, to, off: Off::Blocked { class, waker: waker.filter(|&w| w != tid) }, site });
    }

    /// The id of a place threads wait at, for [`Threads::blocked`].
    pub fn site(&mut self, text: &str) -> u32 {
        if let Some(&id) = self.site_ids.get(text) {
            return id;
        }
        let id = self.sites.len() as u32;
        self.sites.push(text.to_string());
        self.site_ids.insert(text.to_string(), id);
        id
    }

    /// A thread was runnable from `from` until it ran at `to`; `other` had the CPU.
    pub fn cpu_wait(&mut self, tid: u32, from: u64, to: u64, other: u32) {
        self.push(tid, Interval { from, to, off: Off::CpuWait { other }, site: None });
    }

    /// A thread was on the CPU faulting memory back in (the kernel's swap-in path) over
    /// `from..to`: running time the path counts as memory.
    pub fn memory_on_cpu(&mut self, tid: u32, from: u64, to: u64) {
        if to > from {
            self.memory_on_cpu.entry(tid).or_default().push((from, to));
            self.sorted = false;
        }
    }

    /// The running segment `from..to` of `tid`, split where it was in memory work on the CPU.
    fn running(&self, segs: &mut Vec<Seg>, from: u64, to: u64, tid: u32) {
        let mem = self.memory_on_cpu.get(&tid).map_or(&[][..], |v| v.as_slice());
        let mut t = from;
        // Intervals are sorted by start and may overlap (samples a period apart, or closer).
        let first = mem.partition_point(|m| m.1 <= from);
        for &(a, b) in mem[first..].iter().take_while(|m| m.0 < to) {
            let (a, b) = (a.max(t), b.min(to));
            if b <= a {
                continue;
            }
            if a > t {
                segs.push((t, a, State::Running, tid, None));
            }
            segs.push((a, b, State::Memory, tid, None));
            t = b;
        }
        if to > t {
            segs.push((t, to, State::Running, tid, None));
        }
    }

    fn push(&mut self, tid: u32, iv: Interval) {
        if iv.to > iv.from {
            self.by_tid.entry(tid).or_default().push(iv);
            self.sorted = false;
        }
    }

    /// Sorts each thread's intervals (before [`Threads::walk`]).
    pub fn finish(&mut self) {
        for v in self.by_tid.values_mut() {
            v.sort_by_key(|i| (i.from, i.to));
        }
        for v in self.memory_on_cpu.values_mut() {
            v.sort_unstable();
        }
        self.sorted = true;
    }

    pub fn is_empty(&self) -> bool {
        self.by_tid.is_empty()
    }

    /// The critical path over `from..to` that ends in thread `writer` at `to`.
    pub fn walk(&self, writer: u32, from: u64, to: u64) -> Path {
        debug_assert!(self.sorted, "finish() before walk()");
        let mut segs: Vec<Seg> = Vec::new();
        let mut hops = 0;
        let (mut cur, mut t) = (writer, to);
        let mut last_hop = None;
        let mut steps = 0;
        while t > from {
            steps += 1;
            if steps > MAX_STEPS {
                break;
            }
            let ivs = self.by_tid.get(&cur).map_or(&[][..], |v| v.as_slice());
            // The last interval that began before t.
            let n = ivs.partition_point(|i| i.from < t);
            let Some(i) = n.checked_sub(1).map(|k| ivs[k]) else {
                self.running(&mut segs, from, t, cur);
                t = from;
                break;
            };
            let end = i.to.min(t);
            if end < t {
                self.running(&mut segs, end.max(from), t, cur);
            }
            let start = i.from.max(from);
            match i.off {
                // Another server thread ended the wait: the path goes on in its timeline from
                // the wake-up (it was running then: sched_waking ran in it). Two hops at one
                // instant would be a loop: the second is the waiter's own wait.
                Off::Blocked { class: Class::Lock, waker: Some(w) } if end > start && i.to <= t + TIE_NS && last_hop != Some(end) => {
                    hops += 1;
                    last_hop = Some(end);
                    cur = w;
                    t = end;
                }
                off => {
                    let state = match off {
                        Off::CpuWait { .. } => State::CpuWait,
                        Off::Blocked { class: Class::Disk, .. } => State::Disk,
                        Off::Blocked { class: Class::Memory, .. } => State::Memory,
                        Off::Blocked { .. } => State::Idle,
                    };
                    // A wait another server thread ended (an event loop's poll woken by the
                    // worker that computed) was on that thread's work: no place to name.
                    let site = if matches!(off, Off::Blocked { waker: Some(_), .. }) { None } else { i.site };
                    if end > start {
                        segs.push((start, end, state, cur, site));
                    }
                    // i.from < t, so the walk moves back (or reaches `from`).
                    t = start;
                }
            }
        }
        let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e6;
        let mut states = States::default();
        let mut threads: Vec<OnPath> = Vec::new();
        let mut at: HashMap<(u32, u32), f64> = HashMap::new();
        for &(a, b, st, tid, site) in &segs {
            states.add(st, ms(a, b));
            let i = match threads.iter().position(|p| p.tid == tid) {
                Some(i) => i,
                None => {
                    threads.push(OnPath { tid, ..Default::default() });
                    threads.len() - 1
                }
            };
            threads[i].ms += ms(a, b);
            threads[i].states.add(st, ms(a, b));
            if let Some(site) = site {
                *at.entry((tid, site)).or_default() += ms(a, b);
            }
        }
        for t in &mut threads {
            let mut waits: Vec<Wait> = at
                .iter()
                .filter(|((tid, _), ms)| *tid == t.tid && **ms >= 1.0)
                .map(|(&(_, site), &ms)| Wait { ms, site: self.sites.get(site as usize).cloned().unwrap_or_default() })
                .collect();
            waits.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.site.cmp(&b.site)));
            waits.truncate(MAX_SITES);
            t.waits = waits;
        }
        threads.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Path { writer, threads, states, hops, not_walked_ms: if t > from { ms(from, t) } else { 0.0 } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// The HTTP thread (1) hands the request to the main thread (2) and waits on a condition
    /// variable; 2 computes, waits for a CPU, reads from disk, and wakes 1, which writes.
    #[test]
    fn a_wait_on_another_thread_goes_on_in_its_timeline() {
        let mut th = Threads::default();
        // 1: waiting for input until the request (arrival 0 is inside), then blocked on 2.
        th.blocked(1, 10 * MS, 100 * MS, Class::Lock, Some(2), None);
        // 2: idle on its condition variable until 1 woke it at 10 ms; a CPU wait and a disk read.
        th.blocked(2, 0, 10 * MS, Class::Lock, Some(1), None);
        th.cpu_wait(2, 30 * MS, 50 * MS, 999);
        th.blocked(2, 60 * MS, 70 * MS, Class::Disk, None, None);
        // 2 wakes 1 at 100 ms; 2 blocks after.
        th.blocked(2, 101 * MS, 500 * MS, Class::Lock, None, None);
        th.finish();
        let p = th.walk(1, 0, 110 * MS);
        let tids: Vec<u32> = p.threads.iter().map(|t| t.tid).collect();
        assert_eq!(tids, vec![2, 1], "the longest first");
        // 1 ran 100..110 and 0..10; 2 ran 10..30, 50..60, 70..100.
        assert!((p.states.running - 80.0).abs() < 1e-6, "{p:?}");
        assert!((p.states.cpu_wait - 20.0).abs() < 1e-6, "{p:?}");
        assert!((p.states.disk - 10.0).abs() < 1e-6, "{p:?}");
        assert_eq!(p.states.idle, 0.0);
        assert_eq!(p.hops, 2, "1 on 2, and 2 on 1 before it (the hand-over): {p:?}");
        let h = &p.threads[0];
        assert!((h.ms - 90.0).abs() < 1e-6);
        assert!((h.states.running - 60.0).abs() < 1e-6 && (h.states.cpu_wait - 20.0).abs() < 1e-6, "{h:?}");
        assert_eq!(h.states.words(), "running 60 ms, waiting for a CPU 20 ms, blocked on disk 10 ms");
        assert!((p.threads[1].ms - 20.0).abs() < 1e-6 && p.threads[1].states.running == p.threads[1].ms);
        assert_eq!(p.not_walked_ms, 0.0);
    }

    /// A wait nobody in the server ended (the network, a timer) is idle, in the thread's own time.
    #[test]
    fn an_outside_wake_up_is_idle_and_stays_in_the_thread() {
        let mut th = Threads::default();
        th.blocked(1, 5 * MS, 25 * MS, Class::Outside, Some(2), None);
        th.blocked(1, 30 * MS, 40 * MS, Class::Lock, None, None);
        th.finish();
        let p = th.walk(1, 0, 50 * MS);
        assert_eq!(p.threads.len(), 1);
        assert!((p.states.idle - 30.0).abs() < 1e-6 && (p.states.running - 20.0).abs() < 1e-6, "{p:?}");
        assert_eq!(p.hops, 0);
    }

    /// Two threads waking each other at one instant (timestamps that tie) end, all time said.
    #[test]
    fn a_wake_up_loop_ends() {
        let mut th = Threads::default();
        th.blocked(1, 10 * MS, 50 * MS, Class::Lock, Some(2), None);
        th.blocked(2, 20 * MS, 50 * MS, Class::Lock, Some(1), None);
        th.finish();
        let p = th.walk(1, 0, 60 * MS);
        let s = p.states;
        assert!((s.running + s.cpu_wait + s.disk + s.memory + s.idle + p.not_walked_ms - 60.0).abs() < 1e-6, "{p:?}");
    }

    /// On-CPU swap-in time (from samples) is memory, cut out of the running time around it,
    /// overlapping estimates counted once.
    #[test]
    fn swap_in_on_the_cpu_is_memory() {
        let mut th = Threads::default();
        th.blocked(1, 40 * MS, 50 * MS, Class::Memory, None, None);
        th.memory_on_cpu(1, 10 * MS, 20 * MS);
        th.memory_on_cpu(1, 15 * MS, 25 * MS);
        th.memory_on_cpu(1, 55 * MS, 70 * MS);
        th.finish();
        let p = th.walk(1, 0, 60 * MS);
        assert!((p.states.memory - 30.0).abs() < 1e-6, "15 ms on the CPU, 10 blocked, 5 after: {p:?}");
        assert!((p.states.running - 30.0).abs() < 1e-6, "{p:?}");
        assert_eq!(p.threads[0].states.words(), "running 30 ms, in reclaim or swap-in 30 ms");
    }

    /// Where a thread waited is summed per place over the part of the path that was its, the
    /// longest first; waits the path did not go through (before `from`), and waits another server
    /// thread ended, are not counted.
    #[test]
    fn waits_are_named_by_where_they_were() {
        let mut th = Threads::default();
        let recv = th.site("[network wait] in m.f (m.py:3) under m.g (m.py:9)");
        let lock = th.site("[lock wait]");
        assert_eq!(th.site("[lock wait]"), lock);
        th.blocked(1, 0, 20 * MS, Class::Outside, None, Some(recv));
        th.blocked(1, 30 * MS, 40 * MS, Class::Outside, None, Some(recv));
        th.blocked(1, 45 * MS, 60 * MS, Class::Lock, None, Some(lock));
        // A poll another server thread ended: its time, not a place named.
        th.blocked(1, 62 * MS, 68 * MS, Class::Outside, Some(2), Some(recv));
        th.finish();
        let p = th.walk(1, 10 * MS, 70 * MS);
        let w: Vec<(f64, &str)> = p.threads[0].waits.iter().map(|w| (w.ms, w.site.as_str())).collect();
        assert_eq!(w, vec![(20.0, "[network wait] in m.f (m.py:3) under m.g (m.py:9)"), (15.0, "[lock wait]")]);
    }

    /// A thread with no interval ran the whole window.
    #[test]
    fn an_unseen_thread_ran() {
        let mut th = Threads::default();
        th.finish();
        let p = th.walk(7, 10 * MS, 30 * MS);
        assert!((p.states.running - 20.0).abs() < 1e-6);
    }
}
