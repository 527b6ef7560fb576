//! Python frames at a stack event: the CPython thread's frame chain, walked from its thread state
//! (see probe_common::python). Every read is a probe read of the target's memory: a torn chain
//! (a frame freed under the walk, a bad pointer) ends the walk and says so, never more.
use aya_ebpf::{
    helpers::generated::{bpf_loop, bpf_probe_read_user},
    macros::map,
    maps::HashMap,
};
use probe_common::{
    Counter, Record,
    python::{PY_CUT_DEPTH, PY_CUT_READ, PY_DEPTH, PY_ENTRY, PY_FRAMES_311, PY_NO_CFRAME, PY_OWNED_BY_CSTACK, PyStackEvent, PyThread},
};

use crate::{COUNTERS, EVENTS, LOST, add, header, now_ns, ringbuf_flags};

#[map(name = "PY_THREADS")]
static PY_THREADS: HashMap<u32, PyThread> = HashMap::with_max_entries(16384, 0);

#[inline(always)]
fn read<T>(at: u64) -> Option<T> {
    let mut v = core::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: a probe read of the target's memory into a local; failure is returned.
    if unsafe { bpf_probe_read_user(v.as_mut_ptr().cast(), core::mem::size_of::<T>() as u32, at as *const _) } != 0 {
        return None;
    }
    // SAFETY: read in full above (plain integers: any bit pattern is valid).
    Some(unsafe { v.assume_init() })
}

/// Send the Python frames of `tid` when it is a CPython thread probe knows.
#[inline(always)]
pub fn send(pid: u32, tid: u32) {
    // SAFETY: the value is copied out at once.
    let Some(t) = (unsafe { PY_THREADS.get(&tid) }).copied() else { return };
    let t0 = now_ns();
    let Some(mut rec) = EVENTS.reserve::<PyStackEvent>(0) else {
        add(&LOST, PyStackEvent::KIND as u32, 1);
        return;
    };
    let ev = rec.as_mut_ptr();
    let (n, cut) = walk(&t, ev);
    // SAFETY: `ev` is the reserved record; the walk wrote frames 0..n.
    unsafe {
        (*ev).hdr = header::<PyStackEvent>(pid, tid);
        (*ev).frames_n = n;
        (*ev).cut = cut;
    }
    rec.submit(ringbuf_flags(core::mem::size_of::<PyStackEvent>() as u64));
    // What the walk cost, for the Python frames' budget (userspace turns them off beyond it).
    add(&COUNTERS, Counter::PyWalks as u32, 1);
    add(&COUNTERS, Counter::PyWalkNs as u32, now_ns().wrapping_sub(t0));
}

/// Walk the chain into `ev`'s frames: (frames written, cut).
#[inline(always)]
fn walk(t: &PyThread, ev: *mut PyStackEvent) -> (u32, u32) {
    let holder = if t.cframe == PY_NO_CFRAME {
        t.tstate
    } else {
        match read::<u64>(t.tstate + u64::from(t.cframe)) {
            Some(c) if c != 0 => c,
            _ => return (0, 0),
        }
    };
    let Some(frame) = read::<u64>(holder + u64::from(t.frame)) else { return (0, PY_CUT_READ) };
    walk_from(frame, t.layout == PY_FRAMES_311, ev)
}

/// The walk's state, on the program's stack, for [`step`].
#[repr(C)]
struct Walk {
    frame: u64,
    ev: *mut PyStackEvent,
    n: u32,
    cut: u32,
    l311: u32,
    _pad: u32,
}

/// The walk by `bpf_loop` (one verification of [`step`] for every program that takes stacks: an
/// unrolled or bounded loop was verified once per iteration and per path into it, 100–200 ms of
/// verifier time per program at arming). A 3.12+ shim frame is sent as `[0, PY_ENTRY]`: the
/// frame before it began its C-level evaluation (userspace folds it).
#[inline(always)]
fn walk_from(frame: u64, l311: bool, ev: *mut PyStackEvent) -> (u32, u32) {
    let mut w = Walk { frame, ev, n: 0, cut: 0, l311: l311 as u32, _pad: 0 };
    // SAFETY: `step` is a BPF function of this object taking (index, ctx); ctx is `w`, alive for
    // the call.
    let done = unsafe { bpf_loop(PY_DEPTH as u32, step as *mut core::ffi::c_void, (&raw mut w).cast(), 0) };
    if done < 0 {
        return (0, PY_CUT_READ);
    }
    if w.cut == 0 && w.frame != 0 && w.n as usize >= PY_DEPTH {
        w.cut = PY_CUT_DEPTH;
    }
    (w.n, w.cut)
}

/// One frame of the walk: 0 to go on, 1 to stop.
#[inline(never)]
extern "C" fn step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: ctx is the caller's `Walk` (walk_from).
    let w = unsafe { &mut *ctx.cast::<Walk>() };
    if w.frame == 0 {
        return 1;
    }
    // The frame's first 72 bytes hold every field read (both layouts).
    let Some(f) = read::<[u64; 9]>(w.frame) else {
        w.cut = PY_CUT_READ;
        return 1;
    };
    let sent = if w.l311 != 0 {
        w.frame = f[6];
        [f[4], f[7] | (u64::from((f[8] >> 32) as u8 != 0) << 63)]
    } else {
        w.frame = f[1];
        if (f[8] >> 48) as u8 == PY_OWNED_BY_CSTACK { [0, PY_ENTRY] } else { [f[0], f[7]] }
    };
    let n = w.n as usize;
    if n >= PY_DEPTH {
        return 1;
    }
    // SAFETY: n < PY_DEPTH: frame n of the reserved record.
    unsafe { (*w.ev).frames[n] = sent };
    w.n += 1;
    0
}
