//! A recording kept as a window of segment files (`probe watch`): what a trace session tells
//! whoever keeps the window (finished requests, closed segments, its end) and when it closes a
//! segment. Below both the collector and the watcher.
use std::{
    path::PathBuf,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::Duration,
};

use crate::stream::RequestRecord;

/// A segment file of the live window: `segment-000042.bin`.
pub fn segment_name(n: u64) -> String {
    format!("segment-{n:06}.bin")
}

/// A closed segment: its file and the time it covers (ms after the session's start).
#[derive(Clone, Debug)]
pub struct Segment {
    pub path: PathBuf,
    pub from_ms: f64,
    pub to_ms: f64,
    pub bytes: u64,
}

/// What a trace session tells the watcher.
pub enum Msg {
    /// A request finished (its record was written to the current segment).
    Request(Box<RequestRecord>),
    /// A sampler's record the metrics show (model-file residency, the server's own endpoints).
    Sample(Box<crate::record::samples::Sample>),
    /// A segment was closed: it is whole on disk, and the watcher owns it now.
    Segment(Segment),
    /// The session ended (after its last segment).
    Ended { reason: String, target_exited: bool, lost: u64 },
}

/// When a segment is closed: this old, this big, or at once when the watcher asks (an incident
/// waits for the segment that holds its request's end).
pub struct Rotation {
    pub every: Duration,
    pub max_bytes: u64,
}

/// The session's side of the watcher: a channel, the rotation rule and where the cost figures
/// go.
pub struct Link {
    tx: Mutex<mpsc::Sender<Msg>>,
    rotate_now: AtomicBool,
    rotation: Rotation,
    on_cost: Box<dyn Fn(u64, u64) + Send + Sync>,
}

impl Link {
    /// `on_cost(lost events, BPF run ns)` gets the session's cumulative figures.
    pub fn new(tx: mpsc::Sender<Msg>, rotation: Rotation, on_cost: Box<dyn Fn(u64, u64) + Send + Sync>) -> Link {
        Link { tx: Mutex::new(tx), rotate_now: AtomicBool::new(false), rotation, on_cost }
    }

    pub fn send(&self, m: Msg) {
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(m);
        }
    }

    /// Close the current segment at the next chance.
    pub fn rotate_soon(&self) {
        self.rotate_now.store(true, Ordering::Relaxed);
    }

    pub fn rotate_due(&self, age: Duration, bytes: u64) -> bool {
        self.rotate_now.swap(false, Ordering::Relaxed) || age >= self.rotation.every || bytes >= self.rotation.max_bytes
    }

    /// The cumulative events lost and BPF run time, for the metrics.
    pub fn set_cost(&self, lost: u64, runs: &std::collections::BTreeMap<String, crate::kernel::probes::ProgRuns>) {
        (self.on_cost)(lost, runs.values().map(|r| r.run_ns).sum());
    }
}
