//! One set of probe's kernel programs for every server on the node (`probe watch --all`).
//!
//! The programs are loaded and attached once, for the first server. Every later server joins the
//! one target set (its processes into `TARGETS`, its listeners into the socket maps, perf events on
//! its threads, the engine probe on executables not searched before) instead of loading an object
//! of its own: with N servers the kernel runs each tracepoint program once per event, not N times,
//! and the node holds one ring and one set of maps.
//!
//! One drain thread reads the ring and routes each record to the member (server) it belongs to:
//! - by the header's process for records made in a target's own context (most kinds; the block
//!   layer's completions carry the target the kernel matched: issuer, block cgroup or file);
//! - scheduler records by the thread they are about (`SchedEvent::tid`: the header names the task
//!   that ran instead);
//! - socket records made in softirq (pid 0) by the socket, learned from the member's own reads and
//!   writes on it, else by the listening port the connection arrived on;
//! - a fork's child joins its parent's member before any record of the child's can follow.
//!
//! A member's session reads its records from a bounded queue; a record its queue had no room for
//! is counted as lost for that member, by kind. A record no member claims (a process that left,
//! a socket of a server that stopped being followed) is counted (`unrouted`).
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    os::fd::AsRawFd as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{Map, MapData, PerCpuArray, RingBuf};
use probe_common::{
    EventHeader, EventKind, MAX_KINDS,
    proc::{PROC_EXIT, PROC_FORK, ProcEvent},
    sock::{SOCK_STATE, SockEvent, TCP_CLOSE, TCP_LISTEN},
    stack::SchedEvent,
    stream::DataEvent,
};

use crate::{
    kernel::engine,
    kernel::probes,
    os::procfs,
    os::target_file::Ident,
    record::decode,
    record::records::{Subsystem, SubsystemStatus},
};

/// Records waiting for one member's session at most (about 4 s of a busy server's records at
/// the 20 ms drain; more are counted as lost for that member).
const QUEUE: usize = 1 << 16;
/// Threads and sockets remembered for routing at most (forgotten all at once past it, learned
/// again from the next record).
const MAX_ROUTES: usize = 1 << 16;
const TICK: Duration = Duration::from_millis(20);
const IDLE_TICK: Duration = Duration::from_millis(200);

/// A member's losses by record kind (its queue was full).
type Dropped = [AtomicU64; MAX_KINDS as usize];

struct Feed {
    tx: mpsc::SyncSender<Vec<u8>>,
    dropped: Arc<Dropped>,
}

/// Where records go: by process, thread, socket and listening port.
#[derive(Default)]
struct Routes {
    pids: HashMap<u32, u32>,
    /// Thread → (its process, member).
    tids: HashMap<u32, (u32, u32)>,
    /// Threads looked up and found to belong to no followed process (forgotten when a member
    /// joins or a process forks: then they may).
    strangers: HashSet<u32>,
    socks: HashMap<u64, u32>,
    ports: HashMap<u16, Vec<u32>>,
    feeds: HashMap<u32, Feed>,
    next_id: u32,
}

impl Routes {
    fn member_of_tid(&mut self, tid: u32) -> Option<u32> {
        if let Some(&(_, m)) = self.tids.get(&tid) {
            return Some(m);
        }
        // A thread not seen in any record yet: its process from /proc (readable by tid), once:
        // a thread of no followed process (one that just left) is not looked up at every switch.
        if self.strangers.contains(&tid) {
            return None;
        }
        let Some(m) = procfs::tgid_of(tid).and_then(|pid| Some((pid, *self.pids.get(&pid)?))) else {
            if self.strangers.len() >= MAX_ROUTES {
                self.strangers.clear();
            }
            self.strangers.insert(tid);
            return None;
        };
        let (pid, m) = m;
        self.learn_tid(tid, pid, m);
        Some(m)
    }

    fn learn_tid(&mut self, tid: u32, pid: u32, m: u32) {
        if self.tids.len() >= MAX_ROUTES && !self.tids.contains_key(&tid) {
            self.tids.clear();
        }
        self.tids.insert(tid, (pid, m));
    }

    fn learn_sock(&mut self, sk: u64, m: u32) {
        if self.socks.len() >= MAX_ROUTES && !self.socks.contains_key(&sk) {
            self.socks.clear();
        }
        self.socks.insert(sk, m);
    }

    /// The members a record goes to (usually one; a softirq socket record on a port several
    /// members listen on goes to each), learning routes from it. Read from the record's fixed
    /// part only (no decoding, no allocation): this runs for every record on the node.
    fn route(&mut self, bytes: &[u8], out: &mut Vec<u32>) {
        out.clear();
        let Some(h) = decode::prefix::<EventHeader>(bytes) else { return };
        let kind = EventKind::try_from(h.kind).ok();
        match kind {
            Some(EventKind::Sched) => {
                if let Some(e) = decode::prefix::<SchedEvent>(bytes) {
                    out.extend(self.member_of_tid(e.tid));
                }
                return;
            }
            Some(EventKind::Sock) if h.pid == 0 => {
                let Some(s) = decode::prefix::<SockEvent>(bytes) else { return };
                match self.socks.get(&s.skaddr) {
                    Some(&m) => out.push(m),
                    None => out.extend(self.ports.get(&s.sport).into_iter().flatten().copied()),
                }
                if s.what == SOCK_STATE && s.newstate == TCP_CLOSE {
                    self.socks.remove(&s.skaddr);
                }
                return;
            }
            _ => out.extend(self.pids.get(&h.pid).copied()),
        }
        let Some(&m) = out.first() else { return };
        match kind {
            Some(EventKind::Data) => {
                if let Some(d) = decode::prefix::<DataEvent>(bytes) {
                    self.learn_sock(d.sk, m);
                }
            }
            Some(EventKind::Sock) => {
                let Some(s) = decode::prefix::<SockEvent>(bytes) else { return };
                if s.what == SOCK_STATE && s.newstate == TCP_CLOSE {
                    self.socks.remove(&s.skaddr);
                } else if s.what == SOCK_STATE && s.newstate == TCP_LISTEN {
                    let at = self.ports.entry(s.sport).or_default();
                    if !at.contains(&m) {
                        at.push(m);
                    }
                } else {
                    self.learn_sock(s.skaddr, m);
                }
            }
            Some(EventKind::Proc) => {
                if let Some(p) = decode::prefix::<ProcEvent>(bytes)
                    && p.op == PROC_FORK
                {
                    self.pids.insert(p.child, m);
                    self.strangers.clear();
                }
            }
            _ => {}
        }
        if h.pid != 0 && !self.tids.contains_key(&h.tid) {
            self.learn_tid(h.tid, h.pid, m);
        }
    }

    /// After the record went out: a process that exited leaves the routes.
    fn after(&mut self, bytes: &[u8]) {
        if let Some(p) = decode::prefix::<ProcEvent>(bytes)
            && p.hdr.kind == EventKind::Proc as u32
            && p.op == PROC_EXIT
        {
            let pid = p.hdr.pid;
            self.pids.remove(&pid);
            self.tids.retain(|_, (p, _)| *p != pid);
        }
    }

    fn forget_member(&mut self, id: u32) {
        self.feeds.remove(&id);
        self.pids.retain(|_, m| *m != id);
        self.tids.retain(|_, (_, m)| *m != id);
        self.socks.retain(|_, m| *m != id);
        for v in self.ports.values_mut() {
            v.retain(|m| *m != id);
        }
        self.ports.retain(|_, v| !v.is_empty());
    }
}

/// The kernel side, shared: the object, its counters and what the engine probe was attached to.
struct Kernel {
    ebpf: aya::Ebpf,
    lost: PerCpuArray<MapData, u64>,
    counters: PerCpuArray<MapData, u64>,
    /// Maps each member opens a handle of its own to (by id).
    map_ids: HashMap<&'static str, u32>,
    _maps: Vec<MapData>,
    /// The load's own status: what attached, what was skipped (the engine's is per member).
    status: Vec<SubsystemStatus>,
    bpf_unmeasured: Option<String>,
    _run_time_stats: Option<std::os::fd::OwnedFd>,
    sample_hz: u64,
    /// Executable files the engine probe searched, and those it attached to (with what).
    engine_seen: HashSet<Ident>,
    engine_live: HashMap<Ident, Vec<String>>,
    /// The engine probe was asked for.
    want_engine: bool,
}

struct Shared {
    kernel: Mutex<Kernel>,
    routes: Mutex<Routes>,
    stop: AtomicBool,
    /// Drain turns done (a member leaving waits for the next full one).
    turns: AtomicU64,
    unrouted: AtomicU64,
    records: AtomicU64,
}

/// The node's hub: made at the first server's join, let go once no server follows it.
#[derive(Default)]
pub struct Node {
    hub: Mutex<Option<Arc<Hub>>>,
}

impl Node {
    /// A server joins: the first loads and attaches the programs, the others join them.
    pub fn join(&self, popts: &probes::Options) -> anyhow::Result<Member> {
        let mut g = lock(&self.hub);
        if let Some(h) = g.as_ref() {
            return h.join(popts.pid);
        }
        let (h, m) = Hub::start(popts)?;
        *g = Some(h);
        Ok(m)
    }

    /// No server follows the programs any more: they go (detached on a thread of their own:
    /// closing tracepoints waits for RCU grace periods).
    pub fn release_idle(&self) {
        let mut g = lock(&self.hub);
        if g.as_ref().is_some_and(|h| h.members() == 0)
            && let Some(h) = g.take()
        {
            let _ = std::thread::Builder::new().name("probe-detach".into()).spawn(move || drop(h));
        }
    }

    pub fn hub(&self) -> Option<Arc<Hub>> {
        lock(&self.hub).clone()
    }
}

/// probe's kernel programs, loaded once, and the thread that routes their records.
pub struct Hub {
    shared: Arc<Shared>,
    drain: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What a session gets from the hub at join: its records, and what the report says of the probes.
pub struct Member {
    pub id: u32,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Vec<u8>>,
    dropped: Arc<Dropped>,
    /// The processes of this server, at join.
    pub targets: Vec<u32>,
    pub status: Vec<SubsystemStatus>,
    pub stages: Vec<(String, f64)>,
    pub engine_seen: Vec<Ident>,
    pub bpf_unmeasured: Option<String>,
    left: bool,
}

fn map_data(m: Map) -> Option<MapData> {
    match m {
        Map::HashMap(d) | Map::LruHashMap(d) | Map::PerCpuArray(d) | Map::RingBuf(d) | Map::Array(d) => Some(d),
        _ => None,
    }
}

fn sum(map: &PerCpuArray<MapData, u64>) -> Vec<u64> {
    (0..MAX_KINDS).map(|i| map.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0)).collect()
}

impl Hub {
    /// Load and attach probe's programs for the first server, and start routing.
    pub fn start(popts: &probes::Options) -> anyhow::Result<(Arc<Hub>, Member)> {
        let t = Instant::now();
        let mut attached = probes::attach(popts)?;
        let ring = RingBuf::try_from(attached.ebpf.take_map(probe_common::maps::EVENTS).context("EVENTS map missing")?)?;
        let lost = PerCpuArray::try_from(attached.ebpf.take_map(probe_common::maps::LOST).context("LOST map missing")?)?;
        let counters = PerCpuArray::try_from(attached.ebpf.take_map(probe_common::maps::COUNTERS).context("COUNTERS map missing")?)?;
        let mut map_ids = HashMap::new();
        let mut kept = Vec::new();
        for name in [
            probe_common::maps::USTACK_NEED,
            probe_common::maps::STACK_RANGES,
            probe_common::maps::OTHER_COMMS,
            probe_common::maps::PY_THREADS,
            probe_common::maps::TARGET_FILES,
            probe_common::maps::TARGET_BLKCG,
        ] {
            if let Some(d) = attached.ebpf.take_map(name).and_then(map_data)
                && let Ok(info) = d.info()
            {
                map_ids.insert(name, info.id());
                kept.push(d);
            }
        }
        let want_engine = popts.only.as_ref().is_none_or(|o| o.iter().any(|n| n == Subsystem::Engine.name()));
        let engine_status = attached.status.iter().find(|s| s.name == Subsystem::Engine).cloned();
        // Live for the executables the engine probe was attached to ("NAME in BASE"), not for
        // every file the first server maps (its libc would make a Python server's engine "live").
        let engine_live: HashMap<Ident, Vec<String>> = match &engine_status {
            Some(s) if s.live => exec_mappings(&attached.targets)
                .into_iter()
                .filter(|m| {
                    let base = m.path.rsplit('/').next().unwrap_or(&m.path);
                    s.attached.iter().any(|a| a.rsplit(" in ").next() == Some(base))
                })
                .map(|m| (Ident::of(&m), s.attached.clone()))
                .collect(),
            _ => HashMap::new(),
        };
        let (bpf_unmeasured, run_time_stats) = match attached.run_time_stats {
            Ok(fd) => (None, Some(fd)),
            Err(e) => (Some(e), None),
        };
        let mut routes = Routes::default();
        let feed = new_feed(&mut routes);
        let kernel = Kernel {
            ebpf: attached.ebpf,
            lost,
            counters,
            map_ids,
            _maps: kept,
            status: attached.status.clone(),
            bpf_unmeasured: bpf_unmeasured.clone(),
            _run_time_stats: run_time_stats,
            sample_hz: popts.sample_hz,
            engine_seen: attached.engine_seen.iter().copied().collect(),
            engine_live,
            want_engine,
        };
        let shared = Arc::new(Shared {
            kernel: Mutex::new(kernel),
            routes: Mutex::new(routes),
            stop: AtomicBool::new(false),
            turns: AtomicU64::new(0),
            unrouted: AtomicU64::new(0),
            records: AtomicU64::new(0),
        });
        let (id, rx, dropped) = feed;
        {
            let mut r = lock(&shared.routes);
            for &pid in &attached.targets {
                r.pids.insert(pid, id);
                for tid in procfs::tasks(pid) {
                    r.learn_tid(tid, pid, id);
                }
            }
            for port in attached.targets.iter().flat_map(|&p| procfs::listen_sockets(p)).map(|a| a.port()) {
                r.ports.entry(port).or_default().push(id);
            }
        }
        let s = shared.clone();
        let drain = std::thread::Builder::new().name("probe-hub".into()).spawn(move || drain_loop(ring, &s))?;
        let mut stages = attached.stages;
        stages.push(("hub".into(), t.elapsed().as_secs_f64() * 1e3));
        let member = Member {
            id,
            shared: shared.clone(),
            rx,
            dropped,
            targets: attached.targets,
            status: attached.status,
            stages,
            engine_seen: attached.engine_seen,
            bpf_unmeasured,
            left: false,
        };
        Ok((Arc::new(Hub { shared, drain: Mutex::new(Some(drain)) }), member))
    }

    /// Another server joins the running programs: its processes, listeners, threads' perf
    /// events and, for executables not searched yet, the engine probe.
    pub fn join(&self, pid: u32) -> anyhow::Result<Member> {
        let t = Instant::now();
        if !procfs::exists(pid) {
            anyhow::bail!("no process with pid {pid}");
        }
        let mut targets = vec![pid];
        targets.extend(procfs::descendants(pid));
        let (id, rx, dropped) = {
            let mut r = lock(&self.shared.routes);
            let feed = new_feed(&mut r);
            // Routes first: the first records after the kernel knows the targets have somewhere to go.
            for &p in &targets {
                r.pids.insert(p, feed.0);
                for tid in procfs::tasks(p) {
                    r.learn_tid(tid, p, feed.0);
                }
            }
            for port in targets.iter().flat_map(|&p| procfs::listen_sockets(p)).map(|a| a.port()) {
                let at = r.ports.entry(port).or_default();
                if !at.contains(&feed.0) {
                    at.push(feed.0);
                }
            }
            feed
        };
        let mut k = lock(&self.shared.kernel);
        let mut added = Vec::new();
        for &p in &targets {
            let hz = k.sample_hz;
            match probes::add_target(&mut k.ebpf, p, hz) {
                Ok(true) => added.push(p),
                Ok(false) => {}
                Err(e) => {
                    drop(k);
                    lock(&self.shared.routes).forget_member(id);
                    return Err(e.context(format!("cannot add pid {p} to probe's running programs")));
                }
            }
        }
        let mut stages = vec![("join".to_string(), t.elapsed().as_secs_f64() * 1e3)];
        let t = Instant::now();
        let maps: Vec<(u32, procfs::Mapping)> =
            targets.iter().flat_map(|&p| procfs::read_maps(p).unwrap_or_default().into_iter().map(move |m| (p, m))).collect();
        let engine = k.engine_for(&maps);
        stages.push(("engine uprobes".to_string(), t.elapsed().as_secs_f64() * 1e3));
        let mut status = k.status.clone();
        if let Some(s) = status.iter_mut().find(|s| s.name == Subsystem::Engine) {
            *s = engine;
        }
        let engine_seen = maps.iter().filter(|(_, m)| m.perms.contains('x')).map(|(_, m)| Ident::of(m)).collect();
        log::info!("hub: pid {pid} joined as member {id} ({} processes, {} new)", targets.len(), added.len());
        Ok(Member {
            id,
            shared: self.shared.clone(),
            rx,
            dropped,
            targets,
            status,
            stages,
            engine_seen,
            bpf_unmeasured: k.bpf_unmeasured.clone(),
            left: false,
        })
    }

    /// Servers following the programs now.
    pub fn members(&self) -> usize {
        lock(&self.shared.routes).feeds.len()
    }

    /// The programs' run counts and time (node-wide), records routed and left unclaimed.
    pub fn runs(&self) -> BTreeMap<String, probes::ProgRuns> {
        probes::prog_runs(&lock(&self.shared.kernel).ebpf)
    }

    pub fn unrouted(&self) -> u64 {
        self.shared.unrouted.load(Ordering::Relaxed)
    }
}

impl Drop for Hub {
    /// Stop routing; the programs go with the object (closing their links).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(d) = self.drain.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = d.join();
        }
        probes::switch_off(&mut lock(&self.shared.kernel).ebpf);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn new_feed(r: &mut Routes) -> (u32, mpsc::Receiver<Vec<u8>>, Arc<Dropped>) {
    let (tx, rx) = mpsc::sync_channel(QUEUE);
    let dropped: Arc<Dropped> = Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
    let id = r.next_id;
    r.next_id += 1;
    r.strangers.clear();
    r.feeds.insert(id, Feed { tx, dropped: dropped.clone() });
    (id, rx, dropped)
}

/// The executable files these processes map.
fn exec_mappings(pids: &[u32]) -> Vec<procfs::Mapping> {
    pids.iter().flat_map(|&p| procfs::read_maps(p).unwrap_or_default()).filter(|m| m.perms.contains('x')).collect()
}

impl Kernel {
    /// The engine probe for a member mapping `maps`: executables not searched before are searched
    /// and attached (once for the node: its uprobes fire for every process that runs the file and
    /// the target set filters them); the status says what serves this member.
    fn engine_for(&mut self, maps: &[(u32, procfs::Mapping)]) -> SubsystemStatus {
        let mut st = SubsystemStatus { name: Subsystem::Engine, live: false, attached: vec![], skipped: vec![] };
        if !self.want_engine {
            return st;
        }
        let new: Vec<(u32, procfs::Mapping)> =
            maps.iter().filter(|(_, m)| m.perms.contains('x') && !self.engine_seen.contains(&Ident::of(m))).cloned().collect();
        if !new.is_empty() {
            let found = engine::search_mappings(&new);
            let a = engine::attach(&mut self.ebpf, &found);
            self.engine_seen.extend(found.seen.iter().copied());
            if a.live {
                for f in &found.found {
                    self.engine_live.insert(f.ident, a.attached.clone());
                }
            }
            st.skipped = a.skipped;
        }
        for (_, m) in maps {
            if let Some(what) = self.engine_live.get(&Ident::of(m)) {
                st.live = true;
                for w in what {
                    if !st.attached.contains(w) {
                        st.attached.push(w.clone());
                    }
                }
            }
        }
        if st.live {
            st.skipped.clear();
        } else if st.skipped.is_empty() {
            st.skipped.push("engine probes: no llama.cpp entry point found in this server's executables".into());
        }
        st
    }
}

/// Read the ring and route every record until the hub stops.
fn drain_loop(mut ring: RingBuf<MapData>, s: &Shared) {
    let fd = ring.as_raw_fd();
    let mut tick = TICK;
    let mut to = Vec::new();
    while !s.stop.load(Ordering::Relaxed) {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the ring's descriptor, which `ring` keeps open.
        unsafe { libc::poll(&mut p, 1, tick.as_millis() as i32) };
        let mut n = 0u64;
        let mut r = lock(&s.routes);
        while let Some(item) = ring.next() {
            n += 1;
            dispatch(&item, &mut r, &mut to, s);
        }
        drop(r);
        s.records.fetch_add(n, Ordering::Relaxed);
        s.turns.fetch_add(1, Ordering::Release);
        tick = if n > 0 { TICK } else { IDLE_TICK };
    }
}

fn dispatch(bytes: &[u8], r: &mut Routes, to: &mut Vec<u32>, s: &Shared) {
    r.route(bytes, to);
    if to.is_empty() {
        s.unrouted.fetch_add(1, Ordering::Relaxed);
    }
    let kind = decode::kind_of(bytes).map_or(0, |k| k as usize);
    for m in to.iter() {
        let Some(f) = r.feeds.get(m) else {
            s.unrouted.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if f.tx.try_send(bytes.to_vec()).is_err() {
            f.dropped[kind.min(MAX_KINDS as usize - 1)].fetch_add(1, Ordering::Relaxed);
        }
    }
    r.after(bytes);
}

impl Member {
    /// The next record routed to this member, if one waits.
    pub fn next_record(&mut self) -> Option<Vec<u8>> {
        self.rx.try_recv().ok()
    }

    /// Events lost by kind: the kernel's (node-wide: a full ring is every member's loss) and this
    /// member's queue's.
    pub fn lost(&self) -> Vec<u64> {
        let mut v = sum(&lock(&self.shared.kernel).lost);
        for (i, d) in self.dropped.iter().enumerate() {
            v[i] += d.load(Ordering::Relaxed);
        }
        v
    }

    pub fn counters(&self) -> Vec<u64> {
        sum(&lock(&self.shared.kernel).counters)
    }

    /// The programs' runs: node-wide, shared by every member.
    pub fn runs(&self) -> BTreeMap<String, probes::ProgRuns> {
        probes::prog_runs(&lock(&self.shared.kernel).ebpf)
    }

    /// A handle of this member's own to one of the shared maps.
    pub fn open_hash<K: aya::Pod, V: aya::Pod>(&self, name: &str) -> Option<aya::maps::HashMap<MapData, K, V>> {
        let id = *lock(&self.shared.kernel).map_ids.get(name)?;
        let d = MapData::from_id(id).ok()?;
        aya::maps::HashMap::try_from(Map::from_map_data(d).ok()?).ok()
    }

    /// A process joined this server (its cgroup): the kernel follows it, its records come here.
    pub fn add_target(&self, pid: u32) -> anyhow::Result<bool> {
        {
            let mut r = lock(&self.shared.routes);
            r.pids.insert(pid, self.id);
            r.strangers.clear();
        }
        let mut k = lock(&self.shared.kernel);
        let hz = k.sample_hz;
        probes::add_target(&mut k.ebpf, pid, hz)
    }

    /// Executables this server mapped after it joined: the engine probe for those not searched.
    pub fn engine_mapped(&self, maps: &[(u32, procfs::Mapping)]) -> Vec<String> {
        let mut k = lock(&self.shared.kernel);
        let before: HashSet<Ident> = k.engine_live.keys().copied().collect();
        let st = k.engine_for(maps);
        let new = maps.iter().any(|(_, m)| k.engine_live.contains_key(&Ident::of(m)) && !before.contains(&Ident::of(m)));
        if new { st.attached } else { Vec::new() }
    }

    /// Leave: the kernel stops following this server's processes, and once the hub has routed
    /// what the ring held of them, nothing more comes. Records already queued stay readable.
    pub fn leave(&mut self, pids: &[u32]) {
        if std::mem::replace(&mut self.left, true) {
            return;
        }
        {
            let mut k = lock(&self.shared.kernel);
            if let Some(m) = k.ebpf.map_mut(probe_common::maps::TARGETS)
                && let Ok(mut t) = aya::maps::HashMap::<_, u32, u8>::try_from(m)
            {
                for p in pids {
                    let _ = t.remove(p);
                }
            }
        }
        // Two turns of the drain: the one under way may have read the ring before the removal.
        let at = self.shared.turns.load(Ordering::Acquire);
        let until = Instant::now() + Duration::from_millis(600);
        while self.shared.turns.load(Ordering::Acquire) < at + 2 && Instant::now() < until && !self.shared.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        lock(&self.shared.routes).forget_member(self.id);
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let pids: Vec<u32> = lock(&self.shared.routes).pids.iter().filter(|(_, m)| **m == self.id).map(|(p, _)| *p).collect();
        self.leave(&pids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(kind: EventKind, pid: u32, tid: u32) -> EventHeader {
        EventHeader { kind: kind as u32, pid, tid, cpu: 0, ts_ns: 1 }
    }

    fn routed(r: &mut Routes, bytes: &[u8]) -> Vec<u32> {
        let mut out = Vec::new();
        r.route(bytes, &mut out);
        r.after(bytes);
        out
    }

    /// Records go to the server they belong to: by process, by the thread a scheduler record is
    /// about, by the socket a softirq record names (learned from the member's own reads), by the
    /// listening port before that, and a fork's child with its parent.
    #[test]
    fn records_go_to_their_server() {
        let mut r = Routes::default();
        let (a, b) = (new_feed(&mut r).0, new_feed(&mut r).0);
        r.pids.insert(4_000_100, a);
        r.pids.insert(4_000_200, b);
        r.ports.insert(8080, vec![a]);
        r.ports.insert(8000, vec![a, b]);
        let fault =
            |pid, tid| decode::encode(&probe_common::fault::FaultEvent { hdr: hdr(EventKind::Fault, pid, tid), ..Default::default() });
        assert_eq!(routed(&mut r, &fault(4_000_200, 4_000_201)), vec![b]);
        assert_eq!(routed(&mut r, &fault(4_000_300, 4_000_300)), Vec::<u32>::new(), "a process of no server");
        // The header of a wait names the task that ran instead; the thread waiting is b's.
        let sched = SchedEvent { hdr: hdr(EventKind::Sched, 4_000_100, 4_000_100), tid: 4_000_201, flags: 0, blocked_ns: 5 };
        assert_eq!(routed(&mut r, &decode::encode(&sched)), vec![b]);
        // Softirq: by the port until the socket is known from a read of b's.
        let sock = |pid, sk, sport| SockEvent {
            hdr: hdr(EventKind::Sock, pid, pid),
            skaddr: sk,
            what: SOCK_STATE,
            newstate: 1,
            sport,
            ..Default::default()
        };
        assert_eq!(routed(&mut r, &decode::encode(&sock(0, 77, 8080))), vec![a]);
        assert_eq!(routed(&mut r, &decode::encode(&sock(0, 78, 8000))), vec![a, b], "a port two servers listen on");
        let data = DataEvent { hdr: hdr(EventKind::Data, 4_000_200, 4_000_201), sk: 78, ..Default::default() };
        assert_eq!(routed(&mut r, &decode::encode(&data)), vec![b]);
        assert_eq!(routed(&mut r, &decode::encode(&sock(0, 78, 8000))), vec![b], "the socket is b's now");
        let mut close = sock(0, 78, 8000);
        close.newstate = TCP_CLOSE;
        assert_eq!(routed(&mut r, &decode::encode(&close)), vec![b]);
        assert!(!r.socks.contains_key(&78), "a closed socket is forgotten");
        // A fork: the child is its parent's server's; after its exit, nobody's.
        let fork = ProcEvent { hdr: hdr(EventKind::Proc, 4_000_100, 4_000_100), op: PROC_FORK, child: 4_000_150, ..Default::default() };
        assert_eq!(routed(&mut r, &decode::encode(&fork)), vec![a]);
        assert_eq!(routed(&mut r, &fault(4_000_150, 4_000_150)), vec![a]);
        let exit = ProcEvent {
            hdr: hdr(EventKind::Proc, 4_000_150, 4_000_150),
            op: PROC_EXIT,
            child: 4_000_150,
            group_dead: 1,
            ..Default::default()
        };
        assert_eq!(routed(&mut r, &decode::encode(&exit)), vec![a]);
        assert_eq!(routed(&mut r, &fault(4_000_150, 4_000_150)), Vec::<u32>::new());
        // A member that leaves takes its routes.
        r.forget_member(b);
        assert_eq!(routed(&mut r, &fault(4_000_200, 4_000_201)), Vec::<u32>::new());
        assert_eq!(r.ports.get(&8000), Some(&vec![a]));
    }
}
