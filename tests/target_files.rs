//! Target-file tests: a target that puts something else at the path of a file it maps (a FIFO, a
//! different ELF, a different model file) must neither stall probe nor make it read that thing.
//! The C workload (tests/data/target_files/swap.c) and its library (lib.c, built twice under two
//! names) are compiled here with cc.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{OnceLock, mpsc},
    time::{Duration, Instant},
};

use serde_json::Value;

mod common;
use common::{
    probe_bin,
    workload::{Workload, scratch},
};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/target_files").join(name)
}

/// The workload and the two builds of its library, built once per test run.
fn built() -> &'static (PathBuf, PathBuf, PathBuf) {
    static BIN: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    BIN.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let cc = |args: &[&str], out: &Path| {
            let st = Command::new("cc").args(["-O2", "-fomit-frame-pointer"]).args(args).arg("-o").arg(out).status().expect("cc");
            assert!(st.success(), "cannot compile {args:?}");
        };
        let (bin, victim, impost) = (dir.join("swap-workload"), dir.join("victim.so"), dir.join("impost.so"));
        cc(&[data("swap.c").to_str().unwrap(), "-ldl"], &bin);
        for (name, out) in [("victim", &victim), ("impost", &impost)] {
            cc(&["-shared", "-fPIC", &format!("-DNAME={name}"), data("lib.c").to_str().unwrap()], out);
        }
        (bin, victim, impost)
    })
}

/// Let the workload swap the file; returns once it has.
fn swap(w: &mut Workload) {
    writeln!(w.stdin.take().unwrap(), "go").unwrap();
    w.wait_line("swapped");
}

/// `probe trace --pid` on the workload, armed; killed on drop (a probe that stalls must not
/// outlive the test).
struct Trace {
    child: Child,
    log: mpsc::Receiver<String>,
    rec: PathBuf,
}

impl Trace {
    fn start(pid: u32, rec: &Path) -> Trace {
        let mut child = Command::new(probe_bin())
            .args(["trace", "--pid", &pid.to_string(), "--duration", "60s", "--out"])
            .arg(rec)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn probe");
        let err = child.stderr.take().unwrap();
        let (tx, log) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let t = Trace { child, log, rec: rec.to_path_buf() };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l =
                t.log.recv_timeout(left).unwrap_or_else(|_| panic!("probe did not arm within 20 s (stalled opening the target's files?)"));
            assert!(!l.contains("error"), "probe failed to start: {l}");
            if l.contains("armed in") {
                return t;
            }
        }
    }

    /// SIGINT, then probe must stop (its `stopped` line: the recording is complete) within 10 s
    /// and exit within 4 s of that (analysis, symbols, flamegraphs of a few seconds of trace,
    /// beside the detach of ~55 tracepoints: ~2 s here, an RCU grace period each). A stall never
    /// ends.
    fn interrupt(mut self) -> PathBuf {
        // SAFETY: signalling our own child, which has not been waited for yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok(l) if l.starts_with("probe: stopped") => break,
                Ok(_) => {}
                Err(_) => panic!("probe did not stop within 10 s of SIGINT (stalled on a file the target named?)"),
            }
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(4) {
            if let Some(st) = self.child.try_wait().unwrap() {
                let log: Vec<String> = self.log.try_iter().collect();
                assert!(st.code().is_some_and(|c| c <= 1), "probe exited {st:?}: {log:?}");
                return self.rec.clone();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("probe did not exit within 4 s of stopping (stalled symbolizing?): {:?}", self.log.try_iter().collect::<Vec<_>>());
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The recording's report, as `probe report --json` computes it again (it must be readable).
fn report(rec: &Path) -> Value {
    let out = Command::new(probe_bin()).args(["report", "--json"]).arg(rec).output().unwrap();
    assert!(out.status.code().is_some_and(|c| c <= 1), "probe report: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("probe report --json: {e}"))
}

/// `probe flamegraph` again, after the workload is gone (symbols by path only); within 10 s.
fn cpu_folded_offline(rec: &Path) -> String {
    let svg = rec.join("offline-cpu.svg");
    let mut p = Command::new(probe_bin())
        .args(["flamegraph", "--kind", "cpu", "--output"])
        .arg(&svg)
        .arg(rec)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if let Some(st) = p.try_wait().unwrap() {
            assert!(st.success(), "probe flamegraph failed: {st:?}");
            return std::fs::read_to_string(svg.with_extension("folded")).unwrap();
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = p.kill();
            let _ = p.wait();
            panic!("probe flamegraph stalled on the recording of a gone process");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A copy of the library at a path of its own, as the workload maps it.
fn lib_in(dir: &Path, which: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::copy(which, &p).unwrap();
    p
}

#[test]
fn a_fifo_at_a_mapped_elf_path_does_not_stall_probe() {
    let dir = scratch("fifo");
    let lib = lib_in(&dir, &built().1, "lib.so");
    let mut w = Workload::start_program(&built().0, &[lib.to_str().unwrap(), "fifo"]);
    let t = Trace::start(w.pid, &dir.join("rec"));
    std::thread::sleep(Duration::from_millis(1000));
    swap(&mut w);
    std::thread::sleep(Duration::from_millis(1000));
    let rec = t.interrupt();
    let folded = std::fs::read_to_string(rec.join("flame-cpu.folded")).unwrap();
    // Symbolized at the end through /proc/PID/map_files: the mapped library, not the FIFO.
    assert!(folded.contains("victim_spin;victim_inner"), "{folded}");
    assert!(report(&rec)["problems"].is_array());
    drop(w);
    let offline = cpu_folded_offline(&rec);
    assert!(!offline.contains("victim_"), "the FIFO at the path cannot have given names: {offline}");
    assert!(offline.contains("lib.so+0x"), "{offline}");
}

#[test]
fn a_different_elf_swapped_in_is_never_read() {
    let dir = scratch("elf");
    let lib = lib_in(&dir, &built().1, "lib.so");
    let other = lib_in(&dir, &built().2, "other.so");
    let mut w = Workload::start_program(&built().0, &[lib.to_str().unwrap(), "elf", other.to_str().unwrap()]);
    let t = Trace::start(w.pid, &dir.join("rec"));
    std::thread::sleep(Duration::from_millis(1000));
    swap(&mut w);
    std::thread::sleep(Duration::from_millis(1000));
    let rec = t.interrupt();
    let folded = std::fs::read_to_string(rec.join("flame-cpu.folded")).unwrap();
    assert!(!folded.contains("impost_"), "frames named from the ELF swapped in at the mapped path: {folded}");
    assert!(folded.contains("victim_spin;victim_inner"), "{folded}");
    drop(w);
    // The process is gone: the file at the path is not the one it mapped (another inode).
    let offline = cpu_folded_offline(&rec);
    assert!(!offline.contains("impost_") && !offline.contains("victim_"), "{offline}");
    assert!(offline.contains("lib.so+0x"), "{offline}");
}

#[test]
fn a_fifo_at_the_deleted_name_is_not_read_at_attach() {
    let dir = scratch("deleted");
    let lib = lib_in(&dir, &built().1, "lib.so");
    // /proc/PID/maps names the unlinked library "lib.so (deleted)": a FIFO waits at that path.
    let mut w = Workload::start_program(&built().0, &[lib.to_str().unwrap(), "deleted-fifo"]);
    let t = Trace::start(w.pid, &dir.join("rec"));
    swap(&mut w);
    std::thread::sleep(Duration::from_millis(1500));
    let rec = t.interrupt();
    let folded = std::fs::read_to_string(rec.join("flame-cpu.folded")).unwrap();
    // Unwound through the deleted library's .eh_frame (read through map_files) up to main.
    assert!(folded.contains("main;victim_spin;victim_inner"), "{folded}");
}

/// The residency the report gives the model file at `path`.
fn model_file<'a>(r: &'a Value, path: &Path) -> &'a Value {
    let files = r["system"]["model_files"].as_array().unwrap();
    files.iter().find(|f| f["path"] == path.to_str().unwrap()).unwrap_or_else(|| panic!("{} not watched: {files:?}", path.display()))
}

fn swapped_model_file(mode: &str) -> Value {
    let dir = scratch(mode);
    let data = dir.join("weights.bin");
    let mut w = Workload::start_program(&built().0, &[data.to_str().unwrap(), mode]);
    let t = Trace::start(w.pid, &dir.join("rec"));
    // The sampler finds the file at its first scan, then measures it every second.
    std::thread::sleep(Duration::from_millis(1500));
    swap(&mut w);
    std::thread::sleep(Duration::from_millis(2500));
    let rec = t.interrupt();
    let r = report(&rec);
    model_file(&r, &data).clone()
}

#[test]
fn a_fifo_at_a_mapped_model_path_does_not_stall_probe() {
    let f = swapped_model_file("data-fifo");
    assert!(f["readings"].as_u64().unwrap() >= 3, "{f}");
}

#[test]
fn residency_is_the_mapped_file_s_not_the_one_swapped_in() {
    let f = swapped_model_file("data-hot");
    // The mapped file was evicted and never touched; the one written at its path is all resident.
    assert!(f["readings"].as_u64().unwrap() >= 3, "{f}");
    assert!(f["resident_end"].as_f64().unwrap() < 0.5, "the residency of the file swapped in was reported: {f}");
    assert_eq!(f["bytes"], 32u64 << 20, "{f}");
}
