//! Readers of /proc: a process's mappings, threads, descendants, open files and listening ports.
//! Parsers are pure functions over the file text, with tests.
use std::{collections::HashSet, fs, path::Path};

use serde::{Deserialize, Serialize};

/// One line of /proc/PID/maps that maps a file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
    pub path: String,
}

/// File-backed mappings of /proc/PID/maps text (anonymous, [heap], [stack] ... are left out).
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?;
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let dev = it.next()?;
    let inode: u64 = it.next()?.parse().ok()?;
    let path = it.next().unwrap_or("").trim_start();
    if inode == 0 || !path.starts_with('/') {
        return None;
    }
    let (s, e) = range.split_once('-')?;
    let (ma, mi) = dev.split_once(':')?;
    Some(Mapping {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms: perms.to_string(),
        offset,
        major: u32::from_str_radix(ma, 16).ok()?,
        minor: u32::from_str_radix(mi, 16).ok()?,
        inode,
        path: path.to_string(),
    })
}

pub fn read_maps(pid: u32) -> std::io::Result<Vec<Mapping>> {
    Ok(parse_maps(&fs::read_to_string(format!("/proc/{pid}/maps"))?))
}

/// The end of the mapping of `pid` that holds `addr` (a thread's stack: anonymous mappings too),
/// from /proc/PID/maps.
pub fn mapping_end(pid: u32, addr: u64) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    text.lines().find_map(|l| {
        let (start, end) = l.split(' ').next()?.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        (start <= addr && addr < end).then_some(end)
    })
}

/// The mappings of /proc/PID/maps text that may hold a thread's stack, in address order:
/// `[stack]`, and each writable private anonymous mapping that starts where a guard mapping
/// (no access) ends (a pthread stack above its guard page). The first `max`.
pub fn stack_mappings(text: &str, max: usize) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut guard_end = None;
    for l in text.lines() {
        let mut f = l.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        let (inode, path) = (f.nth(2), f.next());
        let anon = inode == Some("0");
        if perms == "---p" {
            guard_end = Some(end);
            continue;
        }
        let stack = path == Some("[stack]") || (anon && path.is_none() && perms == "rw-p" && guard_end == Some(start));
        guard_end = None;
        if stack && out.len() < max {
            out.push((start, end));
        }
    }
    out
}

pub fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

pub fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm")).map(|s| s.trim_end().to_string()).unwrap_or_default()
}

/// The arguments of a process (`/proc/PID/cmdline`). They may hold secrets (`--api-key`):
/// what is kept goes through `redact::command_line`.
pub fn cmdline_args(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| b.split(|&c| c == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect())
        .unwrap_or_default()
}

/// A thread's name (`/proc/PID/task/TID/comm`; set by the program, so text, not trusted).
pub fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok().map(|s| s.trim_end().to_string())
}

/// Thread ids of a process.
pub fn tasks(pid: u32) -> Vec<u32> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// The process a thread belongs to (`Tgid:` of /proc/TID/status: a thread's directory is there
/// by its tid, though /proc lists only processes).
pub fn tgid_of(tid: u32) -> Option<u32> {
    let s = fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("Tgid:"))?.trim().parse().ok()
}

/// Parent pid from /proc/PID/stat text (the field after the parenthesised comm).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Every live process below `root` (children, grandchildren ...), found by scanning /proc once.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parent = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Some(pp) = fs::read_to_string(format!("/proc/{pid}/stat")).ok().as_deref().and_then(parse_ppid) {
            parent.push((pid, pp));
        }
    }
    descendants_in(&parent, root)
}

/// The processes below `root` among (pid, ppid) pairs (one /proc scan, taken once).
pub fn descendants_in(parent: &[(u32, u32)], root: u32) -> Vec<u32> {
    let mut set: HashSet<u32> = HashSet::from([root]);
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for &(pid, pp) in parent {
            if set.contains(&pp) && set.insert(pid) {
                out.push(pid);
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

/// A file a process has open, identified the way the kernel's page cache sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OpenFile {
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
    pub path: String,
}

/// Regular files open in /proc/PID/fd.
pub fn open_files(pid: u32) -> Vec<OpenFile> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for e in fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten() {
        let Ok(meta) = fs::metadata(e.path()) else { continue };
        if !meta.is_file() {
            continue;
        }
        let Ok(target) = fs::read_link(e.path()) else { continue };
        let dev = meta.dev();
        out.push(OpenFile { major: libc::major(dev), minor: libc::minor(dev), inode: meta.ino(), path: target.display().to_string() });
    }
    out
}

/// Socket inodes among a process's fds ("socket:[12345]").
pub fn socket_inodes(pid: u32) -> HashSet<u64> {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let l = fs::read_link(e.path()).ok()?;
            l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// Inodes of the LISTEN sockets on `port` in /proc/net/tcp{,6} text.
pub fn parse_listen_inodes(text: &str, port: u16) -> HashSet<u64> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let p = u16::from_str_radix(f.get(1)?.rsplit_once(':')?.1, 16).ok()?;
            (*f.get(3)? == "0A" && p == port).then(|| f.get(9)?.parse().ok())?
        })
        .collect()
}

/// The uid that owns a process (its /proc directory's owner: the effective uid at exec).
pub fn uid(pid: u32) -> Option<u32> {
    fs::metadata(format!("/proc/{pid}")).ok().map(|m| std::os::unix::fs::MetadataExt::uid(&m))
}

/// The executable a process runs (` (deleted)` kept: a replaced binary is another one).
pub fn exe(pid: u32) -> Option<std::path::PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// The inode of a process's network namespace (None once it is gone).
pub fn netns(pid: u32) -> Option<u64> {
    fs::metadata(format!("/proc/{pid}/ns/net")).ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}

/// The calling thread runs at idle priority (SCHED_IDLE: it gets a CPU only when nothing else
/// wants it, and so never delays the server probe watches), and so do the threads it starts.
/// For probe's threads that may lag without losing anything (pollers, incident writing); the
/// drain and the samplers yield only while they keep up ([`crate::os::yielding::Yielding`]).
pub fn idle_priority() {
    if let Err(e) = set_policy(libc::SCHED_IDLE) {
        log::debug!("cannot run at idle priority: {e}");
    }
}

/// How many times the calling thread was switched out involuntarily so far (`ru_nivcsw` of
/// getrusage(RUSAGE_THREAD)): another task took its CPU. 0 when the kernel does not say.
pub fn preemptions() -> i64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct it is given.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return 0;
    }
    u.ru_nivcsw
}

/// This process's effective capabilities (`CapEff` of /proc/self/status), one bit each.
pub fn effective_caps() -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0)
}

pub(crate) fn set_policy(policy: libc::c_int) -> std::io::Result<()> {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: a valid sched_param; pid 0 is the calling thread.
    if unsafe { libc::sched_setscheduler(0, policy, &p) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's network namespace becomes the one `ns` refers to (an open
/// /proc/PID/ns/net): sockets it makes from then on live there. Other threads are not moved.
pub fn enter_netns(ns: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
    // SAFETY: setns on a valid descriptor; it changes only this thread's namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `f` run in `pid`'s network namespace: here when probe shares it, else on a thread moved there
/// (setns moves only the calling thread) named `name`. None when the namespace cannot be
/// entered or `f` says none.
pub fn in_netns_of<T: Send + 'static>(pid: u32, name: &str, f: impl FnOnce() -> Option<T> + Send + 'static) -> Option<T> {
    if netns(self_pid()) == netns(pid) {
        return f();
    }
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let ns = fs::File::open(format!("/proc/{pid}/ns/net")).ok()?;
            enter_netns(&ns).ok()?;
            f()
        })
        .ok()
        .and_then(|t| t.join().ok())
        .flatten()
}

/// Whether the TCP socket `local` ⇄ `peer` (looked up in `pid`'s network namespace) belongs to a
/// process running probe's own executable (the same file as /proc/self/exe): another probe
/// (`probe bench` beside its trace). None: no such socket (closed already).
pub fn held_by_own_executable(pid: u32, local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<bool> {
    let sock = in_netns_of(pid, "probe-own-sock", move || tcp_socket(local, peer))?;
    Some(own_executable_processes().into_iter().any(|p| socket_inodes(p).contains(&sock.inode)))
}

/// Processes running probe's own executable, looked up at most every 5 s.
fn own_executable_processes() -> Vec<u32> {
    use std::os::unix::fs::MetadataExt as _;
    static CACHE: std::sync::Mutex<Option<(std::time::Instant, Vec<u32>)>> = std::sync::Mutex::new(None);
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((t, pids)) = c.as_ref()
        && t.elapsed() < std::time::Duration::from_secs(5)
    {
        return pids.clone();
    }
    let id = |p: &str| fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let ours = id("/proc/self/exe");
    let pids: Vec<u32> = all_pids().into_iter().filter(|p| ours.is_some() && id(&format!("/proc/{p}/exe")) == ours).collect();
    *c = Some((std::time::Instant::now(), pids.clone()));
    pids
}

/// probe's own pid as the /proc it reads numbers processes: the kernel's, when probe runs in a
/// PID namespace of its own with the host's /proc mounted (`std::process::id()` would give the
/// namespace's number, which names another process there).
pub fn self_pid() -> u32 {
    fs::read_link("/proc/self").ok().and_then(|p| p.to_str()?.parse().ok()).unwrap_or_else(std::process::id)
}

/// Of several processes, the one whose parent is not among them (a server, not the worker or
/// runner it forked), lowest pid first; None for none.
pub fn topmost(found: &[u32]) -> Option<u32> {
    let set: HashSet<u32> = found.iter().copied().collect();
    let parent = |p: u32| fs::read_to_string(format!("/proc/{p}/stat")).ok().and_then(|s| parse_ppid(&s));
    found.iter().copied().filter(|&p| !parent(p).is_some_and(|pp| set.contains(&pp))).min().or_else(|| found.iter().copied().min())
}

/// Every pid in /proc.
pub fn all_pids() -> Vec<u32> {
    fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

/// Local ports of LISTEN sockets in /proc/net/tcp{,6} text whose inode is in `inodes`.
pub fn parse_listen_ports(text: &str, inodes: &HashSet<u64>) -> Vec<u16> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = u16::from_str_radix(f.get(1)?.rsplit_once(':')?.1, 16).ok()?;
            let state = *f.get(3)?;
            let inode: u64 = f.get(9)?.parse().ok()?;
            (state == "0A" && inodes.contains(&inode)).then_some(port)
        })
        .collect()
}

/// Where to reach each LISTEN socket in /proc/net/tcp{,6} text whose inode is in `inodes`: its
/// address, with a wildcard (0.0.0.0, ::) replaced by the loopback address of its family.
/// The address to connect to for a listener bound to `ip`: loopback for an unspecified
/// address, IPv4 for a v4-mapped one.
fn reachable(ip: std::net::IpAddr) -> std::net::IpAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    match ip {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        IpAddr::V6(a) => a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4),
        a => a,
    }
}

pub fn parse_listen_addrs(text: &str, inodes: &HashSet<u64>) -> Vec<std::net::SocketAddr> {
    parse_listen_bound(text, inodes).into_iter().map(|a| std::net::SocketAddr::new(reachable(a.ip()), a.port())).collect()
}

/// The bound address of each LISTEN socket in /proc/net/tcp{,6} text whose inode is in
/// `inodes`, as bound (a wildcard stays 0.0.0.0 or ::).
pub fn parse_listen_bound(text: &str, inodes: &HashSet<u64>) -> Vec<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (hex, port) = f.get(1)?.rsplit_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let inode: u64 = f.get(9)?.parse().ok()?;
            if *f.get(3)? != "0A" || !inodes.contains(&inode) {
                return None;
            }
            // The kernel prints each 32-bit word of the address in host byte order.
            let words: Vec<u32> = (0..hex.len() / 8).filter_map(|i| u32::from_str_radix(&hex[i * 8..i * 8 + 8], 16).ok()).collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            let ip = match bytes.len() {
                4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
                16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).ok()?)),
                _ => return None,
            };
            Some(std::net::SocketAddr::new(ip, port))
        })
        .collect()
}

/// The listening sockets of a process as bound (wildcards as 0.0.0.0 or ::), read in its own
/// network namespace (sock_diag there, else its /proc/PID/net/tcp{,6}).
pub fn listen_sockets(pid: u32) -> Vec<std::net::SocketAddr> {
    let inodes = socket_inodes(pid);
    if inodes.is_empty() {
        return Vec::new();
    }
    let wanted = inodes.clone();
    let mut out: Vec<std::net::SocketAddr> = in_netns_of(pid, "probe-listen", move || {
        Some(tcp_listeners()?.into_iter().filter(|(_, i)| wanted.contains(i)).map(|(a, _)| a).collect())
    })
    .unwrap_or_else(|| {
        ["tcp", "tcp6"]
            .iter()
            .filter_map(|f| fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
            .flat_map(|t| parse_listen_bound(&t, &inodes))
            .collect()
    });
    out.sort_unstable();
    out.dedup();
    out
}

/// Addresses the process listens on (wildcards as loopback), IPv4 first.
pub fn listen_addrs(pid: u32) -> Vec<std::net::SocketAddr> {
    let inodes = socket_inodes(pid);
    let mut out = Vec::new();
    if inodes.is_empty() {
        return out;
    }
    if let Some(listening) = listeners_here(pid) {
        for (a, ino) in listening {
            let a = std::net::SocketAddr::new(reachable(a.ip()), a.port());
            if inodes.contains(&ino) && !out.contains(&a) {
                out.push(a);
            }
        }
        return out;
    }
    for f in ["tcp", "tcp6"] {
        if let Ok(t) = fs::read_to_string(format!("/proc/{pid}/net/{f}")) {
            for a in parse_listen_addrs(&t, &inodes) {
                if !out.contains(&a) {
                    out.push(a);
                }
            }
        }
    }
    out
}

/// TCP ports the process listens on.
pub fn listen_ports(pid: u32) -> Vec<u16> {
    let inodes = socket_inodes(pid);
    if inodes.is_empty() {
        return Vec::new();
    }
    if let Some(listening) = listeners_here(pid) {
        let mut ports: Vec<u16> = listening.into_iter().filter(|(_, ino)| inodes.contains(ino)).map(|(a, _)| a.port()).collect();
        ports.sort_unstable();
        ports.dedup();
        return ports;
    }
    let mut ports = Vec::new();
    for f in ["tcp", "tcp6"] {
        if let Ok(t) = fs::read_to_string(format!("/proc/{pid}/net/{f}")) {
            ports.extend(parse_listen_ports(&t, &inodes));
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// [`tcp_listeners`] when `pid` shares probe's network namespace, else None (read its
/// /proc/PID/net/tcp then). sock_diag walks the listening sockets only; /proc/PID/net/tcp walks
/// every bucket of the established-connections hash table, 10 ms each for tcp and tcp6 on a 24 GiB
/// machine: a seventh of the time to arm, and 5% of probe's CPU while it polled the server.
fn listeners_here(pid: u32) -> Option<Vec<(std::net::SocketAddr, u64)>> {
    let ns = |p: &str| fs::metadata(p).ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    let ours = ns("/proc/self/ns/net")?;
    if ns(&format!("/proc/{pid}/ns/net")) != Some(ours) {
        return None;
    }
    tcp_listeners()
}

/// (local address, inode) of every TCP socket listening in this network namespace, IPv4 and
/// IPv6, from the kernel's sock_diag netlink interface (linux/inet_diag.h). None when it cannot
/// answer.
pub fn tcp_listeners() -> Option<Vec<(std::net::SocketAddr, u64)>> {
    const TCP_LISTEN: u32 = 10;
    Some(tcp_sockets(1 << TCP_LISTEN, false)?.into_iter().map(|s| (s.local, s.inode)).collect())
}

/// What sock_diag says of one TCP socket.
#[derive(Clone, Debug, PartialEq)]
pub struct TcpSocket {
    pub local: std::net::SocketAddr,
    pub peer: std::net::SocketAddr,
    /// TCP_* state (1 established, 8 close-wait, 10 listen).
    pub state: u8,
    /// Bytes received and not read by the process; bytes sent and not acknowledged.
    pub rqueue: u32,
    pub wqueue: u32,
    /// 0 for a connection not accepted yet (still in its listener's queue).
    pub inode: u64,
    /// The uid of the socket's owner (its creator's).
    pub uid: u32,
    pub info: Option<TcpInfo>,
}

/// The part of the kernel's `struct tcp_info` (linux/tcp.h) probe reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TcpInfo {
    /// ms since the last data was sent, and since the last data arrived (jiffy granularity).
    pub last_data_sent_ms: u32,
    pub last_data_recv_ms: u32,
    /// Bytes received and bytes sent over the connection's life (kernel 4.19+: 0 before).
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub data_segs_out: u32,
}

impl TcpInfo {
    /// From the INET_DIAG_INFO attribute's bytes (offsets of linux/tcp.h's struct tcp_info).
    pub fn parse(b: &[u8]) -> Option<TcpInfo> {
        let u32_at = |o: usize| b.get(o..o + 4).map(|x| u32::from_ne_bytes([x[0], x[1], x[2], x[3]]));
        let u64_at = |o: usize| b.get(o..o + 8).map(|x| u64::from_ne_bytes(x.try_into().unwrap_or_default()));
        Some(TcpInfo {
            last_data_sent_ms: u32_at(44)?,
            last_data_recv_ms: u32_at(52)?,
            bytes_received: u64_at(128).unwrap_or(0),
            data_segs_out: u32_at(156).unwrap_or(0),
            bytes_sent: u64_at(200).unwrap_or(0),
        })
    }
}

/// Every TCP socket of this network namespace in one of `states` (a bit per TCP_* state), IPv4
/// and IPv6, from sock_diag; with `info`, each with its `tcp_info`. None when it cannot answer.
pub fn tcp_sockets(states: u32, info: bool) -> Option<Vec<TcpSocket>> {
    tcp_query(states, info, None)
}

/// The TCP socket of this network namespace with exactly this local and peer address, from
/// sock_diag's lookup of one socket (no walk of the connection table: a dump of every established
/// socket costs about a millisecond a family on this machine). Tried as IPv4, then as IPv6 with
/// IPv4-mapped addresses (a dual-stack socket). None when there is none or it cannot answer.
pub fn tcp_socket(local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<TcpSocket> {
    let found = tcp_query(!0, false, Some((local, peer)))?;
    found.into_iter().next()
}

/// sock_diag's numbers (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h).
const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_DONE: u16 = 3;
const NLMSG_ERROR: u16 = 2;
const INET_DIAG_INFO: u16 = 2;

fn tcp_query(states: u32, info: bool, exact: Option<(std::net::SocketAddr, std::net::SocketAddr)>) -> Option<Vec<TcpSocket>> {
    use std::os::fd::AsRawFd as _;
    let fd = diag_socket()?;
    let mut out = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let Some(req) = diag_request(family, states, info, exact) else { continue };
        // SAFETY: sending our own buffer on our own socket (to the kernel: address 0).
        if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } != req.len() as isize {
            return None;
        }
        let mut buf = vec![0u8; 64 << 10];
        'dump: loop {
            // SAFETY: receiving into our own buffer of that length.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n <= 0 {
                return None;
            }
            let mut msgs = &buf[..n as usize];
            while msgs.len() >= 16 {
                let len = u32::from_ne_bytes(msgs[0..4].try_into().ok()?) as usize;
                let ty = u16::from_ne_bytes(msgs[4..6].try_into().ok()?);
                if len < 16 || len > msgs.len() {
                    return None;
                }
                match ty {
                    NLMSG_DONE => break 'dump,
                    // One socket asked for: none (ENOENT) is an answer, tried in the next family.
                    NLMSG_ERROR if exact.is_some() => break 'dump,
                    NLMSG_ERROR => return None,
                    SOCK_DIAG_BY_FAMILY => out.extend(diag_msg(&msgs[16..len])),
                    _ => {}
                }
                msgs = &msgs[((len + 3) & !3).min(msgs.len())..];
            }
            // One socket asked for: its answer is one message, no end-of-dump after it.
            if exact.is_some() {
                break 'dump;
            }
        }
        if exact.is_some() && !out.is_empty() {
            break;
        }
    }
    Some(out)
}

/// A sock_diag netlink socket, its answers awaited at most a second.
fn diag_socket() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: socket(2) with constant arguments; the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd of ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 1, tv_usec: 0 };
    // SAFETY: a valid timeval for SO_RCVTIMEO: a kernel that never answers cannot hang probe.
    unsafe {
        libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&raw const tv).cast(), size_of::<libc::timeval>() as u32)
    };
    Some(fd)
}

/// The request for the TCP sockets of `family` in `states` (a bit each), with their `tcp_info`
/// when `info`: a dump, or the one socket `exact` names (None: it has no address in `family`).
fn diag_request(family: u8, states: u32, info: bool, exact: Option<(std::net::SocketAddr, std::net::SocketAddr)>) -> Option<[u8; 72]> {
    // nlmsghdr (16 bytes) + inet_diag_req_v2 (56 bytes).
    let mut req = [0u8; 72];
    req[0..4].copy_from_slice(&72u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = if exact.is_some() { NLM_F_REQUEST } else { NLM_F_REQUEST | NLM_F_DUMP };
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family;
    req[17] = libc::IPPROTO_TCP as u8;
    // idiag_ext: the attributes wanted, a bit each (1 << (attribute - 1)).
    req[18] = if info { 1 << (INET_DIAG_INFO - 1) } else { 0 };
    req[20..24].copy_from_slice(&states.to_ne_bytes());
    if let Some((local, peer)) = exact {
        // inet_diag_sockid: sport, dport (big-endian), src, dst, interface, cookie (none).
        let (Some(src), Some(dst)) = (diag_ip_bytes(local.ip(), family), diag_ip_bytes(peer.ip(), family)) else { return None };
        req[24..26].copy_from_slice(&local.port().to_be_bytes());
        req[26..28].copy_from_slice(&peer.port().to_be_bytes());
        req[28..44].copy_from_slice(&src);
        req[44..60].copy_from_slice(&dst);
        req[64..72].copy_from_slice(&[0xff; 8]);
    }
    Some(req)
}

/// One socket of an answer: inet_diag_msg (72 bytes: family, state, timer, retrans, then
/// inet_diag_sockid (sport and dport big-endian, src[16], dst[16], if, cookie[2]), expires,
/// rqueue, wqueue, uid, inode), then its attributes. None when it is short or its addresses are.
fn diag_msg(m: &[u8]) -> Option<TcpSocket> {
    if m.len() < 72 {
        return None;
    }
    let u32_at = |o: usize| u32::from_ne_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]]);
    let mut tcp = None;
    let mut attrs = &m[72..];
    while attrs.len() >= 4 {
        let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let aty = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if alen < 4 || alen > attrs.len() {
            break;
        }
        if aty == INET_DIAG_INFO {
            tcp = TcpInfo::parse(&attrs[4..alen]);
        }
        attrs = &attrs[((alen + 3) & !3).min(attrs.len())..];
    }
    let local = diag_addr(m[0], &m[8..24], u16::from_be_bytes([m[4], m[5]]))?;
    let peer = diag_addr(m[0], &m[24..40], u16::from_be_bytes([m[6], m[7]]))?;
    Some(TcpSocket {
        local,
        peer,
        state: m[1],
        rqueue: u32_at(56),
        wqueue: u32_at(60),
        inode: u64::from(u32_at(68)),
        uid: u32_at(64),
        info: tcp,
    })
}

/// The address sock_diag holds in 16 bytes `b`, in `family`, with `port`.
fn diag_addr(family: u8, b: &[u8], port: u16) -> Option<std::net::SocketAddr> {
    let ip: std::net::IpAddr = if family == libc::AF_INET as u8 {
        std::net::Ipv4Addr::from(<[u8; 4]>::try_from(b.get(..4)?).ok()?).into()
    } else {
        std::net::Ipv6Addr::from(<[u8; 16]>::try_from(b.get(..16)?).ok()?).into()
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// The address as sock_diag's inet_diag_sockid holds it (16 bytes), in `family`.
fn diag_ip_bytes(ip: std::net::IpAddr, family: u8) -> Option<[u8; 16]> {
    let mut b = [0u8; 16];
    match (ip, family == libc::AF_INET as u8) {
        (std::net::IpAddr::V4(v4), true) => b[..4].copy_from_slice(&v4.octets()),
        (std::net::IpAddr::V4(v4), false) => b = v4.to_ipv6_mapped().octets(),
        (std::net::IpAddr::V6(v6), false) => b = v6.octets(),
        (std::net::IpAddr::V6(_), true) => return None,
    }
    Some(b)
}

/// Tests that open listening sockets and then compare this process's listeners: one at a time.
#[cfg(test)]
pub(crate) static TEST_LISTENERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// USER_HZ, the unit of /proc/stat's and /proc/PID/stat's times.
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as u64 } else { 100 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[stack]` and the anonymous writable mappings right above a guard mapping; not a malloc
    /// arena (its no-access reserve is above it), not a file.
    #[test]
    fn stack_mappings_are_stack_and_guarded_anonymous_ones() {
        let text = "\
55d000000000-55d000001000 r--p 00000000 fd:01 42 /usr/bin/server
7f0000000000-7f0000001000 ---p 00000000 00:00 0
7f0000001000-7f0000801000 rw-p 00000000 00:00 0
7f1000000000-7f1000100000 rw-p 00000000 00:00 0
7f1000100000-7f1004000000 ---p 00000000 00:00 0
7f2000000000-7f2000001000 ---p 00000000 00:00 0
7f2000001000-7f2000801000 rw-p 00000000 fd:01 43 /tmp/file
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
";
        assert_eq!(stack_mappings(text, 8), vec![(0x7f0000001000, 0x7f0000801000), (0x7ffc00000000, 0x7ffc00021000)]);
        assert_eq!(stack_mappings(text, 1), vec![(0x7f0000001000, 0x7f0000801000)]);
    }

    /// This process's threads: each one's stack is in one of the mappings listed, the main
    /// thread's in `[stack]`.
    #[test]
    fn every_thread_stack_is_in_a_stack_mapping() {
        let local = 0u8;
        let here = (&raw const local) as u64;
        let t = std::thread::spawn(|| {
            let local = 0u8;
            (&raw const local) as u64
        });
        let there = t.join().unwrap();
        let maps = stack_mappings(&fs::read_to_string("/proc/self/maps").unwrap(), 1024);
        for sp in [here, there] {
            assert!(maps.iter().any(|&(a, b)| a <= sp && sp < b), "{sp:#x} not in {maps:x?}");
        }
    }

    /// A dump asks for every socket of the family; one socket's lookup names it, and has no
    /// request in a family its addresses are not of.
    #[test]
    fn sock_diag_requests_dump_or_name_one_socket() {
        let dump = diag_request(libc::AF_INET as u8, 1 << 1, true, None).unwrap();
        assert_eq!(u32::from_ne_bytes(dump[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes(dump[6..8].try_into().unwrap()), NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!((dump[16], dump[17], dump[18]), (libc::AF_INET as u8, libc::IPPROTO_TCP as u8, 2));
        assert_eq!(u32::from_ne_bytes(dump[20..24].try_into().unwrap()), 2);
        let local: std::net::SocketAddr = "10.0.0.1:8080".parse().unwrap();
        let peer: std::net::SocketAddr = "10.0.0.2:40000".parse().unwrap();
        let one = diag_request(libc::AF_INET6 as u8, !0, false, Some((local, peer))).unwrap();
        assert_eq!(u16::from_ne_bytes(one[6..8].try_into().unwrap()), NLM_F_REQUEST);
        assert_eq!(&one[24..28], &[0x1f, 0x90, 0x9c, 0x40]);
        assert_eq!(&one[28..44], &std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().octets());
        let v6: std::net::SocketAddr = "[::1]:8080".parse().unwrap();
        assert_eq!(diag_request(libc::AF_INET as u8, !0, false, Some((v6, v6))), None);
    }

    /// An answer's socket: its addresses, state and queues from inet_diag_msg; a short one is none.
    #[test]
    fn sock_diag_messages_are_read_as_sockets() {
        let mut m = [0u8; 72];
        m[0] = libc::AF_INET as u8;
        m[1] = 1;
        m[4..6].copy_from_slice(&8080u16.to_be_bytes());
        m[6..8].copy_from_slice(&40000u16.to_be_bytes());
        m[8..12].copy_from_slice(&[127, 0, 0, 1]);
        m[24..28].copy_from_slice(&[127, 0, 0, 2]);
        m[56..60].copy_from_slice(&5u32.to_ne_bytes());
        m[60..64].copy_from_slice(&6u32.to_ne_bytes());
        m[64..68].copy_from_slice(&1000u32.to_ne_bytes());
        m[68..72].copy_from_slice(&4242u32.to_ne_bytes());
        let s = diag_msg(&m).unwrap();
        assert_eq!(s.local, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.peer, "127.0.0.2:40000".parse().unwrap());
        assert_eq!((s.state, s.rqueue, s.wqueue, s.uid, s.inode, s.info), (1, 5, 6, 1000, 4242, None));
        assert_eq!(diag_msg(&m[..71]), None);
    }

    /// sock_diag finds a listener of ours with its port and inode, and not a connected socket.
    #[test]
    fn netlink_finds_listening_sockets() {
        let _one = TEST_LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let l6 = std::net::TcpListener::bind("[::1]:0").ok();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let got = tcp_listeners().expect("sock_diag answers");
        let inodes = socket_inodes(std::process::id());
        assert!(got.iter().any(|&(a, ino)| a == l.local_addr().unwrap() && inodes.contains(&ino)), "{port} not in {got:?}");
        if let Some(l6) = &l6 {
            assert!(got.iter().any(|&(a, _)| a == l6.local_addr().unwrap()), "{l6:?} not in {got:?}");
        }
        // Addresses and ports too, as /proc/net/tcp{,6} gives them (read again when another test
        // of this process opened or closed a listener between the two reads).
        fn agree<T: Ord + PartialEq + std::fmt::Debug>(
            ours: impl Fn() -> Vec<T>,
            parse: impl Fn(&str, &HashSet<u64>) -> Vec<T>,
        ) -> (Vec<T>, Vec<T>) {
            let mut last = (vec![], vec![]);
            for _ in 0..5 {
                let inodes = socket_inodes(std::process::id());
                let mut theirs: Vec<T> = ["tcp", "tcp6"]
                    .iter()
                    .flat_map(|f| parse(&fs::read_to_string(format!("/proc/self/net/{f}")).unwrap(), &inodes))
                    .collect();
                theirs.sort();
                theirs.dedup();
                let mut mine = ours();
                mine.sort();
                if mine == theirs {
                    return (mine, theirs);
                }
                last = (mine, theirs);
            }
            last
        }
        let (ours, from_proc_addrs) = agree(|| listen_addrs(std::process::id()), parse_listen_addrs);
        assert_eq!(ours, from_proc_addrs);
        assert!(listen_ports(std::process::id()).contains(&port));
        let (ports, from_proc) = agree(|| listen_ports(std::process::id()), parse_listen_ports);
        assert_eq!(ports, from_proc);
    }

    /// One socket asked for by its addresses: found without a dump, with its inode; a pair no
    /// socket has is none.
    #[test]
    fn netlink_finds_one_socket_by_its_addresses() {
        let _one = TEST_LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (local, peer) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        let s = tcp_socket(local, peer).expect("sock_diag finds the client's socket");
        assert_eq!((s.local, s.peer, s.state), (local, peer, 1));
        assert!(socket_inodes(std::process::id()).contains(&s.inode), "{s:?}");
        assert!(tcp_socket(local, "127.0.0.1:1".parse().unwrap()).is_none());
    }

    #[test]
    fn maps_keep_file_mappings_only() {
        let text = "\
55d0c0a00000-55d0c0a02000 r--p 00000000 fe:00 1311 /usr/bin/cat
7f1c00000000-7f1c06000000 r--s 00001000 fe:00 98765 /root/.cache/probe/models/SmolLM2 135M.gguf
7f1c06000000-7f1c06021000 rw-p 00000000 00:00 0 
7ffd1c5e0000-7ffd1c601000 rw-p 00000000 00:00 0                          [stack]
7f1c07000000-7f1c07001000 rw-s 00000000 00:01 4242 /dev/zero (deleted)
";
        let m = parse_maps(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].start, 0x55d0c0a00000);
        assert_eq!((m[1].major, m[1].minor, m[1].inode), (0xfe, 0, 98765));
        assert_eq!(m[1].offset, 0x1000);
        assert_eq!(m[1].path, "/root/.cache/probe/models/SmolLM2 135M.gguf");
        assert_eq!(m[2].path, "/dev/zero (deleted)");
    }

    #[test]
    fn ppid_survives_odd_comm() {
        assert_eq!(parse_ppid("1234 (a) b (c)) S 77 1234 1234 0 -1"), Some(77));
    }

    #[test]
    fn listen_ports_match_own_inodes() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5555 1 0 100 0 0 10 0
   1: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 6666 1 0 100 0 0 10 0
   2: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 5555 1 0 100 0 0 10 0
";
        assert_eq!(parse_listen_ports(text, &HashSet::from([5555])), vec![8080]);
        assert_eq!(parse_listen_addrs(text, &HashSet::from([5555])), vec!["127.0.0.1:8080".parse().unwrap()]);
    }

    #[test]
    fn listen_addrs_of_real_sockets() {
        let _one = TEST_LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        // A wildcard listener is reached on loopback; a specific one on its own address.
        let any = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let own = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let v6 = std::net::TcpListener::bind("[::]:0").ok();
        let addrs = listen_addrs(std::process::id());
        assert!(addrs.contains(&format!("127.0.0.1:{}", any.local_addr().unwrap().port()).parse().unwrap()), "{addrs:?}");
        assert!(addrs.contains(&own.local_addr().unwrap()), "{addrs:?}");
        if let Some(l) = v6 {
            let p = l.local_addr().unwrap().port();
            assert!(addrs.iter().any(|a| a.port() == p && a.ip().is_loopback()), "{addrs:?}");
        }
    }
}
