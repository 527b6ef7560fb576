//! The collector's stack records: each stack sample unwound and written (an off-CPU one once its
//! thread runs again, Python frames merged in), the user-stack bytes each thread needs told to the
//! kernel, and the record naming where cut stacks stop.
use std::collections::HashMap;

use probe_common::stack::{BASE_ANCHORS, StackBase};

use super::{CUT_FRAMES_PER_KIND, CUT_MODULE_MAX, LAST_OFFCPU_STACKS, LAST_USER_STACKS, MAX_CUT_TOPS, State};
use crate::record::{
    self,
    records::{self, UserRecord},
};

/// A thread's last off-CPU stack at one place, for the records that refer to it
/// (STACK_SAME_USER, STACK_SAME_KERNEL): its process, its unwound user stack and its kernel frames.
pub(super) struct LastOffcpu {
    pub pid: u32,
    pub user: crate::kernel::unwind::Unwound,
    pub kernel: Vec<u64>,
}

/// What the collector learned of a thread's outer frames, for [`StackBase`]: the stack words its
/// complete unwinds read alike (address and value) above the highest one where any two differed
/// (`floor`), lowest address first.
pub(super) struct Base {
    pid: u32,
    stable: Vec<(u64, u64)>,
    floor: u64,
    /// What the kernel holds for the thread (None: nothing).
    told: Option<StackBase>,
    /// The last bases told (the current one too), for the records copied under each that are
    /// still in the ring when the next is told.
    history: Vec<StackBase>,
}

/// Bases remembered per thread for the records still in the ring.
const BASE_HISTORY: usize = 4;

/// A base is told to the kernel when the stack it leaves out is at least this large (what each
/// copy then saves): llama-server's `main` holds tens of KiB of locals, its workers none.
const BASE_MIN_SAVED: u64 = 8 << 10;

/// An unwind's reads by address, each once, lowest first.
fn by_address(reads: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut r = reads.to_vec();
    r.sort_unstable();
    r.dedup_by_key(|w| w.0);
    r
}

/// The highest address where two sets of reads (by address, lowest first) differ: read by one
/// only, or with another value (0: they agree).
fn highest_difference(a: &[(u64, u64)], b: &[(u64, u64)]) -> u64 {
    let (mut i, mut j) = (a.len(), b.len());
    while i > 0 && j > 0 {
        let (x, y) = (a[i - 1], b[j - 1]);
        if x != y {
            return x.0.max(y.0);
        }
        i -= 1;
        j -= 1;
    }
    match (i, j) {
        (0, 0) => 0,
        (0, _) => b[j - 1].0,
        _ => a[i - 1].0,
    }
}

/// The kernel's view of a base: its highest stable words (at most BASE_ANCHORS) read in place,
/// the copy reaching every other word this unwind read (`reads`, by address) and the floor.
/// None when that leaves out less than BASE_MIN_SAVED.
fn told_base(stable: &[(u64, u64)], floor: u64, reads: &[(u64, u64)], sp: u64) -> Option<StackBase> {
    let anchors = &stable[stable.len().saturating_sub(BASE_ANCHORS)..];
    let &(lowest, _) = anchors.first()?;
    let copied = reads.iter().map(|r| r.0).filter(|&a| a < lowest).max();
    let top = copied.map_or(sp, |a| a + 8).max(if floor == 0 { sp } else { floor + 8 });
    let end = reads.last().map_or(0, |r| r.0 + 8);
    if end.saturating_sub(top) < BASE_MIN_SAVED {
        return None;
    }
    let mut b = StackBase { top, n: anchors.len() as u32, generation: 0, ..Default::default() };
    for (i, &(slot, value)) in anchors.iter().enumerate() {
        b.slots[i] = slot;
        b.values[i] = value;
    }
    Some(b)
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
        use probe_common::stack::{STACK_SAME_USER, stack_kind, stack_slot};
        let offcpu = stack_kind(s.what) == probe_common::stack::STACK_OFFCPU;
        // Off-CPU stacks are remembered by thread and place (the kernel's slot).
        let place = (s.hdr.tid, stack_slot(s.what) as u8);
        let last = self.last_offcpu.get(&place).filter(|l| l.pid == s.hdr.pid);
        let kernel = kernel_frames(s, last.map(|l| &l.kernel[..]));
        // An off-CPU stack the kernel left out as the same as this thread's last: its frames.
        let u = match last {
            Some(last) if s.what & STACK_SAME_USER != 0 => {
                self.unwinders.reused += 1;
                last.user.clone()
            }
            _ => {
                let anchors = self.anchors(s);
                let u = self.unwinders.unwind(s.hdr.pid, s.ip, s.sp, s.bp, ustack, &anchors);
                if s.what & probe_common::stack::STACK_USER_BASE != 0 {
                    self.unwinders.based += 1;
                    if u.outside {
                        self.base_missed(s.hdr.tid);
                    }
                } else {
                    self.learn_need(s.hdr.tid, &u, ustack.len());
                    self.learn_base(s, &u);
                }
                if offcpu {
                    // Threads that exited leave entries until their process does: bounded like
                    // the kernel's map (a thread forgotten here is unwound from its ip alone once).
                    if self.last_offcpu.len() >= LAST_OFFCPU_STACKS && !self.last_offcpu.contains_key(&place) {
                        self.last_offcpu.clear();
                    }
                    let last = LastOffcpu {
                        pid: s.hdr.pid,
                        user: crate::kernel::unwind::Unwound { reads: Vec::new(), ..u.clone() },
                        kernel: Vec::new(),
                    };
                    self.last_offcpu.insert(place, last);
                }
                u
            }
        };
        if offcpu && let Some(last) = self.last_offcpu.get_mut(&place) {
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
                offcpu,
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

    /// The words of `tid`'s stack the kernel read in place for a record copied up to its base.
    fn anchors(&self, s: &probe_common::stack::StackEvent) -> Vec<(u64, u64)> {
        if s.what & probe_common::stack::STACK_USER_BASE == 0 {
            return Vec::new();
        }
        let generation = probe_common::stack::base_gen(s.what);
        let b = self.bases.get(&s.hdr.tid).filter(|b| b.pid == s.hdr.pid);
        let told = b.and_then(|b| b.history.iter().find(|t| t.generation == generation));
        told.map(|t| (0..t.n as usize).map(|i| (t.slots[i], t.values[i])).collect()).unwrap_or_default()
    }

    /// A record copied up to its thread's base whose unwind needed a word the copy left out: the
    /// thread's frames changed there in a way the words checked in place do not show. The base is
    /// forgotten here and in the kernel (its last ones kept for the records still in the ring):
    /// the next copies are whole, and it is learned again.
    fn base_missed(&mut self, tid: u32) {
        self.unwinders.base_missed += 1;
        if let Some(b) = self.bases.get_mut(&tid) {
            b.stable.clear();
            b.floor = 0;
            if b.told.take().is_some()
                && let Some(map) = self.ustack_base.as_mut()
            {
                let _ = map.remove(&tid);
            }
        }
    }

    /// Learn a thread's base from a complete unwind of a whole copy: the words it read alike with
    /// the thread's earlier ones above the highest word where they differed (the same values at
    /// the same addresses: the same live outer frames). Once two unwinds agree and that leaves
    /// out at least BASE_MIN_SAVED, the kernel is told: it copies up to the floor and reads the
    /// highest BASE_ANCHORS stable words in place.
    fn learn_base(&mut self, s: &probe_common::stack::StackEvent, u: &crate::kernel::unwind::Unwound) {
        let Some(map) = self.ustack_base.as_mut() else { return };
        if !u.complete || u.reads.is_empty() {
            return;
        }
        let tid = s.hdr.tid;
        let reads = by_address(&u.reads);
        let Some(b) = self.bases.get_mut(&tid).filter(|b| b.pid == s.hdr.pid) else {
            if self.bases.len() >= super::LAST_USER_STACKS {
                for (tid, b) in self.bases.drain() {
                    if b.told.is_some() {
                        let _ = map.remove(&tid);
                    }
                }
            }
            self.bases.insert(tid, Base { pid: s.hdr.pid, stable: reads, floor: 0, told: None, history: Vec::new() });
            return;
        };
        if b.stable.is_empty() {
            // Forgotten after a miss: learned again from here.
            b.stable = reads;
            return;
        }
        b.floor = b.floor.max(highest_difference(&b.stable, &reads));
        b.stable.retain(|w| w.0 > b.floor);
        let want = if b.stable.is_empty() {
            // Nothing in common: the thread's outer frames changed; learn them anew.
            b.stable = reads;
            b.floor = 0;
            None
        } else {
            told_base(&b.stable, b.floor, &reads, s.sp)
        };
        let same = |w: &StackBase, t: &StackBase| StackBase { generation: t.generation, ..*w } == *t;
        match (want, b.told) {
            (Some(w), Some(t)) if same(&w, &t) => {}
            (None, None) => {}
            (Some(mut w), _) => {
                self.base_generation = self.base_generation % 0xffff + 1;
                w.generation = self.base_generation;
                if map.insert(tid, w, 0).is_ok() {
                    log::debug!("thread {tid}: stacks copied {} bytes above sp, {} words read in place", w.top.saturating_sub(s.sp), w.n);
                    if b.history.len() >= BASE_HISTORY {
                        b.history.remove(0);
                    }
                    b.history.push(w);
                    b.told = Some(w);
                }
            }
            (None, Some(_)) => {
                if map.remove(&tid).is_ok() {
                    b.told = None;
                }
            }
        }
    }

    /// Tell the kernel how many user-stack bytes `tid`'s stacks need, from what unwinding this
    /// one used: a quarter more, in powers of two from 1 KiB, only ever growing; double when the
    /// unwinder ran out of bytes. The copy is most of a stack sample's cost in the kernel
    /// (64 KiB for 18 us; llama-server's workers unwind in 2 KiB).
    fn learn_need(&mut self, tid: u32, u: &crate::kernel::unwind::Unwound, given: usize) {
        let Some(map) = self.ustack_need.as_mut() else { return };
        let cap = probe_common::stack::USTACK_CAP as u64;
        let class = |b: u64| b.next_power_of_two().clamp(1024, cap + 8).min(cap) as u32;
        let told = self.need_told.get(&tid).copied().unwrap_or(0);
        let want = if u.short { class(given as u64 * 2) } else { class(u.used_bytes + u.used_bytes / 4) };
        if want <= told || (!u.short && u.used_bytes == 0) {
            return;
        }
        if self.need_told.len() >= LAST_USER_STACKS && !self.need_told.contains_key(&tid) {
            self.need_told.clear();
        }
        if map.insert(tid, want, 0).is_ok() {
            log::debug!("thread {tid}: user stacks need {want} bytes (used {}, short {}, given {given})", u.used_bytes, u.short);
            self.need_told.insert(tid, want);
        }
    }
}

#[cfg(test)]
mod tests {
    use probe_common::stack::{STACK_OFFCPU, STACK_SAME_KERNEL, STACK_SAME_USER, StackEvent};

    use super::{by_address, highest_difference, kernel_frames, told_base};

    /// Reads of a thread whose `main` holds 40 KiB of locals: main's and the C library's words
    /// at the top, then the words of the frames under main (`inner`: return addresses by slot).
    fn unwind_reads(inner: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let top = 0x7fff_0001_0000u64;
        let mut r = vec![(top - 8, 0x1111), (top - 0x40, 0x2222), (top - 0x48, 0x7fff_0001_0000), (top - 0xa000, 0x3333)];
        r.extend_from_slice(inner);
        by_address(&r)
    }

    #[test]
    fn a_base_is_the_words_two_unwinds_read_alike_above_where_they_differ() {
        let top = 0x7fff_0001_0000u64;
        let at = top - 0xa010;
        // Two samples under different callees of main: the return address into main's callee
        // (at `at`) differs, everything above it is the same.
        let a = unwind_reads(&[(at, 0xaaaa), (at - 0x40, 0x4444), (at - 0x80, 0x5555)]);
        let b = unwind_reads(&[(at, 0xbbbb), (at - 0x30, 0x6666)]);
        assert_eq!(highest_difference(&a, &b), at);
        assert_eq!(highest_difference(&a, &a), 0, "the same reads agree everywhere");
        let shorter = &a[1..];
        assert_eq!(highest_difference(&a, shorter), a[0].0, "a word read by one only is a difference");
        let stable: Vec<_> = a.iter().copied().filter(|w| w.0 > at).collect();
        let base = told_base(&stable, at, &b, at - 0x30).expect("main's 40 KiB are worth leaving out");
        // The copy reaches the word that differed (and every other word under the anchors); the
        // anchors are main's and the C library's words, read in place.
        assert_eq!(base.top, at + 8);
        assert_eq!(base.n, 4);
        assert_eq!(&base.slots[..4], &[top - 0xa000, top - 0x48, top - 0x40, top - 8]);
        assert_eq!(&base.values[..4], &[0x3333, 0x7fff_0001_0000, 0x2222, 0x1111]);
        // A worker whose whole stack is a few frames: nothing worth leaving out.
        let w = [(0x1000, 1), (0x1040, 2), (0x1100, 3)];
        assert!(told_base(&w, 0, &w, 0xff0).is_none());
    }

    #[test]
    fn a_base_names_at_most_eight_words_and_copies_the_rest() {
        // Twelve stable words 0x100 apart up to 48 KiB above sp, nothing differed yet.
        let sp = 0x10_0000u64;
        let reads: Vec<(u64, u64)> = (0..12).map(|i| (sp + 0x100 * i + if i == 11 { 0xc000 } else { 0 }, i)).collect();
        let b = told_base(&reads, 0, &reads, sp).unwrap();
        assert_eq!(b.n, 8);
        assert_eq!(b.slots[0], reads[4].0, "the highest eight");
        assert_eq!(b.top, reads[3].0 + 8, "the copy reaches the highest word that is not read in place");
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
