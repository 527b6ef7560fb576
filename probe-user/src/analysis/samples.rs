//! The distinct stack samples of a recording per kind, with their labels (pid, thread, wait
//! class, the requests in flight), gathered in the analysis' second pass for the pprof profiles
//! (`render::export::pprof` encodes them).
use std::collections::{BTreeMap, HashMap};

use crate::{analysis::flame::Kind, record::StackRecord};

/// A distinct sample: its stack (leaf first: kernel frames, then user frames) and labels.
#[derive(Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub(crate) pid: u32,
    pub(crate) tid: u32,
    pub(crate) wait: &'static str,
    pub(crate) requests: Vec<u64>,
    pub(crate) user: Vec<(i64, u64)>,
    pub(crate) kernel: Vec<u64>,
}

/// The request windows of a report on the recording's clock: (from_ns, to_ns, id).
fn request_windows(requests: &[crate::analysis::report::Request], start_ns: u64) -> Vec<(u64, u64, u64)> {
    requests
        .iter()
        .filter_map(|q| {
            let a = start_ns + (q.arrival_ms? * 1e6) as u64;
            let e = a + (q.end_ms.or(q.closed_ms).unwrap_or(0.0) * 1e6) as u64;
            Some((a, e.max(a), q.id))
        })
        .collect()
}

/// The most `request` labels on one sample (requests in flight at once beyond it are left out).
const MAX_REQUEST_LABELS: usize = 64;

/// The ids of the requests in flight at `ts`.
fn in_flight(windows: &[(u64, u64, u64)], ts: u64) -> Vec<u64> {
    windows.iter().filter(|(a, e, _)| *a <= ts && ts <= *e).map(|w| w.2).take(MAX_REQUEST_LABELS).collect()
}

/// The distinct samples of a recording per kind, with their labels, gathered while the stacks
/// stream past (crate::analysis's second pass): memory grows with distinct stacks and label
/// sets, not with samples.
#[derive(Default)]
pub struct Samples {
    pub(crate) windows: Vec<(u64, u64, u64)>,
    pub(crate) raw: BTreeMap<Kind, HashMap<Key, (u64, u64)>>,
    pub(crate) first_ns: u64,
    pub(crate) last_ns: u64,
}

impl Samples {
    /// For a recording whose requests (report.json's) are `requests`, on the clock from `start_ns`.
    pub fn new(requests: &[crate::analysis::report::Request], start_ns: u64) -> Samples {
        Samples { windows: request_windows(requests, start_ns), raw: BTreeMap::new(), first_ns: u64::MAX, last_ns: 0 }
    }

    pub fn add(&mut self, s: &StackRecord, names: &crate::analysis::ksyms::Names) {
        let Some(kind) = Kind::ALL.into_iter().find(|k| k.what() == s.what) else { return };
        let value = match kind {
            Kind::Offcpu => s.blocked_ns.unwrap_or(0),
            _ => 1,
        };
        if value == 0 {
            return;
        }
        self.first_ns = self.first_ns.min(s.ts_ns);
        self.last_ns = self.last_ns.max(s.ts_ns);
        let key = Key {
            pid: s.pid,
            tid: s.tid,
            wait: if kind == Kind::Offcpu { names.wait_of_stack(s) } else { "" },
            requests: in_flight(&self.windows, s.ts_ns),
            user: s.user.clone(),
            kernel: s.kernel.clone(),
        };
        let e = self.raw.entry(kind).or_default().entry(key).or_default();
        e.0 += 1;
        e.1 += value;
    }

    /// Kinds that have samples.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }
}
