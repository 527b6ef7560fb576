//! One trace session in named stages: [`arm`](arm::arm) (the maps, the recording, its first
//! records), [`follow`] (drain the ring and keep up with the target until a stop),
//! [`stop`](stop::stop) (drain what was captured up to the stop, stop the samplers, close the
//! recording), then either hand the last segment to `probe watch` or
//! [`write_outputs`](stop::write_outputs) (one analysis, every output from it).
use std::{
    collections::{BTreeMap, HashSet},
    time::{Duration, Instant},
};

use aya::maps::{MapData, PerCpuArray, RingBuf};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

mod arm;
mod stop;

use super::{BUSY_EVENTS, DRAIN_RECORDS, DRAIN_TICK, IDLE_DRAIN, IDLE_STATS, State, TraceOptions, TraceOutcome, drain_turn, stats, sum};
use crate::{
    analysis::report::Report,
    collector::segments,
    kernel::probes,
    monotonic_ns,
    os::procfs,
    record::{
        self,
        records::{self, UserRecord},
    },
    sampler::Sampler,
};
use arm::arm;
use stop::{stop, write_outputs};

/// What the session holds besides the collector's state: the kernel side and the segment open.
struct Session {
    kernel: Source,
    /// Why the programs' run time is not counted, when it is not.
    bpf_unmeasured: Option<String>,
    start_ns: u64,
    /// The open segment (`probe watch`): its number, when it began, and since when it is open.
    segment: (u64, u64, Instant),
    /// A probe did not attach: the trace is partial.
    partial: bool,
    /// The engine probe was asked for: executable files mapped later are searched for llama.cpp.
    follow_engine: bool,
}

/// The session after [`stop`]: the counters read at the stop, and what is still under way.
struct Stopped {
    lost: Vec<u64>,
    skipped: BTreeMap<String, u64>,
    /// The disk filled while tracing (then the recording ends where it filled).
    full: Option<record::DiskFull>,
    /// The end record did not fit either.
    full_again: bool,
    /// The programs, switched off: detached on their own thread (`probe watch`, which goes on) or
    /// handed off at exit (`probe trace`).
    programs: Programs,
}

enum Programs {
    Detaching(Option<std::thread::JoinHandle<()>>),
    Attached(Box<probes::Attached>),
    /// A member of the node's hub left it; the programs go on for the others.
    Shared,
}

/// The kernel side of a session: its own programs and counters, or its membership of the hub.
/// One per session, never moved about: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Source {
    Own {
        ring: AsyncFd<RingBuf<MapData>>,
        lost_map: PerCpuArray<MapData, u64>,
        counter_map: PerCpuArray<MapData, u64>,
        attached: Box<probes::Attached>,
    },
    Member(Box<super::hub::Member>),
}

impl Source {
    fn lost(&self) -> Vec<u64> {
        match self {
            Source::Own { lost_map, .. } => sum(lost_map),
            Source::Member(m) => m.lost(),
        }
    }

    fn counters(&self) -> Vec<u64> {
        match self {
            Source::Own { counter_map, .. } => sum(counter_map),
            Source::Member(m) => m.counters(),
        }
    }

    fn runs(&self) -> BTreeMap<String, probes::ProgRuns> {
        match self {
            Source::Own { attached, .. } => probes::prog_runs(&attached.ebpf),
            Source::Member(m) => m.runs(),
        }
    }
}

impl Session {
    /// Where the next records come from: the ring, or the hub's queue for this member.
    fn records(&mut self) -> &mut dyn super::Records {
        match &mut self.kernel {
            Source::Own { ring, .. } => ring.get_mut(),
            Source::Member(m) => m.as_mut(),
        }
    }
}

/// The signals that stop or steer a trace, registered before probe says it is armed: a Ctrl-C
/// the moment after that line still ends the trace with its report.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

pub(super) async fn run(opts: TraceOptions, kernel: super::Kernel, out_dir: &crate::util::output::OutDir) -> anyhow::Result<TraceOutcome> {
    let mut signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
        hup: signal(SignalKind::hangup())?,
        usr1: signal(SignalKind::user_defined1())?,
    };
    let (mut st, mut se) = arm(&opts, kernel, out_dir)?;
    let sampler = Sampler::start(crate::sampler::Options {
        pid: opts.pid,
        targets: st.targets.clone(),
        hz: opts.host_hz,
        poll: opts.poll,
        headers: opts.headers.clone(),
    });
    if opts.watch.is_some() {
        // A service: it stops with the watch (SIGTERM from systemd, or Ctrl-C in a terminal).
        say!("probe: recording the window to {} (SIGUSR1 measures the model files' page-cache residency)", opts.out.display());
    } else {
        say!("probe: recording to {} (Ctrl-C to stop; SIGUSR1 measures the model files' page-cache residency)", opts.out.display());
    }
    // A daemon's log (journald) gets lines, never the live view.
    let mut screen = st.live.is_some().then(crate::collector::live::Screen::default);
    let (reason, hung_up) = follow(&opts, &mut st, &mut se, &sampler, out_dir, &mut screen, &mut signals).await?;
    if let Some(s) = &mut screen
        && !hung_up
    {
        s.clear();
    }
    let stopping = Instant::now();
    let (partial, start_ns, segment) = (se.partial, se.start_ns, se.segment);
    let stopped = stop(&mut st, se, sampler, &reason, out_dir, stopping)?;
    let target_exited = st.root_exited;
    if let Some(w) = st.watch.take() {
        // The last segment goes to the watcher; the window is its to analyse, not a report's.
        let bytes = st.writer.bytes;
        drop(st);
        out_dir.release_reserve();
        let now = monotonic_ns();
        w.send(segments::Msg::Segment(segments::Segment {
            path: opts.out.join(segments::segment_name(segment.0)),
            from_ms: (segment.1 - start_ns) as f64 / 1e6,
            to_ms: (now - start_ns) as f64 / 1e6,
            bytes,
        }));
        w.send(segments::Msg::Ended { reason: reason.clone(), target_exited, lost: stopped.lost.iter().sum() });
        if let Programs::Detaching(Some(d)) = stopped.programs {
            let _ = d.join();
        }
        return Ok(TraceOutcome { report: Report::default(), partial: false, reason, target_exited });
    }
    let report = write_outputs(&opts, st, &stopped, &reason, out_dir, stopping)?;
    match stopped.programs {
        Programs::Detaching(Some(d)) => {
            let _ = d.join();
        }
        Programs::Detaching(None) => {}
        Programs::Attached(a) => probes::hand_off(*a),
        Programs::Shared => {}
    }
    log::info!("stop: programs let go at {:?}", stopping.elapsed());
    let partial = partial || stopped.full.is_some() || report.lost_events.values().any(|&n| n > 0) || !report.skipped_runs.is_empty();
    Ok(TraceOutcome { report, partial, reason, target_exited })
}

/// Drain the ring as records arrive and keep up with the target, until a signal, the duration,
/// the target's exit, a full disk or the size limit. Returns why it stopped, and whether by SIGHUP.
async fn follow(
    opts: &TraceOptions,
    st: &mut State,
    se: &mut Session,
    sampler: &Sampler,
    out_dir: &crate::util::output::OutDir,
    screen: &mut Option<crate::collector::live::Screen>,
    signals: &mut Signals,
) -> anyhow::Result<(String, bool)> {
    let Signals { int: sigint, term: sigterm, hup: sighup, usr1: sigusr1 } = signals;
    // The first at once, then every second; a drain held back for seconds takes one turn when let
    // go, not one per second missed. One wake-up per turn (`os::timer`).
    let mut sec_tick = crate::os::timer::Timer::new();
    sec_tick.set(Duration::ZERO, Duration::from_secs(1));
    let mut drain_timer = crate::os::timer::Timer::new();
    // Small records wait in the ring for this timer (the kernel wakes probe only for a backlog):
    // every DRAIN_TICK (100 ms) while records flow, every IDLE_DRAIN after a quiet turn (an idle server then
    // costs probe a few wake-ups a second, not fifty).
    let mut tick = DRAIN_TICK;
    let mut second = Second { started: Some(Instant::now()), ..Default::default() };
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut hung_up = false;
    let (mut peers_at, mut remote_peers) = (Instant::now(), std::collections::HashMap::new());
    let (mut yielding, busy_due, quiet_due) = drain_yielding(opts, st, se);
    let reason: String = loop {
        let mut more = false;
        let events_before = st.events;
        // Held by the watchdog (every CPU busy, the ring with room): no turn, not even a timer's
        // wake-up, until it lets go; signals are still heard.
        let held = yielding.held();
        // Quiet, a drain of its own ring has no timer of its own: the once-a-second turn drains,
        // and the kernel wakes it for a backlog or a request's first bytes. A hub member has no
        // ring to be woken by: its tick (once a second while quiet) is what finds records again.
        let own_ring = matches!(se.kernel, Source::Own { .. });
        let drain_timed = !held && (tick == DRAIN_TICK || !own_ring);
        if drain_timed {
            drain_timer.set(tick, Duration::ZERO);
        }
        tokio::select! {
            _ = yielding.released(), if held => continue,
            guard = async { match &mut se.kernel { Source::Own { ring, .. } => ring.readable_mut().await, Source::Member(_) => std::future::pending().await } }, if !held => {
                let mut guard = guard?;
                // The kernel woke the drain (a backlog, or a request's first bytes): records flow.
                tick = DRAIN_TICK;
                more = drain_turn(guard.get_inner_mut(), st, sampler, turn_mode(&yielding))?;
                if !more {
                    guard.clear_ready();
                }
            }
            _ = drain_timer.wait(), if drain_timed => {
                let before = st.events;
                more = drain_turn(se.records(), st, sampler, turn_mode(&yielding))?;
                tick = if st.events > before { DRAIN_TICK } else { IDLE_DRAIN };
            }
            _ = sec_tick.wait() => {
                if held {
                    // The target's state for the samplers and the endpoint poller, which go by
                    // it (a reading at a request's arrival, vLLM's counters every 2 s while
                    // busy): from what the kernel wrote to the ring, its records waiting unread.
                    second.held_turn(opts, st, se, sampler, yielding.produced());
                    if st.root_exited {
                        break "target exited".to_string();
                    }
                    continue;
                }
                more = drain_turn(se.records(), st, sampler, turn_mode(&yielding))?;
                second.turn(opts, st, se, sampler, out_dir, screen.as_mut().filter(|_| !hung_up))?;
            }
            _ = sigusr1.recv() => sampler.snapshot_now(),
            _ = sigint.recv() => break "interrupted (Ctrl-C)".to_string(),
            _ = sigterm.recv() => break "terminated (SIGTERM)".to_string(),
            _ = sighup.recv() => {
                hung_up = true;
                break "hangup (SIGHUP)".to_string();
            }
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await }, if deadline.is_some() => break "duration reached".to_string(),
        }
        // A request's arrival (the kernel woke the drain for its first bytes): the samplers take
        // their reading at the arrival (the GPU's power state then), not at the next second.
        if st.streams.others_in_flight() > 0 {
            sampler.set_busy(true);
        }
        if st.python.due() {
            follow_python(st);
        }
        if peers_at.elapsed() >= PEER_LOOKUP {
            peers_at = Instant::now();
            name_peers(st, &mut remote_peers);
        }
        if let Some(reason) = stop_reason(opts, st) {
            break reason;
        }
        // Records flowing, the next turn is due within the drain tick; else within the
        // once-a-second turn (overdue: `busy_due`, `quiet_due`).
        let flowing = st.events > events_before || tick == DRAIN_TICK;
        let next = if flowing { busy_due } else { quiet_due };
        // A turn that stopped before the ring was empty (its record or time budget spent) was
        // behind: normal priority until turns empty it again.
        // Busy for the watchdog (a closer watch): more than an idle server's trickle this turn.
        let taken = st.events.saturating_sub(events_before);
        yielding.turn(more || taken >= DRAIN_RECORDS as u64, flowing && (more || taken >= QUIET_TURN), Some(next));
        if more {
            // Let the runtime look at signals and timers before the next turn.
            tokio::task::yield_now().await;
        }
    };
    // The last drain and the report do not wait for a free CPU.
    yielding.stop();
    if st.yielded_turns > 0 {
        log::info!("drain: {} turns stopped early to leave a CPU to the server (records left in the ring)", st.yielded_turns);
    }
    Ok((reason, hung_up))
}

/// How the drain's next turn takes its records: copied out unread while every CPU is busy and the
/// ring fills, stopped when preempted while it yields ([`crate::collector::drain::TurnMode`]).
fn turn_mode(y: &crate::os::yielding::Yielding) -> super::drain::TurnMode {
    super::drain::TurnMode { spill: y.spill(), polite: y.polite() }
}

/// Records a turn may take and still leave the watchdog at its quiet pace (an idle llama-server's
/// threads make about ten a second).
const QUIET_TURN: u64 = 64;

/// The drain's watchdog for [`follow`] (`yielding::Yielding`), and how long a turn may be overdue
/// while records flow and while they do not.
fn drain_yielding(opts: &TraceOptions, st: &State, se: &Session) -> (crate::os::yielding::Yielding, Duration, Duration) {
    // The drain yields the CPUs to the server while it keeps up (`yielding::Yielding`): a turn that
    // took a ring's worth of records at once was behind, and runs at normal priority until caught up.
    // With the ring's fill in sight the drain may wait as long as the ring holds (raised at half
    // full): a request's records wait in the ring while the server keeps every CPU busy, and are
    // read when it pauses. A hub member's queue is watched by the time since its last turn only.
    let gauge = match &se.kernel {
        Source::Own { ring, .. } => crate::os::yielding::RingFill::new(ring.get_ref(), opts.ring_bytes as u64),
        Source::Member(_) => None,
    };
    let (busy_due, quiet_due) = match gauge {
        // Overdue once the once-a-second turn is a second late: a drain asleep until that turn
        // (no records flowing) wakes at idle priority on CPUs the server keeps busy, and was
        // raised to normal priority for seconds, due at exactly its tick, by any delay of its
        // wake-up. Not longer: that turn follows what the targets start (a library mapped after
        // attach gets its engine probe there; 5 s missed a binding's first decode steps).
        Some(_) => (Duration::from_secs(2), Duration::from_secs(2)),
        None => (Duration::from_millis(100), Duration::from_millis(1500)),
    };
    // A library mapped while the drain is held lets it go: its engine probe attaches there.
    let exec_maps: Option<crate::os::yielding::Urgent> = match &se.kernel {
        Source::Own { counter_map, .. } => aya::maps::IterableMap::map(counter_map)
            .info()
            .ok()
            .and_then(|i| MapData::from_id(i.id()).ok())
            .and_then(|d| PerCpuArray::<MapData, u64>::try_from(aya::maps::Map::PerCpuArray(d)).ok())
            .map(|m| {
                Box::new(move || m.get(&(probe_common::Counter::ExecMaps as u32), 0).map_or(0, |v| v.iter().sum()))
                    as crate::os::yielding::Urgent
            }),
        Source::Member(_) => None,
    };
    // The kernel's count of the targets' runnable threads (not with OFFCPU_D_ONLY: the sleeps
    // the kernel does not follow leave their threads counted).
    let server_runs: Option<crate::os::yielding::ServerRuns> = match &se.kernel {
        Source::Own { attached, .. } if !opts.offcpu_d_only => match attached.ebpf.map(probe_common::maps::RUNNABLE) {
            Some(aya::maps::Map::PerCpuArray(m)) => std::os::fd::AsFd::as_fd(m.fd()).try_clone_to_owned().ok().map(|fd| {
                let count = crate::kernel::percpu::PerCpuSum::new(fd);
                Box::new(move || count.sum().is_some_and(|n| n > 0)) as crate::os::yielding::ServerRuns
            }),
            _ => None,
        },
        _ => None,
    };
    let mut yielding = crate::os::yielding::Yielding::start("probe: the ring's drain", busy_due, gauge, exec_maps, server_runs);
    if st.live.is_some() {
        // A live view is made from the records as they come: not held while it shows.
        yielding = yielding.never_held();
    }
    (yielding, busy_due, quiet_due)
}

/// Why [`follow`] stops after a turn, if it does: the target exited, the node agent stopped the
/// trace, the disk filled or the recording reached its size limit (looked at in that order).
fn stop_reason(opts: &TraceOptions, st: &State) -> Option<String> {
    if st.root_exited {
        return Some("target exited".to_string());
    }
    if opts.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
        return Some("stopped by the node agent".to_string());
    }
    if st.writer.disk_full().is_some() {
        return Some("disk full".to_string());
    }
    if let Some((max, text)) = &opts.max_size
        && st.writer.bytes >= *max
    {
        return Some(format!("size limit reached (--max-size {text})"));
    }
    None
}

/// Python frames past their budget are turned off (said now, and in the recording's stats): the
/// kernel's walks (its counter) and this process's work for them, over the budget's window.
fn python_budget(st: &mut State, counters: impl FnOnce() -> Vec<u64>) {
    let Some(b) = st.py_budget.as_mut() else { return };
    if st.py_threads.is_none() || st.python.off.is_some() || !st.python.any() {
        return;
    }
    let kernel = counters().get(probe_common::Counter::PyWalkNs as usize).copied().unwrap_or(0);
    let Some(share) = b.over(monotonic_ns(), kernel.saturating_add(st.python.work_ns)) else { return };
    let why = format!(
        "Python frames turned off: their own work (the kernel's walks and naming the code) took {:.2}% of a core over {} s, over the budget of {}% (--python-budget)",
        share * 100.0,
        crate::kernel::python::Budget::WINDOW_NS / 1_000_000_000,
        (b.share * 1e5).round() / 1e3
    );
    eprintln!("probe: {why}");
    st.python.turn_off(why, &mut st.py_threads);
}

/// Search executable files the targets mapped since the last turn for llama.cpp's entry points
/// and attach the engine probe to them: a model runner started after attach (Ollama), a
/// libllama loaded later (a Python server importing its binding).
/// CPython targets: new processes checked for an interpreter, every interpreter's threads put in
/// the kernel's map (a thread started since the last turn gets its Python frames from now on).
/// A target whose Python cannot be read is said once.
pub(super) fn follow_python(st: &mut State) {
    if st.py_threads.is_none() {
        return;
    }
    let targets = st.targets.lock().map(|t| t.clone()).unwrap_or_default();
    st.python.refresh(&targets, &mut st.py_threads);
    for note in std::mem::take(&mut st.python.notes) {
        eprintln!("probe: {note}");
    }
    // Threads as Python names them, after the kernel's name: "python3 · Thread-2 (worker)".
    let named: Vec<(u32, u32, String)> = std::mem::take(&mut st.python.new_thread_names)
        .into_iter()
        .map(|(pid, tid, py)| {
            let name = match crate::os::procfs::thread_comm(pid, tid) {
                Some(comm) if comm != py => format!("{comm} · {py}"),
                _ => py,
            };
            (pid, tid, name)
        })
        .collect();
    if !named.is_empty() {
        let rec = UserRecord::Threads(records::Threads { ts_ns: monotonic_ns(), threads: named });
        if let Err(e) = st.writer.record(&rec) {
            log::warn!("thread names not written: {e}");
        }
    }
}

fn follow_engine(st: &mut State, se: &mut Session) {
    let new = std::mem::take(&mut st.engine_new);
    if new.is_empty() || !se.follow_engine {
        return;
    }
    let attached = match &mut se.kernel {
        Source::Member(m) => m.engine_mapped(&new),
        Source::Own { attached, .. } => {
            let found = crate::kernel::engine::search_mappings(&new);
            if found.found.is_empty() {
                return;
            }
            let a = crate::kernel::engine::attach(&mut attached.ebpf, &found);
            for x in &a.skipped {
                log::info!("{x}");
            }
            a.attached
        }
    };
    for x in &attached {
        say!("probe: engine probes: attached {x} (mapped after attach)");
    }
}

/// What the once-a-second turn keeps between turns.
#[derive(Default)]
struct Second {
    started: Option<Instant>,
    events_at_sec: u64,
    /// The ring's producer position at the last held look ([`Second::held_turn`]).
    produced_at: Option<u64>,
    last_events: u64,
    last_stats: Option<Instant>,
    lost_at_stats: u64,
}

/// How often new connections' peers are looked up (all of them at once: a lookup reads the
/// descriptors of the processes that may own the other end), and how long a request must have
/// been in flight first.
const PEER_LOOKUP: Duration = Duration::from_millis(500);
const PEER_AGE_NS: u64 = 800_000_000;

/// The processes at the other end of new connections with a request in flight, looked up once
/// each while they are open (a gateway that hangs up later is named by it). `remote`: peer
/// addresses found on no network namespace of this machine, and when (let be for a minute).
fn name_peers(st: &mut State, remote: &mut std::collections::HashMap<std::net::IpAddr, Instant>) {
    let mut by_pid: BTreeMap<u32, Vec<(String, String)>> = BTreeMap::new();
    for (pid, local, peer) in st.streams.peers_to_name(crate::monotonic_ns(), PEER_AGE_NS) {
        by_pid.entry(pid).or_default().push((local, peer));
    }
    for (pid, conns) in by_pid {
        let found = crate::collector::peer::resolve(pid, &conns, remote);
        st.streams.name_peers(&found);
    }
}

/// Ring bytes a second that make a held target busy: about `BUSY_EVENTS` small records.
const BUSY_BYTES: u64 = BUSY_EVENTS * 64;

impl Second {
    /// The once-a-second look while the drain is held (every CPU busy, the records wait in the
    /// ring): the target is busy when a request was in flight at the last read, or when the
    /// kernel wrote at least `BUSY_BYTES` to the ring since the last held look (the first
    /// leaves the state the last read turn found); and the targets are followed (a process
    /// joining the cgroup, the root's exit) and so are their Python threads (the kernel walks
    /// the frames of the threads in its map only: a thread that started, or an interpreter
    /// found, while every CPU was busy would have none until the drain was let go; a Python
    /// server spinning on every CPU had none at all).
    fn held_turn(&mut self, opts: &TraceOptions, st: &mut State, se: &mut Session, sampler: &Sampler, produced: Option<u64>) {
        if let (Some(now), Some(then)) = (produced, self.produced_at) {
            sampler.set_busy(st.streams.others_in_flight() > 0 || now.saturating_sub(then) >= BUSY_BYTES);
        }
        self.produced_at = produced;
        python_budget(st, || se.kernel.counters());
        follow_python(st);
        follow_targets(opts, st, se);
    }

    /// Once a second: counters into the recording, the samplers' pace, the next segment, the
    /// status line, and processes joining the cgroup or the target's exit.
    fn turn(
        &mut self,
        opts: &TraceOptions,
        st: &mut State,
        se: &mut Session,
        sampler: &Sampler,
        out_dir: &crate::util::output::OutDir,
        screen: Option<&mut crate::collector::live::Screen>,
    ) -> anyhow::Result<()> {
        self.produced_at = None;
        // Busy: a request in flight, or the target keeps the probes going.
        let busy = st.streams.others_in_flight() > 0 || st.events.saturating_sub(self.events_at_sec) >= BUSY_EVENTS;
        sampler.set_busy(busy);
        // The kernel's losses are read when more than an idle server's trickle of records came
        // this second (a record is lost only to a full ring, which holds hundreds of thousands),
        // when the stats are due, or when they are shown: an idle second costs no look at the
        // maps (a syscall for each of their slots).
        let stats_due = self.last_stats.is_none_or(|t| t.elapsed() >= IDLE_STATS);
        let flowed = st.events.saturating_sub(self.events_at_sec) >= QUIET_TURN;
        let lost = (busy || stats_due || flowed || screen.is_some()).then(|| se.kernel.lost());
        let lost_now: u64 = lost.iter().flatten().sum();
        // Every second while busy or losing events; every IDLE_STATS otherwise.
        if let Some(lost) = lost.as_deref()
            && (busy || lost_now != self.lost_at_stats || stats_due)
        {
            self.lost_at_stats = lost_now;
            let runs = se.kernel.runs();
            st.writer.record(&stats(lost, &se.kernel.counters(), st, &runs, se.bpf_unmeasured.as_deref()))?;
            self.last_stats = Some(Instant::now());
            if let Some(w) = &st.watch {
                // A member's programs are the node's: the agent counts their cost once.
                let none = BTreeMap::new();
                w.set_cost(lost_now, if matches!(se.kernel, Source::Own { .. }) { &runs } else { &none });
            }
        }
        st.writer.flush()?;
        follow_engine(st, se);
        python_budget(st, || se.kernel.counters());
        follow_python(st);
        rotate(opts, st, se, out_dir)?;
        if let (Some(screen), Some(live)) = (screen, &mut st.live) {
            let rate = st.events - self.last_events;
            let serving = st.streams.serving();
            let header = format!(
                "  {:>6.1} s | {} events ({rate}/s) | {} in flight | lost {}",
                self.started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
                st.events,
                crate::util::text::count(
                    serving.iter().filter(|q| q.role == crate::stream::Role::Server && !q.probe_poll).count() as u64,
                    "request"
                ),
                lost_now
            );
            let targets: Vec<u32> = st.targets.lock().map(|t| t.clone()).unwrap_or_default();
            let frame = live.frame(header, &serving, monotonic_ns(), se.start_ns, &|| crate::kernel::attach::threads_of(&targets));
            screen.draw(&frame);
        }
        self.last_events = st.events;
        self.events_at_sec = st.events;
        follow_targets(opts, st, se);
        Ok(())
    }
}

/// Processes that joined the traced cgroup (traced from now on), and the end of the targets: a
/// cgroup left empty, or the root process gone. Once a second, held or not: a process that
/// joined while every CPU was busy is traced before its records would be lost.
fn follow_targets(opts: &TraceOptions, st: &mut State, se: &mut Session) {
    match &opts.cgroup {
        Some(cg) => {
            let now = crate::os::cgroup::procs(cg);
            let known: HashSet<u32> = st.targets.lock().map(|t| t.iter().copied().collect()).unwrap_or_default();
            for pid in now.iter().copied().filter(|p| !known.contains(p)) {
                // A process that joined the cgroup without a target forking it (a target's
                // new child is already followed; its fork event is on its way).
                let added = match &mut se.kernel {
                    Source::Own { attached, .. } => probes::add_target(&mut attached.ebpf, pid, opts.sample_hz),
                    Source::Member(m) => m.add_target(pid),
                };
                match added {
                    Ok(true) => st.add_target(pid),
                    Ok(false) => {}
                    Err(e) => log::warn!("pid {pid} joined {} but cannot be traced: {e:#}", cg.display()),
                }
            }
            st.root_exited = now.is_empty();
        }
        None if !procfs::exists(opts.pid) => st.root_exited = true,
        None => {}
    }
}

/// `probe watch`: close the segment when it is due and hand it over; the next one goes on.
fn rotate(opts: &TraceOptions, st: &mut State, se: &mut Session, out_dir: &crate::util::output::OutDir) -> anyhow::Result<()> {
    let Some(w) = st.watch.clone() else { return Ok(()) };
    if !w.rotate_due(se.segment.2.elapsed(), st.writer.bytes) {
        return Ok(());
    }
    let next = out_dir.create(&segments::segment_name(se.segment.0 + 1))?;
    let now = monotonic_ns();
    let bytes = st.writer.rotate(next)?;
    w.send(segments::Msg::Segment(segments::Segment {
        path: opts.out.join(segments::segment_name(se.segment.0)),
        from_ms: (se.segment.1 - se.start_ns) as f64 / 1e6,
        to_ms: (now - se.start_ns) as f64 / 1e6,
        bytes,
    }));
    se.segment = (se.segment.0 + 1, now, Instant::now());
    Ok(())
}
