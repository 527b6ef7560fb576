//! Building the [`Report`]: two passes over a recording (the userspace records and file
//! mappings, then the kernel records in time order), keeping aggregates and what the verdicts
//! need, not the events. The builder's state and its passes are here; the file and IO tables
//! (`files`), the per-request verdicts (`verdicts`), the warm baseline (`warm`), the closes of the
//! connections table (`sock`) and the reordering of kernel records (`reorder`) are beside it.
use std::collections::{BTreeMap, HashMap};

/// `crate::analysis::report::build::prompt_size` (the warm baseline's, in `warm`) stays a path.
pub(crate) use super::warm::prompt_size;
use super::{
    files::{FileMap, MapHistory, folio_bytes, kdev},
    sock::closes_after_the_response,
    *,
};
use crate::{
    analysis::ksyms::Wait,
    record::decode::Event,
    record::{
        Recording, StackKind, StackRecord,
        problem::Problem,
        records::{Meta, Stats, UserRecord},
        samples::Sample,
    },
    stream::{RequestRecord, Role},
};
use probe_common::{
    fault::FAULT_MAJOR,
    mmap::MmapOp,
    proc::{PROC_EXEC, PROC_EXIT, PROC_FORK},
};

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    // To the nanosecond (values are µs).
    let at = |p: f64| (crate::util::stats::percentile_sorted(&v, p).unwrap_or(0.0) * 1e3).round() / 1e3;
    Percentiles { count: v.len() as u64, p50: at(50.0), p90: at(90.0), p99: at(99.0), max: v[v.len() - 1] }
}

/// A file by (major, minor, inode).
pub(super) type FileKey = (u32, u32, u64);

/// Fills older than this (by the time of the event being read) cannot be the cause of a block
/// read any more: forgotten, so memory does not grow with the trace.
const FILL_MEMORY_NS: u64 = 10_000_000_000;

/// Which requests' windows cover a time: the windows cut the timeline into segments, each with
/// the requests that cover it; a lookup is one binary search.
pub(crate) struct WindowIndex {
    bounds: Vec<u64>,
    covering: Vec<Vec<usize>>,
}

impl WindowIndex {
    pub(crate) fn new(windows: &[Option<(u64, u64)>]) -> Self {
        let mut bounds: Vec<u64> = windows.iter().flatten().flat_map(|&(a, b)| [a, b.saturating_add(1)]).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let covering = bounds
            .iter()
            .map(|&t| windows.iter().enumerate().filter(|(_, w)| w.is_some_and(|(a, b)| a <= t && t <= b)).map(|(i, _)| i).collect())
            .collect();
        WindowIndex { bounds, covering }
    }

    /// The windows `[from, to]` (inclusive) that contain `t`.
    pub(crate) fn at(&self, t: u64) -> &[usize] {
        match self.bounds.partition_point(|&b| b <= t).checked_sub(1) {
            Some(i) => &self.covering[i],
            None => &[],
        }
    }
}

/// What each request's verdict needs from the events inside its window, gathered while the
/// events stream past.
#[derive(Default, Clone)]
pub(super) struct WindowData {
    /// Bytes each file added to the page cache before the first token, and when it started.
    pub(super) read: BTreeMap<FileKey, (u64, u64)>,
    pub(super) stacks: u64,
    pub(super) stacks_cut: u64,
    /// Of those cut, the ones cut within `verdict::DEEP_ENOUGH` user frames, and why each cut
    /// stack stopped (by `Cut::ALL`).
    pub(super) stacks_cut_shallow: u64,
    pub(super) cut_reasons: [u64; 3],
}

/// The analysis, built in two passes over a recording so that memory grows with requests,
/// files, threads and connections, not with events. Pass 1 reads the userspace records (and the
/// file mappings); pass 2 reads the kernel records in time order.
pub(crate) struct Builder {
    pub(super) r: Report,
    pub(super) meta: Option<Meta>,
    /// The `stats` records, one a second.
    pub(super) stats: Vec<Stats>,
    pub(super) start: u64,
    pub(super) page_size: u64,
    pub(super) end_ts: u64,
    pub(super) dev_names: HashMap<String, String>,
    /// Userspace records the system section and verdicts read (samples, polls, stats, meta);
    /// stack records are not kept (counted here, revisited in pass 2).
    pub(super) samples: Vec<Sample>,
    pub(super) maps: MapHistory,
    pub(super) depths: BTreeMap<String, (u64, u64, BTreeMap<u64, u64>)>,
    /// Per kind of stack: why the cut ones stopped.
    pub(super) cuts: BTreeMap<String, BTreeMap<crate::record::Cut, u64>>,
    pub(super) file_names: HashMap<FileKey, String>,
    pub(super) mmap_names: HashMap<FileKey, String>,
    pub(super) names: crate::analysis::ksyms::NamesBuilder,
    pub(super) knames: crate::analysis::ksyms::Names,
    pub(super) has_end: bool,
    /// Stack records that could not be read.
    pub(super) bad_stacks: u64,
    // File mappings as the mmap probe saw them (named in the kernel, exact in time), and the
    // unmaps that cut into one of them.
    pub(super) file_maps: Vec<FileMap>,
    pub(super) unmaps: Vec<FileMap>,
    pub(super) by_pid: HashMap<u32, Vec<(usize, Vec<usize>)>>,
    // Pass 2.
    pub(super) files: HashMap<FileKey, FileStat>,
    pub(super) fills_by_tid: HashMap<u32, std::collections::VecDeque<(u64, FileKey)>>,
    pub(super) procs: BTreeMap<u32, Process>,
    pub(super) mem_events: Vec<probe_common::mem::MemEvent>,
    /// The engine probe's steps and cache events.
    pub(super) engine: crate::analysis::steps::Log,
    pub(super) conns: Vec<(u64, Connection, bool)>,
    pub(super) conn_index: HashMap<u64, usize>,
    pub(super) devs: BTreeMap<u32, (Device, Vec<f64>, Vec<f64>)>,
    pub(super) io_waits: Vec<(u64, u64)>,
    pub(super) mem_waits: Vec<(u64, u64)>,
    /// Off-CPU intervals faulting memory back in from swap.
    pub(super) swap_waits: Vec<(u64, u64)>,
    /// The on-CPU sampling period (1 / --hz), ns.
    pub(super) cpu_period_ns: u64,
    /// Run-queue waits of target threads (preempted, runnable): (from, to, what ran instead).
    pub(super) cpu_waits: Vec<crate::analysis::verdict::CpuWait>,
    /// The hypervisor's steal while target threads ran (SCHED_STEAL records), sorted by end.
    pub(super) steal_runs: Vec<crate::analysis::verdict::StealRun>,
    /// Other processes by pid: (comm, cgroup), from the `procs` records.
    pub(super) other_names: HashMap<u32, (String, Option<String>)>,
    /// Each target thread's off-CPU intervals, for the requests' critical paths, and names.
    pub(super) threads: crate::analysis::critical::Threads,
    pub(super) thread_names: HashMap<u32, String>,
    /// Python frames' names by id (the `pyframes` records), for where waits were.
    pub(super) py_frames: HashMap<u64, String>,
    /// Warm requests of earlier sessions (`probe watch`'s baseline).
    pub(super) kept_warm: Vec<crate::record::records::Warm>,
    /// Where cut user stacks stop, as the trace named it.
    pub(super) cut_frames: Vec<crate::record::records::CutFrame>,
    pub(super) ttft_windows: WindowIndex,
    pub(super) served_windows: WindowIndex,
    pub(super) windows: Vec<WindowData>,
}

impl Builder {
    pub(crate) fn new() -> Self {
        Builder {
            r: Report::default(),
            meta: None,
            stats: vec![],
            start: 0,
            page_size: 4096,
            end_ts: 0,
            dev_names: HashMap::new(),
            samples: vec![],
            maps: MapHistory::default(),
            depths: BTreeMap::new(),
            cuts: BTreeMap::new(),
            file_names: HashMap::new(),
            mmap_names: HashMap::new(),
            names: Default::default(),
            knames: Default::default(),
            has_end: false,
            bad_stacks: 0,
            file_maps: vec![],
            unmaps: vec![],
            by_pid: HashMap::new(),
            files: HashMap::new(),
            fills_by_tid: HashMap::new(),
            procs: BTreeMap::new(),
            mem_events: vec![],
            engine: Default::default(),
            conns: vec![],
            conn_index: HashMap::new(),
            devs: BTreeMap::new(),
            io_waits: vec![],
            mem_waits: vec![],
            swap_waits: vec![],
            cpu_period_ns: 0,
            cpu_waits: vec![],
            steal_runs: vec![],
            other_names: HashMap::new(),
            threads: Default::default(),
            thread_names: HashMap::new(),
            py_frames: HashMap::new(),
            kept_warm: vec![],
            cut_frames: vec![],
            ttft_windows: WindowIndex::new(&[]),
            served_windows: WindowIndex::new(&[]),
            windows: vec![],
        }
    }

    /// Pass 1: one userspace record, or why it could not be read.
    pub(crate) fn user(&mut self, rec: Result<UserRecord, (crate::record::records::RecordType, String)>) {
        let rec = match rec {
            Ok(rec) => rec,
            Err((crate::record::records::RecordType::Stack, _)) => {
                self.bad_stacks += 1;
                return;
            }
            Err((ty, e)) => {
                self.r.problems.push(Problem::RecordUnreadable { ty: ty.to_string(), error: e.to_string() });
                return;
            }
        };
        let r = &mut self.r;
        self.end_ts = self.end_ts.max(rec.ts_ns().unwrap_or(0));
        match rec {
            UserRecord::Meta(m) if self.meta.is_none() => self.meta = Some(*m),
            UserRecord::Threads(t) => {
                for (_, tid, name) in t.threads {
                    self.thread_names.insert(tid, name);
                }
            }
            UserRecord::WarmBaseline(w) => self.kept_warm = w.warm,
            UserRecord::CutFrames(c) => self.cut_frames = c.frames,
            UserRecord::Meta(_) | UserRecord::Module(_) => {}
            UserRecord::Procs(p) => {
                for o in p.procs {
                    self.other_names.entry(o.pid).or_insert((o.comm, o.cgroup));
                }
            }
            UserRecord::Maps(m) => {
                for f in &m.mappings {
                    self.file_names.entry((f.major, f.minor, f.inode)).or_insert_with(|| f.path.clone());
                }
                self.maps.by_pid.entry(m.pid).or_default().push((m.ts_ns, m.mappings));
            }
            UserRecord::Files(f) => {
                for f in f.files {
                    self.file_names.entry((f.major, f.minor, f.inode)).or_insert(f.path);
                }
            }
            UserRecord::Ksyms(k) => self.names.feed_ksyms(&k),
            UserRecord::PyFrames(p) => self.py_frames.extend(p.frames),
            UserRecord::Stack(s) => self.stack_seen(&s),
            UserRecord::Stats(s) => {
                let u = &s.unwind;
                r.unwind.samples = u.samples;
                r.unwind.complete = u.complete;
                r.unwind.reused = u.reused;
                r.unwind.left_out_modules = u.left_out;
                r.unwind.held_bytes = u.held_bytes;
                if u.samples > 0 {
                    r.unwind.success_rate = u.complete as f64 / u.samples as f64;
                    r.unwind.us_per_sample = u.ns as f64 / 1e3 / u.samples as f64;
                }
                r.unwind.load_ms = u.load_ns as f64 / 1e6;
                r.lost_events = s.lost.clone();
                r.events_received = s.events.values().sum();
                r.counters = s.counters.clone();
                r.skipped_runs = s.skipped_runs.clone();
                r.stream_limits = s.streams.clone();
                r.python = s.python.clone();
                self.stats.push(*s);
            }
            UserRecord::End(e) => {
                self.has_end = true;
                r.target.end_reason = Some(e.reason);
            }
            // A snapshot taken in flight is replaced by the request's later record (see prepare).
            UserRecord::Request(q) => r.requests.push(Request { record: *q, verdict: None, engine: None }),
            UserRecord::Sample(v) => self.samples.push(*v),
            UserRecord::Other(_) => {}
        }
    }

    /// Pass 1: a stack record: counts and depths per kind.
    pub(crate) fn stack_seen(&mut self, s: &StackRecord) {
        self.end_ts = self.end_ts.max(s.ts_ns);
        self.names.feed_stack(s);
        let e = self.depths.entry(s.what.name().to_string()).or_default();
        e.0 += 1;
        e.1 += u64::from(s.complete);
        *e.2.entry((s.user_depth() + s.kernel.len()) as u64).or_default() += 1;
        if let Some(c) = s.cut {
            *self.cuts.entry(s.what.name().to_string()).or_default().entry(c).or_default() += 1;
        }
    }

    /// Between the passes: the target, the requests and their windows.
    pub(crate) fn prepare(&mut self) {
        for (k, n) in std::mem::take(&mut self.mmap_names) {
            self.file_names.entry(k).or_insert(n);
        }
        let r = &mut self.r;
        if self.meta.is_none() {
            r.problems.push(Problem::NoMeta);
        }
        let meta = self.meta.clone().unwrap_or_default();
        self.start = meta.start_ns;
        self.end_ts = self.end_ts.max(self.start);
        // Meta::default() has no page size; a recording without meta has 4 KiB pages.
        self.page_size = self.meta.as_ref().map_or(4096, |m| m.page_size);
        self.cpu_period_ns = 1_000_000_000u64.checked_div(meta.cpu_hz).unwrap_or(0);
        r.target.pid = meta.pid;
        r.target.comm = meta.comm.clone();
        r.target.cmdline = meta.cmdline.clone();
        r.probes = meta.probes.clone();
        if meta.armed_ms > 0.0 {
            r.armed = Some(Armed { ms: meta.armed_ms, stages: meta.arm_stages.clone() });
        }
        self.dev_names = meta.block_devices.clone().into_iter().collect();
        for &pid in &meta.targets {
            let comm = if pid == r.target.pid { r.target.comm.clone() } else { String::new() };
            self.procs.insert(pid, Process { pid, comm, ..Default::default() });
        }
        for (what, (n, complete, hist)) in std::mem::take(&mut self.depths) {
            let depths: Vec<f64> = hist.iter().flat_map(|(&d, &k)| std::iter::repeat_n(d as f64, k as usize)).collect();
            let median = crate::util::stats::percentile(&depths, 50.0).unwrap_or(0.0).round() as u64;
            let cut = self.cuts.remove(&what).unwrap_or_default();
            let cut_under = self
                .cut_frames
                .iter()
                .filter(|f| f.kind == what)
                .map(|f| super::CutUnder { frame: f.name.clone(), stacks: f.stacks })
                .collect();
            r.stacks.insert(what, StackStats { stacks: n, complete, median_depth: median, cut, cut_under });
        }
        for snaps in self.maps.by_pid.values_mut() {
            snaps.sort_by_key(|(t, _)| *t);
        }
        if self.bad_stacks > 0 {
            r.problems.push(Problem::BadStacks(self.bad_stacks));
        }
        if !self.has_end {
            r.problems.push(Problem::NoEnd);
        }
        // probe's own polls of the server's endpoints are not the server's traffic.
        let polls = crate::analysis::system::poll_ports(&self.samples);
        let port_of = |a: &str| a.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
        let ours = |peer: &str, local: &str, role: Role| {
            let p = if role == Role::Client { port_of(local) } else { port_of(peer) };
            p.is_some_and(|p| polls.contains(&p))
        };
        // A snapshot taken while a request was in flight gives way to its later record; one
        // without a later record stays: the recording was cut while it was in flight.
        let last: HashMap<(u32, u64), usize> = r.requests.iter().enumerate().map(|(i, q)| ((q.pid, q.id), i)).collect();
        let mut i = 0;
        r.requests.retain(|q| {
            i += 1;
            last.get(&(q.pid, q.id)) == Some(&(i - 1))
        });
        let before = r.requests.len();
        // A poll's head says so (User-Agent); its port is the only sign when the head was not seen.
        // Ports are reused: a client's request with a parsed head is never matched by port.
        let poll = |q: &Request| q.probe_poll || (q.method.is_none() && ours(&q.peer, &q.local, q.role));
        r.requests.retain(|q| !poll(q));
        r.probe_polls = (before - r.requests.len()) as u64;
        r.requests.sort_by(|a, b| a.arrival_ms.unwrap_or(f64::MIN).total_cmp(&b.arrival_ms.unwrap_or(f64::MIN)).then(a.id.cmp(&b.id)));
        let start = self.start;
        let ttft: Vec<Option<(u64, u64)>> = r.requests.iter().map(|q| q.arrival_ms.map(|a| ttft_window(start, a, q))).collect();
        let served: Vec<Option<(u64, u64)>> =
            r.requests.iter().map(|q| q.arrival_ms.map(|a| (at_ms(start, a), served_until(start, a, q)))).collect();
        self.ttft_windows = WindowIndex::new(&ttft);
        self.served_windows = WindowIndex::new(&served);
        self.windows = vec![WindowData::default(); r.requests.len()];
        self.knames = std::mem::take(&mut self.names).finish();
    }

    /// Pass 2: a stack record (for the windows it falls in, and off-CPU waits).
    pub(crate) fn stack(&mut self, s: &StackRecord) {
        let ts = s.ts_ns;
        for &i in self.served_windows.at(ts) {
            self.windows[i].stacks += 1;
            let w = &mut self.windows[i];
            w.stacks_cut += u64::from(!s.complete);
            w.stacks_cut_shallow += u64::from(!s.complete && s.user_depth() < crate::analysis::verdict::DEEP_ENOUGH);
            if let Some(c) = s.cut {
                w.cut_reasons[crate::record::Cut::ALL.iter().position(|&x| x == c).unwrap_or(0)] += 1;
            }
        }
        // An on-CPU sample in the kernel's swap-in path: the thread was faulting memory back in
        // from swap, on the CPU (reading the swap entry, allocating and charging the page,
        // mapping it), the part of a swap-in its off-CPU waits do not hold. The sample stands
        // for one sampling period of the thread's time before it (perf's frequency estimate).
        // Reclaim on the CPU is already timed by its tracepoints (direct and cgroup reclaim).
        if s.what == StackKind::Cpu && self.cpu_period_ns > 0 && !s.kernel.is_empty() && self.knames.wait_kind_of_stack(s) == Wait::Swap {
            let from = ts.saturating_sub(self.cpu_period_ns);
            self.swap_waits.push((from, ts));
            self.threads.memory_on_cpu(s.tid, from, ts);
        }
        if s.what == StackKind::Offcpu {
            let Some(b) = s.blocked_ns else { return };
            let wait = self.knames.wait_kind_of_stack(s);
            let site = self.threads.site(&wait_site(wait.name(), &s.user, &self.py_frames));
            self.threads.blocked(s.tid, ts, ts.saturating_add(b), crate::analysis::critical::Class::of(wait), s.waker, Some(site));
            match wait {
                Wait::Io | Wait::PageFault => self.io_waits.push((ts, ts + b)),
                Wait::Memory => self.mem_waits.push((ts, ts + b)),
                Wait::Swap => self.swap_waits.push((ts, ts + b)),
                _ => {}
            }
        }
    }

    /// The kernel's names (after [`Builder::prepare`]): one table for the report and the flamegraphs.
    pub(crate) fn kernel_names(&self) -> &crate::analysis::ksyms::Names {
        &self.knames
    }

    /// The report's requests (after [`Builder::prepare`]: probe's polls left out, in arrival order).
    pub(crate) fn requests(&self) -> &[Request] {
        &self.r.requests
    }

    /// The recording's meta record, when it has one.
    pub(crate) fn meta(&self) -> Option<&Meta> {
        self.meta.as_ref()
    }

    /// Pass 2: one kernel record, in time order.
    pub(crate) fn kernel(&mut self, ev: &Event) {
        let start = self.start;
        let ms = |ts: u64| (ts.saturating_sub(start)) as f64 / 1e6;
        self.r.events += 1;
        self.end_ts = self.end_ts.max(ev.header().ts_ns);
        match ev {
            Event::Fault(f) if f.flags & FAULT_MAJOR != 0 => {
                self.r.faults.major += 1;
                match self.resolve(f.hdr.pid, f.hdr.ts_ns, f.addr) {
                    Some(key) => self.file_of(key).major_faults += 1,
                    None => self.r.faults.major_unresolved += 1,
                }
            }
            Event::Fault(_) => {}
            Event::Filemap(f) => {
                let (ma, mi) = kdev(f.dev);
                let key = (ma, mi, f.ino);
                let (t, bytes) = (f.hdr.ts_ns, folio_bytes(self.page_size, f.order));
                let file = self.file_of(key);
                file.read_bytes = file.read_bytes.saturating_add(bytes);
                for &i in self.ttft_windows.at(t) {
                    let e = self.windows[i].read.entry(key).or_insert((0, t));
                    e.0 = e.0.saturating_add(bytes);
                    e.1 = e.1.min(t);
                }
                let fills = self.fills_by_tid.entry(f.hdr.tid).or_default();
                while fills.front().is_some_and(|(old, _)| old.saturating_add(FILL_MEMORY_NS) < t) {
                    fills.pop_front();
                }
                fills.push_back((t, key));
            }
            Event::BlockIo(b) => self.block(b),
            Event::Mmap(m) => {
                let op = MmapCall(m.op);
                *self.r.mmap_counts.entry(op.name().into_owned()).or_default() += 1;
                if self.r.mmaps.len() >= MAX_MMAP_ROWS {
                    self.r.mmaps_not_listed += 1;
                    return;
                }
                let returns_addr = matches!(MmapOp::try_from(m.op), Ok(MmapOp::Mmap | MmapOp::Mremap));
                let ok_addr = returns_addr && !(-4095..0).contains(&m.ret);
                let key = if m.ino != 0 {
                    let (ma, mi) = kdev(m.dev);
                    Some((ma, mi, m.ino))
                } else if ok_addr {
                    self.resolve(m.hdr.pid, m.hdr.ts_ns, m.ret as u64)
                } else if m.ret == 0 && !returns_addr {
                    self.resolve(m.hdr.pid, m.enter_ns, m.addr)
                } else {
                    None
                };
                let path = key.and_then(|k| self.file_names.get(&k).cloned());
                self.r.mmaps.push(MmapRow {
                    t_ms: ms(m.hdr.ts_ns),
                    pid: m.hdr.pid,
                    tid: m.hdr.tid,
                    op,
                    addr: format!("{:#x}", m.addr),
                    len: m.len,
                    path: if returns_addr && m.fd < 0 { None } else { path },
                    error: if ok_addr || (!returns_addr && m.ret == 0) { 0 } else { m.ret },
                    result_addr: ok_addr.then(|| format!("{:#x}", m.ret)),
                });
            }
            Event::Proc(p) => {
                let t = ms(p.hdr.ts_ns);
                let comm = String::from_utf8_lossy(p.comm.split(|&c| c == 0).next().unwrap_or_default()).to_string();
                match p.op {
                    PROC_FORK => {
                        self.procs.insert(
                            p.child,
                            Process { pid: p.child, parent: Some(p.hdr.pid), comm, forked_ms: Some(t), ..Default::default() },
                        );
                    }
                    PROC_EXEC => {
                        let e = self.procs.entry(p.hdr.pid).or_insert_with(|| Process { pid: p.hdr.pid, ..Default::default() });
                        e.exec_ms = Some(t);
                        e.comm = comm;
                    }
                    PROC_EXIT => {
                        let e = self.procs.entry(p.hdr.pid).or_insert_with(|| Process { pid: p.hdr.pid, comm, ..Default::default() });
                        e.exited_ms = Some(t);
                    }
                    _ => {}
                }
            }
            Event::Sock(s) => sock::sock_event(s, &mut self.conns, &mut self.conn_index, &ms),
            // Stream bytes (present only with --capture-text) are summarised in request records;
            // stacks are unwound while tracing and kept as stack records.
            Event::Sched(e) if probe_common::stack::is_cpu_wait(e.flags) => {
                let to = e.hdr.ts_ns;
                let from = to.saturating_sub(e.blocked_ns);
                let held_from = probe_common::stack::last_run_ns(e.flags).map_or(from, |ran| to.saturating_sub(ran).max(from));
                self.cpu_waits.push(crate::analysis::verdict::CpuWait { from, to, tid: e.tid, other: e.hdr.pid, held_from });
                self.threads.cpu_wait(e.tid, to.saturating_sub(e.blocked_ns), to, e.hdr.pid);
            }
            Event::Sched(e) if probe_common::stack::is_steal(e.flags) => {
                let to = e.hdr.ts_ns;
                let from = to.saturating_sub(probe_common::stack::steal_span_ns(e.flags));
                self.steal_runs.push(crate::analysis::verdict::StealRun { from, to, tid: e.hdr.tid, ns: e.blocked_ns });
            }
            Event::Data(_) | Event::Stack(_) | Event::Sched(_) | Event::PyStack(_) => {}
            Event::Engine(e) => self.engine.add(e),
            Event::Mem(m) => {
                if m.what != probe_common::mem::MEM_OOM_VICTIM {
                    self.mem_waits.push((m.begin_ns, m.hdr.ts_ns));
                }
                self.mem_events.push(*m);
            }
        }
    }

    pub(crate) fn finish(mut self, problems: Vec<Problem>) -> Report {
        let mut r = std::mem::take(&mut self.r);
        if let Some(a) = self.samples.iter().find_map(|v| if let Sample::Attach(a) = v { Some(a) } else { None }) {
            r.blockio.limits = a.io_limits.clone();
        }
        self.threads.finish();
        self.steal_runs.sort_by_key(|s| s.to);
        for s in &self.steal_runs {
            *r.steal_running_ms.entry(s.tid).or_default() += s.ns as f64 / 1e6;
        }
        r.schema_version = SCHEMA_VERSION;
        r.problems.splice(0..0, problems);
        if let Some(why) = r.python.as_ref().and_then(|p| p.off.clone()) {
            r.problems.push(Problem::PythonOff(why));
        }
        let from = self.meta.as_ref().and_then(|m| m.window_start_ns).unwrap_or(self.start).max(self.start);
        r.duration_s = self.end_ts.saturating_sub(from) as f64 / 1e9;
        // The unwinder's counters run from attach: a window of a longer trace (an incident)
        // counts its own stack records instead, as does a recording whose counters never came.
        let windowed = self.meta.as_ref().is_some_and(|m| m.window_start_ns.is_some());
        if windowed || (r.unwind.samples == 0 && !r.stacks.is_empty()) {
            r.unwind.samples = r.stacks.values().map(|s| s.stacks).sum();
            r.unwind.complete = r.stacks.values().map(|s| s.complete).sum();
            r.unwind.success_rate = if r.unwind.samples > 0 { r.unwind.complete as f64 / r.unwind.samples as f64 } else { 0.0 };
        }
        r.system = crate::analysis::system::build(&self.samples, &self.mem_events.iter().collect::<Vec<_>>(), self.start);
        r.blockio.devices = std::mem::take(&mut self.devs)
            .into_values()
            .map(|(mut d, lat, q)| {
                d.latency_us = percentiles(lat);
                d.queue_us = percentiles(q);
                d
            })
            .collect();
        r.files = std::mem::take(&mut self.files).into_values().collect();
        r.files.sort_by(|a, b| b.read_bytes.cmp(&a.read_bytes).then(b.major_faults.cmp(&a.major_faults)).then(a.path.cmp(&b.path)));
        r.faults.minor = r.counters.get("user_faults").map(|&all| all.saturating_sub(r.faults.major));
        let polls = crate::analysis::system::poll_ports(&self.samples);
        let port_of = |a: &str| a.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
        r.connections = std::mem::take(&mut self.conns)
            .into_iter()
            .map(|(_, c, _)| c)
            .filter(|c| !port_of(&c.peer).is_some_and(|p| polls.contains(&p)))
            .collect();
        r.target.processes = std::mem::take(&mut self.procs).into_values().collect();
        closes_after_the_response(&mut r);
        self.engine.finish();
        if !self.engine.is_empty() {
            let start = self.start;
            let wants: Vec<crate::analysis::steps::Want> = r
                .requests
                .iter()
                .map(|q| {
                    let arrival = q.arrival_ms.map_or(u64::MAX, |a| at_ms(start, a));
                    let until = q.end_ms.map_or(u64::MAX, |e| arrival.saturating_add((e * 1e6) as u64));
                    let prompt_tokens =
                        q.stop.server_timings.as_ref().and_then(|t| t["prompt_n"].as_u64()).and_then(|n| u32::try_from(n).ok());
                    crate::analysis::steps::Want { arrival, until, slot: q.stop.id_slot.and_then(|s| u32::try_from(s).ok()), prompt_tokens }
                })
                .collect();
            for (q, e) in r.requests.iter_mut().zip(crate::analysis::steps::join(&self.engine, &wants)) {
                q.engine = e;
            }
            r.engine = Some(crate::analysis::steps::summary(&self.engine));
        }
        self.verdicts(&mut r);
        let lost: u64 = r.lost_events.values().sum();
        if lost > 0 {
            r.problems.push(Problem::LostEvents(lost));
        }
        if let Some(&n) = r.counters.get(probe_common::Counter::TrimmedStacks.name()).filter(|&&n| n > 0) {
            r.problems.push(Problem::TrimmedStacks(n));
        }
        if let Some(l) = r.stream_limits.as_ref().filter(|l| l.conns_evicted > 0) {
            r.problems.push(Problem::ConnsEvicted { conns: l.conns_evicted, requests: l.requests_evicted });
        }
        let measured: Vec<&Stats> = self.stats.iter().filter(|s| s.cost.is_some()).collect();
        if let (Some(a), Some(b)) = (measured.first(), measured.last()) {
            r.cost = Cost::between(a.cost.as_ref().expect("filtered"), b.cost.as_ref().expect("filtered"), b.ts_ns.saturating_sub(a.ts_ns));
        }
        let skipped: u64 = r.skipped_runs.values().sum();
        if skipped > 0 {
            let per = r.skipped_runs.iter().map(|(k, n)| (k.clone(), *n)).collect();
            r.problems.push(Problem::SkippedRuns { total: skipped, per });
        }
        r
    }
}

/// A request's time to first token: arrival to the first token (or to its end).
pub(super) fn ttft_window(start: u64, arrival_ms: f64, q: &RequestRecord) -> (u64, u64) {
    let from = at_ms(start, arrival_ms);
    (from, at_ms(from, q.ttft_ms.or(q.end_ms).unwrap_or(0.0)))
}

/// The end of a request: its last byte (or its first token when that came later).
pub(super) fn served_until(start: u64, arrival_ms: f64, q: &RequestRecord) -> u64 {
    at_ms(at_ms(start, arrival_ms), q.end_ms.unwrap_or(0.0).max(q.ttft_ms.unwrap_or(0.0)))
}

/// Where a thread waited: the wait's class and, when its stack holds Python frames (user frames
/// of `PY_MODULE`, innermost first), the innermost and the frame that called it.
fn wait_site(wait: &str, user: &[(i64, u64)], py: &HashMap<u64, String>) -> String {
    let mut named = user.iter().filter(|f| f.0 == crate::record::records::PY_MODULE).filter_map(|f| py.get(&f.1));
    match (named.next(), named.next()) {
        (Some(f), Some(caller)) => format!("{wait} in {f} under {caller}"),
        (Some(f), None) => format!("{wait} in {f}"),
        _ => wait.to_string(),
    }
}

/// The clock reading `ms` milliseconds after `start` (a recording's own figures: a corrupt one
/// saturates rather than wraps).
pub(super) fn at_ms(start: u64, ms: f64) -> u64 {
    start.saturating_add((ms * 1e6) as u64)
}
/// The report of a recording already in memory.
pub fn build(rec: &Recording) -> Report {
    let mut b = Builder::new();
    for r in &rec.records {
        b.user(Ok(r.clone()));
    }
    for (ty, why) in &rec.unreadable {
        b.user(Err((*ty, why.clone())));
    }
    for s in &rec.stacks {
        b.stack_seen(s);
    }
    for e in &rec.events {
        if let Event::Mmap(m) = e {
            b.mapping(m);
        }
    }
    b.prepare();
    let mut events: Vec<&Event> = rec.events.iter().collect();
    events.sort_by_key(|e| e.header().ts_ns);
    for e in events {
        b.kernel(e);
    }
    for s in &rec.stacks {
        b.stack(s);
    }
    b.finish(rec.problems.clone())
}

#[cfg(test)]
mod tests {
    use probe_common::{EventHeader, EventKind, blockio::BlockIoEvent, filemap::FilemapEvent};

    use super::*;

    fn fill(order: u32) -> Event {
        fill_at(1_000, 5, order)
    }

    fn fill_at(ts_ns: u64, ino: u64, order: u32) -> Event {
        let hdr = EventHeader { kind: EventKind::Filemap as u32, pid: 1, tid: 1, cpu: 0, ts_ns };
        Event::Filemap(FilemapEvent { hdr, ino, index: 0, dev: 1, order })
    }

    #[test]
    fn fills_near_the_end_of_the_clock_are_remembered() {
        // Found by the recording_report fuzz target: `old + FILL_MEMORY_NS` overflowed for a
        // timestamp near u64::MAX (a panic with overflow checks; without, the fill was forgotten
        // and the block read that followed it named no file).
        let end = u64::MAX - 100;
        let hdr = EventHeader { kind: EventKind::BlockIo as u32, pid: 1, tid: 1, cpu: 0, ts_ns: end + 90 };
        let read = BlockIoEvent {
            hdr,
            dev: 1,
            bytes: 4096,
            insert_ns: end + 10,
            issue_ns: end + 20,
            complete_ns: end + 90,
            rwbs: *b"R\0\0\0\0\0\0\0",
            ..Default::default()
        };
        let rec = Recording { events: vec![fill_at(end, 5, 0), fill_at(end + 50, 6, 0), Event::BlockIo(read)], ..Default::default() };
        let r = build(&rec);
        let file = r.files.iter().find(|f| f.inode == 5).unwrap();
        assert_eq!(file.block_reads, 1, "{:?}", r.files);
    }

    #[test]
    fn a_corrupt_folio_order_saturates_the_bytes_read() {
        // Found by the recording_report fuzz target: `page_size << order` overflowed (a panic
        // with overflow checks, a wrong count without).
        let rec = Recording { events: vec![fill(64)], ..Default::default() };
        assert_eq!(build(&rec).files[0].read_bytes, u64::MAX);
        let rec = Recording { events: vec![fill(50); 4], ..Default::default() };
        assert_eq!(build(&rec).files[0].read_bytes, u64::MAX, "4 × 2^62 bytes");
        // Without a meta record pages are 4 KiB (Meta::default() said 0: every fill read 0 bytes).
        let rec = Recording { events: vec![fill(0), fill(9)], ..Default::default() };
        assert_eq!(build(&rec).files[0].read_bytes, 4096 + (4096 << 9));
    }

    #[test]
    fn a_record_of_the_wrong_shape_reads_the_same_in_memory_and_streamed() {
        // Found by the recording_report fuzz target: in memory, a ksyms record with a float
        // where an address goes was counted undecodable; streamed, it was named with its error.
        let dir = std::env::temp_dir().join(format!("probe-build-shape-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = crate::record::Writer::create(&dir).unwrap();
        w.json(&serde_json::json!({"type": "meta", "pid": 1, "start_ns": 5})).unwrap();
        w.json(&serde_json::json!({"type": "ksyms", "syms": [[1.5e19, "x"]]})).unwrap();
        w.json(&serde_json::json!({"type": "stack", "ts_ns": "not a time"})).unwrap();
        w.json_bytes(b"{not json").unwrap();
        w.flush().unwrap();
        let bytes = std::fs::read(dir.join(crate::record::FILE_NAME)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let streamed = crate::analysis::Analysis::report_bytes(&bytes).unwrap();
        assert_eq!(build(&crate::record::parse(&bytes, "x").unwrap()), streamed);
        assert!(streamed.problems.iter().any(|p| p.to_string().starts_with("a ksyms record could not be read")), "{:?}", streamed.problems);
        assert!(streamed.problems.contains(&crate::record::problem::Problem::Undecodable(1)), "{:?}", streamed.problems);
    }

    /// Found by `cargo xtask soak`: 81 of 2096 chat requests were left out of a 10-minute report
    /// because their client's port had been used by one of probe's endpoint polls before.
    #[test]
    fn a_request_on_a_port_a_poll_used_before_is_kept() {
        let req = |id: u64, method: Option<&str>, poll: bool| {
            let q = crate::stream::RequestRecord {
                id,
                local: "127.0.0.1:8080".into(),
                peer: "127.0.0.1:40000".into(),
                role: Role::Server,
                method: method.map(String::from),
                path: method.map(|_| "/v1/chat/completions".into()),
                probe_poll: poll,
                arrival_ms: Some(id as f64),
                partial: method.is_none(),
                ..Default::default()
            };
            let mut v = serde_json::to_value(q).unwrap();
            v["type"] = "request".into();
            v
        };
        let rec = Recording::from_json(vec![
            serde_json::json!({"type": "endpoint", "ts_ns": 1, "local_ports": [40000]}),
            req(1, Some("GET"), true),
            req(2, Some("POST"), false),
            req(3, None, false),
        ]);
        let r = build(&rec);
        let kept: Vec<u64> = r.requests.iter().map(|q| q.id).collect();
        assert_eq!((kept, r.probe_polls), (vec![2], 2));
    }
}
