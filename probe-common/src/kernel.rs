//! Kernel struct offsets the programs need to walk from a task to an open file. aya-ebpf has no
//! CO-RE, so userspace reads these from the running kernel's BTF (/sys/kernel/btf/vmlinux) and
//! sets them as the global `KOFF` before loading. `valid == 0` means "unknown here: don't walk".

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub valid: u32,
    /// task_struct.files
    pub task_files: u32,
    /// files_struct.fdt
    pub files_fdt: u32,
    /// fdtable.max_fds
    pub fdt_max_fds: u32,
    /// fdtable.fd
    pub fdt_fd: u32,
    /// file.f_inode
    pub file_inode: u32,
    /// file.f_path.dentry
    pub file_dentry: u32,
    /// inode.i_ino
    pub inode_ino: u32,
    /// inode.i_sb
    pub inode_sb: u32,
    /// super_block.s_dev
    pub sb_dev: u32,
    /// dentry.d_name.name
    pub dentry_name: u32,
    /// file.private_data (a `struct socket *` for socket files)
    pub file_private_data: u32,
    /// socket.sk
    pub socket_sk: u32,
    /// inode.i_mode (u16)
    pub inode_mode: u32,
    /// sock_common (at the start of struct sock): skc_daddr, skc_rcv_saddr (IPv4, network order),
    /// skc_dport (network order), skc_num (host order), skc_family, skc_v6_daddr, skc_v6_rcv_saddr.
    pub skc_daddr: u32,
    pub skc_rcv_saddr: u32,
    pub skc_dport: u32,
    pub skc_num: u32,
    pub skc_family: u32,
    pub skc_v6_daddr: u32,
    pub skc_v6_rcv_saddr: u32,
    /// sock_common.skc_state (u8, TCP_* numbering)
    pub skc_state: u32,
    /// 1 when the block-request offsets below are known (read separately: a kernel may lack them).
    pub blk_valid: u32,
    /// request.__sector (u64), request.q, request_queue.disk, gendisk.major, gendisk.first_minor (int)
    pub rq_sector: u32,
    pub rq_q: u32,
    pub q_disk: u32,
    pub disk_major: u32,
    pub disk_first_minor: u32,
    /// request.__data_len (u32 bytes) and request.cmd_flags (u32: op in the low 8 bits, flags above)
    pub rq_data_len: u32,
    pub rq_cmd_flags: u32,
    /// Bit numbers of REQ_PREFLUSH, REQ_FUA, REQ_RAHEAD, REQ_SYNC, REQ_META in cmd_flags, from the
    /// kernel's `enum req_flag_bits` (they move between versions); [`NO_BIT`] when absent.
    pub req_bits: [u32; 5],
    /// task_struct.pid (the thread id): a raw sched_wakeup reads the woken task's.
    pub task_pid: u32,
    /// 1 when the bio offsets below are known: request.bio, bio.bi_blkg, blkcg_gq.blkcg,
    /// blkcg.css.cgroup, cgroup.kn, kernfs_node.id (u64), bio.bi_io_vec, bio_vec.bv_page,
    /// page.mapping, address_space.host. A bio's block cgroup and the file of its first page.
    pub bio_valid: u32,
    pub rq_bio: u32,
    pub bio_blkg: u32,
    pub blkg_blkcg: u32,
    pub blkcg_cgroup: u32,
    pub cgroup_kn: u32,
    pub kn_id: u32,
    pub bio_io_vec: u32,
    pub bvec_page: u32,
    pub page_mapping: u32,
    pub mapping_host: u32,
    /// task_struct.se.cfs_rq, cfs_rq.rq and rq.prev_steal_time_rq (u64: the paravirt steal the
    /// CPU's run queue accounted so far, CONFIG_PARAVIRT_TIME_ACCOUNTING): a switch reads its CPU's
    /// steal through the current task. All 0: unknown here.
    pub task_cfs_rq: u32,
    pub cfs_rq_rq: u32,
    pub rq_steal: u32,
    /// sock_common.skc_net.net (`struct net *`, CONFIG_NET_NS) and net.ns.inum (u32: the
    /// namespace's inode, as /proc/PID/ns/net shows it). 0: unknown here.
    pub skc_net: u32,
    pub net_inum: u32,
}

/// A flag bit the running kernel does not have.
pub const NO_BIT: u32 = 0xff;

/// Name of the global in probe-ebpf that holds [`KernelOffsets`].
pub const KOFF_SYMBOL: &str = "KOFF";
/// The global that limits off-CPU stacks to uninterruptible waits (u32, 1 = on): set by
/// userspace before load (`probe watch`).
pub const OFFCPU_D_ONLY_SYMBOL: &str = "OFFCPU_D_ONLY";
/// The global that caps the user-stack bytes a record copies (u32; 0: no cap beyond the
/// largest copy): set by userspace before load (`probe trace --stack-kib`).
pub const USTACK_LIMIT_SYMBOL: &str = "USTACK_LIMIT";
/// The global that says the perf programs (CPU samples, major faults) are attached per CPU, not
/// per target thread, and must keep the targets' events only (u32, 1 = per CPU): set by
/// userspace before load when probe runs in a PID namespace of its own.
pub const PERF_PER_CPU_SYMBOL: &str = "PERF_PER_CPU";
/// The global that says how often the ring's producer wakes the drain (u32: one forced wakeup
/// per `1 << shift` bytes of backlog, [`crate::wakeup_shift`]): set by userspace before load.
pub const WAKEUP_SHIFT_SYMBOL: &str = "WAKEUP_SHIFT";

/// Bytes of a file's base name carried in records.
pub const NAME_LEN: usize = 48;
