//! The engine's steps by uprobe on llama.cpp's C API (see probe_common::engine). Userspace finds
//! the entry points in the target's objects and attaches these programs to them for every process
//! (the uprobe is on the file); each program first checks that the caller is a target.
//!
//! Cheap per step: the entry keeps a small [`Call`] by thread; the return writes the record
//! straight into the ring buffer (no 272-byte copies through maps). An extended batch's fill is
//! taken (and forgotten) by the `llama_process` that consumes it, so `llama_batch_ext_clear` needs
//! no probe of its own.
use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::{map, uprobe, uretprobe},
    maps::LruHashMap,
    programs::{ProbeContext, RetProbeContext},
};
use probe_common::{
    EventKind,
    engine::{
        BatchFill, ENGINE_CLEAR, ENGINE_CONTEXT_INIT, ENGINE_DECODE, ENGINE_ENCODE, ENGINE_MODEL_LOAD, ENGINE_PROCESS, ENGINE_SEQ_RM,
        EngineEvent, SCAN_TOKENS, SEQS,
    },
};

use crate::{EVENTS, LOST, add, current_target, emit, header, insert_lru, now_ns, ringbuf_flags};

/// A classic `struct llama_batch` (llama.h): n_tokens, token*, embd*, pos*, n_seq_id*, seq_id**, logits*.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LlamaBatch {
    n_tokens: i32,
    _pad: u32,
    token: u64,
    embd: u64,
    pos: u64,
    n_seq_id: u64,
    seq_id: u64,
    logits: u64,
}

/// A call in progress, by tid: what the return needs, and the return address its uretprobe
/// replaced (where it was on the user stack, what it was: stack.rs puts it back in the copies of
/// the user stack it sends, or every unwind inside the call would end at the kernel's trampoline).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Call {
    pub ret_slot: u64,
    pub ret_addr: u64,
    begin_ns: u64,
    ctx: u64,
    what: u32,
    arg: u32,
    /// The batch's composition, taken at the entry: llama_process's fill; llama_decode's and
    /// llama_encode's read from the batch passed by value ([`classic`]).
    fill: BatchFill,
    /// Classic batches: tokens read one by one, and the largest position per sequence, +1.
    scanned: u32,
    seq_pos_end: [u32; SEQS],
    seq: i32,
    p0: i32,
    p1: i32,
}

#[map(name = "ENGINE_CALL")]
pub(crate) static ENGINE_CALL: LruHashMap<u32, Call> = LruHashMap::with_max_entries(4096, 0);

/// Extended batches being filled (`llama_batch_ext_add_*` since their last `llama_process`).
#[map(name = "ENGINE_FILL")]
static ENGINE_FILL: LruHashMap<u64, BatchFill> = LruHashMap::with_max_entries(256, 0);

#[inline(always)]
fn arg<T>(ctx: &ProbeContext, n: usize) -> T
where
    T: aya_ebpf::Argument + Default,
{
    ctx.arg::<T>(n).unwrap_or_default()
}

#[inline(always)]
fn read<T>(p: u64) -> Option<T> {
    // SAFETY: a probe read of the target's memory; a bad pointer is an error, not a fault.
    unsafe { bpf_probe_read_user(p as *const T) }.ok()
}

/// A call begins: its state waits in `ENGINE_CALL` for the return (the entry program runs before
/// the uretprobe replaces the return address, so `[sp]` is still the real one).
#[inline(always)]
fn begin(ctx: &ProbeContext, what: u32, fill: impl FnOnce(&mut Call)) {
    let Some((_, tid)) = current_target() else { return };
    // SAFETY: `regs` is the trapped thread's saved registers, valid for this program's run.
    let sp = unsafe { (*ctx.regs).rsp };
    let mut c =
        Call { ret_slot: sp, ret_addr: read::<u64>(sp).unwrap_or(0), begin_ns: now_ns(), ctx: arg::<u64>(ctx, 0), what, ..Call::default() };
    if c.ret_addr == 0 {
        c.ret_slot = 0;
    }
    fill(&mut c);
    // The thread's entry from its last call is written over in place (the return leaves it,
    // marked done): a remove and an insert per step cost an LRU list lock each.
    match ENGINE_CALL.get_ptr_mut(&tid) {
        // SAFETY: this thread's map value; only this thread's programs write it.
        Some(p) => unsafe { *p = c },
        None => insert_lru(&ENGINE_CALL, &tid, &c),
    }
}

/// The call returns: its record, written in place in the ring buffer.
#[inline(always)]
fn end(ret: i64) {
    let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    let (pid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    // A call in progress is a target's (only a target's entry makes one): the target set is
    // asked only when there is none, to tell a target's unmatched return from another process's.
    let c = match ENGINE_CALL.get_ptr_mut(&tid) {
        // SAFETY: this thread's map value; copied out, then marked done (`what` 0, and no return
        // address for stack.rs to put back) for the next call to write over.
        Some(p) if unsafe { (*p).what } != 0 => unsafe {
            let c = *p;
            (*p).what = 0;
            (*p).ret_slot = 0;
            c
        },
        _ => {
            if current_target().is_some() {
                crate::count(probe_common::Counter::Unmatched);
            }
            return;
        }
    };
    let size = core::mem::size_of::<EngineEvent>() as u64;
    let flags = ringbuf_flags(size);
    let Some(mut slot) = EVENTS.reserve::<EngineEvent>(0) else {
        add(&LOST, EventKind::Engine as u32, 1);
        return;
    };
    let ev = slot.as_mut_ptr();
    // SAFETY: `ev` is a reserved ring-buffer record of one EngineEvent, filled before submit.
    unsafe {
        (*ev).hdr = header::<EngineEvent>(pid, tid);
        (*ev).what = c.what;
        (*ev).arg = c.arg;
        (*ev).begin_ns = c.begin_ns;
        (*ev).ctx = c.ctx;
        (*ev).ret = ret;
        (*ev).seq = c.seq;
        (*ev).p0 = c.p0;
        (*ev).p1 = c.p1;
        (*ev).n_tokens = c.fill.n_tokens;
        (*ev).scanned = c.scanned;
        (*ev).other_tokens = c.fill.other_tokens;
        (*ev).seq_tokens = c.fill.seq_tokens;
        (*ev).seq_pos_end = c.seq_pos_end;
    }
    slot.submit(flags);
}

/// A classic batch's composition: the first SCAN_TOKENS tokens one by one (a decode step has one
/// per sequence), the rest for the sequence of the batch's last token (callers add a sequence's
/// prompt tokens together). Read at the entry: the caller has just written the arrays, so they
/// are in its caches and TLB; at the return, after the step's compute, each read of another
/// page of the target's walked the page tables again (engine_ret took 4.5 µs a step).
#[inline(always)]
fn classic(c: &mut Call, b: &LlamaBatch) {
    let n = if b.n_tokens > 0 { b.n_tokens as u32 } else { 0 };
    c.fill.n_tokens = n;
    let mut i: u32 = 0;
    while i < SCAN_TOKENS && i < n {
        count_token(c, b, i, 1);
        i += 1;
    }
    if n > i {
        count_token(c, b, n - 1, (n - i) as u16);
    }
    c.scanned = i;
}

/// Count `weight` tokens for the sequence of token `k` of a classic batch, and its position.
/// A batch without `seq_id` arrays (llama_batch_get_one) is sequence 0; a token in several
/// sequences counts for its first.
#[inline(always)]
fn count_token(c: &mut Call, b: &LlamaBatch, k: u32, weight: u16) {
    let k = k as u64;
    let seq = if b.seq_id == 0 { 0 } else { read::<u64>(b.seq_id + 8 * k).and_then(read::<i32>).unwrap_or(-1) };
    let pos = if b.pos == 0 { -1 } else { read::<i32>(b.pos + 4 * k).unwrap_or(-1) };
    let s = seq as u32 as usize;
    if s < SEQS {
        let s = s & (SEQS - 1);
        c.fill.seq_tokens[s] = c.fill.seq_tokens[s].wrapping_add(weight);
        let end = (pos + 1) as u32;
        if pos >= 0 && end > c.seq_pos_end[s] {
            c.seq_pos_end[s] = end;
        }
    } else {
        c.fill.other_tokens += weight as u32;
    }
}

/// `llama_decode(ctx, llama_batch)` / `llama_encode`: the batch is passed by value. On x86-64 (the
/// only architecture probe's programs are built for: fault.rs reads `rip`) a 56-byte struct
/// travels on the stack, just above the return address.
#[inline(always)]
fn classic_entry(ctx: &ProbeContext, what: u32) {
    begin(ctx, what, |c| {
        if let Some(b) = read::<LlamaBatch>(c.ret_slot + 8) {
            classic(c, &b);
        }
    });
}

#[uprobe]
pub fn engine_decode(ctx: ProbeContext) -> u32 {
    classic_entry(&ctx, ENGINE_DECODE);
    0
}

/// `llama_decode` of a build whose `llama_batch` layout is not known: timed, the batch not read.
#[uprobe]
pub fn engine_decode_opaque(ctx: ProbeContext) -> u32 {
    begin(&ctx, ENGINE_DECODE, |_| {});
    0
}

#[uprobe]
pub fn engine_encode(ctx: ProbeContext) -> u32 {
    classic_entry(&ctx, ENGINE_ENCODE);
    0
}

/// The return of any call begun above (one uretprobe program for every entry point).
#[uretprobe]
pub fn engine_ret(ctx: RetProbeContext) -> u32 {
    end(ctx.ret::<i64>());
    0
}

/// The return of a call whose value is an `int32_t` (`llama_decode`, `llama_process`): sign-extended.
#[uretprobe]
pub fn engine_ret_i32(ctx: RetProbeContext) -> u32 {
    end(ctx.ret::<i32>() as i64);
    0
}

/// `llama_process(ctx, type, batch)`: the batch's composition is its fill since the last step.
#[uprobe]
pub fn engine_process(ctx: ProbeContext) -> u32 {
    let batch = arg::<u64>(&ctx, 2);
    begin(&ctx, ENGINE_PROCESS, |c| {
        c.arg = arg::<u32>(&ctx, 1);
        // SAFETY: the fill is copied out of its map value before the remove.
        if let Some(f) = unsafe { ENGINE_FILL.get(&batch) } {
            c.fill = *f;
            // Every token of an extended batch is counted as it is added.
            c.scanned = f.n_tokens;
        }
    });
    let _ = ENGINE_FILL.remove(&batch);
    0
}

/// `llama_batch_ext_clear(batch)`: a new batch begins (attached only where `llama_process` is not:
/// the step takes its fill).
#[uprobe]
pub fn engine_batch_clear(ctx: ProbeContext) -> u32 {
    if current_target().is_some() {
        let _ = ENGINE_FILL.remove(&arg::<u64>(&ctx, 0));
    }
    0
}

/// `llama_batch_ext_add_token(batch, seq_id, token)` / `_add_embd(batch, seq_id, embd)`: one token.
#[uprobe]
pub fn engine_batch_add(ctx: ProbeContext) -> u32 {
    if current_target().is_none() {
        return 0;
    }
    let batch = arg::<u64>(&ctx, 0);
    let seq = arg::<i32>(&ctx, 1);
    if ENGINE_FILL.get_ptr_mut(&batch).is_none() {
        insert_lru(&ENGINE_FILL, &batch, &BatchFill::default());
    }
    let Some(f) = ENGINE_FILL.get_ptr_mut(&batch) else { return 0 };
    // SAFETY: the batch's map value; batches are filled by one thread at a time.
    let f = unsafe { &mut *f };
    f.n_tokens += 1;
    if seq >= 0 && (seq as usize) < SEQS {
        let s = seq as usize;
        f.seq_tokens[s] = f.seq_tokens[s].saturating_add(1);
    } else {
        f.other_tokens += 1;
    }
    0
}

/// `llama_memory_seq_rm(mem, seq_id, p0, p1)` (and `llama_kv_self_seq_rm` / `llama_kv_cache_seq_rm`
/// with a context first): tokens of a sequence dropped from the cache.
#[uprobe]
pub fn engine_seq_rm(ctx: ProbeContext) -> u32 {
    begin(&ctx, ENGINE_SEQ_RM, |c| {
        c.seq = arg::<i32>(&ctx, 1);
        c.p0 = arg::<i32>(&ctx, 2);
        c.p1 = arg::<i32>(&ctx, 3);
    });
    0
}

/// `llama_memory_clear(mem, data)` and older names: the whole cache dropped.
#[uprobe]
pub fn engine_clear(ctx: ProbeContext) -> u32 {
    let Some((pid, tid)) = current_target() else { return 0 };
    let now = now_ns();
    emit(&EngineEvent {
        hdr: header::<EngineEvent>(pid, tid),
        what: ENGINE_CLEAR,
        begin_ns: now,
        ctx: arg::<u64>(&ctx, 0),
        ..EngineEvent::default()
    });
    0
}

/// Model load begins (`llama_model_load_from_file`, `llama_load_model_from_file`).
#[uprobe]
pub fn engine_model_load(ctx: ProbeContext) -> u32 {
    begin(&ctx, ENGINE_MODEL_LOAD, |c| c.ctx = 0);
    0
}

/// Context creation begins (`llama_init_from_model`, `llama_new_context_with_model`).
#[uprobe]
pub fn engine_context_init(ctx: ProbeContext) -> u32 {
    begin(&ctx, ENGINE_CONTEXT_INIT, |_| {});
    0
}
