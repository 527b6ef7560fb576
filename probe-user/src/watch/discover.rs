//! `watch --all`'s discovery: every listening TCP socket on the node, and whether it serves
//! models.
//!
//! Servers are found by what they do, never by a name: every few seconds the listening TCP
//! sockets of every network namespace are read (one sock_diag dump per namespace), and each new
//! one is asked, from inside its namespace and without any of the operator's credentials, for
//! `/v1/models` (OpenAI-style servers: llama.cpp, vLLM, Ollama, LM Studio, llama-cpp-python) and
//! `/api/tags` (Ollama). A model list is a server; so is a 401/403 whose body is an API's error
//! (a server started with an API key); anything else is not, and is not asked again. A server
//! still loading (503) or not yet accepting is asked again at the next scan. Asks run in
//! parallel, each bounded in time and size ([`Asker`]), so no listener holds back the others.
use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    time::{Duration, Instant},
};

use super::log_line;

/// A listening socket found in a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    pub pid: u32,
    pub addr: SocketAddr,
    pub netns: Option<u64>,
}

/// What asking a listener said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A model list: a server.
    Server,
    /// 401/403 with an API's error body: a server that wants a key.
    WantsKey,
    NotServer,
    /// Not now (refused, loading): ask again at the next scan.
    Later,
    /// No whole answer before the deadline: ask again, less often each time.
    Slow,
}

/// (local address, inode) of every LISTEN socket in /proc/net/tcp{,6} text.
pub fn parse_listeners(text: &str) -> Vec<(SocketAddr, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if *f.get(3)? != "0A" {
                return None;
            }
            let addr = crate::os::procfs::parse_listen_addrs(&format!("h\n{l}\n"), &HashSet::from([f.get(9)?.parse().ok()?])).pop()?;
            Some((addr, f.get(9)?.parse().ok()?))
        })
        .collect()
}

/// Every listening TCP socket on the node with the process that owns it (the topmost of its
/// owners). `owners` caches inode → pid across scans, so a scan reads file descriptors only
/// for sockets it has not seen before.
pub fn scan(owners: &mut HashMap<u64, Option<u32>>, skip: &HashSet<u32>, closed: &mut HashMap<Option<u64>, Instant>) -> Vec<Listener> {
    let mut by_ns: HashMap<Option<u64>, Vec<u32>> = HashMap::new();
    for p in crate::os::procfs::all_pids() {
        if !skip.contains(&p) {
            by_ns.entry(crate::os::procfs::netns(p)).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let ours = crate::os::procfs::netns(crate::os::procfs::self_pid());
    for (ns, members) in &by_ns {
        // A namespace probe could not enter is tried again a minute later.
        if closed.get(ns).is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            continue;
        }
        let Some(socks) = listeners_in(*ns == ours, members[0]) else {
            if closed.insert(*ns, Instant::now()).is_none() {
                log_line!(
                    "probe watch: cannot enter the network namespace of pid {} (another user namespace?): its servers are not looked for",
                    members[0]
                );
            }
            continue;
        };
        let new: HashSet<u64> = socks.iter().map(|s| s.1).filter(|i| !owners.contains_key(i)).collect();
        if !new.is_empty() {
            let mut found: HashMap<u64, Vec<u32>> = HashMap::new();
            for &p in members {
                for i in crate::os::procfs::socket_inodes(p).intersection(&new) {
                    found.entry(*i).or_default().push(p);
                }
            }
            // A socket no process was found for (ours, one that closed meanwhile) is
            // remembered too: a scan reads file descriptors only for sockets new to it.
            for i in new {
                owners.insert(i, found.get(&i).and_then(|p| crate::os::procfs::topmost(p)));
            }
        }
        for (addr, inode) in socks {
            seen.insert(inode);
            if let Some(&Some(pid)) = owners.get(&inode).filter(|p| p.is_some_and(|p| !skip.contains(&p))) {
                out.push(Listener { pid, addr, netns: *ns });
            }
        }
    }
    owners.retain(|i, _| seen.contains(i));
    out
}

/// The listening sockets of `member`'s network namespace: the kernel's sock_diag dump of LISTEN
/// sockets (from a thread moved into that namespace), which costs what the listeners cost;
/// /proc/PID/net/tcp{,6} walks every socket of the namespace (a busy server's thousands of
/// connections, every scan), so it is only the fallback.
fn listeners_in(ours: bool, member: u32) -> Option<Vec<(SocketAddr, u64)>> {
    let dump = move || {
        if !ours {
            let ns = std::fs::File::open(format!("/proc/{member}/ns/net")).ok()?;
            crate::os::procfs::enter_netns(&ns).ok()?;
        }
        crate::os::procfs::tcp_listeners()
    };
    let got = if ours {
        dump()
    } else {
        std::thread::Builder::new().name("probe-scan".into()).spawn(dump).ok().and_then(|t| t.join().ok()).flatten()
    };
    if got.is_none() && !ours {
        // A namespace probe cannot enter (another user namespace): its servers could not be
        // asked either.
        return None;
    }
    Some(got.unwrap_or_else(|| {
        let text: String = ["tcp", "tcp6"].iter().filter_map(|f| std::fs::read_to_string(format!("/proc/{member}/net/{f}")).ok()).collect();
        parse_listeners(&text)
    }))
}

/// The most one ask may take, both paths together, however the listener trickles its answer.
pub const ASK_DEADLINE: Duration = Duration::from_secs(2);
/// The most body an answer may have (an Ollama with hundreds of models lists them in ~100 KiB).
const ASK_CAP: usize = 256 << 10;

/// Ask a listener, from inside its network namespace, whether it serves models. Nothing the
/// operator gave (`--api-key`, `--header`) is sent: the listener may be anyone's.
pub fn ask(l: &Listener) -> Answer {
    let l = l.clone();
    let ours = crate::os::procfs::netns(crate::os::procfs::self_pid());
    let run = move || {
        if l.netns != ours {
            let Ok(ns) = std::fs::File::open(format!("/proc/{}/ns/net", l.pid)) else { return Answer::Later };
            if crate::os::procfs::enter_netns(&ns).is_err() {
                return Answer::Later;
            }
        }
        let ip: std::net::IpAddr = match l.addr.ip() {
            ip if !ip.is_unspecified() => ip,
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        };
        let url = crate::util::httpc::Url::of(SocketAddr::new(ip, l.addr.port()));
        let deadline = Instant::now() + ASK_DEADLINE;
        let mut later = false;
        for (path, key) in [("/v1/models", "data"), ("/api/tags", "models")] {
            match crate::util::httpc::get_anonymous(&url, path, Duration::from_secs(1), deadline, ASK_CAP) {
                Ok((401 | 403, body)) if api_error(&body) => return Answer::WantsKey,
                Ok((200, body)) => {
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    if v[key].is_array() {
                        return Answer::Server;
                    }
                }
                Ok((503, _)) => later = true,
                Ok(_) => {}
                Err(e) if e.contains("refused") => later = true,
                // Out of time, or a body past the cap: asked again later.
                Err(e) if Instant::now() + Duration::from_millis(50) >= deadline || e.contains("sent a body over") => return Answer::Slow,
                Err(_) => {}
            }
        }
        if later { Answer::Later } else { Answer::NotServer }
    };
    // A thread of its own: setns moves only the calling thread.
    std::thread::Builder::new().name("probe-ask".into()).spawn(run).ok().and_then(|t| t.join().ok()).unwrap_or(Answer::Later)
}

/// Whether a 401/403 body is an API's error as the servers write it: OpenAI-style
/// `{"error": {"message": ...}}` (llama.cpp, LiteLLM, LM Studio), `{"error": "..."}` (vLLM,
/// Ollama), FastAPI's `{"detail": ...}`. A bare 401 page is not a server.
pub fn api_error(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else { return false };
    v["error"].is_string() || v["error"]["message"].is_string() || v["detail"].is_string() || v["detail"].is_array()
}

/// The most listeners asked at once; more wait for the next scan.
pub const MAX_ASKS: usize = 16;

/// Listeners asked in parallel, off the scanning loop: a slow, silent or endless listener holds
/// one of [`MAX_ASKS`] slots for at most [`ASK_DEADLINE`], and is asked again later, each time
/// less often (10 s, 20 s... up to 2 min).
pub struct Asker {
    tx: std::sync::mpsc::Sender<(Listener, Answer)>,
    rx: std::sync::mpsc::Receiver<(Listener, Answer)>,
    in_flight: HashSet<(u32, u16)>,
    backoff: HashMap<(u32, u16), (Instant, u32)>,
}

impl Default for Asker {
    fn default() -> Asker {
        let (tx, rx) = std::sync::mpsc::channel();
        Asker { tx, rx, in_flight: HashSet::new(), backoff: HashMap::new() }
    }
}

impl Asker {
    /// Start asking `l` unless it is being asked, waits out a backoff, or every slot is taken.
    pub fn start(&mut self, l: &Listener) {
        let key = (l.pid, l.addr.port());
        if self.in_flight.len() >= MAX_ASKS || self.in_flight.contains(&key) || self.backoff.get(&key).is_some_and(|b| Instant::now() < b.0)
        {
            return;
        }
        let (tx, l) = (self.tx.clone(), l.clone());
        if std::thread::Builder::new()
            .name("probe-discover".into())
            .spawn(move || {
                let a = ask(&l);
                let _ = tx.send((l, a));
            })
            .is_ok()
        {
            self.in_flight.insert(key);
        }
    }

    /// The answers that came since the last call (a slow one starts its backoff).
    pub fn answers(&mut self) -> Vec<(Listener, Answer)> {
        let got: Vec<(Listener, Answer)> = self.rx.try_iter().collect();
        for (l, a) in &got {
            let key = (l.pid, l.addr.port());
            self.in_flight.remove(&key);
            if *a == Answer::Slow {
                let tries = self.backoff.get(&key).map_or(0, |b| b.1) + 1;
                let wait = Duration::from_secs((10u64 << (tries - 1).min(4)).min(120));
                self.backoff.insert(key, (Instant::now() + wait, tries));
            } else {
                self.backoff.remove(&key);
            }
        }
        got
    }

    /// Forget listeners no longer there.
    pub fn retain(&mut self, live: &HashSet<(u32, u16)>) {
        self.backoff.retain(|k, _| live.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_of_both_families() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n\
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 100 0 0 10 0\n\
   0: 00000000000000000000000000000000:2382 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1 0\n";
        let l = parse_listeners(text);
        assert_eq!(l.len(), 2, "{l:?}");
        assert_eq!(l[0], ("127.0.0.1:8080".parse().unwrap(), 4242));
        assert_eq!(l[1].0.port(), 9090);
    }

    #[test]
    fn api_errors_are_told_from_pages() {
        assert!(api_error(br#"{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}"#));
        assert!(api_error(br#"{"error":"Unauthorized"}"#));
        assert!(api_error(br#"{"detail":"Not authenticated"}"#));
        assert!(!api_error(b"<html>401 Unauthorized</html>"));
        assert!(!api_error(br#"{"status":"denied"}"#));
        assert!(!api_error(b""));
    }
}
