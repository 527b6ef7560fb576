//! Incidents pulled from many nodes (a folder per node, e.g. `rsync node:/var/lib/probe
//! incidents/NODE`): `probe report DIR` on such a tree lists every incident with where it
//! happened (its labels.json, else the node folder it was found under) and its verdict. The
//! aggregation itself stays in Prometheus and the collector: this only reads folders.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::analysis::verdict::{SlowCause, StopCause, Verdict};

/// One incident found under the tree.
#[derive(Clone, Debug, Serialize)]
pub struct Incident {
    pub dir: PathBuf,
    /// node, container, pod, ... (labels.json; `node` from the folder when it has none).
    pub labels: std::collections::BTreeMap<String, String>,
    /// `slow_ttft`, `abnormal_stop`, `server_exit`, ...: the folder's name after its time.
    pub kind: String,
    /// The folder's time stamp (UTC, as watch names it).
    pub time: String,
    pub request: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub slow_cause: Option<SlowCause>,
    pub stop_cause: Option<StopCause>,
    /// The verdict's first lines of evidence.
    pub evidence: Vec<String>,
}

/// What an incident's report.json tells the listing: its requests' ids, TTFTs and verdicts
/// (read typed; the rest of the report is not needed here).
#[derive(Default, Deserialize)]
#[serde(default)]
struct ReportView {
    requests: Vec<RequestView>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct RequestView {
    id: u64,
    ttft_ms: Option<f64>,
    verdict: Option<Verdict>,
}

/// How deep incident folders are looked for under the tree.
const DEPTH: usize = 8;

/// Whether `dir` is a tree of incidents rather than one recording.
pub fn is_tree(dir: &Path) -> bool {
    !dir.join(crate::record::FILE_NAME).exists() && !dir.join("segments").exists() && !find(dir).is_empty()
}

/// Incident folders under `root` (a folder with events.bin and report.json), sorted by time.
pub fn find(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        if d.join(crate::record::FILE_NAME).is_file() && d.join("report.json").is_file() {
            out.push(d);
            continue;
        }
        if depth >= DEPTH {
            continue;
        }
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            // Never through a link: a pulled tree is data, not a map of the machine.
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    out.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    out
}

/// The node folder an incident was found under: the first folder below `root`.
fn node_folder(root: &Path, dir: &Path) -> Option<String> {
    let rel = dir.strip_prefix(root).ok()?;
    let mut parts = rel.components();
    let first = parts.next()?.as_os_str().to_string_lossy().to_string();
    // An incident right under the root has no node folder.
    parts.next().map(|_| first)
}

/// An incident's labels (its labels.json), if it has them.
pub fn labels_of(dir: &Path) -> Option<std::collections::BTreeMap<String, String>> {
    crate::util::output::read_recording_text(&dir.join(super::place::LABELS_FILE), 1 << 16).ok().and_then(|t| serde_json::from_str(&t).ok())
}

/// Read one incident folder.
pub fn read(root: &Path, dir: &Path) -> Incident {
    let mut labels = labels_of(dir).unwrap_or_default();
    if !labels.contains_key(super::place::NODE)
        && let Some(n) = node_folder(root, dir)
    {
        labels.insert(super::place::NODE.into(), n);
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    // TIME-KIND[-reqN][-n]
    let (time, rest) = name.split_once('-').unwrap_or((&name, ""));
    let (kind, request) = match rest.split_once("-req") {
        Some((k, r)) => (k.to_string(), r.split('-').next().and_then(|r| r.parse().ok())),
        None => (rest.split('-').next().unwrap_or(rest).to_string(), None),
    };
    let mut i = Incident {
        dir: dir.to_path_buf(),
        labels,
        kind,
        time: time.to_string(),
        request,
        ttft_ms: None,
        slow_cause: None,
        stop_cause: None,
        evidence: vec![],
    };
    let report: ReportView = crate::util::output::read_recording_text(&dir.join("report.json"), 256 << 20)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if let Some(q) = report.requests.into_iter().find(|q| Some(q.id) == request) {
        i.ttft_ms = q.ttft_ms;
        if let Some(v) = q.verdict {
            (i.slow_cause, i.stop_cause) = (Some(v.slow_cause), Some(v.stop_cause));
            i.evidence = v.evidence.into_iter().take(3).collect();
        }
    }
    i
}

/// Every incident of the tree at `root`.
pub fn list(root: &Path) -> Vec<Incident> {
    find(root).iter().map(|d| read(root, d)).collect()
}

/// Where, in words: `node n1, pod llm/llama-0, container c` (what is known).
pub fn place_words(labels: &std::collections::BTreeMap<String, String>) -> String {
    let mut w = Vec::new();
    if let Some(n) = labels.get(super::place::NODE) {
        w.push(format!("node {n}"));
    }
    match (labels.get(super::place::NAMESPACE), labels.get(super::place::POD)) {
        (Some(ns), Some(p)) => w.push(format!("pod {ns}/{p}")),
        (_, Some(p)) => w.push(format!("pod {p}")),
        _ => {}
    }
    if let Some(c) = labels.get(super::place::CONTAINER).or(labels.get(super::place::CONTAINER_ID)) {
        w.push(format!("container {}", c.chars().take(40).collect::<String>()));
    }
    if let Some(p) = labels.get("port") {
        w.push(format!("port {p}"));
    }
    if w.is_empty() { "where unknown".into() } else { w.join(", ") }
}

/// The listing, one incident a paragraph, oldest first, with a count per node and cause.
pub fn render(root: &Path, all: &[Incident]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let mut by: std::collections::BTreeMap<(String, String), u64> = std::collections::BTreeMap::new();
    for i in all {
        let node = i.labels.get(super::place::NODE).cloned().unwrap_or_else(|| "?".into());
        let cause = i.slow_cause.filter(|c| *c != SlowCause::None).map_or_else(|| i.kind.clone(), |c| c.name().to_string());
        *by.entry((node, cause)).or_default() += 1;
    }
    let _ = writeln!(o, "probe report: {} incident(s) under {}", all.len(), root.display());
    for ((node, cause), n) in &by {
        let _ = writeln!(o, "  node {node}: {n} {cause}");
    }
    for i in all {
        let ttft = i.ttft_ms.map(|t| format!(", TTFT {t:.0} ms")).unwrap_or_default();
        let slow = i.slow_cause.map(|c| format!(", slow: {c}")).unwrap_or_default();
        let stop = i.stop_cause.map(|c| format!(", stopped: {}", c.words())).unwrap_or_default();
        let req = i.request.map(|r| format!(" request {r}")).unwrap_or_default();
        let _ = writeln!(o, "\n{} {}{req} on {}{ttft}{slow}{stop}", i.time, i.kind, place_words(&i.labels));
        for e in &i.evidence {
            let _ = writeln!(o, "  - {e}");
        }
        let _ = writeln!(o, "  {}", i.dir.display());
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incidents_of_two_nodes() {
        let root = std::env::temp_dir().join(format!("probe-fleet-{}", std::process::id()));
        let a = root.join("node-a/servers/llm_x-port8080/incidents/20261203T010203Z-slow_ttft-req7");
        let b = root.join("node-b/incidents/20261203T020000Z-server_exit");
        for d in [&a, &b] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join(crate::record::FILE_NAME), b"").unwrap();
        }
        let q = serde_json::json!({"requests": [{"id": 7, "ttft_ms": 812.0, "verdict": {"slow_cause": "load", "stop_cause": "eos", "evidence": ["model read"]}}]});
        std::fs::write(a.join("report.json"), q.to_string()).unwrap();
        std::fs::write(b.join("report.json"), "{}").unwrap();
        std::fs::write(a.join(super::super::place::LABELS_FILE), r#"{"node":"gpu-1","namespace":"llm","pod":"x"}"#).unwrap();
        assert!(is_tree(&root));
        let all = list(&root);
        assert_eq!(all.len(), 2);
        assert_eq!((all[0].kind.as_str(), all[0].request, all[0].slow_cause), ("slow_ttft", Some(7), Some(SlowCause::Load)));
        assert_eq!(all[0].labels["node"], "gpu-1", "labels.json wins over the folder");
        assert_eq!((all[1].kind.as_str(), all[1].labels["node"].as_str()), ("server_exit", "node-b"));
        let text = render(&root, &all);
        assert!(text.contains("on node gpu-1, pod llm/x, TTFT 812 ms, slow: load"), "{text}");
        assert!(text.contains("node node-b: 1 server_exit"), "{text}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
