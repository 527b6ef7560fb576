//! The connections table: TCP state changes and resets of the target's sockets, per socket, with
//! which side closed first.
use std::collections::HashMap;

use probe_common::sock::*;

use super::{Closer, Connection, ResetSeen};

pub fn state_name(s: i32) -> &'static str {
    match s {
        TCP_ESTABLISHED => "ESTABLISHED",
        TCP_SYN_SENT => "SYN_SENT",
        TCP_SYN_RECV => "SYN_RECV",
        TCP_FIN_WAIT1 => "FIN_WAIT1",
        TCP_FIN_WAIT2 => "FIN_WAIT2",
        TCP_TIME_WAIT => "TIME_WAIT",
        TCP_CLOSE => "CLOSE",
        TCP_CLOSE_WAIT => "CLOSE_WAIT",
        TCP_LAST_ACK => "LAST_ACK",
        TCP_LISTEN => "LISTEN",
        TCP_CLOSING => "CLOSING",
        _ => "UNKNOWN",
    }
}

fn addr_str(family: u16, a: &[u8; 16], port: u16) -> String {
    if family == AF_INET6 {
        format!("[{}]:{port}", std::net::Ipv6Addr::from(*a))
    } else {
        format!("{}.{}.{}.{}:{port}", a[0], a[1], a[2], a[3])
    }
}

pub(super) fn sock_event(
    s: &SockEvent,
    conns: &mut Vec<(u64, Connection, bool)>,
    index: &mut HashMap<u64, usize>,
    ms: &dyn Fn(u64) -> f64,
) {
    let is_listener = s.what == SOCK_STATE && (s.newstate == TCP_LISTEN || s.oldstate == TCP_LISTEN);
    if is_listener {
        return;
    }
    let i = match index.get(&s.skaddr) {
        Some(&i) if conns[i].2 => i,
        _ => {
            conns.push((
                s.skaddr,
                Connection {
                    local: addr_str(s.family, &s.saddr, s.sport),
                    peer: addr_str(s.family, &s.daddr, s.dport),
                    closed_by: Closer::None,
                    reset: ResetSeen::None,
                    ..Default::default()
                },
                true,
            ));
            index.insert(s.skaddr, conns.len() - 1);
            conns.len() - 1
        }
    };
    let (_, c, open) = &mut conns[i];
    // connect() moves to SYN_SENT before the local port is chosen: take the 4-tuple once complete.
    if s.sport != 0 && s.dport != 0 {
        c.local = addr_str(s.family, &s.saddr, s.sport);
        c.peer = addr_str(s.family, &s.daddr, s.dport);
    }
    if s.hdr.pid != 0 && c.pid.is_none() {
        c.pid = Some(s.hdr.pid);
    }
    let t = ms(s.hdr.ts_ns);
    let mut set_closer = |who: Closer| {
        if c.closed_by == Closer::None {
            c.closed_by = who;
        }
    };
    match s.what {
        SOCK_RESET_RECEIVED => {
            set_closer(Closer::Peer);
            if c.reset == ResetSeen::None {
                c.reset = ResetSeen::Received;
            }
        }
        SOCK_RESET_SENT => {
            set_closer(Closer::Local);
            if c.reset == ResetSeen::None {
                c.reset = ResetSeen::Sent;
            }
        }
        _ => {
            if c.states.is_empty() {
                c.states.push(state_name(s.oldstate).into());
            }
            c.states.push(state_name(s.newstate).into());
            if matches!(s.newstate, TCP_ESTABLISHED | TCP_SYN_SENT) && c.opened_ms.is_none() {
                c.opened_ms = Some(t);
            }
            match (s.oldstate, s.newstate) {
                (TCP_ESTABLISHED | TCP_SYN_RECV, TCP_FIN_WAIT1) => set_closer(Closer::Local),
                (TCP_ESTABLISHED | TCP_SYN_RECV, TCP_CLOSE_WAIT) => set_closer(Closer::Peer),
                (_, TCP_CLOSE) => set_closer(if s.in_target != 0 { Closer::Local } else { Closer::Peer }),
                _ => {}
            }
            if s.newstate == TCP_CLOSE {
                c.closed_ms = Some(t);
                *open = false;
            }
        }
    }
}
