//! probe's own threads off the server's CPUs: the ring's drain and the samplers run at idle
//! priority while they keep up, at normal priority from the turn they fall behind; a watchdog
//! raises one that cannot run to see it is behind.
use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use crate::os::procfs::{effective_caps, set_policy};

/// A thread that must keep up (the ring's drain, the samplers) but should not take a CPU from the
/// server while it does: it runs at idle priority (a waking server thread preempts it at once),
/// and at normal priority from the turn it falls behind (a backlog in the ring, a late sample)
/// until it has kept up again ([`Policy`]). A thread at idle priority on CPUs that others keep
/// busy may not run at all to see that it is behind: a watchdog thread at normal priority (asleep
/// but for a look every 100 ms) raises it when what it drains is half full or filling fast (a
/// ring buffer's positions, read from a mapping of its own) or its last turn is overdue. Only
/// where it may go back: root or CAP_SYS_NICE (leaving SCHED_IDLE needs one); otherwise it stays
/// at normal priority.
pub struct Yielding {
    name: &'static str,
    /// It may leave idle priority again (root, CAP_SYS_NICE).
    may: bool,
    policy: Policy,
    beat: Arc<Heartbeat>,
    /// Turns spent behind, at normal priority (for the report's cost line).
    pub behind_turns: u64,
}

/// What the watchdog reads of a yielding thread.
struct Heartbeat {
    tid: libc::pid_t,
    /// Monotonic ns of its last turn.
    last_ns: AtomicU64,
    /// How long after its last turn the next is overdue (0: none expected).
    due_ns: AtomicU64,
    /// Set by the watchdog when it raised the thread.
    raised: AtomicBool,
    /// Its last turn had work (records flowing, a busy target).
    busy: AtomicBool,
    done: AtomicBool,
    /// What it keeps up with, when that can be read from here.
    backlog: Option<RingFill>,
    /// The backlog's fill at the watchdog's last look (f64 bits; the watchdog's own).
    last_fill: AtomicU64,
    /// Monotonic ns it started yielding: its first second is watched closely ([`WATCH_START`]).
    born_ns: u64,
    /// Set by the watchdog while the thread should not run at all ([`Yielding::held`]).
    held: AtomicBool,
    /// It may be held without a backlog in sight ([`Yielding::hold_when_busy`]).
    holdable: AtomicBool,
    /// Set by the watchdog while every CPU is busy ([`Yielding::spill`]).
    saturated: AtomicBool,
    /// Woken when the watchdog lets a held thread go.
    release: tokio::sync::Notify,
    /// A count that, when it moves, lets a held thread go for [`URGENT_NS`] (a library mapped:
    /// the drain's once-a-second turn attaches the engine probe there), and its last value.
    urgent: Option<Urgent>,
    urgent_seen: AtomicU64,
    /// Whether the server's threads are runnable now (the kernel's count of the targets'
    /// runnable threads), for a thread that waits while they run ([`BUSY_IDLE`]).
    server_runs: Option<ServerRuns>,
    /// When the urgent count is read next (monotonic ns; the watchdog's own).
    urgent_next_ns: AtomicU64,
    /// Not held before this (monotonic ns).
    free_until_ns: AtomicU64,
    /// The backlog's producer position at the watchdog's last look (the watchdog's own).
    last_produced: AtomicU64,
    /// The producer position and the time at the last busy look, for the ring's rate
    /// ([`busy_pace`]; the watchdog's own).
    pace_produced: AtomicU64,
    pace_ns: AtomicU64,
}

impl Heartbeat {
    /// Nothing to watch closely: not busy, held or raised, and no more than an idle server's
    /// trickle written to its ring since the last look (a ring starting to fill brings the
    /// watchdog back to its quarter-second).
    fn quiet(&self) -> bool {
        let produced = self.backlog.as_ref().map_or(0, RingFill::produced);
        let moved = produced.saturating_sub(self.last_produced.swap(produced, Relaxed)) >= QUIET_BYTES;
        !moved && !self.busy.load(Relaxed) && !self.held.load(Relaxed) && !self.raised.load(Relaxed)
    }
}

/// Reads a count the watchdog watches ([`Heartbeat::urgent`]).
pub type Urgent = Box<dyn Fn() -> u64 + Send + Sync>;

/// Says whether the server's threads are runnable now ([`Heartbeat::server_runs`]).
pub type ServerRuns = Box<dyn Fn() -> bool + Send + Sync>;

/// How often, at most, the watchdog reads an urgent count while it holds a thread.
const URGENT_EVERY: Duration = Duration::from_millis(250);
/// How long a held thread is let go when its urgent count moves: past its next once-a-second turn.
const URGENT_NS: u64 = 1_500_000_000;

/// How full a BPF ring buffer is, from a read-only mapping of its two position pages (the
/// kernel lets any part be mapped read-only): producer − consumer, over its size.
pub struct RingFill {
    at: std::ptr::NonNull<libc::c_void>,
    page: usize,
    size: u64,
}

// SAFETY: a read-only shared mapping, read with volatile loads of two u64 the kernel and the
// drain update atomically; nothing is written through it.
unsafe impl Send for RingFill {}
// SAFETY: as above.
unsafe impl Sync for RingFill {}

impl RingFill {
    /// Map the position pages of the ring buffer map `fd` of `size` bytes.
    pub fn new(fd: &impl std::os::fd::AsFd, size: u64) -> Option<RingFill> {
        use std::os::fd::AsRawFd;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        // SAFETY: a fresh read-only shared mapping of two pages of a ring buffer map's descriptor;
        // checked for failure below, unmapped once in Drop.
        let at = unsafe { libc::mmap(std::ptr::null_mut(), 2 * page, libc::PROT_READ, libc::MAP_SHARED, fd.as_fd().as_raw_fd(), 0) };
        if at == libc::MAP_FAILED {
            return None;
        }
        Some(RingFill { at: std::ptr::NonNull::new(at)?, page, size: size.max(1) })
    }

    /// The consumer and producer positions (bytes read and written since the ring was made).
    fn positions(&self) -> (u64, u64) {
        // SAFETY: both positions are the first u64 of a page of the live mapping.
        unsafe {
            let base = self.at.as_ptr().cast::<u8>();
            (std::ptr::read_volatile(base.cast::<u64>()), std::ptr::read_volatile(base.add(self.page).cast::<u64>()))
        }
    }

    /// The share of the ring holding records not yet read (0..1).
    pub fn fill(&self) -> f64 {
        let (consumer, producer) = self.positions();
        producer.saturating_sub(consumer) as f64 / self.size as f64
    }

    /// Bytes the kernel has written to the ring since it was made: what the target did, seen
    /// without reading a record.
    pub fn produced(&self) -> u64 {
        self.positions().1
    }
}

impl Drop for RingFill {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that length, unmapped once.
        unsafe { libc::munmap(self.at.as_ptr(), 2 * self.page) };
    }
}

/// Turns in a row that keep up before a thread yields again.
const KEEP_UP: u32 = 5;
/// The least time since it last fell behind before a thread yields again; doubled each time it
/// falls behind soon after yielding, up to `MAX_CALM`.
const MIN_CALM: Duration = Duration::from_secs(1);
const MAX_CALM: Duration = Duration::from_secs(32);
/// The ring's fill at which the watchdog raises its drain: the other half holds what the kernel
/// writes until the raised drain runs (at the CPU-hog tests' 16 MB/s, half of the default ring
/// lasts 500 ms; the watchdog looks every 100 ms). A ring filling faster is raised earlier: when
/// at the rate since the last look it would pass `RAISE_AHEAD` within two more looks.
const RAISE_AT_FILL: f64 = 0.5;
/// The ring's fill from which a drain let go while every CPU is busy copies records out unread
/// ([`Yielding::spill`]), to make room; below it, it reads them. The fill it is raised at: a
/// drain let go for another reason (a CPU idled at the last look, busy again at this one, often
/// by probe's own turn) has room to spare.
const SPILL_AT_FILL: f64 = RAISE_AT_FILL;
const RAISE_AHEAD: f64 = 0.75;
const CAP_SYS_NICE: u64 = 1 << 23;
const WATCH_EVERY: Duration = Duration::from_millis(100);
const WATCH_IDLE: Duration = Duration::from_millis(250);
/// How often the watchdog looks while nothing happens: no watched thread busy or held, the CPUs
/// not saturated at the last look and nothing written to a watched ring since. Nothing is held
/// then, so a look that comes late only holds late (a drain at idle priority meanwhile); each
/// look is a wake-up (tens of µs on a VM) and a read of /proc/stat.
const WATCH_QUIET: Duration = Duration::from_secs(1);
/// What a ring may take between two looks and still count as quiet (an idle server's threads
/// waking now and then write a few KiB a second).
const QUIET_BYTES: u64 = 64 << 10;
/// How often, at most, the watchdog looks in a thread's first [`START_NS`]: right after attach
/// a small ring can fill in a tenth of a second (a decode's thread pool switching 26,000 times a
/// second) while the drain, held, waits behind the server it must not delay. It looks as often
/// as a sixteenth of the smallest watched ring fills at [`FAST_FILL`] (every 65 ms for the
/// default 32 MiB), never more often than this: each look is a wake-up of probe's at normal
/// priority, which a server thread waking at the same tick waits behind (at 10 ms for every
/// ring, those waits were 6 ms of a request started right after attach).
const WATCH_START: Duration = Duration::from_millis(10);
/// The fastest fill the first second's looks are paced for, bytes a second (twice the CPU-hog
/// tests' 16 MB/s).
const FAST_FILL: u64 = 32 << 20;
const START_NS: u64 = 1_000_000_000;
/// The CPUs count as saturated while less than this share of one CPU was idle over the last
/// [`IDLE_WINDOW`]: a drain at idle priority then has no idle time to run in, only its small
/// weight's share of a CPU a server thread is waiting for.
const SATURATED_IDLE: f64 = 0.05;
/// Less than this share of one CPU idle over the last window, with the server's own threads
/// runnable ([`Heartbeat::server_runs`]), a drain waits too: a drain at idle priority that runs in
/// the idle moments of a server using every CPU (a thread pool spinning at its barriers, yielding
/// the CPU to whatever is runnable) holds a CPU a server thread wants back a moment later: 2-3 ms
/// at a time, 6-8 ms of a request started right after attach. With half a CPU idle or more it
/// runs beside the server.
const BUSY_IDLE: f64 = 0.5;
/// The least window over which the CPUs' idle time is measured (/proc/stat counts in 10 ms
/// ticks: over the least window, "saturated" is less than a tick of idle time).
const IDLE_WINDOW_NS: u64 = 50_000_000;
const IDLE_READ_NS: u64 = 25_000_000;

/// When a yielding thread goes back to idle priority: after `KEEP_UP` turns in a row that kept
/// up, and no sooner than `calm` since it last fell behind. A thread that falls behind again soon
/// after it yielded (within 4 × `calm`) doubles `calm`: under a load that idle priority cannot keep
/// up with (every CPU busy with many threads, a ring filling at tens of MB/s) it then stays at
/// normal priority, as it would without yielding, instead of yielding, starving and being raised
/// over and over (each time with half a ring of records waiting: the last half is all the
/// margin there is). A long stretch at idle priority before a fall starts `calm` over.
#[derive(Debug)]
struct Policy {
    idle: bool,
    kept_up: u32,
    fell_ns: u64,
    idle_since_ns: u64,
    calm_ns: u64,
}

#[derive(Debug, PartialEq)]
enum Change {
    Stay,
    /// To normal priority.
    Raise,
    /// To idle priority.
    Lower,
}

impl Policy {
    fn new(idle: bool, now_ns: u64) -> Policy {
        Policy { idle, kept_up: 0, fell_ns: now_ns, idle_since_ns: now_ns, calm_ns: MIN_CALM.as_nanos() as u64 }
    }

    /// One turn at `now_ns`: `fell`, it was behind (or raised by the watchdog); `may`, it may
    /// leave idle priority again later.
    fn turn(&mut self, now_ns: u64, fell: bool, may: bool) -> Change {
        if fell {
            self.kept_up = 0;
            self.fell_ns = now_ns;
            if !self.idle {
                return Change::Stay;
            }
            let (min, max) = (MIN_CALM.as_nanos() as u64, MAX_CALM.as_nanos() as u64);
            self.calm_ns =
                if now_ns.saturating_sub(self.idle_since_ns) < self.calm_ns.saturating_mul(4) { (self.calm_ns * 2).min(max) } else { min };
            self.idle = false;
            return Change::Raise;
        }
        if self.idle || !may {
            return Change::Stay;
        }
        self.kept_up += 1;
        if self.kept_up >= KEEP_UP && now_ns.saturating_sub(self.fell_ns) >= self.calm_ns {
            self.idle = true;
            self.idle_since_ns = now_ns;
            return Change::Lower;
        }
        Change::Stay
    }
}

/// Whether the watchdog raises a thread whose backlog is `fill` full, `last` at its last look.
fn filling(fill: f64, last: f64) -> bool {
    fill > RAISE_AT_FILL || fill + 2.0 * (fill - last).max(0.0) > RAISE_AHEAD
}

/// The CPUs' idle time from /proc/stat's first line (idle and iowait, every CPU), kept over a
/// short window: whether a thread at idle priority has idle time to run in.
struct CpuIdle {
    file: Option<std::fs::File>,
    /// (monotonic ns, idle ms) at past looks, oldest first, spanning at least the window.
    seen: std::collections::VecDeque<(u64, u64)>,
    /// The answer at the last read.
    last: bool,
    /// Less than [`BUSY_IDLE`] of one CPU was idle over the last window.
    busy: bool,
}

impl CpuIdle {
    fn new() -> CpuIdle {
        CpuIdle { file: std::fs::File::open("/proc/stat").ok(), seen: std::collections::VecDeque::new(), last: false, busy: false }
    }

    /// The CPUs' idle time in ms since boot (idle + iowait of the `cpu` line).
    fn idle_ms(&mut self) -> Option<u64> {
        use std::os::unix::fs::FileExt as _;
        let mut buf = [0u8; 256];
        let n = self.file.as_ref()?.read_at(&mut buf, 0).ok()?;
        let line = std::str::from_utf8(&buf[..n]).ok()?.lines().next()?;
        parse_idle_ms(line, crate::os::procfs::clock_ticks())
    }

    /// Whether less than [`SATURATED_IDLE`] of one CPU was idle over the last window (false until
    /// a window has been seen).
    fn saturated(&mut self, now_ns: u64) -> bool {
        // /proc/stat is made whole at each read (every IRQ's count: tens of µs): read at most
        // every IDLE_READ, the last answer standing between.
        if let Some(&(t, _)) = self.seen.back()
            && now_ns.saturating_sub(t) < IDLE_READ_NS
        {
            return self.last;
        }
        let Some(idle) = self.idle_ms() else { return false };
        self.observe(now_ns, idle)
    }

    /// A reading of `idle` ms at `now_ns`: whether the CPUs were busy over the window it closes.
    fn observe(&mut self, now_ns: u64, idle: u64) -> bool {
        self.seen.push_back((now_ns, idle));
        while self.seen.len() > 2 && now_ns.saturating_sub(self.seen[1].0) >= IDLE_WINDOW_NS {
            self.seen.pop_front();
        }
        let &(t0, i0) = self.seen.front().expect("pushed above");
        let span = now_ns.saturating_sub(t0);
        let idle_ms = idle.saturating_sub(i0) as f64;
        self.last = span >= IDLE_WINDOW_NS && idle_ms < SATURATED_IDLE * span as f64 / 1e6;
        self.busy = span >= IDLE_WINDOW_NS && idle_ms < BUSY_IDLE * span as f64 / 1e6;
        self.last
    }
}

/// Whether every CPU has been busy over the last window (see [`CpuIdle`]).
fn saturated(now_ns: u64) -> bool {
    cpus(now_ns).0
}

/// Over the last window: every CPU busy ([`SATURATED_IDLE`]), and less than half a CPU idle
/// ([`BUSY_IDLE`]).
fn cpus(now_ns: u64) -> (bool, bool) {
    static CPUS: OnceLock<Mutex<CpuIdle>> = OnceLock::new();
    let mut c = CPUS.get_or_init(|| Mutex::new(CpuIdle::new())).lock().unwrap_or_else(|e| e.into_inner());
    let saturated = c.saturated(now_ns);
    (saturated, c.busy)
}

/// Start measuring the CPUs' idle time now, so that a drain starting once probe has armed
/// knows at once whether they are all busy (a request in flight at attach).
pub fn prime() {
    saturated(crate::monotonic_ns());
}

/// How often the watchdog looks in a thread's first second ([`WATCH_START`]): as a sixteenth of
/// the smallest watched ring fills at [`FAST_FILL`], between `WATCH_START` and [`WATCH_EVERY`].
fn start_pace(beats: &[Arc<Heartbeat>]) -> Duration {
    pace_for(beats.iter().filter_map(|b| b.backlog.as_ref()).map(|r| r.size).min())
}

/// How often the watchdog looks while a watched thread has work: as often as a sixteenth of its
/// ring fills at the rate the kernel wrote to it since the last look, between [`WATCH_EVERY`]
/// and [`WATCH_IDLE`] (a decode writing 3.5 MB a second to the default ring is looked at every
/// 250 ms: four wake-ups of probe's a second at normal priority where there were ten). A thread
/// without a ring in sight is looked at every `WATCH_EVERY` when its turns are due that often
/// (a hub member's), else every `WATCH_IDLE` (the samplers: seconds of slack).
fn busy_pace(beats: &[Arc<Heartbeat>], now: u64) -> Duration {
    let mut pace = WATCH_IDLE;
    for b in beats.iter().filter(|b| b.busy.load(Relaxed)) {
        let p = match &b.backlog {
            Some(r) => {
                let produced = r.produced();
                let (then, at) = (b.pace_produced.swap(produced, Relaxed), b.pace_ns.swap(now, Relaxed));
                match now.checked_sub(at).filter(|&dt| at > 0 && dt > 0) {
                    Some(dt) => pace_at(r.size, produced.saturating_sub(then) as f64 * 1e9 / dt as f64),
                    None => WATCH_EVERY,
                }
            }
            None if b.due_ns.load(Relaxed) < 1_000_000_000 => WATCH_EVERY,
            None => WATCH_IDLE,
        };
        pace = pace.min(p);
    }
    pace
}

/// [`busy_pace`] for a ring of `size` bytes written at `per_s` bytes a second.
fn pace_at(size: u64, per_s: f64) -> Duration {
    if per_s <= 0.0 {
        return WATCH_IDLE;
    }
    Duration::from_secs_f64(size as f64 / 16.0 / per_s).clamp(WATCH_EVERY, WATCH_IDLE)
}

/// [`start_pace`] for the smallest watched ring's size (None: no ring watched).
fn pace_for(smallest: Option<u64>) -> Duration {
    smallest.map_or(WATCH_EVERY, |size| Duration::from_secs_f64(size as f64 / 16.0 / FAST_FILL as f64).clamp(WATCH_START, WATCH_EVERY))
}

/// Idle + iowait of /proc/stat's `cpu` line, in ms (`hz` clock ticks a second).
fn parse_idle_ms(line: &str, hz: u64) -> Option<u64> {
    let mut f = line.split_ascii_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.take(5).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    Some((v.get(3)? + v.get(4)?) * 1000 / hz.max(1))
}

/// The watched threads, and the watchdog's wake-up when one starts (its first look is then due
/// at once, not at the end of a quarter-second sleep).
fn watchdog() -> &'static (Mutex<Vec<Arc<Heartbeat>>>, std::sync::Condvar) {
    static BEATS: OnceLock<(Mutex<Vec<Arc<Heartbeat>>>, std::sync::Condvar)> = OnceLock::new();
    BEATS.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("probe-watchdog".into()).spawn(|| {
            // Nice 19, not idle priority: it must run while the server keeps every CPU busy (to
            // raise a drain that cannot), but it need not run the moment it wakes. At nice 0 each
            // look (tens of µs here) preempted a server thread as it woke: the verdicts charged
            // probe 50 µs at every look during a request. At nice 19 its wake-up waits for the
            // running thread's slice (a few ms); a look every 100 ms is 0.1% of its share.
            // SAFETY: setpriority on this thread (tid) only.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
            let mut every = WATCH_EVERY;
            let (list, wake) = watchdog();
            let mut beats = list.lock().unwrap_or_else(|e| e.into_inner());
            let mut was_saturated = false;
            loop {
                beats = wake.wait_timeout(beats, every).unwrap_or_else(|e| e.into_inner()).0;
                let now = crate::monotonic_ns();
                beats.retain(|b| !b.done.load(Relaxed));
                // Every 10–100 ms in a thread's first second (by its ring's size), every 100–250
                // ms while a watched thread has work flowing (by its ring's rate), every 250 ms otherwise (a ring filling from idle at 16 MB/s
                // is then seen at most 4 MB past half full), every second while nothing happens.
                every = if beats.iter().any(|b| now.saturating_sub(b.born_ns) < START_NS) {
                    start_pace(&beats)
                } else if beats.iter().any(|b| b.busy.load(Relaxed)) {
                    busy_pace(&beats, now)
                } else {
                    WATCH_IDLE
                };
                // Every beat is asked (not `all`, which stops at the first busy one): each keeps
                // its ring's position for the next look.
                let quiet = every == WATCH_IDLE && !was_saturated && beats.iter().fold(true, |q, b| b.quiet() & q);
                if quiet {
                    every = WATCH_QUIET;
                }
                // /proc/stat's first line: at most 40 reads a second, none while quiet (the kernel
                // makes the whole file at each read, every IRQ's count: most of a quiet look's
                // cost). Nothing flows then, so nothing is held; the first look that sees records
                // flowing reads it (over the whole quiet spell: the window only widens).
                let (saturated, busy) = if !beats.is_empty() && !quiet { cpus(now) } else { (false, false) };
                was_saturated = saturated;
                for b in beats.iter() {
                    let due = b.due_ns.load(Relaxed);
                    let fill = b.backlog.as_ref().map_or(0.0, RingFill::fill);
                    let last = f64::from_bits(b.last_fill.swap(fill.to_bits(), Relaxed));
                    let full = due > 0 && b.backlog.is_some() && filling(fill, last);
                    // A drain whose records can wait in the ring waits there, not runnable at
                    // all, while the server keeps every CPU busy: at idle priority it would still
                    // take its weight's share of a CPU a server thread waits for. Let go when
                    // a CPU idles, when the ring fills (then raised too), when the trace stops.
                    // A thread without such a backlog (the samplers) is held until its turn is
                    // overdue: then it takes one, raised, and is held again.
                    let late = due > 0 && now.saturating_sub(b.last_ns.load(Relaxed)) > due;
                    let mut urgent = false;
                    // Read at most every URGENT_EVERY (a system call, and aya's count of the
                    // CPUs from sysfs: a quarter of a look's cost when read at each).
                    if let Some(count) = &b.urgent
                        && saturated
                        && now >= b.urgent_next_ns.load(Relaxed)
                    {
                        b.urgent_next_ns.store(now + URGENT_EVERY.as_nanos() as u64, Relaxed);
                        let n = count();
                        if b.urgent_seen.swap(n, Relaxed) != n {
                            b.free_until_ns.store(now + URGENT_NS, Relaxed);
                            urgent = true;
                        }
                    }
                    let free = now < b.free_until_ns.load(Relaxed);
                    // Less than half a CPU idle and the server's threads runnable: a drain waits
                    // too ([`BUSY_IDLE`]; the kernel's count read only then).
                    let server = !saturated && busy && b.backlog.is_some() && b.server_runs.as_ref().is_some_and(|runs| runs());
                    let hold =
                        due > 0 && (saturated || server) && !full && !free && b.holdable.load(Relaxed) && (b.backlog.is_some() || !late);
                    b.saturated.store(saturated, Relaxed);
                    if b.held.swap(hold, Relaxed) && !hold {
                        b.release.notify_one();
                    }
                    let overdue = late && !hold;
                    if (overdue || full || urgent) && !b.raised.load(Relaxed) {
                        // The tid is a thread of this process (it leaves the list, `done`,
                        // before it ends).
                        if raise(b.tid) {
                            b.raised.store(true, Relaxed);
                        }
                    }
                }
            }
        });
        if let Err(e) = spawned {
            log::warn!("no watchdog thread ({e}): yielding threads are raised only when they run");
        }
        (Mutex::new(Vec::new()), std::sync::Condvar::new())
    })
}

/// Raise thread `tid` of this process to normal priority now, for a reading that must be taken at
/// a moment (a request's arrival): it lowers itself again ([`Yielding::settle`]). Best effort:
/// leaving idle priority needs root or CAP_SYS_NICE.
pub fn raise(tid: libc::pid_t) -> bool {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: a valid sched_param; a thread of this process (the caller's to name).
    unsafe { libc::sched_setscheduler(tid, libc::SCHED_OTHER, &p) == 0 }
}

/// Set by [`never`]: no thread yields (`probe trace --no-yield`).
static NEVER: AtomicBool = AtomicBool::new(false);

/// Keep every thread at normal priority and never hold one back, for the rest of the process.
pub fn never() {
    NEVER.store(true, Relaxed);
}

impl Yielding {
    /// Start yielding on the calling thread (when it could stop yielding again); its first turn
    /// is overdue after `first`. `backlog`: what it drains, when the watchdog can read its fill;
    /// `urgent`: a count that lets it go when it moves while held.
    pub fn start(
        name: &'static str,
        first: Duration,
        backlog: Option<RingFill>,
        urgent: Option<Urgent>,
        server_runs: Option<ServerRuns>,
    ) -> Yielding {
        // SAFETY: geteuid and gettid have no preconditions.
        let (euid, tid) = unsafe { (libc::geteuid(), libc::gettid()) };
        let may = (euid == 0 || effective_caps() & CAP_SYS_NICE != 0) && !NEVER.load(Relaxed);
        let now = crate::monotonic_ns();
        let holdable = backlog.is_some();
        let beat = Arc::new(Heartbeat {
            tid,
            last_ns: now.into(),
            due_ns: (first.as_nanos() as u64).into(),
            raised: false.into(),
            busy: false.into(),
            done: false.into(),
            backlog,
            last_fill: 0f64.to_bits().into(),
            born_ns: now,
            held: false.into(),
            holdable: holdable.into(),
            saturated: false.into(),
            release: tokio::sync::Notify::new(),
            urgent_seen: urgent.as_ref().map_or(0, |c| c()).into(),
            urgent_next_ns: 0.into(),
            server_runs,
            urgent,
            free_until_ns: 0.into(),
            last_produced: 0.into(),
            pace_produced: 0.into(),
            pace_ns: 0.into(),
        });
        if may {
            // A drain whose backlog can wait is held from its first turn when every CPU is busy
            // (the records of a request in flight at attach wait in the ring).
            if beat.backlog.is_some() && saturated(now) {
                beat.held.store(true, Relaxed);
                beat.saturated.store(true, Relaxed);
            }
            let (list, wake) = watchdog();
            list.lock().unwrap_or_else(|e| e.into_inner()).push(beat.clone());
            wake.notify_one();
        }
        // Idle priority from the start. A drain at normal priority in its first second (once
        // chosen for the burst of records right after attach) woke on the CPUs of the request the
        // user attached for, preempting its threads 20 to 30 times for 25 µs to 2.5 ms each: 6-8 ms
        // of that request charged to probe. The ring holds the burst meanwhile; the watchdog
        // looks closely in the first second ([`WATCH_START`]) and raises the drain when the ring
        // fills; a turn at idle priority stops when a server thread takes its CPU
        // ([`Yielding::polite`]).
        if may && set_policy(libc::SCHED_IDLE).is_ok() {
            return Yielding { name, may, policy: Policy::new(true, now), beat, behind_turns: 0 };
        }
        Yielding { name, may, policy: Policy::new(false, now), beat, behind_turns: 0 }
    }

    /// Whether a turn should stop when its thread is preempted: it runs at idle priority to
    /// leave the CPUs to the server (not raised: behind, or its ring filling).
    pub fn polite(&self) -> bool {
        self.may && self.policy.idle && !self.beat.raised.load(Relaxed)
    }

    /// After a turn: `behind`, it fell behind (normal priority from now on); else it kept up.
    /// `busy`: it had work this turn (the watchdog looks more often).
    /// `next`: when the next turn is overdue (the watchdog raises the thread then); None: no turn
    /// is expected (nothing to keep up with).
    pub fn turn(&mut self, behind: bool, busy: bool, next: Option<Duration>) {
        let now = crate::monotonic_ns();
        self.beat.busy.store(busy, Relaxed);
        self.beat.last_ns.store(now, Relaxed);
        self.beat.due_ns.store(next.map_or(0, |d| d.as_nanos() as u64), Relaxed);
        let raised = self.beat.raised.swap(false, Relaxed);
        // At idle priority a turn that found more than it could take is not yet behind when
        // the watchdog sees what is left (a ring's fill): the records wait there while the server
        // keeps every CPU busy, and the drain takes them at idle priority, or raised once the
        // ring is half full. Raised already, a turn left behind keeps it raised.
        let behind = behind && (self.beat.backlog.is_none() || !self.policy.idle);
        if behind || raised {
            self.behind_turns += 1;
        }
        match self.policy.turn(now, behind || raised, self.may) {
            Change::Stay => {}
            Change::Raise if raised => {
                log::info!("{}: overdue at idle priority: raised to normal for at least {} ms", self.name, self.policy.calm_ns / 1_000_000)
            }
            Change::Raise => match set_policy(libc::SCHED_OTHER) {
                Ok(()) => {
                    log::info!("{}: fell behind at idle priority: normal for at least {} ms", self.name, self.policy.calm_ns / 1_000_000)
                }
                Err(e) => log::warn!("{}: fell behind at idle priority and cannot leave it: {e}", self.name),
            },
            Change::Lower => {
                if set_policy(libc::SCHED_IDLE).is_err() {
                    self.policy.idle = false;
                }
            }
        }
    }

    /// At idle priority from the start, for a thread whose work can wait without loss (the
    /// samplers: a reading carries the time it was read). Only the drain starts at normal
    /// priority (its ring holds only so much); the samplers' first turn (the model files found
    /// and measured, the memory files read) came at the moment probe armed, at normal priority,
    /// while the request the user attached for was running.
    pub fn idle_from_start(mut self) -> Yielding {
        if self.may && !self.policy.idle && set_policy(libc::SCHED_IDLE).is_ok() {
            self.policy = Policy::new(true, crate::monotonic_ns());
        }
        self
    }

    /// Back to the priority its policy says, after another thread raised it ([`raise`]).
    pub fn settle(&mut self) {
        if self.may && self.policy.idle && !self.beat.raised.load(Relaxed) && set_policy(libc::SCHED_IDLE).is_err() {
            self.policy.idle = false;
        }
    }

    /// Never held back (the drain while a live view shows: the screen is made from the records
    /// as they come); it still yields at idle priority.
    pub fn never_held(self) -> Yielding {
        self.beat.holdable.store(false, Relaxed);
        self.beat.held.store(false, Relaxed);
        self.beat.saturated.store(false, Relaxed);
        self.beat.release.notify_one();
        self
    }

    /// Let the watchdog hold this thread while every CPU is busy, though what it keeps up with
    /// cannot be seen (the samplers: a reading waits, once 3 s overdue it is taken). A thread
    /// with a queue that overflows (a hub member's) is not held.
    pub fn hold_when_busy(self) -> Yielding {
        self.beat.holdable.store(true, Relaxed);
        self
    }

    /// Whether the watchdog holds this thread back: its backlog can wait while the server keeps
    /// every CPU busy. A held thread waits for [`Yielding::released`] instead of its next turn.
    pub fn held(&self) -> bool {
        self.beat.held.load(Relaxed)
    }

    /// Whether a drain should copy its backlog out unread rather than read it: every CPU is
    /// busy (it runs because its ring filled, not because a CPU is free).
    /// Only once the ring is half full ([`SPILL_AT_FILL`]): below that the room is not needed
    /// yet, and copying the records out costs more than reading them (the spill's fresh pages are
    /// faulted in: 18–21 ms for 2,400 records, 8 MB, here at the end of a request, where reading
    /// them took 5).
    pub fn spill(&self) -> bool {
        self.beat.holdable.load(Relaxed)
            && self.beat.saturated.load(Relaxed)
            && self.beat.backlog.as_ref().is_some_and(|r| r.fill() >= SPILL_AT_FILL)
    }

    /// Bytes written to the ring this thread drains, since it was made (None: no ring in sight).
    pub fn produced(&self) -> Option<u64> {
        self.beat.backlog.as_ref().map(RingFill::produced)
    }

    /// Resolves when the watchdog lets the thread go (at once when it was let go since it was
    /// last seen held).
    pub async fn released(&self) {
        self.beat.release.notified().await;
    }

    /// Normal priority for good (the end of a trace: its last drain and report should not wait).
    pub fn stop(&mut self) {
        self.beat.held.store(false, Relaxed);
        self.beat.due_ns.store(0, Relaxed);
        if self.policy.idle && set_policy(libc::SCHED_OTHER).is_ok() {
            self.policy.idle = false;
        }
        self.may = false;
    }
}

impl Drop for Yielding {
    fn drop(&mut self) {
        self.beat.due_ns.store(0, Relaxed);
        self.beat.done.store(true, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// The first second's looks: a sixteenth of the ring at 32 MB/s, between 10 and 100 ms.
    #[test]
    fn the_first_seconds_looks_follow_the_rings_size() {
        assert_eq!(pace_for(Some(32 << 20)), Duration::from_micros(62_500));
        assert_eq!(pace_for(Some(1 << 20)), WATCH_START);
        assert_eq!(pace_for(Some(256 << 20)), WATCH_EVERY);
        assert_eq!(pace_for(None), WATCH_EVERY);
    }

    /// While busy: a sixteenth of the ring at the rate it is written, between 100 and 250 ms.
    #[test]
    fn busy_looks_follow_the_rings_rate() {
        assert_eq!(pace_at(32 << 20, 3.5e6), WATCH_IDLE, "a decode's off-CPU stacks");
        assert_eq!(pace_at(32 << 20, 16e6), Duration::from_nanos(131_072_000), "the CPU-hog tests' rate");
        assert_eq!(pace_at(32 << 20, 64e6), WATCH_EVERY);
        assert_eq!(pace_at(32 << 20, 0.0), WATCH_IDLE);
    }

    /// Five turns that keep up and a second of calm, then idle; a fall soon after doubles the
    /// calm each time (up to 32 s); a long idle stretch before a fall starts it over.
    #[test]
    fn a_thread_that_keeps_falling_behind_stays_raised_longer() {
        let mut p = Policy::new(true, 0);
        assert_eq!(p.turn(S / 10, true, true), Change::Raise);
        assert_eq!(p.calm_ns, 2 * S, "a fall 100 ms after starting idle doubles the calm");
        // Kept up, but not yet calm for 2 s.
        for i in 1..=10 {
            assert_eq!(p.turn(S / 10 + i * S / 10, false, true), Change::Stay);
        }
        assert_eq!(p.turn(S / 10 + 2 * S, false, true), Change::Lower);
        // Starved again at once: 4 s now, then 8, 16, 32, 32.
        let mut t = 3 * S;
        for want in [4, 8, 16, 32, 32] {
            assert_eq!(p.turn(t, true, true), Change::Raise);
            assert_eq!(p.calm_ns, want * S);
            for k in 0..KEEP_UP as u64 {
                assert_eq!(p.turn(t + k * 1000, false, true), Change::Stay, "yielded {k} turns after a fall");
            }
            t += want * S;
            assert_eq!(p.turn(t, false, true), Change::Lower);
            t += S / 2;
        }
        // A fall after a long idle stretch starts over at 1 s.
        t += 1000 * S;
        assert_eq!(p.turn(t, true, true), Change::Raise);
        assert_eq!(p.calm_ns, S);
        // A fall while already raised changes nothing but the clock; without the right to leave
        // idle priority again it never yields.
        assert_eq!(p.turn(t + 1, true, true), Change::Stay);
        let mut q = Policy::new(false, 0);
        for k in 0..100 {
            assert_eq!(q.turn(k * S, false, false), Change::Stay);
        }
    }

    #[test]
    fn idle_time_is_idle_and_iowait() {
        assert_eq!(parse_idle_ms("cpu  100 0 50 9000 10 0 5 250 0 0", 100), Some(90_100));
        assert_eq!(parse_idle_ms("cpu0 100 0 50 9000 10", 100), None, "one CPU's line");
        assert_eq!(parse_idle_ms("cpu  1 2", 100), None);
        let mut c = CpuIdle::new();
        assert!(!c.saturated(crate::monotonic_ns()), "no window yet");
    }

    /// Saturated over a window with less than a twentieth of a CPU idle, not before the window.
    #[test]
    fn the_cpus_are_saturated_without_idle_time() {
        let mut c = CpuIdle { file: None, seen: Default::default(), last: false, busy: false };
        let ms = 1_000_000u64;
        assert!(!c.observe(0, 1000));
        assert!(!c.observe(30 * ms, 1000), "a window not yet long enough");
        assert!(c.observe(60 * ms, 1001), "1 ms idle in 60 ms: busy");
        assert!(c.busy, "and less than half a CPU idle");
        assert!(!c.observe(120 * ms, 1031), "30 ms idle in the last 60: a CPU to spare");
        assert!(!c.busy, "half a CPU idle");
        assert!(c.seen.len() <= 3, "only the window is kept: {:?}", c.seen);
        let mut d = CpuIdle { file: None, seen: Default::default(), last: false, busy: false };
        d.observe(0, 1000);
        assert!(!d.observe(60 * ms, 1010), "10 ms idle in 60: a CPU to spare");
        assert!(d.busy, "but less than half of one");
    }

    /// Half full, or filling fast enough to pass three quarters within two more looks.
    #[test]
    fn a_ring_filling_fast_is_raised_before_half_full() {
        assert!(filling(0.51, 0.51));
        assert!(!filling(0.3, 0.3), "a steady backlog under half is left to the drain");
        assert!(filling(0.4, 0.2), "0.2 a look: 0.6 at the next, past three quarters after that");
        assert!(!filling(0.1, 0.05));
        assert!(!filling(0.0, 0.4), "an emptied ring is not filling");
    }
}
