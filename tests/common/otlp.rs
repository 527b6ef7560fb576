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
        std::fs::create_dir_all(dir).unwrap();
        let (port_file, out) = (dir.join("port"), dir.join("received.jsonl"));
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/otlp.py");
        let child = Command::new(super::clients_python())
            .arg(script)
            .args(["receive", "--port-file", port_file.to_str().unwrap(), "--out", out.to_str().unwrap()])
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
