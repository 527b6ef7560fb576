//! Adversarial clients on loopback, as any client of a public LLM server can be: thousands of
//! keep-alive connections that never finish their request head, chunked bodies with endless
//! trailers, and pipelined requests that never read an answer. probe follows the server's sockets
//! through all of it with bounded memory, reports what it gave up, and still stops promptly.
//! Its own test binary: it measures probe's peak memory.
use std::{
    io::Write as _,
    net::TcpStream,
    time::{Duration, Instant},
};

mod common;
use common::{start_trace, workload::Workload};

/// A field of /proc/PID/status in KiB (VmHWM: the peak resident set).
fn status_kib(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap()
}

fn raise_nofile() {
    // SAFETY: getrlimit/setrlimit with a valid, owned struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
}

/// `n` connections that each send `head`, then `rounds` × 4000 bytes of `fill` (never a blank
/// line), round robin.
fn flood(addr: &str, n: usize, head: &[u8], rounds: usize) -> Vec<TcpStream> {
    let mut conns: Vec<TcpStream> = (0..n)
        .map(|_| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(head).unwrap();
            c
        })
        .collect();
    let fill = vec![b'a'; 4000];
    for _ in 0..rounds {
        for c in &mut conns {
            c.write_all(&fill).unwrap();
        }
    }
    conns
}

#[test]
fn adversarial_clients_leave_probe_bounded_and_prompt() {
    raise_nofile();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Workload::start(&["sink-server", &port.to_string()]);
    let rec = common::workload::scratch("load").join("rec");
    let pid = server.pid.to_string();
    let (mut probe, rx, armed) = start_trace(&["--pid", &pid, "--probes", "stream,sock", "--no-poll", "--out", rec.to_str().unwrap()]);
    assert!(armed.contains("stream"), "{armed}");
    writeln!(server.stdin.take().unwrap(), "go").unwrap();
    let t = Instant::now();
    // 5000 heads of 64 KiB that never end, 5000 chunked bodies whose trailer never ends
    // (128 KiB each), one connection with 200 000 pipelined requests and no reader.
    let heads = flood(&addr, 5000, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ", 16);
    let trailers = flood(&addr, 5000, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: ", 32);
    let mut pipe = TcpStream::connect(&addr).unwrap();
    let reqs = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".repeat(100);
    for _ in 0..2000 {
        pipe.write_all(&reqs).unwrap();
    }
    let sent = t.elapsed();
    // Let probe drain what the server read.
    std::thread::sleep(Duration::from_secs(2));
    let peak_kib = status_kib(probe.id(), "VmHWM:");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGINT) };
    let stop = Instant::now();
    // Tracing ends at the `stopped` line; detaching and the report follow.
    let mut err = Vec::new();
    let mut obeyed = None;
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(30)) {
        if l.contains("probe: stopped") && obeyed.is_none() {
            obeyed = Some(stop.elapsed());
        }
        err.push(l);
    }
    let status = probe.wait().unwrap();
    let stopped = stop.elapsed();
    drop((heads, trailers, pipe));
    let obeyed = obeyed.unwrap_or_else(|| panic!("no `stopped` line: {err:?}"));
    assert!(status.code().is_some_and(|c| c <= 1), "probe failed: {status}: {err:?}");
    eprintln!(
        "sent ~1 GB in {sent:?}; probe peak RSS {} MiB; after SIGINT: stopped tracing in {obeyed:?}, exited in {stopped:?}",
        peak_kib >> 10
    );
    assert!(obeyed < Duration::from_secs(2), "probe took {obeyed:?} to obey SIGINT");
    assert!(peak_kib < 256 << 10, "probe's peak RSS was {} MiB under adversarial clients", peak_kib >> 10);
    assert!(stopped < Duration::from_secs(5), "probe took {stopped:?} to detach and write its report");
    let report = common::read_report(&rec);
    let limits = &report["stream_limits"];
    assert!(limits["conns_evicted"].as_u64().unwrap() > 0, "{limits}");
    assert!(limits["requests_evicted"].as_u64().unwrap() > 0, "the pipelined requests past the cap: {limits}");
    assert!(limits["held_peak"].as_u64().unwrap() <= (64 << 20) + (1 << 20), "{limits}");
    assert!(
        report["problems"].as_array().unwrap().iter().any(|p| p.as_str().unwrap().contains("stopped following")),
        "{}",
        report["problems"]
    );
    let evicted = report["requests"].as_array().unwrap().iter().filter(|r| r["evicted"] == true).count() as u64;
    assert_eq!(evicted, limits["requests_evicted"].as_u64().unwrap());
}
