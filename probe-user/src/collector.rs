//! `probe trace`: attach, drain the ring buffer into the recording as events arrive, follow the
//! target's mappings and files, and stop on Ctrl-C, SIGTERM, the duration or the target's exit.
use std::{
    collections::{HashMap, HashSet},
    io::IsTerminal as _,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{MapData, PerCpuArray, RingBuf};
use probe_common::{
    Counter, EventKind, maps,
    mmap::MmapOp,
    proc::{PROC_EXIT, PROC_FORK},
};
use serde_json::json;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use crate::{
    decode::{self, Event},
    monotonic_ns, probes, procfs,
    recording::{self, Writer},
    report::{self, Report},
    stream,
    unwind::Unwinders,
};

pub struct TraceOptions {
    pub pid: u32,
    pub duration: Option<Duration>,
    pub out: PathBuf,
    /// Replace a recording already in `out` (the caller's own).
    pub force: bool,
    pub only: Option<Vec<String>>,
    pub ring_bytes: u32,
    /// On-CPU sampling frequency (Hz).
    pub sample_hz: u64,
    /// Keep the bytes of request streams in the recording (off by default: prompts and answers
    /// are private).
    pub capture_text: bool,
    /// GPU / CPU-frequency / memory samples per second (0: off).
    pub host_hz: f64,
    /// Poll the server's own HTTP endpoints (/metrics, /props, /api/ps).
    pub poll: bool,
    /// When the process started: "armed in N ms" counts from here.
    pub started: Instant,
}

pub struct TraceOutcome {
    pub report: Report,
    /// Probes were skipped or events were lost: the recording is usable but incomplete.
    pub partial: bool,
}

pub fn trace(opts: TraceOptions) -> anyhow::Result<TraceOutcome> {
    let popts = probes::Options { pid: opts.pid, only: opts.only.clone(), ring_bytes: opts.ring_bytes, sample_hz: opts.sample_hz };
    // Then the output: a refused --out costs nothing to attach (or to detach).
    probes::preflight(&popts)?;
    let out_dir = crate::output::OutDir::create_recording(&opts.out, opts.force)?;
    let attached = match probes::attach(&popts) {
        Ok(a) => a,
        Err(e) => {
            // Nothing was recorded: leave no empty directory behind (rmdir removes only an empty one).
            let _ = std::fs::remove_dir(&opts.out);
            return Err(e);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(opts, attached, out_dir))
}

struct State {
    writer: Writer,
    capture_text: bool,
    streams: stream::Tracker,
    unwinders: Unwinders,
    /// Kernel addresses named while they mean something (see crate::ksyms).
    ksyms: crate::ksyms::Resolver,
    /// Off-CPU stacks waiting for their thread to run again (by tid).
    offcpu: HashMap<u32, recording::StackRecord>,
    root: u32,
    root_exited: bool,
    /// The target set, shared with the samplers.
    targets: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
    events: u64,
    per_kind: [u64; probe_common::MAX_KINDS as usize],
    dirty_maps: HashSet<u32>,
    dirty_files: HashSet<u32>,
    last_maps: HashMap<u32, Vec<procfs::Mapping>>,
    known_files: HashSet<(u32, u32, u64)>,
    last_file_scan: HashMap<u32, Instant>,
    /// Threads seen (named in a `threads` record, or being named at the next refresh).
    threads_seen: HashSet<u32>,
    threads_new: Vec<(u32, u32)>,
}

impl State {
    fn on_record(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.events += 1;
        let Ok(ev) = decode::decode(bytes) else {
            return self.writer.kernel(bytes);
        };
        self.per_kind[ev.kind() as usize] += 1;
        let h = ev.header();
        if h.pid != 0 && self.threads_seen.insert(h.tid) {
            self.threads_new.push((h.pid, h.tid));
        }
        // Stream bytes are parsed here and dropped unless the user asked to keep them; raw stacks
        // (which hold user memory) are unwound here and only their frames are kept.
        if let (Event::Data(_), true) = (&ev, self.capture_text) {
            // Kept text never keeps credentials: Authorization, Cookie, X-Api-Key values and secret
            // query parameters are overwritten (same length) before the bytes reach the file.
            let mut copy = bytes.to_vec();
            let head = bytes.len() - decode::data_payload(bytes).len();
            crate::redact::http_credentials_in_place(&mut copy[head..]);
            self.writer.kernel(&copy)?;
        } else if !matches!(ev, Event::Data(_) | Event::Stack(_) | Event::Sched(_)) {
            self.writer.kernel(bytes)?;
        }
        match ev {
            Event::Stack(s) => self.on_stack(&s, decode::data_payload(bytes))?,
            Event::Sched(e) => {
                if let Some(mut v) = self.offcpu.remove(&e.tid) {
                    v.blocked_ns = Some(e.blocked_ns);
                    self.writer.stack(&v)?;
                }
            }
            Event::Data(d) => self.streams.on_data(&d, decode::data_payload(bytes)),
            Event::Sock(s) => self.streams.on_sock(&s),
            Event::Mmap(m) => {
                if matches!(MmapOp::try_from(m.op), Ok(MmapOp::Mmap | MmapOp::Munmap | MmapOp::Mremap)) {
                    self.dirty_maps.insert(m.hdr.pid);
                }
            }
            Event::Proc(p) if p.op == PROC_FORK => {
                if let Ok(mut t) = self.targets.lock() {
                    t.push(p.child);
                }
                self.dirty_maps.insert(p.child);
                self.dirty_files.insert(p.child);
            }
            Event::Proc(p) if p.op == PROC_EXIT => {
                if let Ok(mut t) = self.targets.lock() {
                    t.retain(|&x| x != p.hdr.pid);
                }
                if p.hdr.pid == self.root {
                    self.root_exited = true;
                }
            }
            Event::Filemap(f) if !self.known_files.contains(&(f.dev >> 20, f.dev & 0xfffff, f.ino)) => {
                self.dirty_files.insert(f.hdr.pid);
            }
            _ => {}
        }
        Ok(())
    }

    /// Unwind a stack sample and write its frames (off-CPU ones once the thread runs again).
    fn on_stack(&mut self, s: &probe_common::stack::StackEvent, ustack: &[u8]) -> std::io::Result<()> {
        let u = self.unwinders.unwind(s.hdr.pid, s.ip, s.sp, s.bp, ustack);
        for (id, path) in self.unwinders.take_new_modules() {
            self.writer.json(&json!({"type": "module", "id": id, "path": path}))?;
        }
        let kernel: Vec<u64> = if s.kstack_bytes > 0 {
            s.kstack.iter().take(s.kstack_bytes as usize / 8).copied().take_while(|&a| a != 0).collect()
        } else {
            Vec::new()
        };
        let what = match s.what {
            probe_common::stack::STACK_CPU => recording::StackKind::Cpu,
            probe_common::stack::STACK_OFFCPU => recording::StackKind::Offcpu,
            probe_common::stack::STACK_FAULT => recording::StackKind::Fault,
            _ => recording::StackKind::Io,
        };
        if let Some(names) = self.ksyms.learn(&kernel) {
            self.writer.json(&names)?;
        }
        let mut v = recording::StackRecord {
            what,
            pid: s.hdr.pid,
            tid: s.hdr.tid,
            ts_ns: s.hdr.ts_ns,
            user: u.frames,
            complete: u.complete,
            addr: s.addr,
            state: s.state,
            ..Default::default()
        };
        if s.what == probe_common::stack::STACK_OFFCPU {
            v.wait = Some(crate::ksyms::wait_class(&self.ksyms.names(&kernel)).into());
            v.kernel = kernel;
            if let Some(old) = self.offcpu.insert(s.hdr.tid, v) {
                self.writer.stack(&old)?;
            }
            return Ok(());
        }
        v.kernel = kernel;
        self.writer.stack(&v)
    }

    /// Write the requests that finished.
    fn write_requests(&mut self) -> std::io::Result<()> {
        for r in self.streams.take_done() {
            let mut v = serde_json::to_value(&r).map_err(std::io::Error::other)?;
            v["type"] = json!("request");
            self.writer.json(&v)?;
        }
        Ok(())
    }

    /// Re-read /proc for processes whose mappings or files changed; write what is new.
    fn refresh(&mut self) -> std::io::Result<()> {
        self.write_requests()?;
        self.name_threads()?;
        for pid in std::mem::take(&mut self.dirty_maps) {
            self.snapshot_maps(pid)?;
        }
        let now = Instant::now();
        let due: Vec<u32> = self
            .dirty_files
            .iter()
            .copied()
            .filter(|p| self.last_file_scan.get(p).is_none_or(|t| now - *t > Duration::from_millis(200)))
            .collect();
        for pid in due {
            self.dirty_files.remove(&pid);
            self.last_file_scan.insert(pid, now);
            self.snapshot_files(pid)?;
        }
        Ok(())
    }

    /// Name the threads seen since the last refresh (a thread that already exited stays unnamed).
    fn name_threads(&mut self) -> std::io::Result<()> {
        if self.threads_new.is_empty() {
            return Ok(());
        }
        let named: Vec<serde_json::Value> = std::mem::take(&mut self.threads_new)
            .into_iter()
            .filter_map(|(pid, tid)| Some(json!([pid, tid, procfs::thread_comm(pid, tid)?])))
            .collect();
        if named.is_empty() {
            return Ok(());
        }
        self.writer.json(&json!({"type": "threads", "ts_ns": monotonic_ns(), "threads": named}))
    }

    fn snapshot_maps(&mut self, pid: u32) -> std::io::Result<()> {
        let Ok(maps) = procfs::read_maps(pid) else { return Ok(()) };
        if self.last_maps.get(&pid) == Some(&maps) {
            return Ok(());
        }
        self.unwinders.update(pid, &maps);
        for m in &maps {
            self.known_files.insert((m.major, m.minor, m.inode));
        }
        self.writer.json(&json!({"type": "maps", "pid": pid, "ts_ns": monotonic_ns(), "mappings": maps}))?;
        self.last_maps.insert(pid, maps);
        Ok(())
    }

    fn snapshot_files(&mut self, pid: u32) -> std::io::Result<()> {
        let files: Vec<_> = procfs::open_files(pid).into_iter().filter(|f| self.known_files.insert((f.major, f.minor, f.inode))).collect();
        if !files.is_empty() {
            self.writer.json(&json!({"type": "files", "pid": pid, "ts_ns": monotonic_ns(), "files": files}))?;
        }
        Ok(())
    }
}

fn sum(map: &PerCpuArray<MapData, u64>) -> Vec<u64> {
    (0..probe_common::MAX_KINDS).map(|i| map.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0)).collect()
}

fn stats_json(lost: &[u64], counters: &[u64], st: &State, skipped: &std::collections::BTreeMap<String, u64>) -> serde_json::Value {
    let lost: serde_json::Map<_, _> = EventKind::ALL.iter().map(|k| (k.name().to_string(), json!(lost[*k as usize]))).collect();
    let counters: serde_json::Map<_, _> = Counter::ALL.iter().map(|c| (c.name().to_string(), json!(counters[*c as usize]))).collect();
    let events: serde_json::Map<_, _> = EventKind::ALL.iter().map(|k| (k.name().to_string(), json!(st.per_kind[*k as usize]))).collect();
    let u = &st.unwinders;
    let unwind = json!({"samples": u.samples, "complete": u.complete, "ns": u.nanos, "load_ns": u.load_nanos});
    json!({"type": "stats", "ts_ns": monotonic_ns(), "lost": lost, "counters": counters, "events": events, "unwind": unwind, "skipped_runs": skipped, "streams": st.streams.limits()})
}

async fn run(opts: TraceOptions, mut attached: probes::Attached, out_dir: crate::output::OutDir) -> anyhow::Result<TraceOutcome> {
    let ring = RingBuf::try_from(attached.ebpf.take_map(maps::EVENTS).context("EVENTS map missing")?)?;
    let lost_map: PerCpuArray<MapData, u64> = PerCpuArray::try_from(attached.ebpf.take_map(maps::LOST).context("LOST map missing")?)?;
    let counter_map: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(attached.ebpf.take_map(maps::COUNTERS).context("COUNTERS map missing")?)?;
    // SAFETY: the RingBuf owns its map fd and keeps it open, unchanged, for as long as the AsyncFd lives.
    let mut ring = unsafe { AsyncFd::register(ring) }.context("cannot poll the ring buffer")?;

    let armed_ms = opts.started.elapsed().as_secs_f64() * 1e3;
    let writer = Writer::create_in(&out_dir).with_context(|| format!("cannot create the recording in {}", opts.out.display()))?;
    let start_ns = monotonic_ns();
    let mut st = State {
        writer,
        capture_text: opts.capture_text,
        streams: stream::Tracker::new(start_ns, opts.capture_text),
        unwinders: Unwinders::default(),
        ksyms: crate::ksyms::Resolver::default(),
        offcpu: HashMap::new(),
        root: opts.pid,
        root_exited: false,
        targets: std::sync::Arc::new(std::sync::Mutex::new(attached.targets.clone())),
        events: 0,
        per_kind: [0; probe_common::MAX_KINDS as usize],
        dirty_maps: attached.targets.iter().copied().collect(),
        dirty_files: attached.targets.iter().copied().collect(),
        last_maps: HashMap::new(),
        known_files: HashSet::new(),
        last_file_scan: HashMap::new(),
        threads_seen: HashSet::new(),
        threads_new: vec![],
    };
    // Every thread there at attach; later ones when they first show up in an event.
    for &pid in &attached.targets {
        for tid in procfs::tasks(pid) {
            if st.threads_seen.insert(tid) {
                st.threads_new.push((pid, tid));
            }
        }
    }
    let uname = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let start_unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    st.writer.json(&json!({
        "type": "meta", "format_version": recording::VERSION, "probe_version": env!("CARGO_PKG_VERSION"),
        "pid": opts.pid, "comm": procfs::comm(opts.pid), "cmdline": crate::redact::command_line(&procfs::cmdline_args(opts.pid)),
        "exe": std::fs::read_link(format!("/proc/{}/exe", opts.pid)).map(|p| p.display().to_string()).unwrap_or_default(),
        "targets": attached.targets, "start_ns": start_ns, "capture_text": opts.capture_text, "start_unix_ms": start_unix_ms,
        "kernel": uname.trim(), "armed_ms": armed_ms, "probes": attached.status,
        // SAFETY: sysconf has no preconditions.
        "page_size": unsafe { libc::sysconf(libc::_SC_PAGESIZE) }, "block_devices": block_devices(),
    }))?;
    st.refresh()?;
    for &pid in &attached.targets {
        st.unwinders.prepare(pid);
    }
    st.writer.flush()?;

    let live: Vec<&str> = attached.status.iter().filter(|s| s.live).map(|s| s.name.as_str()).collect();
    eprintln!(
        "probe: armed in {armed_ms:.0} ms: pid {} ({}), {} process(es); probes live: {}",
        opts.pid,
        crate::text::terminal(&procfs::comm(opts.pid)),
        attached.targets.len(),
        live.join(", ")
    );
    let mut partial = false;
    for s in &attached.status {
        if !s.live {
            partial = true;
            eprintln!("probe: skipped {}: {}", s.name, s.skipped.join("; "));
        } else if !s.skipped.is_empty() {
            log::info!("{}: optional programs not attached: {}", s.name, s.skipped.join("; "));
        }
    }
    let sampler = crate::sampler::Sampler::start(crate::sampler::Options {
        pid: opts.pid,
        targets: st.targets.clone(),
        hz: opts.host_hz,
        poll: opts.poll,
    });
    eprintln!("probe: recording to {} (Ctrl-C to stop; SIGUSR1 measures the model files' page-cache residency)", opts.out.display());

    let tty = std::io::stderr().is_terminal();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigusr1 = signal(SignalKind::user_defined1())?;
    let mut drain_tick = tokio::time::interval(Duration::from_millis(20));
    let mut sec_tick = tokio::time::interval(Duration::from_secs(1));
    let started = Instant::now();
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut last_events = 0u64;
    let drain = |ring: &mut RingBuf<aya::maps::MapData>, st: &mut State| -> std::io::Result<()> {
        while let Some(item) = ring.next() {
            st.on_record(&item)?;
        }
        for v in sampler.drain() {
            st.writer.json(&v)?;
        }
        st.refresh()
    };
    let reason = loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                drain(guard.get_inner_mut(), &mut st)?;
                guard.clear_ready();
            }
            _ = drain_tick.tick() => drain(ring.get_mut(), &mut st)?,
            _ = sec_tick.tick() => {
                drain(ring.get_mut(), &mut st)?;
                let lost = sum(&lost_map);
                st.writer.json(&stats_json(&lost, &sum(&counter_map), &st, &probes::skipped_runs(&attached.ebpf)))?;
                st.writer.flush()?;
                if tty {
                    let rate = st.events - last_events;
                    eprint!("\r  {:>6.1} s | {} events ({rate}/s) | {} requests in flight | lost {}    ", started.elapsed().as_secs_f64(), st.events, st.streams.in_flight(), lost.iter().sum::<u64>());
                }
                last_events = st.events;
                if !procfs::exists(opts.pid) {
                    st.root_exited = true;
                }
            }
            _ = sigusr1.recv() => sampler.snapshot_now(),
            _ = sigint.recv() => break "interrupted (Ctrl-C)",
            _ = sigterm.recv() => break "terminated (SIGTERM)",
            _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await }, if deadline.is_some() => break "duration reached",
        }
        if st.root_exited {
            break "target exited";
        }
    };
    if tty {
        eprintln!();
    }
    drain(ring.get_mut(), &mut st)?;
    for v in sampler.stop() {
        st.writer.json(&v)?;
    }
    st.streams.finish();
    st.write_requests()?;
    // Threads still blocked when the trace ended: blocked until now.
    let now = monotonic_ns();
    for (_, mut v) in std::mem::take(&mut st.offcpu) {
        v.blocked_ns = Some(now.saturating_sub(v.ts_ns));
        v.still_blocked = true;
        st.writer.stack(&v)?;
    }
    let lost = sum(&lost_map);
    let skipped = probes::skipped_runs(&attached.ebpf);
    st.writer.json(&stats_json(&lost, &sum(&counter_map), &st, &skipped))?;
    st.writer.json(&json!({"type": "end", "ts_ns": monotonic_ns(), "reason": reason}))?;
    st.writer.flush()?;
    drop(attached);
    let parsed = st.per_kind[EventKind::Data as usize];
    let kept = if st.capture_text { "kept with --capture-text" } else { "parsed in memory, not stored" };
    let skipped_total: u64 = skipped.values().sum();
    let skipped_note = if skipped_total > 0 {
        format!(", {skipped_total} program runs skipped by the kernel (another BPF program was running on that CPU)")
    } else {
        String::new()
    };
    eprintln!(
        "probe: stopped: {reason}; {} events ({parsed} stream records {kept}), {} lost{skipped_note}",
        st.events,
        lost.iter().sum::<u64>()
    );

    // One analysis (streamed from the file: memory does not grow with the trace's length) and
    // one symbolization for every output.
    let report = report::build_dir(&opts.out)?;
    let rec = recording::read_dir(&opts.out)?;
    let flames = crate::flame::Flames::of_dir(&opts.out, Default::default())?;
    match crate::flame::write_defaults(&flames, &out_dir) {
        Ok(written) => {
            for (path, weight) in written {
                eprintln!("probe: flamegraph {} (weight {weight})", path.display());
            }
        }
        Err(e) => eprintln!("probe: flamegraphs not written: {e}"),
    }
    out_dir.write("report.json", &serde_json::to_vec_pretty(&report)?)?;
    match crate::html::write_for(&rec, &report, &flames, &out_dir) {
        Ok(page) => eprintln!("probe: {}", page.display()),
        Err(e) => eprintln!("probe: report.html not written: {e:#}"),
    }
    partial |= report.lost_events.values().any(|&n| n > 0) || !report.skipped_runs.is_empty();
    Ok(TraceOutcome { report, partial })
}

/// "major:minor" → name of every block device (/sys/class/block/*/dev), to name devices in reports.
fn block_devices() -> serde_json::Map<String, serde_json::Value> {
    std::fs::read_dir("/sys/class/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let dev = std::fs::read_to_string(e.path().join("dev")).ok()?;
            Some((dev.trim().to_string(), json!(e.file_name().to_string_lossy())))
        })
        .collect()
}
