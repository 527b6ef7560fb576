//! The process at the other end of a request's connection, when it runs on this machine: the
//! gateway (nginx, a tunnel, a chat UI's backend) or client that hung up is named by the owner of
//! the peer socket. The kernel's own state, read while the connection is open (a closed socket
//! has no owner): sock_diag finds the socket whose local address is the request's peer and whose
//! peer is the request's local address, in the server's network namespace and then in the others
//! of this machine (a container on a bridge); its inode is matched to a process by /proc/PID/fd.
//! Nothing keys on a process's name: what is found is said as it is.
use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt as _,
};

use crate::os::procfs;
pub use crate::stream::PeerProcess;

/// Network namespaces searched at most for one lookup (the server's own first).
const MAX_NETNS: usize = 32;
/// Processes whose descriptors are read at most for one lookup.
const MAX_PROCS: usize = 4096;

/// An address as the stream tracker writes it ("1.2.3.4:80", "[::1]:80"), with an IPv4 address
/// mapped into IPv6 (a dual-stack listener's view of an IPv4 client) made IPv4 again.
pub fn parse_addr(s: &str) -> Option<SocketAddr> {
    s.parse().ok().map(canonical)
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A peer address found on no namespace of this machine is not looked for again for this long
/// (a container's address missed once, its socket already closed, is tried again after it).
const REMOTE_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// For each (local, peer) of connections of the server `pid`: the process owning the other end,
/// where it is on this machine. Pairs not found are left out. `remote` holds peer addresses found
/// on no namespace of this machine, and when; those found on none now are added to it.
pub fn resolve(
    pid: u32,
    conns: &[(String, String)],
    remote: &mut HashMap<IpAddr, std::time::Instant>,
) -> HashMap<(String, String), PeerProcess> {
    remote.retain(|_, t| t.elapsed() < REMOTE_FOR);
    let mut want: HashMap<(SocketAddr, SocketAddr), (String, String)> = HashMap::new();
    for (l, p) in conns {
        if let (Some(la), Some(pa)) = (parse_addr(l), parse_addr(p))
            && !remote.contains_key(&pa.ip())
        {
            // The peer's socket: local = our peer, peer = our local.
            want.insert((pa, la), (l.clone(), p.clone()));
        }
    }
    let mut out = HashMap::new();
    if want.is_empty() {
        return out;
    }
    // Inode of each wanted socket and its owner's uid: the server's namespace first; the others
    // of this machine (one process's view of each) only for sockets not found there.
    let mut inodes: HashMap<u64, ((String, String), u32)> = HashMap::new();
    let mut local_ips: HashSet<IpAddr> = HashSet::new();
    let mut pids = procfs::all_pids();
    pids.sort_unstable();
    let mut search = |p: u32, inodes: &mut HashMap<u64, ((String, String), u32)>| {
        let ask: Vec<(SocketAddr, SocketAddr)> =
            want.keys().filter(|w| !inodes.values().any(|(k, _)| want.get(*w) == Some(k))).copied().collect();
        for s in sockets_in(p, ask).into_iter().flatten() {
            let (l, r) = (canonical(s.local), canonical(s.peer));
            local_ips.insert(l.ip());
            if s.inode != 0
                && let Some(key) = want.get(&(l, r))
            {
                inodes.insert(s.inode, (key.clone(), s.uid));
            }
        }
    };
    search(pid, &mut inodes);
    if inodes.len() < want.len() {
        let ns_of = |p: u32| std::fs::metadata(format!("/proc/{p}/ns/net")).ok().map(|m| m.ino());
        let mut seen: HashSet<u64> = ns_of(pid).into_iter().collect();
        for &p in &pids {
            if seen.len() > MAX_NETNS || inodes.len() == want.len() {
                break;
            }
            if let Some(n) = ns_of(p)
                && seen.insert(n)
            {
                search(p, &mut inodes);
            }
        }
    }
    for (pa, _) in want.keys() {
        if !local_ips.contains(&pa.ip()) && !pa.ip().is_loopback() {
            remote.insert(pa.ip(), std::time::Instant::now());
        }
    }
    if inodes.is_empty() {
        return out;
    }
    // The owner of each inode (socket inodes are unique on the machine): processes of the
    // socket's uid first (reading every process's descriptors is the cost: a gateway's user has a
    // few), the newest first (a client that just connected is likelier than an old daemon of the
    // same uid); the scan stops at the last owner found.
    let uids: HashSet<u32> = inodes.values().map(|(_, u)| *u).collect();
    let uid_of = |p: u32| std::fs::metadata(format!("/proc/{p}")).ok().map(|m| m.uid());
    let mut other_uid = Vec::new();
    for pass in 0..2 {
        let list: Vec<u32> = if pass == 0 { pids.iter().rev().take(MAX_PROCS).copied().collect() } else { std::mem::take(&mut other_uid) };
        for p in list {
            if out.len() == inodes.len() {
                return out;
            }
            if pass == 0 && !uid_of(p).is_some_and(|u| uids.contains(&u)) {
                other_uid.push(p);
                continue;
            }
            for ino in procfs::socket_inodes(p) {
                if let Some((key, _)) = inodes.get(&ino)
                    && !out.contains_key(key)
                {
                    out.insert(key.clone(), describe(p));
                }
            }
        }
    }
    out
}

/// The process `pid` as a peer: its comm, executable and container.
fn describe(pid: u32) -> PeerProcess {
    // The innermost cgroup directory naming a container (docker-ID.scope, libpod-ID, a bare id).
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let id = cgroups
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .find_map(|path| path.split('/').rev().find_map(crate::os::cgroup::container_id).map(str::to_string));
    let container = id.map(|id| crate::os::cgroup::name_of_id(&id).unwrap_or_else(|| id.chars().take(12).collect()));
    PeerProcess {
        pid,
        comm: procfs::comm(pid),
        exe: std::fs::read_link(format!("/proc/{pid}/exe")).ok().map(|p| p.to_string_lossy().into_owned()),
        container,
    }
}

/// The TCP sockets with these (local, peer) addresses in `pid`'s network namespace (from a thread
/// moved there), each looked up by its addresses.
fn sockets_in(pid: u32, ask: Vec<(SocketAddr, SocketAddr)>) -> Option<Vec<procfs::TcpSocket>> {
    procfs::in_netns_of(pid, "probe-peer", move || Some(ask.iter().filter_map(|&(l, p)| procfs::tcp_socket(l, p)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection of this process to itself: the peer of the accepted end is found as this
    /// process; an address on no namespace of this machine is remembered as remote.
    #[test]
    fn the_peer_of_a_loopback_connection_is_its_owner() {
        let _one = procfs::TEST_LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let key = (s.local_addr().unwrap().to_string(), s.peer_addr().unwrap().to_string());
        assert_eq!(key.1, c.local_addr().unwrap().to_string());
        let mut remote = HashMap::new();
        let t = std::time::Instant::now();
        let got = resolve(std::process::id(), std::slice::from_ref(&key), &mut remote);
        eprintln!("one lookup: {:.2} ms of wall time", t.elapsed().as_secs_f64() * 1e3);
        let p = got.get(&key).unwrap_or_else(|| panic!("{key:?} not found: {got:?}"));
        assert_eq!(p.pid, std::process::id());
        assert_eq!(p.comm, procfs::comm(std::process::id()));
        assert!(p.exe.as_deref().is_some_and(|e| e.starts_with('/')), "{p:?}");
        assert!(remote.is_empty(), "{remote:?}");
        // TEST-NET-3 is nobody's address here.
        let far = ("127.0.0.1:80".to_string(), "203.0.113.9:5555".to_string());
        assert!(resolve(std::process::id(), &[far], &mut remote).is_empty());
        assert!(remote.contains_key(&"203.0.113.9".parse::<IpAddr>().unwrap()), "{remote:?}");
    }

    #[test]
    fn mapped_addresses_compare_as_ipv4() {
        assert_eq!(parse_addr("[::ffff:127.0.0.1]:8080"), Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(parse_addr("[::1]:80"), Some("[::1]:80".parse().unwrap()));
        assert_eq!(parse_addr("?"), None);
    }
}
