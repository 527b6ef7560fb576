//! What the tests and benches run probe against: the test workload, a llama-server on a free
//! port, and plain HTTP to them.
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::setup::{bin, llama};

/// Start a workload (it prints `ready PID` and waits for a line on stdin).
/// Returns the child, its pid, and its later stdout lines.
pub(crate) fn start_workload(args: &[&str]) -> anyhow::Result<(std::process::Child, u32, std::sync::mpsc::Receiver<String>)> {
    let mut child = Command::new(bin("probe-workload")).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("workload stdout")?);
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            bail!("workload exited before it was ready");
        }
        if let Some(pid) = line.strip_prefix("ready ") {
            let pid = pid.trim().parse()?;
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for l in out.lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
            return Ok((child, pid, rx));
        }
    }
}

pub(crate) fn wait_for(path: &Path, limit: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > limit {
            bail!("{} did not appear within {limit:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// One HTTP request with `Connection: close`; reads the whole response, or drops the connection
/// after `cut_after` SSE events. Returns (status line, SSE events read).
pub(crate) fn http(addr: &str, path: &str, body: &str, cut_after: Option<usize>) -> anyhow::Result<(String, usize)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        let events = buf.windows(6).filter(|w| w == b"data: ").count();
        if cut_after.is_some_and(|c| events > c) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&buf);
    Ok((text.lines().next().unwrap_or("").to_string(), buf.windows(6).filter(|w| w == b"data: ").count()))
}

/// A llama-server (SmolLM2-135M) on a free loopback port, answering /health; killed when dropped.
pub(crate) struct Llama {
    child: std::process::Child,
    pub(crate) addr: String,
}

impl Llama {
    /// Start it with `args` (beside the model and the address), its stderr to `log`, and wait up
    /// to 60 s for /health.
    pub(crate) fn start(args: &[&str], log: Option<&Path>) -> anyhow::Result<Llama> {
        let (server, model) = llama()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
        let stderr = match log {
            Some(p) => Stdio::from(std::fs::File::create(p)?),
            None => Stdio::null(),
        };
        let child = Command::new(&server)
            .args(["-m", &model])
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        let srv = Llama { child, addr: format!("127.0.0.1:{port}") };
        println!("llama-server on {} with {model}", srv.addr);
        let t = Instant::now();
        while !http_get_ok(&srv.addr, "/health") {
            if t.elapsed() > Duration::from_secs(60) {
                let see = log.map(|p| format!(" (see {})", p.display())).unwrap_or_default();
                bail!("llama-server did not become healthy in 60 s{see}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(srv)
    }

    pub(crate) fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Llama {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a GET answered 200, when it was.
pub(crate) fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

pub(crate) fn http_get_ok(addr: &str, path: &str) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return false };
    if write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}
