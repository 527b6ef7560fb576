//! Kernel tests: real workloads traced by the real `probe` binary, as root, on this kernel.
//! They fail (never skip) when probe cannot attach. Build the binary first: `cargo xtask test`
//! does, or set PROBE_BIN.
use std::{
    io::{BufRead, BufReader, Write},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command},
    sync::mpsc,
    time::Duration,
};

use serde_json::Value;

mod common;
use common::{
    probe_bin, start_trace,
    workload::{Workload, scratch},
};

/// `probe trace` running against a pid, returning once it printed "armed".
struct Trace {
    child: Child,
    out: PathBuf,
    stderr: mpsc::Receiver<String>,
}

impl Trace {
    fn start(pid: u32, out: &std::path::Path, extra: &[&str]) -> Self {
        let pid = pid.to_string();
        let out_s = out.to_str().unwrap();
        let mut args = vec!["--pid", &pid, "--out", out_s, "--duration", "60s", "--json"];
        args.extend_from_slice(extra);
        let (child, stderr, _) = start_trace(&args);
        Trace { child, out: out.to_path_buf(), stderr }
    }

    /// Wait for probe to stop by itself (the target exited) and return report.json.
    fn finish(mut self) -> Value {
        let status = self.child.wait().unwrap();
        let log: Vec<String> = self.stderr.iter().collect(); // until probe closed stderr
        assert!(status.code() == Some(0), "probe exited {status:?}: {log:?}");
        assert!(log.iter().any(|l| l.contains("target exited")), "probe should stop on the target's exit: {log:?}");
        common::read_report(&self.out)
    }
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn cold_mapped_file_is_named_with_exact_major_faults() {
    const PAGES: u64 = 48;
    let dir = scratch("cold");
    let file = dir.join("weights.bin");
    let mut w = Workload::start(&["cold-mmap", file.to_str().unwrap(), &PAGES.to_string()]);
    let t = Trace::start(w.pid, &dir.join("rec"), &[]);
    let done = w.go();
    assert!(done.contains("resident_before=0"), "the file was not cold: {done}");
    let r = t.finish();
    // This kernel (6.18) runs every kernel program, the raw tracepoint twins too: none falls back
    // (a program the verifier refuses is a skip, not a failure, so only this says it).
    for p in r["probes"].as_array().unwrap().iter().filter(|p| p["name"] != "engine") {
        assert!(p["skipped"].as_array().unwrap().is_empty(), "{}: {}", p["name"], p["skipped"]);
    }

    let files = r["files"].as_array().unwrap();
    let f = files.iter().find(|f| f["path"] == file.to_str().unwrap()).unwrap_or_else(|| panic!("file not named: {files:?}"));
    assert_eq!(n(&f["major_faults"]), PAGES, "{f}");
    assert!(n(&f["read_bytes"]) >= PAGES * 4096, "{f}");
    assert!(n(&r["blockio"]["read_bytes"]) >= PAGES * 4096, "{} skipped by the kernel: {}", r["blockio"], r["skipped_runs"]);
    assert!(n(&r["blockio"]["requests"]) >= 1);
    assert_eq!(n(&r["faults"]["major"]), PAGES);
    let mmaps = r["mmaps"].as_array().unwrap();
    assert!(
        mmaps.iter().any(|m| m["op"] == "mmap" && m["path"] == file.to_str().unwrap() && n(&m["len"]) == PAGES * 16 * 4096),
        "{mmaps:?}"
    );
    assert!(mmaps.iter().any(|m| m["op"] == "madvise"), "{mmaps:?}");
    assert!(r["lost_events"].as_object().unwrap().values().all(|v| n(v) == 0));
    // What tracing cost: the kernel counted the fault program's runs and their time.
    let cost = &r["cost"];
    assert!(cost["bpf_unmeasured"].is_null(), "{cost}");
    let prog = |name: &str| cost["programs"].as_array().unwrap().iter().find(|p| p["name"] == name).cloned();
    let pf = prog("page_fault_user").unwrap_or_else(|| panic!("no cost for page_fault_user: {cost}"));
    assert!(n(&pf["runs"]) >= PAGES && pf["ns_per_run"].as_f64().unwrap() > 0.0, "{pf}");
    assert!(cost["probe_cpu_ms"].as_f64().unwrap() > 0.0 && cost["wall_s"].as_f64().unwrap() > 0.0, "{cost}");
}

/// A listener on loopback in the test process: the peer of the workload's connection.
fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

fn connection_to<'a>(r: &'a Value, peer: &str) -> &'a Value {
    let conns = r["connections"].as_array().unwrap();
    conns.iter().find(|c| c["peer"] == peer).unwrap_or_else(|| panic!("no connection to {peer}: {conns:?}"))
}

#[test]
fn peer_reset_is_seen_as_received_reset() {
    let dir = scratch("rst");
    let (l, addr) = listener();
    let mut w = Workload::start(&["tcp", &addr, "wait-reset"]);
    let (sock, _) = l.accept().unwrap();
    let t = Trace::start(w.pid, &dir.join("rec"), &[]);
    let peer = std::thread::spawn(move || {
        let mut s = sock;
        let mut line = String::new();
        BufReader::new(&mut s).read_line(&mut line).unwrap();
        // SO_LINGER 0 makes close() send RST instead of FIN.
        let lin = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: valid socket fd and a linger struct of the right size.
        unsafe {
            use std::os::fd::AsRawFd;
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&lin as *const libc::linger).cast(),
                size_of::<libc::linger>() as u32,
            );
        }
        drop(s);
    });
    let done = w.go();
    peer.join().unwrap();
    assert!(done.contains("ConnectionReset") || done.contains("104"), "workload did not see a reset: {done}");
    let r = t.finish();
    let c = connection_to(&r, &addr);
    assert_eq!(c["closed_by"], "peer", "{c}");
    assert_eq!(c["reset"], "received", "{c}");
}

#[test]
fn local_close_is_seen_as_closed_by_local() {
    let dir = scratch("fin");
    let (l, addr) = listener();
    let mut w = Workload::start(&["tcp", &addr, "close"]);
    let (sock, _) = l.accept().unwrap();
    let t = Trace::start(w.pid, &dir.join("rec"), &[]);
    let peer = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut &sock, &mut buf);
        drop(sock);
    });
    w.go();
    peer.join().unwrap();
    let r = t.finish();
    let c = connection_to(&r, &addr);
    assert_eq!(c["closed_by"], "local", "{c}");
    assert_eq!(c["reset"], "none", "{c}");
    assert!(c["states"].as_array().unwrap().iter().any(|s| s == "FIN_WAIT1"), "{c}");
}

#[test]
fn forked_child_is_traced_and_mmaps_are_counted() {
    const N: usize = 37;
    const LEN: usize = 7 * 4096; // a length nothing else in the workload uses
    let dir = scratch("fork");
    let mut w = Workload::start(&["fork-mmap", &N.to_string(), &LEN.to_string()]);
    let t = Trace::start(w.pid, &dir.join("rec"), &[]);
    let done = w.go();
    let child: u64 = done.split_whitespace().find_map(|kv| kv.strip_prefix("child=")).unwrap().parse().unwrap();
    let r = t.finish();
    let procs = r["target"]["processes"].as_array().unwrap();
    let p = procs.iter().find(|p| n(&p["pid"]) == child).unwrap_or_else(|| panic!("child {child} not traced: {procs:?}"));
    assert_eq!(n(&p["parent"]), w.pid as u64);
    assert!(p["exited_ms"].is_number(), "{p}");
    let rows = r["mmaps"].as_array().unwrap();
    let count = |op: &str| rows.iter().filter(|m| m["op"] == op && n(&m["pid"]) == child && n(&m["len"]) == LEN as u64).count();
    assert_eq!(count("mmap"), N);
    assert_eq!(count("munmap"), N);
}

#[test]
fn sigkilled_probe_leaves_a_readable_recording() {
    let dir = scratch("kill");
    let rec = dir.join("rec");
    let mut w = Workload::start(&["mmap-loop", "30"]);
    let mut t = Trace::start(w.pid, &rec, &[]);
    w.stdin.take().map(|mut s| writeln!(s, "go"));
    std::thread::sleep(Duration::from_millis(2500));
    t.child.kill().unwrap(); // SIGKILL
    t.child.wait().unwrap();
    let _ = w.child.kill();
    let _ = w.child.wait();
    let out = Command::new(probe_bin()).args(["report", "--json"]).arg(&rec).output().unwrap();
    assert!(out.status.code() == Some(0) || out.status.code() == Some(1), "{out:?}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(n(&r["mmap_counts"]["mmap"]) > 1000, "events before the kill should be there: {}", r["mmap_counts"]);
    let problems = r["problems"].as_array().unwrap();
    assert!(problems.iter().any(|p| p.as_str().unwrap().contains("no end record")), "{problems:?}");
}

/// Each thread of `pid`: (comm, scheduling policy), from /proc (field 41 of stat: 0 SCHED_OTHER,
/// 5 SCHED_IDLE).
fn policies(pid: u32) -> Vec<(String, u32)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?.trim().to_string();
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let policy = stat.rsplit_once(')')?.1.split_whitespace().nth(38)?.parse().ok()?;
            Some((comm, policy))
        })
        .collect()
}

/// By default the ring's drain yields the CPUs (idle priority once it keeps up) under a watchdog;
/// `--no-yield` keeps it at normal priority, with no watchdog (nothing can hold it back).
#[test]
fn the_drain_yields_unless_told_not_to() {
    let dir = scratch("yield");
    let mut w = Workload::start(&["mmap-loop", "30"]);
    let drain = |extra: &[&str], rec: &str| {
        let t = Trace::start(w.pid, &dir.join(rec), extra);
        let pid = t.child.id();
        let t0 = std::time::Instant::now();
        let mut seen = policies(pid);
        // Idle priority comes after 5 turns that keep up and a second of calm.
        while extra.is_empty() && !seen.iter().any(|(c, p)| c == "probe" && *p == 5) && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(200));
            seen = policies(pid);
        }
        if !extra.is_empty() {
            std::thread::sleep(Duration::from_secs(3));
            seen = policies(pid);
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGINT) };
        let mut t = t;
        t.child.wait().unwrap();
        seen
    };
    let yielding = drain(&[], "default");
    let kept = drain(&["--no-yield"], "no-yield");
    let _ = w.child.kill();
    let _ = w.child.wait();
    assert!(yielding.iter().any(|(c, p)| c == "probe" && *p == 5), "the drain never yielded: {yielding:?}");
    assert!(yielding.iter().any(|(c, _)| c == "probe-watchdog"), "{yielding:?}");
    assert!(kept.iter().filter(|(c, _)| c == "probe" || c == "probe-sample").all(|(_, p)| *p == 0), "{kept:?}");
    assert!(!kept.iter().any(|(c, _)| c == "probe-watchdog"), "no watchdog with --no-yield: {kept:?}");
}

fn run_probe(args: &[&str]) -> (i32, String) {
    let out = Command::new(probe_bin()).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_input_gets_one_clear_line_and_exit_2() {
    // A pid that cannot exist (above pid_max).
    let (code, err) = run_probe(&["trace", "--pid", "999999999", "--duration", "1s"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no process with pid 999999999"), "{err}");
    let (code, err) = run_probe(&["trace", "--pid", "1", "--probes", "blockio,nosuch", "--duration", "1s"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown probe `nosuch`"), "{err}");
    let dir = scratch("notrec");
    std::fs::write(dir.join("events.bin"), b"definitely not a recording").unwrap();
    let (code, err) = run_probe(&["report", dir.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a probe recording"), "{err}");
    let (code, err) = run_probe(&["report", "/nonexistent/dir"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn doctor_finds_every_probe_live() {
    let t = std::time::Instant::now();
    let out = Command::new(probe_bin()).arg("doctor").output().unwrap();
    let took = t.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    for p in ["blockio", "fault", "filemap", "mmap", "sock", "stream", "cpu", "offcpu", "mem", "proc"] {
        assert!(text.lines().any(|l| l.starts_with(&format!("probe {p} ")) && l.contains("ok: live")), "{p}: {text}");
    }
    // One row per capability, each ok as root.
    for cap in ["CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE", "CAP_SYSLOG", "CAP_CHECKPOINT_RESTORE"] {
        assert!(text.lines().any(|l| l.starts_with(cap) && l.contains(" ok: ")), "{cap}: {text}");
    }
    // The samplers' findings: this machine has PSI and a 6.18 kernel (cachestat), no NVIDIA GPU.
    assert!(text.lines().any(|l| l.starts_with("PSI") && l.contains("ok: memory and io stall time")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("page cache") && l.contains("cachestat(2)")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("GPU")), "{text}");
    // The programs are detached after doctor exits, not while the user waits (a gross bound).
    assert!(took < std::time::Duration::from_secs(3), "doctor took {took:?}");
    // As a user without privileges: the checklist still comes, with what is missing, and exit 2.
    let dir = std::env::temp_dir().join(format!("probe-doctor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    let bin = dir.join("probe");
    std::fs::copy(probe_bin(), &bin).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("setpriv").args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(&bin).arg("doctor").output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.lines().any(|l| l.starts_with("CAP_BPF") && l.contains("missing")), "{text}");
    assert!(text.contains("run `sudo probe doctor`"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("PSI")), "the checks that need no privilege are made: {text}");
}

/// A process that allocates without end inside a memory cgroup (v1, 48 MiB): the cgroup reclaims
/// in its context, then the OOM killer ends it. The mem probe sees both; the trace stops on the exit.
#[test]
fn oom_kill_in_a_memory_cgroup_is_reported() {
    let cg = PathBuf::from(format!("/sys/fs/cgroup/memory/probe-oom-{}", std::process::id()));
    assert!(std::path::Path::new("/sys/fs/cgroup/memory").exists(), "no cgroup v1 memory controller at /sys/fs/cgroup/memory");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("memory.limit_in_bytes"), (48u64 << 20).to_string()).unwrap();
    let dir = scratch("oom");
    let mut w = Workload::start(&["hog", cg.to_str().unwrap()]);
    let t = Trace::start(w.pid, &dir.join("rec"), &[]);
    writeln!(w.stdin.take().unwrap(), "go").unwrap();
    let status = w.child.wait().unwrap();
    let r = t.finish();
    let _ = std::fs::remove_dir(&cg);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "the workload was not killed: {status:?}");
    let m = &r["system"]["memory"];
    let kills = m["oom_kills"].as_array().unwrap();
    assert_eq!(kills.len(), 1, "{m}");
    assert_eq!(n(&kills[0]["pid"]), w.pid as u64, "{m}");
    assert!(n(&kills[0]["rss_kib"]) >= 30 << 10, "the victim's RSS at the kill: {m}");
    assert!(n(&m["memcg_reclaim"]["count"]) > 0, "no cgroup reclaim seen before the kill: {m}");
    assert_eq!(m["cgroup_limit"], 48u64 << 20, "{m}");
}

/// scripts/install.sh (what `cargo xtask install` runs as root) into a scratch prefix: the
/// binary with the README's mode, group and capabilities, man pages and completions. From a fresh
/// shell `probe doctor` runs by name; a member of the group, not root, gets every probe live
/// through the file capabilities. `--uninstall` leaves nothing of it.
#[test]
fn install_puts_probe_on_path_with_its_capabilities_and_uninstall_removes_it() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let prefix = std::env::temp_dir().join(format!("probe-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    std::fs::create_dir(&prefix).unwrap();
    std::fs::set_permissions(&prefix, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/install.sh");
    let out = Command::new("bash").arg(&script).arg("--prefix").arg(&prefix).arg(probe_bin()).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{said}");
    let bin = prefix.join("bin/probe");
    let meta = std::fs::metadata(&bin).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o750, "{said}");
    let group = Command::new("getent").args(["group", "probe"]).output().unwrap();
    let gid: u32 = String::from_utf8_lossy(&group.stdout).split(':').nth(2).unwrap().trim().parse().unwrap();
    assert_eq!(meta.gid(), gid);
    // Run by name from a fresh shell.
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", prefix.join("bin").display());
    let fresh = Command::new("env").args(["-i", &format!("PATH={path}"), "sh", "-c", "probe doctor"]).output().unwrap();
    let text = String::from_utf8_lossy(&fresh.stdout);
    assert_eq!(fresh.status.code(), Some(0), "{text}");
    // The capabilities: a member of the group, not root, traces without sudo.
    let caps = Command::new("getcap").arg(&bin).output().map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default();
    assert!(caps.contains("cap_bpf") && caps.contains("cap_perfmon"), "no capabilities on {}: {caps} ({said})", bin.display());
    let member = Command::new("setpriv")
        .args(["--reuid=65534", &format!("--regid={gid}"), "--clear-groups"])
        .arg(&bin)
        .arg("doctor")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&member.stdout);
    assert_eq!(member.status.code(), Some(0), "as a member of the group: {text}");
    assert!(text.lines().any(|l| l.starts_with("probe offcpu") && l.contains("ok: live")), "{text}");
    // Man pages for every command, and completions.
    let man1 = prefix.join("share/man/man1");
    let pages: std::collections::BTreeSet<String> =
        std::fs::read_dir(&man1).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    for p in ["probe.1", "probe-trace.1", "probe-watch.1", "probe-doctor.1"] {
        assert!(pages.contains(p), "{pages:?}");
    }
    assert!(std::fs::read_to_string(prefix.join("share/bash-completion/completions/probe")).unwrap().contains("_probe"));
    // Uninstall: nothing of it is left (every page it wrote is one it removes).
    let out = Command::new("bash").arg(&script).arg("--prefix").arg(&prefix).arg("--uninstall").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let left: Vec<PathBuf> = walk(&prefix).into_iter().filter(|p| p.is_file()).collect();
    let _ = std::fs::remove_dir_all(&prefix);
    assert!(left.is_empty(), "left after --uninstall: {left:?}");
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            all.extend(walk(&p));
        }
        all.push(p);
    }
    all
}

/// The .deb `cargo xtask deb` builds (PROBE_DEB; `cargo xtask test` builds it first), installed
/// with apt as a user would and removed again: probe on PATH with its group and capabilities, its
/// man pages, completions and the watch unit; nothing of it left after `apt-get purge`.
#[test]
fn the_deb_installs_and_removes_cleanly() {
    use std::os::unix::fs::MetadataExt as _;
    let deb = PathBuf::from(
        std::env::var_os("PROBE_DEB").expect("PROBE_DEB is not set: run the tests with `cargo xtask test`, which builds the .deb"),
    );
    assert!(deb.exists(), "{} does not exist", deb.display());
    assert!(!std::path::Path::new("/usr/bin/probe").exists(), "/usr/bin/probe is there before the test: not the case this test is about");
    let apt = |args: &[&str]| {
        let o = Command::new("apt-get").args(args).env("DEBIAN_FRONTEND", "noninteractive").output().unwrap();
        assert!(o.status.success(), "apt-get {args:?}: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    };
    apt(&["install", "-y", deb.to_str().unwrap()]);
    let installed = (|| {
        let meta = std::fs::metadata("/usr/bin/probe").map_err(|e| format!("/usr/bin/probe: {e}"))?;
        if meta.mode() & 0o7777 != 0o750 {
            return Err(format!("mode {:o}", meta.mode() & 0o7777));
        }
        let caps = Command::new("getcap").arg("/usr/bin/probe").output().map_err(|e| e.to_string())?;
        if !String::from_utf8_lossy(&caps.stdout).contains("cap_bpf") {
            return Err(format!("no capabilities: {}", String::from_utf8_lossy(&caps.stdout)));
        }
        let doctor = Command::new("env")
            .args(["-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "sh", "-c", "probe doctor"])
            .output()
            .map_err(|e| e.to_string())?;
        if !doctor.status.success() {
            return Err(format!("probe doctor: {}", String::from_utf8_lossy(&doctor.stdout)));
        }
        for f in [
            "/usr/share/man/man1/probe-trace.1.gz",
            "/usr/share/bash-completion/completions/probe",
            "/lib/systemd/system/probe-watch.service",
        ] {
            if !std::path::Path::new(f).exists() {
                return Err(format!("{f} missing"));
            }
        }
        let unit = std::fs::read_to_string("/lib/systemd/system/probe-watch.service").unwrap_or_default();
        if !unit.contains("ExecStart=/usr/bin/probe watch") {
            return Err("the watch unit does not start /usr/bin/probe".into());
        }
        Ok(())
    })();
    // Removed whatever happened above: the machine is left as it was.
    apt(&["purge", "-y", "probe"]);
    installed.unwrap();
    for f in ["/usr/bin/probe", "/usr/share/man/man1/probe-trace.1.gz", "/lib/systemd/system/probe-watch.service"] {
        assert!(!std::path::Path::new(f).exists(), "{f} left after purge");
    }
}
