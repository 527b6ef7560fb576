//! The collector's counters: the kernel's per-CPU counts summed, probe's own CPU time and its
//! programs' run time, and the stats record made of them.
use aya::maps::{MapData, PerCpuArray};
use probe_common::{Counter, EventKind};

use super::State;
use crate::{
    kernel::probes,
    monotonic_ns,
    record::{
        self,
        records::{self, UserRecord},
    },
};

/// The per-CPU counts of `map`, summed over the CPUs, one per event kind.
pub(super) fn sum(map: &PerCpuArray<MapData, u64>) -> Vec<u64> {
    (0..probe_common::MAX_KINDS).map(|i| map.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0)).collect()
}

/// probe's own CPU time so far (user + system, every thread, ended ones included), ns.
pub fn own_cpu_ns() -> u64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a local.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The `cost` of a stats record: probe's CPU and its programs' runs, cumulative.
fn cost(runs: &std::collections::BTreeMap<String, probes::ProgRuns>, bpf_unmeasured: Option<&str>) -> record::records::Cost {
    record::records::Cost {
        cpu_ns: own_cpu_ns(),
        bpf: runs.iter().map(|(k, r)| (k.clone(), record::records::ProgCost { runs: r.runs, ns: r.run_ns })).collect(),
        bpf_unmeasured: bpf_unmeasured.map(str::to_string),
    }
}

pub(super) fn stats(
    lost: &[u64],
    counters: &[u64],
    st: &State,
    runs: &std::collections::BTreeMap<String, probes::ProgRuns>,
    bpf_unmeasured: Option<&str>,
) -> UserRecord {
    let by_kind = |n: &[u64]| EventKind::ALL.iter().map(|k| (k.name().to_string(), n[*k as usize])).collect();
    let mut lost: std::collections::BTreeMap<String, u64> = by_kind(lost);
    // Records the writer did not write count as lost too (every report shows them).
    let d = st.writer.dropped;
    for (name, n) in [("oversized_record", d.oversized), ("disk_full", d.disk_full)] {
        if n > 0 {
            lost.insert(name.into(), n);
        }
    }
    let u = &st.unwinders;
    UserRecord::Stats(Box::new(records::Stats {
        ts_ns: monotonic_ns(),
        lost,
        counters: Counter::ALL.iter().map(|c| (c.name().to_string(), counters[*c as usize])).collect(),
        events: by_kind(&st.per_kind),
        skipped_runs: probes::skipped_runs(runs),
        unwind: records::UnwindCounters {
            samples: u.samples,
            complete: u.complete,
            ns: u.nanos,
            load_ns: u.load_nanos,
            reused: u.reused,
            left_out: u.left_out,
            held_bytes: u.held_bytes(),
        },
        streams: Some(st.streams.limits().clone()),
        cost: Some(cost(runs, bpf_unmeasured)),
        python: st.python.any_seen().then(|| records::PythonStats {
            merged: st.python.merged,
            unnamed: st.python.unnamed,
            work_ns: st.python.work_ns,
            off: st.python.off.clone(),
        }),
    }))
}
