//! Field offsets of the classic tracepoints the kernel programs read, in one place.
//!
//! aya-ebpf has no CO-RE, so the programs read fields at fixed offsets. Userspace checks every
//! offset here against `/sys/kernel/tracing/events/<group>/<name>/format` before attaching and
//! skips (and reports) a probe whose layout differs on the running kernel, instead of reading
//! garbage. Offsets are in bytes from the start of the tracepoint record (after `common_*`).

/// A field the programs read: name in the format file, offset, size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

const fn f(name: &'static str, offset: usize, size: usize) -> Field {
    Field { name, offset, size }
}

/// One tracepoint and the fields read from it.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub group: &'static str,
    pub name: &'static str,
    pub fields: &'static [Field],
}

macro_rules! layout {
    ($id:ident, $group:literal, $name:literal, { $($field:ident : $fname:literal @ $off:literal, $size:literal;)* }) => {
        #[allow(non_snake_case)]
        pub mod $id {
            $(pub const $field: usize = $off;)*
            pub const LAYOUT: super::Layout = super::Layout {
                group: $group,
                name: $name,
                fields: &[$(super::f($fname, $off, $size)),*],
            };
        }
    };
}

// block: `dev_t dev` is the kernel-internal encoding (major << 20 | minor).
layout!(block_rq_insert, "block", "block_rq_insert", { DEV: "dev" @ 8, 4; SECTOR: "sector" @ 16, 8; });
layout!(block_io_start, "block", "block_io_start", { DEV: "dev" @ 8, 4; SECTOR: "sector" @ 16, 8; });
layout!(block_rq_issue, "block", "block_rq_issue", {
    DEV: "dev" @ 8, 4; SECTOR: "sector" @ 16, 8; BYTES: "bytes" @ 28, 4; RWBS: "rwbs" @ 34, 10;
});
layout!(block_rq_complete, "block", "block_rq_complete", {
    DEV: "dev" @ 8, 4; SECTOR: "sector" @ 16, 8; ERROR: "error" @ 28, 4;
});
layout!(mm_filemap_add_to_page_cache, "filemap", "mm_filemap_add_to_page_cache", {
    I_INO: "i_ino" @ 16, 8; INDEX: "index" @ 24, 8; S_DEV: "s_dev" @ 32, 4; ORDER: "order" @ 36, 1;
});
layout!(page_fault_user, "exceptions", "page_fault_user", { ADDRESS: "address" @ 8, 8; });
layout!(inet_sock_set_state, "sock", "inet_sock_set_state", {
    SKADDR: "skaddr" @ 8, 8; OLDSTATE: "oldstate" @ 16, 4; NEWSTATE: "newstate" @ 20, 4;
    SPORT: "sport" @ 24, 2; DPORT: "dport" @ 26, 2; FAMILY: "family" @ 28, 2; PROTOCOL: "protocol" @ 30, 2;
    SADDR: "saddr" @ 32, 4; DADDR: "daddr" @ 36, 4; SADDR_V6: "saddr_v6" @ 40, 16; DADDR_V6: "daddr_v6" @ 56, 16;
});
layout!(tcp_receive_reset, "tcp", "tcp_receive_reset", {
    SKADDR: "skaddr" @ 8, 8; SPORT: "sport" @ 16, 2; DPORT: "dport" @ 18, 2; FAMILY: "family" @ 20, 2;
    SADDR: "saddr" @ 22, 4; DADDR: "daddr" @ 26, 4; SADDR_V6: "saddr_v6" @ 30, 16; DADDR_V6: "daddr_v6" @ 46, 16;
});
// saddr/daddr are a `struct sockaddr_in` or `sockaddr_in6` (28 bytes), ports in network order.
layout!(tcp_send_reset, "tcp", "tcp_send_reset", {
    SKADDR: "skaddr" @ 16, 8; STATE: "state" @ 24, 4; SADDR: "saddr" @ 32, 28; DADDR: "daddr" @ 60, 28;
});
layout!(sock_send_length, "sock", "sock_send_length", {
    SK: "sk" @ 8, 8; FAMILY: "family" @ 16, 2; PROTOCOL: "protocol" @ 18, 2;
});
layout!(sock_recv_length, "sock", "sock_recv_length", {
    SK: "sk" @ 8, 8; FAMILY: "family" @ 16, 2; PROTOCOL: "protocol" @ 18, 2;
});
layout!(sched_switch, "sched", "sched_switch", {
    PREV_PID: "prev_pid" @ 24, 4; PREV_STATE: "prev_state" @ 32, 8; NEXT_PID: "next_pid" @ 56, 4;
});
layout!(sched_waking, "sched", "sched_waking", { PID: "pid" @ 24, 4; });
// vmscan / compaction / oom: memory pressure (the begin events are only timed, no field read).
layout!(mm_vmscan_direct_reclaim_end, "vmscan", "mm_vmscan_direct_reclaim_end", { NR_RECLAIMED: "nr_reclaimed" @ 8, 8; });
layout!(mm_vmscan_memcg_reclaim_end, "vmscan", "mm_vmscan_memcg_reclaim_end", { NR_RECLAIMED: "nr_reclaimed" @ 8, 8; });
layout!(mm_compaction_end, "compaction", "mm_compaction_end", { STATUS: "status" @ 44, 4; });
layout!(mark_victim, "oom", "mark_victim", { PID: "pid" @ 8, 4; ANON_RSS: "anon_rss" @ 24, 8; FILE_RSS: "file_rss" @ 32, 8; });
layout!(task_newtask, "task", "task_newtask", { PID: "pid" @ 8, 4; CLONE_FLAGS: "clone_flags" @ 32, 8; });
layout!(sched_process_exec, "sched", "sched_process_exec", { PID: "pid" @ 12, 4; });
layout!(sched_process_exit, "sched", "sched_process_exit", { PID: "pid" @ 24, 4; GROUP_DEAD: "group_dead" @ 32, 1; });

/// Syscall tracepoints: `sys_enter_*` arguments are 8-byte slots from offset 16 (after
/// `__syscall_nr` and padding); `sys_exit_*` has `ret` at 16. This is the syscall ABI of the
/// tracepoint and is checked like the others.
pub const SYSCALL_ARG0: usize = 16;
pub const SYSCALL_RET: usize = 16;

/// `clone_flags` bit that makes a new task a thread of its parent's process.
pub const CLONE_THREAD: u64 = 0x0001_0000;
