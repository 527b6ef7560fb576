//! Loading probe's kernel object and attaching it from one table, feature-checked first.
//!
//! Every program belongs to a subsystem (blockio, fault, filemap, mmap, sock, proc). A program
//! that cannot attach here (tracepoint missing, layout differs, kernel refuses) is reported and
//! its subsystem skipped, unless the user named that subsystem with `--probes`: then it is an error.
use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::HashMap,
    programs::{
        PerfEvent, TracePoint,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
    },
};
use probe_common::tracepoints::{self as tp, Layout};

use crate::{os::procfs, os::tracefs};

/// The compiled kernel object, built by build.rs from probe-ebpf.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/probe"));

pub const SUBSYSTEMS: [Subsystem; 11] = Subsystem::ALL;

#[derive(Clone, Copy, Debug)]
enum How {
    /// A classic tracepoint whose fields are read at the offsets in `Layout`.
    Tracepoint(&'static Layout),
    /// A tracepoint whose fields are not read (only that it fired).
    Plain(&'static str, &'static str),
    /// syscalls:sys_enter_X / sys_exit_X: arguments at 16 + 8i, ret at 16.
    Syscall(&'static str),
    /// A raw tracepoint (arguments of the trace call; reads structs at offsets from BTF).
    Raw(&'static str),
    /// perf software event PAGE_FAULTS_MAJ, period 1, per thread of each target process.
    PerfMajorFaults,
    /// perf software event CPU_CLOCK at `Options::sample_hz`, per thread of each target process.
    PerfCpuClock,
}

#[derive(Clone, Copy, Debug)]
struct Spec {
    subsystem: Subsystem,
    program: &'static str,
    how: How,
    /// When false the subsystem still counts as live without it (e.g. insert: not every
    /// device uses an IO scheduler; mlock2: not every libc calls it).
    required: bool,
}

const fn s(subsystem: Subsystem, program: &'static str, how: How, required: bool) -> Spec {
    Spec { subsystem, program, how, required }
}

/// The attach table.
const TABLE: &[Spec] = &[
    s(Subsystem::Proc, "task_newtask", How::Tracepoint(&tp::task_newtask::LAYOUT), true),
    s(Subsystem::Proc, "sched_process_exec", How::Plain("sched", "sched_process_exec"), false),
    s(Subsystem::Proc, "sched_process_exit", How::Tracepoint(&tp::sched_process_exit::LAYOUT), true),
    s(Subsystem::Blockio, "block_io_start", How::Tracepoint(&tp::block_io_start::LAYOUT), false),
    s(Subsystem::Blockio, "block_rq_insert", How::Tracepoint(&tp::block_rq_insert::LAYOUT), false),
    s(Subsystem::Blockio, "block_rq_issue_raw", How::Raw("block_rq_issue"), false),
    s(Subsystem::Blockio, "block_rq_issue", How::Tracepoint(&tp::block_rq_issue::LAYOUT), true),
    s(Subsystem::Blockio, "block_rq_complete_raw", How::Raw("block_rq_complete"), false),
    s(Subsystem::Blockio, "block_rq_complete", How::Tracepoint(&tp::block_rq_complete::LAYOUT), true),
    s(Subsystem::Fault, "fault_major", How::PerfMajorFaults, true),
    s(Subsystem::Fault, "page_fault_user", How::Tracepoint(&tp::page_fault_user::LAYOUT), false),
    s(Subsystem::Filemap, "filemap_add", How::Tracepoint(&tp::mm_filemap_add_to_page_cache::LAYOUT), true),
    s(Subsystem::Mmap, "mmap_enter", How::Syscall("sys_enter_mmap"), true),
    s(Subsystem::Mmap, "mmap_exit", How::Syscall("sys_exit_mmap"), true),
    s(Subsystem::Mmap, "munmap_enter", How::Syscall("sys_enter_munmap"), true),
    s(Subsystem::Mmap, "munmap_exit", How::Syscall("sys_exit_munmap"), true),
    s(Subsystem::Mmap, "mremap_enter", How::Syscall("sys_enter_mremap"), false),
    s(Subsystem::Mmap, "mremap_exit", How::Syscall("sys_exit_mremap"), false),
    s(Subsystem::Mmap, "madvise_enter", How::Syscall("sys_enter_madvise"), false),
    s(Subsystem::Mmap, "madvise_exit", How::Syscall("sys_exit_madvise"), false),
    s(Subsystem::Mmap, "mlock_enter", How::Syscall("sys_enter_mlock"), false),
    s(Subsystem::Mmap, "mlock_exit", How::Syscall("sys_exit_mlock"), false),
    s(Subsystem::Mmap, "munlock_enter", How::Syscall("sys_enter_munlock"), false),
    s(Subsystem::Mmap, "munlock_exit", How::Syscall("sys_exit_munlock"), false),
    s(Subsystem::Mmap, "mlock2_enter", How::Syscall("sys_enter_mlock2"), false),
    s(Subsystem::Mmap, "mlock2_exit", How::Syscall("sys_exit_mlock2"), false),
    s(Subsystem::Mmap, "mprotect_enter", How::Syscall("sys_enter_mprotect"), false),
    s(Subsystem::Mmap, "mprotect_exit", How::Syscall("sys_exit_mprotect"), false),
    s(Subsystem::Sock, "inet_sock_set_state_raw", How::Raw("inet_sock_set_state"), false),
    s(Subsystem::Sock, "inet_sock_set_state", How::Tracepoint(&tp::inet_sock_set_state::LAYOUT), true),
    s(Subsystem::Sock, "tcp_receive_reset_raw", How::Raw("tcp_receive_reset"), false),
    s(Subsystem::Sock, "tcp_receive_reset", How::Tracepoint(&tp::tcp_receive_reset::LAYOUT), true),
    s(Subsystem::Sock, "tcp_send_reset_raw", How::Raw("tcp_send_reset"), false),
    s(Subsystem::Sock, "tcp_send_reset", How::Tracepoint(&tp::tcp_send_reset::LAYOUT), true),
    s(Subsystem::Sock, "sock_send_length", How::Tracepoint(&tp::sock_send_length::LAYOUT), false),
    s(Subsystem::Sock, "sock_recv_length", How::Tracepoint(&tp::sock_recv_length::LAYOUT), false),
    s(Subsystem::Sock, "sock_connect", How::Syscall("sys_enter_connect"), true),
    s(Subsystem::Sock, "sock_listen", How::Syscall("sys_enter_listen"), false),
    s(Subsystem::Sock, "sock_close", How::Syscall("sys_enter_close"), false),
    s(Subsystem::Cpu, "cpu_sample", How::PerfCpuClock, true),
    s(Subsystem::Offcpu, "sched_switch", How::Tracepoint(&tp::sched_switch::LAYOUT), true),
    s(Subsystem::Offcpu, "sched_waking_raw", How::Raw("sched_waking"), false),
    s(Subsystem::Offcpu, "sched_waking", How::Tracepoint(&tp::sched_waking::LAYOUT), false),
    s(Subsystem::Mem, "direct_reclaim_begin", How::Plain("vmscan", "mm_vmscan_direct_reclaim_begin"), true),
    s(Subsystem::Mem, "direct_reclaim_end", How::Tracepoint(&tp::mm_vmscan_direct_reclaim_end::LAYOUT), true),
    s(Subsystem::Mem, "memcg_reclaim_begin", How::Plain("vmscan", "mm_vmscan_memcg_reclaim_begin"), false),
    s(Subsystem::Mem, "memcg_reclaim_end", How::Tracepoint(&tp::mm_vmscan_memcg_reclaim_end::LAYOUT), false),
    s(Subsystem::Mem, "compaction_begin", How::Plain("compaction", "mm_compaction_begin"), false),
    s(Subsystem::Mem, "compaction_end", How::Tracepoint(&tp::mm_compaction_end::LAYOUT), false),
    s(Subsystem::Mem, "oom_mark_victim", How::Tracepoint(&tp::mark_victim::LAYOUT), false),
    s(Subsystem::Stream, "read_enter", How::Syscall("sys_enter_read"), true),
    s(Subsystem::Stream, "read_exit", How::Syscall("sys_exit_read"), true),
    s(Subsystem::Stream, "write_enter", How::Syscall("sys_enter_write"), true),
    s(Subsystem::Stream, "write_exit", How::Syscall("sys_exit_write"), true),
    s(Subsystem::Stream, "recvfrom_enter", How::Syscall("sys_enter_recvfrom"), true),
    s(Subsystem::Stream, "recvfrom_exit", How::Syscall("sys_exit_recvfrom"), true),
    s(Subsystem::Stream, "sendto_enter", How::Syscall("sys_enter_sendto"), true),
    s(Subsystem::Stream, "sendto_exit", How::Syscall("sys_exit_sendto"), true),
    s(Subsystem::Stream, "readv_enter", How::Syscall("sys_enter_readv"), false),
    s(Subsystem::Stream, "readv_exit", How::Syscall("sys_exit_readv"), false),
    s(Subsystem::Stream, "writev_enter", How::Syscall("sys_enter_writev"), false),
    s(Subsystem::Stream, "writev_exit", How::Syscall("sys_exit_writev"), false),
    s(Subsystem::Stream, "recvmsg_enter", How::Syscall("sys_enter_recvmsg"), false),
    s(Subsystem::Stream, "recvmsg_exit", How::Syscall("sys_exit_recvmsg"), false),
    s(Subsystem::Stream, "sendmsg_enter", How::Syscall("sys_enter_sendmsg"), false),
    s(Subsystem::Stream, "sendmsg_exit", How::Syscall("sys_exit_sendmsg"), false),
];

/// Programs whose code is another's, instruction for instruction (a syscall's exit reads what its
/// enter kept, whichever syscall it was): the first is verified once and attached to the others'
/// tracepoints as well. Each keeps its name in what attached.
const SAME_CODE: &[(&str, &[&str])] = &[
    ("read_exit", &["write_exit", "recvfrom_exit", "sendto_exit", "readv_exit", "writev_exit", "recvmsg_exit", "sendmsg_exit"]),
    ("mmap_exit", &["munmap_exit", "mremap_exit", "madvise_exit", "mlock_exit", "munlock_exit", "mlock2_exit", "mprotect_exit"]),
];

/// The program whose loaded code `program` runs on, when that is another's (`SAME_CODE`).
fn code_of(program: &str) -> Option<&'static str> {
    SAME_CODE.iter().find(|(_, same)| same.contains(&program)).map(|(first, _)| *first)
}

pub use crate::record::records::{Subsystem, SubsystemStatus};

pub struct Attached {
    pub ebpf: Ebpf,
    pub status: Vec<SubsystemStatus>,
    /// The processes traced from the start: the target and its live descendants.
    pub targets: Vec<u32>,
    /// Keeps the kernel counting the programs' run time while it is open; why not, when not.
    pub run_time_stats: Result<std::os::fd::OwnedFd, String>,
    /// What attaching took, stage by stage (ms), the slowest programs last.
    pub stages: Vec<(String, f64)>,
    /// Executable files the engine probe already searched (a later mapping of another is searched
    /// as it appears: a runner started after attach, a library loaded later).
    pub engine_seen: Vec<crate::os::target_file::Ident>,
}

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
    /// More processes traced from the start with their descendants (a cgroup's other members).
    pub more: Vec<u32>,
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

/// Check, load and attach everything for `opts.pid`. On error nothing stays loaded: the `Ebpf`
/// owns every program, map and link and is dropped.
pub fn attach(opts: &Options) -> anyhow::Result<Attached> {
    let mut laps = Laps { at: std::time::Instant::now(), stages: Vec::new() };
    preflight(opts)?;
    let tracefs = tracefs::ensure_mounted().map_err(|e| anyhow!(e))?;
    raise_memlock();
    let run_time_stats = enable_run_time_stats();
    laps.lap("preflight");
    // The engine probe's search reads the target's objects (/proc, ELF string tables): on a
    // thread of its own while the kernel programs load and verify.
    let want_engine = opts.only.as_ref().is_none_or(|o| o.iter().any(|n| n == Subsystem::Engine.name()));
    let engine_search = want_engine.then(|| {
        let pids: Vec<u32> = std::iter::once(opts.pid).chain(procfs::descendants(opts.pid)).chain(opts.more.iter().copied()).collect();
        std::thread::Builder::new().name("probe-engine".into()).spawn(move || crate::kernel::engine::search(&pids))
    });

    // Struct offsets for naming the file behind an fd; without BTF the mmap probe still runs
    // and files are named from /proc alone. Kept from the last trace on this kernel (`/run/probe`)
    // or read from BTF now; aya's loader does not read BTF for an object without CO-RE relocations.
    let (koff, koff_note, cached) = kernel_offsets();
    let mut loader = EbpfLoader::new();
    laps.lap(if cached { "kernel_btf (cached)" } else { "kernel_btf" });
    let mut ebpf = loader
        .map_max_entries(probe_common::maps::EVENTS, opts.ring_bytes)
        .override_global(probe_common::kernel::KOFF_SYMBOL, &koff, true)
        .override_global(probe_common::kernel::OFFCPU_D_ONLY_SYMBOL, &u32::from(opts.offcpu_d_only), true)
        .override_global(probe_common::kernel::PERF_PER_CPU_SYMBOL, &u32::from(in_own_pid_namespace()), true)
        .load(OBJECT)
        .context("the kernel refused probe's BPF object (needs Linux >= 5.8 with BPF ring buffers and BTF)")?;

    laps.lap("object_load");
    let mut targets = vec![opts.pid];
    targets.extend(procfs::descendants(opts.pid));
    for &pid in &opts.more {
        for p in std::iter::once(pid).chain(procfs::descendants(pid)) {
            if !targets.contains(&p) {
                targets.push(p);
            }
        }
    }
    laps.lap("descendants");
    {
        let mut map: HashMap<_, u32, u8> = HashMap::try_from(ebpf.map_mut(probe_common::maps::TARGETS).context("TARGETS map missing")?)?;
        for &pid in &targets {
            map.insert(pid, 1, 0).with_context(|| format!("cannot add pid {pid} to the target set"))?;
        }
    }
    laps.lap("target_map");
    for &pid in &targets {
        add_listeners(&mut ebpf, pid)?;
    }

    laps.lap("listen_ports");
    let wanted = |sub: Subsystem| opts.only.as_ref().is_none_or(|o| o.iter().any(|n| n == sub.name()));
    let mut status: Vec<SubsystemStatus> = SUBSYSTEMS
        .iter()
        .filter(|s| wanted(**s))
        .map(|s| SubsystemStatus { name: *s, live: true, attached: vec![], skipped: vec![] })
        .collect();
    // Verify and attach every program, a thread per core: the kernel verifies programs in the
    // caller's thread, so on two cores this halves the longest stage of arming. A classic
    // tracepoint with a raw twin (`NAME_raw`) comes in a second round, only when its twin failed.
    let offsets_known = |spec: &Spec| match spec.program {
        "block_rq_complete_raw" | "block_rq_issue_raw" => koff.blk_valid != 0,
        _ => koff.valid != 0,
    };
    let has_raw_twin = |spec: &Spec| TABLE.iter().any(|t| t.program == format!("{}_raw", spec.program) && wanted(t.subsystem));
    let mut results: Vec<(&Spec, anyhow::Result<()>, f64)> = Vec::new();
    let mut results_ms_engine = None;
    let mut engine_seen = Vec::new();
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
    std::thread::scope(|scope| {
        let engine = engine_search.map(|search| {
            let targets = &targets;
            let mut progs = engine_progs;
            let job = move || {
                let t = std::time::Instant::now();
                let found = match search {
                    Ok(h) => h.join().unwrap_or_default(),
                    Err(_) => crate::kernel::engine::search(targets),
                };
                let a = crate::kernel::engine::attach(&mut progs, &found);
                (a, found.seen, t.elapsed().as_secs_f64() * 1e3)
            };
            std::thread::Builder::new().name("probe-engine".into()).spawn_scoped(scope, job)
        });
        // Round one verifies every program (the engine's uprobes attach meanwhile), then attaches
        // them once the engine's thread is done: a tracepoint attached while a uprobe registers
        // waits on the same kernel locks through its RCU grace periods (400-500 ms measured).
        let specs: Vec<&Spec> = TABLE.iter().filter(|s| wanted(s.subsystem) && !has_raw_twin(s)).collect();
        let mut jobs = load_all(&mut progs, &tracefs, &specs, &targets, opts.sample_hz, &offsets_known);
        let engine = engine.map(|h| h.map(|h| h.join()));
        pool(&mut jobs, |j| j.attach(&tracefs));
        results.extend(jobs.into_iter().flat_map(Job::results));
        // Round two: the classic twins of raw programs that did not attach.
        let specs: Vec<&Spec> = TABLE
            .iter()
            .filter(|s| wanted(s.subsystem) && has_raw_twin(s))
            .filter(|s| !results.iter().any(|(r, ok, _)| r.program == format!("{}_raw", s.program) && ok.is_ok()))
            .collect();
        let mut jobs = load_all(&mut progs, &tracefs, &specs, &targets, opts.sample_hz, &offsets_known);
        pool(&mut jobs, |j| j.attach(&tracefs));
        results.extend(jobs.into_iter().flat_map(Job::results));
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
    });
    let mut per_program: Vec<(String, f64)> = Vec::new();
    if let Some(ms) = results_ms_engine {
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
    if let Some(note) = koff_note {
        if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Mmap) {
            st.skipped.push(format!("file names in the kernel: {note}; files are named from /proc only"));
        }
        // Without the fd → socket walk there is no way to tell socket bytes from file bytes.
        if let Some(st) = status.iter_mut().find(|s| s.name == Subsystem::Stream) {
            st.live = false;
            st.skipped.push(format!("needs struct offsets from kernel BTF: {note}"));
        }
    }
    for st in &status {
        if !st.live && opts.only.is_some() {
            bail!("probe `{}` cannot run here: {}", st.name, st.skipped.join("; "));
        }
    }
    if !status.iter().any(|s| s.live) {
        let why: Vec<String> = status.iter().flat_map(|s| s.skipped.clone()).collect();
        bail!("no probe could attach: {}", why.join("; "));
    }
    laps.lap("programs");
    // The three programs that took longest to verify and attach.
    per_program.sort_by(|a, b| b.1.total_cmp(&a.1));
    laps.stages.extend(per_program.into_iter().take(3).map(|(name, ms)| (format!("program {name}"), ms)));
    Ok(Attached { ebpf, status, targets, run_time_stats, stages: laps.stages, engine_seen })
}

/// The kernel's struct offsets from its BTF, or zeros and why not.
/// The kernel's struct offsets, the note of what is missing, and whether they came from the cache.
fn kernel_offsets() -> (probe_common::kernel::KernelOffsets, Option<String>, bool) {
    use crate::os::kernel_cache;
    let key = kernel_cache::key();
    let dir = Path::new(kernel_cache::DIR);
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

/// One program of the table on its way to attached: verified (and, for a perf program, attached
/// to the target's threads) by [`load_all`], attached by [`Job::attach`], with the programs that
/// run its code (`SAME_CODE`).
struct Job<'s, 'p> {
    spec: &'s Spec,
    program: Option<&'p mut aya::programs::Program>,
    same: Vec<(&'s Spec, anyhow::Result<()>, f64)>,
    result: anyhow::Result<()>,
    ms: f64,
}

impl<'s> Job<'s, '_> {
    fn load(&mut self, tracefs: &Path, targets: &[u32], sample_hz: u64, offsets_known: &(dyn Fn(&Spec) -> bool + Sync)) {
        let t = std::time::Instant::now();
        self.result = match self.program.as_deref_mut() {
            None => Err(anyhow!("program missing from the object")),
            Some(_) if matches!(self.spec.how, How::Raw(_)) && !offsets_known(self.spec) => {
                Err(anyhow!("kernel BTF lacks the struct offsets it reads"))
            }
            Some(p) => load_one(p, tracefs, self.spec, targets, sample_hz),
        };
        self.ms += t.elapsed().as_secs_f64() * 1e3;
    }

    fn attach(&mut self, tracefs: &Path) {
        let t = std::time::Instant::now();
        let Some(p) = self.program.as_deref_mut() else {
            // Its result says why already; the programs running its code did not attach either.
            for (_, r, _) in &mut self.same {
                *r = Err(anyhow!("runs {}'s code, which is missing from the object", self.spec.program));
            }
            return;
        };
        if self.result.is_ok() {
            self.result = attach_point(p, self.spec.how);
        }
        self.ms += t.elapsed().as_secs_f64() * 1e3;
        for (other, r, ms) in &mut self.same {
            let t = std::time::Instant::now();
            *r = match &self.result {
                Ok(()) => check_point(tracefs, other.how).and_then(|()| attach_point(p, other.how)),
                Err(e) => Err(anyhow!("runs {}'s code, which did not attach: {e:#}", self.spec.program)),
            };
            *ms += t.elapsed().as_secs_f64() * 1e3;
        }
    }

    fn results(self) -> impl Iterator<Item = (&'s Spec, anyhow::Result<()>, f64)> {
        std::iter::once((self.spec, self.result, self.ms)).chain(self.same)
    }
}

/// Run `f` on every item, on as many threads as there are cores (each takes the next item from a
/// shared queue; the calling thread too, so a thread that cannot be made costs nothing but time).
fn pool<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    let queue = std::sync::Mutex::new(items.iter_mut());
    let work = || {
        loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some(item) = next else { break };
            f(item);
        }
    };
    let helpers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8) - 1;
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            if let Err(e) = std::thread::Builder::new().name("probe-attach".into()).spawn_scoped(scope, work) {
                log::debug!("no thread to attach on ({e})");
            }
        }
        work();
    });
}

/// Verify `specs` on the pool's threads (the kernel verifies a program in the caller's thread,
/// so on two cores this halves the longest stage of arming): a job each, the programs that run
/// another's code (`SAME_CODE`) in that one's job.
fn load_all<'s, 'p>(
    progs: &mut std::collections::HashMap<&str, &'p mut aya::programs::Program>,
    tracefs: &Path,
    specs: &[&'s Spec],
    targets: &[u32],
    sample_hz: u64,
    offsets_known: &(dyn Fn(&Spec) -> bool + Sync),
) -> Vec<Job<'s, 'p>> {
    let in_specs = |name: &str| specs.iter().any(|s| s.program == name);
    let mut jobs: Vec<Job<'s, 'p>> = Vec::new();
    for spec in specs.iter().copied() {
        if code_of(spec.program).is_some_and(in_specs) {
            continue;
        }
        let same = specs.iter().copied().filter(|s| code_of(s.program) == Some(spec.program)).map(|s| (s, Ok(()), 0.0)).collect();
        jobs.push(Job { spec, program: progs.remove(spec.program), same, result: Ok(()), ms: 0.0 });
    }
    // The perf programs first: the first event bound to a task waits for an RCU grace period in
    // the kernel (perf_sched_events, 10-20 ms asleep), which the other threads fill.
    jobs.sort_by_key(|j| !matches!(j.spec.how, How::PerfMajorFaults | How::PerfCpuClock));
    pool(&mut jobs, |j| j.load(tracefs, targets, sample_hz, offsets_known));
    jobs
}

/// Check that `how`'s tracepoint exists with the layout the program reads.
fn check_point(tracefs: &Path, how: How) -> anyhow::Result<()> {
    match how {
        How::Tracepoint(layout) => {
            let fmt = tracefs::format(tracefs, layout.group, layout.name).map_err(|e| anyhow!(e))?;
            if let Some(why) = tracefs::check_layout(layout, &fmt) {
                bail!("{}:{} layout differs from what probe was built for: {why}", layout.group, layout.name);
            }
        }
        How::Plain(group, name) => {
            tracefs::format(tracefs, group, name).map_err(|e| anyhow!(e))?;
        }
        How::Syscall(name) => {
            let fmt = tracefs::format(tracefs, "syscalls", name).map_err(|e| anyhow!(e))?;
            let ok = tracefs::parse_format(&fmt).iter().any(|f| f.offset == tp::SYSCALL_ARG0 && f.size == 8);
            if !ok {
                bail!("syscalls:{name} has no 8-byte field at offset {}", tp::SYSCALL_ARG0);
            }
        }
        How::Raw(_) | How::PerfMajorFaults | How::PerfCpuClock => {}
    }
    Ok(())
}

/// Check and verify one program; a perf program is attached too (to each thread of the targets).
fn load_one(program: &mut aya::programs::Program, tracefs: &Path, spec: &Spec, targets: &[u32], sample_hz: u64) -> anyhow::Result<()> {
    check_point(tracefs, spec.how)?;
    match spec.how {
        How::Tracepoint(_) | How::Plain(..) | How::Syscall(_) => {
            let p: &mut TracePoint = program.try_into()?;
            p.load().context("verifier refused the program")?;
        }
        How::Raw(_) => {
            let p: &mut aya::programs::RawTracePoint = program.try_into()?;
            p.load().context("verifier refused the program")?;
        }
        How::PerfMajorFaults => per_thread(program, targets, SoftwareEvent::PageFaultsMaj, SamplePolicy::Period(1))?,
        How::PerfCpuClock => per_thread(program, targets, SoftwareEvent::CpuClock, SamplePolicy::Frequency(sample_hz))?,
    }
    Ok(())
}

/// Attach a verified program to its tracepoint (a perf program is attached already).
fn attach_point(program: &mut aya::programs::Program, how: How) -> anyhow::Result<()> {
    match how {
        How::Tracepoint(layout) => {
            let p: &mut TracePoint = program.try_into()?;
            p.attach(layout.group, layout.name)?;
        }
        How::Plain(group, name) => {
            let p: &mut TracePoint = program.try_into()?;
            p.attach(group, name)?;
        }
        How::Syscall(name) => {
            let p: &mut TracePoint = program.try_into()?;
            p.attach("syscalls", name)?;
        }
        How::Raw(name) => {
            let p: &mut aya::programs::RawTracePoint = program.try_into()?;
            p.attach(name)?;
        }
        How::PerfMajorFaults | How::PerfCpuClock => {}
    }
    Ok(())
}

/// Add a process to a running trace (one that joined the traced cgroup without being forked by
/// a target: `docker exec`, a restarted server): the target set, the ports it listens on, and the
/// perf events of its threads for the perf programs that are attached. Its children are then
/// followed as every target's are.
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

/// Attach a perf_event program to every thread of every target process, inherited by threads
/// and children created later (perf follows them from the thread that creates them).
fn per_thread(program: &mut aya::programs::Program, targets: &[u32], event: SoftwareEvent, policy: SamplePolicy) -> anyhow::Result<()> {
    let p: &mut PerfEvent = program.try_into()?;
    p.load().context("verifier refused the program")?;
    let (mut n, mut last_err) = (0, None);
    for &pid in targets {
        for tid in procfs::tasks(pid) {
            // A thread that exits between listing and opening is fine to miss.
            match p.attach(PerfEventConfig::Software(event), PerfEventScope::OneProcess { pid: tid, cpu: None }, policy, true) {
                Ok(_) => n += 1,
                Err(e) => last_err = Some(e),
            }
        }
    }
    if n == 0 && in_own_pid_namespace() {
        // probe runs in a PID namespace of its own (a container) with the host's /proc: perf
        // cannot name the host's threads from there. Watch every CPU instead; the program keeps
        // the targets' samples only.
        let cpus = online_cpus();
        for cpu in &cpus {
            match p.attach(PerfEventConfig::Software(event), PerfEventScope::AllProcessesOneCpu { cpu: *cpu }, policy, true) {
                Ok(_) => n += 1,
                Err(e) => last_err = Some(e),
            }
        }
        log::info!("perf {event:?}: attached on {n} of {} CPUs (probe is in a PID namespace of its own)", cpus.len());
    }
    if n == 0 {
        return match last_err {
            Some(e) => Err(anyhow::Error::new(e).context(format!("perf_event_open({event:?}) failed"))),
            None => bail!("no thread of the target could be watched"),
        };
    }
    Ok(())
}

/// probe runs in a PID namespace of its own while reading the host's /proc (a container
/// started without `--pid=host`): the pids it reads are not the ones perf takes.
fn in_own_pid_namespace() -> bool {
    crate::os::procfs::self_pid() != std::process::id()
}

/// The online CPUs (/sys/devices/system/cpu/online: `0-3,5`).
fn online_cpus() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b.min(a + 4096));
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// What the kernel counts for one loaded program (`struct bpf_prog_info`): runs and run time
/// (counted only while bpf_stats is on: [`enable_run_time_stats`]), and runs it skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProgRuns {
    pub runs: u64,
    pub run_ns: u64,
    /// Runs skipped because a BPF program was already running on that CPU
    /// (`recursion_misses`, Linux 5.12+): events lost before they were made.
    pub skipped: u64,
}

/// [`ProgRuns`] of every loaded program, by name (cumulative since load).
pub fn prog_runs(ebpf: &Ebpf) -> std::collections::BTreeMap<String, ProgRuns> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// Offsets in `struct bpf_prog_info` (include/uapi/linux/bpf.h).
    const RUN_TIME_NS: usize = 192;
    const RUN_CNT: usize = 200;
    const RECURSION_MISSES: usize = 208;
    #[repr(C, align(8))]
    struct Info([u8; 256]);
    #[repr(C)]
    struct Attr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut out = std::collections::BTreeMap::new();
    for (name, prog) in ebpf.programs() {
        let Ok(fd) = prog.fd() else { continue };
        let mut info = Info([0; 256]);
        let mut attr = Attr { bpf_fd: fd.as_fd().as_raw_fd() as u32, info_len: 256, info: info.0.as_mut_ptr() as u64 };
        // SAFETY: BPF_OBJ_GET_INFO_BY_FD writes at most info_len bytes into `info` and the
        // written length into attr.info_len; both live for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, &mut attr as *mut Attr, std::mem::size_of::<Attr>()) };
        if rc != 0 {
            continue;
        }
        let len = attr.info_len as usize;
        let at = |off: usize| -> u64 {
            if len < off + 8 {
                return 0;
            }
            u64::from_ne_bytes(info.0[off..off + 8].try_into().expect("8 bytes"))
        };
        out.insert(name.to_string(), ProgRuns { runs: at(RUN_CNT), run_ns: at(RUN_TIME_NS), skipped: at(RECURSION_MISSES) });
    }
    out
}

/// Runs each program skipped ([`ProgRuns::skipped`]); programs with none are left out.
pub fn skipped_runs(runs: &std::collections::BTreeMap<String, ProgRuns>) -> std::collections::BTreeMap<String, u64> {
    runs.iter().filter(|(_, r)| r.skipped > 0).map(|(k, r)| (k.clone(), r.skipped)).collect()
}

/// Turn on the kernel's per-program run-time counting (BPF_ENABLE_STATS, Linux 5.8+) for as long
/// as the returned fd is open: what each program costs, for the report's `cost` section. It adds
/// two clock reads to every program run (tens of ns), and ends with probe, whatever way it ends.
pub fn enable_run_time_stats() -> Result<std::os::fd::OwnedFd, String> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| format!("bpf_stats not enabled ({e})"))
}

/// Detach and unload every program, all at once: closing a classic tracepoint's last perf
/// event waits for the kernel's RCU grace periods (30 ms idle, 500 ms under load, one
/// tracepoint after another), which made a stop take seconds (4.2 s for 64 programs on an idle
/// 2-CPU VM; 138 ms in parallel). Maps taken out of the `Ebpf` before stay.
/// The off switch, thrown the moment the trace stops: the target set is emptied, so every program
/// that asks whether the current task is traced (all but the socket and wake-up ones, which look
/// up maps of the target's own sockets and threads) returns at once and produces nothing more.
pub fn switch_off(ebpf: &mut Ebpf) {
    let Some(m) = ebpf.map_mut(probe_common::maps::TARGETS) else { return };
    let Ok(mut map) = HashMap::<_, u32, u8>::try_from(m) else { return };
    let pids: Vec<u32> = map.keys().filter_map(Result::ok).collect();
    for pid in pids {
        let _ = map.remove(&pid);
    }
}

/// Hand the programs to a child process that lets them go once probe has exited: closing a
/// classic tracepoint waits for an RCU grace period, one after another (about 2 s for 66
/// programs on a 2-CPU VM), and the process that closes the last descriptor of each pays for it.
/// The child holds the same descriptors and waits for probe's end (a pipe only probe holds open),
/// then exits, and the kernel detaches everything. probe itself exits at once; kill -9 of either
/// still leaves nothing attached. Without a child (fork refused), they are detached here.
pub fn hand_off(attached: Attached) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return detach(attached);
    }
    // SAFETY: the child calls only async-signal-safe functions (close, read, _exit).
    match unsafe { libc::fork() } {
        0 => {
            // The child: let go of the terminal and of probe's output pipes (whoever reads them
            // sees their end with probe's), wait for probe to exit (the pipe's write end closes),
            // then exit.
            // SAFETY: plain descriptor calls on descriptors this process owns.
            unsafe {
                for fd in [0, 1, 2, fds[1]] {
                    libc::close(fd);
                }
                let mut b = 0u8;
                while libc::read(fds[0], (&raw mut b).cast(), 1) != 0 {}
                libc::_exit(0);
            }
        }
        -1 => {
            // SAFETY: closing the pipe this function made.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            detach(attached)
        }
        child => {
            log::info!("programs handed to pid {child}, detached when probe exits");
            // SAFETY: the read end is the child's.
            unsafe { libc::close(fds[0]) };
            // Our descriptors close with the process; the child's are the last ones.
            std::mem::forget(attached);
        }
    }
}

pub fn detach(attached: Attached) {
    let Attached { mut ebpf, .. } = attached;
    let t = std::time::Instant::now();
    let progs: Vec<(&str, &mut aya::programs::Program)> = ebpf.programs_mut().collect();
    let n = progs.len();
    std::thread::scope(|s| {
        for (name, p) in progs {
            // A program whose thread cannot be made is detached with the `Ebpf` below.
            let spawned = std::thread::Builder::new().name("probe-detach".into()).spawn_scoped(s, move || {
                let t = std::time::Instant::now();
                unload(p);
                log::debug!("detached {name} in {:?}", t.elapsed());
            });
            if let Err(e) = spawned {
                log::debug!("no thread to detach {name} ({e})");
            }
        }
    });
    drop(ebpf);
    log::info!("{n} programs detached in {:?}", t.elapsed());
}

fn unload(p: &mut aya::programs::Program) {
    use aya::programs::Program as P;
    let _ = match p {
        P::TracePoint(p) => p.unload(),
        P::RawTracePoint(p) => p.unload(),
        P::PerfEvent(p) => p.unload(),
        _ => Ok(()),
    };
}
