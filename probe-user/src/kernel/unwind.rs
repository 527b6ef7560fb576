//! User-stack unwinding from `.eh_frame` with framehop, for binaries without frame pointers
//! (real servers): the modules of a process come from /proc/PID/maps, their unwind sections from
//! the ELF files, the stack bytes from the sample. Addresses leave here as (module, file offset)
//! so they can be symbolized after the process is gone.
//!
//! framehop does not evaluate CFA expressions. GCC emits one for functions that realign the
//! stack (AVX code, e.g. all of ggml's compute kernels): the DRAP pattern, CFA = *(rbp - 24).
//! framehop then falls back to frame pointers and the next frame reads a wrong slot; those
//! frames are stepped here instead, with the rule read by gimli.
use std::{collections::HashMap, ops::Range, sync::Arc};

use framehop::{
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};
use object::{Object, ObjectSection, ObjectSegment};

use crate::{
    os::procfs::{self, Mapping},
    os::target_file,
};

/// Frames kept per stack at most.
pub const MAX_FRAMES: usize = 128;

/// The most bytes of unwind sections (`.text`, `.eh_frame`, `.eh_frame_hdr` copies) kept for
/// every traced process together: a target that maps many distinct executables cannot grow
/// probe without bound. A module past it is unwound without (its frames end the stack there),
/// and counted. `.text` only helps (framehop's look at a prologue or epilogue; `.eh_frame`
/// already says how to step every instruction) and is most of the bytes (libtorch_cpu.so's is
/// 267 MiB, its `.eh_frame` 16 MiB): it may take at most [`TEXT_SHARE`] of the budget, so that
/// the modules mapped later (a Python server's own interpreter among a hundred of torch's
/// libraries) still have their CFI. Sections are released when no process maps their file any more (unmapped, or
/// the process exited). `PROBE_UNWIND_BUDGET` (bytes) sets another.
pub const UNWIND_BUDGET: u64 = 256 << 20;

/// The part of the budget `.text` copies may take, all modules together.
pub const TEXT_SHARE: u64 = 4;

fn unwind_budget() -> u64 {
    std::env::var("PROBE_UNWIND_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(UNWIND_BUDGET)
}

/// Unwind sections of one ELF file, shared by every process that maps it.
struct Elf {
    /// PT_LOAD segments: (vaddr, file offset, file size).
    segments: Vec<(u64, u64, u64)>,
    text: Option<(Range<u64>, Arc<[u8]>)>,
    eh_frame: Option<(Range<u64>, Arc<[u8]>)>,
    eh_frame_hdr: Option<(Range<u64>, Arc<[u8]>)>,
    got: Option<Range<u64>>,
}

impl Elf {
    /// Bytes of the sections copied.
    fn bytes(&self) -> u64 {
        [&self.text, &self.eh_frame, &self.eh_frame_hdr].iter().filter_map(|s| s.as_ref()).map(|s| s.1.len() as u64).sum()
    }

    /// Bytes of its `.text` copy.
    fn text_bytes(&self) -> u64 {
        self.text.as_ref().map_or(0, |t| t.1.len() as u64)
    }
}

/// Why a module's unwind sections were not loaded.
enum NotLoaded {
    /// Not readable as the mapped ELF file (said in the log).
    Unreadable,
    /// Its sections would pass the budget (`bytes` of them).
    OverBudget(u64),
}

/// The unwind sections of the file `m` maps in `pid`, opened through crate::os::target_file (the
/// mapped file itself, regular, at most 4 GiB) and read on demand (object's ReadCache): only the
/// headers and the sections kept here, never the whole file. Not mmapped: the target could truncate the file
/// under the mapping, and the next read would kill probe with SIGBUS.
/// Only `room` bytes of sections may be read, of them at most `text_room` of `.text` (left out
/// past it): the section headers say their sizes first.
fn load_elf(pid: u32, m: &Mapping, room: u64, text_room: u64) -> Result<Elf, NotLoaded> {
    let f = match target_file::open_mapping(Some(pid), m, target_file::MAX_ELF_BYTES) {
        Ok(f) => f,
        Err(e) => {
            log::info!("unwinding without {}: {e}", m.path);
            return Err(NotLoaded::Unreadable);
        }
    };
    let cache = object::ReadCache::new(f.file);
    let file = object::File::parse(&cache).map_err(|_| NotLoaded::Unreadable)?;
    let size = |name: &str| file.section_by_name(name).map_or(0, |s| s.size());
    let cfi = size(".eh_frame") + size(".eh_frame_hdr");
    if cfi > room {
        return Err(NotLoaded::OverBudget(cfi));
    }
    let with_text = size(".text") <= text_room.min(room - cfi);
    let section = |name: &str| {
        let s = file.section_by_name(name)?;
        let bytes = s.data().ok()?;
        Some((s.address()..s.address() + s.size(), Arc::<[u8]>::from(bytes)))
    };
    Ok(Elf {
        segments: file.segments().map(|s| (s.address(), s.file_range().0, s.file_range().1)).collect(),
        text: if with_text { section(".text") } else { None },
        eh_frame: section(".eh_frame"),
        eh_frame_hdr: section(".eh_frame_hdr"),
        got: file.section_by_name(".got").map(|s| s.address()..s.address() + s.size()),
    })
}

struct Proc {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    cache: CacheX86_64,
    maps: Vec<Mapping>,
    /// Executable mappings: address range, ELF, load bias.
    modules: Vec<(Range<u64>, Arc<Elf>, u64)>,
}

/// A frame whose CFA is `*(rbp + cfa)`: the return address is at CFA + `ra`, the caller's rbp
/// at `*(rbp + rbp)` (expression rule) or CFA + offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrapRule {
    pub cfa: i64,
    pub ra: i64,
    pub rbp: SavedRbp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedRbp {
    AtRbpPlus(i64),
    AtCfaPlus(i64),
    Same,
}

/// `DW_OP_breg6 <sleb128>` optionally followed by `DW_OP_deref`: (offset, deref).
fn breg6(expr: &[u8]) -> Option<(i64, bool)> {
    let (&op, mut rest) = expr.split_first()?;
    if op != 0x76 {
        return None;
    }
    let (mut value, mut shift) = (0i64, 0);
    loop {
        let (&b, r) = rest.split_first()?;
        rest = r;
        value |= ((b & 0x7f) as i64) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            if shift < 64 && b & 0x40 != 0 {
                value |= -1i64 << shift;
            }
            break;
        }
    }
    match rest {
        [] => Some((value, false)),
        [0x06] => Some((value, true)),
        _ => None,
    }
}

/// The DRAP rule at `svma` in `elf`, if its CFA is an expression of that shape.
fn drap_rule(elf: &Elf, svma: u64) -> Option<DrapRule> {
    use gimli::{BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, RegisterRule, UnwindContext, UnwindSection, X86_64};
    let (hdr_svma, hdr) = elf.eh_frame_hdr.as_ref()?;
    let (frame_svma, frame) = elf.eh_frame.as_ref()?;
    let mut bases = BaseAddresses::default().set_eh_frame_hdr(hdr_svma.start).set_eh_frame(frame_svma.start);
    if let Some((text, _)) = &elf.text {
        bases = bases.set_text(text.start);
    }
    let eh_frame = EhFrame::new(frame, LittleEndian);
    let parsed = EhFrameHdr::new(hdr, LittleEndian).parse(&bases, 8).ok()?;
    let fde = parsed.table()?.fde_for_address(&eh_frame, &bases, svma, EhFrame::cie_from_offset).ok()?;
    let mut ctx = UnwindContext::new();
    let row = fde.unwind_info_for_address(&eh_frame, &bases, &mut ctx, svma).ok()?;
    let CfaRule::Expression(e) = row.cfa() else { return None };
    let (cfa, true) = breg6(e.get(&eh_frame).ok()?.0.slice())? else { return None };
    let ra = match row.register(X86_64::RA) {
        Some(RegisterRule::Offset(o)) => o,
        _ => return None,
    };
    let rbp = match row.register(X86_64::RBP) {
        Some(RegisterRule::Expression(e)) => match breg6(e.get(&eh_frame).ok()?.0.slice())? {
            (o, false) => SavedRbp::AtRbpPlus(o),
            _ => return None,
        },
        Some(RegisterRule::Offset(o)) => SavedRbp::AtCfaPlus(o),
        _ => SavedRbp::Same,
    };
    Some(DrapRule { cfa, ra, rbp })
}

/// A read this far past the copied stack bytes or less counts as the copy being too short.
const SHORT_REACH: usize = 16 << 10;

/// One frame: a module id and a file offset, or (-1, absolute address) outside any file.
pub type Frame = (i64, u64);

#[derive(Clone, Debug, Default)]
pub struct Unwound {
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// The unwinder reached the end of the stack (not cut by missing unwind info or stack bytes).
    pub complete: bool,
    /// Stack bytes (from sp) the unwinder read: what a copy of this thread's stack needs.
    pub used_bytes: u64,
    /// It stopped on a read past the bytes it was given (a larger copy would have gone further).
    pub short: bool,
    /// Why it stopped short of the end of the stack (None: complete).
    pub cut: Option<crate::record::Cut>,
    /// The bytes a copy needs for this stack when the frames it shares with one of the thread's
    /// last whole stacks are taken from that one ([`Outer`]; stitched: `used_bytes`; None: no
    /// last whole stack, or this one is cut).
    pub stitch_bytes: Option<u64>,
}

/// A thread's last whole stacks: each frame's lookup address and stack pointer (its callee's
/// CFA), innermost first. A later stack cut at a frame found here, at the same address and the
/// same stack pointer, is inside the same call of that frame: its callers are the same, and
/// are taken from here. A thread spends its life under the same outer frames (llama-server's
/// main thread under `llama_server()` and frames of tens of KiB: 80 KiB from its samples to its
/// stack's end): the copy then need only reach the frames that change, a few KiB.
/// The last few distinct ones are kept ([`OUTER_STACKS`]): a thread's calls from one frame to
/// the next come from a few places (a server loop's decode, its sampling, its tokenizing).
struct Outer {
    pid: u32,
    stacks: Vec<Vec<(u64, u64)>>,
}

/// A thread's last whole stacks kept, distinct, most recent first.
const OUTER_STACKS: usize = 8;

/// Threads whose last whole stack is kept ([`Outer`]); past it, all are forgotten at once.
const OUTER_THREADS: usize = 4096;

/// Unwinders for every traced process, and the table of modules (file paths) frames refer to.
#[derive(Default)]
pub struct Unwinders {
    procs: HashMap<u32, Proc>,
    elves: HashMap<(String, u64), Option<Arc<Elf>>>,
    /// DRAP rules by (ELF, svma), looked up once.
    drap: HashMap<(usize, u64), Option<DrapRule>>,
    module_ids: HashMap<String, i64>,
    /// Modules assigned an id since the last call to `take_new_modules`.
    new_modules: Vec<(i64, String)>,
    pub samples: u64,
    pub complete: u64,
    /// Off-CPU stacks whose user part the kernel left out as the thread's last one: its frames
    /// were reused, nothing was unwound.
    pub reused: u64,
    /// Time spent unwinding, ns (module loading excluded: see `load_nanos`).
    pub nanos: u64,
    /// Time spent reading ELF files and building unwinders, ns (once per process and mapping change).
    pub load_nanos: u64,
    /// Bytes of unwind sections held now, of them `.text` copies, and the most allowed
    /// ([`UNWIND_BUDGET`]; 0: not read yet).
    held: u64,
    held_text: u64,
    budget: u64,
    /// Distinct modules unwound without their sections because of the budget.
    pub left_out: u64,
    /// Processes that exited, released a while later (their samples may still be in the ring).
    exited: Vec<(u32, std::time::Instant)>,
    /// Each thread's last whole stacks ([`Outer`]).
    outer: HashMap<u32, Outer>,
}

/// How long an exited process's unwinder is kept for its samples still in the ring buffer.
const KEEP_EXITED: std::time::Duration = std::time::Duration::from_secs(2);

impl Unwinders {
    /// Build the unwinder of `pid` now (at attach), so the first samples do not pay for it.
    pub fn prepare(&mut self, pid: u32) {
        if !self.procs.contains_key(&pid) {
            let l = std::time::Instant::now();
            self.proc(pid);
            self.load_nanos += l.elapsed().as_nanos() as u64;
        }
    }

    /// The mappings of `pid` changed: rebuild its unwinder now, while the process surely exists
    /// (samples already in the ring buffer may be read after it exited).
    pub fn update(&mut self, pid: u32, maps: &[Mapping]) {
        let l = std::time::Instant::now();
        // Only code is unwound: a change of the other file mappings (a model mapped, a file
        // mapped to read) keeps the unwinder and its cache (rebuilding it at every mapping
        // change was most of probe's CPU in the second after attach).
        fn code(ms: &[Mapping]) -> impl Iterator<Item = &Mapping> {
            ms.iter().filter(|m| m.perms.contains('x'))
        }
        if let Some(p) = self.procs.get_mut(&pid)
            && code(&p.maps).eq(code(maps))
        {
            p.maps = maps.to_vec();
            return;
        }
        // The new unwinder is built while the old one still holds its sections (they are shared by
        // file, not reloaded); what only the old one held is released after.
        let p = self.build(pid, maps.to_vec());
        self.procs.insert(pid, p);
        self.release();
        self.load_nanos += l.elapsed().as_nanos() as u64;
    }

    /// `pid` exited: its unwinder goes (a little later), and with it the sections no other
    /// process maps.
    pub fn exited(&mut self, pid: u32) {
        let now = std::time::Instant::now();
        let (gone, keep): (Vec<_>, Vec<_>) = self.exited.drain(..).partition(|(_, t)| now.duration_since(*t) >= KEEP_EXITED);
        self.exited = keep;
        self.exited.push((pid, now));
        if !gone.is_empty() {
            for (p, _) in gone {
                self.procs.remove(&p);
                self.outer.retain(|_, o| o.pid != p);
            }
            self.release();
        }
    }

    /// Drop the sections no process maps any more (and the DRAP rules read from them).
    fn release(&mut self) {
        self.elves.retain(|_, e| e.as_ref().is_none_or(|a| Arc::strong_count(a) > 1));
        let live: std::collections::HashSet<usize> = self.elves.values().flatten().map(|a| Arc::as_ptr(a) as usize).collect();
        self.drap.retain(|(elf, _), _| live.contains(elf));
        self.held = self.elves.values().flatten().map(|a| a.bytes()).sum();
        self.held_text = self.elves.values().flatten().map(|a| a.text_bytes()).sum();
    }

    /// Bytes of unwind sections held now.
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    pub fn take_new_modules(&mut self) -> Vec<(i64, String)> {
        std::mem::take(&mut self.new_modules)
    }

    fn module_id(&mut self, path: &str) -> i64 {
        if let Some(&id) = self.module_ids.get(path) {
            return id;
        }
        let id = self.module_ids.len() as i64;
        self.module_ids.insert(path.to_string(), id);
        self.new_modules.push((id, path.to_string()));
        id
    }

    fn proc(&mut self, pid: u32) -> &mut Proc {
        if !self.procs.contains_key(&pid) {
            let p = self.build(pid, procfs::read_maps(pid).unwrap_or_default());
            self.procs.insert(pid, p);
        }
        self.procs.get_mut(&pid).expect("inserted above")
    }

    /// The unwind sections of the file `m` maps, loaded once while the budget allows.
    fn elf(&mut self, pid: u32, m: &Mapping) -> Option<Arc<Elf>> {
        let key = (m.path.clone(), m.inode);
        if let Some(e) = self.elves.get(&key) {
            return e.clone();
        }
        if self.budget == 0 {
            self.budget = unwind_budget();
        }
        let room = |u: &Self| (u.budget.saturating_sub(u.held), (u.budget / TEXT_SHARE).saturating_sub(u.held_text));
        let (all, text) = room(self);
        let mut got = load_elf(pid, m, all, text);
        if matches!(got, Err(NotLoaded::OverBudget(_))) {
            // What nobody maps any more may make room.
            self.release();
            let (all, text) = room(self);
            got = load_elf(pid, m, all, text);
        }
        let elf = match got {
            Ok(e) => Some(Arc::new(e)),
            Err(NotLoaded::OverBudget(bytes)) => {
                self.left_out += 1;
                log::info!(
                    "unwinding without {}: its {} KiB of unwind sections would pass the budget ({} MiB held of {} MiB)",
                    m.path,
                    bytes >> 10,
                    self.held >> 20,
                    self.budget >> 20
                );
                None
            }
            Err(NotLoaded::Unreadable) => None,
        };
        self.held += elf.as_ref().map_or(0, |e| e.bytes());
        self.held_text += elf.as_ref().map_or(0, |e| e.text_bytes());
        self.elves.insert(key, elf.clone());
        elf
    }

    fn build(&mut self, pid: u32, maps: Vec<Mapping>) -> Proc {
        {
            let mut unwinder = UnwinderX86_64::new();
            let mut modules = Vec::new();
            for m in maps.iter().filter(|m| m.perms.contains('x')) {
                let Some(elf) = self.elf(pid, m) else { continue };
                // The load segment this mapping comes from gives the load bias.
                let Some(&(vaddr, off, _)) = elf.segments.iter().find(|(_, off, size)| *off <= m.offset && m.offset < off + size.max(&1))
                else {
                    continue;
                };
                let bias = m.start.wrapping_sub(vaddr + (m.offset - off));
                let info = ExplicitModuleSectionInfo {
                    base_svma: 0,
                    text_svma: elf.text.as_ref().map(|t| t.0.clone()),
                    text: elf.text.as_ref().map(|t| t.1.clone()),
                    got_svma: elf.got.clone(),
                    eh_frame_svma: elf.eh_frame.as_ref().map(|t| t.0.clone()),
                    eh_frame: elf.eh_frame.as_ref().map(|t| t.1.clone()),
                    eh_frame_hdr_svma: elf.eh_frame_hdr.as_ref().map(|t| t.0.clone()),
                    eh_frame_hdr: elf.eh_frame_hdr.as_ref().map(|t| t.1.clone()),
                    ..Default::default()
                };
                unwinder.add_module(Module::new(m.path.clone(), m.start..m.end, bias, info));
                modules.push((m.start..m.end, elf.clone(), bias));
            }
            Proc { unwinder, cache: CacheX86_64::new(), maps, modules }
        }
    }

    /// Unwind one sample: user registers and the stack bytes copied from `sp` upwards.
    /// `tid`'s last whole stack stands in for the outer frames a shorter copy did not reach
    /// ([`Outer`]).
    pub fn unwind(&mut self, pid: u32, tid: u32, ip: u64, sp: u64, bp: u64, stack: &[u8]) -> Unwound {
        let t = std::time::Instant::now();
        let load_before = self.load_nanos;
        let mut addrs = Vec::new();
        // The stack pointer at each frame (its callee's CFA), beside `addrs`.
        let mut sps = Vec::new();
        // The stack bytes read before each frame was reached, beside `addrs`.
        let mut used_at = Vec::new();
        let mut stitched = false;
        let (mut complete, mut short, mut bad_read) = (false, false, false);
        let used = std::cell::Cell::new(0u64);
        let mut stitch_bytes = None;
        if ip != 0 {
            if !self.procs.contains_key(&pid) {
                let l = std::time::Instant::now();
                self.proc(pid);
                self.load_nanos += l.elapsed().as_nanos() as u64;
            }
            let p = self.procs.get_mut(&pid).expect("built above");
            let drap = &mut self.drap;
            let (short, bad_read) = (&mut short, &mut bad_read);
            let mut read_stack = |addr: u64| -> Result<u64, ()> {
                let Some(off) = addr.checked_sub(sp).map(|o| o as usize) else {
                    *bad_read = true;
                    return Err(());
                };
                let Some(b) = stack.get(off..off + 8) else {
                    // Just past the copy (within what one more frame takes): more bytes would
                    // have answered it. Reads far beyond come from a wrong rule, not a short copy.
                    if off < stack.len() + SHORT_REACH {
                        *short = true;
                    } else {
                        *bad_read = true;
                    }
                    return Err(());
                };
                used.set(used.get().max(off as u64 + 8));
                Ok(u64::from_le_bytes(b.try_into().map_err(|_| ())?))
            };
            let mut regs = UnwindRegsX86_64::new(ip, sp, bp);
            let mut frame = FrameAddress::from_instruction_pointer(ip);
            while addrs.len() < MAX_FRAMES {
                let lookup = frame.address_for_lookup();
                addrs.push(lookup);
                sps.push(regs.sp());
                used_at.push(used.get());
                let rule = p.modules.iter().find(|(r, _, _)| r.contains(&lookup)).and_then(|(_, elf, bias)| {
                    let svma = lookup.wrapping_sub(*bias);
                    *drap.entry((Arc::as_ptr(elf) as usize, svma)).or_insert_with(|| drap_rule(elf, svma))
                });
                let next = match rule {
                    Some(r) => step_drap(&r, &mut regs, &mut read_stack),
                    None => p.unwinder.unwind_frame(frame, &mut regs, &mut p.cache, &mut read_stack).map_err(|_| ()),
                };
                match next {
                    Ok(Some(ra)) => match FrameAddress::from_return_address(ra) {
                        Some(f) => frame = f,
                        None => {
                            complete = true;
                            break;
                        }
                    },
                    Ok(None) => {
                        complete = true;
                        break;
                    }
                    Err(()) => {
                        // Cut here (the copy ended, a read failed): the thread's last whole
                        // stack passed this same frame, at this same place and stack pointer,
                        // so the frames above it are the ones it had then.
                        let here = addrs.last().copied().zip(sps.last().copied());
                        if let Some(o) = self.outer.get(&tid).filter(|o| o.pid == pid)
                            && let Some((f, i)) = o.stacks.iter().find_map(|f| Some((f, f.iter().position(|&x| Some(x) == here)?)))
                        {
                            let tail = &f[i + 1..];
                            let room = MAX_FRAMES.saturating_sub(addrs.len());
                            addrs.extend(tail.iter().take(room).map(|f| f.0));
                            sps.extend(tail.iter().take(room).map(|f| f.1));
                            (complete, stitched) = (true, true);
                            stitch_bytes = Some(used.get());
                        }
                        break;
                    }
                }
            }
            if complete && !stitched {
                // What a copy reaching only the frames below those it shares with the last whole
                // stack would have taken (at least one frame's step): the copy a stitch needs.
                stitch_bytes = self.outer.get(&tid).filter(|o| o.pid == pid).map(|o| {
                    let shared = |f: &Vec<(u64, u64)>| {
                        addrs.iter().zip(&sps).rev().zip(f.iter().rev()).take_while(|((a, s), f)| (**a, **s) == **f).count()
                    };
                    let shared = o.stacks.iter().map(shared).max().unwrap_or(0);
                    used_at.get(addrs.len().saturating_sub(shared).max(1)).copied().unwrap_or(used.get())
                });
            }
            // Kept, most recent first; the one kept last again (a thread sampled where it was)
            // costs a comparison, not a copy.
            let latest = |o: &Outer| {
                o.pid == pid && o.stacks.first().is_some_and(|f| f.iter().copied().eq(addrs.iter().copied().zip(sps.iter().copied())))
            };
            if complete && !self.outer.get(&tid).is_some_and(latest) {
                if self.outer.len() >= OUTER_THREADS && !self.outer.contains_key(&tid) {
                    self.outer.clear();
                }
                let frames: Vec<(u64, u64)> = addrs.iter().copied().zip(sps.iter().copied()).collect();
                let o = self.outer.entry(tid).or_insert_with(|| Outer { pid, stacks: Vec::new() });
                if o.pid != pid {
                    *o = Outer { pid, stacks: Vec::new() };
                }
                o.stacks.retain(|f| *f != frames);
                o.stacks.insert(0, frames);
                o.stacks.truncate(OUTER_STACKS);
            }
        }
        let frames = self.frames(pid, &addrs);
        self.samples += 1;
        self.complete += complete as u64;
        self.nanos += (t.elapsed().as_nanos() as u64).saturating_sub(self.load_nanos - load_before);
        let cut = match (complete, short, bad_read) {
            // No user stack (a kernel-only sample): nothing was cut.
            _ if ip == 0 => None,
            (true, ..) => None,
            (false, true, _) => Some(crate::record::Cut::Bytes),
            (false, false, true) => Some(crate::record::Cut::Read),
            // No read failed: the unwinder had no rule (CFI) for the frame.
            (false, false, false) => Some(crate::record::Cut::Cfi),
        };
        Unwound { frames, complete, used_bytes: used.get(), short: short && !complete, cut, stitch_bytes }
    }

    /// Absolute addresses → (module id, file offset) with the process's current mappings.
    fn frames(&mut self, pid: u32, addrs: &[u64]) -> Vec<Frame> {
        let maps = self.procs.get(&pid).map(|p| p.maps.clone()).unwrap_or_default();
        addrs
            .iter()
            .map(|&a| match maps.iter().find(|m| m.start <= a && a < m.end) {
                Some(m) => (self.module_id(&m.path), a - m.start + m.offset),
                None => (-1, a),
            })
            .collect()
    }
}

/// One step through a DRAP frame: CFA = *(rbp + cfa), return address at CFA + ra.
fn step_drap(r: &DrapRule, regs: &mut UnwindRegsX86_64, read: &mut impl FnMut(u64) -> Result<u64, ()>) -> Result<Option<u64>, ()> {
    let bp = regs.bp();
    let cfa = read(bp.wrapping_add_signed(r.cfa))?;
    let ra = read(cfa.wrapping_add_signed(r.ra))?;
    let caller_bp = match r.rbp {
        SavedRbp::AtRbpPlus(o) => read(bp.wrapping_add_signed(o))?,
        SavedRbp::AtCfaPlus(o) => read(cfa.wrapping_add_signed(o))?,
        SavedRbp::Same => bp,
    };
    if cfa <= regs.sp() {
        return Err(()); // the stack grows down: a caller's frame is above
    }
    regs.set_sp(cfa);
    regs.set_bp(caller_bp);
    Ok(if ra == 0 { None } else { Some(ra) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_breg6_expressions() {
        // DW_OP_breg6 -24; DW_OP_deref (GCC's DRAP CFA) and DW_OP_breg6 0.
        assert_eq!(breg6(&[0x76, 0x68, 0x06]), Some((-24, true)));
        assert_eq!(breg6(&[0x76, 0x00]), Some((0, false)));
        assert_eq!(breg6(&[0x76, 0x80, 0x01]), Some((128, false)));
        assert_eq!(breg6(&[0x77, 0x00]), None);
        assert_eq!(breg6(&[0x76, 0x68, 0x06, 0x06]), None);
    }

    /// The `.text` copy is left out past its share, the CFI kept: the unwinder of this very
    /// test binary, from its own mapping.
    #[test]
    fn text_past_its_share_is_left_out_and_the_cfi_kept() {
        let me = std::process::id();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let maps = procfs::read_maps(me).unwrap();
        let m = maps.iter().find(|m| m.perms.contains('x') && std::path::Path::new(&m.path) == exe).unwrap();
        let full = load_elf(me, m, u64::MAX, u64::MAX).ok().unwrap();
        assert!(full.text.is_some() && full.eh_frame.is_some() && full.eh_frame_hdr.is_some());
        let lean = load_elf(me, m, u64::MAX, full.text_bytes() - 1).ok().unwrap();
        assert!(lean.text.is_none() && lean.eh_frame.is_some() && lean.eh_frame_hdr.is_some());
        assert_eq!(lean.bytes(), full.bytes() - full.text_bytes());
        // Room for the CFI but not its text: loaded without; not even for the CFI: over budget.
        let cfi = lean.bytes();
        assert!(load_elf(me, m, cfi, u64::MAX).is_ok_and(|e| e.text.is_none()));
        assert!(matches!(load_elf(me, m, cfi - 1, u64::MAX), Err(NotLoaded::OverBudget(b)) if b == cfi));
    }

    #[test]
    fn steps_through_a_realigned_frame() {
        // rbp = 0x1000; *(rbp - 24) = CFA 0x1040; return address at CFA - 8; caller rbp at *rbp.
        let mem: HashMap<u64, u64> = [(0x1000 - 24, 0x1040), (0x1040 - 8, 0x4000_1234), (0x1000, 0x2000)].into();
        let mut read = |a: u64| mem.get(&a).copied().ok_or(());
        let mut regs = UnwindRegsX86_64::new(0x4000_0000, 0x0f00, 0x1000);
        let rule = DrapRule { cfa: -24, ra: -8, rbp: SavedRbp::AtRbpPlus(0) };
        assert_eq!(step_drap(&rule, &mut regs, &mut read), Ok(Some(0x4000_1234)));
        assert_eq!((regs.sp(), regs.bp()), (0x1040, 0x2000));
    }
}
