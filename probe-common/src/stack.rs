//! Stacks: a sample's kernel stack (instruction pointers) and the raw user stack with the user
//! registers, for unwinding in userspace from `.eh_frame` (servers ship without frame pointers).
//! The raw user stack is unwound by the collector and dropped: only frame addresses are stored.
use crate::{EventHeader, EventKind, Record};

/// Largest user-stack slice copied per sample (from `sp` up): 128 KiB less one word, so that
/// `& USTACK_MASK` bounds it for the verifier. A server thread's frames from `main` down to the
/// sampled function can exceed 64 KiB (llama-server's main thread: 82 KiB from the decode to the
/// end of its stack, `llama_server`'s frame alone over 20 KiB). A thread is copied that much only
/// once its stacks were seen to need it ([`need_entry`]); before, at most [`USTACK_WIDE`]. Near
/// the top of a stack the copy falls back to 32, 16, 8, 4, 2 and 1 KiB, or reads up to the end of
/// the stack's mapping when the collector found it.
pub const USTACK_CAP: usize = 131072 - 8;
pub const USTACK_MASK: u32 = 0x1ffff;
/// The second largest copy, and the most a thread is copied before its needs are known.
pub const USTACK_WIDE: usize = 65536 - 8;
/// The ring buffer's fill (eighths) from which a stack record copies at most [`TRIM_BYTES`] of user
/// stack, and from which ([`DROP_USTACK_AT`]) none (kernel frames only). The collector lets the
/// ring fill to half while every CPU is busy (its drain then yields to the server) and is raised
/// there: past that, whole-stack copies (tens of KiB each, at every block IO of a thrashing
/// model) would fill the rest and lose the small records a verdict rests on.
pub const TRIM_AT: u64 = 5;
pub const DROP_USTACK_AT: u64 = 6;
/// The user-stack bytes a trimmed record keeps: the innermost frames.
pub const TRIM_BYTES: u32 = 8192;

/// The most user-stack bytes a record may copy with `used` of the ring's `size` bytes unread:
/// `cap`, or less past [`TRIM_AT`] (see there).
#[inline(always)]
pub const fn ring_cap(cap: u32, used: u64, size: u64) -> u32 {
    let eighth = size / 8;
    if eighth == 0 {
        // A ring whose size the kernel did not say: nothing to go by.
        cap
    } else if used >= DROP_USTACK_AT * eighth {
        0
    } else if used >= TRIM_AT * eighth && cap > TRIM_BYTES {
        TRIM_BYTES
    } else {
        cap
    }
}
pub const KSTACK_DEPTH: usize = 64;

/// A thread's entry in the USTACK_NEED map: the user-stack bytes its stacks need (a power of two,
/// rounded up to one: its log2 in the low 5 bits; [`USTACK_CAP`] is kept as 128 KiB) and, when the collector found it, the end of the mapping its stack
/// is in (page aligned; 0: not known). The two largest copies then read only up to that end: a
/// read past it faults as a whole, and a thread whose stack ends less than the copy above its
/// frames (a main thread under `main`, a thread under a large frame) was cut at the next size.
pub const fn need_entry(need: u32, top: u64) -> u64 {
    let log2 = if need == 0 { 0 } else { need.next_power_of_two().trailing_zeros() as u64 };
    (top & !0xfff) | (log2 & 0x1f)
}

/// The bytes a [`need_entry`] says its thread's stacks need.
pub const fn entry_need(v: u64) -> u32 {
    1u32 << ((v & 0x1f) as u32 & 31)
}

/// The end of a [`need_entry`]'s stack mapping (0: not known).
pub const fn entry_top(v: u64) -> u64 {
    v & !0xfff
}

/// Fixed part of a stack record; `ustack_bytes` of user stack (starting at `sp`) follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackEvent {
    pub hdr: EventHeader,
    /// [`STACK_CPU`], [`STACK_OFFCPU`], [`STACK_FAULT`] or [`STACK_IO`].
    pub what: u32,
    /// `bpf_get_stack` result for the kernel stack: bytes written, or -errno.
    pub kstack_bytes: i32,
    pub ustack_bytes: u32,
    /// Off-CPU: the task state when it left the CPU (1 interruptible, 2 uninterruptible, ...).
    pub state: u32,
    /// User registers (the user-mode state at the last kernel entry).
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Fault: the faulting address; IO: the sector.
    pub addr: u64,
    pub kstack: [u64; KSTACK_DEPTH],
}
const _: () = assert!(core::mem::size_of::<StackEvent>() == 584);
impl Record for StackEvent {
    const KIND: EventKind = EventKind::Stack;
}

impl Default for StackEvent {
    fn default() -> Self {
        Self {
            hdr: Default::default(),
            what: 0,
            kstack_bytes: 0,
            ustack_bytes: 0,
            state: 0,
            ip: 0,
            sp: 0,
            bp: 0,
            addr: 0,
            kstack: [0; KSTACK_DEPTH],
        }
    }
}

/// Or'ed into `what` of a record ([`stack_remembered`] kinds) whose user stack was left out because
/// it is the one the same thread sent last from the same place ([`SeenStacks`] matched a slot, [`stack_slot`]):
/// the collector reuses that one's frames.
pub const STACK_SAME_USER: u32 = 0x100;
/// Or'ed into `what` with [`STACK_SAME_USER`]: the kernel stack was left out too (`kstack_bytes`
/// 0), because the thread also entered the kernel the same way as for that record
/// ([`kernel_key`]): the collector reuses its kernel frames. Unwinding the kernel stack is most
/// of an off-CPU record's cost (about 10 us a switch on this kernel).
pub const STACK_SAME_KERNEL: u32 = 0x200;
/// After this many reuses in a row the user stack is sent again, so no reuse goes stale for long.
pub const SAME_REFRESH: u32 = 32;
/// Places each thread's off-CPU stacks are remembered for (an OpenMP worker blocks at two or
/// three barriers in turn: with one place remembered, none of its stacks was ever reused).
pub const STACK_SLOTS: usize = 4;
/// An off-CPU record's slot ([`stack_slot`]) in `what`, bits 12..14: with [`STACK_SAME_USER`]
/// the slot whose stacks it reuses, else the slot its stacks are remembered in.
pub const STACK_SLOT_SHIFT: u32 = 12;

/// A stack record's kind ([`STACK_CPU`], ...) without the flags `what` carries.
pub const fn stack_kind(what: u32) -> u32 {
    what & 0xff
}

/// Whether records of `what`'s kind go through the thread's places ([`SeenStacks`]): off-CPU,
/// block IO and major-fault records may be sent as the same as the thread's last at a place, and
/// each one not sent so is remembered there. A readahead issues several block IOs from one fault
/// (the same user registers: the same stack), and the fault's own switch off the CPU follows
/// from there too; a thrashing model faults again and again at one load instruction of a matrix
/// loop. CPU samples do not (each is its own).
pub const fn stack_remembered(what: u32) -> bool {
    matches!(stack_kind(what), STACK_OFFCPU | STACK_IO | STACK_FAULT)
}

/// An off-CPU record's slot ([`STACK_SLOT_SHIFT`]).
pub const fn stack_slot(what: u32) -> usize {
    (what >> STACK_SLOT_SHIFT) as usize % STACK_SLOTS
}

/// One place a thread blocked at ([`SeenStacks`]): the user registers it blocked with. The same
/// instruction, stack depth and frame register in the same thread is the same call path (bytes
/// on the stack are not compared: locals change between waits, and the measured matches fell
/// from a third to none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeenUstack {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// How the last record of this place entered the kernel ([`kernel_key`]); 0: never reused.
    pub kernel_key: u64,
    pub repeats: u32,
    /// The user-stack bytes the thread's stacks were known to need when this place's stack was
    /// sent ([`entry_need`]; 0: not known): once the collector says they need more, the place's
    /// next record is sent whole again rather than reuse a stack that was cut.
    pub need: u32,
}
const _: () = assert!(core::mem::size_of::<SeenUstack>() == 40);

/// Stack mappings are listed by 2 MiB of address space ([`StackKey::granule`]).
pub const STACK_GRANULE_SHIFT: u32 = 21;

/// A process's 2 MiB of address space (map `STACK_RANGES`): the key of the stack mappings that
/// overlap it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StackKey {
    pub pid: u32,
    /// The address shifted right by [`STACK_GRANULE_SHIFT`] (user addresses are below 2^47).
    pub granule: u32,
}

impl StackKey {
    pub const fn of(pid: u32, addr: u64) -> StackKey {
        StackKey { pid, granule: (addr >> STACK_GRANULE_SHIFT) as u32 }
    }
}

/// The mappings that may hold a thread's stack, overlapping one [`StackKey`]'s 2 MiB (two at most:
/// pthread stacks lie side by side, each above its guard page), written by the collector from
/// /proc/PID/maps at attach and when the mappings change: `[stack]` and the writable anonymous
/// mappings just above a guard mapping. Before the collector has learned what a thread's stacks
/// need (`USTACK_NEED`), a stack record copies the stack from its pointer to the end of the
/// mapping that holds it, no more: a thread pool blocked at its barriers has a few KiB there,
/// where the copy used to be 64 KiB (the ring filled at 26 MB/s in the first second after attach,
/// before anything was learned). One lookup, no search: the verifier walks it once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackSpans {
    pub start: [u64; 2],
    pub end: [u64; 2],
}

impl StackSpans {
    /// The end of the span holding `sp` (None: neither does).
    #[inline(always)]
    pub fn end_of(&self, sp: u64) -> Option<u64> {
        if self.start[0] <= sp && sp < self.end[0] {
            Some(self.end[0])
        } else if self.start[1] <= sp && sp < self.end[1] {
            Some(self.end[1])
        } else {
            None
        }
    }

    /// Add a span; false when both are taken.
    pub fn add(&mut self, start: u64, end: u64) -> bool {
        for i in 0..2 {
            if self.end[i] == 0 {
                (self.start[i], self.end[i]) = (start, end);
                return true;
            }
        }
        false
    }
}

/// The keys of `pid`'s span `start..end` with the granules it overlaps.
pub fn stack_keys(pid: u32, start: u64, end: u64) -> impl Iterator<Item = StackKey> {
    let (first, last) = ((start >> STACK_GRANULE_SHIFT) as u32, (end.saturating_sub(1) >> STACK_GRANULE_SHIFT) as u32);
    (first..=last).map(move |granule| StackKey { pid, granule })
}

/// The smallest stack copy that holds `room` bytes: the power of two at or above it, 1 KiB at
/// least, 1 MiB at most (the copies are 1 KiB to 128 KiB: one of 1 MiB is the largest). Bits
/// smeared, not a loop: one path for the verifier, not one per size.
#[inline(always)]
pub const fn copy_for(room: u64) -> u32 {
    let room = if room > 1 << 20 { 1 << 20 } else { room };
    let mut x = room.saturating_sub(1) | 1023;
    x |= x >> 1;
    x |= x >> 2;
    x |= x >> 4;
    x |= x >> 8;
    x |= x >> 16;
    (x + 1) as u32
}

/// What the kernel remembers of a thread's last off-CPU stacks (map `USTACK_SEEN`): the last
/// [`STACK_SLOTS`] places it blocked at, replaced in turn (`next`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeenStacks {
    pub slots: [SeenUstack; STACK_SLOTS],
    pub next: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<SeenStacks>() == 168);

/// The key under which an off-CPU kernel stack may be reused: the system call the thread is in
/// (`orig_ax` of its user registers) and the state it blocked in. From the same user registers,
/// the same call and an interruptible sleep take the same kernel path (a futex, poll or accept
/// wait). 0 (never reused) for an uninterruptible wait: disk IO, a fault or reclaim can block
/// inside any call at several places, and the disk and memory verdicts rest on those stacks.
pub const fn kernel_key(orig_ax: u64, state: u32) -> u64 {
    if state & 0x2 != 0 || state == 0 { 0 } else { (state as u64) << 32 | (orig_ax & 0xffff_ffff) }
}

/// The `prev_state` the classic sched_switch tracepoint reports (the kernel's
/// `__trace_sched_switch_state`), from the raw tracepoint's arguments: preempted,
/// TASK_REPORT_MAX (0x100); otherwise the highest bit of the state within TASK_REPORT (0x7f),
/// where TASK_IDLE reads as idle (0x80), a wait for an RT lock as TASK_UNINTERRUPTIBLE (0x2), and
/// a thread past `do_task_dead` (TASK_DEAD, 0x80: its exit state is not in `__state`) as
/// EXIT_DEAD (0x10).
#[inline(always)]
pub const fn reported_state(preempt: bool, prev: u32) -> i64 {
    const TASK_DEAD: u32 = 0x80;
    const TASK_IDLE: u32 = 0x402;
    const TASK_RTLOCK_WAIT: u32 = 0x1000;
    if preempt {
        return 0x100;
    }
    let s = if prev & TASK_RTLOCK_WAIT != 0 {
        0x2
    } else if prev & TASK_IDLE == TASK_IDLE {
        0x80
    } else if prev & TASK_DEAD != 0 {
        0x10
    } else {
        prev & 0x7f
    };
    if s == 0 { 0 } else { 1i64 << (31 - s.leading_zeros()) }
}

pub const STACK_CPU: u32 = 1;
pub const STACK_OFFCPU: u32 = 2;
pub const STACK_FAULT: u32 = 3;
pub const STACK_IO: u32 = 4;

/// `SchedEvent::flags`: the thread was switched out still runnable (preempted, or it yielded)
/// and `blocked_ns` is all run-queue wait: it wanted a CPU the whole time. The header's task is
/// the one it replaced on this CPU: what ran instead.
pub const SCHED_PREEMPTED: u32 = 1;

/// `SchedEvent::flags`: the thread had blocked, was woken (sched_waking) and `blocked_ns` is the
/// run-queue wait from the wake-up until it ran; the header's task is what ran on this CPU
/// meanwhile. Its blocked part before the wake-up comes in its own record (flags 0), just before.
pub const SCHED_WOKEN: u32 = 2;

/// `SchedEvent::flags`: the hypervisor's steal while the thread ran: what its CPU's run queue
/// accounted of the paravirt steal clock (`rq.prev_steal_time_rq`, CONFIG_PARAVIRT_TIME_ACCOUNTING)
/// grew by between the thread's switch-in and switch-out, summed over its runs since the record
/// before: `blocked_ns` is that steal, the header's time the end of the span, and bits 8..32 the
/// span in µs ([`steal_span_ns`]). The header's task is the thread.
pub const SCHED_STEAL: u32 = 4;

/// Whether a [`SchedEvent`] is a wait for a CPU (after a preemption or a wake-up).
pub const fn is_cpu_wait(flags: u32) -> bool {
    flags & (SCHED_PREEMPTED | SCHED_WOKEN) != 0
}

/// Whether a [`SchedEvent`] is the steal of a thread's runs ([`SCHED_STEAL`]).
pub const fn is_steal(flags: u32) -> bool {
    flags & SCHED_STEAL != 0
}

/// The span a [`SCHED_STEAL`] record's steal fell in, ns (ending at its header's time).
pub const fn steal_span_ns(flags: u32) -> u64 {
    (flags >> 8) as u64 * 1000
}

/// A cpu-wait record's bits 8..32: how long the task in its header had been running on this CPU
/// when the thread switched in, in µs + 1 (capped at 2^24 − 2 µs, 16.7 s). It held the CPU for
/// the end of the wait only: before, the CPU may have been another's (a server thread's) that
/// left it. 0: not measured (a recording from before): the whole wait was its.
pub const fn last_run_flags(run_ns: u64) -> u32 {
    let us = run_ns / 1000 + 1;
    (if us > 0xff_fffe { 0xff_fffe } else { us as u32 }) << 8
}

/// The header task's run before a cpu-wait record's thread switched in, ns ([`last_run_flags`]).
pub const fn last_run_ns(flags: u32) -> Option<u64> {
    let v = flags >> 8;
    if v == 0 { None } else { Some((v as u64 - 1) * 1000) }
}

/// The target thread that woke a blocked thread, from a blocked record's flags (bits 8..32; a
/// tid fits: PID_MAX_LIMIT is 2^22); None when the waker was no target thread (another process,
/// an interrupt over one, a timer) or the kernel did not say.
pub const fn waker_of(flags: u32) -> Option<u32> {
    if is_cpu_wait(flags) || is_steal(flags) || flags >> 8 == 0 { None } else { Some(flags >> 8) }
}

/// A thread's steal is sent once it reaches this (else with the span's end, below)...
pub const STEAL_SEND_NS: u64 = 1_000_000;
/// ...or after this long, when it reached [`STEAL_MIN_NS`] (less is not worth a record).
pub const STEAL_SPAN_NS: u64 = 100_000_000;
pub const STEAL_MIN_NS: u64 = 20_000;

/// A run-queue wait shorter than this is only counted (`Counter::ShortWaits`, `ShortWaitNs`), not
/// sent: at 20 µs a wait is below any scheduler slice, and such waits come by the thousand.
pub const SHORT_WAIT_NS: u64 = 20_000;

/// A target thread came back on a CPU after blocking (pairs with its STACK_OFFCPU record) or
/// after waiting for a CPU ([`SCHED_PREEMPTED`]: no stack was taken).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedEvent {
    pub hdr: EventHeader,
    /// The thread that switched in (the header's tid is the task it replaced).
    pub tid: u32,
    /// [`SCHED_PREEMPTED`], [`SCHED_WOKEN`], or for a blocked record 0 with the waking target
    /// thread in bits 8..32 ([`waker_of`]).
    pub flags: u32,
    /// How long it was off the CPU, ns.
    pub blocked_ns: u64,
}
const _: () = assert!(core::mem::size_of::<SchedEvent>() == 40);
impl Record for SchedEvent {
    const KIND: EventKind = EventKind::Sched;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole copies while the drain keeps the ring under its raise point; past it the innermost
    /// TRIM_BYTES, then none, whatever size the ring is.
    #[test]
    fn a_filling_ring_trims_user_stacks() {
        for size in [1u64 << 20, 32 << 20, 256 << 20] {
            assert_eq!(ring_cap(USTACK_CAP as u32, 0, size), USTACK_CAP as u32);
            assert_eq!(ring_cap(USTACK_CAP as u32, size / 2, size), USTACK_CAP as u32, "half full: the drain is raised there");
            assert_eq!(ring_cap(USTACK_CAP as u32, size / 8 * 5, size), TRIM_BYTES);
            assert_eq!(ring_cap(4096, size / 8 * 5, size), 4096, "a small copy stays as it is");
            assert_eq!(ring_cap(USTACK_CAP as u32, size / 4 * 3, size), 0);
            assert_eq!(ring_cap(4096, size, size), 0);
        }
        assert_eq!(ring_cap(4096, 1 << 20, 0), 4096, "no size: no trim");
    }

    /// The raw tracepoint's state reads as the classic one reports it (include/linux/sched.h's
    /// bits; `__trace_sched_switch_state` in include/trace/events/sched.h).
    #[test]
    fn raw_switch_states_read_as_the_classic_tracepoint_reports_them() {
        for (preempt, raw, classic) in [
            (true, 0x1, 0x100),   // preempted: runnable whatever the state
            (false, 0x0, 0x0),    // yielded: running
            (false, 0x1, 0x1),    // TASK_INTERRUPTIBLE: S
            (false, 0x2, 0x2),    // TASK_UNINTERRUPTIBLE: D
            (false, 0x102, 0x2),  // TASK_KILLABLE: D
            (false, 0x2002, 0x2), // D | TASK_FREEZABLE
            (false, 0x402, 0x80), // TASK_IDLE: I
            (false, 0x1000, 0x2), // TASK_RTLOCK_WAIT: D
            (false, 0x4, 0x4),    // __TASK_STOPPED: T
            (false, 0x8, 0x8),    // __TASK_TRACED: t
            (false, 0x40, 0x40),  // TASK_PARKED
            (false, 0x80, 0x10),  // TASK_DEAD: its last switch, an exit
        ] {
            assert_eq!(reported_state(preempt, raw), classic, "preempt {preempt}, state {raw:#x}");
        }
    }

    #[test]
    fn a_need_entry_holds_the_bytes_and_the_stacks_end() {
        let v = need_entry(65536, 0x7ffd_1234_5000);
        assert_eq!((entry_need(v), entry_top(v)), (65536, 0x7ffd_1234_5000));
        assert!(entry_need(need_entry(USTACK_CAP as u32, 0)) >= USTACK_CAP as u32, "the largest copy");
        let v = need_entry(1024, 0);
        assert_eq!((entry_need(v), entry_top(v)), (1024, 0), "no end known");
        assert_eq!(entry_top(need_entry(2048, 1)), 0, "an end looked for and not limiting: none");
        assert_eq!(entry_top(need_entry(4096, 0x7000_0fff)), 0x7000_0000, "page aligned");
    }

    #[test]
    fn only_interruptible_sleeps_reuse_a_kernel_stack() {
        let futex = 202;
        assert_ne!(kernel_key(futex, 1), 0, "an interruptible futex wait");
        assert_ne!(kernel_key(futex, 1), kernel_key(7, 1), "another call (poll) is another path");
        assert_ne!(kernel_key(futex, 1), kernel_key(futex, 0x100 | 1), "another state");
        assert_eq!(kernel_key(0, 2), 0, "uninterruptible: never reused");
        assert_eq!(kernel_key(futex, 0x2 | 0x400), 0, "TASK_KILLABLE is uninterruptible too");
        assert_eq!(kernel_key(futex, 0), 0, "a running task did not block");
    }

    #[test]
    fn a_slot_and_a_kind_share_what() {
        let what = STACK_OFFCPU | STACK_SAME_USER | STACK_SAME_KERNEL | (3 << STACK_SLOT_SHIFT);
        assert_eq!((stack_kind(what), stack_slot(what)), (STACK_OFFCPU, 3));
        assert_eq!((stack_kind(STACK_CPU), stack_slot(STACK_CPU)), (STACK_CPU, 0));
    }

    #[test]
    fn a_last_run_survives_its_flags() {
        for ns in [0u64, 999, 1_000, 2_500_000, 16_000_000_000] {
            let f = SCHED_PREEMPTED | last_run_flags(ns);
            assert!(is_cpu_wait(f) && waker_of(f).is_none());
            assert_eq!(last_run_ns(f), Some(ns / 1000 * 1000));
        }
        assert_eq!(last_run_ns(SCHED_WOKEN), None, "not said: a recording from before");
        assert_eq!(last_run_ns(last_run_flags(u64::MAX)), Some((0xff_fffe - 1) * 1000), "capped");
    }

    /// A stack pointer finds its mapping's end through the 2 MiB it is in; two mappings side by
    /// side in one 2 MiB are told apart; a third is not kept.
    #[test]
    fn a_stack_pointer_finds_the_end_of_its_mapping() {
        let (a, b) = (0x7f00_0000_1000u64, 0x7f00_0080_1000u64);
        assert_eq!(stack_keys(7, a, b).count(), 5, "8 MiB not aligned to 2 MiB: five of them");
        assert_eq!(stack_keys(7, a, b).next(), Some(StackKey::of(7, a)));
        assert_eq!(stack_keys(7, a, b).last(), Some(StackKey::of(7, b - 1)));
        let mut s = StackSpans::default();
        assert_eq!(s.end_of(a), None);
        assert!(s.add(a, b) && s.add(b + 0x1000, b + 0x81_0000));
        assert!(!s.add(1, 2), "two at most");
        assert_eq!(s.end_of(a), Some(b));
        assert_eq!(s.end_of(b - 8), Some(b));
        assert_eq!(s.end_of(b), None, "the guard page between them");
        assert_eq!(s.end_of(b + 0x2000), Some(b + 0x81_0000));
    }

    #[test]
    fn a_copy_holds_the_room_it_is_for() {
        assert_eq!(copy_for(0), 1024);
        assert_eq!(copy_for(1024), 1024);
        assert_eq!(copy_for(1025), 2048);
        assert_eq!(copy_for(80 * 1024), 128 * 1024);
        assert_eq!(copy_for(128 * 1024), 128 * 1024);
        assert_eq!(copy_for(1 << 30), 1 << 20, "the largest copy, whatever the room");
    }
}
