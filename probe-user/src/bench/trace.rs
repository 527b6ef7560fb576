//! Tracing a benchmark: the server's pid from the port it listens on (sock_diag or /proc/PID/net/tcp →
//! socket inode → /proc/PID/fd), a real `probe trace` per segment (one per server process: a
//! restart starts a new segment), and each request joined to its traced record by the client's
//! local port (the traced record's `peer`), taking the record's verdict. Also the /proc facts the
//! idle sweep records: process age, RSS, the model file and its page-cache residency.
use std::{
    io::{BufRead, BufReader},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context, bail};

use super::metrics::{Row, RowVerdict};
use crate::{analysis::report::Report, stream::Role};

/// The process listening on `port`, in this network namespace or a container's (see
/// [`crate::watch::target::listener`]).
pub fn pid_listening(port: u16) -> Option<u32> {
    crate::watch::target::listener(port)
}

/// Seconds since the process started, and its resident memory (MiB).
pub fn process_facts(pid: u32) -> (Option<f64>, Option<f64>) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    let start_ticks = stat.as_deref().and_then(|s| s.rsplit_once(')')).and_then(|(_, r)| r.split_whitespace().nth(19)?.parse::<f64>().ok());
    let uptime = std::fs::read_to_string("/proc/uptime").ok().and_then(|u| u.split_whitespace().next()?.parse::<f64>().ok());
    let hz = crate::os::procfs::clock_ticks() as f64;
    let age = start_ticks.zip(uptime).map(|(t, u)| u - t / hz.max(1.0));
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse::<f64>().ok()))
        .map(|kb| kb / 1024.0);
    (age, rss)
}

/// The largest regular file that `pid` or its children map (the model, for an LLM server).
pub fn largest_mapped_file(pid: u32) -> Option<PathBuf> {
    let mut pids = vec![pid];
    if let Ok(d) = std::fs::read_dir("/proc") {
        for e in d.filter_map(Result::ok) {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let ppid = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse::<u32>().ok());
            if ppid == Some(pid) {
                pids.push(p);
            }
        }
    }
    let mut best: Option<(u64, PathBuf)> = None;
    for p in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{p}/maps")) else { continue };
        for l in maps.lines() {
            let Some(path) = l.split_whitespace().nth(5).filter(|s| s.starts_with('/')) else { continue };
            let Ok(m) = std::fs::metadata(path) else { continue };
            if m.is_file() && best.as_ref().is_none_or(|b| m.len() > b.0) {
                best = Some((m.len(), PathBuf::from(path)));
            }
        }
    }
    best.map(|b| b.1)
}

/// posix_fadvise(DONTNEED) on the whole file: evicts its clean pages that no process maps.
pub fn drop_cache(path: &Path) -> anyhow::Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: a valid open fd; advice only.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise(DONTNEED) on {} failed: errno {rc}", path.display());
    }
    Ok(())
}

/// Share of the file's pages in the page cache (mincore over a fresh read-only mapping).
pub fn resident_pct(path: &Path) -> Option<f64> {
    let f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len() as usize;
    if len == 0 {
        return Some(100.0);
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    // SAFETY: a private read-only mapping of an open file, unmapped below; mincore writes one
    // byte per page into a vector of that many bytes. Mapping does not read the file.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
        if p == libc::MAP_FAILED {
            return None;
        }
        let pages = len.div_ceil(page);
        let mut v = vec![0u8; pages];
        let rc = libc::mincore(p, len, v.as_mut_ptr());
        libc::munmap(p, len);
        if rc != 0 {
            return None;
        }
        Some(v.iter().filter(|b| *b & 1 == 1).count() as f64 * 100.0 / pages as f64)
    }
}

/// One `probe trace` of one server process.
pub struct Segment {
    child: Child,
    pub out: PathBuf,
    pub pid: u32,
    /// Indices of the rows sent while this segment traced.
    pub rows: Vec<usize>,
}

/// Start `probe trace --pid PID --out DIR` (this same binary) and wait for "armed in".
pub fn start(pid: u32, out: &Path) -> anyhow::Result<Segment> {
    let exe = std::env::current_exe().context("cannot find the probe binary")?;
    let mut cmd = Command::new(exe);
    // --force: a rerun into the same --out replaces the earlier run's recordings.
    cmd.args(["trace", "--force", "--pid", &pid.to_string(), "--out"])
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // Its own process group: a terminal's Ctrl-C reaches probe bench, which lets requests
        // in flight finish and then stops the trace itself, so the trace sees their ends.
        .process_group(0);
    crate::util::httpc::pass_headers(&mut cmd);
    // SAFETY: prctl in the child before exec. If probe bench dies, the trace stops as on Ctrl-C
    // (and writes its report) instead of tracing on.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start probe trace")?;
    let err = child.stderr.take().context("probe trace stderr")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) if l.contains("armed in") => break,
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("probe trace --pid {pid} did not arm: {}", seen.join(" | "));
            }
        }
    }
    // Keep draining its status lines so it never blocks on a full pipe.
    std::thread::spawn(move || while rx.recv().is_ok() {});
    Ok(Segment { child, out: out.to_path_buf(), pid, rows: Vec::new() })
}

/// Stop the trace (SIGINT, as Ctrl-C) and read its report.json.
pub fn stop(mut seg: Segment) -> anyhow::Result<(Segment, Report)> {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(seg.child.id() as i32, libc::SIGINT) };
    let st = seg.child.wait()?;
    let path = seg.out.join("report.json");
    let bytes = std::fs::read(&path).with_context(|| format!("probe trace ({st}) wrote no {}", path.display()))?;
    let report: Report = serde_json::from_slice(&bytes).with_context(|| format!("{} is not a probe report", path.display()))?;
    Ok((seg, report))
}

/// Attach each row's traced verdict: the report's request whose peer port is the row's local port.
/// Returns how many rows found their request.
pub fn join(rows: &mut [Row], idx: &[usize], report: &Report, trace: &str) -> usize {
    let reqs = &report.requests;
    let mut used = vec![false; reqs.len()];
    let mut found = 0;
    for &i in idx {
        let Some(port) = rows[i].local_port else { continue };
        let suffix = format!(":{port}");
        let Some(j) = (0..reqs.len()).find(|&j| !used[j] && reqs[j].role == Role::Server && reqs[j].peer.ends_with(&suffix)) else {
            continue;
        };
        used[j] = true;
        let q = &reqs[j];
        let v = q.verdict.clone().unwrap_or_default();
        let verdict = RowVerdict {
            trace: trace.to_string(),
            request_id: q.id,
            slow_cause: v.slow_cause,
            stop_cause: v.stop_cause,
            ttft_ms: v.ttft_ms,
            evidence: v.evidence,
            engine: q.engine.clone(),
        };
        rows[i].queue_ms = verdict.ttft_ms.as_ref().map(|s| s.queue);
        rows[i].verdict = Some(verdict);
        found += 1;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_join_traced_requests_by_port() {
        use crate::{
            analysis::report::Request,
            analysis::verdict::{SlowCause, Split, StopCause, Verdict},
            stream::RequestRecord,
        };
        let q = |id: u64, peer: &str, verdict: Verdict| Request {
            record: RequestRecord { id, role: Role::Server, peer: peer.into(), ..Default::default() },
            verdict: Some(verdict),
            engine: None,
        };
        let report = Report {
            requests: vec![
                q(
                    1,
                    "127.0.0.1:40000",
                    Verdict {
                        slow_cause: SlowCause::Queue,
                        stop_cause: StopCause::Eos,
                        evidence: vec!["x".into()],
                        ttft_ms: Some(Split { queue: 5.0, compute: 1.0, ..Default::default() }),
                        ..Default::default()
                    },
                ),
                q(
                    2,
                    "127.0.0.1:40001",
                    Verdict { slow_cause: SlowCause::Disk, stop_cause: StopCause::RequestedLimit, ..Default::default() },
                ),
            ],
            ..Default::default()
        };
        let mut rows = vec![
            Row { local_port: Some(40001), ..Default::default() },
            Row { local_port: Some(40000), ..Default::default() },
            Row { local_port: Some(9), ..Default::default() },
        ];
        assert_eq!(join(&mut rows, &[0, 1, 2], &report, "trace-1"), 2);
        assert_eq!(rows[0].verdict.as_ref().unwrap().slow_cause, SlowCause::Disk);
        assert_eq!(rows[1].verdict.as_ref().unwrap().request_id, 1);
        assert_eq!(rows[1].queue_ms, Some(5.0));
        assert!(rows[2].verdict.is_none());
    }

    #[test]
    fn own_process_facts_and_listening_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // probe never takes itself for the server: the listener is found in a child that
        // inherited the socket.
        assert_eq!(pid_listening(port), None);
        let fd = l.as_raw_fd();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: in the forked child before exec, clearing FD_CLOEXEC on the inherited socket
        // (only this child keeps it; fcntl is async-signal-safe).
        unsafe {
            cmd.pre_exec(move || {
                libc::fcntl(fd, libc::F_SETFD, 0);
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let t = std::time::Instant::now();
        let mut found = None;
        while found.is_none() && t.elapsed() < std::time::Duration::from_secs(5) {
            found = pid_listening(port);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found, Some(child.id()));
        let (age, rss) = process_facts(std::process::id());
        assert!(age.unwrap() >= 0.0 && rss.unwrap() > 0.0);
        let exe = std::env::current_exe().unwrap();
        assert!(resident_pct(&exe).is_some());
    }
}
