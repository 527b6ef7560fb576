//! What is wrong with a recording, found by the reader or the analysis: one closed set, said in
//! report.json (and every output) as its sentence. A report.json read back keeps each sentence
//! as [`Problem::Said`].
use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub enum Problem {
    /// The file ends inside a frame; `ignored`: the bytes after `at`.
    TornTail {
        at: u64,
        ignored: Option<u64>,
    },
    /// A frame's header is not a frame probe writes.
    CorruptFrame {
        at: u64,
        ty: u32,
        len: u64,
        ignored: Option<u64>,
    },
    /// Kernel records whose kind this version does not know.
    Undecodable(u64),
    /// A record of a known type that did not parse.
    RecordUnreadable {
        ty: String,
        error: String,
    },
    /// Stack records that did not parse.
    BadStacks(u64),
    NoMeta,
    NoEnd,
    /// The timeline keeps the tail of a long recording.
    LongRecording {
        events: usize,
        stacks: usize,
        events_before: u64,
        stacks_before: u64,
    },
    /// Python frames turned off past their budget, in the collector's words.
    PythonOff(String),
    LostEvents(u64),
    /// Stack records whose user stack the kernel cut short to keep the filling ring's room.
    TrimmedStacks(u64),
    ConnsEvicted {
        conns: u64,
        requests: u64,
    },
    /// Program runs the kernel skipped (recursion), in total and per program.
    SkippedRuns {
        total: u64,
        per: Vec<(String, u64)>,
    },
    /// A sentence read back from a report.json.
    Said(String),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::TornTail { at, ignored } => {
                write!(f, "recording ends mid-record at byte {at} (probe was killed or the disk filled)")?;
                ignored.map_or(Ok(()), |n| write!(f, ": the last {n} bytes were ignored"))
            }
            Problem::CorruptFrame { at, ty, len, ignored } => {
                write!(f, "corrupt frame at byte {at} (type {ty}, length {len})")?;
                ignored.map_or(Ok(()), |n| write!(f, ": the {n} bytes after it were ignored"))
            }
            Problem::Undecodable(n) => write!(f, "{n} records could not be decoded and were skipped"),
            Problem::RecordUnreadable { ty, error } => write!(f, "a {ty} record could not be read: {error}"),
            Problem::BadStacks(n) => write!(f, "{n} stack records could not be read and were skipped"),
            Problem::NoMeta => f.write_str("the recording has no meta record: target details are unknown"),
            Problem::NoEnd => {
                f.write_str("the recording has no end record: probe did not stop cleanly (killed?); the report covers what was written")
            }
            Problem::LongRecording { events, stacks, events_before, stacks_before } => write!(
                f,
                "a long recording: its timeline shows the last {events} kernel events and {stacks} stack samples ({events_before} and {stacks_before} before them are in the report's counts and the flamegraphs)"
            ),
            Problem::PythonOff(why) | Problem::Said(why) => f.write_str(why),
            Problem::LostEvents(n) => {
                write!(f, "{n} events were lost (ring buffer full): counts below are lower bounds; retry with a larger --ring-mb")
            }
            Problem::TrimmedStacks(n) => write!(
                f,
                "{n} stack samples were cut short (the ring buffer was over {}% full: probe's drain was behind, every CPU busy); their flamegraph frames stop early, no event was lost for them; a larger --ring-mb keeps them whole",
                probe_common::stack::TRIM_AT * 100 / 8
            ),
            Problem::ConnsEvicted { conns, requests } => write!(
                f,
                "probe stopped following {conns} connections to stay bounded (more than {} at once, over {} MiB of buffered bytes, or over {} pipelined requests); {requests} requests in flight on them are marked evicted",
                crate::stream::MAX_CONNS,
                crate::stream::MAX_HELD >> 20,
                crate::stream::MAX_PENDING,
            ),
            Problem::SkippedRuns { total, per } => {
                let per: Vec<String> = per.iter().map(|(k, n)| format!("{k} {n}")).collect();
                write!(
                    f,
                    "the kernel skipped {total} program runs because another BPF program was already running on that CPU ({}): those events were never made; other BPF tools running at the same time make this likelier",
                    per.join(", ")
                )
            }
        }
    }
}

impl serde::Serialize for Problem {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Problem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Problem::Said)
    }
}

#[cfg(test)]
mod tests {
    use super::Problem;

    /// Each problem says its sentence, in report.json too, and reads back as it was said.
    #[test]
    fn a_problem_is_its_sentence() {
        let p = Problem::TornTail { at: 10, ignored: Some(6) };
        assert_eq!(
            p.to_string(),
            "recording ends mid-record at byte 10 (probe was killed or the disk filled): the last 6 bytes were ignored"
        );
        let json = serde_json::to_string(&vec![p.clone(), Problem::LostEvents(3)]).unwrap();
        assert!(json.starts_with("[\"recording ends mid-record") && json.contains("3 events were lost"), "{json}");
        let back: Vec<Problem> = serde_json::from_str(&json).unwrap();
        assert_eq!(back[0].to_string(), p.to_string());
        let per = Problem::SkippedRuns { total: 3, per: vec![("a".into(), 1), ("b".into(), 2)] };
        assert!(per.to_string().contains("(a 1, b 2)"), "{per}");
    }
}
