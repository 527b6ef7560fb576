//! `watch --all --api-key-for SCOPE`: which of the node's servers get the operator's credentials.
//!
//! Discovery asks every listener on the node, so it sends no credentials at all; a server gets
//! the key (through its follower's environment, never a command line) only when it matches a
//! scope the operator gave. A scope is pinned to the first server it matched: its uid and
//! executable. A later match (the server restarted, or someone else bound its port first) gets
//! the key only as the same user running the same executable, so a local user who takes the
//! port while the server restarts gets neither the key nor its traffic's trace.
use std::path::PathBuf;

/// One `--api-key-for` scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// A container by name (the `container` label).
    Container(String),
    /// Whoever listens on this TCP port (in its own network namespace).
    Port(u16),
    /// A process running this executable (absolute path, as /proc/PID/exe shows it).
    Exe(PathBuf),
}

impl Scope {
    pub fn parse(s: &str) -> Result<Scope, String> {
        let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}`: give container=NAME, port=PORT or exe=PATH"))?;
        let v = v.trim();
        if v.is_empty() {
            return Err(format!("`{s}`: the {k} is empty"));
        }
        match k.trim() {
            "container" => Ok(Scope::Container(v.to_string())),
            "port" => v.parse().map(Scope::Port).map_err(|_| format!("`{v}` is not a TCP port")),
            "exe" if v.starts_with('/') => Ok(Scope::Exe(PathBuf::from(v))),
            "exe" => Err(format!("`{v}`: give the executable's absolute path (as /proc/PID/exe shows it)")),
            _ => Err(format!("`{k}`: a scope is container=NAME, port=PORT or exe=PATH")),
        }
    }

    /// Whether a server (its labels, port and executable) is in this scope.
    fn covers(&self, s: &Server) -> bool {
        match self {
            Scope::Container(n) => s.labels.iter().any(|(k, v)| k == super::place::CONTAINER && v == n),
            Scope::Port(p) => s.port == *p,
            Scope::Exe(e) => s.exe.as_ref() == Some(e),
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Container(n) => write!(f, "container={}", crate::util::text::terminal(n)),
            Scope::Port(p) => write!(f, "port={p}"),
            Scope::Exe(e) => write!(f, "exe={}", crate::util::text::terminal(&e.display().to_string())),
        }
    }
}

/// What a scope is matched against: a server found on the node.
pub struct Server {
    pub port: u16,
    pub labels: Vec<(String, String)>,
    pub uid: Option<u32>,
    pub exe: Option<PathBuf>,
}

impl Server {
    pub fn of(pid: u32, port: u16, labels: &[(String, String)]) -> Server {
        Server { port, labels: labels.to_vec(), uid: crate::os::procfs::uid(pid), exe: crate::os::procfs::exe(pid) }
    }
}

/// The operator's scopes, each with the identity it was pinned to.
#[derive(Default)]
pub struct Scopes {
    scopes: Vec<(Scope, Option<(u32, PathBuf)>)>,
}

/// Whether a server gets the credentials, and why not.
#[derive(Debug, PartialEq, Eq)]
pub enum Grant {
    Yes(String),
    /// No scope covers it.
    NotScoped,
    /// A scope covers it, but it is not who the scope was pinned to.
    NotPinned(String),
}

impl Scopes {
    pub fn new(scopes: Vec<Scope>) -> Scopes {
        Scopes { scopes: scopes.into_iter().map(|s| (s, None)).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.scopes.is_empty()
    }

    /// Whether `s` gets the credentials; the first match of a scope pins it to `s`'s identity.
    pub fn grant(&mut self, s: &Server) -> Grant {
        let mut refused = None;
        for (scope, pin) in &mut self.scopes {
            if !scope.covers(s) {
                continue;
            }
            let (Some(uid), Some(exe)) = (s.uid, s.exe.clone()) else {
                refused = Some(format!("{scope} matches, but its uid and executable cannot be read"));
                continue;
            };
            match pin {
                None => {
                    *pin = Some((uid, exe));
                    return Grant::Yes(scope.to_string());
                }
                Some((u, e)) if *u == uid && *e == exe => return Grant::Yes(scope.to_string()),
                Some((u, e)) => {
                    refused = Some(format!(
                        "{scope} was first given to uid {u} running {}; this is uid {uid} running {}",
                        crate::util::text::terminal(&e.display().to_string()),
                        crate::util::text::terminal(&exe.display().to_string())
                    ))
                }
            }
        }
        refused.map_or(Grant::NotScoped, Grant::NotPinned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_and_pin_to_the_first_match() {
        assert_eq!(Scope::parse("port=8080"), Ok(Scope::Port(8080)));
        assert_eq!(Scope::parse("container= llm "), Ok(Scope::Container("llm".into())));
        assert!(Scope::parse("exe=llama-server").is_err(), "a relative path names nothing");
        assert!(Scope::parse("pid=3").is_err() && Scope::parse("port=x").is_err() && Scope::parse("port=").is_err());
        let server = |port, uid, exe: &str, container: &str| Server {
            port,
            labels: vec![("container".into(), container.into())],
            uid: Some(uid),
            exe: Some(exe.into()),
        };
        let mut s = Scopes::new(vec![Scope::Port(8080), Scope::Container("llm".into())]);
        assert_eq!(s.grant(&server(9000, 0, "/bin/x", "web")), Grant::NotScoped);
        assert_eq!(s.grant(&server(8080, 0, "/usr/bin/llama-server", "a")), Grant::Yes("port=8080".into()));
        // Restarted: the same user and executable get it again; another user on the port does not.
        assert_eq!(s.grant(&server(8080, 0, "/usr/bin/llama-server", "b")), Grant::Yes("port=8080".into()));
        assert!(matches!(s.grant(&server(8080, 1000, "/tmp/evil", "c")), Grant::NotPinned(w) if w.contains("uid 1000")));
        // Another scope is pinned on its own.
        assert_eq!(s.grant(&server(1, 1000, "/opt/vllm", "llm")), Grant::Yes("container=llm".into()));
        let unknown = Server { port: 8080, labels: vec![], uid: None, exe: None };
        assert!(matches!(s.grant(&unknown), Grant::NotPinned(_)));
    }
}
