//! One trace session in named stages: [`arm`] (the maps, the recording, its first records),
//! [`follow`] (drain the ring and keep up with the target until a stop), [`stop`] (drain what was
//! captured up to the stop, stop the samplers, close the recording), then either hand the last
//! segment to `probe watch` or [`write_outputs`] (one analysis, every output from it).
use std::{
    collections::{BTreeMap, HashSet},
    io::IsTerminal as _,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{MapData, PerCpuArray, RingBuf};
use probe_common::{EventKind, maps};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use super::{
    BUSY_EVENTS, DRAIN_RECORDS, DRAIN_TICK, IDLE_DRAIN, IDLE_STATS, SAMPLER_STOP, State, TraceOptions, TraceOutcome, drain_turn,
    reserve_error, stats, sum,
};
use crate::{
    analysis::report::Report,
    collector::segments,
    kernel::probes,
    monotonic_ns,
    os::procfs,
    record::{
        self, Writer,
        records::{self, UserRecord},
    },
    sampler::Sampler,
};

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

/// Take the maps, open the recording, write its meta and first counters, and say what is live.
fn arm(opts: &TraceOptions, kernel: super::Kernel, out_dir: &crate::util::output::OutDir) -> anyhow::Result<(State, Session)> {
    let mut kernel = match kernel {
        super::Kernel::Own(mut attached) => {
            let ring = RingBuf::try_from(attached.ebpf.take_map(maps::EVENTS).context("EVENTS map missing")?)?;
            let lost_map: PerCpuArray<MapData, u64> =
                PerCpuArray::try_from(attached.ebpf.take_map(maps::LOST).context("LOST map missing")?)?;
            let counter_map: PerCpuArray<MapData, u64> =
                PerCpuArray::try_from(attached.ebpf.take_map(maps::COUNTERS).context("COUNTERS map missing")?)?;
            // SAFETY: the RingBuf owns its map fd and keeps it open, unchanged, for as long as the AsyncFd lives.
            let ring = unsafe { AsyncFd::register(ring) }.context("cannot poll the ring buffer")?;
            Source::Own { ring, lost_map, counter_map, attached: Box::new(attached) }
        }
        super::Kernel::Member(m) => Source::Member(Box::new(m)),
    };
    let mut attached = Armed::of(&mut kernel);

    let armed_ms = opts.started.elapsed().as_secs_f64() * 1e3;
    let mut arm_stages = std::mem::take(&mut attached.stages);
    let counted: f64 = arm_stages.iter().filter(|(n, _)| !n.starts_with("program ")).map(|(_, ms)| ms).sum();
    arm_stages.insert(
        arm_stages.iter().position(|(n, _)| n.starts_with("program ")).unwrap_or(arm_stages.len()),
        ("ring".into(), armed_ms - counted),
    );
    let bpf_unmeasured = attached.bpf_unmeasured.clone();
    let writer = match &opts.watch {
        Some(_) => out_dir.create(&segments::segment_name(0)).and_then(Writer::create_file),
        None => Writer::create_in(out_dir),
    }
    .map_err(|e| match record::is_disk_full(&e) {
        true => reserve_error(&opts.out, e),
        false => anyhow::Error::new(e).context(format!("cannot create the recording in {}", opts.out.display())),
    })?;
    let start_ns = monotonic_ns();
    let mut st = State::new(writer, start_ns, opts.pid, &attached.targets, opts.capture_text);
    // The engine probe follows executable files mapped after attach (when it was asked for):
    // those it searched already are not searched again.
    let follow_engine = attached.status.iter().any(|s| s.name == records::Subsystem::Engine);
    st.engine_seen = attached.engine_seen.iter().copied().collect();
    st.follow_cgroup = opts.cgroup.is_some();
    st.ustack_need = attached.ustack_need.take();
    st.other_comms = attached.other_comms.take();
    st.py_threads = if opts.python_frames { attached.py_threads.take() } else { None };
    st.py_budget = (opts.python_budget > 0.0).then(|| crate::kernel::python::Budget::new(opts.python_budget / 100.0));
    st.max_bytes = opts.max_size.as_ref().map(|m| m.0);
    if opts.watch.is_some() {
        st.writer.keep_context();
        st.watch = opts.watch.clone();
    }
    // Every thread there at attach; later ones when they first show up in an event.
    for &pid in &attached.targets {
        for tid in procfs::tasks(pid) {
            if st.threads_seen.insert(tid, pid).is_none() {
                st.threads_new.push((pid, tid));
            }
        }
    }
    let arm_line = opts.verbose.then(|| {
        let parts: Vec<String> = arm_stages.iter().map(|(name, ms)| format!("{name} {ms:.1} ms")).collect();
        format!("probe: arming took: {}", parts.join(", "))
    });
    st.writer.record(&UserRecord::Meta(Box::new(meta(opts, &attached, start_ns, armed_ms, arm_stages))))?;
    // Block IO the kernel issues for the target from other tasks (the cgroup throttle's kworker)
    // is matched by the target's block cgroups and the files it maps (filled by `refresh`).
    if let Some(map) = attached.blkcg.as_mut() {
        own_block_cgroups(map, &attached.targets);
    }
    st.target_files = attached.target_files.take();
    // What came before attach: the requests in flight (taken up by the stream tracker) and what
    // the target was doing, read once now that the probes are armed.
    let (at_attach, seeds) = crate::kernel::attach::read(&attached.targets, opts.pid, monotonic_ns());
    log::info!("attach: {} connection(s) in the middle of a request", seeds.len());
    st.streams.seed(seeds);
    // The live view (a terminal, not `--quiet`, not a service) names the cgroup's IO limits.
    if std::io::stderr().is_terminal() && opts.watch.is_none() && !opts.quiet {
        st.live = Some(crate::collector::live::Live::new(&at_attach.io_limits, monotonic_ns()));
    }
    st.writer.sample(&crate::record::samples::Sample::Attach(at_attach))?;
    st.refresh()?;
    for &pid in &attached.targets {
        st.unwinders.prepare(pid);
    }
    // The first cumulative counters: the report's tracing cost counts from here.
    st.writer.record(&stats(&kernel.lost(), &kernel.counters(), &st, &kernel.runs(), bpf_unmeasured.as_deref()))?;
    st.writer.flush()?;

    let live: Vec<&str> = attached.status.iter().filter(|s| s.live).map(|s| s.name.name()).collect();
    say!(
        "probe: armed in {armed_ms:.0} ms: pid {} ({}), {}; probes live: {}",
        opts.pid,
        crate::util::text::terminal(&procfs::comm(opts.pid)),
        crate::util::text::count(attached.targets.len() as u64, "process"),
        live.join(", ")
    );
    if let Some(line) = arm_line {
        say!("{line}");
    }
    let mut partial = false;
    for s in &attached.status {
        if !s.live {
            // The engine probe applies to llama.cpp engines only: another server has none to find.
            partial |= s.name != records::Subsystem::Engine || opts.only.is_some();
            say!("probe: skipped {}: {}", s.name, s.skipped.join("; "));
        } else if !s.skipped.is_empty() {
            log::info!("{}: optional programs not attached: {}", s.name, s.skipped.join("; "));
        }
    }
    let segment = (0, start_ns, Instant::now());
    Ok((st, Session { kernel, bpf_unmeasured, start_ns, segment, partial, follow_engine }))
}

/// What arming takes from the kernel side, whichever it is: what attached, for which processes,
/// and handles to the maps the collector fills.
struct Armed {
    status: Vec<records::SubsystemStatus>,
    targets: Vec<u32>,
    stages: Vec<(String, f64)>,
    engine_seen: Vec<crate::os::target_file::Ident>,
    bpf_unmeasured: Option<String>,
    ustack_need: Option<aya::maps::HashMap<MapData, u32, u32>>,
    other_comms: Option<aya::maps::HashMap<MapData, u32, [u8; 16]>>,
    py_threads: Option<aya::maps::HashMap<MapData, u32, probe_common::python::PyThread>>,
    target_files: Option<aya::maps::HashMap<MapData, probe_common::blockio::FileId, u32>>,
    blkcg: Option<aya::maps::HashMap<MapData, u64, u32>>,
}

impl Armed {
    fn of(k: &mut Source) -> Armed {
        match k {
            Source::Own { attached, .. } => {
                let mut take = |name: &str| attached.ebpf.take_map(name);
                let ustack_need = take(maps::USTACK_NEED).and_then(|m| aya::maps::HashMap::try_from(m).ok());
                let other_comms = take(maps::OTHER_COMMS).and_then(|m| aya::maps::HashMap::try_from(m).ok());
                let py_threads = take(maps::PY_THREADS).and_then(|m| aya::maps::HashMap::try_from(m).ok());
                let target_files = take(maps::TARGET_FILES).and_then(|m| aya::maps::HashMap::try_from(m).ok());
                let blkcg = take(maps::TARGET_BLKCG).and_then(|m| aya::maps::HashMap::try_from(m).ok());
                Armed {
                    status: attached.status.clone(),
                    targets: attached.targets.clone(),
                    stages: std::mem::take(&mut attached.stages),
                    engine_seen: attached.engine_seen.clone(),
                    bpf_unmeasured: attached.run_time_stats.as_ref().err().cloned(),
                    ustack_need,
                    other_comms,
                    py_threads,
                    target_files,
                    blkcg,
                }
            }
            Source::Member(m) => Armed {
                status: m.status.clone(),
                targets: m.targets.clone(),
                stages: std::mem::take(&mut m.stages),
                engine_seen: m.engine_seen.clone(),
                bpf_unmeasured: m.bpf_unmeasured.clone(),
                ustack_need: m.open_hash(maps::USTACK_NEED),
                other_comms: m.open_hash(maps::OTHER_COMMS),
                py_threads: m.open_hash(maps::PY_THREADS),
                target_files: m.open_hash(maps::TARGET_FILES),
                blkcg: m.open_hash(maps::TARGET_BLKCG),
            },
        }
    }
}

/// The block cgroups of the targets (v1 blkio, or v2 below the root) by cgroup id: a bio charged
/// to one is the target's, whoever issues it.
fn own_block_cgroups(map: &mut aya::maps::HashMap<MapData, u64, u32>, targets: &[u32]) {
    for &pid in targets {
        for (dir, _) in crate::kernel::attach::block_cgroups(pid) {
            // A cgroup's id is its directory's inode number (kernfs).
            if let Ok(md) = std::fs::metadata(&dir) {
                let _ = map.insert(std::os::unix::fs::MetadataExt::ino(&md), pid, 0);
            }
        }
    }
}

/// The recording's first record: what is traced, with which probes, since when.
fn meta(opts: &TraceOptions, attached: &Armed, start_ns: u64, armed_ms: f64, arm_stages: Vec<(String, f64)>) -> records::Meta {
    let uname = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    records::Meta {
        format_version: record::VERSION,
        probe_version: env!("CARGO_PKG_VERSION").into(),
        pid: opts.pid,
        comm: procfs::comm(opts.pid),
        cmdline: crate::util::redact::command_line(&procfs::cmdline_args(opts.pid)),
        exe: std::fs::read_link(format!("/proc/{}/exe", opts.pid)).map(|p| p.display().to_string()).unwrap_or_default(),
        exe_build_id: std::fs::File::open(format!("/proc/{}/exe", opts.pid))
            .ok()
            .and_then(|f| crate::analysis::flame::symbols::build_id(&f)),
        targets: attached.targets.clone(),
        start_ns,
        window_start_ns: None,
        offcpu_waits: Some(if opts.offcpu_d_only { "uninterruptible" } else { "all" }.into()),
        start_unix_ms: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        cgroup: opts.cgroup.as_ref().map(|c| c.display().to_string()),
        cpu_hz: if attached.status.iter().any(|p| p.name == records::Subsystem::Cpu && p.live) { opts.sample_hz } else { 0 },
        kernel: uname.trim().into(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()),
        machine: Some(crate::sampler::host::machine()),
        armed_ms,
        arm_stages,
        probes: attached.status.clone(),
        // SAFETY: sysconf has no preconditions.
        page_size: unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64,
        capture_text: opts.capture_text,
        block_devices: block_devices(),
    }
}

/// "major:minor" → name of every block device (/sys/class/block/*/dev), to name devices in reports.
fn block_devices() -> BTreeMap<String, String> {
    std::fs::read_dir("/sys/class/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let dev = std::fs::read_to_string(e.path().join("dev")).ok()?;
            Some((dev.trim().to_string(), e.file_name().to_string_lossy().into_owned()))
        })
        .collect()
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
    let mut sec_tick = tokio::time::interval(Duration::from_secs(1));
    // A drain held back for seconds takes one turn when let go, not one per second missed.
    sec_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Small records wait in the ring for this timer (the kernel wakes probe only for a backlog):
    // every 20 ms while records flow, every IDLE_DRAIN after a quiet turn (an idle server then
    // costs probe a few wake-ups a second, not fifty).
    let mut tick = DRAIN_TICK;
    let mut second = Second { started: Some(Instant::now()), ..Default::default() };
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut hung_up = false;
    let (mut peers_at, mut remote_peers) = (Instant::now(), std::collections::HashMap::new());
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
        // Not longer: the once-a-second turn follows what the targets start (a library mapped
        // after attach gets its engine probe there; 5 s missed a binding's first decode steps).
        Some(_) => (Duration::from_secs(1), Duration::from_secs(1)),
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
    let mut yielding = crate::os::yielding::Yielding::start("probe: the ring's drain", busy_due, gauge, exec_maps);
    if st.live.is_some() {
        // A live view is made from the records as they come: not held while it shows.
        yielding = yielding.never_held();
    }
    let reason: String = loop {
        let mut more = false;
        let events_before = st.events;
        // Held by the watchdog (every CPU busy, the ring with room): no turn, not even a timer's
        // wake-up, until it lets go; signals are still heard.
        let held = yielding.held();
        tokio::select! {
            _ = yielding.released(), if held => continue,
            guard = async { match &mut se.kernel { Source::Own { ring, .. } => ring.readable_mut().await, Source::Member(_) => std::future::pending().await } }, if !held => {
                let mut guard = guard?;
                more = drain_turn(guard.get_inner_mut(), st, sampler, yielding.spill())?;
                if !more {
                    guard.clear_ready();
                }
            }
            _ = tokio::time::sleep(tick), if !held => {
                let before = st.events;
                more = drain_turn(se.records(), st, sampler, yielding.spill())?;
                tick = if st.events > before { DRAIN_TICK } else { IDLE_DRAIN };
            }
            _ = sec_tick.tick() => {
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
                more = drain_turn(se.records(), st, sampler, yielding.spill())?;
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
        if st.python.due() {
            follow_python(st);
        }
        if peers_at.elapsed() >= PEER_LOOKUP {
            peers_at = Instant::now();
            name_peers(st, &mut remote_peers);
        }
        if st.root_exited {
            break "target exited".to_string();
        }
        if opts.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
            break "stopped by the node agent".to_string();
        }
        if st.writer.disk_full().is_some() {
            break "disk full".to_string();
        }
        if let Some((max, text)) = &opts.max_size
            && st.writer.bytes >= *max
        {
            break format!("size limit reached (--max-size {text})");
        }
        // Records flowing, the next turn is due within the drain tick; else within the
        // once-a-second turn (overdue: `busy_due`, `quiet_due`).
        let flowing = st.events > events_before || tick == DRAIN_TICK;
        let next = if flowing { busy_due } else { quiet_due };
        // A turn that stopped before the ring was empty (its record or time budget spent) was
        // behind: normal priority until turns empty it again.
        yielding.turn(more || st.events.saturating_sub(events_before) >= DRAIN_RECORDS as u64, flowing, Some(next));
        if more {
            // Let the runtime look at signals and timers before the next turn.
            tokio::task::yield_now().await;
        }
    };
    // The last drain and the report do not wait for a free CPU.
    yielding.stop();
    Ok((reason, hung_up))
}

/// Python frames past their budget are turned off (said now, and in the recording's stats): the
/// kernel's walks (its counter) and this process's work for them, over the budget's window.
fn python_budget(st: &mut State, counters: &[u64]) {
    let Some(b) = st.py_budget.as_mut() else { return };
    if st.py_threads.is_none() || st.python.off.is_some() || !st.python.any() {
        return;
    }
    let kernel = counters.get(probe_common::Counter::PyWalkNs as usize).copied().unwrap_or(0);
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
            sampler.set_busy(st.streams.in_flight() > 0 || now.saturating_sub(then) >= BUSY_BYTES);
        }
        self.produced_at = produced;
        python_budget(st, &se.kernel.counters());
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
        let lost = se.kernel.lost();
        // Busy: a request in flight, or the target keeps the probes going.
        let busy = st.streams.in_flight() > 0 || st.events.saturating_sub(self.events_at_sec) >= BUSY_EVENTS;
        sampler.set_busy(busy);
        // Every second while busy or losing events; every IDLE_STATS otherwise.
        let lost_now: u64 = lost.iter().sum();
        if busy || lost_now != self.lost_at_stats || self.last_stats.is_none_or(|t| t.elapsed() >= IDLE_STATS) {
            self.lost_at_stats = lost_now;
            let runs = se.kernel.runs();
            st.writer.record(&stats(&lost, &se.kernel.counters(), st, &runs, se.bpf_unmeasured.as_deref()))?;
            self.last_stats = Some(Instant::now());
            if let Some(w) = &st.watch {
                // A member's programs are the node's: the agent counts their cost once.
                let none = BTreeMap::new();
                w.set_cost(lost_now, if matches!(se.kernel, Source::Own { .. }) { &runs } else { &none });
            }
        }
        st.writer.flush()?;
        follow_engine(st, se);
        python_budget(st, &se.kernel.counters());
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

/// Stop in this order. The counters are read at the stop (the programs' run counts, the losses)
/// and the programs are detached at once, on their own thread (the maps taken at arming stay):
/// closing a classic tracepoint waits for RCU grace periods, one tracepoint after another in the
/// kernel (about 2 s for 64 programs on a 2-CPU VM), so that runs while the ring is drained and
/// the report is made. Then everything captured up to the stop is drained (records made after it
/// are not part of the trace), the samplers are stopped with a deadline, and the recording ends.
fn stop(
    st: &mut State,
    se: Session,
    sampler: Sampler,
    reason: &str,
    out_dir: &crate::util::output::OutDir,
    stopping: Instant,
) -> anyhow::Result<Stopped> {
    let stop_ns = monotonic_ns();
    let Session { mut kernel, bpf_unmeasured, .. } = se;
    if let Source::Own { attached, .. } = &mut kernel {
        probes::switch_off(&mut attached.ebpf);
    }
    if let Source::Member(m) = &mut kernel {
        // The kernel stops following this server; what the hub routed before is still queued.
        let pids: Vec<u32> = st.targets.lock().map(|t| t.clone()).unwrap_or_default();
        m.leave(&pids);
    }
    let runs = kernel.runs();
    let skipped = probes::skipped_runs(&runs);
    let (lost, counters) = (kernel.lost(), kernel.counters());
    // probe watch goes on to its next session: detach meanwhile, on a thread. probe trace exits
    // once its outputs are written, and hands the programs off then (see probes::hand_off).
    let (programs, mut rest): (Programs, Box<dyn super::Records>) = match kernel {
        Source::Member(m) => (Programs::Shared, m),
        Source::Own { ring, attached, .. } if st.watch.is_some() => (
            Programs::Detaching(std::thread::Builder::new().name("probe-detach".into()).spawn(move || probes::detach(*attached)).ok()),
            Box::new(ring.into_inner()),
        ),
        Source::Own { ring, attached, .. } => (Programs::Attached(attached), Box::new(ring.into_inner())),
    };
    // What was copied out unread comes first, all of it.
    let mut spilled = std::mem::take(&mut st.spill);
    while let Some(r) = super::Records::take(&mut spilled, &mut |item| st.on_record(item)) {
        r?;
    }
    let mut after_stop = 0usize;
    let records = rest.as_mut();
    loop {
        let mut late = false;
        let took = records.take(&mut |item| {
            // The header's ts_ns (probe-common EventHeader: four u32, then the u64 timestamp).
            let ts = item.get(16..24).and_then(|b| b.try_into().ok()).map_or(0, u64::from_ne_bytes);
            if ts > stop_ns {
                late = true;
                return Ok(());
            }
            st.on_record(item)
        });
        match took {
            None => break,
            Some(r) => r?,
        }
        // The ring is in reservation order: once this many later records were seen, what came
        // before the stop has been read.
        if late {
            after_stop += 1;
            if after_stop >= DRAIN_RECORDS {
                break;
            }
        }
    }
    drop(rest);
    log::info!("stop: ring drained at {:?}", stopping.elapsed());
    let (rest, abandoned) = sampler.stop(SAMPLER_STOP);
    log::info!("stop: samplers stopped at {:?}", stopping.elapsed());
    for name in abandoned {
        say!("probe: the {name} thread did not stop within {} ms; left behind", SAMPLER_STOP.as_millis());
    }
    // After a full disk: give back the reserve and write the end of the recording into it.
    let full = st.writer.resume();
    if full.is_some() {
        out_dir.release_reserve();
    }
    for v in rest {
        st.writer.sample(&v)?;
    }
    st.refresh()?;
    st.streams.finish();
    st.write_requests()?;
    // Threads still blocked when the trace ended: blocked until now.
    let now = monotonic_ns();
    for (_, mut v) in std::mem::take(&mut st.offcpu) {
        v.blocked_ns = Some(now.saturating_sub(v.ts_ns));
        v.still_blocked = true;
        st.writer.stack(&v)?;
    }
    if let Some(cut) = st.cut_frames() {
        st.writer.record(&cut)?;
    }
    st.writer.record(&stats(&lost, &counters, st, &runs, bpf_unmeasured.as_deref()))?;
    st.writer.record(&UserRecord::End(records::End { ts_ns: monotonic_ns(), reason: reason.to_string() }))?;
    st.writer.flush()?;
    let full_again = st.writer.disk_full().is_some();
    Ok(Stopped { lost, skipped, full, full_again, programs })
}

/// One analysis (streamed from the file: memory does not grow with the trace's length) and one
/// symbolization for every output. report.json first: on a full disk it is what matters.
fn write_outputs(
    opts: &TraceOptions,
    st: State,
    stopped: &Stopped,
    reason: &str,
    out_dir: &crate::util::output::OutDir,
    stopping: Instant,
) -> anyhow::Result<Report> {
    let parsed = st.per_kind[EventKind::Data as usize];
    let kept = if st.capture_text { "kept with --capture-text" } else { "parsed in memory, not stored" };
    let skipped_total: u64 = stopped.skipped.values().sum();
    let skipped_note = if skipped_total > 0 {
        format!(", {skipped_total} program runs skipped by the kernel (another BPF program was running on that CPU)")
    } else {
        String::new()
    };
    // Room for the outputs: the reserve is not needed any more.
    out_dir.release_reserve();
    if stopped.full.is_none() {
        say!(
            "probe: stopped: {reason}; {} events received ({parsed} stream records {kept}), {} lost{skipped_note}",
            // What the last stats record counts, and so report.json's `events_received`.
            st.per_kind.iter().sum::<u64>(),
            stopped.lost.iter().sum::<u64>()
        );
    }
    log::info!("stop: recording closed at {:?}", stopping.elapsed());
    let analysis = crate::analysis::Analysis::of_dir(&opts.out, crate::analysis::Needs::ALL)?;
    let report = &analysis.report;
    log::info!("stop: recording analysed at {:?}", stopping.elapsed());
    let report_written = out_dir.write("report.json", &serde_json::to_vec_pretty(&report)?);
    if let Some(f) = &stopped.full {
        let what = f.error.to_string();
        let what = what.split(" (os error").next().unwrap_or_default();
        let end = if stopped.full_again { "; the end record did not fit either" } else { "" };
        let rep = match &report_written {
            Ok(_) => "report written from it".to_string(),
            Err(e) => format!("report.json not written ({e:#}): `probe report {}` reads it once there is room", opts.out.display()),
        };
        say!(
            "probe: stopped: the disk holding {} is full ({}) after {} events; the recording holds everything up to that point{end}; {rep}",
            opts.out.display(),
            what,
            f.events_written
        );
    } else {
        report_written?;
    }
    drop(st);
    let drawn = crate::render::flame::draw_all(&analysis.flames);
    match crate::render::html::write_for(&analysis, &drawn, out_dir) {
        Ok(page) => say!("probe: {}", page.display()),
        Err(e) => say!("probe: report.html not written: {e:#}"),
    }
    match crate::render::flame::write_defaults(&analysis.flames, &drawn, out_dir) {
        Ok(written) => {
            for (path, weight) in written {
                say!("probe: flamegraph {} (weight {weight})", path.display());
            }
        }
        Err(e) => say!("probe: flamegraphs not written: {e}"),
    }
    if let Some(ep) = &opts.otlp {
        let spans = crate::render::export::otlp::from_report(report, &analysis.meta, None);
        match ep.send(&spans) {
            Ok(_) => say!("probe: sent {} request spans to the OTLP collector", spans.spans.len()),
            Err(e) => say!("probe: request spans not sent to the OTLP collector: {e} (`probe export --otlp URL` sends them later)"),
        }
    }
    log::info!("stop: outputs written at {:?}", stopping.elapsed());
    Ok(analysis.report)
}
