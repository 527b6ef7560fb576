//! Python frames of CPython targets (3.11, 3.12, 3.13): which threads are Python threads and where
//! their frame chain starts (for the kernel's walk, probe_common::python), what each code object
//! the walk sent is called (`module.qualname (file.py:line)`), and the merge of those frames into
//! the native stack in place of the interpreter's evaluation frames, as `py-spy --native` does.
//!
//! The target's memory is untrusted input: every read is bounded (process_vm_readv of at most
//! [`MAX_READ`] bytes), every pointer is checked for null and every count capped; a chain that
//! tears while read ends there. No file of the target is mapped: its ELF symbols are read
//! through probe's verified open file (crate::os::target_file).
mod interp;
mod layout;
mod memory;

use std::collections::HashMap;

use probe_common::python::{PY_ENTRY, PyStackEvent, PyThread};

use crate::record::records::PY_MODULE;

pub use interp::thread_states;
use interp::{Interp, Syms, find, threads};
pub use layout::{Layout, debug_offsets, frame_name, layout, line_of, module_of, unicode_text};
use memory::{Code, line_at, read_code};
pub use memory::{Memory, ProcMemory, frame_text, thread_names};

/// Most bytes one read of the target's memory takes.
pub const MAX_READ: usize = 64 << 10;
/// Most threads read from one interpreter's list.
const MAX_THREADS: usize = 4096;
/// Most characters of a name or file name kept.
const MAX_NAME: usize = 512;
/// Most distinct Python frames named per trace (then frames are named by code address).
const MAX_FRAMES: usize = 1 << 18;

/// Merge a stack's native frames (innermost first) with its Python frames (innermost first,
/// [`PY_ENTRY`] ending each C-level evaluation's group): each native frame for which `is_eval`
/// holds is replaced by the next group of Python frames; groups left over (the native unwind
/// stopped short) go outermost. `py_id` names a Python frame (its code object and instruction).
pub fn merge(
    native: &[(i64, u64)],
    py: &[[u64; 2]],
    is_eval: impl Fn(i64, u64) -> bool,
    mut py_id: impl FnMut(u64, u64) -> u64,
) -> Vec<(i64, u64)> {
    // A 3.12+ shim frame (`[0, PY_ENTRY]`) says the frame before it is an entry.
    let mut folded: Vec<[u64; 2]> = Vec::with_capacity(py.len());
    for f in py {
        match (f[0], folded.last_mut()) {
            (0, Some(last)) => last[1] |= f[1] & PY_ENTRY,
            (0, None) => {}
            _ => folded.push(*f),
        }
    }
    let py = &folded[..];
    let mut groups: Vec<&[[u64; 2]]> = Vec::new();
    let mut start = 0;
    for (i, f) in py.iter().enumerate() {
        if f[1] & PY_ENTRY != 0 {
            groups.push(&py[start..=i]);
            start = i + 1;
        }
    }
    if start < py.len() {
        groups.push(&py[start..]);
    }
    let mut out = Vec::with_capacity(native.len() + py.len());
    let mut g = groups.into_iter();
    let mut push = |out: &mut Vec<(i64, u64)>, group: &[[u64; 2]]| {
        out.extend(group.iter().map(|f| (PY_MODULE, py_id(f[0], f[1] & !PY_ENTRY))));
    };
    for &(m, off) in native {
        if is_eval(m, off)
            && let Some(group) = g.next()
        {
            push(&mut out, group);
            continue;
        }
        out.push((m, off));
    }
    for group in g {
        push(&mut out, group);
    }
    out
}

/// The Python side of a trace: the interpreters of the targets, their threads in the kernel's
/// map, and the names of the frames seen.
#[derive(Default)]
pub struct Pythons {
    procs: HashMap<u32, Option<Interp>>,
    /// The last Python frames per thread, waiting for their stack record.
    pending: HashMap<u32, Box<PyStackEvent>>,
    /// Each thread's Python frames at its last stack at each place (tid, the kernel's slot:
    /// off-CPU, block IO and fault records share them), for the ones sent as the same.
    last_at_place: HashMap<(u32, u8), Box<PyStackEvent>>,
    codes: HashMap<(u32, u64), Option<Code>>,
    ids: HashMap<(u32, u64, i64), u64>,
    /// Frame ids by (pid, code object, instruction): what `ids` gives without the line's lookup.
    by_instr: HashMap<(u32, u64, u64), u64>,
    /// Frame names not written to the recording yet.
    pub new_names: Vec<(u64, String)>,
    /// What was said about processes that could not be read (once each).
    pub notes: Vec<String>,
    /// Python stacks merged, and those whose frames could not be named.
    pub merged: u64,
    pub unnamed: u64,
    /// A thread of a Python target showed up that the kernel's map may not hold yet.
    pub dirty: bool,
    /// Threads `threading` named (or renamed) since the last look: (pid, tid, name).
    pub new_thread_names: Vec<(u32, u32, String)>,
    /// CPU time this process spent on Python frames (reading threads, naming code), ns: the
    /// thread's own clock (a drain at idle priority waits behind the server: wall time would
    /// count the server's work).
    pub work_ns: u64,
    /// Why Python frames were turned off during the trace ([`Pythons::turn_off`]).
    pub off: Option<String>,
    last_refresh: Option<std::time::Instant>,
    /// What each interpreter file's ELF symbols gave, by (path, device, inode): read once per
    /// file, not once per process (vLLM and multiprocessing servers start many).
    files: HashMap<(String, u32, u32, u64), Option<Syms>>,
}

impl Pythons {
    /// Look at the targets: a process not seen before is checked for a CPython interpreter
    /// (once); every interpreter's thread list is read again and the kernel's map brought up to
    /// date (threads started since, threads gone).
    pub fn refresh(&mut self, pids: &[u32], map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        self.dirty = false;
        if self.off.is_some() {
            return;
        }
        let t0 = thread_cpu_ns();
        self.refresh_now(pids, map);
        self.work_ns += thread_cpu_ns().saturating_sub(t0);
    }

    /// Python frames cost more than their budget: every thread leaves the kernel's map (the walk
    /// stops), nothing is read from the targets any more, and `why` is kept for the report.
    pub fn turn_off(&mut self, why: String, map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        if let Some(map) = map.as_mut() {
            for interp in self.procs.values().flatten() {
                for tid in &interp.threads {
                    let _ = map.remove(tid);
                }
            }
        }
        self.procs.clear();
        self.pending.clear();
        self.last_at_place.clear();
        self.off = Some(why);
    }

    fn refresh_now(&mut self, pids: &[u32], map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        self.last_refresh = Some(std::time::Instant::now());
        for &pid in pids {
            if !self.procs.contains_key(&pid) {
                let found = find(pid, &mut self.files);
                let interp = match found {
                    Ok(i) => i,
                    Err(Some(why)) => {
                        self.notes.push(format!("pid {pid}: Python frames not read: {why}"));
                        None
                    }
                    Err(None) => None,
                };
                self.procs.insert(pid, interp);
            }
            let Some(Some(interp)) = self.procs.get_mut(&pid) else { continue };
            let Some(map) = map.as_mut() else { continue };
            let mem = ProcMemory(pid);
            let now = threads(&mem, interp);
            for (&tid, &tstate) in &now {
                let l = &interp.layout;
                let t = PyThread { tstate, cframe: l.tstate_cframe, frame: l.frame, layout: l.frames, _pad: 0 };
                if map.get(&tid, 0).ok() != Some(t) {
                    let _ = map.insert(tid, t, 0);
                }
            }
            for gone in interp.threads.iter().filter(|t| !now.contains_key(t)) {
                let _ = map.remove(gone);
            }
            interp.threads = now.into_keys().collect();
            Self::name_threads(&mem, pid, interp, &mut self.new_thread_names);
        }
        self.procs.retain(|pid, _| pids.contains(pid));
    }

    /// Read `threading`'s thread names when the interpreter's threads changed and one has no
    /// name yet (a thread is in the interpreter's list a moment before `threading` registers
    /// it); threads no Python code started (a C library's pool calling in) never get one, so a
    /// thread set that stays the same is read again only every 5 s.
    fn name_threads(mem: &impl Memory, pid: u32, interp: &mut Interp, out: &mut Vec<(u32, u32, String)>) {
        let unnamed = interp.threads.iter().any(|t| !interp.names.contains_key(t));
        let due = match interp.names_read {
            None => true,
            Some((at, n)) => n != interp.threads.len() || at.elapsed() >= std::time::Duration::from_secs(5),
        };
        if !unnamed || !due {
            return;
        }
        interp.names_read = Some((std::time::Instant::now(), interp.threads.len()));
        let names = thread_names(mem, &interp.layout, interp.runtime, &mut interp.active);
        for (tid, name) in names {
            if interp.names.get(&tid) != Some(&name) {
                out.push((pid, tid, name.clone()));
                interp.names.insert(tid, name);
            }
        }
        interp.names.retain(|t, _| interp.threads.contains(t));
    }

    /// Whether a CPython target was found during the trace (also after [`Pythons::turn_off`]).
    pub fn any_seen(&self) -> bool {
        self.off.is_some() || self.any()
    }

    /// Whether any target runs a CPython this version reads.
    pub fn any(&self) -> bool {
        self.procs.values().any(Option::is_some)
    }

    /// A new thread of `pid` was seen: when `pid` runs a CPython, its thread list is read again
    /// soon ([`Pythons::due`]), so a thread started after attach (a thread pool's worker) gets
    /// its Python frames within a drain turn or two, not at the next second.
    pub fn new_thread(&mut self, pid: u32) {
        if matches!(self.procs.get(&pid), Some(Some(_))) {
            self.dirty = true;
        }
    }

    /// A new thread waits and the last read is 50 ms old or more.
    pub fn due(&self) -> bool {
        self.dirty && self.last_refresh.is_none_or(|t| t.elapsed() >= std::time::Duration::from_millis(50))
    }

    /// A thread's Python frames arrived; its stack record follows.
    pub fn frames(&mut self, ev: Box<PyStackEvent>) {
        if self.pending.len() >= 16384 && !self.pending.contains_key(&ev.hdr.tid) {
            self.pending.clear();
        }
        self.pending.insert(ev.hdr.tid, ev);
    }

    /// The native frames of a stack record of (`pid`, `tid`) at `ts_ns`, merged with the Python
    /// frames sent just before it (none: unchanged). `is_module(id, path)`: native module `id` is
    /// the file at `path`. A stack the kernel sent as the same as the thread's last
    /// (`same`: no walk, no Python frames sent) gets the Python frames of that last one.
    pub fn merge_into(&mut self, at: StackAt, native: Vec<(i64, u64)>, is_module: impl Fn(i64, &str) -> bool) -> Vec<(i64, u64)> {
        let StackAt { pid, tid, ts_ns, remembered, slot, same } = at;
        let (ev, fresh) = match self.pending.remove(&tid) {
            Some(ev) => (ev, true),
            None if same && remembered => match self.last_at_place.remove(&(tid, slot)) {
                Some(ev) if ev.hdr.pid == pid => (ev, false),
                _ => return native,
            },
            None => return native,
        };
        let t0 = thread_cpu_ns();
        let merged = self.merge_event(pid, if fresh { ts_ns } else { ev.hdr.ts_ns }, &ev, native, is_module);
        self.work_ns += thread_cpu_ns().saturating_sub(t0);
        if remembered {
            if self.last_at_place.len() >= 65536 && !self.last_at_place.contains_key(&(tid, slot)) {
                self.last_at_place.clear();
            }
            self.last_at_place.insert((tid, slot), ev);
        }
        merged
    }

    fn merge_event(
        &mut self,
        pid: u32,
        ts_ns: u64,
        ev: &PyStackEvent,
        native: Vec<(i64, u64)>,
        is_module: impl Fn(i64, &str) -> bool,
    ) -> Vec<(i64, u64)> {
        // Sent in the same program run, just before: never after the stack, never long before.
        if ev.hdr.pid != pid || ev.hdr.ts_ns > ts_ns || ts_ns - ev.hdr.ts_ns > 1_000_000 {
            return native;
        }
        let Some(Some(interp)) = self.procs.get(&pid) else { return native };
        let layout = interp.layout;
        let (eval_path, lo, hi) = (&interp.eval.0, interp.eval.1, interp.eval.2);
        let n = (ev.frames_n as usize).min(ev.frames.len());
        let mem = ProcMemory(pid);
        let is_eval = |m: i64, off: u64| off >= lo && off < hi && is_module(m, eval_path);
        let mut unnamed = 0u64;
        let (codes, ids, new_names, by_instr) = (&mut self.codes, &mut self.ids, &mut self.new_names, &mut self.by_instr);
        let merged = merge(&native, &ev.frames[..n], is_eval, |code, instr| {
            // A frame seen before at the same instruction: its id at once (a thread that
            // switches thousands of times a second, a spin-wait's yield, repeats its stack).
            if let Some(&id) = by_instr.get(&(pid, code, instr)) {
                return id;
            }
            let c = codes.entry((pid, code)).or_insert_with(|| read_code(&mem, &layout, code));
            let line = c.as_ref().and_then(|c| line_at(c, &layout, code, instr));
            let key = (pid, code, line.unwrap_or(-1));
            if let Some(&id) = ids.get(&key) {
                if by_instr.len() < 4 * MAX_FRAMES {
                    by_instr.insert((pid, code, instr), id);
                }
                return id;
            }
            let id = ids.len() as u64;
            let text = match c {
                Some(c) => frame_name(&c.qualname, &c.file, line),
                None => {
                    unnamed += 1;
                    format!("[python code {code:#x}]")
                }
            };
            if ids.len() < MAX_FRAMES {
                ids.insert(key, id);
                new_names.push((id, text));
                if by_instr.len() < 4 * MAX_FRAMES {
                    by_instr.insert((pid, code, instr), id);
                }
            }
            id
        });
        self.unnamed += unnamed;
        self.merged += 1;
        merged
    }
}

/// Which stack record [`Pythons::merge_into`] merges into.
#[derive(Clone, Copy, Debug)]
pub struct StackAt {
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// A stack remembered by place (probe_common::stack::stack_remembered: off-CPU, block IO,
    /// fault), its place (the kernel's slot), and whether the kernel sent it as the same as the
    /// thread's last at that place.
    pub remembered: bool,
    pub slot: u8,
    pub same: bool,
}

/// The calling thread's CPU time, ns.
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write; the clock id is a constant.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// What Python frames may cost: their own work (the kernel's walks and this process's reading
/// and naming) as a share of one core over the last [`Budget::WINDOW`], looked at each second.
pub struct Budget {
    /// The most they may take, a share of one core (0.01: 1%).
    pub share: f64,
    looks: std::collections::VecDeque<(u64, u64)>,
}

impl Budget {
    /// The window a share is taken over: long enough that naming a server's code at attach
    /// (a burst of reads) is spread, short enough to stop a steady cost within seconds.
    pub const WINDOW_NS: u64 = 5_000_000_000;

    pub fn new(share: f64) -> Budget {
        Budget { share, looks: Default::default() }
    }

    /// A look at `now_ns` with `spent_ns` spent so far: the share over the last window when it
    /// is over the budget (a full window must have passed).
    pub fn over(&mut self, now_ns: u64, spent_ns: u64) -> Option<f64> {
        self.looks.push_back((now_ns, spent_ns));
        while self.looks.len() > 2 && self.looks[1].0 + Self::WINDOW_NS <= now_ns {
            self.looks.pop_front();
        }
        let &(t0, s0) = self.looks.front()?;
        let dt = now_ns.checked_sub(t0).filter(|&d| d >= Self::WINDOW_NS)?;
        let share = spent_ns.saturating_sub(s0) as f64 / dt as f64;
        (share > self.share).then_some(share)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share is taken over a full window, the oldest look kept just outside it.
    #[test]
    fn the_budget_is_a_share_of_a_core_over_five_seconds() {
        const S: u64 = 1_000_000_000;
        let mut b = Budget::new(0.01);
        // 8 ms a second: under 1%.
        for i in 0..10 {
            assert_eq!(b.over(i * S, i * 8_000_000), None, "second {i}");
        }
        // A burst of 40 ms in one second, then calm: 48 ms over the window is under 5 s × 1%
        // (50 ms), so it stays on.
        let mut b = Budget::new(0.01);
        assert_eq!(b.over(0, 0), None);
        assert_eq!(b.over(S, 40_000_000), None);
        for i in 2..8 {
            assert_eq!(b.over(i * S, 40_000_000 + (i - 1) * 1_000_000), None, "second {i}");
        }
        // 15 ms a second: over, once a window has passed, and not before.
        let mut b = Budget::new(0.01);
        for i in 0..5 {
            assert_eq!(b.over(i * S, i * 15_000_000), None, "second {i}");
        }
        let share = b.over(5 * S, 75_000_000).unwrap();
        assert!((share - 0.015).abs() < 1e-9, "{share}");
    }

    /// A made-up address space: regions at their addresses.
    #[derive(Default)]
    struct Image(Vec<(u64, Vec<u8>)>);

    impl Memory for Image {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            let Some((at, b)) = self.0.iter().find(|(at, b)| addr >= *at && addr + buf.len() as u64 <= at + b.len() as u64) else {
                return false;
            };
            let o = (addr - at) as usize;
            buf.copy_from_slice(&b[o..o + buf.len()]);
            true
        }
    }

    impl Image {
        fn words(&mut self, at: u64, w: &[u64]) {
            self.0.push((at, w.iter().flat_map(|w| w.to_le_bytes()).collect()));
        }

        /// A compact ASCII `str`.
        fn str(&mut self, at: u64, l: &Layout, text: &str) {
            let mut b = vec![0u8; l.ascii_size as usize];
            b[16..24].copy_from_slice(&(text.len() as u64).to_le_bytes());
            b[32..36].copy_from_slice(&(1u32 << 2 | 1 << 5 | 1 << 6).to_le_bytes());
            b.extend_from_slice(text.as_bytes());
            b.push(0);
            self.0.push((at, b));
        }

        /// A dict keys object of `kind` with these (key, value) entries.
        fn keys(&mut self, at: u64, kind: u8, entries: &[(u64, u64)]) {
            let mut b = vec![0u8; 40];
            b[8] = 3;
            b[9] = 3;
            b[10] = kind;
            b[24..32].copy_from_slice(&(entries.len() as u64).to_le_bytes());
            for &(k, v) in entries {
                if kind == 0 {
                    b.extend_from_slice(&0u64.to_le_bytes());
                }
                b.extend_from_slice(&k.to_le_bytes());
                b.extend_from_slice(&v.to_le_bytes());
            }
            self.0.push((at, b));
        }

        /// An `int` of one or two 30-bit digits.
        fn int(&mut self, at: u64, l: &Layout, v: u64) {
            let digits = if v >> 30 == 0 { vec![v] } else { vec![v & 0x3fff_ffff, v >> 30] };
            let n = digits.len() as u64;
            let size = if l.version >= (3, 12) { n << 3 } else { n };
            let mut b: Vec<u8> = [1u64, 0, size].iter().flat_map(|w| w.to_le_bytes()).collect();
            b.extend(digits.iter().flat_map(|&d| (d as u32).to_le_bytes()));
            self.0.push((at, b));
        }
    }

    /// `threading._active` as each version keeps it: sys.modules and the module globals as
    /// dicts of strings, `_active` keyed by ints, and each `Thread`'s `_name` and `_native_id`
    /// in its class's shared keys with the values where the version keeps them (3.11: a pointer
    /// four words before the object; 3.12: three words before, tagged; 3.13: inline after the
    /// object, behind a header), or in a dict of its own once one was made. Only 3.11 runs here.
    #[test]
    fn threads_are_named_as_threading_names_them() {
        for version in [(3, 11), (3, 12), (3, 13)] {
            let l = Layout { version, interp_modules: 888, ..layout(3, if version == (3, 11) { 11 } else { 12 }).unwrap() };
            let mut m = Image::default();
            let (runtime, interp, modules, threading, globals, active) = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000);
            m.words(runtime + l.interp_head, &[interp]);
            m.words(interp + l.interp_modules, &[modules]);
            // sys.modules = {"sys": 0x9999, "threading": <module>}: a unicode-keyed dict.
            m.str(0x10_000, &l, "sys");
            m.str(0x10_100, &l, "threading");
            m.words(modules, &[1, 0, 2, 0, 0x3100, 0]);
            m.keys(0x3100, 1, &[(0x10_000, 0x9999), (0x10_100, threading)]);
            m.words(threading, &[1, 0, globals]);
            m.str(0x10_200, &l, "_limbo");
            m.str(0x10_300, &l, "_active");
            m.words(globals, &[1, 0, 2, 0, 0x5100, 0]);
            m.keys(0x5100, 1, &[(0x10_200, 0x9999), (0x10_300, active)]);
            // _active = {ident: Thread}: int keys, a general table.
            let (t1, t2, cls) = (0x20_000, 0x21_000, 0x22_000);
            m.words(active, &[1, 0, 2, 0, 0x6100, 0]);
            m.keys(0x6100, 0, &[(0x30_000, t1), (0x30_100, t2)]);
            // The class's shared keys: _target, _name, _native_id.
            m.str(0x10_400, &l, "_target");
            m.str(0x10_500, &l, "_name");
            m.str(0x10_600, &l, "_native_id");
            m.words(cls + l.type_cached_keys, &[0x22_400]);
            m.words(cls + 32, &[16]);
            m.keys(0x22_400, 2, &[(0x10_400, 0), (0x10_500, 0), (0x10_600, 0)]);
            m.str(0x40_000, &l, "MainThread");
            m.int(0x40_100, &l, 4242);
            m.str(0x40_200, &l, "Thread-2 (worker)");
            m.int(0x40_300, &l, 1 << 31 | 77);
            // t1: values in the version's place; t2: a dict of its own.
            let values = [0u64, 0x40_000, 0x40_100];
            match version {
                (3, 11) => {
                    m.words(t1 - 32, &[0x23_000, 0, 0, 0, 1, cls]);
                    m.words(0x23_000, &values);
                }
                (3, 12) => {
                    m.words(t1 - 24, &[0x23_000 | 1, 0, 0, 1, cls]);
                    m.words(0x23_000, &values);
                }
                _ => {
                    m.words(t1 - 24, &[0, 0, 0, 1, cls, 0x0100_0303, 0, 0x40_000, 0x40_100]);
                }
            }
            m.words(t2 - 32, &[0, 0x24_000, 0, 0, 1, cls]);
            m.words(0x24_000, &[1, 0, 2, 0, 0x24_100, 0]);
            m.keys(0x24_100, 1, &[(0x10_500, 0x40_200), (0x10_600, 0x40_300)]);
            let mut at = None;
            let names = thread_names(&m, &l, runtime, &mut at);
            let want: HashMap<u32, String> = [(4242, "MainThread".to_string()), (1 << 31 | 77, "Thread-2 (worker)".to_string())].into();
            assert_eq!(names, want, "{version:?}");
            assert_eq!(at, Some(active));
            // A torn object: no name, no panic.
            m.0.retain(|(a, _)| *a != 0x40_300);
            assert_eq!(thread_names(&m, &l, runtime, &mut at).len(), 1);
        }
    }

    #[test]
    fn names_read_like_pythons_own() {
        assert_eq!(module_of("/opt/venv/lib/python3.11/site-packages/llama_cpp/server/app.py"), "llama_cpp.server.app");
        assert_eq!(module_of("/usr/lib/python3.11/asyncio/base_events.py"), "asyncio.base_events");
        assert_eq!(module_of("/usr/lib/python3/dist-packages/pkg/__init__.py"), "pkg");
        assert_eq!(module_of("/srv/plugin.py"), "plugin");
        assert_eq!(frame_name("Spin.run", "/srv/plugin.py", Some(12)), "plugin.Spin.run (plugin.py:12)");
        assert_eq!(frame_name("<module>", "<string>", None), "<module> (<string>)");
    }

    /// Entries of each form: short (code 0–9, one byte), one-line (10–12, two bytes), no column
    /// (13, a signed varint), long (14, four varints), none (15).
    #[test]
    fn location_tables_give_the_line_of_each_instruction() {
        let t = [
            0x80 | (13 << 3) | 1, // 2 units, line +1 (svarint 2)
            2,
            0x80 | (11 << 3), // 1 unit, line +1, columns
            4,
            9,
            0x80 | (14 << 3) | 2, // 3 units, line -2 (svarint 5), end line, columns
            5,
            0,
            1,
            1,
            0x80 | (15 << 3), // 1 unit, no location
            0x80 | (3 << 3),  // 1 unit, same line
            7,
        ];
        let at = |i| line_of(&t, 10, i);
        assert_eq!((at(0), at(1), at(2), at(3), at(5), at(6), at(7)), (Some(11), Some(11), Some(12), Some(10), Some(10), None, Some(10)));
        assert_eq!(at(8), None, "past the table");
        assert_eq!(line_of(&[0x01, 0x02], 1, 0), None, "a torn table");
    }

    #[test]
    fn strings_of_each_kind() {
        let l = layout(3, 11).unwrap();
        let mut ascii = vec![0u8; 48];
        ascii[16] = 5;
        ascii[32] = (1 << 5) | (1 << 6) | (1 << 2);
        ascii.extend_from_slice(b"hello");
        assert_eq!(unicode_text(&ascii, &l).as_deref(), Some("hello"));
        let mut wide = vec![0u8; 72];
        wide[16] = 2;
        wide[32] = (1 << 5) | (2 << 2);
        wide.extend_from_slice(&0x00e9u16.to_le_bytes());
        wide.extend_from_slice(&0x4e2du16.to_le_bytes());
        assert_eq!(unicode_text(&wide, &l).as_deref(), Some("é中"));
        let mut legacy = ascii.clone();
        legacy[32] = 0;
        assert_eq!(unicode_text(&legacy, &l), None);
        assert_eq!(unicode_text(&ascii[..50], &l), None, "cut short");
    }

    /// Each evaluation frame of the native stack gets its group of Python frames, in order; a
    /// group left over goes outermost.
    #[test]
    fn python_frames_take_the_place_of_the_evaluation_frames() {
        let native = [(1, 10), (2, 500), (1, 20), (2, 510), (1, 30)];
        let py = [[100, 1], [101, 2 | PY_ENTRY], [102, 3 | PY_ENTRY], [103, 4]];
        let out = merge(&native, &py, |m, _| m == 2, |code, _| code);
        assert_eq!(out, vec![(1, 10), (PY_MODULE, 100), (PY_MODULE, 101), (1, 20), (PY_MODULE, 102), (1, 30), (PY_MODULE, 103)]);
        assert_eq!(merge(&native, &[], |m, _| m == 2, |c, _| c), native.to_vec(), "no Python frames: unchanged");
        // 3.12+: shims instead of entry flags.
        let shims = [[100, 1], [101, 2], [0, PY_ENTRY], [102, 3], [0, PY_ENTRY], [103, 4]];
        assert_eq!(merge(&native, &shims, |m, _| m == 2, |code, _| code), out);
    }
}
