//! Verifying and attaching the programs of the attach table: a job per program (with the programs
//! that run its code), run on a pool of threads, a tracepoint's format checked first; the perf
//! programs attached to each thread of the targets.
use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use aya::programs::{
    PerfEvent, TracePoint,
    perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
};
use probe_common::tracepoints as tp;

use super::table::{How, Spec, code_of};
use crate::{os::procfs, os::tracefs};

/// One program of the table on its way to attached: verified (and, for a perf program, attached
/// to the target's threads) by [`load_all`], attached by [`Job::attach`], with the programs that
/// run its code (`SAME_CODE`).
pub(super) struct Job<'s, 'p> {
    spec: &'s Spec,
    program: Option<&'p mut aya::programs::Program>,
    same: Vec<(&'s Spec, anyhow::Result<()>, f64)>,
    result: anyhow::Result<()>,
    ms: f64,
}

impl<'s> Job<'s, '_> {
    fn load(&mut self, formats: &Formats, targets: &[u32], sample_hz: u64, offsets_known: &(dyn Fn(&Spec) -> bool + Sync)) {
        let t = std::time::Instant::now();
        self.result = match self.program.as_deref_mut() {
            None => Err(anyhow!("program missing from the object")),
            Some(_) if matches!(self.spec.how, How::Raw(_)) && !offsets_known(self.spec) => {
                Err(anyhow!("kernel BTF lacks the struct offsets it reads"))
            }
            Some(p) => load_one(p, formats, self.spec, targets, sample_hz),
        };
        self.ms += t.elapsed().as_secs_f64() * 1e3;
    }

    pub(super) fn attach(&mut self, formats: &Formats) {
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
                Ok(()) => check_point(formats, other.how).and_then(|()| attach_point(p, other.how)),
                Err(e) => Err(anyhow!("runs {}'s code, which did not attach: {e:#}", self.spec.program)),
            };
            *ms += t.elapsed().as_secs_f64() * 1e3;
        }
    }

    pub(super) fn results(self) -> impl Iterator<Item = (&'s Spec, anyhow::Result<()>, f64)> {
        std::iter::once((self.spec, self.result, self.ms)).chain(self.same)
    }
}

/// Run `f` on every item, on as many threads as there are cores (each takes the next item from a
/// shared queue; the calling thread too, so a thread that cannot be made costs nothing but time).
pub(super) fn pool<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
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
pub(super) fn load_all<'s, 'p>(
    progs: &mut std::collections::HashMap<&str, &'p mut aya::programs::Program>,
    formats: &Formats,
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
    pool(&mut jobs, |j| j.load(formats, targets, sample_hz, offsets_known));
    jobs
}

/// The format files of the tracepoints the table attaches to, read before any uprobe registers:
/// a format file's read takes the kernel's `event_mutex`, which a uprobe's registration holds
/// through its RCU grace periods (`perf_uprobe_init`), so a format read beside the engine's
/// attach waited for it (100-400 ms of a 650 ms arming on a slow grace period, measured from the
/// threads' kernel stacks). A point not read ahead is read when asked for.
pub(super) struct Formats {
    root: std::path::PathBuf,
    read: std::collections::HashMap<(&'static str, &'static str), Result<String, String>>,
}

impl Formats {
    /// Read the format of each of `specs`' tracepoints under tracefs `root`.
    pub(super) fn read<'a>(root: &Path, specs: impl Iterator<Item = &'a Spec>) -> Formats {
        let read = specs.filter_map(|s| point(s.how)).map(|(g, n)| ((g, n), tracefs::format(root, g, n))).collect();
        Formats { root: root.to_path_buf(), read }
    }

    fn get(&self, group: &'static str, name: &'static str) -> anyhow::Result<std::borrow::Cow<'_, str>> {
        match self.read.get(&(group, name)) {
            Some(r) => r.as_deref().map(std::borrow::Cow::Borrowed).map_err(|e| anyhow!(e.clone())),
            None => tracefs::format(&self.root, group, name).map(std::borrow::Cow::Owned).map_err(|e| anyhow!(e)),
        }
    }
}

/// The tracefs event (group, name) of `how`, for the kinds checked against a format file.
fn point(how: How) -> Option<(&'static str, &'static str)> {
    match how {
        How::Tracepoint(layout) => Some((layout.group, layout.name)),
        How::Plain(group, name) => Some((group, name)),
        How::Syscall(name) => Some(("syscalls", name)),
        How::Raw(_) | How::PerfMajorFaults | How::PerfCpuClock => None,
    }
}

/// Check that `how`'s tracepoint exists with the layout the program reads.
fn check_point(formats: &Formats, how: How) -> anyhow::Result<()> {
    let Some((group, name)) = point(how) else { return Ok(()) };
    let fmt = formats.get(group, name)?;
    match how {
        How::Tracepoint(layout) => {
            if let Some(why) = tracefs::check_layout(layout, &fmt) {
                bail!("{}:{} layout differs from what probe was built for: {why}", layout.group, layout.name);
            }
        }
        How::Syscall(name) => {
            let ok = tracefs::parse_format(&fmt).iter().any(|f| f.offset == tp::SYSCALL_ARG0 && f.size == 8);
            if !ok {
                bail!("syscalls:{name} has no 8-byte field at offset {}", tp::SYSCALL_ARG0);
            }
        }
        How::Plain(..) | How::Raw(_) | How::PerfMajorFaults | How::PerfCpuClock => {}
    }
    Ok(())
}

/// Check and verify one program; a perf program is attached too (to each thread of the targets).
fn load_one(program: &mut aya::programs::Program, formats: &Formats, spec: &Spec, targets: &[u32], sample_hz: u64) -> anyhow::Result<()> {
    check_point(formats, spec.how)?;
    match spec.how {
        // A program taken from the kept set is loaded and verified already (`kept`).
        How::Tracepoint(_) | How::Plain(..) | How::Syscall(_) => {
            let p: &mut TracePoint = program.try_into()?;
            if p.fd().is_err() {
                p.load().context("verifier refused the program")?;
            }
        }
        How::Raw(_) => {
            let p: &mut aya::programs::RawTracePoint = program.try_into()?;
            if p.fd().is_err() {
                p.load().context("verifier refused the program")?;
            }
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

/// Attach a perf_event program to every thread of every target process, inherited by threads
/// and children created later (perf follows them from the thread that creates them).
fn per_thread(program: &mut aya::programs::Program, targets: &[u32], event: SoftwareEvent, policy: SamplePolicy) -> anyhow::Result<()> {
    let p: &mut PerfEvent = program.try_into()?;
    let t = std::time::Instant::now();
    if p.fd().is_err() {
        p.load().context("verifier refused the program")?;
    }
    let verified = t.elapsed();
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
    log::debug!("perf {event:?}: verified in {verified:?}, {n} events opened in {:?}", t.elapsed() - verified);
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
pub(super) fn in_own_pid_namespace() -> bool {
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
