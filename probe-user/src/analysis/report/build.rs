//! Building the [`Report`]: two passes over a recording (the userspace records and file
//! mappings, then the kernel records in time order), keeping aggregates and what the verdicts
//! need, not the events.
use std::collections::{BTreeMap, HashMap};

use super::*;
use crate::{
    analysis::verdict::SlowCause,
    os::procfs::Mapping,
    record::decode::Event,
    record::{
        Recording, StackKind, StackRecord,
        problem::Problem,
        records::{Meta, Stats, UserRecord},
        samples::{EndpointPoll, Sample},
    },
    stream::{ClosedBy, RequestRecord, Role},
};
use probe_common::{
    blockio::BlockIoEvent,
    fault::FAULT_MAJOR,
    mmap::MmapOp,
    proc::{PROC_EXEC, PROC_EXIT, PROC_FORK},
};

/// A block read is charged to the file its thread last added to the page cache this recently.
const FILE_IO_WINDOW_NS: u64 = 100_000_000;

fn kdev(dev: u32) -> (u32, u32) {
    (dev >> 20, dev & 0xfffff)
}

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
type FileKey = (u32, u32, u64);

/// A file mapping (or an unmap) seen by the mmap probe.
struct FileMap {
    pid: u32,
    t: u64,
    start: u64,
    end: u64,
    key: (u32, u32, u64),
}

/// Mapping snapshots per pid, in time order, to name the file behind an address at a time.
#[derive(Default)]
struct MapHistory {
    by_pid: HashMap<u32, Vec<(u64, Vec<Mapping>)>>,
}

impl MapHistory {
    /// The mapping that covered `addr` in `pid` at `ts`: the latest snapshot at or before `ts`
    /// that has it, else the earliest after (a mapping is read from /proc just after its mmap).
    fn find(&self, pid: u32, ts: u64, addr: u64) -> Option<&Mapping> {
        let snaps = self.by_pid.get(&pid)?;
        let split = snaps.partition_point(|(t, _)| *t <= ts);
        fn hit(snap: &(u64, Vec<Mapping>), addr: u64) -> Option<&Mapping> {
            snap.1.iter().find(|m| m.start <= addr && addr < m.end)
        }
        snaps[..split].iter().rev().find_map(|s| hit(s, addr)).or_else(|| snaps[split..].iter().find_map(|s| hit(s, addr)))
    }
}

/// Fills older than this (by the time of the event being read) cannot be the cause of a block
/// read any more: forgotten, so memory does not grow with the trace.
const FILL_MEMORY_NS: u64 = 10_000_000_000;
/// Kernel records arrive nearly in time order (one ring buffer, records from several CPUs);
/// this many are held back and sorted before they are analysed.
const REORDER: usize = 1 << 16;

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
struct WindowData {
    /// Bytes each file added to the page cache before the first token, and when it started.
    read: BTreeMap<FileKey, (u64, u64)>,
    stacks: u64,
    stacks_cut: u64,
    /// Of those cut, the ones cut within `verdict::DEEP_ENOUGH` user frames, and why each cut
    /// stack stopped (by `Cut::ALL`).
    stacks_cut_shallow: u64,
    cut_reasons: [u64; 3],
}

/// The analysis, built in two passes over a recording so that memory grows with requests,
/// files, threads and connections, not with events. Pass 1 reads the userspace records (and the
/// file mappings); pass 2 reads the kernel records in time order.
pub(crate) struct Builder {
    r: Report,
    meta: Option<Meta>,
    /// The `stats` records, one a second.
    stats: Vec<Stats>,
    start: u64,
    page_size: u64,
    end_ts: u64,
    dev_names: HashMap<String, String>,
    /// Userspace records the system section and verdicts read (samples, polls, stats, meta);
    /// stack records are not kept (counted here, revisited in pass 2).
    samples: Vec<Sample>,
    maps: MapHistory,
    depths: BTreeMap<String, (u64, u64, BTreeMap<u64, u64>)>,
    /// Per kind of stack: why the cut ones stopped.
    cuts: BTreeMap<String, BTreeMap<crate::record::Cut, u64>>,
    file_names: HashMap<FileKey, String>,
    mmap_names: HashMap<FileKey, String>,
    names: crate::analysis::ksyms::NamesBuilder,
    knames: crate::analysis::ksyms::Names,
    has_end: bool,
    /// Stack records that could not be read.
    bad_stacks: u64,
    // File mappings as the mmap probe saw them (named in the kernel, exact in time), and the
    // unmaps that cut into one of them.
    file_maps: Vec<FileMap>,
    unmaps: Vec<FileMap>,
    by_pid: HashMap<u32, Vec<(usize, Vec<usize>)>>,
    // Pass 2.
    files: HashMap<FileKey, FileStat>,
    fills_by_tid: HashMap<u32, std::collections::VecDeque<(u64, FileKey)>>,
    procs: BTreeMap<u32, Process>,
    mem_events: Vec<probe_common::mem::MemEvent>,
    /// The engine probe's steps and cache events.
    engine: crate::analysis::steps::Log,
    conns: Vec<(u64, Connection, bool)>,
    conn_index: HashMap<u64, usize>,
    devs: BTreeMap<u32, (Device, Vec<f64>, Vec<f64>)>,
    io_waits: Vec<(u64, u64)>,
    mem_waits: Vec<(u64, u64)>,
    /// Off-CPU intervals faulting memory back in from swap.
    swap_waits: Vec<(u64, u64)>,
    /// The on-CPU sampling period (1 / --hz), ns.
    cpu_period_ns: u64,
    /// Run-queue waits of target threads (preempted, runnable): (from, to, what ran instead).
    cpu_waits: Vec<crate::analysis::verdict::CpuWait>,
    /// The hypervisor's steal while target threads ran (SCHED_STEAL records), sorted by end.
    steal_runs: Vec<crate::analysis::verdict::StealRun>,
    /// Other processes by pid: (comm, cgroup), from the `procs` records.
    other_names: HashMap<u32, (String, Option<String>)>,
    /// Each target thread's off-CPU intervals, for the requests' critical paths, and names.
    threads: crate::analysis::critical::Threads,
    thread_names: HashMap<u32, String>,
    /// Python frames' names by id (the `pyframes` records), for where waits were.
    py_frames: HashMap<u64, String>,
    /// Warm requests of earlier sessions (`probe watch`'s baseline).
    kept_warm: Vec<crate::record::records::Warm>,
    /// Where cut user stacks stop, as the trace named it.
    cut_frames: Vec<crate::record::records::CutFrame>,
    ttft_windows: WindowIndex,
    served_windows: WindowIndex,
    windows: Vec<WindowData>,
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

    /// Pass 1: a kernel record, for the file mappings (in file order, which is time order but
    /// for records from different CPUs a few microseconds apart).
    pub(crate) fn mapping(&mut self, m: &probe_common::mmap::MmapEvent) {
        match MmapOp::try_from(m.op) {
            Ok(MmapOp::Mmap) if m.ino != 0 && !(-4095..0).contains(&m.ret) => {
                let (ma, mi) = kdev(m.dev);
                let key = (ma, mi, m.ino);
                let name = String::from_utf8_lossy(m.name.split(|&c| c == 0).next().unwrap_or_default()).to_string();
                // Names from /proc (maps and files records) win: merged after pass 1.
                self.mmap_names.entry(key).or_insert_with(|| format!("<inode {} on {ma}:{mi}>/{name}", m.ino));
                self.by_pid.entry(m.hdr.pid).or_default().push((self.file_maps.len(), vec![]));
                self.file_maps.push(FileMap {
                    pid: m.hdr.pid,
                    t: m.hdr.ts_ns,
                    start: m.ret as u64,
                    end: (m.ret as u64).saturating_add(m.len),
                    key,
                });
            }
            Ok(MmapOp::Munmap) if m.ret == 0 => {
                let u = FileMap { pid: m.hdr.pid, t: m.hdr.ts_ns, start: m.addr, end: m.addr.saturating_add(m.len), key: (0, 0, 0) };
                // Only an unmap that cuts into a file mapping matters (anonymous memory churn
                // would otherwise be kept whole).
                let Some(list) = self.by_pid.get_mut(&u.pid) else { return };
                let mut kept = false;
                for (i, cuts) in list.iter_mut() {
                    let f = &self.file_maps[*i];
                    if u.t > f.t && u.start < f.end && f.start < u.end {
                        cuts.push(self.unmaps.len());
                        kept = true;
                    }
                }
                if kept {
                    self.unmaps.push(u);
                }
            }
            _ => {}
        }
    }

    /// The file behind `addr` in `pid` at `t`.
    fn resolve(&self, pid: u32, t: u64, addr: u64) -> Option<FileKey> {
        let live = |(i, cuts): &(usize, Vec<usize>)| {
            let m = &self.file_maps[*i];
            m.t <= t
                && m.start <= addr
                && addr < m.end
                && !cuts.iter().map(|&c| &self.unmaps[c]).any(|u| u.t < t && u.start <= addr && addr < u.end)
        };
        let hit = self.by_pid.get(&pid).and_then(|list| list.iter().rev().find(|e| live(e)).map(|e| self.file_maps[e.0].key));
        hit.or_else(|| self.maps.find(pid, t, addr).map(|m| (m.major, m.minor, m.inode)))
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
        if s.what == StackKind::Cpu && self.cpu_period_ns > 0 && !s.kernel.is_empty() && self.knames.wait_of_stack(s) == "[swap wait]" {
            let from = ts.saturating_sub(self.cpu_period_ns);
            self.swap_waits.push((from, ts));
            self.threads.memory_on_cpu(s.tid, from, ts);
        }
        if s.what == StackKind::Offcpu {
            let Some(b) = s.blocked_ns else { return };
            let wait = self.knames.wait_of_stack(s);
            let site = self.threads.site(&wait_site(wait, &s.user, &self.py_frames));
            self.threads.blocked(s.tid, ts, ts.saturating_add(b), crate::analysis::critical::Class::of(wait), s.waker, Some(site));
            match wait {
                "[io wait]" | "[page-fault wait]" => self.io_waits.push((ts, ts + b)),
                "[memory wait]" => self.mem_waits.push((ts, ts + b)),
                "[swap wait]" => self.swap_waits.push((ts, ts + b)),
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

    fn file_of(&mut self, key: FileKey) -> &mut FileStat {
        let names = &self.file_names;
        self.files.entry(key).or_insert_with(|| FileStat {
            path: names.get(&key).cloned().unwrap_or_else(|| format!("<inode {} on {}:{}>", key.2, key.0, key.1)),
            dev: format!("{}:{}", key.0, key.1),
            inode: key.2,
            ..Default::default()
        })
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

    /// Block IO: totals, per device, and per file by the thread that filled the page cache.
    fn block(&mut self, b: &BlockIoEvent) {
        let rwbs = String::from_utf8_lossy(b.rwbs.split(|&c| c == 0).next().unwrap_or_default()).to_string();
        let (read, write) = (rwbs.contains('R'), rwbs.contains('W'));
        let r = &mut self.r;
        r.blockio.requests += 1;
        if b.matched != probe_common::blockio::BY_ISSUER {
            r.blockio.issued_for_target += 1;
        }
        let (ma, mi) = kdev(b.dev);
        let dev_names = &self.dev_names;
        let e = self.devs.entry(b.dev).or_insert_with(|| {
            let dev = format!("{ma}:{mi}");
            (Device { name: dev_names.get(&dev).cloned(), dev, ..Default::default() }, vec![], vec![])
        });
        e.0.requests += 1;
        if read {
            r.blockio.read_bytes += b.bytes as u64;
            e.0.read_bytes += b.bytes as u64;
        } else if write {
            r.blockio.write_bytes += b.bytes as u64;
            e.0.write_bytes += b.bytes as u64;
        }
        let device_ns = b.complete_ns.saturating_sub(b.issue_ns);
        e.1.push(device_ns as f64 / 1e3);
        if b.insert_ns != 0 {
            e.2.push(b.issue_ns.saturating_sub(b.insert_ns) as f64 / 1e3);
        }
        if read {
            let at = if b.insert_ns != 0 { b.insert_ns } else { b.issue_ns };
            // The kernel named the file behind the request's pages; else the file its thread
            // last added to the page cache (a record written before block records named it).
            let named = (b.ino != 0).then(|| {
                let (ma, mi) = kdev(b.ino_dev);
                (at, (ma, mi, b.ino))
            });
            let fill = named.or_else(|| {
                self.fills_by_tid.get(&b.hdr.tid).filter(|_| b.hdr.tid != 0).and_then(|v| {
                    let i = v.partition_point(|(t, _)| *t <= at);
                    i.checked_sub(1).map(|i| v[i]).filter(|(t, _)| at - t <= FILE_IO_WINDOW_NS)
                })
            });
            if let Some((_, key)) = fill {
                let f = self.file_of(key);
                f.block_reads += 1;
                f.io_time_ms += device_ns as f64 / 1e6;
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

    /// Attach a verdict to every request (see crate::analysis::verdict).
    fn verdicts(&self, r: &mut Report) {
        if r.requests.is_empty() {
            return;
        }
        let (start, samples) = (self.start, &self.samples);
        let offcpu_probe = r.probes.iter().any(|p| p.name == crate::record::records::Subsystem::Offcpu && p.live);
        let mut target_pids: Vec<u32> = self.meta.as_ref().map(|m| m.targets.clone()).unwrap_or_default();
        target_pids.extend(self.procs.keys().copied());
        target_pids.push(r.target.pid);
        let oom_kills: Vec<u64> =
            self.mem_events.iter().filter(|m| m.what == probe_common::mem::MEM_OOM_VICTIM).map(|m| m.hdr.ts_ns).collect();
        let (gpu_clocks, cpu_clocks) = crate::analysis::system::clock_series(samples);
        let gpu_pci = crate::analysis::system::pci_series(samples);
        // Losses are counted per second (stats records, cumulative): a window's losses are the
        // growth between the last count before it and the first after it.
        let lost_at: Vec<(u64, u64)> = self.stats.iter().map(|s| (s.ts_ns, s.lost_total())).collect();
        let lost_between = |from: u64, to: u64| {
            let before = lost_at.iter().rev().find(|(t, _)| *t <= from).map_or(0, |x| x.1);
            let after = lost_at.iter().find(|(t, _)| *t >= to).or(lost_at.last()).map_or(0, |x| x.1);
            after.saturating_sub(before)
        };
        let sys = &r.system;
        let power_absent = (gpu_clocks.is_empty() && cpu_clocks.is_empty()).then(|| {
            let gpu = sys.gpu.absent.clone().unwrap_or_else(|| "GPU clocks not sampled".into());
            let cpu = sys.cpu_freq.absent.clone().unwrap_or_else(|| "CPU frequency not sampled".into());
            format!("{gpu}; {cpu}")
        });
        let polls: Vec<&EndpointPoll> =
            samples.iter().filter_map(|v| if let Sample::Endpoint(e) = v { Some(e) } else { None }).filter(|e| e.answered()).collect();
        let mut pressure: Vec<crate::analysis::verdict::Pressure> = samples
            .iter()
            .filter_map(|v| if let Sample::Mem(m) = v { Some(crate::analysis::verdict::Pressure::of(m)) } else { None })
            .collect();
        pressure.sort_by_key(|p| p.ts_ns);
        let swaps: Vec<String> =
            samples.iter().find_map(|v| if let Sample::Samplers(s) = v { Some(s.swaps.clone()) } else { None }).unwrap_or_default();
        let server_kind = polls.iter().rev().map(|v| v.kind.name()).find(|k| !matches!(*k, "other" | "none"));
        let sleeping_before = |t: u64| polls.iter().rev().find(|v| v.ts_ns <= t).is_some_and(|v| v.sleeping() == Some(true));
        let deferred_in = |from: u64, to: u64| {
            polls
                .iter()
                .filter(|v| (from..=to + 1_000_000_000).contains(&v.ts_ns))
                .filter_map(|v| v.metric("llamacpp:requests_deferred").or(v.metric("vllm:num_requests_waiting")))
                .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
        };
        // vLLM's cumulative counters (summed over their labels): what one grew by from the last
        // poll at or before `from` to the first at or after `until`. Preemptions while a request
        // was served; its prefix cache's hits and queries (tokens).
        let counter_at = |v: &EndpointPoll, name: &str| -> Option<f64> {
            let mut it = v.metrics.as_ref()?.iter().filter(|(k, _)| k.starts_with(name)).map(|(_, x)| *x).peekable();
            it.peek()?;
            Some(it.sum())
        };
        let grew = |name: &str, from: u64, until: u64| {
            let before = polls.iter().rev().find(|v| v.ts_ns <= from).and_then(|v| counter_at(v, name))?;
            let after = polls.iter().find(|v| v.ts_ns >= until).and_then(|v| counter_at(v, name))?;
            Some((after - before).max(0.0))
        };
        let lost: u64 = r.lost_events.values().sum();
        let mut residency: Vec<&crate::record::samples::ResidencyReading> =
            samples.iter().filter_map(|v| if let Sample::Residency(x) = v { Some(x) } else { None }).collect();
        residency.sort_by_key(|r| r.ts_ns);
        let names = &self.file_names;
        let name = |k: &FileKey| names.get(k).cloned().unwrap_or_else(|| format!("<inode {} on {}:{}>", k.2, k.0, k.1));
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
        // When each request was being served: from the start of its prompt processing (its last
        // byte less the server's prompt and generation time) to its last byte. Before that it may
        // have been waiting itself.
        let spans: Vec<(u64, Option<(u64, u64)>)> = r
            .requests
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
            .collect();
        // What the counters grew by between two polls is this request's burst's (the requests
        // served overlapping it, and those overlapping them) only when no request outside that
        // burst was served in the stretch: a poll every 10 s while idle can bracket a whole
        // earlier burst, whose preemptions and cache hits are not this request's. Requests here
        // are POSTs (a GET of /metrics or /health moves no counter), not probe's own polls.
        // In flight: arrival to last byte (a request queued behind others is part of their burst
        // before it is served).
        let posts: Vec<(u64, (u64, u64))> = r
            .requests
            .iter()
            .filter(|q| q.method.as_deref() == Some("POST") && !q.probe_poll)
            .filter_map(|q| {
                let a = q.arrival_ms?;
                Some((q.id, (at_ms(start, a), at_ms(start, a + q.end_ms.unwrap_or(0.0)))))
            })
            .collect();
        // The bursts, once: in-flight spans that overlap merged (sorted by start, a sweep), and
        // each POST's burst. Asked per request, not grown request by request (that was cubic in
        // the requests of a long busy trace).
        let (bursts, burst_of) = {
            let mut spans: Vec<(u64, (u64, u64))> = posts.clone();
            spans.sort_by_key(|(_, (s, _))| *s);
            let mut bursts: Vec<(u64, u64)> = Vec::new();
            let mut burst_of: HashMap<u64, usize> = HashMap::new();
            for (id, (s, t)) in spans {
                match bursts.last_mut() {
                    Some(b) if s < b.1 => b.1 = b.1.max(t),
                    _ => bursts.push((s, t)),
                }
                burst_of.insert(id, bursts.len() - 1);
            }
            (bursts, burst_of)
        };
        let bracket_is_own = |id: u64, from: u64, until: u64| {
            let (Some(b), Some(e)) = (polls.iter().rev().find(|v| v.ts_ns <= from), polls.iter().find(|v| v.ts_ns >= until)) else {
                return false;
            };
            let own = burst_of.get(&id).copied();
            let (lo, hi) = own.map_or((from, until), |k| (bursts[k].0.min(from), bursts[k].1.max(until)));
            !bursts.iter().enumerate().any(|(k, (s, t))| Some(k) != own && *s < e.ts_ns && *t > b.ts_ns && (*t <= lo || *s >= hi))
        };
        let preempted_in =
            |id: u64, from: u64, until: u64| grew("vllm:num_preemptions_total", from, until).filter(|_| bracket_is_own(id, from, until));
        let prefix_cache_in = |id: u64, from: u64, until: u64| {
            Some((grew("vllm:prefix_cache_hits", from, until)?, grew("vllm:prefix_cache_queries", from, until)?))
                .filter(|_| bracket_is_own(id, from, until))
        };
        for (i, q) in r.requests.iter_mut().enumerate() {
            let Some(a) = q.arrival_ms else {
                q.verdict = Some(crate::analysis::verdict::attribute(
                    q,
                    &crate::analysis::verdict::Window {
                        lost_events: lost,
                        offcpu_probe,
                        power_absent: power_absent.as_deref(),
                        ..Default::default()
                    },
                ));
                continue;
            };
            let (from, to) = ttft_window(start, a, q);
            let until = served_until(start, a, q);
            let data = &self.windows[i];
            let mut files_read: Vec<(String, u64, u64)> = data.read.iter().map(|(k, (b, t))| (name(k), *b, *t)).collect();
            files_read.sort_by_key(|f| std::cmp::Reverse(f.1));
            let w = crate::analysis::verdict::Window {
                arrival_ns: from,
                io_waits: &self.io_waits,
                mem_waits: &self.mem_waits,
                swap_waits: &self.swap_waits,
                pressure: &pressure,
                swaps: &swaps,
                cpu_waits: &self.cpu_waits,
                steal_runs: &self.steal_runs,
                other_names: Some(&self.other_names),
                target_pids: &target_pids,
                files_read,
                mapped: self.file_maps.iter().filter(|m| m.t >= from && m.t <= to).map(|m| (m.t, name(&m.key))).collect(),
                others: spans.iter().filter(|(id, _)| *id != q.id).filter_map(|(_, s)| *s).collect(),
                lost_events: lost_between(from, until),
                offcpu_probe,
                stacks: data.stacks,
                stacks_cut: data.stacks_cut,
                stacks_cut_shallow: data.stacks_cut_shallow,
                cut_reasons: data.cut_reasons,
                oom_kills: &oom_kills,
                gpu_clocks: &gpu_clocks,
                gpu_pci: &gpu_pci,
                cpu_clocks: &cpu_clocks,
                power_absent: power_absent.as_deref(),
                server_sleeping: sleeping_before(from),
                server_deferred: deferred_in(from, to),
                server_preemptions: preempted_in(q.id, from, until),
                server_prefix_cache: prefix_cache_in(q.id, from, until),
                thread_names: Some(&self.thread_names),
                cut_under: self.cut_frames.iter().max_by_key(|f| f.stacks).map(|f| f.name.as_str()),
                path: q.writer_tid.filter(|_| offcpu_probe && !self.threads.is_empty()).map(|t| self.threads.walk(t, from, to)),
                engine: q.engine.as_ref(),
                before_attach_ms: (-a).max(0.0),
                at_attach: attach.filter(|_| a < 0.0).map(|st| {
                    let ahead = in_flight_at_attach.iter().filter(|(id, a2, _)| *id != q.id && *a2 < a).count();
                    at_attach(st, first_residency, q, ahead, &data.read, names, sleeping_before(from))
                }),
                io_limits: attach.map_or(&[], |a| a.io_limits.as_slice()),
                trace_end_ns: self.end_ts,
                server_kind,
            };
            let mut v = crate::analysis::verdict::attribute(q, &w);
            // The model files' page-cache residency at the last reading before arrival.
            let i = residency.partition_point(|r| r.ts_ns <= from);
            if let Some(r) = i.checked_sub(1).map(|i| residency[i]) {
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
            q.verdict = Some(v);
        }
        super::prompt::prompts(&mut r.requests);
        against_warm(&mut r.requests, &self.kept_warm);
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
    let blocked: Vec<&crate::record::samples::ThreadAtAttach> = st.threads.iter().filter(|t| t.state == "D").collect();
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

/// A request's prompt size for the warm baseline, as the work it was: the prompt tokens the
/// server computed (llama.cpp's `timings.prompt_n`, which leaves out the `cache_n` it reused;
/// Ollama's `prompt_eval_count`; OpenAI-style `usage.prompt_tokens` less
/// `prompt_tokens_details.cached_tokens`), else its prompt tokens when the server does not say
/// what it reused, else the request's bytes (a server that reports no tokens). A warm request
/// that reused most of its prompt is then the baseline for prompts that reused as much.
pub(crate) fn prompt_size(q: &RequestRecord) -> (u64, &'static str) {
    let t = q.stop.server_timings.as_ref();
    if let Some(n) = t.and_then(|t| t["prompt_n"].as_u64().or(t["prompt_eval_count"].as_u64())) {
        return (n, COMPUTED);
    }
    let u = q.stop.usage.as_ref();
    match u.and_then(|u| u["prompt_tokens"].as_u64()) {
        Some(n) => match u.and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64()) {
            Some(c) => (n.saturating_sub(c), COMPUTED),
            None => (n, "token"),
        },
        None => (q.request_bytes, "byte"),
    }
}

/// Two prompt sizes of one unit are alike: within 2× of each other, or within
/// [`ALIKE_TOKENS`] (a few tokens more or less are no more work on a small prompt).
pub(crate) fn similar_size(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= ALIKE_TOKENS || (a <= b.max(1) * 2 && b <= a.max(1) * 2)
}

const ALIKE_TOKENS: u64 = 16;

/// The unit of [`prompt_size`] for prompt tokens the server computed.
pub(crate) const COMPUTED: &str = "computed token";

/// "a 250-byte prompt", "240 computed prompt tokens".
pub(crate) fn size_words(size: u64, unit: &str) -> String {
    if unit == COMPUTED { format!("{size} computed prompt tokens") } else { format!("a {size}-{unit} prompt") }
}

/// Against this server's own warm requests in the trace: a request of a similar prompt size
/// (computed prompt tokens within 2× or 16 tokens: [`similar_size`]) whose verdict found nothing
/// but its own work. Each other request with a verdict
/// gets "N× this server's warm TTFT for a P-token prompt" when it took at least 1.5× their
/// median, or, when it has a slow cause and there is no such request, "no warm baseline in this
/// trace" (the absolute rules stand alone). More than 20% of a TTFT unexplained is a
/// data-quality line.
pub(crate) fn against_warm(requests: &mut [Request], kept: &[crate::record::records::Warm]) {
    let warm: Vec<(u64, (u64, &str), f64)> = requests
        .iter()
        .filter_map(|q| {
            let v = q.verdict.as_ref().filter(|_| !q.record.probe_poll)?;
            let ttft = q.record.ttft_ms.filter(|_| matches!(v.slow_cause, SlowCause::None | SlowCause::Compute))?;
            Some((q.record.id, prompt_size(&q.record), ttft))
        })
        .collect();
    for q in requests.iter_mut() {
        let (Some(ttft), Some(v)) = (q.record.ttft_ms.filter(|_| !q.record.probe_poll), q.verdict.as_mut()) else { continue };
        if let Some(s) = &v.ttft_ms
            && ttft > 0.0
            && s.unexplained > 0.2 * ttft
        {
            v.data_quality.push(format!("{:.0}% of the TTFT is unexplained ({:.0} ms)", s.unexplained * 100.0 / ttft, s.unexplained));
        }
        let (size, unit) = prompt_size(&q.record);
        // Sizes in the same unit only (tokens with tokens, bytes with bytes).
        let similar = |n: u64, u: &str| u == unit && similar_size(n, size);
        let mut peers: Vec<f64> = warm.iter().filter(|(id, (n, u), _)| *id != q.record.id && similar(*n, u)).map(|w| w.2).collect();
        let here = peers.len();
        peers.extend(kept.iter().filter(|k| similar(k.size, &k.unit)).map(|k| k.ttft_ms));
        if peers.is_empty() {
            if !matches!(v.slow_cause, SlowCause::None | SlowCause::Compute) {
                v.evidence.push(
                    "no warm baseline in this trace (no fast request of a similar prompt size): the cause rests on the absolute rules"
                        .into(),
                );
            }
            continue;
        }
        peers.sort_by(f64::total_cmp);
        let median = peers[peers.len() / 2];
        if median > 0.0 && ttft >= 1.5 * median {
            let of = match peers.len() - here {
                0 => format!("the median of {here} warm request(s) in this trace"),
                k if here == 0 => format!("the median of {k} warm request(s) probe watch kept from earlier sessions"),
                k => {
                    format!("the median of {} warm request(s): {here} in this trace, {k} probe watch kept from earlier sessions", here + k)
                }
            };
            v.evidence.push(format!("{:.1}× this server's warm TTFT for {} ({median:.0} ms, {of})", ttft / median, size_words(size, unit)));
            growth_is_contention(v, ttft, median);
            if v.slow_cause == SlowCause::None {
                beyond_warm(v, ttft - median);
            }
        }
    }
}

/// The server's own work grew over its warm baseline for as much work while other processes held
/// the CPUs its threads waited for: the growth is cpu_contention, not compute. A pool's threads
/// meet at a barrier after every step; one preempted by another process leaves the others spinning
/// (running, to the scheduler) or parked until it runs again, so the run-queue wait counts only
/// part of what the other process took. Growth under 20% (caches shared with the other job) stays
/// compute; without competitors (the CPUs were the server's) it is compute too. Contention in all
/// is at most what the others held (the sum of every server thread's waits they were charged
/// with): the pool is held back only while at least one of its threads waits for a CPU. Growth
/// past that has another cause (a request faulting its memory back in runs slower after it,
/// however little the others ran).
fn growth_is_contention(v: &mut crate::analysis::verdict::Verdict, ttft: f64, warm: f64) {
    const GREW: f64 = 1.2;
    let held: f64 = v.competitors.iter().map(|c| c.ms).sum();
    let Some(s) = v.ttft_ms.as_mut() else { return };
    if held < 10.0 || s.compute < GREW * warm {
        return;
    }
    let room = (held - s.cpu_contention).max(0.0);
    let moved = (s.compute - warm).min(ttft - warm).min(room).max(0.0);
    if moved < 1.0 {
        return;
    }
    s.compute -= moved;
    s.cpu_contention += moved;
    let names: Vec<String> = v.competitors.iter().take(3).map(|c| format!("{} {:.0} ms", c.who(), c.held())).collect();
    v.evidence.push(format!(
        "its own work took {:.0} ms against {warm:.0} ms warm for as much work, while other processes held the CPUs its threads waited for ({}): the {moved:.0} ms it grew is cpu_contention (a pool's threads wait at each step for a peer that another process preempted, spinning or parked)",
        s.compute + moved,
        names.join(", ")
    ));
    let (cause, ms) = s.largest_stall();
    if ms >= 0.25 * ttft && ms >= s.compute {
        v.slow_cause = cause;
    }
}

/// A request well over its warm baseline is not `none`: the part that explains at least half of
/// the excess is its cause (its own work, when that grew), else a data-quality line says that
/// nothing probe saw explains it.
fn beyond_warm(v: &mut crate::analysis::verdict::Verdict, excess: f64) {
    let Some(s) = &v.ttft_ms else { return };
    let (cause, ms) = s.largest_stall();
    if ms >= 0.5 * excess && ms >= s.compute {
        v.slow_cause = cause;
    } else if s.compute >= 0.5 * excess && s.unexplained < 0.5 * excess {
        v.slow_cause = SlowCause::Compute;
    } else {
        v.data_quality.push(format!(
            "{excess:.0} ms slower than this server's warm requests, and what probe saw explains under half of it ({:.0} ms unexplained)",
            s.unexplained
        ));
    }
}

/// A request record says "none" (kept open) when its response ended before any close was seen:
/// the tracker finalizes it at its last byte. When the connection table shows the connection
/// closed afterwards with no other request on it (`Connection: close`, a client that leaves after
/// one answer), the request says who closed it, as the table does.
fn closes_after_the_response(r: &mut Report) {
    // Per connection (local, peer): its requests' arrivals, sorted, and its closes (a lookup
    // each, not a scan of every request and connection per request).
    let mut arrivals: HashMap<(&str, &str), Vec<f64>> = HashMap::new();
    for q in &r.requests {
        if let Some(a) = q.arrival_ms {
            arrivals.entry((q.local.as_str(), q.peer.as_str())).or_default().push(a);
        }
    }
    arrivals.values_mut().for_each(|v| v.sort_by(f64::total_cmp));
    let mut conns: HashMap<(&str, &str), Vec<&Connection>> = HashMap::new();
    for c in &r.connections {
        conns.entry((c.local.as_str(), c.peer.as_str())).or_default().push(c);
    }
    let mut closes = Vec::new();
    for (i, q) in r.requests.iter().enumerate() {
        let (Some(a), Some(e)) = (q.arrival_ms, q.end_ms) else { continue };
        if q.closed_by != ClosedBy::None {
            continue;
        }
        let key = (q.local.as_str(), q.peer.as_str());
        let Some(c) =
            conns.get(&key).into_iter().flatten().find(|c| {
                c.pid.is_none_or(|p| p == q.pid) && c.opened_ms.is_none_or(|o| o <= a) && c.closed_ms.is_some_and(|t| t >= a + e)
            })
        else {
            continue;
        };
        // Another request used the connection after this one, before the close: the close is
        // not this request's (a port reused by a later connection does not count).
        let closed = c.closed_ms.unwrap_or(f64::MAX);
        let after = arrivals.get(&key).map_or(&[][..], |v| &v[v.partition_point(|&x| x <= a)..]);
        if after.first().is_some_and(|&x| x <= closed) {
            continue;
        }
        let by_peer = match c.closed_by {
            Closer::Peer => true,
            Closer::Local => false,
            Closer::None => continue,
        };
        // The table's "peer" is the other end: for a server that is the client.
        let server_side = q.role == Role::Server;
        closes.push((i, if by_peer == server_side { ClosedBy::Client } else { ClosedBy::Server }));
    }
    for (i, by) in closes {
        r.requests[i].record.closed_by = by;
    }
}

/// A request's time to first token: arrival to the first token (or to its end).
fn ttft_window(start: u64, arrival_ms: f64, q: &RequestRecord) -> (u64, u64) {
    let from = at_ms(start, arrival_ms);
    (from, at_ms(from, q.ttft_ms.or(q.end_ms).unwrap_or(0.0)))
}

/// The end of a request: its last byte (or its first token when that came later).
fn served_until(start: u64, arrival_ms: f64, q: &RequestRecord) -> u64 {
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
fn at_ms(start: u64, ms: f64) -> u64 {
    start.saturating_add((ms * 1e6) as u64)
}

/// Sorts kernel records that arrive nearly in time order: holds back up to 2 × [`REORDER`],
/// sorts them (nearly sorted runs sort in about linear time) and lets the earlier half go. Exact
/// while no record arrives more than [`REORDER`] records late. Only the (time, slot) keys are
/// sorted; each record is moved into its slot once and at most once more when the held half is
/// compacted (sorting the records themselves moved each several times: most of a long report's
/// time went to copying them).
#[derive(Default)]
pub(crate) struct Reorder {
    slots: Vec<Option<Event>>,
    /// The other slot buffer, reused: the held half is compacted into it.
    spare: Vec<Option<Event>>,
    /// (time, slot), in arrival order until sorted: the stable sort keeps arrival order on ties.
    keys: Vec<(u64, u32)>,
}

impl Reorder {
    pub(crate) fn push(&mut self, ev: Event, out: &mut impl FnMut(&Event)) {
        self.keys.push((ev.header().ts_ns, self.slots.len() as u32));
        self.slots.push(Some(ev));
        if self.keys.len() >= 2 * REORDER {
            self.keys.sort_by_key(|k| k.0);
            for &(_, i) in &self.keys[..REORDER] {
                if let Some(e) = &self.slots[i as usize] {
                    out(e);
                }
            }
            // The held half, moved to the front in its sorted order.
            self.spare.clear();
            for (j, k) in self.keys[REORDER..].iter_mut().enumerate() {
                self.spare.push(self.slots[k.1 as usize].take());
                k.1 = j as u32;
            }
            std::mem::swap(&mut self.slots, &mut self.spare);
            self.keys.drain(..REORDER);
        }
    }

    pub(crate) fn drain(&mut self, out: &mut impl FnMut(&Event)) {
        self.keys.sort_by_key(|k| k.0);
        for &(_, i) in &self.keys {
            if let Some(e) = &self.slots[i as usize] {
                out(e);
            }
        }
        self.keys.clear();
        self.slots.clear();
    }
}

/// Bytes in a folio of 2^order pages. The order comes from the recording (the kernel's is at most
/// a few tens; a corrupt record's is anything): saturated, never a shift past 63 bits.
fn folio_bytes(page_size: u64, order: u32) -> u64 {
    match 1u64.checked_shl(order) {
        Some(pages) if order < 64 => page_size.saturating_mul(pages),
        _ => u64::MAX,
    }
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
    use probe_common::{EventHeader, EventKind, filemap::FilemapEvent};

    use super::*;

    /// The baseline compares work: a warm request that reused 230 of its 231 prompt tokens from
    /// the cache computed one, so it is no baseline for a request that computed all 231 (the
    /// demo's morning request read "12.5× this server's warm TTFT"); one that computed as many is.
    #[test]
    fn the_warm_baseline_counts_computed_prompt_tokens() {
        use crate::{analysis::verdict::Verdict, stream::payload::Stop};
        let mk = |id: u64, ttft: f64, timings: serde_json::Value| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(timings), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict { slow_cause: SlowCause::Compute, ttft_ms: Some(Default::default()), ..Default::default() }),
            engine: None,
        };
        let cached = mk(1, 79.0, serde_json::json!({"prompt_n": 1, "cache_n": 230}));
        let morning = mk(2, 986.0, serde_json::json!({"prompt_n": 231, "cache_n": 0}));
        let mut rs = vec![cached.clone(), morning.clone()];
        against_warm(&mut rs, &[]);
        assert!(rs[1].verdict.as_ref().unwrap().evidence.is_empty(), "{:?}", rs[1].verdict);
        // A warm request that computed 231 tokens in 300 ms is its baseline.
        let mut rs = vec![cached, morning, mk(3, 300.0, serde_json::json!({"prompt_n": 231, "cache_n": 0}))];
        rs[1].verdict.as_mut().unwrap().slow_cause = SlowCause::Load;
        against_warm(&mut rs, &[]);
        let said = &rs[1].verdict.as_ref().unwrap().evidence;
        assert!(said.iter().any(|e| e.starts_with("3.3× this server's warm TTFT for 231 computed prompt tokens (300 ms")), "{said:?}");
        // OpenAI-style usage: prompt tokens less the cached ones.
        let q = RequestRecord {
            stop: Stop {
                usage: Some(serde_json::json!({"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 480}})),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(prompt_size(&q), (20, COMPUTED));
    }

    /// A slow request is set against the same server's warm requests of a similar prompt size;
    /// with none, it says so.
    #[test]
    fn slow_requests_are_measured_against_the_warm_ones() {
        use crate::{
            analysis::verdict::{Split, Verdict},
            stream::payload::Stop,
        };
        let mk = |id: u64, ttft: f64, prompt_n: u64, cause: SlowCause, unexplained: f64| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(serde_json::json!({"prompt_n": prompt_n, "cache_n": 0})), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict { slow_cause: cause, ttft_ms: Some(Split { unexplained, ..Default::default() }), ..Default::default() }),
            engine: None,
        };
        let mut rs = vec![
            mk(1, 100.0, 250, SlowCause::None, 0.0),
            mk(2, 120.0, 240, SlowCause::Compute, 0.0),
            mk(3, 340.0, 250, SlowCause::CpuContention, 0.0),
            // Ten times the prompt: no peer.
            mk(4, 900.0, 2500, SlowCause::Disk, 300.0),
        ];
        against_warm(&mut rs, &[]);
        let said = |i: usize| rs[i].verdict.as_ref().unwrap().evidence.clone();
        assert!(
            said(2).iter().any(|e| e
                == "2.8× this server's warm TTFT for 250 computed prompt tokens (120 ms, the median of 2 warm request(s) in this trace)"),
            "{:?}",
            said(2)
        );
        assert!(said(3).iter().any(|e| e.starts_with("no warm baseline in this trace")), "{:?}", said(3));
        assert!(rs[3].verdict.as_ref().unwrap().data_quality.iter().any(|d| d == "33% of the TTFT is unexplained (300 ms)"));
        // The warm ones are near their own baseline: nothing said.
        assert!(said(0).is_empty() && said(1).is_empty(), "{:?} {:?}", said(0), said(1));
        // Far over it with no cause by the absolute rules: not none. Queue explains the excess
        // in one; nothing does in the other.
        let mut queued = mk(5, 400.0, 250, SlowCause::None, 0.0);
        let split = queued.verdict.as_mut().unwrap().ttft_ms.as_mut().unwrap();
        (split.queue, split.compute) = (200.0, 110.0);
        let mut rs2 = vec![
            mk(1, 100.0, 250, SlowCause::None, 0.0),
            mk(2, 120.0, 240, SlowCause::Compute, 0.0),
            queued,
            mk(6, 500.0, 250, SlowCause::None, 350.0),
        ];
        against_warm(&mut rs2, &[]);
        assert_eq!(rs2[2].verdict.as_ref().unwrap().slow_cause, SlowCause::Queue);
        let v = rs2[3].verdict.as_ref().unwrap();
        assert_eq!(v.slow_cause, SlowCause::None);
        assert!(v.data_quality.iter().any(|d| d.contains("380 ms slower than this server's warm requests")), "{:?}", v.data_quality);
    }

    /// Per-token time that grew over the warm baseline while other processes held the CPUs is
    /// cpu_contention (a pool spinning at barriers for a preempted peer); the same growth on
    /// CPUs nobody else held is the server's own work.
    #[test]
    fn grown_work_beside_other_processes_is_contention() {
        use crate::{
            analysis::verdict::{Competitor, Split, Verdict},
            stream::payload::Stop,
        };
        let mk = |id: u64, ttft: f64, split: Split, held: f64| Request {
            record: RequestRecord {
                id,
                ttft_ms: Some(ttft),
                stop: Stop { server_timings: Some(serde_json::json!({"prompt_n": 280, "cache_n": 0})), ..Default::default() },
                ..Default::default()
            },
            verdict: Some(Verdict {
                slow_cause: SlowCause::Compute,
                ttft_ms: Some(split),
                competitors: if held > 0.0 {
                    vec![Competitor { pid: 42, comm: Some("backup".into()), cgroup: None, ms: held, held_ms: None }]
                } else {
                    vec![]
                },
                ..Default::default()
            }),
            engine: None,
        };
        let warm = || mk(1, 800.0, Split { compute: 800.0, ..Default::default() }, 0.0);
        let warm2 = || mk(1, 50.0, Split { compute: 50.0, ..Default::default() }, 0.0);
        // The critical path waited 815 ms; the pool's threads 2900 ms in all.
        let busy = mk(2, 3560.0, Split { compute: 2745.0, cpu_contention: 815.0, ..Default::default() }, 2900.0);
        let mut rs = vec![warm(), busy.clone()];
        against_warm(&mut rs, &[]);
        let v = rs[1].verdict.as_ref().unwrap();
        let s = v.ttft_ms.as_ref().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (800.0, 2760.0), "{v:?}");
        assert_eq!(v.slow_cause, SlowCause::CpuContention);
        assert!(
            v.evidence.iter().any(|e| e.contains("the 1945 ms it grew is cpu_contention") && e.contains("backup (pid 42)")),
            "{:?}",
            v.evidence
        );
        // Others held the CPUs 13 ms in all while the request faulted its memory back in from swap
        // and ran slower after: 13 ms is contention at most, the rest stays its own work (CI: the
        // whole growth was called contention, and the verdict lost `memory`).
        let mut swapped = mk(4, 490.0, Split { compute: 267.0, memory: 220.0, cpu_contention: 12.0, ..Default::default() }, 12.7);
        swapped.verdict.as_mut().unwrap().slow_cause = SlowCause::Memory;
        let mut rs = vec![warm2(), swapped];
        against_warm(&mut rs, &[]);
        let v = rs[1].verdict.as_ref().unwrap();
        assert_eq!(v.slow_cause, SlowCause::Memory, "{v:?}");
        assert!(v.ttft_ms.as_ref().unwrap().cpu_contention <= 12.7 + 1e-9, "{v:?}");
        // Nobody else held the CPUs: the growth stays the server's own work.
        let alone = mk(3, 3560.0, Split { compute: 3560.0, ..Default::default() }, 0.0);
        let mut rs = vec![warm(), alone];
        against_warm(&mut rs, &[]);
        let s = rs[1].verdict.as_ref().unwrap().ttft_ms.clone().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (3560.0, 0.0));
        // Under 20% grown: caches shared with the other job, still compute.
        let near = mk(4, 1300.0, Split { compute: 900.0, cpu_contention: 400.0, ..Default::default() }, 400.0);
        let mut rs = vec![warm(), near];
        against_warm(&mut rs, &[]);
        let s = rs[1].verdict.as_ref().unwrap().ttft_ms.clone().unwrap();
        assert_eq!((s.compute, s.cpu_contention), (900.0, 400.0));
    }

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

    /// Only the last request of a connection takes its close; one whose connection carried
    /// another request afterwards stays "kept open", and a later connection on a reused port
    /// does not stop the close from being taken.
    #[test]
    fn a_close_after_the_answer_belongs_to_the_connections_last_request() {
        let q = |id: u64, peer: &str, arrival: f64| Request {
            record: RequestRecord {
                id,
                local: "127.0.0.1:8080".into(),
                peer: peer.into(),
                arrival_ms: Some(arrival),
                end_ms: Some(10.0),
                ..Default::default()
            },
            verdict: None,
            engine: None,
        };
        let c = |peer: &str, opened: f64, closed: f64, by: Closer| Connection {
            local: "127.0.0.1:8080".into(),
            peer: peer.into(),
            opened_ms: Some(opened),
            closed_ms: Some(closed),
            closed_by: by,
            ..Default::default()
        };
        let mut r = Report {
            // Keep-alive: 1 then 2 on one connection, the server closes after 2. Then 3 and 4 on
            // connections of one reused port: 3's closed by its client before 4 came.
            requests: vec![
                q(1, "127.0.0.1:40000", 0.0),
                q(2, "127.0.0.1:40000", 20.0),
                q(3, "127.0.0.1:40001", 100.0),
                q(4, "127.0.0.1:40001", 200.0),
            ],
            connections: vec![
                c("127.0.0.1:40000", 0.0, 30.1, Closer::Local),
                c("127.0.0.1:40001", 99.0, 150.0, Closer::Peer),
                c("127.0.0.1:40001", 199.0, 250.0, Closer::Local),
            ],
            ..Default::default()
        };
        closes_after_the_response(&mut r);
        let by: Vec<ClosedBy> = r.requests.iter().map(|q| q.closed_by).collect();
        assert_eq!(by, [ClosedBy::None, ClosedBy::Server, ClosedBy::Client, ClosedBy::Server]);
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
