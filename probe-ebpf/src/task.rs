//! Walks from the current task to one of its open files (task → files → fdt → fd[n] → file),
//! with struct offsets userspace read from the running kernel's BTF (`KOFF`).
use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes};
use probe_common::kernel::{KernelOffsets, NAME_LEN};

/// Set by userspace before load (EbpfLoader::set_global). All zero = unknown: don't walk.
#[unsafe(no_mangle)]
static KOFF: KernelOffsets = KernelOffsets {
    valid: 0,
    task_files: 0,
    files_fdt: 0,
    fdt_max_fds: 0,
    fdt_fd: 0,
    file_inode: 0,
    file_dentry: 0,
    inode_ino: 0,
    inode_sb: 0,
    sb_dev: 0,
    dentry_name: 0,
    file_private_data: 0,
    socket_sk: 0,
    inode_mode: 0,
    skc_daddr: 0,
    skc_rcv_saddr: 0,
    skc_dport: 0,
    skc_num: 0,
    skc_family: 0,
    skc_v6_daddr: 0,
    skc_v6_rcv_saddr: 0,
    skc_state: 0,
    blk_valid: 0,
    rq_sector: 0,
    rq_q: 0,
    q_disk: 0,
    disk_major: 0,
    disk_first_minor: 0,
    rq_data_len: 0,
    rq_cmd_flags: 0,
    req_bits: [probe_common::kernel::NO_BIT; 5],
    task_pid: 0,
    bio_valid: 0,
    rq_bio: 0,
    bio_blkg: 0,
    blkg_blkcg: 0,
    blkcg_cgroup: 0,
    cgroup_kn: 0,
    kn_id: 0,
    bio_io_vec: 0,
    bvec_page: 0,
    page_mapping: 0,
    mapping_host: 0,
    task_cfs_rq: 0,
    cfs_rq_rq: 0,
    rq_steal: 0,
    skc_net: 0,
    net_inum: 0,
};

#[inline(always)]
pub fn read<T>(base: u64, off: u32) -> Option<T> {
    // SAFETY: a probe read: a bad kernel address returns an error instead of faulting.
    unsafe { bpf_probe_read_kernel((base + off as u64) as *const T) }.ok()
}

#[inline(always)]
pub fn offsets() -> KernelOffsets {
    // SAFETY: read_volatile of a global so the compiler keeps the value set at load, not 0.
    unsafe { core::ptr::read_volatile(&KOFF) }
}

/// `struct file *` of the current task's `fd`.
#[inline(always)]
fn file_ptr(k: &KernelOffsets, fd: i32) -> Option<u64> {
    if k.valid == 0 || fd < 0 {
        return None;
    }
    // SAFETY: helper without arguments; the pointer is only used for probe reads.
    let task = unsafe { bpf_get_current_task() };
    let files: u64 = read(task, k.task_files)?;
    let fdt: u64 = read(files, k.files_fdt)?;
    let max: u32 = read(fdt, k.fdt_max_fds)?;
    if fd as u32 >= max {
        return None;
    }
    let fds: u64 = read(fdt, k.fdt_fd)?;
    let file: u64 = read(fds, fd as u32 * 8)?;
    (file != 0).then_some(file)
}

/// The file behind `fd` of the current task: (inode, kernel dev_t), and its base name in `name`.
#[inline(always)]
pub fn file_of_fd(fd: i32, name: &mut [u8; NAME_LEN]) -> Option<(u64, u32)> {
    let k = offsets();
    let file = file_ptr(&k, fd)?;
    let inode: u64 = read(file, k.file_inode)?;
    let ino: u64 = read(inode, k.inode_ino)?;
    let sb: u64 = read(inode, k.inode_sb)?;
    let dev: u32 = read(sb, k.sb_dev)?;
    let dentry: u64 = read(file, k.file_dentry)?;
    let name_ptr: u64 = read(dentry, k.dentry_name)?;
    // SAFETY: probe read of a NUL-terminated kernel string into a fixed buffer.
    let _ = unsafe { bpf_probe_read_kernel_str_bytes(name_ptr as *const u8, name) };
    Some((ino, dev))
}

/// The `struct sock *` behind `fd` of the current task, when that fd is a socket.
#[inline(always)]
pub fn sock_of_fd(fd: i32) -> Option<u64> {
    const S_IFMT: u16 = 0o170000;
    const S_IFSOCK: u16 = 0o140000;
    let k = offsets();
    let file = file_ptr(&k, fd)?;
    let inode: u64 = read(file, k.file_inode)?;
    let mode: u16 = read(inode, k.inode_mode)?;
    if mode & S_IFMT != S_IFSOCK {
        return None;
    }
    let socket: u64 = read(file, k.file_private_data)?;
    let sk: u64 = read(socket, k.socket_sk)?;
    (sk != 0).then_some(sk)
}
