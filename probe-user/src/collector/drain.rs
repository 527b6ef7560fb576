//! The drain: records one at a time from the ring, the hub's queue or the spill (records copied
//! out of the ring unread while every CPU is busy), taken in turns of bounded length.
use std::time::Instant;

use aya::maps::{MapData, RingBuf};

use super::{DRAIN_RECORDS, DRAIN_TIME, State, hub};
use crate::record::samples::Sample;

/// Records one at a time, from the ring or from the hub's queue for a member.
pub(crate) trait Records {
    /// Hand the next record to `f`; None when none waits.
    fn take(&mut self, f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Option<std::io::Result<()>>;
}

impl Records for RingBuf<MapData> {
    fn take(&mut self, f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Option<std::io::Result<()>> {
        let item = self.next()?;
        Some(f(&item))
    }
}

impl Records for hub::Member {
    fn take(&mut self, f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Option<std::io::Result<()>> {
        let item = self.next_record()?;
        Some(f(&item))
    }
}

/// Records copied out of the ring buffer unread: while every CPU is busy and the ring fills, the
/// drain copies them here (a memcpy, a tenth of reading them) and reads them once a CPU idles,
/// before what came after them. At most [`SPILL_MAX`] bytes: past that they are read at once.
#[derive(Default)]
pub(crate) struct Spill {
    /// Records, each after its length (u32, native order).
    pub(super) buf: Vec<u8>,
    /// Where the next record to read starts.
    pub(super) at: usize,
    /// Memory for the first spill, its pages faulted in at idle priority ([`Spill::prepared`]).
    ready: Option<std::thread::JoinHandle<Vec<u8>>>,
}

/// The most bytes of records kept unread (the ring's own size comes first: 32 MiB by default). A
/// flood past it is read at once: probe's memory stays bounded (tests/load.rs: under 256 MiB
/// while adversarial clients send 1 GB; a 256 MiB spill passed that).
pub(crate) const SPILL_MAX: usize = 64 << 20;
/// The most memory kept for the next spill once one was read through (a spill is about half the
/// ring: 16 MiB by default).
const SPILL_KEEP: usize = 32 << 20;

impl Spill {
    /// A spill whose first `bytes` of memory a thread of idle priority faults in ahead of need. The
    /// first spill comes while every CPU is busy with the server (a request's, often the first
    /// after attach): copying into fresh memory there is mostly page faults, taken from the
    /// server's CPUs (an 18 MB spill of llama-server's whole stacks: 22–36 ms and 11,000 faults
    /// into fresh memory, 2 ms into memory faulted in ahead). Faulted in while a CPU idles (at
    /// start, before the request), the copy is a memcpy. Until that memory is ready a spill takes
    /// fresh memory as before.
    pub(crate) fn prepared(bytes: usize) -> Spill {
        let spawned = std::thread::Builder::new().name("probe-spill".into()).spawn(move || {
            crate::os::procfs::idle_priority();
            // Written, not only reserved: every page faulted in here (`vec![0; n]` would take
            // calloc's pages, untouched).
            #[allow(clippy::slow_vector_initialization)]
            let mut buf: Vec<u8> = Vec::new();
            if buf.try_reserve_exact(bytes).is_ok() {
                buf.resize(bytes, 0);
                buf.clear();
            }
            buf
        });
        Spill { ready: spawned.ok(), ..Spill::default() }
    }

    /// Take the memory [`Spill::prepared`] faulted in, once its thread is done; true when taken.
    pub(super) fn adopt_ready(&mut self) -> bool {
        if !self.ready.as_ref().is_some_and(std::thread::JoinHandle::is_finished) {
            return false;
        }
        match self.ready.take().map(std::thread::JoinHandle::join) {
            Some(Ok(buf)) => {
                self.buf = buf;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn has_room(&self) -> bool {
        self.buf.len() < SPILL_MAX
    }

    pub(crate) fn push(&mut self, rec: &[u8]) {
        let Ok(len) = u32::try_from(rec.len()) else { return };
        if self.buf.capacity() == 0 {
            self.adopt_ready();
        }
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(rec);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.at >= self.buf.len()
    }
}

impl Records for Spill {
    fn take(&mut self, f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> Option<std::io::Result<()>> {
        let len = self.buf.get(self.at..self.at + 4)?;
        let len = u32::from_ne_bytes(len.try_into().ok()?) as usize;
        let (from, to) = (self.at + 4, (self.at + 4 + len).min(self.buf.len()));
        self.at = to;
        let r = f(&self.buf[from..to]);
        if self.is_empty() {
            // Read through: kept for the next spill (its pages already faulted in) up to
            // SPILL_KEEP; the rest of a larger one goes back (a spill of a busy minute is
            // hundreds of MB; shrunk in place, what is kept stays faulted in).
            self.buf.clear();
            self.at = 0;
            if self.buf.capacity() > SPILL_KEEP {
                self.buf.shrink_to(SPILL_KEEP);
            }
        }
        Some(r)
    }
}

/// One turn of the drain: at most [`DRAIN_RECORDS`] records or [`DRAIN_TIME`] (those copied out
/// earlier first, [`Spill`]), then the samplers' records and the /proc refresh. True when it
/// stopped early (more may be waiting). `spill`: every CPU is busy and the ring fills: copy its
/// records out unread instead, and leave the rest for a turn with a CPU to spare.
pub(super) fn drain_turn(
    src: &mut dyn Records,
    st: &mut State,
    sampler: &crate::sampler::Sampler,
    mode: TurnMode,
) -> std::io::Result<bool> {
    let spill = mode.spill;
    if spill {
        while st.spill.has_room() {
            let spilled = &mut st.spill;
            match src.take(&mut |item| {
                spilled.push(item);
                Ok(())
            }) {
                None => return Ok(false),
                Some(r) => r?,
            }
        }
    }
    let mut budget = Budget { t0: Instant::now(), n: 0, preempted: mode.polite.then(crate::os::procfs::preemptions) };
    let mut stop = Stop::Empty;
    if !st.spill.is_empty() {
        let mut spilled = std::mem::take(&mut st.spill);
        stop = take_records(&mut spilled, st, &mut budget)?;
        st.spill = spilled;
    }
    if stop == Stop::Empty {
        stop = take_records(src, st, &mut budget)?;
    }
    if stop == Stop::Yielded {
        st.yielded_turns += 1;
    }
    let more = stop == Stop::Budget;
    for v in sampler.drain() {
        st.writer.sample(&v)?;
        if let (Some(l), Sample::Residency(r)) = (&mut st.live, &v) {
            l.residency(r);
        }
        if let Some(w) = &st.watch
            && matches!(v, Sample::Residency(_) | Sample::Endpoint(_))
        {
            w.send(crate::collector::segments::Msg::Sample(Box::new(v)));
        }
    }
    st.refresh()?;
    Ok(more)
}

/// How a drain turn takes its records.
#[derive(Clone, Copy, Default)]
pub(super) struct TurnMode {
    /// Every CPU is busy and the ring fills: copy its records out unread ([`Spill`]).
    pub spill: bool,
    /// The drain runs at idle priority to leave the CPUs to the server: a turn whose thread was
    /// preempted stops there ([`Stop::Yielded`]).
    pub polite: bool,
}

/// Why [`take_records`] stopped.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stop {
    /// Nothing left to take.
    Empty,
    /// The turn's records or time were spent, records left: behind.
    Budget,
    /// Preempted at idle priority: records left for a later turn, not behind.
    Yielded,
}

/// What a turn has spent so far: its start, the records taken, and the thread's involuntary
/// switches at its start (None: it does not yield, [`TurnMode::polite`]).
struct Budget {
    t0: Instant,
    n: usize,
    preempted: Option<i64>,
}

/// Read records from `src` while the turn's budget lasts.
/// A polite turn looks every 64 records whether its thread was preempted since the turn began:
/// at idle priority that means a server thread woke on its CPU, and the drain, still runnable,
/// would take its small weight's share of that CPU in slices of milliseconds (EEVDF picks an
/// idle-priority task that has waited, whatever its weight) while the server thread waits. It
/// stops instead, and the records wait in the ring for a turn with a CPU to spare (or for the
/// watchdog, which raises the drain when the ring passes half full).
fn take_records(src: &mut dyn Records, st: &mut State, b: &mut Budget) -> std::io::Result<Stop> {
    while !st.stop_writing() {
        match src.take(&mut |item| st.on_record(item)) {
            None => return Ok(Stop::Empty),
            Some(r) => r?,
        }
        b.n += 1;
        if b.n >= DRAIN_RECORDS {
            return Ok(Stop::Budget);
        }
        if b.n.is_multiple_of(64) {
            if b.preempted.is_some_and(|at| crate::os::procfs::preemptions() > at) {
                return Ok(Stop::Yielded);
            }
            if b.t0.elapsed() >= DRAIN_TIME {
                return Ok(Stop::Budget);
            }
        }
    }
    Ok(Stop::Empty)
}
