//! The parts of probe's report.json the benches and the soak read, typed: probe-user's
//! `analysis::report::Report` writes the file, and these structs hold only the fields xtask uses,
//! under the same names. Every field defaults when absent (a report from an older probe, the
//! baseline binary's included), as the benches' figures did: 0, nothing, none.
use std::{collections::BTreeMap, path::Path};

use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Report {
    pub duration_s: f64,
    pub events: u64,
    pub lost_events: BTreeMap<String, u64>,
    pub skipped_runs: BTreeMap<String, u64>,
    /// The stream tracker's limits, key by key: a map (not a struct) so that the soak prints them
    /// as they are in the file, every key, in key order, `null` when absent.
    pub stream_limits: Option<BTreeMap<String, u64>>,
    pub requests: Vec<Request>,
    /// By kind: cpu, offcpu, fault, io.
    pub stacks: BTreeMap<String, StackStats>,
    pub unwind: Unwind,
    pub counters: BTreeMap<String, u64>,
    pub python: Python,
    pub armed: Armed,
    pub cost: Cost,
}

impl Report {
    /// The report.json in recording `rec`.
    pub fn read(rec: &Path) -> anyhow::Result<Report> {
        Ok(serde_json::from_slice(&std::fs::read(rec.join("report.json"))?)?)
    }

    /// A counter by name, 0 when the report has none.
    pub fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    /// Events lost, all probes.
    pub fn lost(&self) -> u64 {
        self.lost_events.values().sum()
    }

    /// Program runs the kernel skipped, all programs.
    pub fn skipped(&self) -> u64 {
        self.skipped_runs.values().sum()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Request {
    pub verdict: Option<Verdict>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Verdict {
    pub competitors: Vec<Competitor>,
}

/// Another process that held a CPU a target thread waited for.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Competitor {
    pub pid: u32,
    /// The waits it ended; `held_ms`, the time it held the CPU, is absent in reports from a
    /// binary before the kernel said how long the task it replaced had run.
    pub ms: Option<f64>,
    pub held_ms: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct StackStats {
    pub stacks: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Unwind {
    pub us_per_sample: f64,
    pub load_ms: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Python {
    pub work_ns: u64,
}

/// Start to armed, stage by stage: (stage, ms).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Armed {
    pub stages: Vec<(String, f64)>,
}

/// What tracing cost, % of one core, and per program.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Cost {
    pub pct_of_core: f64,
    pub probe_pct: f64,
    pub bpf_pct: f64,
    pub programs: Vec<ProgramCost>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct ProgramCost {
    pub name: String,
    pub runs_per_s: f64,
    pub ns_per_run: f64,
}

impl Cost {
    /// (ns per run, runs per second) of program `name`; zeros when it did not run.
    pub fn program(&self, name: &str) -> (f64, f64) {
        self.programs.iter().find(|p| p.name == name).map_or((0.0, 0.0), |p| (p.ns_per_run, p.runs_per_s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report probe wrote (the kernel demo's, kept for the HTML tests): it parses, and its
    /// figures are the file's.
    #[test]
    fn reads_a_report_probe_wrote() {
        let r: Report = serde_json::from_str(include_str!("../../tests/data/report/demo/report.json")).unwrap();
        assert_eq!(r.events, 783);
        assert_eq!(r.duration_s, 0.021950446);
        assert_eq!(r.lost_events.len(), 6);
        assert_eq!((r.lost(), r.skipped()), (0, 0));
        assert!(r.armed.stages.is_empty());
        assert!(r.stream_limits.is_none());
        assert_eq!(r.cost.program("cpu_sample"), (0.0, 0.0));
    }

    /// The fields the benches read, in the shapes probe-user's serializer gives them (armed
    /// stages as [name, ms] pairs, a competitor with and without `held_ms`, the cost's programs).
    #[test]
    fn reads_the_fields_the_benches_use() {
        let text = serde_json::json!({
            "schema_version": 2,
            "duration_s": 3.5,
            "events": 120,
            "lost_events": {"mmap": 2, "sock": 3},
            "skipped_runs": {"cpu_sample": 4},
            "stream_limits": {"conns_evicted": 0, "requests_evicted": 1, "conns_forgotten": 2, "conns_peak": 3, "held_peak": 4},
            "requests": [
                {"method": "POST", "verdict": {"slow_cause": "cpu", "competitors": [
                    {"pid": 42, "comm": "probe", "ms": 5.0, "held_ms": 1.5},
                    {"pid": 42, "comm": "probe", "ms": 2.0},
                    {"pid": 7, "comm": "stress", "ms": 9.0}
                ]}},
                {"method": "GET"}
            ],
            "stacks": {"cpu": {"stacks": 99, "complete": 90, "median_depth": 12}},
            "unwind": {"samples": 99, "complete": 90, "success_rate": 0.9, "us_per_sample": 4.5, "reused": 0, "load_ms": 30.25},
            "counters": {"python_walks": 10, "python_walk_ns": 2000},
            "python": {"merged": 1, "unnamed": 0, "work_ns": 500},
            "armed": {"ms": 134.0, "stages": [["preflight", 1.5], ["program cpu_sample", 20.0]]},
            "cost": {"wall_s": 3.0, "probe_cpu_ms": 1.0, "bpf_ms": 2.0, "pct_of_core": 0.3, "probe_pct": 0.1, "bpf_pct": 0.2,
                "programs": [{"name": "cpu_sample", "runs": 300, "runs_per_s": 100.0, "ns_per_run": 2500.0, "pct_of_core": 0.025}]}
        })
        .to_string();
        let r: Report = serde_json::from_str(&text).unwrap();
        assert_eq!((r.duration_s, r.events, r.lost(), r.skipped()), (3.5, 120, 5, 4));
        assert_eq!(r.requests.len(), 2);
        let c = &r.requests[0].verdict.as_ref().unwrap().competitors;
        assert_eq!(c.iter().map(|c| (c.pid, c.held_ms.or(c.ms))).collect::<Vec<_>>(), [(42, Some(1.5)), (42, Some(2.0)), (7, Some(9.0))]);
        assert!(r.requests[1].verdict.is_none());
        assert_eq!(r.stacks["cpu"].stacks, 99);
        assert_eq!((r.unwind.us_per_sample, r.unwind.load_ms), (4.5, 30.25));
        assert_eq!((r.counter("python_walks"), r.counter("python_walk_ns"), r.counter("absent")), (10, 2000, 0));
        assert_eq!(r.python.work_ns, 500);
        assert_eq!(r.armed.stages, [("preflight".to_string(), 1.5), ("program cpu_sample".to_string(), 20.0)]);
        assert_eq!((r.cost.pct_of_core, r.cost.probe_pct, r.cost.bpf_pct), (0.3, 0.1, 0.2));
        assert_eq!((r.cost.program("cpu_sample"), r.cost.program("sched_switch")), ((2500.0, 100.0), (0.0, 0.0)));
    }

    /// The soak prints the stream tracker's limits as the untyped read printed them: compact,
    /// keys in order, `null` when absent.
    #[test]
    fn stream_limits_print_as_before() {
        let limits = serde_json::json!({"conns_evicted": 0, "requests_evicted": 1, "conns_forgotten": 2, "conns_peak": 3, "held_peak": 4});
        for file in [serde_json::json!({"stream_limits": limits}), serde_json::json!({})] {
            let r: Report = serde_json::from_value(file.clone()).unwrap();
            assert_eq!(serde_json::to_string(&r.stream_limits).unwrap(), file["stream_limits"].to_string());
        }
    }
}
