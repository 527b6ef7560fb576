//! Nothing stays loaded: after `probe trace` ends (cleanly, or refused with an error) no BPF
//! program of probe's is left in the kernel. Its own test binary, so no other probe runs meanwhile.
use std::process::Command;

mod common;
use common::probe_bin;

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// Names of every BPF program loaded in the kernel (bpf(2), as `bpftool prog` lists them).
fn loaded_programs() -> Vec<String> {
    let mut names = Vec::new();
    let mut id: u32 = 0;
    loop {
        let mut attr = [0u32; 32];
        attr[0] = id; // start_id
        // SAFETY: bpf(2) with a zeroed attr union large enough for these commands.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_GET_NEXT_ID, attr.as_mut_ptr(), 128) };
        if rc != 0 {
            return names;
        }
        id = attr[1]; // next_id
        let mut attr = [0u32; 32];
        attr[0] = id; // prog_id
        // SAFETY: as above.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_GET_FD_BY_ID, attr.as_mut_ptr(), 128) } as i32;
        if fd < 0 {
            continue;
        }
        let mut info = [0u8; 256]; // struct bpf_prog_info; name[16] at offset 64
        let mut attr = [0u64; 16];
        attr[0] = fd as u64 | ((info.len() as u64) << 32); // bpf_fd, info_len
        attr[1] = info.as_mut_ptr() as u64; // info
        // SAFETY: info points to a buffer of info_len bytes.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, attr.as_mut_ptr(), 128) };
        // SAFETY: closing the fd we got.
        unsafe { libc::close(fd) };
        if rc == 0 {
            let name = &info[64..80];
            names.push(String::from_utf8_lossy(&name[..name.iter().position(|&c| c == 0).unwrap_or(16)]).into_owned());
        }
    }
}

fn ours() -> usize {
    // Names unique to probe's object (the kernel keeps 15 characters); the block issue program is
    // the raw tracepoint (`block_rq_issue_raw`, kept as `block_rq_issue_`) or its classic twin.
    loaded_programs()
        .iter()
        .filter(|n| ["fault_major", "filemap_add", "sock_connect"].contains(&n.as_str()) || n.starts_with("block_rq_issue"))
        .count()
}

#[test]
fn no_program_outlives_probe() {
    assert_eq!(ours(), 0, "probe programs loaded before the test");
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let out = std::env::temp_dir().join(format!("probe-cleanup-{}", std::process::id()));
    let mut p = Command::new(probe_bin())
        .args(["trace", "--pid", &sleeper.id().to_string(), "--duration", "3s", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(ours(), 4, "while tracing, the programs are loaded (and this check can see them)");
    assert!(p.wait().unwrap().success());
    assert_eq!(ours(), 0, "programs left loaded after a clean stop");
    // A refused start (a probe that is not known) loads nothing either.
    let st = Command::new(probe_bin()).args(["trace", "--pid", &sleeper.id().to_string(), "--probes", "nosuch"]).output().unwrap();
    assert_eq!(st.status.code(), Some(2));
    assert_eq!(ours(), 0);
    // Not root: one clear line, exit 2, nothing loaded.
    let st = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(probe_bin())
        .args(["trace", "--pid", &sleeper.id().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&st.stderr);
    assert_eq!(st.status.code(), Some(2), "{err}");
    assert!(err.contains("needs root"), "{err}");
    assert_eq!(ours(), 0);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let _ = std::fs::remove_dir_all(out);
}
