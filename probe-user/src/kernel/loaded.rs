//! Probe's programs once loaded: what the kernel counts for each (runs, run time, runs skipped),
//! and their end: the off switch, the hand-off to a child, the detach.
use aya::{Ebpf, maps::HashMap};

use crate::record::records::SubsystemStatus;

/// What [`attach`](super::probes::attach) made: the loaded object with its programs attached, and what
/// attached of each subsystem.
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
    /// The kept set of verified programs this trace holds (`super::kept`), until its programs are
    /// detached.
    pub kept: Option<super::kept::Kept>,
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

/// [`ProgRuns`] of every loaded program, by name: since this process loaded it, or took it from
/// the kept set ([`note_taken`]).
pub fn prog_runs(ebpf: &Ebpf) -> std::collections::BTreeMap<String, ProgRuns> {
    let taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = std::collections::BTreeMap::new();
    for (name, prog) in ebpf.programs() {
        let Ok(fd) = prog.fd() else { continue };
        let Some((id, r)) = runs_of(fd) else { continue };
        let base = taken.get(&id).copied().unwrap_or_default();
        let r = ProgRuns {
            runs: r.runs.saturating_sub(base.runs),
            run_ns: r.run_ns.saturating_sub(base.run_ns),
            skipped: r.skipped.saturating_sub(base.skipped),
        };
        out.insert(name.to_string(), r);
    }
    out
}

/// What the programs taken from the kept set had counted when taken, by program id: earlier
/// traces' runs, not this one's.
static TAKEN: std::sync::Mutex<std::collections::BTreeMap<u32, ProgRuns>> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// A program taken from the kept set: its counts so far are not this trace's.
pub(crate) fn note_taken(fd: &aya::programs::ProgramFd) {
    if let Some((id, r)) = runs_of(fd) {
        TAKEN.lock().unwrap_or_else(|e| e.into_inner()).insert(id, r);
    }
}

/// A program's id and its counts since it was loaded (`struct bpf_prog_info`).
fn runs_of(fd: &aya::programs::ProgramFd) -> Option<(u32, ProgRuns)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// Offsets in `struct bpf_prog_info` (include/uapi/linux/bpf.h).
    const ID: usize = 4;
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
    let mut info = Info([0; 256]);
    let mut attr = Attr { bpf_fd: fd.as_fd().as_raw_fd() as u32, info_len: 256, info: info.0.as_mut_ptr() as u64 };
    // SAFETY: BPF_OBJ_GET_INFO_BY_FD writes at most info_len bytes into `info` and the written
    // length into attr.info_len; both live for the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, &mut attr as *mut Attr, std::mem::size_of::<Attr>()) };
    if rc != 0 {
        return None;
    }
    let len = attr.info_len as usize;
    let at = |off: usize| -> u64 {
        if len < off + 8 {
            return 0;
        }
        u64::from_ne_bytes(info.0[off..off + 8].try_into().expect("8 bytes"))
    };
    let id = u32::from_ne_bytes(info.0[ID..ID + 4].try_into().expect("4 bytes"));
    Some((id, ProgRuns { runs: at(RUN_CNT), run_ns: at(RUN_TIME_NS), skipped: at(RECURSION_MISSES) }))
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

/// The lock an arming trace holds exclusively while it arms, and an earlier trace's hand-off child
/// holds shared while it closes one descriptor ([`hand_off`]).
const ATTACH_LOCK: &std::ffi::CStr = c"attach.lock";
/// The lock an arming trace holds exclusively from before it asks for [`ATTACH_LOCK`]: a hand-off
/// child closes nothing more while it is held (flock is not fair: children taking the shared
/// lock one after another would keep an exclusive waiter out).
const ARMING_LOCK: &std::ffi::CStr = c"arming.lock";

/// The arming lock and the attach lock, opened (None: no lock files: a /run/probe that is not
/// ours, a read-only /run).
pub(crate) fn teardown_locks() -> (Option<std::fs::File>, Option<std::fs::File>) {
    let dir = std::path::Path::new(crate::os::run_dir::DIR);
    (crate::os::run_dir::lock_file(dir, ARMING_LOCK), crate::os::run_dir::lock_file(dir, ATTACH_LOCK))
}

/// Hand the programs to a child process that lets them go once probe has exited: closing a
/// classic tracepoint waits for an RCU grace period, one after another (about 2 s for 66
/// programs on a 2-CPU VM), and the process that closes the last descriptor of each pays for it.
/// The child holds the same descriptors and waits for probe's end (a pipe only probe holds open),
/// then closes them one by one, each holding the attach lock shared
/// ([`ATTACH_LOCK`]), and exits. A tracepoint's or uprobe's teardown
/// holds the kernel's `event_mutex` through its grace periods, which a trace arming meanwhile
/// needs (to read a tracepoint's format, register a uprobe, attach a tracepoint): it waited for
/// the whole teardown, armed in 0.4-3 s where it took 0.1 (a trace started within 3 s of the last,
/// as the tests and the demo do). An arming trace holds the arming lock and then the attach lock
/// exclusively, so children pause between two descriptors until it has armed: it waits for the
/// closes in flight, one per child. Children of several traces close side by side. probe itself exits at
/// once; kill -9 of either still leaves nothing attached. Without a child (fork refused), they are
/// detached here.
pub fn hand_off(attached: Attached) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return detach(attached);
    }
    // Made before the fork: after it, the child calls only async-signal-safe functions.
    let (arming, attach) = teardown_locks();
    let raw = |f: &Option<std::fs::File>| f.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
    let (arming_fd, attach_fd) = (raw(&arming), raw(&attach));
    // The kept set's lock stays with the child to its exit: the next trace takes the set once
    // nothing of this one is attached.
    let kept_fd = attached.kept.as_ref().map_or(-1, super::kept::Kept::lock_fd);
    let (held, others) = descriptors(&[fds[0], fds[1], arming_fd, attach_fd, kept_fd]);
    // SAFETY: the child calls only async-signal-safe functions (close, read, flock, nanosleep,
    // _exit) and reads errno.
    match unsafe { libc::fork() } {
        0 => {
            // The child: let go of the terminal, of probe's output pipes (whoever reads them sees
            // their end with probe's) and of every other file (the recording's: its disk can be
            // unmounted once probe has exited), wait for probe to exit (the pipe's write end
            // closes), then close the kernel objects one by one.
            // SAFETY: plain descriptor calls on descriptors this process owns.
            unsafe {
                for fd in [0, 1, 2, fds[1]].into_iter().chain(others.iter().copied()) {
                    libc::close(fd);
                }
                let mut b = 0u8;
                while libc::read(fds[0], (&raw mut b).cast(), 1) > 0 {}
                // A trace arming holds the arming lock: nothing is closed meanwhile (it is tried
                // every 5 ms); each close holds the attach lock shared, so the arming trace
                // waits for the closes in flight, one each at most. Children close side by side.
                let pause = || {
                    let t = libc::timespec { tv_sec: 0, tv_nsec: 5_000_000 };
                    libc::nanosleep(&t, std::ptr::null_mut());
                };
                // Taken (or found unusable) within a bounded wait: false where it cannot be.
                let take = |fd: i32, how: i32| -> bool {
                    if fd < 0 {
                        return false;
                    }
                    for _ in 0..400 {
                        if libc::flock(fd, how | libc::LOCK_NB) == 0 {
                            return true;
                        }
                        let e = *libc::__errno_location();
                        if e != libc::EWOULDBLOCK && e != libc::EINTR {
                            return false;
                        }
                        pause();
                    }
                    false
                };
                for &fd in &held {
                    if take(arming_fd, libc::LOCK_SH) {
                        libc::flock(arming_fd, libc::LOCK_UN);
                    }
                    let locked = take(attach_fd, libc::LOCK_SH);
                    libc::close(fd);
                    if locked {
                        libc::flock(attach_fd, libc::LOCK_UN);
                    }
                }
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

/// The descriptors of this process but `keep`: those that hold kernel objects a trace made (BPF
/// programs, maps and links, perf events), and the others.
fn descriptors(keep: &[i32]) -> (Vec<i32>, Vec<i32>) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return (Vec::new(), Vec::new()) };
    let listed: Vec<(i32, String)> = dir
        .filter_map(Result::ok)
        .filter_map(|e| {
            let fd: i32 = e.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(e.path()).map(|t| t.to_string_lossy().into_owned()).unwrap_or_default();
            Some((fd, target))
        })
        .filter(|(fd, _)| *fd > 2 && !keep.contains(fd))
        .collect();
    // The directory's own descriptor is listed and closed by now: closing it in the child is a
    // harmless EBADF (nothing opens a descriptor there to take its number).
    let kernel = |t: &str| t.starts_with("anon_inode:bpf") || t == "anon_inode:[perf_event]";
    let held = listed.iter().filter(|(_, t)| kernel(t)).map(|(fd, _)| *fd).collect();
    let others = listed.iter().filter(|(_, t)| !kernel(t)).map(|(fd, _)| *fd).collect();
    (held, others)
}

/// Detach and unload every program, all at once: closing a classic tracepoint's last perf
/// event waits for the kernel's RCU grace periods (30 ms idle, 500 ms under load, one
/// tracepoint after another), which made a stop take seconds (4.2 s for 64 programs on an idle
/// 2-CPU VM; 138 ms in parallel). Maps taken out of the `Ebpf` before stay.
pub fn detach(attached: Attached) {
    // The kept set's lock goes last, once nothing is attached.
    let Attached { mut ebpf, kept, .. } = attached;
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
    drop(kept);
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
