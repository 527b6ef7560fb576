//! The connections table: TCP state changes and resets of the target's sockets, per socket, with
//! which side closed first.
use std::collections::HashMap;

use probe_common::sock::*;

use super::{Closer, Connection, Report, ResetSeen};
use crate::stream::{ClosedBy, Role};

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

/// A request record says "none" (kept open) when its response ended before any close was seen:
/// the tracker finalizes it at its last byte. When the connection table shows the connection
/// closed afterwards with no other request on it (`Connection: close`, a client that leaves after
/// one answer), the request says who closed it, as the table does.
pub(super) fn closes_after_the_response(r: &mut Report) {
    // Per connection (local, peer): its requests' arrivals, sorted, and its closes (a lookup
    // each, not a scan of every request and connection per request).
    let mut arrivals: HashMap<(&str, &str), Vec<f64>> = HashMap::new();
    for q in &r.requests {
        if let Some(a) = q.arrival_ms {
            arrivals.entry((q.local.as_str(), q.peer.as_str())).or_default().push(a);
        }
    }
    arrivals.values_mut().for_each(|v| v.sort_by(f64::total_cmp));
    let mut conns: HashMap<(&str, &str), Vec<&Connection>> = HashMap::new();
    for c in &r.connections {
        conns.entry((c.local.as_str(), c.peer.as_str())).or_default().push(c);
    }
    let mut closes = Vec::new();
    for (i, q) in r.requests.iter().enumerate() {
        let (Some(a), Some(e)) = (q.arrival_ms, q.end_ms) else { continue };
        if q.closed_by != ClosedBy::None {
            continue;
        }
        let key = (q.local.as_str(), q.peer.as_str());
        let Some(c) =
            conns.get(&key).into_iter().flatten().find(|c| {
                c.pid.is_none_or(|p| p == q.pid) && c.opened_ms.is_none_or(|o| o <= a) && c.closed_ms.is_some_and(|t| t >= a + e)
            })
        else {
            continue;
        };
        // Another request used the connection after this one, before the close: the close is
        // not this request's (a port reused by a later connection does not count).
        let closed = c.closed_ms.unwrap_or(f64::MAX);
        let after = arrivals.get(&key).map_or(&[][..], |v| &v[v.partition_point(|&x| x <= a)..]);
        if after.first().is_some_and(|&x| x <= closed) {
            continue;
        }
        let by_peer = match c.closed_by {
            Closer::Peer => true,
            Closer::Local => false,
            Closer::None => continue,
        };
        // The table's "peer" is the other end: for a server that is the client.
        let server_side = q.role == Role::Server;
        closes.push((i, if by_peer == server_side { ClosedBy::Client } else { ClosedBy::Server }));
    }
    for (i, by) in closes {
        r.requests[i].record.closed_by = by;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analysis::report::Request, stream::RequestRecord};

    /// Only the last request of a connection takes its close; one whose connection carried
    /// another request afterwards stays "kept open", and a later connection on a reused port
    /// does not stop the close from being taken.
    #[test]
    fn a_close_after_the_answer_belongs_to_the_connections_last_request() {
        let q = |id: u64, peer: &str, arrival: f64| Request {
            record: RequestRecord {
                id,
                local: "127.0.0.1:8080".into(),
                peer: peer.into(),
                arrival_ms: Some(arrival),
                end_ms: Some(10.0),
                ..Default::default()
            },
            verdict: None,
            engine: None,
        };
        let c = |peer: &str, opened: f64, closed: f64, by: Closer| Connection {
            local: "127.0.0.1:8080".into(),
            peer: peer.into(),
            opened_ms: Some(opened),
            closed_ms: Some(closed),
            closed_by: by,
            ..Default::default()
        };
        let mut r = Report {
            // Keep-alive: 1 then 2 on one connection, the server closes after 2. Then 3 and 4 on
            // connections of one reused port: 3's closed by its client before 4 came.
            requests: vec![
                q(1, "127.0.0.1:40000", 0.0),
                q(2, "127.0.0.1:40000", 20.0),
                q(3, "127.0.0.1:40001", 100.0),
                q(4, "127.0.0.1:40001", 200.0),
            ],
            connections: vec![
                c("127.0.0.1:40000", 0.0, 30.1, Closer::Local),
                c("127.0.0.1:40001", 99.0, 150.0, Closer::Peer),
                c("127.0.0.1:40001", 199.0, 250.0, Closer::Local),
            ],
            ..Default::default()
        };
        closes_after_the_response(&mut r);
        let by: Vec<ClosedBy> = r.requests.iter().map(|q| q.closed_by).collect();
        assert_eq!(by, [ClosedBy::None, ClosedBy::Server, ClosedBy::Client, ClosedBy::Server]);
    }
}
