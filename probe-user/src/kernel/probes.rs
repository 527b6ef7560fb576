//! Loading probe's kernel object and attaching it from one table, feature-checked first.
//!
//! Every program belongs to a subsystem (blockio, fault, filemap, mmap, sock, proc). A program
//! that cannot attach here (tracepoint missing, layout differs, kernel refuses) is reported and
//! its subsystem skipped, unless the user named that subsystem with `--probes`: then it is an error.
use std::path::Path;

use super::programs::{Formats, Job, in_own_pid_namespace, load_all, pool};
use super::table::{How, Spec, TABLE};
use crate::{os::procfs, os::tracefs};
use anyhow::{Context as _, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::HashMap,
    programs::{
        PerfEvent,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
    },
};

pub use super::loaded::{Attached, ProgRuns, detach, enable_run_time_stats, hand_off, prog_runs, skipped_runs, switch_off};

/// The compiled kernel object, built by build.rs from probe-ebpf.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/probe"));

pub const SUBSYSTEMS: [Subsystem; 11] = Subsystem::ALL;

pub use crate::record::records::{Subsystem, SubsystemStatus};

/// Times the stages of attaching.
struct Laps {
    at: std::time::Instant,
    stages: Vec<(String, f64)>,
}

impl Laps {
    fn lap(&mut self, name: &str) {
        let now = std::time::Instant::now();
        self.stages.push((name.to_string(), (now - self.at).as_secs_f64() * 1e3));
        self.at = now;
    }
}

pub struct Options {
    pub pid: u32,
    /// Subsystems to trace; `None` = all. Named subsystems that cannot attach are errors.
    pub only: Option<Vec<String>>,
    pub ring_bytes: u32,
    /// On-CPU sampling frequency (Hz).
    pub sample_hz: u64,
    /// Off-CPU stacks only for uninterruptible waits (disk, faults, reclaim): `probe watch`.
    pub offcpu_d_only: bool,
    /// The most user-stack bytes a record copies (0: the largest copy, 128 KiB).
    pub stack_limit: u32,
    /// More processes traced from the start with their descendants (a cgroup's other members).
    pub more: Vec<u32>,
    /// Take the verified programs an earlier trace kept and keep this trace's for the next, leave
    /// them, or remove them ([`super::kept`]).
    pub keep: super::kept::Keep,
}

/// Fails unless we are root or hold CAP_BPF + CAP_PERFMON (+ CAP_SYS_ADMIN for tracefs mounts).
pub use crate::os::procfs::effective_caps;

pub fn check_privileges() -> anyhow::Result<()> {
    check_host_pids()?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(());
    }
    let eff = effective_caps();
    const CAP_PERFMON: u64 = 38;
    const CAP_BPF: u64 = 39;
    if eff & (1 << CAP_BPF) != 0 && eff & (1 << CAP_PERFMON) != 0 {
        return Ok(());
    }
    bail!("probe needs root (or CAP_BPF and CAP_PERFMON) to load kernel programs: run it with sudo")
}

/// The initial PID namespace's inode (the kernel's PROC_PID_INIT_INO, include/linux/proc_ns.h).
const PID_NS_INIT_INO: u64 = 0xEFFF_FFFC;

/// probe must see the host's processes: its kernel programs see the kernel's (host) pids, and
/// a /proc of a container's own PID namespace numbers the same processes differently, so nothing
/// would match. The /proc it reads is the host's when its pid 1 is in the initial PID namespace
/// (probe itself may sit in a namespace of its own with the host's /proc mounted: that works).
pub fn check_host_pids() -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(ns) = std::fs::metadata("/proc/1/ns/pid") else { return Ok(()) };
    if ns.ino() == PID_NS_INIT_INO {
        return Ok(());
    }
    bail!(
        "probe sees the processes of a PID namespace of its own (a container without the host's processes), but its kernel programs \
         see the host's pids, which differ from the ones here: nothing could be traced. Run it in the host's PID namespace: `--pid=host` \
         (podman, docker), `hostPID: true` (Kubernetes; `podman kube play` honours it from podman 4.5 on)"
    )
}

fn raise_memlock() {
    let lim = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: valid rlimit struct. Failure only matters on kernels before 5.11 (memcg accounting).
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) };
}

/// The longest an arming trace waits for an earlier trace's teardown to let go of the attach lock
/// (one descriptor's teardown: tens of ms, up to 2 s under load).
const DETACH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The arming and attach locks ([`super::loaded::teardown_locks`]), each held exclusively where
/// it could be had within [`DETACH_WAIT`] (None: no lock files).
fn wait_for_teardowns() -> Option<(std::fs::File, std::fs::File)> {
    let (arming, attach) = super::loaded::teardown_locks();
    let (arming, attach) = (arming?, attach?);
    let t = std::time::Instant::now();
    for f in [&arming, &attach] {
        // SAFETY: flock on a descriptor we own.
        while unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(f), libc::LOCK_EX | libc::LOCK_NB) } != 0 && t.elapsed() < DETACH_WAIT {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Some((arming, attach))
}

/// What can be refused before anything is made or loaded: privileges, the pid, probe names.
pub fn preflight(opts: &Options) -> anyhow::Result<()> {
    check_privileges()?;
    if !procfs::exists(opts.pid) {
        bail!("no process with pid {}: check the pid (e.g. `pgrep llama-server`)", opts.pid);
    }
    if let Some(only) = &opts.only {
        for name in only {
            if let Err(e) = name.parse::<Subsystem>() {
                bail!("{e}");
            }
        }
    }
    Ok(())
}

/// Check, load and attach everything for `opts.pid`. On error nothing stays attached: the `Ebpf`
/// owns every program, map and link and is dropped (what is pinned in the kept set stays, as
/// after any trace: [`super::kept`]).
pub fn attach(opts: &Options) -> anyhow::Result<Attached> {
    let mut laps = Laps { at: std::time::Instant::now(), stages: Vec::new() };
    preflight(opts)?;
    // Held until armed: an earlier trace's hand-off child closes nothing meanwhile (`hand_off`):
    // the arming lock first (children stop taking the attach lock), then the attach lock (the
    // closes in flight end). Each tried every millisecond for at most `DETACH_WAIT` in all: past
    // that, probe arms beside the teardown.
    let locks = wait_for_teardowns();
    if locks.is_some() {
        laps.lap("earlier_trace_detach");
    }
    let tracefs = tracefs::ensure_mounted().map_err(|e| anyhow!(e))?;
    raise_memlock();
    let run_time_stats = enable_run_time_stats();
    laps.lap("preflight");
    let engine_search = start_engine_search(opts);
    let formats = start_format_reads(opts, &tracefs);

    // Struct offsets for naming the file behind an fd; without BTF the mmap probe still runs
    // and files are named from /proc alone. Kept from the last trace on this kernel (`/run/probe`)
    // or read from BTF now; aya's loader does not read BTF for an object without CO-RE relocations.
    let (koff, koff_note, cached) = kernel_offsets();
    laps.lap(if cached { "kernel_btf (cached)" } else { "kernel_btf" });
    let mut kept = match super::kept::open(&kept_key(opts, &koff), opts.keep) {
        Ok(k) => Some(k),
        Err(why) => {
            log::info!("verified programs: {why}");
            None
        }
    };
    let mut ebpf = match load_object(opts, &koff, kept.as_ref().map(|k| k.maps_dir()).as_deref()) {
        Err(e) if kept.is_some() => {
            // Nothing kept is worth a trace: loaded as when nothing is kept.
            log::warn!("verified programs not kept ({e:#}): loaded for this trace only");
            kept = None;
            load_object(opts, &koff, None)?
        }
        loaded => loaded?,
    };
    laps.lap("object_load");
    if let Some(mut k) = kept.take() {
        if let Err(e) = k.loaded(&mut ebpf) {
            // A set that cannot be emptied is not taken: it goes, and this trace loads its own.
            log::warn!("verified programs not kept ({e:#}): the kept set is removed, loaded for this trace only");
            k.forget();
            drop(ebpf);
            ebpf = load_object(opts, &koff, None)?;
        } else {
            kept = Some(k);
        }
    }
    if let Some(k) = &mut kept {
        for name in k.adopt(ebpf.programs_mut()) {
            if let Some(fd) = ebpf.program(&name).and_then(|p| p.fd().ok()) {
                super::loaded::note_taken(fd);
            }
        }
        laps.lap(k.stage());
    }
    let targets = target_set(opts);
    laps.lap("descendants");
    fill_target_map(&mut ebpf, &targets)?;
    laps.lap("target_map");
    for &pid in &targets {
        add_listeners(&mut ebpf, pid)?;
    }

    laps.lap("listen_ports");
    let mut status: Vec<SubsystemStatus> = SUBSYSTEMS
        .iter()
        .filter(|s| wanted(opts, **s))
        .map(|s| SubsystemStatus { name: *s, live: true, attached: vec![], skipped: vec![] })
        .collect();
    let (results, engine) = attach_programs(&mut ebpf, opts, formats, &targets, &koff, engine_search);
    let (engine_seen, engine_ms) = engine_status(&mut status, engine);
    let per_program = program_status(&mut status, results, engine_ms);
    if let Some(note) = koff_note {
        no_offsets_status(&mut status, &note);
    }
    check_live(opts, &status)?;
    laps.lap("programs");
    if let Some(k) = &mut kept {
        let pinned = k.keep(ebpf.programs_mut());
        k.hold_lock_last();
        log::info!("verified programs: {} taken from the kept set, {pinned} verified now and kept", k.adopted);
        laps.lap("kept_programs");
    }
    laps.stages.extend(slowest(per_program));
    Ok(Attached { ebpf, status, targets, run_time_stats, stages: laps.stages, engine_seen, kept })
}

/// Whether the trace wants subsystem `sub`: every one, or the ones named with `--probes`.
fn wanted(opts: &Options, sub: Subsystem) -> bool {
    opts.only.as_ref().is_none_or(|o| o.iter().any(|n| n == sub.name()))
}

/// The engine probe's search of the target's executable files, when the engine is wanted.
type EngineSearch = Option<std::io::Result<std::thread::JoinHandle<crate::kernel::engine::Search>>>;

/// What the engine's thread gave back (None: the engine was not wanted): its attach, the files its
/// search looked at, and what it took (ms); or why there was no thread, or that it panicked.
type EngineDone = Option<std::io::Result<std::thread::Result<(crate::kernel::engine::Attached, Vec<crate::os::target_file::Ident>, f64)>>>;

/// One program of the table as it came out: attached or why not, and what it took (ms).
type Outcome = (&'static Spec, anyhow::Result<()>, f64);

/// Start the engine probe's search, when the engine is wanted. The search reads the target's
/// objects (/proc, ELF string tables): on a thread of its own while the kernel programs load and
/// verify.
fn start_engine_search(opts: &Options) -> EngineSearch {
    wanted(opts, Subsystem::Engine).then(|| {
        let pids: Vec<u32> = std::iter::once(opts.pid).chain(procfs::descendants(opts.pid)).chain(opts.more.iter().copied()).collect();
        std::thread::Builder::new().name("probe-engine".into()).spawn(move || crate::kernel::engine::search(&pids))
    })
}

/// Read the format files of the wanted tracepoints on a thread of their own, while the object
/// loads: before the engine's uprobes register ([`Formats`]). Read on the way when there is no
/// thread.
fn start_format_reads(opts: &Options, tracefs: &Path) -> FormatReads {
    let (opts_only, root) = (opts.only.clone(), tracefs.to_path_buf());
    let job =
        move || Formats::read(&root, TABLE.iter().filter(|s| opts_only.as_ref().is_none_or(|o| o.iter().any(|n| n == s.subsystem.name()))));
    match std::thread::Builder::new().name("probe-formats".into()).spawn(job) {
        Ok(h) => FormatReads::Reading(h, tracefs.to_path_buf()),
        Err(_) => FormatReads::Later(tracefs.to_path_buf()),
    }
}

/// The format reads of [`start_format_reads`].
enum FormatReads {
    Reading(std::thread::JoinHandle<Formats>, std::path::PathBuf),
    Later(std::path::PathBuf),
}

impl FormatReads {
    fn join(self) -> Formats {
        match self {
            FormatReads::Reading(h, root) => h.join().unwrap_or_else(|_| Formats::read(&root, std::iter::empty())),
            FormatReads::Later(root) => Formats::read(&root, std::iter::empty()),
        }
    }
}

/// Load probe's kernel object with the ring's size and the globals it reads: the kernel's struct
/// offsets, whether off-CPU stacks are for uninterruptible waits only, and whether perf events
/// are per CPU (probe in a PID namespace of its own).
fn load_object(opts: &Options, koff: &probe_common::kernel::KernelOffsets, keep_maps_in: Option<&Path>) -> anyhow::Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    if let Some(dir) = keep_maps_in {
        loader.keep_maps_in(dir);
    }
    loader
        .map_max_entries(probe_common::maps::EVENTS, opts.ring_bytes)
        .override_global(probe_common::kernel::KOFF_SYMBOL, koff, true)
        .override_global(probe_common::kernel::OFFCPU_D_ONLY_SYMBOL, &u32::from(opts.offcpu_d_only), true)
        .override_global(probe_common::kernel::USTACK_LIMIT_SYMBOL, &opts.stack_limit, true)
        .override_global(probe_common::kernel::PERF_PER_CPU_SYMBOL, &u32::from(in_own_pid_namespace()), true)
        .override_global(probe_common::kernel::WAKEUP_SHIFT_SYMBOL, &probe_common::wakeup_shift(opts.ring_bytes), true)
        .load(OBJECT)
        .context("the kernel refused probe's BPF object (needs Linux >= 5.8 with BPF ring buffers and BTF)")
}

/// What the programs are verified with beyond probe's executable: the kernel's struct offsets
/// and the globals and sizes [`load_object`] sets.
fn kept_key(opts: &Options, koff: &probe_common::kernel::KernelOffsets) -> String {
    let koff: Vec<u8> = crate::os::kernel_cache::words(koff).iter().flat_map(|w| w.to_ne_bytes()).collect();
    let globals = [
        opts.ring_bytes,
        u32::from(opts.offcpu_d_only),
        opts.stack_limit,
        u32::from(in_own_pid_namespace()),
        probe_common::wakeup_shift(opts.ring_bytes),
    ];
    let globals: Vec<u8> = globals.iter().flat_map(|g| g.to_ne_bytes()).collect();
    super::kept::key(&[&koff, &globals, &OBJECT.len().to_ne_bytes()])
}

/// The processes traced from the start: the target and its live descendants, then each of
/// `opts.more` with its descendants (each once).
fn target_set(opts: &Options) -> Vec<u32> {
    let mut targets = vec![opts.pid];
    targets.extend(procfs::descendants(opts.pid));
    for &pid in &opts.more {
        for p in std::iter::once(pid).chain(procfs::descendants(pid)) {
            if !targets.contains(&p) {
                targets.push(p);
            }
        }
    }
    targets
}

/// The targets into the kernel's target set.
fn fill_target_map(ebpf: &mut Ebpf, targets: &[u32]) -> anyhow::Result<()> {
    let mut map: HashMap<_, u32, u8> = HashMap::try_from(ebpf.map_mut(probe_common::maps::TARGETS).context("TARGETS map missing")?)?;
    for &pid in targets {
        map.insert(pid, 1, 0).with_context(|| format!("cannot add pid {pid} to the target set"))?;
    }
    Ok(())
}

/// Verify and attach every wanted program, a thread per core: the kernel verifies programs in the
/// caller's thread, so on two cores this halves the longest stage of arming. A classic
/// tracepoint with a raw twin (`NAME_raw`) comes in a second round, only when its twin failed.
/// The engine's programs are attached on a thread of their own meanwhile ([`EngineDone`]).
fn attach_programs(
    ebpf: &mut Ebpf,
    opts: &Options,
    formats: FormatReads,
    targets: &[u32],
    koff: &probe_common::kernel::KernelOffsets,
    engine_search: EngineSearch,
) -> (Vec<Outcome>, EngineDone) {
    // Before the engine's thread starts registering uprobes ([`Formats`]).
    let formats = &formats.join();
    // The raw block programs read `struct request` at BTF offsets of their own (`blk_valid`).
    let offsets_known = |spec: &Spec| match (spec.subsystem, spec.how) {
        (Subsystem::Blockio, How::Raw(_)) => koff.blk_valid != 0,
        _ => koff.valid != 0,
    };
    let has_raw_twin = |spec: &Spec| TABLE.iter().any(|t| t.program == format!("{}_raw", spec.program) && wanted(opts, t.subsystem));
    let mut results: Vec<Outcome> = Vec::new();
    // The engine's programs are verified and attached on a thread of their own, beside the pool:
    // its first uprobe waits for an RCU grace period in the kernel (10-15 ms asleep), which the
    // pool's verification fills. Its programs leave the pool's set first.
    let mut progs: std::collections::HashMap<&str, &mut aya::programs::Program> = ebpf.programs_mut().collect();
    let mut engine_progs: std::collections::HashMap<&str, &mut aya::programs::Program> = std::collections::HashMap::new();
    if engine_search.is_some() {
        for name in crate::kernel::engine::PROGRAMS {
            if let Some((k, p)) = progs.remove_entry(name) {
                engine_progs.insert(k, p);
            }
        }
    }
    let engine = std::thread::scope(|scope| {
        let engine = engine_search.map(|search| {
            let mut progs = engine_progs;
            let job = move || {
                let t = std::time::Instant::now();
                let found = match search {
                    Ok(h) => h.join().unwrap_or_default(),
                    Err(_) => crate::kernel::engine::search(targets),
                };
                log::debug!("engine search joined at {:?}", t.elapsed());
                let a = crate::kernel::engine::attach(&mut progs, &found);
                (a, found.seen, t.elapsed().as_secs_f64() * 1e3)
            };
            std::thread::Builder::new().name("probe-engine".into()).spawn_scoped(scope, job)
        });
        // Round one verifies every program (the engine's uprobes attach meanwhile), then attaches
        // them once the engine's thread is done: a tracepoint attached while a uprobe registers
        // waits on the same kernel locks through its RCU grace periods (400-500 ms measured).
        let specs: Vec<&Spec> = TABLE.iter().filter(|s| wanted(opts, s.subsystem) && !has_raw_twin(s)).collect();
        let mut jobs = load_all(&mut progs, formats, &specs, targets, opts.sample_hz, &offsets_known);
        let engine = engine.map(|h| h.map(|h| h.join()));
        pool(&mut jobs, |j| j.attach(formats));
        results.extend(jobs.into_iter().flat_map(Job::results));
        // Round two: the classic twins of raw programs that did not attach.
        let specs: Vec<&Spec> = TABLE
            .iter()
            .filter(|s| wanted(opts, s.subsystem) && has_raw_twin(s))
            .filter(|s| !results.iter().any(|(r, ok, _)| r.program == format!("{}_raw", s.program) && ok.is_ok()))
            .collect();
        let mut jobs = load_all(&mut progs, formats, &specs, targets, opts.sample_hz, &offsets_known);
        pool(&mut jobs, |j| j.attach(formats));
        results.extend(jobs.into_iter().flat_map(Job::results));
        engine
    });
    (results, engine)
}

/// The engine subsystem's status from what its thread gave back; returns the files its search
/// looked at and what it took (ms).
fn engine_status(status: &mut [SubsystemStatus], engine: EngineDone) -> (Vec<crate::os::target_file::Ident>, Option<f64>) {
    let mut engine_seen = Vec::new();
    let mut results_ms_engine = None;
    match engine {
        Some(Ok(Ok((a, seen, ms)))) => {
            engine_seen = seen;
            if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Engine) {
                st.live = a.live;
                st.attached = a.attached;
                st.skipped = a.skipped;
            }
            results_ms_engine = Some(ms);
        }
        Some(Ok(Err(_))) => {
            if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Engine) {
                st.live = false;
                st.skipped.push("engine probes: the thread attaching them panicked".to_string());
            }
        }
        Some(Err(e)) => {
            if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Engine) {
                st.live = false;
                st.skipped.push(format!("engine probes: no thread to attach them on ({e})"));
            }
        }
        None => {}
    }
    (engine_seen, results_ms_engine)
}

/// Each program's outcome into its subsystem's status, in TABLE order (a required program that
/// did not attach takes its subsystem down); returns what each took (ms), the engine's uprobes
/// first.
fn program_status(status: &mut [SubsystemStatus], mut results: Vec<Outcome>, engine_ms: Option<f64>) -> Vec<(String, f64)> {
    let mut per_program: Vec<(String, f64)> = Vec::new();
    if let Some(ms) = engine_ms {
        per_program.push(("engine uprobes".to_string(), ms));
    }
    // In TABLE order, as before.
    results.sort_by_key(|(spec, _, _)| TABLE.iter().position(|t| t.program == spec.program));
    for (spec, result, ms) in results {
        per_program.push((spec.program.to_string(), ms));
        let st = status.iter_mut().find(|s| s.name == spec.subsystem).expect("subsystem in table");
        match result {
            Ok(()) => st.attached.push(spec.program.to_string()),
            Err(why) => {
                if spec.required {
                    st.live = false;
                }
                st.skipped.push(format!("{}: {why:#}", spec.program));
            }
        }
    }
    per_program
}

/// Without the kernel's struct offsets (`note` says why): files are named from /proc only, and the
/// stream subsystem cannot run.
fn no_offsets_status(status: &mut [SubsystemStatus], note: &str) {
    if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Mmap) {
        st.skipped.push(format!("file names in the kernel: {note}; files are named from /proc only"));
    }
    // Without the fd → socket walk there is no way to tell socket bytes from file bytes.
    if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Stream) {
        st.live = false;
        st.skipped.push(format!("needs struct offsets from kernel BTF: {note}"));
    }
}

/// Refuse the trace when a subsystem named with `--probes` cannot run, or when none can.
fn check_live(opts: &Options, status: &[SubsystemStatus]) -> anyhow::Result<()> {
    for st in status {
        if !st.live && opts.only.is_some() {
            bail!("probe `{}` cannot run here: {}", st.name, st.skipped.join("; "));
        }
    }
    if !status.iter().any(|s| s.live) {
        let why: Vec<String> = status.iter().flat_map(|s| s.skipped.clone()).collect();
        bail!("no probe could attach: {}", why.join("; "));
    }
    Ok(())
}

/// The three programs that took longest to verify and attach, as attach stages.
fn slowest(mut per_program: Vec<(String, f64)>) -> impl Iterator<Item = (String, f64)> {
    per_program.sort_by(|a, b| b.1.total_cmp(&a.1));
    per_program.into_iter().take(3).map(|(name, ms)| (format!("program {name}"), ms))
}

/// The kernel's struct offsets from its BTF, or zeros and why not.
/// The kernel's struct offsets, the note of what is missing, and whether they came from the cache.
fn kernel_offsets() -> (probe_common::kernel::KernelOffsets, Option<String>, bool) {
    use crate::os::kernel_cache;
    let key = kernel_cache::key();
    let dir = Path::new(crate::os::run_dir::DIR);
    if let Some(k) = kernel_cache::load(dir, &key) {
        return (k, None, true);
    }
    let (k, note) = match crate::os::btf::Btf::from_sys_fs() {
        Ok(Ok(btf)) => match btf.kernel_offsets() {
            Ok(k) => (k, None),
            Err(e) => (Default::default(), Some(format!("kernel BTF lacks a needed field ({e})"))),
        },
        Ok(Err(e)) => (Default::default(), Some(format!("kernel BTF unreadable ({e})"))),
        Err(e) => (Default::default(), Some(format!("no kernel BTF ({e})"))),
    };
    if note.is_none() {
        kernel_cache::store(dir, &key, &k);
    }
    (k, note, false)
}

/// The listening sockets of `pid` into the kernel's maps: their ports, and each socket by its
/// namespace, port and address (keyed under namespace 0 too, for a kernel whose layout does not
/// say a socket's namespace), so a neighbour on the same port is not taken for the target.
fn add_listeners(ebpf: &mut Ebpf, pid: u32) -> anyhow::Result<()> {
    use probe_common::sock::{AF_INET, AF_INET6, ListenKey};
    let socks = procfs::listen_sockets(pid);
    if socks.is_empty() {
        return Ok(());
    }
    let ns = procfs::netns(pid).and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
    {
        let mut ports: HashMap<_, u16, u8> =
            HashMap::try_from(ebpf.map_mut(probe_common::maps::LISTEN_PORTS).context("LISTEN_PORTS map missing")?)?;
        for a in &socks {
            let _ = ports.insert(a.port(), 1, 0);
        }
    }
    let mut addrs: HashMap<_, ListenKey, u8> =
        HashMap::try_from(ebpf.map_mut(probe_common::maps::LISTEN_ADDRS).context("LISTEN_ADDRS map missing")?)?;
    for a in &socks {
        let (family, bytes) = match a.ip() {
            std::net::IpAddr::V4(v4) => {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&v4.octets());
                (AF_INET, b)
            }
            std::net::IpAddr::V6(v6) => (AF_INET6, v6.octets()),
        };
        for n in [ns, 0] {
            let _ = addrs.insert(ListenKey::new(n, a.port(), family, &bytes), 1, 0);
        }
    }
    Ok(())
}

/// Add a process to a running trace (one that joined the traced cgroup without being forked by
/// a target: `docker exec`, a restarted server): the target set, the ports it listens on, and the
/// perf events of its threads for the perf programs that are attached. Its children are then
/// followed as every target's are.
/// Returns false, attaching nothing, for a pid the kernel already follows (a target's child:
/// the perf events its parent's threads inherit cover it; attaching again would count twice).
pub fn add_target(ebpf: &mut Ebpf, pid: u32, sample_hz: u64) -> anyhow::Result<bool> {
    {
        let mut map: HashMap<_, u32, u8> = HashMap::try_from(ebpf.map_mut(probe_common::maps::TARGETS).context("TARGETS map missing")?)?;
        if map.get(&pid, 0).is_ok() {
            return Ok(false);
        }
        map.insert(pid, 1, 0).with_context(|| format!("cannot add pid {pid} to the target set"))?;
    }
    add_listeners(ebpf, pid)?;
    for spec in TABLE {
        let (event, policy) = match spec.how {
            How::PerfMajorFaults => (SoftwareEvent::PageFaultsMaj, SamplePolicy::Period(1)),
            How::PerfCpuClock => (SoftwareEvent::CpuClock, SamplePolicy::Frequency(sample_hz)),
            _ => continue,
        };
        let Some(program) = ebpf.program_mut(spec.program) else { continue };
        let Ok(p) = <&mut PerfEvent>::try_from(program) else { continue };
        // Only programs attached at the start (loaded): a skipped probe stays skipped.
        if p.fd().is_err() {
            continue;
        }
        for tid in procfs::tasks(pid) {
            let _ = p.attach(PerfEventConfig::Software(event), PerfEventScope::OneProcess { pid: tid, cpu: None }, policy, true);
        }
    }
    Ok(true)
}
