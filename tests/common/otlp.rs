//! A receiver of OTLP/HTTP for the tests: tests/clients/otlp.py, made of the OpenTelemetry
//! project's own message definitions (`opentelemetry-proto`), not of probe's code.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

/// A receiver of OTLP/HTTP made of the opentelemetry-proto package, killed when dropped.
pub struct Receiver {
    child: Child,
    pub port: u16,
    out: PathBuf,
}

impl Receiver {
    pub fn start(dir: &Path) -> Receiver {
        Receiver::start_on(dir, 0)
    }

    /// A receiver on `port` (0: any), e.g. again on the port of one that was stopped.
    pub fn start_on(dir: &Path, port: u16) -> Receiver {
        std::fs::create_dir_all(dir).unwrap();
        let (port_file, out) = (dir.join("port"), dir.join("received.jsonl"));
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/otlp.py");
        let child = Command::new(super::clients_python())
            .arg(script)
            .args(["receive", "--port-file", port_file.to_str().unwrap(), "--out", out.to_str().unwrap(), "--port", &port.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let port = loop {
            if let Some(p) = std::fs::read_to_string(&port_file).ok().and_then(|s| s.trim().parse().ok()) {
                break p;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "the OTLP receiver did not start");
            std::thread::sleep(Duration::from_millis(50));
        };
        Receiver { child, port, out }
    }

    /// Every span received, as OTLP/JSON objects.
    pub fn spans(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut spans = Vec::new();
        for l in text.lines() {
            let v: Value = serde_json::from_str(l).unwrap();
            assert!(v.get("error").is_none(), "the receiver could not decode an export: {v}");
            spans.extend(all_spans(&v));
        }
        spans
    }
}

impl Receiver {
    /// Every export received, as OTLP/JSON (with the receiver's `contentEncoding`).
    pub fn exports(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).inspect(|v| assert!(v.get("error").is_none(), "{v}")).collect()
    }

    /// Every log record received, each with its resource's attributes under `resource`.
    pub fn logs(&self) -> Vec<Value> {
        let mut out = Vec::new();
        for e in self.exports() {
            for rl in e["resourceLogs"].as_array().into_iter().flatten() {
                for sl in rl["scopeLogs"].as_array().into_iter().flatten() {
                    for l in sl["logRecords"].as_array().into_iter().flatten() {
                        let mut l = l.clone();
                        l["resource"] = rl["resource"].clone();
                        out.push(l);
                    }
                }
            }
        }
        out
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn all_spans(export: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for rs in export["resourceSpans"].as_array().into_iter().flatten() {
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            out.extend(ss["spans"].as_array().into_iter().flatten().cloned());
        }
    }
    out
}

/// A span's attributes: key → the value as OTLP/JSON gives it (`{"stringValue": ..}`, ...).
pub fn attrs(span: &Value) -> BTreeMap<String, Value> {
    span["attributes"].as_array().unwrap().iter().map(|a| (a["key"].as_str().unwrap().to_string(), a["value"].clone())).collect()
}
