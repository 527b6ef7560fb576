//! The attach table: every program of probe's kernel object, its subsystem, how it attaches
//! (which tracepoint, raw tracepoint or perf event) and whether its subsystem needs it; and the
//! programs that run another's code.
use probe_common::tracepoints::{self as tp, Layout};

use crate::record::records::Subsystem;

#[derive(Clone, Copy, Debug)]
pub(super) enum How {
    /// A classic tracepoint whose fields are read at the offsets in `Layout`.
    Tracepoint(&'static Layout),
    /// A tracepoint whose fields are not read (only that it fired).
    Plain(&'static str, &'static str),
    /// syscalls:sys_enter_X / sys_exit_X: arguments at 16 + 8i, ret at 16.
    Syscall(&'static str),
    /// A raw tracepoint (arguments of the trace call; reads structs at offsets from BTF).
    Raw(&'static str),
    /// perf software event PAGE_FAULTS_MAJ, period 1, per thread of each target process.
    PerfMajorFaults,
    /// perf software event CPU_CLOCK at `Options::sample_hz`, per thread of each target process.
    PerfCpuClock,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Spec {
    pub(super) subsystem: Subsystem,
    pub(super) program: &'static str,
    pub(super) how: How,
    /// When false the subsystem still counts as live without it (e.g. insert: not every
    /// device uses an IO scheduler; mlock2: not every libc calls it).
    pub(super) required: bool,
}

const fn s(subsystem: Subsystem, program: &'static str, how: How, required: bool) -> Spec {
    Spec { subsystem, program, how, required }
}

/// The attach table.
pub(super) const TABLE: &[Spec] = &[
    s(Subsystem::Proc, "task_newtask", How::Tracepoint(&tp::task_newtask::LAYOUT), true),
    s(Subsystem::Proc, "sched_process_exec", How::Plain("sched", "sched_process_exec"), false),
    s(Subsystem::Proc, "sched_process_exit", How::Tracepoint(&tp::sched_process_exit::LAYOUT), true),
    s(Subsystem::Blockio, "block_io_start", How::Tracepoint(&tp::block_io_start::LAYOUT), false),
    s(Subsystem::Blockio, "block_rq_insert", How::Tracepoint(&tp::block_rq_insert::LAYOUT), false),
    s(Subsystem::Blockio, "block_rq_issue_raw", How::Raw("block_rq_issue"), false),
    s(Subsystem::Blockio, "block_rq_issue", How::Tracepoint(&tp::block_rq_issue::LAYOUT), true),
    s(Subsystem::Blockio, "block_rq_complete_raw", How::Raw("block_rq_complete"), false),
    s(Subsystem::Blockio, "block_rq_complete", How::Tracepoint(&tp::block_rq_complete::LAYOUT), true),
    s(Subsystem::Fault, "fault_major", How::PerfMajorFaults, true),
    s(Subsystem::Fault, "page_fault_user", How::Tracepoint(&tp::page_fault_user::LAYOUT), false),
    s(Subsystem::Filemap, "filemap_add", How::Tracepoint(&tp::mm_filemap_add_to_page_cache::LAYOUT), true),
    s(Subsystem::Mmap, "mmap_enter", How::Syscall("sys_enter_mmap"), true),
    s(Subsystem::Mmap, "mmap_exit", How::Syscall("sys_exit_mmap"), true),
    s(Subsystem::Mmap, "munmap_enter", How::Syscall("sys_enter_munmap"), true),
    s(Subsystem::Mmap, "munmap_exit", How::Syscall("sys_exit_munmap"), true),
    s(Subsystem::Mmap, "mremap_enter", How::Syscall("sys_enter_mremap"), false),
    s(Subsystem::Mmap, "mremap_exit", How::Syscall("sys_exit_mremap"), false),
    s(Subsystem::Mmap, "madvise_enter", How::Syscall("sys_enter_madvise"), false),
    s(Subsystem::Mmap, "madvise_exit", How::Syscall("sys_exit_madvise"), false),
    s(Subsystem::Mmap, "mlock_enter", How::Syscall("sys_enter_mlock"), false),
    s(Subsystem::Mmap, "mlock_exit", How::Syscall("sys_exit_mlock"), false),
    s(Subsystem::Mmap, "munlock_enter", How::Syscall("sys_enter_munlock"), false),
    s(Subsystem::Mmap, "munlock_exit", How::Syscall("sys_exit_munlock"), false),
    s(Subsystem::Mmap, "mlock2_enter", How::Syscall("sys_enter_mlock2"), false),
    s(Subsystem::Mmap, "mlock2_exit", How::Syscall("sys_exit_mlock2"), false),
    s(Subsystem::Mmap, "mprotect_enter", How::Syscall("sys_enter_mprotect"), false),
    s(Subsystem::Mmap, "mprotect_exit", How::Syscall("sys_exit_mprotect"), false),
    s(Subsystem::Sock, "inet_sock_set_state_raw", How::Raw("inet_sock_set_state"), false),
    s(Subsystem::Sock, "inet_sock_set_state", How::Tracepoint(&tp::inet_sock_set_state::LAYOUT), true),
    s(Subsystem::Sock, "tcp_receive_reset_raw", How::Raw("tcp_receive_reset"), false),
    s(Subsystem::Sock, "tcp_receive_reset", How::Tracepoint(&tp::tcp_receive_reset::LAYOUT), true),
    s(Subsystem::Sock, "tcp_send_reset_raw", How::Raw("tcp_send_reset"), false),
    s(Subsystem::Sock, "tcp_send_reset", How::Tracepoint(&tp::tcp_send_reset::LAYOUT), true),
    s(Subsystem::Sock, "sock_send_length", How::Tracepoint(&tp::sock_send_length::LAYOUT), false),
    s(Subsystem::Sock, "sock_recv_length", How::Tracepoint(&tp::sock_recv_length::LAYOUT), false),
    s(Subsystem::Sock, "sock_connect", How::Syscall("sys_enter_connect"), true),
    s(Subsystem::Sock, "sock_listen", How::Syscall("sys_enter_listen"), false),
    s(Subsystem::Sock, "sock_close", How::Syscall("sys_enter_close"), false),
    s(Subsystem::Cpu, "cpu_sample", How::PerfCpuClock, true),
    s(Subsystem::Offcpu, "sched_switch_raw", How::Raw("sched_switch"), false),
    s(Subsystem::Offcpu, "sched_switch", How::Tracepoint(&tp::sched_switch::LAYOUT), true),
    s(Subsystem::Offcpu, "sched_waking_raw", How::Raw("sched_waking"), false),
    s(Subsystem::Offcpu, "sched_waking", How::Tracepoint(&tp::sched_waking::LAYOUT), false),
    s(Subsystem::Mem, "direct_reclaim_begin", How::Plain("vmscan", "mm_vmscan_direct_reclaim_begin"), true),
    s(Subsystem::Mem, "direct_reclaim_end", How::Tracepoint(&tp::mm_vmscan_direct_reclaim_end::LAYOUT), true),
    s(Subsystem::Mem, "memcg_reclaim_begin", How::Plain("vmscan", "mm_vmscan_memcg_reclaim_begin"), false),
    s(Subsystem::Mem, "memcg_reclaim_end", How::Tracepoint(&tp::mm_vmscan_memcg_reclaim_end::LAYOUT), false),
    s(Subsystem::Mem, "compaction_begin", How::Plain("compaction", "mm_compaction_begin"), false),
    s(Subsystem::Mem, "compaction_end", How::Tracepoint(&tp::mm_compaction_end::LAYOUT), false),
    s(Subsystem::Mem, "oom_mark_victim", How::Tracepoint(&tp::mark_victim::LAYOUT), false),
    s(Subsystem::Stream, "read_enter", How::Syscall("sys_enter_read"), true),
    s(Subsystem::Stream, "read_exit", How::Syscall("sys_exit_read"), true),
    s(Subsystem::Stream, "write_enter", How::Syscall("sys_enter_write"), true),
    s(Subsystem::Stream, "write_exit", How::Syscall("sys_exit_write"), true),
    s(Subsystem::Stream, "recvfrom_enter", How::Syscall("sys_enter_recvfrom"), true),
    s(Subsystem::Stream, "recvfrom_exit", How::Syscall("sys_exit_recvfrom"), true),
    s(Subsystem::Stream, "sendto_enter", How::Syscall("sys_enter_sendto"), true),
    s(Subsystem::Stream, "sendto_exit", How::Syscall("sys_exit_sendto"), true),
    s(Subsystem::Stream, "readv_enter", How::Syscall("sys_enter_readv"), false),
    s(Subsystem::Stream, "readv_exit", How::Syscall("sys_exit_readv"), false),
    s(Subsystem::Stream, "writev_enter", How::Syscall("sys_enter_writev"), false),
    s(Subsystem::Stream, "writev_exit", How::Syscall("sys_exit_writev"), false),
    s(Subsystem::Stream, "recvmsg_enter", How::Syscall("sys_enter_recvmsg"), false),
    s(Subsystem::Stream, "recvmsg_exit", How::Syscall("sys_exit_recvmsg"), false),
    s(Subsystem::Stream, "sendmsg_enter", How::Syscall("sys_enter_sendmsg"), false),
    s(Subsystem::Stream, "sendmsg_exit", How::Syscall("sys_exit_sendmsg"), false),
];

/// Programs whose code is another's, instruction for instruction (a syscall's exit reads what its
/// enter kept, whichever syscall it was): the first is verified once and attached to the others'
/// tracepoints as well. Each keeps its name in what attached.
const SAME_CODE: &[(&str, &[&str])] = &[
    ("read_exit", &["write_exit", "recvfrom_exit", "sendto_exit", "readv_exit", "writev_exit", "recvmsg_exit", "sendmsg_exit"]),
    ("mmap_exit", &["munmap_exit", "mremap_exit", "madvise_exit", "mlock_exit", "munlock_exit", "mlock2_exit", "mprotect_exit"]),
    // The same layout (dev @8, sector @16), each checked against its format file at attach; the
    // insert first, as kernels before 6.5 have no block_io_start.
    ("block_rq_insert", &["block_io_start"]),
];

// block_io_start runs block_rq_insert's code: the fields it reads are where that code reads them.
const _: () = assert!(tp::block_io_start::DEV == tp::block_rq_insert::DEV && tp::block_io_start::SECTOR == tp::block_rq_insert::SECTOR);

/// The program whose loaded code `program` runs on, when that is another's (`SAME_CODE`).
pub(super) fn code_of(program: &str) -> Option<&'static str> {
    SAME_CODE.iter().find(|(_, same)| same.contains(&program)).map(|(first, _)| *first)
}
