//! Which process `probe watch` follows, and its successor after it exits: the process that
//! listens on the same port (a restarted server, an upgrade), else one of the same executable.
use std::collections::HashSet;

use crate::os::procfs::{all_pids as pids, topmost};

/// How the user named the target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Select {
    Pid(u32),
    /// Whoever listens on this TCP port (in probe's network namespace).
    Port(u16),
    /// A process whose name (comm) or executable's file name is this.
    Exe(String),
    /// The processes of this cgroup (`--cgroup`, `--container`): all of them are traced; the
    /// one listening on a port stands for them.
    Cgroup(std::path::PathBuf),
}

/// The target across restarts.
pub struct Following {
    select: Select,
    /// What the last target was, to find its successor: its listening ports and executable.
    ports: Vec<u16>,
    exe: Option<String>,
    /// A pid that exited is not taken again (a zombie, or /proc still showing it).
    gone: HashSet<u32>,
    /// Who the first target was: its uid, executable and cgroup. A successor must be the same
    /// user, running the same executable or in the same cgroup: a local user who binds the port
    /// while the server restarts gets neither its credentials nor a trace.
    pin: Option<Pin>,
    /// Candidates refused by the pin, said once each.
    refused: HashSet<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Pin {
    uid: u32,
    exe: Option<std::path::PathBuf>,
    cgroup: Option<String>,
}

impl Pin {
    fn of(pid: u32) -> Option<Pin> {
        Some(Pin { uid: crate::os::procfs::uid(pid)?, exe: crate::os::procfs::exe(pid), cgroup: crate::os::cgroup::of_pid(pid) })
    }

    fn admits(&self, other: &Pin) -> bool {
        self.uid == other.uid && ((self.exe.is_some() && self.exe == other.exe) || (self.cgroup.is_some() && self.cgroup == other.cgroup))
    }
}

impl Following {
    pub fn new(select: Select) -> Following {
        Following { select, ports: vec![], exe: None, gone: HashSet::new(), pin: None, refused: HashSet::new() }
    }

    pub fn describe(&self) -> String {
        let what = match &self.select {
            Select::Pid(p) if self.ports.is_empty() && self.exe.is_none() => return format!("pid {p}"),
            Select::Pid(p) => format!("a successor of pid {p}"),
            Select::Port(p) => return format!("a process listening on port {p}"),
            Select::Exe(e) => return format!("a process named {}", crate::util::text::terminal(e)),
            Select::Cgroup(c) => return format!("a process in cgroup {}", crate::util::text::terminal(&c.display().to_string())),
        };
        let mut by = Vec::new();
        if !self.ports.is_empty() {
            by.push(format!("listening on port {}", self.ports.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")));
        }
        if let Some(e) = &self.exe {
            by.push(format!("running {}", crate::util::text::terminal(e)));
        }
        format!("{what} ({})", by.join(" or "))
    }

    /// The process to follow now, if there is one.
    pub fn find(&mut self) -> Option<u32> {
        let pid = match &self.select {
            Select::Pid(p) if self.ports.is_empty() && self.exe.is_none() => Some(*p).filter(|&p| crate::os::procfs::exists(p)),
            Select::Pid(_) => self.ports.iter().find_map(|&port| listener(port)).or_else(|| self.exe.as_deref().and_then(by_exe)),
            Select::Port(port) => listener(*port),
            Select::Exe(name) => by_exe(name),
            Select::Cgroup(c) => {
                let gone = &self.gone;
                let live: Vec<u32> = crate::os::cgroup::procs(c).into_iter().filter(|p| !gone.contains(p)).collect();
                crate::os::cgroup::main_pid(&live)
            }
        }?;
        if self.gone.contains(&pid) || !crate::os::procfs::exists(pid) {
            return None;
        }
        if !matches!(self.select, Select::Cgroup(_)) {
            let who = Pin::of(pid)?;
            match &self.pin {
                None => self.pin = Some(who),
                Some(p) if p.admits(&who) => {}
                Some(p) => {
                    if self.refused.insert(pid) {
                        super::log_line!(
                            "probe watch: not following pid {pid}: it runs {} as uid {}, not {} as uid {} like the process followed before (restart probe to follow it)",
                            crate::util::text::terminal(&who.exe.as_ref().map_or("?".into(), |e| e.display().to_string())),
                            who.uid,
                            crate::util::text::terminal(&p.exe.as_ref().map_or("?".into(), |e| e.display().to_string())),
                            p.uid
                        );
                    }
                    return None;
                }
            }
        }
        // What to look for when it exits (a --pid target's successor).
        let ports = crate::os::procfs::listen_ports(pid);
        if !ports.is_empty() {
            self.ports = ports;
        }
        if let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) {
            self.exe = exe.file_name().map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string());
        }
        Some(pid)
    }

    pub fn exited(&mut self, pid: u32) {
        if self.gone.len() > 4096 {
            self.gone.clear();
        }
        self.gone.insert(pid);
    }
}

/// The process listening on TCP `port`: in probe's network namespace first, else in another one
/// (a server in a container of its own, whose port is the container's, not the host's).
pub fn listener(port: u16) -> Option<u32> {
    let me = crate::os::procfs::self_pid();
    let all: Vec<u32> = pids().into_iter().filter(|&p| p != me).collect();
    let owners = |inodes: &HashSet<u64>, among: &[u32]| -> Option<u32> {
        let found: Vec<u32> = among.iter().copied().filter(|&p| !crate::os::procfs::socket_inodes(p).is_disjoint(inodes)).collect();
        topmost(&found)
    };
    let here: HashSet<u64> =
        crate::os::procfs::tcp_listeners().unwrap_or_default().into_iter().filter(|(a, _)| a.port() == port).map(|(_, i)| i).collect();
    if !here.is_empty() {
        return owners(&here, &all);
    }
    // Other namespaces: one read of /proc/PID/net/tcp{,6} per namespace, then its processes.
    let ours = crate::os::procfs::netns(me);
    let mut by_ns: std::collections::BTreeMap<u64, Vec<u32>> = std::collections::BTreeMap::new();
    for &p in &all {
        if let Some(ns) = crate::os::procfs::netns(p).filter(|ns| Some(*ns) != ours) {
            by_ns.entry(ns).or_default().push(p);
        }
    }
    for members in by_ns.values() {
        let text: String =
            ["tcp", "tcp6"].iter().filter_map(|f| std::fs::read_to_string(format!("/proc/{}/net/{f}", members[0])).ok()).collect();
        let inodes = crate::os::procfs::parse_listen_inodes(&text, port);
        if !inodes.is_empty() {
            return owners(&inodes, members);
        }
    }
    None
}

/// A process whose comm (first 15 bytes of its name) or executable's file name is `name`.
pub fn by_exe(name: &str) -> Option<u32> {
    let me = crate::os::procfs::self_pid();
    let short: String = name.chars().take(15).collect();
    let found: Vec<u32> = pids()
        .into_iter()
        .filter(|&p| p != me)
        .filter(|&p| {
            let exe = std::fs::read_link(format!("/proc/{p}/exe")).ok();
            let exe_name = exe.as_ref().and_then(|e| e.file_name()).map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string());
            exe_name.as_deref() == Some(name) || (exe.is_some() && crate::os::procfs::comm(p) == short)
        })
        .collect();
    topmost(&found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_process_by_port_and_not_a_gone_pid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // probe never follows itself: a listener of this test process is not found.
        assert_eq!(listener(port), None);
        let mut f = Following::new(Select::Pid(1));
        f.exited(1);
        assert_eq!(f.find(), None, "an exited pid is not taken again");
        // A successor is the same user running the same executable or in the same cgroup.
        let me = Pin { uid: 0, exe: Some("/usr/bin/llama-server".into()), cgroup: Some("/system.slice/llama.service".into()) };
        assert!(me.admits(&Pin { cgroup: None, ..me.clone() }));
        assert!(me.admits(&Pin { exe: Some("/opt/new/llama-server".into()), ..me.clone() }), "an upgrade in the same service");
        assert!(!me.admits(&Pin { uid: 1000, ..me.clone() }), "another user");
        assert!(!me.admits(&Pin { uid: 0, exe: Some("/tmp/x".into()), cgroup: Some("/user.slice".into()) }));
    }
}
