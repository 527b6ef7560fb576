//! The per-request verdicts: what each request's window held (waits, files read, the server's
//! own counters, the state at attach), gathered for [`crate::analysis::verdict::attribute`].
//! Three stages: the trace-wide series, once ([`Trace::gather`]); each request's window
//! ([`Builder::window`]); the verdict and what follows from all of them (prompts, warm baseline).
use std::collections::{BTreeMap, HashMap};

use super::{
    build::{Builder, FileKey, at_ms, served_until, ttft_window},
    warm::against_warm,
    *,
};
use crate::{
    analysis::system::{GpuClock, PciState},
    analysis::verdict::{Pressure, SlowCause, Verdict, Window},
    record::samples::{AttachState, EndpointPoll, Kind, ResidencyReading, Sample},
    stream::RequestRecord,
};

/// What every request's verdict reads from the whole trace, gathered once: the samplers'
/// series, the server's answered endpoint polls, the losses, the requests' served spans and the
/// bursts of POSTs in flight together.
struct Trace<'a> {
    offcpu_probe: bool,
    target_pids: Vec<u32>,
    oom_kills: Vec<u64>,
    gpu_clocks: Vec<GpuClock>,
    cpu_clocks: Vec<(u64, f64)>,
    gpu_pci: Vec<PciState>,
    /// (time, events lost so far), from the stats records.
    lost_at: Vec<(u64, u64)>,
    /// Events lost in the whole trace.
    lost: u64,
    power_absent: Option<String>,
    polls: Vec<&'a EndpointPoll>,
    pressure: Vec<Pressure>,
    swaps: Vec<String>,
    server_kind: Option<Kind>,
    residency: Vec<&'a ResidencyReading>,
    attach: Option<&'a AttachState>,
    /// Requests in flight at attach: (id, arrival, last byte), ms from the trace's start.
    in_flight_at_attach: Vec<(u64, f64, f64)>,
    /// The model files' residency at the first reading after attach.
    first_residency: Option<&'a ResidencyReading>,
    /// Each request's served span, by id (see [`served_spans`]).
    spans: Vec<(u64, Option<(u64, u64)>)>,
    bursts: Bursts,
}

impl<'a> Trace<'a> {
    fn gather(b: &'a Builder, r: &Report) -> Self {
        let (start, samples) = (b.start, &b.samples);
        let offcpu_probe = r.probes.iter().any(|p| p.name == crate::record::records::Subsystem::Offcpu && p.live);
        let mut target_pids: Vec<u32> = b.meta.as_ref().map(|m| m.targets.clone()).unwrap_or_default();
        target_pids.extend(b.procs.keys().copied());
        target_pids.push(r.target.pid);
        let oom_kills: Vec<u64> =
            b.mem_events.iter().filter(|m| m.what == probe_common::mem::MEM_OOM_VICTIM).map(|m| m.hdr.ts_ns).collect();
        let (gpu_clocks, cpu_clocks) = crate::analysis::system::clock_series(samples);
        let gpu_pci = crate::analysis::system::pci_series(samples);
        // Losses are counted per second (stats records, cumulative): a window's losses are the
        // growth between the last count before it and the first after it.
        let lost_at: Vec<(u64, u64)> = b.stats.iter().map(|s| (s.ts_ns, s.lost_total())).collect();
        let sys = &r.system;
        let power_absent = (gpu_clocks.is_empty() && cpu_clocks.is_empty()).then(|| {
            let gpu = sys.gpu.absent.clone().unwrap_or_else(|| "GPU clocks not sampled".into());
            let cpu = sys.cpu_freq.absent.clone().unwrap_or_else(|| "CPU frequency not sampled".into());
            format!("{gpu}; {cpu}")
        });
        let polls: Vec<&EndpointPoll> =
            samples.iter().filter_map(|v| if let Sample::Endpoint(e) = v { Some(e) } else { None }).filter(|e| e.answered()).collect();
        let mut pressure: Vec<Pressure> =
            samples.iter().filter_map(|v| if let Sample::Mem(m) = v { Some(Pressure::of(m)) } else { None }).collect();
        pressure.sort_by_key(|p| p.ts_ns);
        let swaps: Vec<String> =
            samples.iter().find_map(|v| if let Sample::Samplers(s) = v { Some(s.swaps.clone()) } else { None }).unwrap_or_default();
        let server_kind = polls.iter().rev().map(|v| v.kind).find(|k| !matches!(k, Kind::Other | Kind::NotHttp));
        let lost: u64 = r.lost_events.values().sum();
        let mut residency: Vec<&ResidencyReading> =
            samples.iter().filter_map(|v| if let Sample::Residency(x) = v { Some(x) } else { None }).collect();
        residency.sort_by_key(|r| r.ts_ns);
        let attach = samples.iter().find_map(|v| if let Sample::Attach(a) = v { Some(a) } else { None });
        // Requests in flight at attach (ms from the trace's start to their last byte), for the
        // ones queued behind them.
        let in_flight_at_attach: Vec<(u64, f64, f64)> = r
            .requests
            .iter()
            .filter(|q| !q.probe_poll)
            .filter_map(|q| Some((q.id, q.arrival_ms?, q.arrival_ms? + q.end_ms.unwrap_or(f64::INFINITY))))
            .filter(|(_, a, e)| *a < 0.0 && *e > 0.0)
            .collect();
        let first_residency = attach.and_then(|a| residency.iter().find(|r| r.ts_ns >= a.ts_ns).or(residency.last()).copied());
        let spans = served_spans(&r.requests, start);
        let bursts = Bursts::of(in_flight_posts(&r.requests, start));
        Trace {
            offcpu_probe,
            target_pids,
            oom_kills,
            gpu_clocks,
            cpu_clocks,
            gpu_pci,
            lost_at,
            lost,
            power_absent,
            polls,
            pressure,
            swaps,
            server_kind,
            residency,
            attach,
            in_flight_at_attach,
            first_residency,
            spans,
            bursts,
        }
    }

    /// Events lost between two times: the growth of the count from the last stats record at or
    /// before `from` to the first at or after `to` (else the last).
    fn lost_between(&self, from: u64, to: u64) -> u64 {
        let before = self.lost_at.iter().rev().find(|(t, _)| *t <= from).map_or(0, |x| x.1);
        let after = self.lost_at.iter().find(|(t, _)| *t >= to).or(self.lost_at.last()).map_or(0, |x| x.1);
        after.saturating_sub(before)
    }

    /// The server said it was sleeping at its last poll at or before `t`.
    fn sleeping_before(&self, t: u64) -> bool {
        self.polls.iter().rev().find(|v| v.ts_ns <= t).is_some_and(|v| v.sleeping() == Some(true))
    }

    /// The most requests the server reported deferred (waiting) from `from` to a second after `to`.
    fn deferred_in(&self, from: u64, to: u64) -> Option<f64> {
        self.polls
            .iter()
            .filter(|v| (from..=to + 1_000_000_000).contains(&v.ts_ns))
            .filter_map(|v| v.metric("llamacpp:requests_deferred").or(v.metric("vllm:num_requests_waiting")))
            .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
    }

    /// vLLM's cumulative counters (summed over their labels): what one grew by from the last
    /// poll at or before `from` to the first at or after `until`. Preemptions while a request
    /// was served; its prefix cache's hits and queries (tokens).
    fn grew(&self, name: &str, from: u64, until: u64) -> Option<f64> {
        let before = self.polls.iter().rev().find(|v| v.ts_ns <= from).and_then(|v| counter_at(v, name))?;
        let after = self.polls.iter().find(|v| v.ts_ns >= until).and_then(|v| counter_at(v, name))?;
        Some((after - before).max(0.0))
    }

    /// What the counters grew by between two polls is this request's burst's (the requests
    /// served overlapping it, and those overlapping them) only when no request outside that
    /// burst was served in the stretch: a poll every 10 s while idle can bracket a whole
    /// earlier burst, whose preemptions and cache hits are not this request's.
    fn bracket_is_own(&self, id: u64, from: u64, until: u64) -> bool {
        let polls = &self.polls;
        let (Some(b), Some(e)) = (polls.iter().rev().find(|v| v.ts_ns <= from), polls.iter().find(|v| v.ts_ns >= until)) else {
            return false;
        };
        let bursts = &self.bursts.spans;
        let own = self.bursts.of.get(&id).copied();
        let (lo, hi) = own.map_or((from, until), |k| (bursts[k].0.min(from), bursts[k].1.max(until)));
        !bursts.iter().enumerate().any(|(k, (s, t))| Some(k) != own && *s < e.ts_ns && *t > b.ts_ns && (*t <= lo || *s >= hi))
    }

    /// Requests the server preempted while request `id` was served.
    fn preempted_in(&self, id: u64, from: u64, until: u64) -> Option<f64> {
        self.grew("vllm:num_preemptions_total", from, until).filter(|_| self.bracket_is_own(id, from, until))
    }

    /// The prefix cache's hits and queries (tokens) while request `id` was served.
    fn prefix_cache_in(&self, id: u64, from: u64, until: u64) -> Option<(f64, f64)> {
        Some((self.grew("vllm:prefix_cache_hits", from, until)?, self.grew("vllm:prefix_cache_queries", from, until)?))
            .filter(|_| self.bracket_is_own(id, from, until))
    }
}

/// A cumulative counter in one poll, summed over its labels (none when the poll has no series
/// of that name).
fn counter_at(v: &EndpointPoll, name: &str) -> Option<f64> {
    let mut it = v.metrics.as_ref()?.iter().filter(|(k, _)| k.starts_with(name)).map(|(_, x)| *x).peekable();
    it.peek()?;
    Some(it.sum())
}

/// When each request was being served: from the start of its prompt processing (its last
/// byte less the server's prompt and generation time) to its last byte. Before that it may
/// have been waiting itself.
fn served_spans(requests: &[Request], start: u64) -> Vec<(u64, Option<(u64, u64)>)> {
    requests
        .iter()
        .map(|q| {
            let t = q.stop.server_timings.as_ref();
            let work = t.and_then(|t| Some(t["prompt_ms"].as_f64()? + t["predicted_ms"].as_f64()?));
            let served = q.arrival_ms.map(|a| {
                let end = q.end_ms.unwrap_or(0.0);
                let begin = a + match work {
                    Some(w) => (end - w).max(0.0),
                    None => q.ttft_ms.unwrap_or(0.0),
                };
                (at_ms(start, begin), at_ms(start, a + q.end_ms.unwrap_or(0.0)))
            });
            (q.id, served)
        })
        .collect()
}

/// The POSTs in flight, by id: arrival to last byte (a request queued behind others is part of
/// their burst before it is served). Requests here are POSTs (a GET of /metrics or /health moves
/// no counter), not probe's own polls.
fn in_flight_posts(requests: &[Request], start: u64) -> Vec<(u64, (u64, u64))> {
    requests
        .iter()
        .filter(|q| q.method.as_deref() == Some("POST") && !q.probe_poll)
        .filter_map(|q| {
            let a = q.arrival_ms?;
            Some((q.id, (at_ms(start, a), at_ms(start, a + q.end_ms.unwrap_or(0.0)))))
        })
        .collect()
}

/// The bursts, once: in-flight spans that overlap merged (sorted by start, a sweep), and each
/// POST's burst. Asked per request, not grown request by request (that was cubic in the
/// requests of a long busy trace).
#[derive(Debug, Default, PartialEq)]
struct Bursts {
    /// The merged spans, in time order.
    spans: Vec<(u64, u64)>,
    /// Each request's burst (an index into `spans`), by id.
    of: HashMap<u64, usize>,
}

impl Bursts {
    fn of(mut spans: Vec<(u64, (u64, u64))>) -> Self {
        spans.sort_by_key(|(_, (s, _))| *s);
        let mut b = Bursts::default();
        for (id, (s, t)) in spans {
            match b.spans.last_mut() {
                Some(x) if s < x.1 => x.1 = x.1.max(t),
                _ => b.spans.push((s, t)),
            }
            b.of.insert(id, b.spans.len() - 1);
        }
        b
    }
}

impl Builder {
    /// Attach a verdict to every request (see crate::analysis::verdict).
    pub(super) fn verdicts(&self, r: &mut Report) {
        if r.requests.is_empty() {
            return;
        }
        let t = Trace::gather(self, r);
        for (i, q) in r.requests.iter_mut().enumerate() {
            let v = match q.arrival_ms {
                Some(a) => self.verdict(&t, q, i, a),
                None => crate::analysis::verdict::attribute(
                    q,
                    &Window {
                        lost_events: t.lost,
                        offcpu_probe: t.offcpu_probe,
                        power_absent: t.power_absent.as_deref(),
                        ..Default::default()
                    },
                ),
            };
            q.verdict = Some(v);
        }
        super::prompt::prompts(&mut r.requests);
        against_warm(&mut r.requests, &self.kept_warm);
    }

    /// The verdict of request `q` (the `i`th, arrived at `a` ms): its window's facts, and the
    /// model files' page-cache residency at the last reading before arrival.
    fn verdict(&self, t: &Trace<'_>, q: &Request, i: usize, a: f64) -> Verdict {
        let from = ttft_window(self.start, a, q).0;
        let mut v = crate::analysis::verdict::attribute(q, &self.window(t, q, i, a));
        let i = t.residency.partition_point(|r| r.ts_ns <= from);
        if let Some(r) = i.checked_sub(1).map(|i| t.residency[i]) {
            v.model_resident = r
                .files
                .iter()
                .map(|f| crate::analysis::verdict::Resident {
                    path: f.path.clone(),
                    share: f.share(),
                    read_ms_before: (from - r.ts_ns) as f64 / 1e6,
                })
                .collect();
        }
        v
    }

    /// The facts of request `q`'s window (the `i`th request, arrived at `a` ms): the trace-wide
    /// series, and what fell between its arrival and its first token or its end.
    fn window<'w>(&'w self, t: &'w Trace<'_>, q: &'w Request, i: usize, a: f64) -> Window<'w> {
        let start = self.start;
        let (from, to) = ttft_window(start, a, q);
        let until = served_until(start, a, q);
        let data = &self.windows[i];
        let mut files_read: Vec<(String, u64, u64)> = data.read.iter().map(|(k, (b, t))| (self.file_name(k), *b, *t)).collect();
        files_read.sort_by_key(|f| std::cmp::Reverse(f.1));
        let offcpu_probe = t.offcpu_probe;
        Window {
            arrival_ns: from,
            io_waits: &self.io_waits,
            mem_waits: &self.mem_waits,
            swap_waits: &self.swap_waits,
            pressure: &t.pressure,
            swaps: &t.swaps,
            cpu_waits: &self.cpu_waits,
            steal_runs: &self.steal_runs,
            other_names: Some(&self.other_names),
            target_pids: &t.target_pids,
            files_read,
            mapped: self.file_maps.iter().filter(|m| m.t >= from && m.t <= to).map(|m| (m.t, self.file_name(&m.key))).collect(),
            others: t.spans.iter().filter(|(id, _)| *id != q.id).filter_map(|(_, s)| *s).collect(),
            lost_events: t.lost_between(from, until),
            offcpu_probe,
            stacks: data.stacks,
            stacks_cut: data.stacks_cut,
            stacks_cut_shallow: data.stacks_cut_shallow,
            cut_reasons: data.cut_reasons,
            oom_kills: &t.oom_kills,
            gpu_clocks: &t.gpu_clocks,
            gpu_pci: &t.gpu_pci,
            cpu_clocks: &t.cpu_clocks,
            power_absent: t.power_absent.as_deref(),
            server_sleeping: t.sleeping_before(from),
            server_deferred: t.deferred_in(from, to),
            server_preemptions: t.preempted_in(q.id, from, until),
            server_prefix_cache: t.prefix_cache_in(q.id, from, until),
            thread_names: Some(&self.thread_names),
            cut_under: self.cut_frames.iter().max_by_key(|f| f.stacks).map(|f| f.name.as_str()),
            path: q.writer_tid.filter(|_| offcpu_probe && !self.threads.is_empty()).map(|tid| self.threads.walk(tid, from, to)),
            engine: q.engine.as_ref(),
            before_attach_ms: (-a).max(0.0),
            at_attach: t.attach.filter(|_| a < 0.0).map(|st| {
                let ahead = t.in_flight_at_attach.iter().filter(|(id, a2, _)| *id != q.id && *a2 < a).count();
                at_attach(st, t.first_residency, q, ahead, &data.read, &self.file_names, t.sleeping_before(from))
            }),
            io_limits: t.attach.map_or(&[], |a| a.io_limits.as_slice()),
            trace_end_ns: self.end_ts,
            server_kind: t.server_kind,
        }
    }

    /// A file's path as the recording named it, else its inode and device.
    fn file_name(&self, k: &FileKey) -> String {
        self.file_names.get(k).cloned().unwrap_or_else(|| format!("<inode {} on {}:{}>", k.2, k.0, k.1))
    }
}

/// What the target was doing at attach, for request `q` that arrived before: its threads'
/// waits, the model's residency, the requests it was queued behind; and the slow cause that
/// state shows (a reload in progress: load; queued behind another request: queue).
fn at_attach(
    st: &crate::record::samples::AttachState,
    residency: Option<&crate::record::samples::ResidencyReading>,
    q: &RequestRecord,
    ahead: usize,
    read: &BTreeMap<FileKey, (u64, u64)>,
    names: &HashMap<FileKey, String>,
    sleeping: bool,
) -> crate::analysis::verdict::AtAttach {
    let mut words = Vec::new();
    let blocked: Vec<&crate::record::samples::ThreadAtAttach> =
        st.threads.iter().filter(|t| t.state == crate::record::samples::ThreadState::DiskSleep).collect();
    // A thread in uninterruptible sleep in the page cache or the block layer waits for a file's
    // pages (a fault or a read); the stack names the wait, the file comes from what was read.
    let file_wait =
        |w: &str| ["folio", "filemap", "page", "read", "io_schedule", "blk", "bio", "throtl", "fault"].iter().any(|k| w.contains(k));
    let on_file = blocked.iter().filter(|t| t.wchan.as_deref().is_some_and(file_wait)).count();
    if !blocked.is_empty() {
        let mut wchans: Vec<&str> = blocked.iter().filter_map(|t| t.wchan.as_deref()).collect();
        wchans.sort_unstable();
        wchans.dedup();
        let what = if on_file > 0 { "blocked waiting for file pages (a fault or read)" } else { "blocked in the kernel" };
        let of = if wchans.is_empty() {
            String::new()
        } else {
            format!(", in {}", wchans.iter().take(3).copied().collect::<Vec<_>>().join(", "))
        };
        words.push(format!("the server was {what}: {} of {} threads in uninterruptible sleep{of}", blocked.len(), st.threads.len()));
    }
    // The model files as resident at the first reading after attach, and read since.
    let mut cold = false;
    for f in residency.map(|r| r.files.as_slice()).unwrap_or_default().iter().take(2) {
        let share = f.share();
        let base = f.path.rsplit('/').next().unwrap_or(&f.path);
        let read_after: u64 = read.iter().filter(|(k, _)| names.get(k).is_some_and(|n| *n == f.path)).map(|(_, (b, _))| *b).sum();
        cold |= share < 0.9 && read_after >= 1 << 20;
        words.push(format!("{base} {:.0}% resident", share * 100.0));
    }
    if let Some(b) = st.read_bytes {
        words.push(format!("it had read {:.1} MB from disk since it started", b as f64 / 1e6));
    }
    if ahead > 0 {
        words.push(format!("{ahead} request(s) that arrived before it were in flight"));
    }
    // Its own processing began after attach, by the server's timings (else unknown).
    let t = q.stop.server_timings.as_ref();
    let work = t.and_then(|t| Some(t["prompt_ms"].as_f64()? + if q.stream == Some(false) { t["predicted_ms"].as_f64()? } else { 0.0 }));
    let began_after_attach = match (work, q.ttft_ms, q.arrival_ms) {
        (Some(w), Some(ttft), Some(a)) => ttft - w > -a,
        _ => true,
    };
    let reload = on_file > 0 || cold || sleeping;
    let cause = if reload {
        Some(SlowCause::Load)
    } else if ahead > 0 && began_after_attach {
        Some(SlowCause::Queue)
    } else {
        None
    };
    crate::analysis::verdict::AtAttach { words: if words.is_empty() { "nothing was blocked".into() } else { words.join("; ") }, cause }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// POSTs in flight together are one burst (overlapping spans merge, transitively); one that
    /// starts as the last ends begins another.
    #[test]
    fn overlapping_posts_are_one_burst() {
        let b = Bursts::of(vec![(3, (50, 60)), (1, (0, 10)), (2, (5, 20)), (4, (20, 30))]);
        assert_eq!(b.spans, vec![(0, 20), (20, 30), (50, 60)]);
        assert_eq!([b.of[&1], b.of[&2], b.of[&4], b.of[&3]], [0, 0, 1, 2]);
    }
}
