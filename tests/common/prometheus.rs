//! A real Prometheus (Debian's package, installed by scripts/setup.sh) scraping one target every
//! second, with rule files evaluated every second; killed when dropped.
use std::{
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
};

use serde_json::Value;

pub struct Prometheus {
    child: Child,
    pub addr: SocketAddr,
}

impl Prometheus {
    /// Scrape `target` (host:port) every second; its config and data under `dir`.
    pub fn start(dir: &Path, target: &str, rules: Option<&Path>) -> Prometheus {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let rule_files = rules.map(|r| format!("rule_files: ['{}']\n", r.display())).unwrap_or_default();
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{rule_files}scrape_configs:\n  - job_name: probe\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian package `prometheus`, installed by scripts/setup.sh)");
        Prometheus { child, addr: format!("127.0.0.1:{port}").parse().unwrap() }
    }

    /// An instant query's result vector (empty until Prometheus answers).
    pub fn query(&self, q: &str) -> Vec<Value> {
        let Ok((200, body)) = super::http(self.addr, "GET", &format!("/api/v1/query?query={}", encode(q)), None, &[]) else {
            return vec![];
        };
        serde_json::from_slice::<Value>(&body).ok().and_then(|v| v["data"]["result"].as_array().cloned()).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A URL query value, percent-encoded.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}
