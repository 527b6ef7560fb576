//! Verified programs kept from one trace to the next (`/sys/fs/bpf/probe`): a trace that takes
//! them starts as a new one does, with nothing of the last trace's target, state or ring; and
//! `--no-keep` leaves nothing loaded. Its own test binary: no other probe holds the kept set.
use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

mod common;
use common::{probe_bin, spawn_owned};

/// A process that reads `file` from storage over and over (its pages dropped from the page cache
/// before each read): page-cache misses and block reads of that file, and its own pid.
fn reader(file: &Path) -> common::Killed {
    let mut f = std::fs::File::create(file).unwrap();
    f.write_all(&vec![7u8; 4 << 20]).unwrap();
    f.sync_all().unwrap();
    let script = "import os,sys,time\n\
        p=sys.argv[1]\n\
        while True:\n\
        \x20   fd=os.open(p,os.O_RDONLY)\n\
        \x20   os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)\n\
        \x20   while os.read(fd,1<<20): pass\n\
        \x20   os.close(fd)\n\
        \x20   time.sleep(0.05)\n";
    spawn_owned(Command::new("python3").args(["-c", script]).arg(file))
}

/// The kept-set lock is free (no trace, and no child detaching a trace's programs, holds it):
/// waited for up to 30 s.
fn wait_kept_set_free() {
    let t = Instant::now();
    loop {
        let f = std::fs::OpenOptions::new().read(true).write(true).open("/run/probe/kept.lock");
        // SAFETY: flock on a descriptor we own (closed with `f`).
        let free =
            f.as_ref().map_or(true, |f| unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(f), libc::LOCK_EX | libc::LOCK_NB) } == 0);
        if free {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the kept set was still held 30 s on");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The files whose pages a report says the target read into the page cache, by inode. (Block
/// requests are charged to the target's cgroup too: the other reader, in the same cgroup, has
/// block reads in any trace; its page-cache adds are its own.)
fn inodes_read(report: &serde_json::Value) -> Vec<u64> {
    let files = report["files"].as_array().unwrap().iter();
    files.filter(|f| f["read_bytes"].as_u64().unwrap_or(0) > 0).filter_map(|f| f["inode"].as_u64()).collect()
}

fn inode(p: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap())
}

/// `probe trace -q --pid PID ARGS --out OUT` run to its end, which must be a success: its stderr.
fn trace_done(pid: u32, args: &[&str], out: &Path) -> String {
    let run = Command::new(probe_bin()).args(["trace", "--pid", &pid.to_string(), "-q"]).args(args).arg("--out").arg(out).output().unwrap();
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{err}");
    err
}

fn tmp(name: &str) -> PathBuf {
    // The page cache must be the disk's: /tmp may be a tmpfs, the test's target directory is not.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    dir.join(format!("{name}-{}", std::process::id()))
}

/// A trace killed with SIGKILL leaves its target in the kept set's target map and records in
/// its ring (it never switched off): the next trace takes the kept programs (not verified again)
/// and sees only its own target. The truth is which process read which file.
#[test]
fn a_kept_set_starts_as_a_new_one() {
    let _one = common::serial();
    let (file_a, file_b) = (tmp("kept-a.dat"), tmp("kept-b.dat"));
    let a = reader(&file_a);
    wait_kept_set_free();
    let out1 = tmp("kept-trace1");
    let (mut t1, _, _) = common::start_trace(&["--pid", &a.id().to_string(), "-q", "-v", "--out", out1.to_str().unwrap()]);
    std::thread::sleep(Duration::from_secs(2));
    t1.kill().unwrap();
    t1.wait().unwrap();
    let b = reader(&file_b);
    wait_kept_set_free();
    let out2 = tmp("kept-trace2");
    let err = trace_done(b.id(), &["-v", "--duration", "3s"], &out2);
    let took = err.lines().find(|l| l.contains("arming took")).unwrap_or_default();
    assert!(took.contains("kept_set (reused)"), "the second trace did not take the kept programs: {err}");
    let report = common::read_report(&out2);
    let read = inodes_read(&report);
    assert!(read.contains(&inode(&file_b)), "the target's own reads are missing: {}", report["files"]);
    assert!(!read.contains(&inode(&file_a)), "the last trace's target is in this one: {}", report["files"]);
    let lost: u64 = report["lost_events"].as_object().unwrap().values().filter_map(|v| v.as_u64()).sum();
    assert_eq!(lost, 0, "{}", report["lost_events"]);
    drop((a, b));
    for p in [file_a, file_b, out1, out2] {
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir_all(&p);
    }
}

/// `--no-keep`: the trace keeps nothing, and the set kept before is removed: once its programs
/// are detached, none of probe's is loaded at all.
#[test]
fn no_keep_leaves_nothing_loaded() {
    let _one = common::serial();
    let sleeper = spawn_owned(Command::new("sleep").arg("60"));
    wait_kept_set_free();
    let out = tmp("kept-nokeep");
    trace_done(sleeper.id(), &["--no-keep", "--duration", "1s"], &out);
    let t = Instant::now();
    while common::bpf::probe_programs_loaded() != 0 && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(common::bpf::probe_programs_loaded(), 0, "probe programs loaded 15 s after a --no-keep trace");
    let sets: Vec<_> = std::fs::read_dir(common::KEPT_ROOT).into_iter().flatten().flatten().map(|e| e.path()).collect();
    assert!(sets.is_empty(), "kept sets left: {sets:?}");
    let _ = std::fs::remove_dir_all(out);
}
