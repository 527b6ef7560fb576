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
    ids_and_names(next, get_fd, name_at).into_iter().map(|(_, n)| n).collect()
}

/// As [`names`], each with its id.
fn ids_and_names(next: libc::c_long, get_fd: libc::c_long, name_at: usize) -> Vec<(u32, String)> {
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
            names.push((id, String::from_utf8_lossy(&name[..name.iter().position(|&c| c == 0).unwrap_or(16)]).into_owned()));
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

/// Whether a program name is one of the four unique to probe's object; the block issue program
/// is the raw tracepoint (`block_rq_issue_raw`, kept as `block_rq_issue_`) or its classic twin.
fn probe_program(n: &str) -> bool {
    ["fault_major", "filemap_add", "sock_connect"].contains(&n) || n.starts_with("block_rq_issue")
}

/// Whether a map name is one of the five unique to probe's object.
fn probe_map(n: &str) -> bool {
    ["OWNED_SOCKS", "LISTEN_PORTS", "USTACK_NEED", "OFFCPU_SINCE", "MMAP_ARGS"].contains(&n)
}

/// probe's programs in use now (names unique to probe's object): held by a process (a trace,
/// the child detaching its programs), or loaded and not in the kept set. A program kept pinned
/// between traces (`probe trace` keeps its verified programs) is neither: nothing of it runs.
pub fn probe_programs() -> usize {
    let (held, kept) = (held_ids("prog_id:"), kept_ids("progs"));
    ids_and_names(BPF_PROG_GET_NEXT_ID, BPF_PROG_GET_FD_BY_ID, 64)
        .iter()
        .filter(|(id, n)| probe_program(n) && (held.contains(id) || !kept.contains(id)))
        .count()
}

/// probe's maps in use now (names unique to probe's object), as [`probe_programs`] counts them.
pub fn probe_maps() -> usize {
    let (held, kept) = (held_ids("map_id:"), kept_ids("maps"));
    ids_and_names(BPF_MAP_GET_NEXT_ID, BPF_MAP_GET_FD_BY_ID, 24)
        .iter()
        .filter(|(id, n)| probe_map(n) && (held.contains(id) || !kept.contains(id)))
        .count()
}

/// probe's programs loaded at all, kept ones included.
pub fn probe_programs_loaded() -> usize {
    loaded_programs().iter().filter(|n| probe_program(n)).count()
}

/// The ids of the BPF objects that processes hold open (`prog_id:` / `map_id:` in their fds'
/// fdinfo: a program's own fd or a link's).
fn held_ids(field: &str) -> std::collections::HashSet<u32> {
    let mut ids = std::collections::HashSet::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let is_bpf = std::fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy().starts_with("anon_inode:bpf"));
            if !is_bpf {
                continue;
            }
            let info = std::fs::read_to_string(p.path().join("fdinfo").join(fd.file_name())).unwrap_or_default();
            ids.extend(info.lines().filter_map(|l| l.strip_prefix(field)).filter_map(|v| v.trim().parse::<u32>().ok()));
        }
    }
    ids
}

/// The ids of the objects pinned in probe's kept sets (`/sys/fs/bpf/probe/KEY/{progs,maps}`).
pub fn kept_ids(kind: &str) -> std::collections::HashSet<u32> {
    const BPF_OBJ_GET: libc::c_long = 7;
    let mut ids = std::collections::HashSet::new();
    for set in std::fs::read_dir(super::KEPT_ROOT).into_iter().flatten().flatten() {
        for pin in std::fs::read_dir(set.path().join(kind)).into_iter().flatten().flatten() {
            let Ok(path) = std::ffi::CString::new(pin.path().as_os_str().as_encoded_bytes()) else { continue };
            let mut attr = [0u64; 16];
            attr[0] = path.as_ptr() as u64; // pathname
            // SAFETY: bpf(2) with a NUL-terminated path that outlives the call.
            let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, attr.as_mut_ptr(), 128) } as i32;
            if fd < 0 {
                continue;
            }
            let mut info = [0u32; 64];
            let mut attr = [0u64; 16];
            attr[0] = fd as u64 | (256u64 << 32); // bpf_fd, info_len
            attr[1] = info.as_mut_ptr() as u64;
            // SAFETY: info points to a buffer of info_len bytes.
            let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, attr.as_mut_ptr(), 128) };
            // SAFETY: closing the fd we got.
            unsafe { libc::close(fd) };
            if rc == 0 {
                // The id: a program's second u32 (after its type), a map's too.
                ids.insert(info[1]);
            }
        }
    }
    ids
}
