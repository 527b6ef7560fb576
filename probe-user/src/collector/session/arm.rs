//! Arming a session: the maps taken from the kernel side, the recording opened, its meta and first
//! counters written, and what is live said.
use std::{collections::BTreeMap, io::IsTerminal as _, time::Instant};

use anyhow::Context as _;
use aya::maps::{MapData, PerCpuArray, RingBuf};
use probe_common::maps;
use tokio::io::unix::AsyncFd;

use super::{Session, Source};
use crate::collector::{SPILL_MAX, Spill, State, TraceOptions, reserve_error, segments, stats};
use crate::{
    monotonic_ns,
    os::procfs,
    record::{
        self, Writer,
        records::{self, UserRecord},
    },
};

/// Take the maps, open the recording, write its meta and first counters, and say what is live.
pub(super) fn arm(
    opts: &TraceOptions,
    kernel: crate::collector::Kernel,
    out_dir: &crate::util::output::OutDir,
) -> anyhow::Result<(State, Session)> {
    let mut kernel = match kernel {
        crate::collector::Kernel::Own(mut attached) => {
            let ring = RingBuf::try_from(attached.ebpf.take_map(maps::EVENTS).context("EVENTS map missing")?)?;
            let lost_map: PerCpuArray<MapData, u64> =
                PerCpuArray::try_from(attached.ebpf.take_map(maps::LOST).context("LOST map missing")?)?;
            let counter_map: PerCpuArray<MapData, u64> =
                PerCpuArray::try_from(attached.ebpf.take_map(maps::COUNTERS).context("COUNTERS map missing")?)?;
            // SAFETY: the RingBuf owns its map fd and keeps it open, unchanged, for as long as the AsyncFd lives.
            let ring = unsafe { AsyncFd::register(ring) }.context("cannot poll the ring buffer")?;
            Source::Own { ring, lost_map, counter_map, attached: Box::new(attached) }
        }
        crate::collector::Kernel::Member(m) => Source::Member(Box::new(m)),
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
    // A spill holds what the ring held past half full, and what came while it was copied out
    // (a trace's own ring; the members of `watch --all` share the hub's, and spill rarely).
    if matches!(kernel, Source::Own { .. }) {
        st.spill = Spill::prepared((opts.ring_bytes as usize / 8 * 5).min(SPILL_MAX));
    }
    // The engine probe follows executable files mapped after attach (when it was asked for):
    // those it searched already are not searched again.
    let follow_engine = attached.status.iter().any(|s| s.name == records::Subsystem::Engine);
    st.engine_seen = attached.engine_seen.iter().copied().collect();
    st.follow_cgroup = opts.cgroup.is_some();
    st.ustack_need = attached.ustack_need.take();
    st.stack_ranges = attached.stack_ranges.take();
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
        st.list_stacks(pid);
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
    ustack_need: Option<aya::maps::HashMap<MapData, u32, u64>>,
    stack_ranges: Option<aya::maps::HashMap<MapData, probe_common::stack::StackKey, probe_common::stack::StackSpans>>,
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
                let stack_ranges = take(maps::STACK_RANGES).and_then(|m| aya::maps::HashMap::try_from(m).ok());
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
                    stack_ranges,
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
                stack_ranges: m.open_hash(maps::STACK_RANGES),
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
