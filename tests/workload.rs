//! Workloads with a known answer, for probe's kernel tests and benchmark. Each prints `ready PID`,
//! waits for a line on stdin (so the tracer can attach first), does exactly what it says, prints
//! `done ...` with what it did, and exits.
//!
//!   probe-workload cold-mmap FILE PAGES      evict FILE, map it MADV_RANDOM, touch PAGES pages
//!   probe-workload tcp ADDR close|wait-reset connect; close first, or wait for the peer's RST
//!   probe-workload fork-mmap N LEN           a forked child does N mmap+munmap of LEN bytes
//!   probe-workload mmap-loop SECONDS         mmap+munmap in a tight loop (event-rate benchmark)
//!   probe-workload mmap-threads N RATE SECS  N threads doing mmap+munmap at RATE syscalls/s in all
//!                                            (0: flat out) for SECS (ring buffer stress)
//!   probe-workload tcp-threads N SECS        N threads each sending 4000 bytes over their own loopback
//!                                            connection and reading them back (4 KiB stream records)
//!   probe-workload flood THREADS SECONDS     mmap-loop on THREADS threads at once: more events than
//!                                            one consumer drains (the drain-bound and disk-full tests)
//!   probe-workload slow-metrics              listen on 127.0.0.1 (prints `port N`) and answer every
//!                                            request (`GET /metrics`) with a 200 whose body trickles
//!                                            one byte every 100 ms, forever; runs until killed
//!   probe-workload sse-server PORT          serve one streamed chat request on 127.0.0.1:PORT, as a
//!                                            hostile server would: escape sequences in its process
//!                                            name and in the JSON it sends
//!   probe-workload sink-server PORT         accept every connection on 127.0.0.1:PORT and read what
//!                                            it sends, 4000 bytes a call, never answering (runs until
//!                                            killed; `done` is never printed)
//!   probe-workload hog CGROUP                join the memory cgroup (v1 dir), then allocate and touch
//!                                            1 MiB at a time until the OOM killer ends it
use std::{
    fs::{File, OpenOptions},
    io::{BufRead, Read, Write},
    net::TcpStream,
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

const PAGE: usize = 4096;
/// Pages between two touched pages: far apart, so no readahead or fault-around joins them.
const STRIDE: usize = 16;

fn wait_for_go() {
    println!("ready {}", std::process::id());
    std::io::stdout().flush().ok();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).ok();
}

fn die(msg: String) -> ! {
    eprintln!("probe-workload: {msg}");
    std::process::exit(2)
}

/// Make FILE at least `bytes` long, on disk, and not in the page cache.
fn make_cold(path: &str, bytes: usize) -> File {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap_or_else(|e| die(format!("open {path}: {e}")));
    let len = f.metadata().map(|m| m.len() as usize).unwrap_or(0);
    if len < bytes {
        let chunk = vec![0xa5u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            f.write_all(&chunk[..n]).unwrap_or_else(|e| die(format!("write {path}: {e}")));
            left -= n;
        }
    }
    f.sync_all().unwrap_or_else(|e| die(format!("fsync {path}: {e}")));
    // SAFETY: valid fd; DONTNEED drops clean, unmapped pages of this file from the page cache.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        die(format!("posix_fadvise: {rc}"));
    }
    f
}

fn resident_pages(addr: *mut libc::c_void, len: usize) -> usize {
    let mut vec = vec![0u8; len.div_ceil(PAGE)];
    // SAFETY: addr/len describe a live mapping; vec has one byte per page.
    unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

fn cold_mmap(path: &str, pages: usize) {
    let len = pages * STRIDE * PAGE;
    let f = make_cold(path, len);
    wait_for_go();
    // SAFETY: mapping a file we own read-only; the pointer is only read within `len`.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        die(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: p/len is the mapping made above.
    unsafe { libc::madvise(p, len, libc::MADV_RANDOM) };
    let cold_before = resident_pages(p, len);
    let mut sum = 0u64;
    for i in 0..pages {
        // SAFETY: i * STRIDE * PAGE < len.
        sum += unsafe { std::ptr::read_volatile((p as *const u8).add(i * STRIDE * PAGE)) } as u64;
    }
    let resident = resident_pages(p, len);
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, len) };
    println!("done touched={pages} resident_before={cold_before} resident_after={resident} sum={sum}");
}

fn tcp(addr: &str, mode: &str) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| die(format!("connect {addr}: {e}")));
    println!("local {}", s.local_addr().map(|a| a.to_string()).unwrap_or_default());
    wait_for_go();
    s.write_all(b"hello\n").ok();
    match mode {
        "close" => {
            drop(s);
            println!("done closed");
        }
        "wait-reset" => {
            let mut buf = [0u8; 64];
            let r = s.read(&mut buf);
            println!("done read={r:?}");
        }
        _ => die(format!("unknown tcp mode {mode}")),
    }
}

fn map_unmap(len: usize) {
    // SAFETY: anonymous private mapping, unmapped right after.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if p == libc::MAP_FAILED {
            die("mmap failed".into());
        }
        libc::munmap(p, len);
    }
}

fn fork_mmap(n: usize, len: usize) {
    wait_for_go();
    // SAFETY: the child only makes syscalls and exits with _exit.
    let child = unsafe { libc::fork() };
    if child == 0 {
        for _ in 0..n {
            map_unmap(len);
        }
        // SAFETY: leave without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(child, &mut status, 0) };
    println!("done child={child} n={n} len={len}");
}

fn mmap_loop(secs: f64) {
    wait_for_go();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..1000 {
            map_unmap(PAGE);
        }
        n += 1000;
    }
    println!("done calls={} secs={:.3}", n * 2, start.elapsed().as_secs_f64());
}

fn slow_metrics() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| die(format!("bind: {e}")));
    let port = l.local_addr().map(|a| a.port()).unwrap_or_else(|e| die(format!("local_addr: {e}")));
    println!("port {port}");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                println!("request {}", String::from_utf8_lossy(&req).lines().next().unwrap_or_default());
                // No length and no chunking: the body ends only when the connection closes.
                if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n").is_err() {
                    return;
                }
                while s.write_all(b"#").is_ok() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
    });
    wait_for_go();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// `threads` threads doing mmap+munmap (2 syscalls) at `rate` syscalls per second in all (0: as
/// fast as they can) for `secs`.
fn mmap_threads(threads: usize, rate: f64, secs: f64) {
    wait_for_go();
    let start = Instant::now();
    let per_thread = rate / 2.0 / threads.max(1) as f64;
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            std::thread::spawn(move || {
                let mut n = 0u64;
                while start.elapsed() < Duration::from_secs_f64(secs) {
                    for _ in 0..100 {
                        map_unmap(PAGE);
                    }
                    n += 100;
                    // Paced: ahead of the rate, sleep until on schedule.
                    if per_thread > 0.0 {
                        let due = Duration::from_secs_f64(n as f64 / per_thread);
                        if let Some(ahead) = due.checked_sub(start.elapsed()) {
                            std::thread::sleep(ahead);
                        }
                    }
                }
                n
            })
        })
        .collect();
    let n: u64 = workers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
    println!("done calls={} secs={:.3}", n * 2, start.elapsed().as_secs_f64());
}

/// `threads` threads, each with its own loopback connection inside this process, sending 4000
/// bytes and reading them back as fast as they can for `secs` (4 KiB stream records).
fn tcp_threads(threads: usize, secs: f64) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| die(format!("bind: {e}")));
    let addr = l.local_addr().unwrap_or_else(|e| die(format!("addr: {e}")));
    wait_for_go();
    // Connected after the tracer attached, as a server's clients are.
    let pairs: Vec<(TcpStream, TcpStream)> = (0..threads.max(1))
        .map(|_| {
            let c = TcpStream::connect(addr).unwrap_or_else(|e| die(format!("connect: {e}")));
            let (s, _) = l.accept().unwrap_or_else(|e| die(format!("accept: {e}")));
            (c, s)
        })
        .collect();
    let start = Instant::now();
    let workers: Vec<_> = pairs
        .into_iter()
        .map(|(mut c, mut s)| {
            std::thread::spawn(move || {
                let (out, mut back) = ([b'x'; 4000], [0u8; 4000]);
                let mut n = 0u64;
                while start.elapsed() < Duration::from_secs_f64(secs) {
                    if c.write_all(&out).is_err() || s.read_exact(&mut back).is_err() {
                        break;
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let n: u64 = workers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
    println!("done calls={} secs={:.3}", n * 2, start.elapsed().as_secs_f64());
}

fn hog(cgroup: &str) {
    std::fs::write(format!("{cgroup}/cgroup.procs"), std::process::id().to_string())
        .unwrap_or_else(|e| die(format!("cannot join {cgroup}: {e}")));
    wait_for_go();
    let mut kept: Vec<Vec<u8>> = Vec::new();
    loop {
        kept.push(vec![1u8; 1 << 20]);
        if kept.len().is_multiple_of(64) {
            println!("allocated {} MiB", kept.len());
            std::io::stdout().flush().ok();
        }
    }
}

/// Process name with an OSC title sequence and a bell: a terminal that gets it raw obeys it.
const HOSTILE_NAME: &str = "sse\x1b]0;pwn\x07";

fn sse_server(port: &str) {
    let name = std::ffi::CString::new(HOSTILE_NAME).unwrap_or_else(|_| die("name".into()));
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from a live CString.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
    let l = std::net::TcpListener::bind(format!("127.0.0.1:{port}")).unwrap_or_else(|e| die(format!("bind {port}: {e}")));
    wait_for_go();
    // probe polls the ports its target listens on (GET /metrics, /props, ...): those get a 404
    // and the server goes on waiting for the one POST it streams to.
    let (mut s, req) = loop {
        let (mut s, _) = l.accept().unwrap_or_else(|e| die(format!("accept: {e}")));
        let req = read_request(&mut s);
        if req.starts_with(b"POST ") {
            break (s, req);
        }
        s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").ok();
    };
    let mut out = String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n");
    s.write_all(out.as_bytes()).ok();
    for _ in 0..3 {
        out = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok\"},\"finish_reason\":null}]}\n\n".into();
        s.write_all(out.as_bytes()).ok();
        std::thread::sleep(Duration::from_millis(20));
    }
    // A finish_reason that sets the terminal title, rings and clears the screen (JSON escapes).
    let last =
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\\u001b]0;owned\\u0007\\u001b[2J\"}]}\n\ndata: [DONE]\n\n";
    s.write_all(last.as_bytes()).ok();
    drop(s);
    println!("done served {} request bytes", req.len());
}

/// One request from `s`: headers, then Content-Length bytes of body (less if the peer closes).
fn read_request(s: &mut std::net::TcpStream) -> Vec<u8> {
    let mut req = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let n = s.read(&mut b).unwrap_or(0);
        if n == 0 {
            return req;
        }
        req.extend_from_slice(&b[..n]);
        let text = String::from_utf8_lossy(&req).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            if req.len() >= end + 4 + len {
                return req;
            }
        }
    }
}

/// Raise the open-files limit to the hard limit (thousands of connections).
pub fn raise_nofile() {
    // SAFETY: getrlimit/setrlimit with a valid, owned struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn sink_server(port: &str) {
    use std::{collections::HashMap, os::fd::AsRawFd as _};
    raise_nofile();
    let l = std::net::TcpListener::bind(format!("127.0.0.1:{port}")).unwrap_or_else(|e| die(format!("bind {port}: {e}")));
    l.set_nonblocking(true).unwrap_or_else(|e| die(format!("nonblocking: {e}")));
    // SAFETY: epoll_create1 has no preconditions.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        die(format!("epoll_create1: {}", std::io::Error::last_os_error()));
    }
    let add = |fd: i32| {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
        // SAFETY: a live epoll fd, a live socket fd and a valid event.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    };
    add(l.as_raw_fd());
    wait_for_go();
    let mut conns: HashMap<i32, TcpStream> = HashMap::new();
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = [0u8; 4000];
    loop {
        // SAFETY: `events` holds 256 entries.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as i32, 1000) };
        for ev in events.iter().take(n.max(0) as usize) {
            let fd = ev.u64 as i32;
            if fd == l.as_raw_fd() {
                while let Ok((s, _)) = l.accept() {
                    s.set_nonblocking(true).ok();
                    add(s.as_raw_fd());
                    conns.insert(s.as_raw_fd(), s);
                }
                continue;
            }
            let Some(s) = conns.get_mut(&fd) else { continue };
            // A few reads per wakeup: every connection gets its turn.
            for _ in 0..4 {
                match s.read(&mut buf) {
                    Ok(0) => {
                        conns.remove(&fd);
                        break;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        conns.remove(&fd);
                        break;
                    }
                }
            }
        }
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize| a.get(i).cloned().unwrap_or_else(|| die(format!("missing argument {i}; see the file's doc comment")));
    let num = |i: usize| arg(i).parse::<usize>().unwrap_or_else(|_| die(format!("argument {i} must be a number")));
    match arg(1).as_str() {
        "cold-mmap" => cold_mmap(&arg(2), num(3)),
        "tcp" => tcp(&arg(2), &arg(3)),
        "fork-mmap" => fork_mmap(num(2), num(3)),
        "mmap-loop" => mmap_loop(arg(2).parse().unwrap_or(1.0)),
        "hog" => hog(&arg(2)),
        "flood" => mmap_threads(num(2), 0.0, arg(3).parse().unwrap_or(1.0)),
        "slow-metrics" => slow_metrics(),
        "sse-server" => sse_server(&arg(2)),
        "mmap-threads" => mmap_threads(num(2), arg(3).parse().unwrap_or(0.0), arg(4).parse().unwrap_or(1.0)),
        "tcp-threads" => tcp_threads(num(2), arg(3).parse().unwrap_or(1.0)),
        "sink-server" => sink_server(&arg(2)),
        other => die(format!("unknown workload {other}")),
    }
}
