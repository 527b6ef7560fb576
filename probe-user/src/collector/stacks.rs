//! The collector's stack records: each stack sample unwound and written (an off-CPU one once its
//! thread runs again, Python frames merged in), the user-stack bytes each thread needs told to the
//! kernel, and the record naming where cut stacks stop.
use std::collections::HashMap;

use super::{CUT_FRAMES_PER_KIND, CUT_MODULE_MAX, LAST_PLACE_STACKS, LAST_USER_STACKS, MAX_CUT_TOPS, State};
use crate::record::{
    self,
    records::{self, UserRecord},
};

/// A thread's last stack at one place (off-CPU, block IO or fault: probe_common::stack::stack_remembered), for the records that refer to it
/// (STACK_SAME_USER, STACK_SAME_KERNEL): its process, its unwound user stack and its kernel frames.
pub(super) struct LastAtPlace {
    pub pid: u32,
    pub user: crate::kernel::unwind::Unwound,
    pub kernel: Vec<u64>,
}

/// A stack record's kernel frames (innermost first): its own, or with STACK_SAME_KERNEL those of
/// the thread's last off-CPU record at that place (`last`; none when the collector does not have it).
fn kernel_frames(s: &probe_common::stack::StackEvent, last: Option<&[u64]>) -> Vec<u64> {
    if s.what & probe_common::stack::STACK_SAME_KERNEL != 0 {
        return last.map(<[u64]>::to_vec).unwrap_or_default();
    }
    match usize::try_from(s.kstack_bytes) {
        Ok(n) => s.kstack.iter().take(n / 8).copied().take_while(|&a| a != 0).collect(),
        Err(_) => Vec::new(),
    }
}

impl State {
    /// Unwind a stack sample and write its frames (off-CPU ones once the thread runs again).
    pub(super) fn on_stack(&mut self, s: &probe_common::stack::StackEvent, ustack: &[u8]) -> std::io::Result<()> {
        use probe_common::stack::{STACK_SAME_USER, stack_kind, stack_remembered, stack_slot};
        let offcpu = stack_kind(s.what) == probe_common::stack::STACK_OFFCPU;
        // Off-CPU, block IO and fault stacks are remembered by thread and place (the kernel's slot).
        let remembered = stack_remembered(s.what);
        let place = (s.hdr.tid, stack_slot(s.what) as u8);
        let last = self.last_at_place.get(&place).filter(|l| l.pid == s.hdr.pid);
        let kernel = kernel_frames(s, last.map(|l| &l.kernel[..]));
        // An off-CPU stack the kernel left out as the same as this thread's last: its frames.
        let u = match last {
            Some(last) if s.what & STACK_SAME_USER != 0 => {
                self.unwinders.reused += 1;
                last.user.clone()
            }
            _ => {
                let u = self.unwinders.unwind(s.hdr.pid, s.hdr.tid, s.ip, s.sp, s.bp, ustack);
                self.learn_need(s.hdr.pid, s.hdr.tid, s.sp, &u, ustack.len());
                if remembered {
                    // Threads that exited leave entries until their process does: bounded like
                    // the kernel's map (a thread forgotten here is unwound from its ip alone once).
                    if self.last_at_place.len() >= LAST_PLACE_STACKS && !self.last_at_place.contains_key(&place) {
                        self.last_at_place.clear();
                    }
                    let last = LastAtPlace { pid: s.hdr.pid, user: u.clone(), kernel: Vec::new() };
                    self.last_at_place.insert(place, last);
                }
                u
            }
        };
        if remembered && let Some(last) = self.last_at_place.get_mut(&place) {
            // What the next record that says "the same kernel stack" means.
            last.kernel.clone_from(&kernel);
        }
        for (id, path) in self.unwinders.take_new_modules() {
            self.module_paths.insert(id, path.clone());
            self.writer.record(&UserRecord::Module(records::Module { id, path }))?;
        }
        // A CPython thread's Python frames in place of the interpreter's evaluation frames.
        let native_top = u.frames.last().copied();
        let paths = &self.module_paths;
        let user = self.python.merge_into(
            crate::kernel::python::StackAt {
                pid: s.hdr.pid,
                tid: s.hdr.tid,
                ts_ns: s.hdr.ts_ns,
                remembered,
                slot: place.1,
                same: s.what & STACK_SAME_USER != 0,
            },
            u.frames,
            |id, path| paths.get(&id).is_some_and(|p| p == path),
        );
        if !self.python.new_names.is_empty() {
            let frames = std::mem::take(&mut self.python.new_names);
            self.writer.record(&UserRecord::PyFrames(records::PyFrames { frames }))?;
        }
        let what = match stack_kind(s.what) {
            probe_common::stack::STACK_CPU => record::StackKind::Cpu,
            probe_common::stack::STACK_OFFCPU => record::StackKind::Offcpu,
            probe_common::stack::STACK_FAULT => record::StackKind::Fault,
            _ => record::StackKind::Io,
        };
        if let Some(names) = self.ksyms.learn(&kernel) {
            self.writer.record(&UserRecord::Ksyms(names))?;
        }
        if !u.complete
            && let Some(top) = native_top
            && (self.cut_tops.len() < MAX_CUT_TOPS || self.cut_tops.contains_key(&(what, top)))
        {
            *self.cut_tops.entry((what, top)).or_default() += 1;
        }
        let mut v = record::StackRecord {
            what,
            pid: s.hdr.pid,
            tid: s.hdr.tid,
            ts_ns: s.hdr.ts_ns,
            user,
            complete: u.complete,
            cut: u.cut,
            addr: s.addr,
            state: s.state,
            ..Default::default()
        };
        if offcpu {
            v.wait = Some(self.ksyms.wait_class(&kernel).into());
            v.kernel = kernel;
            if let Some(old) = self.offcpu.insert(s.hdr.tid, v) {
                self.writer.stack(&old)?;
            }
            return Ok(());
        }
        v.kernel = kernel;
        self.writer.stack(&v)
    }

    /// The record naming where cut user stacks stop: the most common outermost frames of each
    /// kind, symbolized now from their modules (up to [`CUT_MODULE_MAX`] bytes each: this runs
    /// as the trace stops).
    pub(crate) fn cut_frames(&self) -> Option<UserRecord> {
        if self.cut_tops.is_empty() {
            return None;
        }
        type Top = ((record::StackKind, (i64, u64)), u64);
        let mut tops: Vec<Top> = self.cut_tops.iter().map(|(k, n)| (*k, *n)).collect();
        tops.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut chosen: Vec<Top> = Vec::new();
        for &kind in record::StackKind::ALL {
            chosen.extend(tops.iter().filter(|t| t.0.0 == kind).take(CUT_FRAMES_PER_KIND).copied());
        }
        let small = |id: &i64| self.module_paths.get(id).and_then(|p| std::fs::metadata(p).ok()).is_some_and(|m| m.len() <= CUT_MODULE_MAX);
        let modules: HashMap<i64, String> = self.module_paths.iter().filter(|(id, _)| small(id)).map(|(i, p)| (*i, p.clone())).collect();
        let wanted = crate::analysis::flame::symbols::Wanted::frames(modules, chosen.iter().map(|c| c.0.1));
        let symbols = crate::analysis::flame::symbols::Symbols::of(wanted, Default::default());
        let frames = chosen
            .into_iter()
            .map(|((kind, (module, offset)), stacks)| {
                let name = match self.module_paths.get(&module).filter(|_| small(&module)) {
                    Some(_) => symbols.user(module, offset),
                    None => {
                        let base = self.module_paths.get(&module).map_or("[unknown]", |p| p.rsplit('/').next().unwrap_or(p));
                        format!("{base}+{offset:#x}")
                    }
                };
                records::CutFrame { kind: kind.name().into(), module, offset, name, stacks }
            })
            .collect();
        Some(UserRecord::CutFrames(records::CutFrames { frames }))
    }

    /// Tell the kernel how many user-stack bytes `tid`'s stacks need, from what unwinding this
    /// one used: a quarter more, in powers of two from 1 KiB, only ever growing; double when the
    /// unwinder ran out of bytes. The copy is most of a stack sample's cost in the kernel
    /// (64 KiB for 18 us; llama-server's workers unwind in 2 KiB). A stack that ran out short of
    /// the largest copy may end nearer than that above `sp` (the largest read faulted, a smaller
    /// one came): the end of its mapping, read from /proc once per thread (again only when the
    /// stack is seen above it), is told too, and the largest copy reads up to it.
    fn learn_need(&mut self, pid: u32, tid: u32, sp: u64, u: &crate::kernel::unwind::Unwound, given: usize) {
        let Some(map) = self.ustack_need.as_mut() else { return };
        let cap = probe_common::stack::USTACK_CAP as u64;
        let class = |b: u64| b.next_power_of_two().clamp(1024, cap + 8).min(cap) as u32;
        let (told, told_top) = self.need_told.get(&tid).copied().unwrap_or((0, 0));
        let mut want = if u.short { class(given as u64 * 2) } else { class(u.used_bytes + u.used_bytes / 4) };
        if !u.short && u.used_bytes == 0 {
            want = 0;
        }
        // Only ever growing, but for a thread whose stacks are stitched ([`Shrink`]).
        if self.need_shrink.len() >= LAST_USER_STACKS && !self.need_shrink.contains_key(&tid) {
            self.need_shrink.clear();
        }
        let read_cut = !u.complete && u.cut == Some(crate::record::Cut::Read);
        let want = match u.stitch_bytes {
            // What this stack would take stitched counts toward a shrink (none is told yet: the
            // first need is what the whole stack took).
            Some(b) if !u.short && told > 0 => self.need_shrink.entry(tid).or_default().next(told, class(b + b / 4), true, read_cut),
            _ => self.need_shrink.entry(tid).or_default().next(told, want, false, read_cut),
        };
        // 1: looked for, not nearer than the largest copy (no end told).
        let looked = told_top != 0 && (told_top == 1 || sp < told_top);
        let top = if u.short && (given as u64) < cap && !looked {
            match crate::os::procfs::mapping_end(pid, sp) {
                Some(end) if end > sp && end - sp < cap => end,
                _ => 1,
            }
        } else {
            told_top
        };
        if (want, top) == (told, told_top) || want == 0 {
            return;
        }
        if self.need_told.len() >= LAST_USER_STACKS && !self.need_told.contains_key(&tid) {
            self.need_told.clear();
        }
        if map.insert(tid, probe_common::stack::need_entry(want, top), 0).is_ok() {
            log::debug!(
                "thread {tid}: user stacks need {want} bytes, stack ends at {top:#x} (used {}, short {}, given {given})",
                u.used_bytes,
                u.short
            );
            self.need_told.insert(tid, (want, top));
        }
    }
}

/// Stitched stacks in a row, each needing less than told, after which a thread's copy shrinks
/// to the most of them.
const NEED_SHRINK: u32 = 8;

/// How a thread's copy may shrink: a thread's need only ever grows, but for stacks stitched to
/// its last whole ones (`Unwound::stitch_bytes`): after [`NEED_SHRINK`] of them in a row that all
/// took less than half of what was told, it needs twice the most of them. A later stack cut by a read past the shorter copy
/// that reaches no frame of the last whole one (the thread deeper in another place) brings the
/// need back to what it was; one cut by the copy's end doubles it, as for any thread.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Shrink {
    run: u32,
    most: u32,
    /// The need before it last shrank (0: never).
    before: u32,
}

impl Shrink {
    /// The need to tell after a stack: `told` now, `want` what this one took (a quarter more, a
    /// class), `stitched`, `read_cut` (cut by a read past its copy).
    fn next(&mut self, told: u32, want: u32, stitched: bool, read_cut: bool) -> u32 {
        if stitched && want > 0 && want.saturating_mul(2) < told {
            self.run += 1;
            self.most = self.most.max(want);
            if self.run >= NEED_SHRINK {
                // Twice the most of them: a stack a little deeper than those still reaches a
                // frame to stitch at (at the most, the copy ran short a stack in ten and each
                // time doubled back).
                let to = self.most.saturating_mul(2).min(told);
                *self = Shrink { run: 0, most: 0, before: told };
                return to;
            }
            return told;
        }
        (self.run, self.most) = (0, 0);
        if read_cut && self.before > told {
            return std::mem::take(&mut self.before);
        }
        want.max(told)
    }
}

#[cfg(test)]
mod tests {
    use probe_common::stack::{STACK_OFFCPU, STACK_SAME_KERNEL, STACK_SAME_USER, StackEvent};

    use super::{NEED_SHRINK, Shrink, kernel_frames};

    #[test]
    fn a_stitched_threads_need_shrinks_and_comes_back() {
        let mut s = Shrink::default();
        // Growing as ever: the most of what was told and what this one took.
        assert_eq!(s.next(0, 131072, false, false), 131072);
        // Stitched stacks that took 8 KiB: told stays until NEED_SHRINK of them in a row, then
        // twice that.
        for _ in 1..NEED_SHRINK {
            assert_eq!(s.next(131072, 8192, true, false), 131072);
        }
        assert_eq!(s.next(131072, 8192, true, false), 16384);
        // A stack stitched at 8 KiB keeps 16 KiB (never below what was told but by a run, and a
        // run only of stacks that took less than half).
        assert_eq!(s.next(16384, 8192, true, false), 16384);
        assert_eq!(s.next(16384, 4096, true, false), 16384);
        // Cut by a read past the copy, not stitched: back to what it was.
        assert_eq!(s.next(16384, 16384, false, true), 131072);
        // Once: a read cut after that grows only as any thread's does.
        assert_eq!(s.next(131072, 2048, false, true), 131072);
        // A run broken by an unstitched stack starts again.
        let mut s = Shrink::default();
        for _ in 1..NEED_SHRINK {
            s.next(65536, 4096, true, false);
        }
        assert_eq!(s.next(65536, 65536, false, false), 65536);
        assert_eq!(s.next(65536, 4096, true, false), 65536, "the run starts over");
    }

    #[test]
    fn a_same_kernel_record_takes_the_last_frames() {
        let mut s = StackEvent { what: STACK_OFFCPU, kstack_bytes: 24, ..Default::default() };
        s.kstack[..4].copy_from_slice(&[0xffff_1000, 0xffff_2000, 0xffff_3000, 0xffff_4000]);
        let own = kernel_frames(&s, None);
        assert_eq!(own, [0xffff_1000, 0xffff_2000, 0xffff_3000], "as many frames as the kernel wrote");
        let same = StackEvent { what: STACK_OFFCPU | STACK_SAME_USER | STACK_SAME_KERNEL, kstack_bytes: 0, ..Default::default() };
        assert_eq!(kernel_frames(&same, Some(&own)), own);
        assert!(kernel_frames(&same, None).is_empty(), "the last one is not known: no frames, never another thread's");
        let user_only = StackEvent { what: STACK_OFFCPU | STACK_SAME_USER, ..s };
        assert_eq!(kernel_frames(&user_only, Some(&[1, 2])), own, "only the user stack was left out");
        let failed = StackEvent { kstack_bytes: -14, ..s };
        assert!(kernel_frames(&failed, Some(&own)).is_empty(), "-EFAULT: no kernel stack");
    }
}
