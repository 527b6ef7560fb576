//! The target as probe finds it right after the probes are armed: the requests already in
//! flight (by the kernel's TCP state of its connections), what each of its threads is blocked
//! in, the bytes it has read, and its cgroup's IO limits. What came before attach is described
//! by this, never guessed. One bounded read, after arming (the armed time does not include it).
use std::collections::HashSet;

use crate::{
    os::procfs::{self, TcpSocket},
    record::samples::{AttachState, ConnAtAttach, IoLimit, LimitSource, ThreadAtAttach, ThreadState},
    stream::{Seed, SeedState},
};

/// Threads described at most (a server with thousands is described by its first ones).
const MAX_THREADS: usize = 512;
/// Connections taken up at most.
const MAX_CONNS: usize = 4096;
/// A response that began within this of the request's last bytes, with nothing sent for at
/// least [`QUIET_MS`] since, sent its headers only (a server that answers with headers at once,
/// then computes).
const HEADERS_AFTER_MS: u32 = 20;
const QUIET_MS: u32 = 100;

const TCP_ESTABLISHED: u8 = 1;

/// Read the target's state now (`now_ns`, CLOCK_MONOTONIC): the record to write, and the
/// connections for the stream tracker to take up.
pub fn read(targets: &[u32], main: u32, now_ns: u64) -> (AttachState, Vec<Seed>) {
    let mut st = AttachState { ts_ns: now_ns, ..Default::default() };
    st.threads = threads(targets);
    st.read_bytes = read_bytes(main);
    st.io_limits = io_limits(main);
    let (conns, seeds) = match in_flight(targets, now_ns) {
        Ok(v) => v,
        Err(why) => {
            st.in_flight_absent = Some(why);
            (vec![], vec![])
        }
    };
    st.in_flight = conns;
    (st, seeds)
}

/// Each target thread's state and wchan (at most MAX_THREADS): the snapshot at attach, and
/// the live view's look at a request nothing else explains.
pub(crate) fn threads(targets: &[u32]) -> Vec<ThreadAtAttach> {
    let mut out = Vec::new();
    for &pid in targets {
        for tid in procfs::tasks(pid) {
            if out.len() >= MAX_THREADS {
                return out;
            }
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) else { continue };
            let Some((head, rest)) = stat.rsplit_once(')') else { continue };
            let comm = head.split_once('(').map_or("", |x| x.1).to_string();
            let state = ThreadState::of(rest.split_whitespace().next().unwrap_or("?"));
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/wchan"))
                .ok()
                .map(|w| w.trim().to_string())
                .filter(|w| !w.is_empty() && w != "0");
            out.push(ThreadAtAttach { tid, comm, state, wchan });
        }
    }
    out
}

/// /proc/PID/io `read_bytes`.
pub fn read_bytes(pid: u32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    t.lines().find_map(|l| l.strip_prefix("read_bytes:")).and_then(|v| v.trim().parse().ok())
}

/// The directories of `pid`'s block cgroups: its v1 blkio cgroup and its v2 cgroup, where they
/// are below their hierarchy's root (every process is in the root, which limits nothing).
pub fn block_cgroups(pid: u32) -> Vec<(std::path::PathBuf, LimitSource)> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return vec![] };
    let mut out = Vec::new();
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if path == "/" || path.is_empty() || path.contains("..") {
            continue;
        }
        let rel = path.trim_start_matches('/');
        if ctrl.split(',').any(|c| c == "blkio") {
            out.push((std::path::Path::new("/sys/fs/cgroup/blkio").join(rel), LimitSource::BlkioThrottle));
        } else if ctrl.is_empty()
            && let Some(root) = v2_root()
        {
            out.push((root.join(rel), LimitSource::IoMax));
        }
    }
    out.retain(|(d, _)| d.is_dir());
    out
}

/// Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
/// hybrid system).
fn v2_root() -> Option<std::path::PathBuf> {
    let m = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    m.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        post.starts_with("cgroup2 ").then(|| pre.split_whitespace().nth(4).map(std::path::PathBuf::from))?
    })
}

/// The IO limits that apply to `pid`: its block cgroups' and their ancestors' (a parent's limit
/// holds its children too), from the cgroups' own files.
pub fn io_limits(pid: u32) -> Vec<IoLimit> {
    let mut out = Vec::new();
    for (dir, source) in block_cgroups(pid) {
        let top = match source {
            LimitSource::IoMax => v2_root(),
            LimitSource::BlkioThrottle => Some("/sys/fs/cgroup/blkio".into()),
        };
        let mut d = Some(dir.as_path());
        while let Some(here) = d {
            if top.as_deref().is_some_and(|t| here == t || !here.starts_with(t)) {
                break;
            }
            let limits = match source {
                LimitSource::IoMax => v2_limits(here),
                LimitSource::BlkioThrottle => v1_limits(here),
            };
            out.extend(limits);
            d = here.parent();
        }
    }
    out
}

/// "MAJ:MIN VALUE" lines of a v1 blkio file.
fn v1_values(dir: &std::path::Path, file: &str) -> Vec<(String, u64)> {
    let t = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
    t.lines()
        .filter_map(|l| {
            let (dev, v) = l.split_once(' ')?;
            Some((dev.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

fn v1_limits(dir: &std::path::Path) -> Vec<IoLimit> {
    let mut out: Vec<IoLimit> = Vec::new();
    let cgroup = dir.display().to_string();
    for (file, set) in [
        ("blkio.throttle.read_bps_device", 0),
        ("blkio.throttle.write_bps_device", 1),
        ("blkio.throttle.read_iops_device", 2),
        ("blkio.throttle.write_iops_device", 3),
    ] {
        for (dev, v) in v1_values(dir, file) {
            let i = match out.iter().position(|l| l.dev == dev) {
                Some(i) => i,
                None => {
                    out.push(IoLimit {
                        cgroup: cgroup.clone(),
                        dev: dev.clone(),
                        source: LimitSource::BlkioThrottle,
                        ..Default::default()
                    });
                    out.len() - 1
                }
            };
            let l = &mut out[i];
            *[&mut l.read_bps, &mut l.write_bps, &mut l.read_iops, &mut l.write_iops][set] = Some(v);
        }
    }
    // "MAJ:MIN Read N" lines.
    let served = std::fs::read_to_string(dir.join("blkio.throttle.io_service_bytes")).unwrap_or_default();
    for l in &mut out {
        l.read_bytes = served.lines().find_map(|x| {
            let mut f = x.split_whitespace();
            (f.next() == Some(l.dev.as_str()) && f.next() == Some("Read")).then(|| f.next()?.parse().ok())?
        });
    }
    out
}

fn v2_limits(dir: &std::path::Path) -> Vec<IoLimit> {
    let t = std::fs::read_to_string(dir.join("io.max")).unwrap_or_default();
    let stat = std::fs::read_to_string(dir.join("io.stat")).unwrap_or_default();
    t.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let dev = f.next()?.to_string();
            let mut l = IoLimit { cgroup: dir.display().to_string(), dev: dev.clone(), source: LimitSource::IoMax, ..Default::default() };
            for kv in f {
                let Some((k, v)) = kv.split_once('=') else { continue };
                let v = v.parse::<u64>().ok();
                match k {
                    "rbps" => l.read_bps = v,
                    "wbps" => l.write_bps = v,
                    "riops" => l.read_iops = v,
                    "wiops" => l.write_iops = v,
                    _ => {}
                }
            }
            l.read_bytes = stat.lines().find_map(|x| {
                let mut f = x.split_whitespace();
                (f.next() == Some(dev.as_str())).then(|| f.find_map(|kv| kv.strip_prefix("rbytes=")?.parse().ok()))?
            });
            (l.read_bps.is_some() || l.write_bps.is_some() || l.read_iops.is_some() || l.write_iops.is_some()).then_some(l)
        })
        .collect()
}

/// The kernel's TCP state of the target's server connections, asked from inside its network
/// namespace: those in the middle of a request.
fn in_flight(targets: &[u32], now_ns: u64) -> Result<(Vec<ConnAtAttach>, Vec<Seed>), String> {
    let Some(&main) = targets.first() else { return Ok((vec![], vec![])) };
    let mut ports: HashSet<u16> = HashSet::new();
    let mut inodes: HashSet<u64> = HashSet::new();
    let mut owner: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
    for &pid in targets {
        ports.extend(procfs::listen_ports(pid));
        for ino in procfs::socket_inodes(pid) {
            inodes.insert(ino);
            owner.insert(ino, pid);
        }
    }
    if ports.is_empty() {
        return Ok((vec![], vec![]));
    }
    let sockets = sockets_of(main)?;
    let mut conns = Vec::new();
    let mut seeds = Vec::new();
    for s in sockets.into_iter().filter(|s| s.state == TCP_ESTABLISHED && ports.contains(&s.local.port())) {
        // Ours, or not accepted yet (in the listener's queue: its inode is 0).
        if s.inode != 0 && !inodes.contains(&s.inode) {
            continue;
        }
        let Some((state, info)) = classify(&s) else { continue };
        if seeds.len() >= MAX_CONNS {
            break;
        }
        let arrival_ns = now_ns.saturating_sub(u64::from(info.last_data_recv_ms) * 1_000_000);
        let word = match state {
            SeedState::Unread => "unread",
            SeedState::Waiting => "waiting",
            SeedState::Responding { .. } => "responding",
        };
        conns.push(ConnAtAttach {
            local: s.local.to_string(),
            peer: s.peer.to_string(),
            state: word.into(),
            last_recv_ms: info.last_data_recv_ms,
            last_sent_ms: info.last_data_sent_ms,
            rqueue: s.rqueue,
        });
        seeds.push(Seed {
            pid: owner.get(&s.inode).copied().unwrap_or(main),
            local: s.local.to_string(),
            peer: s.peer.to_string(),
            arrival_ns,
            state,
        });
    }
    Ok((conns, seeds))
}

/// Whether a connection carries a request, by its TCP state: bytes unread, or received since
/// the last send (or never answered), or a response begun after the last bytes received (taken
/// up only if the tracker then sees it go on). A connection that never received is not one.
pub fn classify(s: &TcpSocket) -> Option<(SeedState, procfs::TcpInfo)> {
    let info = s.info?;
    if s.rqueue > 0 || s.inode == 0 {
        return Some((SeedState::Unread, info));
    }
    if info.bytes_received == 0 {
        return None;
    }
    if info.bytes_sent == 0 || info.last_data_recv_ms < info.last_data_sent_ms {
        return Some((SeedState::Waiting, info));
    }
    let headers_only = info.last_data_sent_ms >= QUIET_MS && info.last_data_recv_ms - info.last_data_sent_ms <= HEADERS_AFTER_MS;
    Some((SeedState::Responding { headers_only }, info))
}

/// Every established TCP socket with its tcp_info, in `pid`'s network namespace (from a thread
/// moved there: setns moves only the calling thread).
fn sockets_of(pid: u32) -> Result<Vec<TcpSocket>, String> {
    procfs::in_netns_of(pid, "probe-attach", || procfs::tcp_sockets(1 << TCP_ESTABLISHED, true))
        .ok_or_else(|| "the kernel's socket diagnostics (sock_diag) did not answer in the target's network namespace".to_string())
}

/// The kernel functions the target's threads in uninterruptible sleep wait in (wchan; empty
/// where the kernel does not say), the reader of the snapshot at attach.
pub fn threads_of(targets: &[u32]) -> Vec<String> {
    threads(targets)
        .into_iter()
        .filter(|t| t.state == ThreadState::DiskSleep)
        .map(|t| crate::util::text::terminal(t.wchan.as_deref().unwrap_or_default()).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sock(rqueue: u32, inode: u64, recv: u32, sent: u32, bytes_sent: u64) -> TcpSocket {
        TcpSocket {
            local: "127.0.0.1:8080".parse().unwrap(),
            peer: "127.0.0.1:40000".parse().unwrap(),
            state: 1,
            rqueue,
            wqueue: 0,
            inode,
            uid: 0,
            info: Some(procfs::TcpInfo {
                last_data_recv_ms: recv,
                last_data_sent_ms: sent,
                bytes_received: 300,
                bytes_sent,
                data_segs_out: 0,
            }),
        }
    }

    #[test]
    fn the_kernel_state_tells_a_request_from_an_idle_connection() {
        // Bytes unread, or a connection still in the listener's queue.
        assert_eq!(classify(&sock(120, 7, 50, 900, 0)).unwrap().0, SeedState::Unread);
        assert_eq!(classify(&sock(0, 0, 50, 50, 0)).unwrap().0, SeedState::Unread);
        // Read and never answered; read after the last answer (a keep-alive's next request).
        assert_eq!(classify(&sock(0, 7, 1800, 1800, 0)).unwrap().0, SeedState::Waiting);
        assert_eq!(classify(&sock(0, 7, 300, 9000, 4000)).unwrap().0, SeedState::Waiting);
        // Headers sent at once, then nothing: a response to come.
        assert_eq!(classify(&sock(0, 7, 1500, 1496, 180)).unwrap().0, SeedState::Responding { headers_only: true });
        // Tokens flowing: the first came before attach.
        assert_eq!(classify(&sock(0, 7, 1500, 12, 9000)).unwrap().0, SeedState::Responding { headers_only: false });
        // A connection that never received anything is no request.
        let mut idle = sock(0, 7, 10, 10, 0);
        idle.info.as_mut().unwrap().bytes_received = 0;
        assert!(classify(&idle).is_none());
    }

    /// sock_diag's tcp_info of a real connection: the bytes each way and how long ago.
    #[test]
    fn tcp_info_of_a_real_connection() {
        use std::io::{Read as _, Write as _};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        c.write_all(b"POST /x HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 20];
        s.read_exact(&mut buf).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let all = procfs::tcp_sockets(1 << TCP_ESTABLISHED, true).expect("sock_diag answers");
        let server =
            all.iter().find(|x| x.local == l.local_addr().unwrap() && x.peer == c.local_addr().unwrap()).expect("the accepted socket");
        let info = server.info.expect("tcp_info");
        assert_eq!((info.bytes_received, info.bytes_sent), (20, 0));
        assert!((250..2000).contains(&info.last_data_recv_ms), "{info:?}");
        assert_eq!(classify(server).unwrap().0, SeedState::Waiting);
        s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let all = procfs::tcp_sockets(1 << TCP_ESTABLISHED, true).unwrap();
        let server = all.iter().find(|x| x.local == l.local_addr().unwrap() && x.peer == c.local_addr().unwrap()).unwrap();
        assert_eq!(server.info.unwrap().bytes_sent, 19);
        assert!(matches!(classify(server).unwrap().0, SeedState::Responding { .. }));
    }
}
