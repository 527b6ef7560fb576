//! Stacks for flamegraphs: CPU samples (perf software clock), off-CPU (sched_switch), and the
//! stacks behind major faults and block IO. Each record carries the kernel stack and a raw
//! slice of the user stack with the user registers; userspace unwinds it from `.eh_frame`.
use aya_ebpf::{
    EbpfContext,
    bindings::pt_regs,
    helpers::generated::{bpf_get_current_task_btf, bpf_get_stack, bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs},
    macros::{map, perf_event, raw_tracepoint, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray},
    programs::{PerfEventContext, RawTracePointContext, TracePointContext},
};
use probe_common::{
    Counter, EventHeader, Record,
    stack::{
        KSTACK_DEPTH, SAME_REFRESH, SCHED_PREEMPTED, SCHED_STEAL, SCHED_WOKEN, SHORT_WAIT_NS, STACK_CPU, STACK_OFFCPU, STACK_SAME_KERNEL,
        STACK_SAME_USER, STACK_SLOT_SHIFT, STACK_SLOTS, STEAL_MIN_NS, STEAL_SEND_NS, STEAL_SPAN_NS, SchedEvent, SeenStacks, SeenUstack,
        StackEvent, StackKey, StackSpans, USTACK_CAP, USTACK_WIDE, copy_for, entry_need, entry_top, kernel_key, last_run_flags,
        reported_state, ring_cap,
    },
    tracepoints::{sched_switch as sw, sched_waking as wk},
};

use crate::{
    BPF_RB_AVAIL_DATA, BPF_RB_RING_SIZE, EVENTS, LOST, add, count, current_target, emit, field, header, insert_lru, now_ns, ringbuf_flags,
};

const HDR: usize = core::mem::size_of::<StackEvent>();

/// Scratch room for a thread's first [`SeenStacks`] ([`seen_before`]).
#[map(name = "SEEN_SCRATCH")]
static SEEN_SCRATCH: PerCpuArray<SeenStacks> = PerCpuArray::with_max_entries(1, 0);

/// Each target thread's last places (off-CPU waits, block IOs, major faults), by tid: a thread
/// that blocks again at one of them (ggml's OpenMP workers wait at two or three barriers in
/// turn, hundreds of times a second), or whose readahead issues another IO from the fault it
/// took there, sends no user stack, and (off-CPU) no kernel stack when it entered the kernel the
/// same way.
#[map(name = "USTACK_SEEN")]
static USTACK_SEEN: LruHashMap<u32, SeenStacks> = LruHashMap::with_max_entries(16384, 0);

/// How many user-stack bytes each target thread's stacks need, by tid (1024 to USTACK_CAP, a
/// power of two), with the end of its stack's mapping when known (`need_entry`): written by the
/// collector from what unwinding them used, so a worker whose frames fit in 2 KiB is not copied
/// 64 KiB a sample.
/// 1: off-CPU stacks only for uninterruptible waits (TASK_UNINTERRUPTIBLE: disk IO, page faults,
/// reclaim; what the disk and memory verdicts rest on), not for the frequent interruptible
/// sleeps of thread pools and event loops (`probe watch`'s cost). 0: every block. Set by
/// userspace before load.
#[unsafe(no_mangle)]
static OFFCPU_D_ONLY: u32 = 0;

/// The most user-stack bytes a record copies (0: up to USTACK_CAP), the user's choice of
/// cheaper samples over whole deep stacks (`--stack-kib`). Set by userspace before load.
#[unsafe(no_mangle)]
static USTACK_LIMIT: u32 = 0;

/// 1: the perf programs are attached per CPU (probe in a PID namespace of its own cannot name
/// the target's threads to perf): they keep the targets' events only. 0: per target thread,
/// inherited by its children, every event is a target's. Set by userspace before load.
#[unsafe(no_mangle)]
static PERF_PER_CPU: u32 = 0;

/// The (pid, tid) a perf program's event belongs to, None when it is not a target's.
#[inline(always)]
pub(crate) fn perf_target() -> Option<(u32, u32)> {
    // SAFETY: a read of a global the loader set; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&raw const PERF_PER_CPU) } != 0 {
        return crate::current_target();
    }
    let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    Some(((pid_tgid >> 32) as u32, pid_tgid as u32))
}

#[inline(always)]
fn d_only() -> bool {
    // SAFETY: a read of a global the loader set; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&raw const OFFCPU_D_ONLY) != 0 }
}

/// TASK_UNINTERRUPTIBLE in a task's state.
const TASK_UNINTERRUPTIBLE: i64 = 0x2;

/// The mappings that may hold each target process's thread stacks, by 2 MiB of address space
/// (written by the collector): bound a thread's copies before its needs are known.
#[map(name = "STACK_RANGES")]
static STACK_RANGES: HashMap<StackKey, StackSpans> = HashMap::with_max_entries(16384, 0);

#[map(name = "USTACK_NEED")]
static USTACK_NEED: LruHashMap<u32, u64> = LruHashMap::with_max_entries(16384, 0);

/// Per target thread off the CPU: [when it left (low bit set: still runnable, preempted), when
/// it was woken (0: not yet), the target thread that woke it (0: none, or another process)]; a
/// thread on a CPU has its entry marked so (0: [`off_cpu`], [`on_cpu`]).
/// sched_waking writes the last two in place (no insert: it runs for every wake-up on the machine).
#[map(name = "OFFCPU_SINCE")]
static OFFCPU_SINCE: LruHashMap<u32, [u64; 3]> = LruHashMap::with_max_entries(16384, 0);

/// Per target thread, its runs' steal ([`SCHED_STEAL`]): [when it came on the CPU (0: not on
/// one since probe saw it), its CPU's accounted steal then, steal not sent yet (ns), since when].
#[map(name = "RUN_SINCE")]
static RUN_SINCE: LruHashMap<u32, [u64; 4]> = LruHashMap::with_max_entries(16384, 0);

/// The steal this CPU's run queue has accounted so far (rq.prev_steal_time_rq, reached from the
/// current task: its cfs_rq is on this CPU), None where the kernel does not say.
#[inline(always)]
fn cpu_steal() -> Option<u64> {
    let k = crate::task::offsets();
    if k.valid == 0 || k.rq_steal == 0 {
        return None;
    }
    // SAFETY: helper without arguments; the pointer is only used for probe reads.
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
    let cfs_rq: u64 = crate::task::read(task, k.task_cfs_rq)?;
    let rq: u64 = crate::task::read(cfs_rq, k.cfs_rq_rq)?;
    crate::task::read(rq, k.rq_steal)
}

/// `tid` (the current task, a target thread) leaves the CPU at `now`: its run's steal is what its
/// CPU's steal grew by while it ran, summed until it is worth a record.
#[inline(always)]
fn left_cpu(pid: u32, tid: u32, now: u64, steal: Option<u64>) {
    let Some(steal) = steal else { return };
    let Some(r) = RUN_SINCE.get_ptr_mut(&tid) else {
        insert_lru(&RUN_SINCE, &tid, &[0, 0, 0, 0]);
        return;
    };
    // SAFETY: a map value pointer, valid for this program run (only this thread's switches,
    // which do not overlap, write it).
    let r = unsafe { &mut *r };
    let [since, steal_in, pending, from] = *r;
    r[0] = 0;
    if since == 0 || steal < steal_in || now < since {
        return;
    }
    let pending = pending + (steal - steal_in);
    let from = if from == 0 { since } else { from };
    let span = now - from;
    if pending >= STEAL_SEND_NS || span >= STEAL_SPAN_NS {
        if pending >= STEAL_MIN_NS {
            let span_us = (span / 1000).min((1 << 24) - 1) as u32;
            emit(&SchedEvent {
                hdr: EventHeader { ts_ns: now, ..header::<SchedEvent>(pid, tid) },
                tid,
                flags: SCHED_STEAL | (span_us << 8),
                blocked_ns: pending,
            });
        }
        r[2] = 0;
        r[3] = 0;
    } else {
        r[2] = pending;
        r[3] = from;
    }
}

/// `tid` came on this CPU at `now` (its run's start, for [`left_cpu`]); its CPU's steal is read
/// only for a thread probe follows.
#[inline(always)]
fn came_on_cpu(tid: u32, now: u64) {
    let Some(r) = RUN_SINCE.get_ptr_mut(&tid) else { return };
    let Some(steal) = cpu_steal() else { return };
    // SAFETY: a map value pointer, valid for this program run.
    unsafe {
        (*r)[0] = now;
        (*r)[1] = steal;
    }
}

#[inline(always)]
fn read_kernel<T>(p: *const T) -> T {
    let mut v = core::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: a probe read into a local; on failure the zeroed value is kept.
    unsafe {
        bpf_probe_read_kernel(v.as_mut_ptr().cast(), core::mem::size_of::<T>() as u32, p.cast());
        v.assume_init()
    }
}

/// What a [`capture`] takes. `full` copies up to USTACK_CAP bytes of user stack; otherwise 16 KiB
/// (off-CPU switches are frequent and block in shallow places: a libc wrapper under the caller
/// that matters). `same_as_last` (the kinds of probe_common::stack::stack_remembered): leave the
/// user stack out when it is the one this thread sent last from the same registers
/// ([`seen_before`]), and the kernel stack too when the thread also entered the kernel the same
/// way (an off-CPU wait's key; a block IO's or a fault's kernel stack is always sent). `kstack`:
/// take the kernel stack (false only where it is known to be empty: a CPU sample of user code,
/// [`in_user_mode`]).
#[derive(Clone, Copy)]
pub struct Take {
    pub full: bool,
    pub same_as_last: bool,
    pub kstack: bool,
}

impl Take {
    /// A block IO's or a major fault's stack.
    pub const EVENT: Take = Take { full: true, same_as_last: true, kstack: true };
    /// An off-CPU wait's stack.
    const OFFCPU: Take = Take { full: false, same_as_last: true, kstack: true };
    /// A CPU sample's stack (`kstack`: it interrupted the kernel).
    const fn cpu(kstack: bool) -> Take {
        Take { full: true, same_as_last: false, kstack }
    }
}

/// Capture the current task's kernel and user stack and send a StackEvent ([`Take`]: how).
#[inline(always)]
pub fn capture(ctx: *mut core::ffi::c_void, what: u32, pid: u32, tid: u32, addr: u64, state: u32, take: Take) {
    let Take { full, same_as_last, kstack } = take;
    // The user registers at the task's last kernel entry (interrupt, fault or syscall).
    // SAFETY: helpers without preconditions; the pointer is only read through probe reads.
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
    let (ip, sp, bp) = if regs.is_null() {
        (0, 0, 0)
    } else {
        // SAFETY: probe reads of the task's saved registers.
        unsafe { (read_kernel(&raw const (*regs).rip), read_kernel(&raw const (*regs).rsp), read_kernel(&raw const (*regs).rbp)) }
    };
    let mut c = Capture { ctx, what, pid, tid, addr, state, ip, sp, bp, slot: 0, kstack };
    // A thread that blocks again where it blocked last (same user registers: the same native
    // stack, so the same Python frames, which only change when the interpreter returns through
    // them) is sent as the same: its Python frames too, without a walk (a spin-wait's yields).
    if sp != 0 && same_as_last {
        // SAFETY: `regs` is not null (sp was read through it); a probe read of the saved register.
        let key = if what == STACK_OFFCPU { kernel_key(unsafe { read_kernel(&raw const (*regs).orig_rax) }, state) } else { 0 };
        // What the collector found this thread's stacks need (USTACK_NEED), if it said.
        // SAFETY: the value is copied out at once.
        let need = unsafe { USTACK_NEED.get(&tid) }.map_or(0, |&v| entry_need(v));
        let (seen, slot) = seen_before(tid, ip, sp, bp, key, need);
        c.slot = slot;
        match seen {
            Seen::New => {}
            Seen::User => return c.send_same(STACK_SAME_USER),
            Seen::Both => return c.send_same(STACK_SAME_USER | STACK_SAME_KERNEL),
        }
    }
    // A CPython thread's Python frames go first, in a record of their own (python.rs).
    crate::python::send(pid, tid);
    if sp == 0 {
        c.send::<0>(0, same_as_last);
        return;
    }
    // As many bytes as this thread's stacks took to unwind so far (the collector says, in
    // USTACK_NEED); before it knows, up to USTACK_WIDE (CPU, faults, IO) or 16 KiB (off-CPU).
    // The stack is read straight into the ring record (no copy through a scratch buffer); near
    // the top of a stack a long read faults as a whole: shorter ones are tried.
    // The largest copy reads only up to the end of the stack's mapping, when the collector found
    // it (`need_entry`): its record then has room to spare.
    // SAFETY: the value is copied out at once.
    let (cap, top) = match unsafe { USTACK_NEED.get(&tid) } {
        Some(&v) => (entry_need(v), entry_top(v)),
        // Not learned yet: up to the end of the stack's mapping, when the collector listed it.
        // SAFETY: a map value read in place for this program run.
        None => match unsafe { STACK_RANGES.get(&StackKey::of(pid, sp)) }.and_then(|r| r.end_of(sp)) {
            Some(end) => (copy_for(end - sp), end),
            None if full => (USTACK_WIDE as u32, 0),
            None => (16384, 0),
        },
    };
    // Off-CPU records copy at most USTACK_WIDE: a thread blocks far more often than it is
    // sampled, and llama-server's main thread's 80 KiB copies at its switches filled half the
    // ring within a request (copied out unread into fresh pages: 25-30 ms of probe's at normal
    // priority during the request it was attached for).
    let cap = if full { cap } else { cap.min(USTACK_WIDE as u32) };
    // SAFETY: a read of a global the loader set; volatile so the compiler keeps the load.
    let limit = unsafe { core::ptr::read_volatile(&raw const USTACK_LIMIT) };
    let cap = if limit != 0 { cap.min(limit) } else { cap };
    // A filling ring keeps its room for the small records (probe_common::stack::TRIM_AT).
    let trimmed = ring_cap(cap, EVENTS.query(BPF_RB_AVAIL_DATA), EVENTS.query(BPF_RB_RING_SIZE));
    if trimmed < cap {
        count(Counter::TrimmedStacks);
    }
    let cap = trimmed;
    let room = if top > sp { top - sp } else { 0 };
    let done = (cap == 0 && c.send::<0>(0, same_as_last))
        || (cap >= USTACK_CAP as u32 && c.send::<USTACK_CAP>(room, same_as_last))
        || (cap >= USTACK_WIDE as u32 && c.send::<USTACK_WIDE>(room, same_as_last))
        || (cap >= 32768 && c.send::<32768>(0, same_as_last))
        || (cap >= 16384 && c.send::<16384>(0, same_as_last))
        || (cap >= 8192 && c.send::<8192>(0, same_as_last))
        || (cap >= 4096 && c.send::<4096>(0, same_as_last))
        || (cap >= 2048 && c.send::<2048>(0, same_as_last))
        || c.send::<1024>(0, same_as_last);
    if !done {
        c.send::<0>(0, same_as_last);
    }
}

/// One stack record being made.
struct Capture {
    ctx: *mut core::ffi::c_void,
    what: u32,
    pid: u32,
    tid: u32,
    addr: u64,
    state: u32,
    ip: u64,
    sp: u64,
    bp: u64,
    /// The thread's off-CPU place ([`seen_before`]) this record reuses or is remembered in.
    slot: u32,
    /// The kernel stack is taken (false: a CPU sample of user code, whose kernel stack is empty).
    kstack: bool,
}

impl Capture {
    /// Reserve a record with room for N bytes of user stack and fill it: with N bytes, or only
    /// `room` when that is less (the bytes up to the end of the stack's mapping; 0: not known);
    /// false (and nothing sent) when the stack read faulted; true once sent or counted lost.
    #[inline(always)]
    fn send<const N: usize>(&self, room: u64, same_as_last: bool) -> bool {
        let len: u32 = if room > 0 && room < N as u64 { room as u32 & !7 } else { N as u32 };
        if N > 0 && (len < 8 || len > N as u32) {
            return false;
        }
        // The stack is one mapping: when its last byte reads, all do. Probe that first, so a
        // size that would fault never reserves ring space (a discarded record holds its room
        // until the collector passes it: new threads near the top of their stacks made thread
        // churn lose events that way).
        if N > 0 {
            let mut last = 0u64;
            // SAFETY: a probe read of 8 bytes into a local.
            if unsafe { bpf_probe_read_user((&raw mut last).cast(), 8, (self.sp + len as u64 - 8) as *const _) } != 0 {
                return false;
            }
        }
        let flags = ringbuf_flags((HDR + N) as u64);
        let Some(mut rec) = EVENTS.reserve_bytes(HDR + N, 0) else {
            self.lost(same_as_last);
            return true;
        };
        let base = rec.as_mut_ptr();
        // SAFETY: `base` is the reserved record of HDR + N bytes; the user read writes N bytes
        // at offset HDR, the header fills the first HDR.
        unsafe {
            if N > 0 && bpf_probe_read_user(base.add(HDR).cast(), len, self.sp as *const _) != 0 {
                // With the same wake-up flag: when this record crossed the backlog threshold,
                // the collector must still be woken (the next records will not force it).
                rec.discard(flags);
                return false;
            }
            // Inside a call the engine probe times (engine.rs), the kernel's uretprobe
            // trampoline stands where the call's return address was: put the address back in
            // the copy, so the unwind goes on into the caller.
            if N >= 8
                && let Some(call) = crate::engine::ENGINE_CALL.get(&self.tid)
                && call.ret_slot != 0
            {
                let off = call.ret_slot.wrapping_sub(self.sp);
                if off <= (N - 8) as u64 {
                    core::ptr::write_unaligned(base.add(HDR + off as usize).cast::<u64>(), call.ret_addr);
                }
            }
            self.header(base.cast(), self.what, if N > 0 { len } else { 0 });
        }
        rec.submit(flags);
        true
    }

    /// A record without user-stack bytes that says they are this thread's last ones (`same`:
    /// STACK_SAME_USER, with STACK_SAME_KERNEL when its kernel stack is the last one too).
    #[inline(always)]
    fn send_same(&self, same: u32) {
        let flags = ringbuf_flags(HDR as u64);
        let Some(mut rec) = EVENTS.reserve::<StackEvent>(0) else {
            self.lost(true);
            return;
        };
        // SAFETY: a reserved record of exactly one StackEvent.
        unsafe { self.header(rec.as_mut_ptr(), self.what | same, 0) };
        rec.submit(flags);
    }

    /// Fill the fixed part at `ev` (the kernel stack straight into the record, unless it is the
    /// thread's last one: STACK_SAME_KERNEL in `what`).
    #[inline(always)]
    unsafe fn header(&self, ev: *mut StackEvent, what: u32, ustack_bytes: u32) {
        // SAFETY: `ev` points to a reserved record at least a StackEvent long.
        unsafe {
            (*ev).hdr = header::<StackEvent>(self.pid, self.tid);
            (*ev).what = what | (self.slot << STACK_SLOT_SHIFT);
            (*ev).state = self.state;
            (*ev).addr = self.addr;
            (*ev).ip = self.ip;
            (*ev).sp = self.sp;
            (*ev).bp = self.bp;
            (*ev).ustack_bytes = ustack_bytes;
            (*ev).kstack_bytes = if what & STACK_SAME_KERNEL != 0 || !self.kstack {
                0
            } else {
                bpf_get_stack(self.ctx, (&raw mut (*ev).kstack).cast(), (KSTACK_DEPTH * 8) as u32, 0) as i32
            };
        }
    }

    #[inline(always)]
    fn lost(&self, same_as_last: bool) {
        add(&LOST, StackEvent::KIND as u32, 1);
        if same_as_last {
            // The collector never got this stack: the next one must not refer to it.
            let _ = USTACK_SEEN.remove(&self.tid);
        }
    }
}

/// What a thread's block shares with the last off-CPU record of one of its places.
enum Seen {
    /// Nothing (or it was reused SAME_REFRESH times in a row): both stacks are sent.
    New,
    /// The user stack: the kernel stack is sent.
    User,
    /// Both stacks: neither is sent.
    Both,
}

/// Whether `tid` blocks at one of its last places ([`SeenStacks`]: the same user registers), that
/// place's stack not reused SAME_REFRESH times in a row already, and entered the kernel the same
/// way (`kernel_key`, 0: never the same); and the slot of that place, or the one this new place
/// is remembered in (the oldest).
#[inline(always)]
fn seen_before(tid: u32, ip: u64, sp: u64, bp: u64, kernel_key: u64, need: u32) -> (Seen, u32) {
    let place = SeenUstack { ip, sp, bp, kernel_key, repeats: 0, need };
    let Some(seen) = USTACK_SEEN.get_ptr_mut(&tid) else {
        // The thread's first entry is made in a per-CPU scratch value, not on the BPF stack (the
        // block IO programs that call this have little of their 512 bytes left).
        if let Some(first) = SEEN_SCRATCH.get_ptr_mut(0) {
            // SAFETY: this CPU's scratch value; the program runs with preemption off.
            let first = unsafe { &mut *first };
            *first = SeenStacks::default();
            first.next = 1;
            first.slots[0] = place;
            insert_lru(&USTACK_SEEN, &tid, first);
        }
        return (Seen::New, 0);
    };
    // SAFETY: a map value pointer, valid for this program run (only this thread's switches,
    // which do not overlap, write it).
    let seen = unsafe { &mut *seen };
    for (i, slot) in seen.slots.iter_mut().enumerate() {
        if slot.ip == ip && slot.sp == sp && slot.bp == bp {
            if slot.repeats >= SAME_REFRESH || slot.need < need {
                *slot = place;
                return (Seen::New, i as u32);
            }
            slot.repeats += 1;
            if kernel_key != 0 && slot.kernel_key == kernel_key {
                return (Seen::Both, i as u32);
            }
            // This record carries the kernel stack the next ones may refer to.
            slot.kernel_key = kernel_key;
            return (Seen::User, i as u32);
        }
    }
    let i = seen.next % STACK_SLOTS as u32;
    seen.slots[i as usize % STACK_SLOTS] = place;
    seen.next = i + 1;
    (Seen::New, i)
}

/// `prev_state` bits of a thread that is exiting (include/linux/sched.h).
const EXIT_DEAD: i64 = 0x10;
const EXIT_ZOMBIE: i64 = 0x20;

/// Whether a CPU sample interrupted user code (the privilege level of its saved code segment, as
/// the kernel's `user_mode(regs)`): its kernel stack is then empty, and `bpf_get_stack` would
/// take 1.8 µs here to say so (its walk's setup, cold after the server's own work) in 97 of 100
/// of llama-server's samples.
#[inline(always)]
fn in_user_mode(ctx: &PerfEventContext) -> bool {
    let data = ctx.as_ptr() as *const aya_ebpf::bindings::bpf_perf_event_data;
    // SAFETY: the program's context is a bpf_perf_event_data; its saved registers are readable.
    unsafe { (*data).regs.cs & 3 == 3 }
}

/// perf software event CPU_CLOCK at 99 Hz, opened per thread of the target with inherit.
#[perf_event]
pub fn cpu_sample(ctx: PerfEventContext) -> u32 {
    let Some((pid, tid)) = perf_target() else { return 0 };
    capture(ctx.as_ptr(), STACK_CPU, pid, tid, 0, 0, Take::cpu(!in_user_mode(&ctx)));
    0
}

/// sched:sched_switch from its raw tracepoint (args: preempt, prev, next, prev_state; Linux 5.18
/// on, where an older kernel refuses the attach and [`sched_switch`] runs instead): no trace
/// record is made for it, and its teardown does not hold the kernel's `event_mutex` through
/// grace periods as a classic tracepoint's does. Runs in `prev`, as the classic one.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn sched_switch_raw(ctx: RawTracePointContext) -> i32 {
    let (preempt, next, prev_state): (u64, u64, u64) = (ctx.arg(0), ctx.arg(2), ctx.arg(3));
    if let Some(next) = crate::task::read::<i32>(next, crate::task::offsets().task_pid) {
        let _ = on_switch(ctx.as_ptr(), || Ok(reported_state(preempt & 0xff != 0, prev_state as u32)), next as u32);
    }
    0
}

/// sched:sched_switch (prev_pid @24, prev_state @32, next_pid @56), where the raw tracepoint
/// cannot attach: runs in `prev`. A target thread that blocks (state != running) sends its
/// stack; when it runs again its blocked time.
#[tracepoint(category = "sched", name = "sched_switch")]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    if let Ok(next) = field::<i32>(&ctx, sw::NEXT_PID) {
        let _ = on_switch(ctx.as_ptr(), || field(&ctx, sw::PREV_STATE), next as u32);
    }
    0
}

/// Per CPU, when its last switch happened: at a target thread's switch-in, how long the task it
/// replaces had run (the part of the thread's wait that task held the CPU).
#[map(name = "SWITCH_AT")]
static SWITCH_AT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// A switch from the current task to `next`; `prev_state` as the classic tracepoint reports it.
/// `next`'s side first, the current task's stack last: the verifier then walks the capture once,
/// not once for every state the other side leaves (25,000 instructions walked before, 12,400 now).
#[inline(always)]
fn on_switch(ctx: *mut core::ffi::c_void, prev_state: impl FnOnce() -> Result<i64, i64>, next: u32) -> Result<(), i64> {
    let now = now_ns();
    let prev_ran = match SWITCH_AT.get_ptr_mut(0) {
        // SAFETY: this CPU's slot; the program runs with preemption off.
        Some(p) => unsafe {
            let last = *p;
            *p = now;
            if last == 0 { u64::MAX } else { now.saturating_sub(last) }
        },
        None => u64::MAX,
    };
    switched_in(next, now, prev_ran);
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    let state: i64 = prev_state()?;
    // A thread's last switch, as it exits, reports EXIT_DEAD or EXIT_ZOMBIE: it never runs
    // again, so nothing would take its entry out (thread churn would fill the map).
    if state & (EXIT_DEAD | EXIT_ZOMBIE) != 0 {
        // SAFETY: the value is copied out at once.
        if runnable_counted(unsafe { OFFCPU_SINCE.get(&tid) }.map(|v| v[0])) {
            runnable_add(-1);
        }
        let _ = OFFCPU_SINCE.remove(&tid);
        let _ = USTACK_SEEN.remove(&tid);
        let _ = USTACK_NEED.remove(&tid);
        let _ = RUN_SINCE.remove(&tid);
        return Ok(());
    }
    left_cpu(pid, tid, now, cpu_steal());
    if state & 0xff != 0 && (state & TASK_UNINTERRUPTIBLE != 0 || !d_only()) {
        if runnable_counted(off_cpu(tid, now & !1)) {
            runnable_add(-1);
        }
        capture(ctx, STACK_OFFCPU, pid, tid, 0, state as u32, Take::OFFCPU);
    } else if state & 0xff == 0 {
        // Preempted (or it yielded): still runnable, so until it runs again it waits for a CPU.
        // No stack (where it was is where it will resume); the low bit of the time marks the
        // wait as run-queue time.
        if !runnable_counted(off_cpu(tid, now | 1)) {
            runnable_add(1);
        }
    }
    Ok(())
}

/// How many target threads are runnable now, on a CPU or waiting for one, as the switches probe
/// saw since it armed say (a thread running at attach counts from its first switch). The drain
/// waits while the server's threads run ([`probe_common::maps::RUNNABLE`]). Not a precise
/// count: it can go below zero or stay high (a thread that left the target set while counted;
/// with OFFCPU_D_ONLY, where the sleeps probe does not follow leave their thread counted, it means
/// nothing); the collector reads it as a hint, beside the CPUs' idle time.
/// Per CPU, what that CPU's switches added (a thread leaves one CPU and comes on another): the
/// sum over the CPUs is the count.
#[map(name = "RUNNABLE")]
static RUNNABLE: PerCpuArray<i64> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn runnable_add(n: i64) {
    if let Some(p) = RUNNABLE.get_ptr_mut(0) {
        // SAFETY: this CPU's slot; the program runs with preemption off.
        unsafe { *p = (*p).wrapping_add(n) };
    }
}

/// Whether a thread whose [`OFFCPU_SINCE`] time was `since` (None: no entry) is counted in
/// [`RUNNABLE`]: on a CPU (0) or preempted (the low bit).
#[inline(always)]
fn runnable_counted(since: Option<u64>) -> bool {
    matches!(since, Some(s) if s == 0 || s & 1 != 0)
}

/// `tid` (a target thread) leaves the CPU: off it since `since` (its low bit set: still runnable,
/// preempted). Its entry is written in place: it stays in the map while the thread lives, marked
/// on a CPU ([`on_cpu`]), so that a thread switching hundreds of times a second (a decode's
/// thread pool) is not taken out of and put back into an LRU map at each switch. The time it
/// replaced (None: a thread seen for the first time).
#[inline(always)]
fn off_cpu(tid: u32, since: u64) -> Option<u64> {
    match OFFCPU_SINCE.get_ptr_mut(&tid) {
        // SAFETY: a map value pointer, valid for this program run.
        Some(v) => unsafe {
            let was = (*v)[0];
            *v = [since, 0, 0];
            Some(was)
        },
        None => {
            insert_lru(&OFFCPU_SINCE, &tid, &[since, 0, 0]);
            None
        }
    }
}

/// `tid` comes on a CPU: its wait ([since, woken, waker]) when probe follows it and it was off
/// one, its entry marked on a CPU (since 0).
#[inline(always)]
fn on_cpu(tid: u32) -> Option<[u64; 3]> {
    let v = OFFCPU_SINCE.get_ptr_mut(&tid)?;
    // SAFETY: a map value pointer, valid for this program run.
    let w = unsafe { *v };
    if w[0] == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { (*v)[0] = 0 };
    if w[0] & 1 == 0 {
        // It was blocked: runnable again.
        runnable_add(1);
    }
    Some(w)
}

/// `next` comes on the CPU at `now`, after the task it replaces ran `prev_ran` (u64::MAX: not
/// known): the end of its wait, when probe follows it.
#[inline(always)]
fn switched_in(next: u32, now: u64, prev_ran: u64) {
    if let Some([since, woken, waker]) = on_cpu(next) {
        came_on_cpu(next, now);
        let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
        // One clock reading for the switch: a wait's end is exactly when the thread ran.
        let sched = |flags: u32, blocked_ns: u64| SchedEvent {
            hdr: EventHeader { ts_ns: now, ..header::<SchedEvent>((pid_tgid >> 32) as u32, pid_tgid as u32) },
            tid: next,
            flags,
            blocked_ns,
        };
        // The task replaced held the CPU for the last `prev_ran` of the wait (not measured on
        // this CPU's first switch since arming: then 0, the whole wait).
        let held = if prev_ran == u64::MAX { 0 } else { last_run_flags(prev_ran) };
        if since & 1 != 0 {
            run_queue_wait(now.saturating_sub(since & !1), SCHED_PREEMPTED | held, &sched);
            return;
        }
        // Blocked, then woken: blocked until the wake-up (by which target thread, in the
        // flags' high bits), then waiting for a CPU until now.
        let (woken, waker) = if woken >= since && woken <= now { (woken, waker) } else { (now, 0) };
        emit(&sched(waker_flags(waker as u32), woken - since));
        run_queue_wait(now - woken, SCHED_WOKEN | held, &sched);
    } else if d_only() {
        // Interruptible sleeps are not followed then: the run's start is marked here.
        came_on_cpu(next, now);
    }
}

/// The processes charged with a wait, named as they ran ([`probe_common::maps::OTHER_COMMS`]).
#[map(name = "OTHER_COMMS")]
static OTHER_COMMS: LruHashMap<u32, [u8; 16]> = LruHashMap::with_max_entries(1024, 0);

/// A wait for a CPU: sent when it is at least SHORT_WAIT_NS, else only counted. The task it is
/// charged to (the current one) is named when it is no target's.
#[inline(always)]
fn run_queue_wait(ns: u64, flags: u32, sched: &impl Fn(u32, u64) -> SchedEvent) {
    if ns < SHORT_WAIT_NS {
        if ns > 0 {
            crate::add(&crate::COUNTERS, Counter::ShortWaits as u32, 1);
            crate::add(&crate::COUNTERS, Counter::ShortWaitNs as u32, ns);
        }
        return;
    }
    let ev = sched(flags, ns);
    if ev.hdr.pid != 0
        && current_target().is_none()
        && let Ok(comm) = aya_ebpf::helpers::bpf_get_current_comm()
    {
        let _ = OTHER_COMMS.insert(&ev.hdr.pid, &comm, 0);
    }
    emit(&ev);
}

/// The blocked record's flags: the waking target thread in bits 8..32 ([`waker_of`]).
#[inline(always)]
fn waker_flags(waker: u32) -> u32 {
    if waker < 1 << 24 { waker << 8 } else { 0 }
}

/// A target thread that blocked (it is in OFFCPU_SINCE as blocked) is runnable from now on. The
/// current task is the waker (sched_waking runs in its context): kept when it is a target thread.
#[inline(always)]
fn woken(tid: u32) {
    let Some(v) = OFFCPU_SINCE.get_ptr_mut(&tid) else { return };
    // SAFETY: a map value pointer, valid for this program run; a racing switch-in reads either
    // value, both times of this wake-up or none.
    let v = unsafe { &mut *v };
    if v[0] != 0 && v[0] & 1 == 0 && v[1] == 0 {
        v[2] = match current_target() {
            Some((_, t)) => u64::from(t),
            None => 0,
        };
        v[1] = now_ns();
    }
}

/// sched_waking as a raw tracepoint (arg 0: the woken `struct task_struct *`, its pid read at the
/// BTF offset). It runs for every wake-up on the machine, in the waker's context (sched_wakeup
/// may run on the woken task's CPU instead), often in interrupts on top of other programs: a
/// classic tracepoint would be skipped there (one global guard), a raw one is not.
#[raw_tracepoint(tracepoint = "sched_waking")]
pub fn sched_waking_raw(ctx: RawTracePointContext) -> i32 {
    let task: u64 = ctx.arg(0);
    if let Some(tid) = crate::task::read::<i32>(task, crate::task::offsets().task_pid) {
        woken(tid as u32);
    }
    0
}

/// sched:sched_waking (pid @24), where the raw tracepoint cannot attach.
#[tracepoint(category = "sched", name = "sched_waking")]
pub fn sched_waking(ctx: TracePointContext) -> u32 {
    if let Ok(tid) = field::<i32>(&ctx, wk::PID) {
        woken(tid as u32);
    }
    0
}
