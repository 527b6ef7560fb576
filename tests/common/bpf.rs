//! What BPF objects the kernel holds, through bpf(2) as `bpftool prog` / `bpftool map` list
//! them: the tests that check probe leaves nothing loaded behind (tests/cleanup.rs,
//! tests/faults.rs). Run them one binary at a time: another probe's programs would count.

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_MAP_GET_NEXT_ID: libc::c_long = 12;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// Names of the kernel's loaded objects of one sort: `next` and `get_fd` are the bpf(2)
/// commands that walk the ids and open one; the name is at `name_at` in its info struct
/// (`struct bpf_prog_info`: 64; `struct bpf_map_info`: 24).
fn names(next: libc::c_long, get_fd: libc::c_long, name_at: usize) -> Vec<String> {
    let mut names = Vec::new();
    let mut id: u32 = 0;
    loop {
        let mut attr = [0u32; 32];
        attr[0] = id; // start_id
        // SAFETY: bpf(2) with a zeroed attr union large enough for these commands.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, next, attr.as_mut_ptr(), 128) };
        if rc != 0 {
            return names;
        }
        id = attr[1]; // next_id
        let mut attr = [0u32; 32];
        attr[0] = id; // prog_id / map_id
        // SAFETY: as above.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, get_fd, attr.as_mut_ptr(), 128) } as i32;
        if fd < 0 {
            continue;
        }
        let mut info = [0u8; 256];
        let mut attr = [0u64; 16];
        attr[0] = fd as u64 | ((info.len() as u64) << 32); // bpf_fd, info_len
        attr[1] = info.as_mut_ptr() as u64; // info
        // SAFETY: info points to a buffer of info_len bytes.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, attr.as_mut_ptr(), 128) };
        // SAFETY: closing the fd we got.
        unsafe { libc::close(fd) };
        if rc == 0 {
            let name = &info[name_at..name_at + 16];
            names.push(String::from_utf8_lossy(&name[..name.iter().position(|&c| c == 0).unwrap_or(16)]).into_owned());
        }
    }
}

/// Names of every BPF program loaded in the kernel (the kernel keeps 15 characters).
pub fn loaded_programs() -> Vec<String> {
    names(BPF_PROG_GET_NEXT_ID, BPF_PROG_GET_FD_BY_ID, 64)
}

/// Wait (up to 30 s) until no probe object is loaded: an earlier test's probe that exited is
/// released by the kernel a little later (its programs go one by one), and a count of one
/// object's programs must not see them.
pub fn wait_no_probe_programs() {
    let t = std::time::Instant::now();
    while probe_programs() != 0 && t.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Names of every BPF map in the kernel.
pub fn loaded_maps() -> Vec<String> {
    names(BPF_MAP_GET_NEXT_ID, BPF_MAP_GET_FD_BY_ID, 24)
}

/// probe's programs loaded now: names unique to probe's object; the block issue program is the
/// raw tracepoint (`block_rq_issue_raw`, kept as `block_rq_issue_`) or its classic twin.
pub fn probe_programs() -> usize {
    loaded_programs()
        .iter()
        .filter(|n| ["fault_major", "filemap_add", "sock_connect"].contains(&n.as_str()) || n.starts_with("block_rq_issue"))
        .count()
}

/// probe's maps in the kernel now (names unique to probe's object).
pub fn probe_maps() -> usize {
    loaded_maps()
        .iter()
        .filter(|n| ["OWNED_SOCKS", "LISTEN_PORTS", "USTACK_NEED", "OFFCPU_SINCE", "MMAP_ARGS"].contains(&n.as_str()))
        .count()
}
