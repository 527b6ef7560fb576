//! `probe trace`: attach, drain the ring buffer into the recording as events arrive, follow the
//! target's mappings and files, and stop on Ctrl-C, SIGTERM, the duration or the target's exit.
use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::maps::MapData;
use probe_common::{
    mmap::MmapOp,
    proc::{PROC_EXIT, PROC_FORK},
};

use crate::{
    analysis::report::Report,
    kernel::probes,
    kernel::unwind::Unwinders,
    monotonic_ns,
    os::procfs,
    record::decode::{self, Event},
    record::{
        self, Writer,
        records::{self, UserRecord},
    },
    stream,
};

/// Distinct (kind, outermost frame) pairs of cut stacks counted; those named per kind; the
/// largest module read to name them.
const MAX_CUT_TOPS: usize = 4096;
const CUT_FRAMES_PER_KIND: usize = 3;
const CUT_MODULE_MAX: u64 = 64 << 20;

pub struct TraceOptions {
    pub pid: u32,
    pub duration: Option<Duration>,
    pub out: PathBuf,
    /// Replace a recording already in `out` (the caller's own).
    pub force: bool,
    pub only: Option<Vec<String>>,
    pub ring_bytes: u32,
    /// On-CPU sampling frequency (Hz).
    pub sample_hz: u64,
    /// Keep the bytes of request streams in the recording (off by default: prompts and answers
    /// are private).
    pub capture_text: bool,
    /// Walk CPython threads' frame chains (record::python).
    pub python_frames: bool,
    /// Percent of one core their own work may take (0: no limit; record::python::Budget).
    pub python_budget: f64,
    /// GPU / CPU-frequency / memory samples per second (0: off).
    pub host_hz: f64,
    /// Poll the server's own HTTP endpoints (/metrics, /props, /api/ps).
    pub poll: bool,
    /// When the process started: "armed in N ms" counts from here.
    pub started: Instant,
    /// `--max-size`: end the trace once the recording holds this many bytes (and the text the
    /// user gave, for the end reason).
    pub max_size: Option<(u64, String)>,
    /// `probe watch`: the recording is a window of segment files, requests and segments go to
    /// the watcher as they complete, and no report is made at the end.
    pub watch: Option<std::sync::Arc<crate::collector::segments::Link>>,
    /// Off-CPU stacks only for uninterruptible waits (see probes::Options).
    pub offcpu_d_only: bool,
    /// The most user-stack bytes a record copies (0: the largest copy; see probes::Options).
    pub stack_limit: u32,
    /// Take and keep verified programs across traces (see probes::Options; `--no-keep`).
    pub keep: crate::kernel::kept::Keep,
    /// Send the requests as OpenTelemetry spans here at the end (`--otlp`).
    pub otlp: Option<crate::render::export::otlp::Endpoint>,
    /// Trace every process of this cgroup (`--cgroup`, `--container`), as they join it; the
    /// trace ends when the cgroup has none left rather than when `pid` exits.
    pub cgroup: Option<PathBuf>,
    /// No live view on a terminal (`--quiet`).
    pub quiet: bool,
    /// Say what arming took, stage by stage (`-v`).
    pub verbose: bool,
    /// Join the node's one set of programs instead of loading them (`watch --all`).
    pub node: Option<std::sync::Arc<hub::Node>>,
    /// Set by whoever runs this trace on a thread of its own (`watch --all`): stop now.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Headers for this server's own endpoints when they are not the process's (`watch --all`
    /// scopes credentials per server).
    pub headers: Option<Vec<(String, String)>>,
}

pub struct TraceOutcome {
    pub report: Report,
    /// Probes were skipped or events were lost: the recording is usable but incomplete.
    pub partial: bool,
    /// Why the trace ended ("target exited", "interrupted (Ctrl-C)", ...).
    pub reason: String,
    /// The target exited (rather than probe being stopped).
    pub target_exited: bool,
}

/// The most records one turn of the drain loop takes from the ring buffer, and the most time it
/// spends there: then the loop looks at signals, the clock and the samplers, and comes back at
/// once (the ring stays marked readable). Unbounded, a producer faster than this consumer kept
/// the loop draining, and Ctrl-C, SIGTERM and `--duration` were never seen.
const DRAIN_RECORDS: usize = 4096;
const DRAIN_TIME: Duration = Duration::from_millis(10);
/// Most threads whose last off-CPU user stack is kept (the kernel's USTACK_SEEN holds as many).
const LAST_USER_STACKS: usize = 16384;
/// Most places (off-CPU, block IO, fault) whose last stacks are kept (as many as the kernel's USTACK_SEEN holds).
const LAST_PLACE_STACKS: usize = LAST_USER_STACKS * probe_common::stack::STACK_SLOTS;
/// At most this many other processes are named (the competitors for a CPU on a busy box).
const MAX_OTHERS: usize = 4096;
/// Connections whose credential-masking state is kept at once (as many as the stream tracker).
const MAX_CREDENTIAL_STREAMS: usize = crate::stream::MAX_CONNS * 2;
/// Files told to the kernel at most (its TARGET_FILES map holds 4096).
const MAX_FILES_TOLD: usize = 4000;

/// A request in flight this long gets a snapshot record (see `StreamTracker::snapshots`).
const SNAPSHOT_AGE_NS: u64 = 500_000_000;
/// How often the requests in flight are looked at for snapshots.
const SNAPSHOT_EVERY: Duration = Duration::from_millis(250);
/// How often the ring is drained while records flow, and after a turn that found none. Each turn
/// is a wake-up (tens of µs on a VM before any work), so: every 100 ms while records flow (the
/// kernel wakes the drain sooner for a backlog, `probe_common::wakeup_shift`, and for the first
/// socket data after a quiet spell: a request's arrival is read at once).
const DRAIN_TICK: Duration = Duration::from_millis(100);
/// After a quiet turn: once a second (each look at an idle ring is a wake-up, and a timer's
/// deadline 200 ms out took two; a request's arrival wakes the drain at once).
const IDLE_DRAIN: Duration = Duration::from_secs(1);
/// The cumulative `stats` record is written every second while records flow, this often while
/// none do (and always at the stop).
const IDLE_STATS: Duration = Duration::from_secs(5);
/// Records a second from which the target counts as busy for the samplers (an idle
/// llama-server makes about ten).
const BUSY_EVENTS: u64 = 200;
/// How long the samplers get to stop at the end; a thread still busy then (a server trickling
/// its `/metrics`) is left behind, not waited for.
const SAMPLER_STOP: Duration = Duration::from_secs(1);
/// Kept free on the recording's disk from the start (`.reserve`) and given back when the disk
/// fills (and at the end): room for the end record and report.json (a few hundred KiB; its
/// long lists are capped, its requests are not).
const RESERVE_BYTES: u64 = 1 << 20;

pub fn trace(opts: TraceOptions) -> anyhow::Result<TraceOutcome> {
    let entered = Instant::now();
    // Whether every CPU is busy is known by the time the drain starts (yielding::Yielding).
    crate::os::yielding::prime();
    let popts = probes::Options {
        pid: opts.pid,
        only: opts.only.clone(),
        ring_bytes: opts.ring_bytes,
        sample_hz: opts.sample_hz,
        offcpu_d_only: opts.offcpu_d_only,
        stack_limit: opts.stack_limit,
        keep: opts.keep,
        more: opts.cgroup.as_deref().map(crate::os::cgroup::procs).unwrap_or_default().into_iter().filter(|&p| p != opts.pid).collect(),
    };
    // Then the output: a refused --out costs nothing to attach (or to detach).
    probes::preflight(&popts)?;
    let out_dir = crate::util::output::OutDir::create_recording(&opts.out, opts.force)?;
    let before = vec![
        ("startup".to_string(), (entered - opts.started).as_secs_f64() * 1e3),
        ("output".to_string(), entered.elapsed().as_secs_f64() * 1e3),
    ];
    let load = || match &opts.node {
        Some(node) => node.join(&popts).map(Kernel::Member),
        None => probes::attach(&popts).map(Kernel::Own),
    };
    let attached = match out_dir.reserve(RESERVE_BYTES).map_err(|e| reserve_error(&opts.out, e)).and_then(|()| load()) {
        Ok(mut k) => {
            match &mut k {
                Kernel::Own(a) => a.stages.splice(0..0, before),
                Kernel::Member(m) => m.stages.splice(0..0, before),
            };
            k
        }
        Err(e) => {
            // Nothing was recorded: leave no empty directory behind (rmdir removes only an empty one).
            out_dir.release_reserve();
            let _ = std::fs::remove_dir(&opts.out);
            return Err(e);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let r = rt.block_on(session::run(opts, attached, &out_dir));
    out_dir.release_reserve();
    r
}

/// The kernel side a trace runs on: probe's programs loaded for it alone, or its place in the
/// node's one set (`watch --all`, [`hub`]).
pub enum Kernel {
    Own(probes::Attached),
    Member(hub::Member),
}

fn reserve_error(out: &std::path::Path, e: std::io::Error) -> anyhow::Error {
    if record::is_disk_full(&e) {
        anyhow::anyhow!(
            "the disk holding {} has less than {} KiB free ({e}): free some space or give --out a directory on another disk",
            out.display(),
            RESERVE_BYTES >> 10
        )
    } else {
        anyhow::Error::new(e).context(format!("cannot write in {}", out.display()))
    }
}

/// A line on stderr. After a hangup (the terminal closed) stderr may be gone: that is no
/// reason to stop before the recording is finished (`eprintln!` would panic).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "{}", crate::util::text::log_line(format_args!($($t)*)));
    }};
}

mod counters;
mod drain;
pub mod hub;
pub mod live;
pub mod peer;
pub mod segments;
mod session;
mod stacks;

pub use counters::own_cpu_ns;
use counters::{stats, sum};
use drain::drain_turn;
pub(crate) use drain::{Records, SPILL_MAX, Spill};

struct State {
    writer: Writer,
    capture_text: bool,
    /// With --capture-text: credential masking carried across reads, per (socket, direction).
    credentials: HashMap<(u64, u8), crate::util::redact::CredentialStream>,
    /// When the requests in flight were last looked at for snapshots.
    last_snapshot: Instant,
    streams: stream::Tracker,
    unwinders: Unwinders,
    /// Kernel addresses named while they mean something (see crate::analysis::ksyms).
    ksyms: crate::analysis::ksyms::Resolver,
    /// Records copied out of the ring unread while every CPU was busy.
    pub(crate) spill: Spill,
    /// Drain turns that stopped early, preempted at idle priority ([`drain::TurnMode::polite`]).
    pub(crate) yielded_turns: u64,
    /// Off-CPU stacks waiting for their thread to run again (by tid).
    offcpu: HashMap<u32, record::StackRecord>,
    /// Where to tell the kernel how many user-stack bytes each thread needs, and what was told.
    ustack_need: Option<aya::maps::HashMap<MapData, u32, u64>>,
    /// The kernel's list of the targets' stack mappings ([`probe_common::stack::StackSpans`]), and
    /// the keys written there for each process (replaced when its mappings change).
    stack_ranges: Option<aya::maps::HashMap<MapData, probe_common::stack::StackKey, probe_common::stack::StackSpans>>,
    stack_keys: HashMap<u32, Vec<probe_common::stack::StackKey>>,
    /// The kernel's names of the processes charged with waits ([`probe_common::maps::OTHER_COMMS`]).
    other_comms: Option<aya::maps::HashMap<MapData, u32, [u8; 16]>>,
    /// CPython targets: their threads in the kernel's map (where each one's frame chain starts)
    /// and the names of the Python frames seen.
    python: crate::kernel::python::Pythons,
    py_threads: Option<aya::maps::HashMap<MapData, u32, probe_common::python::PyThread>>,
    py_budget: Option<crate::kernel::python::Budget>,
    /// Where to tell the kernel which files the targets map (their block IO is the target's
    /// whoever issues it), and the files told.
    target_files: Option<aya::maps::HashMap<MapData, probe_common::blockio::FileId, u32>>,
    files_told: HashSet<(u32, u32, u64)>,
    need_told: HashMap<u32, (u32, u64)>,
    /// How each thread's told need may shrink (stacks.rs, `Shrink`).
    need_shrink: HashMap<u32, stacks::Shrink>,
    /// Cut user stacks by (kind, outermost frame), and the modules' paths: named at the end.
    cut_tops: HashMap<(record::StackKind, (i64, u64)), u64>,
    module_paths: HashMap<i64, String>,
    /// Each thread's last stack at each of its places (tid, the kernel's slot: off-CPU, block IO
    /// and fault records share them), for the records that refer to it.
    last_at_place: HashMap<(u32, u8), stacks::LastAtPlace>,
    root: u32,
    root_exited: bool,
    /// A cgroup is traced: the root's exit does not end the trace, an empty cgroup does.
    follow_cgroup: bool,
    /// The target set, shared with the samplers.
    targets: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
    events: u64,
    per_kind: [u64; probe_common::MAX_KINDS as usize],
    dirty_maps: HashSet<u32>,
    dirty_files: HashSet<u32>,
    last_maps: HashMap<u32, Vec<procfs::Mapping>>,
    known_files: HashSet<(u32, u32, u64)>,
    /// Executable files the engine probe searched, and mappings of new ones to search (by the
    /// once-a-second turn, which holds the programs).
    engine_seen: HashSet<crate::os::target_file::Ident>,
    engine_new: Vec<(u32, procfs::Mapping)>,
    last_file_scan: HashMap<u32, Instant>,
    /// Threads seen (named in a `threads` record, or being named at the next refresh): tid →
    /// pid, forgotten when the process exits.
    threads_seen: HashMap<u32, u32>,
    threads_new: Vec<(u32, u32)>,
    /// Processes seen running while a target thread waited for a CPU: named once each.
    others_seen: HashSet<u32>,
    others_new: Vec<u32>,
    /// `--max-size` in bytes.
    max_bytes: Option<u64>,
    watch: Option<std::sync::Arc<crate::collector::segments::Link>>,
    /// The live view's figures (on a terminal only).
    live: Option<crate::collector::live::Live>,
}
// What the collector keeps per process (`last_maps`, `last_file_scan`, `dirty_*`, the
// threads and off-CPU stacks of its threads) goes when the process exits. What stays for the
// whole trace: `known_files` (one entry per distinct file the targets map or open) and the
// threads of a live process that come and go (bounded by the kernel's pid_max); the stream
// tracker, unwinders and kernel symbols bound their own tables.

impl State {
    /// A process joined the trace (see [`probes::add_target`]): its maps, files and unwinder.
    fn add_target(&mut self, pid: u32) {
        if let Ok(mut t) = self.targets.lock() {
            t.push(pid);
        }
        self.dirty_maps.insert(pid);
        self.dirty_files.insert(pid);
        self.unwinders.prepare(pid);
    }

    fn new(writer: Writer, start_ns: u64, root: u32, targets: &[u32], capture_text: bool) -> State {
        State {
            writer,
            capture_text,
            credentials: HashMap::new(),
            last_snapshot: Instant::now(),
            streams: stream::Tracker::new(start_ns, capture_text),
            unwinders: Unwinders::default(),
            ksyms: crate::analysis::ksyms::Resolver::default(),
            spill: Spill::default(),
            yielded_turns: 0,
            offcpu: HashMap::new(),
            last_at_place: HashMap::new(),
            cut_tops: HashMap::new(),
            module_paths: HashMap::new(),
            ustack_need: None,
            stack_ranges: None,
            stack_keys: HashMap::new(),
            other_comms: None,
            python: Default::default(),
            py_threads: None,
            py_budget: None,
            target_files: None,
            files_told: HashSet::new(),
            need_told: HashMap::new(),
            need_shrink: HashMap::new(),
            root,
            root_exited: false,
            follow_cgroup: false,
            targets: std::sync::Arc::new(std::sync::Mutex::new(targets.to_vec())),
            events: 0,
            per_kind: [0; probe_common::MAX_KINDS as usize],
            dirty_maps: targets.iter().copied().collect(),
            dirty_files: targets.iter().copied().collect(),
            last_maps: HashMap::new(),
            known_files: HashSet::new(),
            engine_seen: HashSet::new(),
            engine_new: Vec::new(),
            last_file_scan: HashMap::new(),
            threads_seen: HashMap::new(),
            threads_new: vec![],
            others_seen: HashSet::new(),
            others_new: vec![],
            max_bytes: None,
            watch: None,
            live: None,
        }
    }

    fn on_record(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.events += 1;
        let Ok(ev) = decode::decode(bytes) else {
            return self.writer.kernel(bytes);
        };
        self.per_kind[ev.kind() as usize] += 1;
        let h = ev.header();
        if h.pid != 0 && self.threads_seen.insert(h.tid, h.pid).is_none() {
            self.threads_new.push((h.pid, h.tid));
            self.python.new_thread(h.pid);
        }
        // Stream bytes are parsed here and dropped unless the user asked to keep them; raw stacks
        // (which hold user memory) are unwound here and only their frames are kept.
        if let (Event::Data(d), true) = (&ev, self.capture_text) {
            // Kept text never keeps credentials: Authorization, Cookie, X-Api-Key values and secret
            // query parameters are overwritten (same length) before the bytes reach the file,
            // however the reads split them (state per connection and direction).
            let mut copy = bytes.to_vec();
            let head = bytes.len() - decode::data_payload(bytes).len();
            if self.credentials.len() >= MAX_CREDENTIAL_STREAMS {
                self.credentials.clear();
            }
            self.credentials.entry((d.sk, d.dir)).or_default().mask(&mut copy[head..]);
            self.writer.kernel(&copy)?;
        } else if !matches!(ev, Event::Data(_) | Event::Stack(_) | Event::Sched(_) | Event::PyStack(_)) {
            self.writer.kernel(bytes)?;
        }
        match ev {
            // Merged into the stack record that follows (record::python).
            Event::PyStack(p) => self.python.frames(p),
            Event::Stack(s) => self.on_stack(&s, decode::data_payload(bytes))?,
            Event::Sched(e) if probe_common::stack::is_cpu_wait(e.flags) => {
                // Run-queue wait: kept as it is, with what ran instead named once.
                self.writer.kernel(bytes)?;
                let other = e.hdr.pid;
                // Behind the server's own threads is its own work sharing the CPUs, not a wait
                // the live view names.
                if let Some(l) = &mut self.live
                    && !self.targets.lock().is_ok_and(|t| t.contains(&other))
                {
                    l.cpu_wait(other, e.blocked_ns);
                }
                if other != 0 && self.others_seen.len() < MAX_OTHERS && self.others_seen.insert(other) {
                    self.others_new.push(other);
                }
            }
            // The hypervisor's steal while a thread ran: kept as it is.
            Event::Sched(e) if probe_common::stack::is_steal(e.flags) => self.writer.kernel(bytes)?,
            Event::Sched(e) => {
                if let Some(mut v) = self.offcpu.remove(&e.tid) {
                    v.blocked_ns = Some(e.blocked_ns);
                    v.waker = probe_common::stack::waker_of(e.flags).filter(|&w| w != e.tid);
                    self.writer.stack(&v)?;
                }
            }
            Event::Data(d) => self.streams.on_data(&d, decode::data_payload(bytes)),
            Event::Sock(s) => {
                // A closed connection's masking state goes with it (a new one on the same socket
                // address starts clean).
                if self.capture_text && s.newstate == probe_common::sock::TCP_CLOSE && s.what == probe_common::sock::SOCK_STATE {
                    self.credentials.remove(&(s.skaddr, 0));
                    self.credentials.remove(&(s.skaddr, 1));
                }
                self.streams.on_sock(&s)
            }
            Event::Mmap(m) => {
                if matches!(MmapOp::try_from(m.op), Ok(MmapOp::Mmap | MmapOp::Munmap | MmapOp::Mremap)) {
                    self.dirty_maps.insert(m.hdr.pid);
                }
            }
            Event::Proc(p) if p.op == PROC_FORK => {
                if let Ok(mut t) = self.targets.lock() {
                    t.push(p.child);
                }
                self.dirty_maps.insert(p.child);
                self.dirty_files.insert(p.child);
            }
            Event::Proc(p) if p.op == PROC_EXIT => {
                if let Ok(mut t) = self.targets.lock() {
                    t.retain(|&x| x != p.hdr.pid);
                }
                if p.hdr.pid == self.root && !self.follow_cgroup {
                    self.root_exited = true;
                }
                if p.group_dead != 0 {
                    self.unwinders.exited(p.hdr.pid);
                }
                self.forget(p.hdr.pid, p.hdr.ts_ns)?;
            }
            Event::Filemap(f) if !self.known_files.contains(&(f.dev >> 20, f.dev & 0xfffff, f.ino)) => {
                self.dirty_files.insert(f.hdr.pid);
            }
            Event::BlockIo(b) => {
                if let Some(l) = &mut self.live {
                    l.block(&b);
                }
            }
            Event::Engine(e) => {
                if let Some(l) = &mut self.live {
                    l.engine(&e);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The process `pid` exited: drop what was kept for it. Its threads' off-CPU stacks still
    /// waiting are written, blocked until the exit.
    fn forget(&mut self, pid: u32, ts_ns: u64) -> std::io::Result<()> {
        self.last_maps.remove(&pid);
        self.last_file_scan.remove(&pid);
        self.dirty_maps.remove(&pid);
        self.dirty_files.remove(&pid);
        self.threads_seen.retain(|_, p| *p != pid);
        self.last_at_place.retain(|_, l| l.pid != pid);
        let gone: Vec<u32> = self.offcpu.iter().filter(|(_, v)| v.pid == pid).map(|(&tid, _)| tid).collect();
        for tid in gone {
            if let Some(mut v) = self.offcpu.remove(&tid) {
                v.blocked_ns = Some(ts_ns.saturating_sub(v.ts_ns));
                self.writer.stack(&v)?;
            }
        }
        Ok(())
    }

    /// The drain should pause: the disk is full or the recording reached `--max-size`.
    fn stop_writing(&self) -> bool {
        self.writer.disk_full().is_some() || self.max_bytes.is_some_and(|m| self.writer.bytes >= m)
    }

    /// Write the requests that finished, and a snapshot of each one in flight for half a second
    /// (kept if the recording is torn before it ends).
    fn write_requests(&mut self) -> std::io::Result<()> {
        // Not every drain turn (100 ms while busy): the scan walks every pending request.
        if self.last_snapshot.elapsed() >= SNAPSHOT_EVERY {
            self.last_snapshot = Instant::now();
            self.streams.expire_seeds(crate::monotonic_ns());
            for r in self.streams.snapshots(crate::monotonic_ns(), SNAPSHOT_AGE_NS) {
                self.writer.record(&UserRecord::Request(Box::new(r)))?;
            }
        }
        for r in self.streams.take_done() {
            if let Some(l) = &mut self.live {
                l.done(&r);
            }
            let r = UserRecord::Request(Box::new(r));
            self.writer.record(&r)?;
            if let Some(w) = &self.watch
                && let UserRecord::Request(r) = r
            {
                w.send(crate::collector::segments::Msg::Request(r));
            }
        }
        Ok(())
    }

    /// Re-read /proc for processes whose mappings or files changed; write what is new.
    fn refresh(&mut self) -> std::io::Result<()> {
        self.write_requests()?;
        self.name_threads()?;
        self.name_others()?;
        for pid in std::mem::take(&mut self.dirty_maps) {
            self.snapshot_maps(pid)?;
        }
        let now = Instant::now();
        let due: Vec<u32> = self
            .dirty_files
            .iter()
            .copied()
            .filter(|p| self.last_file_scan.get(p).is_none_or(|t| now - *t > Duration::from_millis(200)))
            .collect();
        for pid in due {
            self.dirty_files.remove(&pid);
            self.last_file_scan.insert(pid, now);
            self.snapshot_files(pid)?;
        }
        Ok(())
    }

    /// Name the processes that ran while a target thread waited for a CPU (comm and cgroup, as
    /// /proc has them now; one that already exited stays a pid).
    fn name_others(&mut self) -> std::io::Result<()> {
        if self.others_new.is_empty() {
            return Ok(());
        }
        // One that exited before its record was read (probe held back while every CPU was busy,
        // a compiler's short jobs) keeps the name the kernel saw, without its cgroup.
        let kernel = |pid: u32| -> Option<String> {
            let c = self.other_comms.as_ref()?.get(&pid, 0).ok()?;
            let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
            Some(String::from_utf8_lossy(&c[..end]).into_owned()).filter(|s| !s.is_empty())
        };
        let procs: Vec<records::OtherProc> = std::mem::take(&mut self.others_new)
            .into_iter()
            .filter_map(|pid| {
                if procfs::exists(pid) {
                    Some(records::OtherProc { pid, comm: procfs::comm(pid), cgroup: crate::os::cgroup::of_pid(pid) })
                } else {
                    Some(records::OtherProc { pid, comm: kernel(pid)?, cgroup: None })
                }
            })
            .collect();
        if procs.is_empty() {
            return Ok(());
        }
        self.writer.record(&UserRecord::Procs(records::Procs { ts_ns: monotonic_ns(), procs }))
    }

    /// Name the threads seen since the last refresh (a thread that already exited stays unnamed).
    fn name_threads(&mut self) -> std::io::Result<()> {
        if self.threads_new.is_empty() {
            return Ok(());
        }
        let threads: Vec<(u32, u32, String)> = std::mem::take(&mut self.threads_new)
            .into_iter()
            .filter_map(|(pid, tid)| Some((pid, tid, procfs::thread_comm(pid, tid)?)))
            .collect();
        if threads.is_empty() {
            return Ok(());
        }
        self.writer.record(&UserRecord::Threads(records::Threads { ts_ns: monotonic_ns(), threads }))
    }

    /// Tell the kernel which of `pid`'s mappings may hold its threads' stacks (a thread started
    /// since has its stack in a new one): by the 2 MiB they overlap, the keys of before removed.
    fn list_stacks(&mut self, pid: u32) {
        let Some(map) = self.stack_ranges.as_mut() else { return };
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return };
        let mut spans: HashMap<probe_common::stack::StackKey, probe_common::stack::StackSpans> = HashMap::new();
        for (start, end) in procfs::stack_mappings(&text, 4096) {
            for k in probe_common::stack::stack_keys(pid, start, end) {
                spans.entry(k).or_default().add(start, end);
            }
        }
        for k in self.stack_keys.remove(&pid).unwrap_or_default() {
            if !spans.contains_key(&k) {
                let _ = map.remove(&k);
            }
        }
        let mut written = Vec::with_capacity(spans.len());
        for (k, v) in spans {
            match map.insert(k, v, 0) {
                Ok(()) => written.push(k),
                Err(e) => {
                    log::debug!("stack mappings of {pid} not all listed for the kernel: {e}");
                    break;
                }
            }
        }
        self.stack_keys.insert(pid, written);
    }

    fn snapshot_maps(&mut self, pid: u32) -> std::io::Result<()> {
        let Ok(maps) = procfs::read_maps(pid) else { return Ok(()) };
        if self.last_maps.get(&pid) == Some(&maps) {
            return Ok(());
        }
        self.list_stacks(pid);
        self.unwinders.update(pid, &maps);
        for m in &maps {
            self.known_files.insert((m.major, m.minor, m.inode));
            if m.inode != 0
                && self.files_told.len() < MAX_FILES_TOLD
                && let Some(t) = self.target_files.as_mut()
                && self.files_told.insert((m.major, m.minor, m.inode))
            {
                let id = probe_common::blockio::FileId { ino: m.inode, dev: (m.major << 20) | (m.minor & 0xfffff), _pad: 0 };
                let _ = t.insert(id, pid, 0);
            }
            if m.perms.contains('x') && self.engine_seen.insert(crate::os::target_file::Ident::of(m)) {
                self.engine_new.push((pid, m.clone()));
            }
        }
        let r = UserRecord::Maps(records::Maps { pid, ts_ns: monotonic_ns(), mappings: maps });
        self.writer.record(&r)?;
        if let UserRecord::Maps(m) = r {
            self.last_maps.insert(pid, m.mappings);
        }
        Ok(())
    }

    fn snapshot_files(&mut self, pid: u32) -> std::io::Result<()> {
        let files: Vec<_> = procfs::open_files(pid).into_iter().filter(|f| self.known_files.insert((f.major, f.minor, f.inode))).collect();
        if !files.is_empty() {
            self.writer.record(&UserRecord::Files(records::Files { pid, ts_ns: monotonic_ns(), files }))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use probe_common::{EventHeader, EventKind, fault::FaultEvent, proc::ProcEvent};

    use super::*;

    fn hdr(kind: EventKind, pid: u32, tid: u32, ts_ns: u64) -> EventHeader {
        EventHeader { kind: kind as u32, pid, tid, cpu: 0, ts_ns }
    }

    /// Records copied out unread come back in order, whole, and the memory goes once read.
    #[test]
    fn spilled_records_come_back_in_order() {
        let mut s = Spill::default();
        assert!(s.is_empty() && s.has_room());
        for r in [&b"first"[..], b"", b"third record"] {
            s.push(r);
        }
        let mut got: Vec<Vec<u8>> = Vec::new();
        while let Some(r) = s.take(&mut |item| {
            got.push(item.to_vec());
            Ok(())
        }) {
            r.unwrap();
        }
        assert_eq!(got, vec![b"first".to_vec(), vec![], b"third record".to_vec()]);
        assert!(s.is_empty() && s.at == 0, "read through: empty again, its memory kept for the next");
        s.push(b"again");
        assert!(
            s.take(&mut |item| {
                assert_eq!(item, b"again");
                Ok(())
            })
            .is_some()
        );
    }

    /// A prepared spill copies into memory faulted in ahead (by its idle-priority thread): the
    /// first spill, which comes while the server keeps every CPU busy, takes no page faults.
    #[test]
    fn a_prepared_spill_copies_without_faulting() {
        fn minor_faults() -> i64 {
            // SAFETY: getrusage writes the struct it is given.
            let mut u: libc::rusage = unsafe { std::mem::zeroed() };
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
            u.ru_minflt
        }
        const BYTES: usize = 4 << 20;
        let rec = vec![7u8; 64 << 10];
        let mut s = Spill::prepared(BYTES);
        let t = Instant::now();
        while !s.adopt_ready() {
            assert!(t.elapsed() < Duration::from_secs(60), "the prepared memory never came");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(s.buf.capacity() >= BYTES && s.buf.is_empty());
        let before = minor_faults();
        while s.buf.len() + rec.len() + 4 <= BYTES {
            s.push(&rec);
        }
        let faults = minor_faults() - before;
        assert!(faults < 16, "{faults} page faults copying {} bytes into prepared memory", s.buf.len());
        let mut n = 0;
        while let Some(r) = s.take(&mut |item| {
            assert_eq!(item, &rec[..]);
            Ok(())
        }) {
            r.unwrap();
            n += 1;
        }
        assert_eq!(n, BYTES / (rec.len() + 4));
        assert!(s.buf.capacity() >= BYTES, "read through: the memory is kept for the next spill");
        // Fresh memory, the way it was: a page fault for each page (THP may make one of a few).
        let mut fresh = Spill::default();
        let before = minor_faults();
        for _ in 0..16 {
            fresh.push(&rec);
        }
        assert!(minor_faults() - before >= 4, "the check above can see faults");
    }

    /// What the collector keeps per process goes when the process exits: a server that starts a
    /// child per request does not grow the collector's tables for the whole trace.
    #[test]
    fn a_process_that_exits_is_forgotten() {
        let dir = std::env::temp_dir().join(format!("probe-collector-forget-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (root, child) = (4_000_001, 4_000_002);
        let mut st = State::new(Writer::create(&dir).unwrap(), 1, root, &[root], false);
        for (pid, tid) in [(root, root), (child, child), (child, child + 1)] {
            st.on_record(&decode::encode(&FaultEvent { hdr: hdr(EventKind::Fault, pid, tid, 10), ..Default::default() })).unwrap();
        }
        st.last_maps.insert(child, vec![]);
        st.last_file_scan.insert(child, Instant::now());
        st.dirty_maps.insert(child);
        st.dirty_files.insert(child);
        let pending = record::StackRecord { pid: child, tid: child + 1, ts_ns: 20, ..Default::default() };
        st.offcpu.insert(child + 1, pending);
        assert_eq!(st.threads_seen.len(), 3);
        let exit = ProcEvent { hdr: hdr(EventKind::Proc, child, child, 50), op: PROC_EXIT, child, group_dead: 1, ..Default::default() };
        st.on_record(&decode::encode(&exit)).unwrap();
        assert!(!st.last_maps.contains_key(&child) && !st.last_file_scan.contains_key(&child));
        assert!(!st.dirty_maps.contains(&child) && !st.dirty_files.contains(&child));
        assert_eq!(st.threads_seen.keys().copied().collect::<Vec<_>>(), vec![root]);
        assert!(st.offcpu.is_empty(), "the exited thread's pending off-CPU stack is written, not kept");
        assert!(!st.root_exited);
        drop(st);
        let rec = record::read_dir(&dir).unwrap();
        assert_eq!(rec.stacks.len(), 1);
        assert_eq!(rec.stacks[0].blocked_ns, Some(30), "blocked until the exit");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
