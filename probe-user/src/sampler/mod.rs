//! Samplers that run beside the kernel probes, on the same CLOCK_MONOTONIC clock: GPU clocks and
//! memory (NVML, behind a trait), CPU frequency, memory pressure and the target's RSS (10 Hz by
//! default), page-cache residency of the model files (every second while busy, every 2 s while
//! idle, at the end, and on SIGUSR1), and the server's own endpoints (every 2 s). Each reading becomes a JSON record in the
//! recording; a source the machine lacks is described once in the `samplers` record, never an error.
use std::{
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{
    monotonic_ns,
    os::procfs,
    record::samples::{
        CpuFreqReading, CpuIdleReading, EndpointPoll, GpuReading, Mem, MemReading, ResidencyReading, ResidencyWhy, Sample, Sources,
    },
};

pub mod endpoints;
pub mod gpu;
pub mod host;
pub mod procs;
pub mod residency;

/// How often the server's endpoints are polled (each poll is 2-3 small HTTP requests the server
/// answers between decode steps; its counters change slowly).
pub const POLL_EVERY: Duration = Duration::from_secs(2);
/// How often they are polled while the target is idle (a sleeping server's state changes after
/// minutes of idling; a request wakes the poller at once).
pub const IDLE_POLL_EVERY: Duration = Duration::from_secs(10);

/// Files at least this big that the target maps or opens are watched for residency (weights).
pub const MODEL_FILE_MIN_BYTES: u64 = 16 << 20;

#[derive(Clone, Debug)]
pub struct Options {
    pub pid: u32,
    /// The processes being traced, kept current by the collector (forks join, exits leave), so
    /// the samplers never scan /proc for descendants.
    pub targets: Arc<Mutex<Vec<u32>>>,
    /// GPU / CPU-frequency / memory samples per second; 0 turns them off.
    pub hz: f64,
    /// Poll the server's HTTP endpoints.
    pub poll: bool,
    /// Headers for this server's endpoints in place of the process's (`watch --all`).
    pub headers: Option<Vec<(String, String)>>,
}

pub struct Sampler {
    rx: mpsc::Receiver<Sample>,
    signal: Arc<Signal>,
    snapshot: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// While the target is idle, GPU, CPU-frequency and memory readings are taken this often (at
/// `hz` otherwise): an idle server changes slowly, and a request makes the collector call
/// [`Sampler::set_busy`], which wakes the samplers at once.
pub const IDLE_PERIOD: Duration = Duration::from_secs(5);
/// While the target is idle, C-states and the model files' residency are read this often (every
/// second while busy): each turn is a wake-up of probe's (50–100 µs of CPU on a VM) and a few
/// hundred µs of reads, the samplers' share of an idle trace's cost; a model leaving the page
/// cache is still seen within 2 s, and a request's arrival is read at once.
const IDLE_SLOW: Duration = Duration::from_secs(2);
/// How often a sampler held back by the watchdog (every CPU busy) looks whether it was let go: a
/// reading then waits anyway, and each look is a wake-up of probe's on a CPU the server wants
/// (at 100 ms, ten a second, most of probe's wake-ups during a request; the verdicts charged
/// probe for the server threads that woke as it ran). The target turning busy wakes it at once.
const HELD_NAP: Duration = Duration::from_millis(500);

/// What the sampler threads sleep on: they wake at once when probe stops, when the target turns
/// busy, or on SIGUSR1, never to look at a flag (no periodic wake-ups while nothing happens).
#[derive(Default)]
struct Signal {
    /// (stopped, busy, pokes)
    state: Mutex<(bool, bool, u64)>,
    cv: Condvar,
    /// The samplers' thread (0 until it starts): raised by the caller that turns the target busy.
    tid: std::sync::atomic::AtomicI32,
    /// Set when that caller raised it: it lowers itself after its next turn.
    raised: AtomicBool,
}

impl Signal {
    fn get(&self) -> std::sync::MutexGuard<'_, (bool, bool, u64)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stopped(&self) -> bool {
        self.get().0
    }

    fn busy(&self) -> bool {
        self.get().1
    }

    fn update(&self, f: impl FnOnce(&mut (bool, bool, u64))) {
        let mut g = self.get();
        f(&mut g);
        g.2 += 1;
        self.cv.notify_all();
    }

    /// Sleep up to `d`; back early when stopped or poked meanwhile.
    fn nap(&self, d: Duration) {
        let until = Instant::now() + d;
        let mut g = self.get();
        let pokes = g.2;
        while !g.0 && g.2 == pokes {
            let now = Instant::now();
            if now >= until {
                break;
            }
            g = self.cv.wait_timeout(g, until - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

fn targets(opts: &Options) -> Vec<u32> {
    opts.targets.lock().map(|t| t.clone()).unwrap_or_else(|_| vec![opts.pid])
}

/// The big-file list is refreshed this often (residency itself is looked at every slow turn).
const FILE_SCAN_EVERY: Duration = Duration::from_secs(5);
/// ... and this often while the target is idle (a server loading a model is busy: its files are
/// found at the busy pace; the scan reads its maps and descriptors, a tenth of an idle trace's
/// sampler time at 5 s).
const FILE_SCAN_IDLE: Duration = Duration::from_secs(10);

impl Sampler {
    pub fn start(opts: Options) -> Sampler {
        let (tx, rx) = mpsc::channel();
        let signal = Arc::new(Signal::default());
        let snapshot = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        {
            let (tx, signal, snapshot, opts) = (tx.clone(), signal.clone(), snapshot.clone(), opts.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("probe-sample".into())
                    .spawn(move || sample_loop(&opts, &tx, &signal, &snapshot))
                    .expect("spawn sampler"),
            );
        }
        if opts.poll {
            let signal = signal.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("probe-poll".into())
                    .spawn(move || {
                        // The server's endpoints can wait for a free CPU, as long as it takes.
                        crate::os::procfs::idle_priority();
                        crate::util::httpc::with_headers(opts.headers.clone(), || poll_loop(&opts, &tx, &signal))
                    })
                    .expect("spawn poller"),
            );
        }
        Sampler { rx, signal, snapshot, threads }
    }

    /// The target is busy (a request in flight, events flowing) or idle again: busy, the samplers
    /// run at their full rates, and a change to busy wakes them now.
    ///
    /// The samplers run at idle priority: while other work keeps every CPU busy they would get
    /// a CPU only seconds later, and the reading at a request's arrival (the GPU's power state
    /// then) would come after the GPU woke. So the thread is raised to normal priority here, for
    /// that one reading: it goes back to idle priority once taken.
    pub fn set_busy(&self, busy: bool) {
        if self.signal.busy() != busy {
            let tid = self.signal.tid.load(Ordering::Relaxed);
            if busy && tid > 0 && crate::os::yielding::raise(tid) {
                self.signal.raised.store(true, Ordering::Relaxed);
            }
            self.signal.update(|s| s.1 = busy);
        }
    }

    /// Records gathered since the last call.
    pub fn drain(&self) -> Vec<Sample> {
        self.rx.try_iter().collect()
    }

    /// Measure residency now (SIGUSR1).
    pub fn snapshot_now(&self) {
        self.snapshot.store(true, Ordering::Relaxed);
        self.signal.update(|_| {});
    }

    /// Stop the threads (they take a last residency and memory reading) and return what is
    /// left, waiting at most `within`: a thread still busy then (a read from a stuck server) is
    /// left behind, named in the second list, and ends with the process.
    pub fn stop(mut self, within: Duration) -> (Vec<Sample>, Vec<String>) {
        self.signal.update(|s| s.0 = true);
        let until = Instant::now() + within;
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut abandoned = Vec::new();
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            } else {
                abandoned.push(t.thread().name().unwrap_or("sampler").to_string());
            }
        }
        (self.drain(), abandoned)
    }
}

/// NVML, open only while the target is busy (an open handle keeps a runtime-suspended GPU
/// awake), and the GPUs' PCI power states from sysfs, read at any time (that wakes nothing).
struct Gpus {
    nvml: Option<Box<dyn gpu::GpuSource>>,
    /// Why NVML is not used at all (no NVIDIA device, no driver).
    absent: Option<String>,
    /// No device here would sleep while NVML is open: it stays open, from the start (the clocks
    /// at a request's arrival are then read before it, as they were).
    keep_open: bool,
    devices_said: bool,
    /// The NVIDIA display devices' sysfs directories, found once at the start.
    pci_devices: Vec<std::path::PathBuf>,
    last_pci: Option<Vec<crate::record::samples::PciPower>>,
}

impl Gpus {
    fn new() -> Gpus {
        let devices = gpu::nvidia_devices();
        let pci = devices.as_deref().map(gpu::pci_power);
        let keep_open = gpu::keep_open_when_idle(pci.as_deref());
        let absent = gpu::present(pci.as_deref()).err();
        Gpus { nvml: None, absent, keep_open, devices_said: false, pci_devices: devices.unwrap_or_default(), last_pci: None }
    }

    /// The PCI power states, when they changed since the last reading sent.
    fn pci_changed(&mut self) -> Vec<crate::record::samples::PciPower> {
        let now = gpu::pci_power(&self.pci_devices);
        if self.last_pci.as_ref() == Some(&now) {
            return Vec::new();
        }
        self.last_pci = Some(now.clone());
        now
    }

    /// The target idles: NVML closes now, not at the next idle reading (5 s later).
    fn idle(&mut self) {
        if !self.keep_open {
            self.nvml = None;
        }
    }

    /// One turn: busy, NVML is opened (once) and read; idle, it is closed and only sysfs is read.
    fn turn(&mut self, busy: bool, stopping: bool, pids: &[u32], tx: &mpsc::Sender<Sample>) {
        let reading = |gpus, pci, devices, opened_ms| Sample::Gpu(GpuReading { ts_ns: monotonic_ns(), gpus, pci, devices, opened_ms });
        let busy = (busy || self.keep_open) && !stopping;
        if !busy || self.absent.is_some() {
            // Every handle closes with the source (nvmlShutdown).
            self.nvml = None;
            let pci = self.pci_changed();
            if !pci.is_empty() {
                let _ = tx.send(reading(Vec::new(), pci, None, None));
            }
            return;
        }
        let mut opened_ms = None;
        if self.nvml.is_none() {
            // The state at the busy moment (a request's arrival), before NVML wakes the device.
            let pci = self.pci_changed();
            if !pci.is_empty() {
                let _ = tx.send(reading(Vec::new(), pci, None, None));
            }
            let t = Instant::now();
            match gpu::open() {
                Ok(g) => {
                    self.nvml = Some(g);
                    opened_ms = Some(t.elapsed().as_secs_f64() * 1e3);
                }
                Err(why) => {
                    log::info!("{why}");
                    self.absent = Some(why);
                    return;
                }
            }
        }
        let Some(g) = self.nvml.as_mut() else { return };
        let devices = (!std::mem::replace(&mut self.devices_said, true)).then(|| g.devices());
        let gpus = g.sample(pids);
        let pci = self.pci_changed();
        if !gpus.is_empty() || !pci.is_empty() || devices.is_some() {
            let _ = tx.send(reading(gpus, pci, devices, opened_ms));
        }
    }
}

/// The samplers' thread: the fast readings (GPU, CPU clocks, memory) at `opts.hz` while the target
/// is busy, the slow ones (C-states, the model files' residency) every second (every 2 s while idle), until the stop.
fn sample_loop(opts: &Options, tx: &mpsc::Sender<Sample>, signal: &Signal, snapshot: &AtomicBool) {
    let mut gpu = Gpus::new();
    let freq = host::cpufreq();
    let cgroup = host::memory_cgroup(opts.pid);
    let cpu_cgroup = host::cpu_cgroup(opts.pid);
    let _ = tx.send(Sample::Samplers(sources(opts, &gpu, freq.as_ref(), cgroup.as_deref())));
    let mut files = ModelFiles::default();
    let mut pids = targets(opts);
    let mut last_slow: Option<Instant> = None;
    let period = if opts.hz > 0.0 { Duration::from_secs_f64(1.0 / opts.hz) } else { Duration::from_secs(1) };
    let mut last_fast: Option<Instant> = None;
    // Idle priority (`yielding::Yielding`): while the server keeps every CPU busy a reading comes
    // late rather than take a CPU from it (samples carry the time they were read); normal once a
    // reading is 3 s overdue (the watchdog: a thread at idle priority still gets a small share of
    // a busy CPU), until readings come on time again.
    let mut yielding = crate::os::yielding::Yielding::start("probe: the samplers", period + Duration::from_secs(3), None, None, None)
        .hold_when_busy()
        .idle_from_start();
    // SAFETY: gettid has no preconditions.
    signal.tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
    let mut was_busy = false;
    loop {
        let stopping = signal.stopped();
        let busy = signal.busy();
        if stopping {
            yielding.stop();
        } else if yielding.held() && (was_busy || !busy) {
            // Every CPU busy: the readings wait (the watchdog lets one through when it is
            // overdue); a look every HELD_NAP. Not the one at the moment the
            // target turns busy: a request's arrival, the GPU's state then.
            signal.nap(HELD_NAP);
            continue;
        }
        was_busy = busy;
        // Residency and C-states every second while busy, every IDLE_SLOW while idle: the model
        // leaving the page cache while the server idles is what the slow morning request is
        // about (a look at sampled pages is cheap; the wake-up is most of the cost).
        let slow_every = if busy { Duration::from_secs(1) } else { IDLE_SLOW };
        let slow_due = last_slow.is_none_or(|t| t.elapsed() >= slow_every);
        if slow_due || stopping {
            last_slow = Some(Instant::now());
            pids = targets(opts);
        }
        let fast_every = if busy { period } else { IDLE_PERIOD };
        if !busy {
            gpu.idle();
        }
        // Back from idle: the first busy turn samples at once.
        let fast_due = last_fast.is_none_or(|t| t.elapsed() >= fast_every.saturating_sub(Duration::from_millis(5)));
        if (opts.hz > 0.0 && fast_due) || stopping {
            yielding.turn(false, busy, Some(fast_every + Duration::from_secs(3)));
            last_fast = Some(Instant::now());
            gpu.turn(busy, stopping, &pids, tx);
            if freq.is_some()
                && let Some(f) = host::cpufreq()
            {
                let _ = tx.send(Sample::Cpufreq(CpuFreqReading { ts_ns: monotonic_ns(), cur_khz: f.cur_khz }));
            }
            let m = targets_mem(opts, &pids, cgroup.as_deref(), cpu_cgroup.as_deref());
            let _ = tx.send(Sample::Mem(MemReading { ts_ns: monotonic_ns(), mem: m }));
        }
        let on_demand = snapshot.swap(false, Ordering::Relaxed);
        if (slow_due || stopping)
            && let Some(c) = host::cpuidle()
        {
            let _ = tx.send(Sample::Cpuidle(CpuIdleReading { ts_ns: monotonic_ns(), idle: c }));
        }
        if slow_due || stopping || on_demand {
            files.turn(&pids, busy, stopping, on_demand, tx);
        }
        // Raised for the reading at an arrival ([`Sampler::set_busy`]): idle again after the
        // turn (whatever it read: without fast readings, `--sample-hz 0`, there is none).
        if signal.raised.swap(false, Ordering::Relaxed) {
            yielding.settle();
        }
        if stopping {
            break;
        }
        let next_slow = last_slow.map_or(Duration::ZERO, |t| slow_every.saturating_sub(t.elapsed()));
        let next_fast = match (opts.hz > 0.0, last_fast) {
            (true, Some(t)) => fast_every.saturating_sub(t.elapsed()),
            (true, None) => Duration::ZERO,
            (false, _) => next_slow,
        };
        signal.nap(next_slow.min(next_fast));
    }
    // Not raised by tid once gone (a tid is reused by any process's next thread).
    signal.tid.store(0, Ordering::Relaxed);
}

/// The `samplers` record: what this machine has to sample and what it lacks.
fn sources(opts: &Options, gpu: &Gpus, freq: Option<&host::CpuFreq>, cgroup: Option<&std::path::Path>) -> Sources {
    let mut info = Sources {
        ts_ns: monotonic_ns(),
        hz: opts.hz,
        cpufreq_max_khz: freq.map(|f| f.max_khz.clone()),
        psi: std::path::Path::new("/proc/pressure/memory").exists(),
        memory_cgroup: cgroup.map(|c| c.display().to_string()),
        swaps: host::swaps(),
        ..Default::default()
    };
    // The devices are named by NVML's first reading, once the target is busy (opening NVML at an
    // idle moment would wake a sleeping GPU); their power states come from sysfs meanwhile.
    info.gpu_absent = gpu.absent.clone();
    if freq.is_none() {
        info.cpufreq_absent = Some("no cpufreq in this kernel (VM or driver): CPU clocks not sampled".into());
    }
    info
}

/// The target's memory reading, its children's resident and swapped memory added in.
fn targets_mem(opts: &Options, pids: &[u32], cgroup: Option<&std::path::Path>, cpu_cgroup: Option<&std::path::Path>) -> Mem {
    let mut m = host::mem(opts.pid, cgroup, cpu_cgroup);
    m.steal_ms = host::steal_ms();
    // Children (Ollama's runner) count towards the target's memory.
    for &p in pids.iter().filter(|&&p| p != opts.pid) {
        add_child_mem(&mut m, &host::mem(p, None, None));
    }
    m
}

/// A child's resident (all, file-backed, anonymous) and swapped memory added to `m`'s (a side
/// neither read counts as 0 once the other is added).
fn add_child_mem(m: &mut Mem, c: &Mem) {
    for (a, b) in [
        (&mut m.rss_kib, c.rss_kib),
        (&mut m.rss_file_kib, c.rss_file_kib),
        (&mut m.rss_anon_kib, c.rss_anon_kib),
        (&mut m.swap_kib, c.swap_kib),
    ] {
        *a = Some(a.unwrap_or(0) + b.unwrap_or(0));
    }
}

/// The model files watched for page-cache residency: found among the targets' big files every
/// [`FILE_SCAN_EVERY`] (and at the end and on demand), measured as [`ModelFiles::turn`] says.
#[derive(Default)]
struct ModelFiles {
    files: Vec<residency::Watched>,
    last_file_scan: Option<Instant>,
    last_residency: Option<Instant>,
    all_resident: bool,
    /// What the last full measure took (cachestat walks each file's page tree: about 4 ms for a
    /// 94 MiB model here, so hundreds for a 7 GB one).
    last_cost: Duration,
    /// Looks at sampled pages so far (their positions' seed).
    looks: u64,
    /// Full measures in a row that found every file as the one before (a file partly resident
    /// and steady: an idle server's model that the page cache keeps 99.9% of).
    steady: u32,
    /// The resident pages of each file at the last full measure.
    last_counts: Vec<u64>,
    /// Pages of each file and whether each was resident at the last full measure, looked at
    /// again while a partly resident file is steady ([`PROBE_PAGES`]).
    probes: Vec<Option<Vec<(u64, bool)>>>,
}

/// Pages of a partly resident file looked at each slow turn while it is steady: any of them
/// coming in or going out brings a full measure (a model leaving the cache goes by thousands of
/// pages; a handful leaving is seen by the next full measure). At 64, their one-page cachestats
/// were a tenth of an idle trace's sampler time.
const PROBE_PAGES: u64 = 16;
/// While the target idles and a partly resident file's full measures keep finding the same,
/// they come up to 2^this times less often (doubling with each steady one): the test model
/// 99.9% resident was walked (4 ms) at every 2 s turn, a third of an idle trace's cost.
const STEADY_BACKOFF_SHIFT: u32 = 4;

/// The least time between full measures of a wholly resident model while the target idles (its
/// sampled pages, different ones at each look, are looked at every slow turn meanwhile: a model
/// losing a tenth of its pages is seen within a few turns). At FILE_SCAN_EVERY the full
/// measures were a third of an idle trace's sampler time.
const RESIDENT_IDLE_EVERY: Duration = Duration::from_secs(20);
/// Pages looked at each slow turn of a wholly resident model between full measures.
const SAMPLED_PAGES: u64 = 16;
/// The share of a core full measures may take: while a model is wholly resident (its sampled
/// pages say when that ends), and while it is not (then every second up to this share). At
/// 0.02% the wholly resident test model's full measures (4 ms) were 40% of an idle trace's
/// sampler time; at 0.005% a page missing is still seen by the samples within a few turns.
const RESIDENT_SHARE: f64 = 0.00005;
const PARTIAL_SHARE: f64 = 0.005;

impl ModelFiles {
    /// The once-a-second turn (also the last one, `stopping`, and a SIGUSR1's, `on_demand`): look
    /// for new big files when a scan is due, and send their residency when it is due.
    fn turn(&mut self, pids: &[u32], busy: bool, stopping: bool, on_demand: bool, tx: &mpsc::Sender<Sample>) {
        let files = &mut self.files;
        let before = files.len();
        let scan_every = if busy { FILE_SCAN_EVERY } else { FILE_SCAN_IDLE };
        if self.last_file_scan.is_none_or(|t| t.elapsed() >= scan_every) || stopping || on_demand {
            self.last_file_scan = Some(Instant::now());
            for &p in pids {
                let known: Vec<_> = files.iter().map(|f| f.ident).collect();
                files.extend(residency::big_files(p, MODEL_FILE_MIN_BYTES, &known));
            }
        }
        // A full measure walks each file's page tree (cachestat: its time grows with the
        // model). While the files are wholly in the page cache, a few sampled pages are looked at
        // every slow turn, and a full measure comes when one is missing, else every FILE_SCAN_EVERY
        // or as rarely as keeps full measures under RESIDENT_SHARE of a core; while one is not,
        // every slow turn (a model leaving the cache or loading back is followed closely) up to
        // PARTIAL_SHARE of a core.
        let since = self.last_residency.map(|t: Instant| t.elapsed());
        let every = |floor: Duration, share: f64| floor.max(self.last_cost.div_f64(share));
        let due = stopping
            || on_demand
            || files.len() != before
            || since.is_none_or(|s| {
                if self.all_resident {
                    let floor = if busy { FILE_SCAN_EVERY } else { RESIDENT_IDLE_EVERY };
                    s >= every(floor, RESIDENT_SHARE) || {
                        self.looks += 1;
                        let seed = self.looks.wrapping_mul(SAMPLED_PAGES);
                        !files.iter().all(|f| f.sampled_resident(SAMPLED_PAGES, seed).unwrap_or(s >= FILE_SCAN_EVERY))
                    }
                } else {
                    let floor = every(Duration::from_secs(1), PARTIAL_SHARE).saturating_sub(Duration::from_millis(50));
                    if busy || self.steady == 0 {
                        s >= floor
                    } else {
                        // Partly resident and steady while the target idles: full measures back
                        // off, the probe pages say when something moved.
                        let backoff = 1u32 << self.steady.min(STEADY_BACKOFF_SHIFT);
                        s >= floor * backoff
                            || !files
                                .iter()
                                .zip(&self.probes)
                                .all(|(f, p)| p.as_ref().is_none_or(|p| f.pages_unchanged(p).unwrap_or(s >= floor)))
                    }
                }
            });
        if !files.is_empty() && due {
            let t = Instant::now();
            self.last_residency = Some(t);
            let r: Vec<crate::record::samples::Residency> = files.iter().filter_map(residency::Watched::measure).collect();
            self.last_cost = t.elapsed();
            self.all_resident = r.len() == files.len() && r.iter().all(|x| x.resident >= x.pages);
            let counts: Vec<u64> = r.iter().map(|x| x.resident).collect();
            self.steady = if r.len() == files.len() && counts == self.last_counts { self.steady.saturating_add(1) } else { 0 };
            self.last_counts = counts;
            self.looks += 1;
            let seed = self.looks.wrapping_mul(PROBE_PAGES);
            self.probes = if self.all_resident { Vec::new() } else { files.iter().map(|f| f.page_states(PROBE_PAGES, seed)).collect() };
            let why = if stopping {
                ResidencyWhy::End
            } else if on_demand {
                ResidencyWhy::OnDemand
            } else {
                ResidencyWhy::Periodic
            };
            let _ = tx.send(Sample::Residency(ResidencyReading { ts_ns: monotonic_ns(), why, files: r }));
        }
    }
}

/// The most ports one poll turn asks at once (a thread each).
const MAX_PORTS_AT_ONCE: usize = 64;

fn poll_loop(opts: &Options, tx: &mpsc::Sender<Sample>, signal: &Signal) {
    let mut eps: Vec<endpoints::Endpoint> = Vec::new();
    let mut dead: Vec<std::net::SocketAddr> = Vec::new();
    // Reading /proc/net/tcp walks the kernel's whole TCP hash table (most of this thread's CPU
    // when done every poll): listeners are looked up when the target set changes, else every 30 s.
    let (mut scanned_for, mut scanned_at): (Vec<u32>, Option<Instant>) = (Vec::new(), None);
    let our_ns = procfs::netns(procfs::self_pid());
    while !signal.stopped() {
        let pids = targets(opts);
        if pids != scanned_for || scanned_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
            for &pid in &pids {
                let ns = procfs::netns(pid).filter(|ns| Some(*ns) != our_ns);
                for addr in procfs::listen_addrs(pid) {
                    // One endpoint per port (a dual-stack server lists two addresses).
                    if !eps.iter().any(|e| e.addr.port() == addr.port()) && !dead.contains(&addr) {
                        let mut e = endpoints::Endpoint::new(addr);
                        if ns.is_some() {
                            e.netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).ok().map(std::sync::Arc::new);
                        }
                        eps.push(e);
                    }
                }
            }
            (scanned_for, scanned_at) = (pids, Some(Instant::now()));
        }
        // Every port at once, each in a thread of its own: a turn takes as long as its slowest
        // port, not their sum. vLLM's worker listens on a dozen ports that never answer HTTP
        // (torch's gloo); asked one after another, at 0.8 s each, they held the server's own poll
        // back for 20 s at every start. A server in a network namespace of its own (a container)
        // is polled from inside it: its port's thread enters the namespace (setns changes only
        // the calling thread, which ends with the poll). At most MAX_PORTS_AT_ONCE threads; the
        // ports past them take their turn next (the list is rotated below).
        let polled: Vec<Option<(u64, Option<EndpointPoll>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = eps
                .iter_mut()
                .take(MAX_PORTS_AT_ONCE)
                .map(|ep| {
                    let headers = crate::util::httpc::thread_headers();
                    std::thread::Builder::new().name("probe-poll-port".into()).spawn_scoped(s, move || {
                        crate::util::httpc::with_headers(headers, move || {
                            let t = monotonic_ns();
                            // Not inside the server's namespace, its port here is another's.
                            if let Some(ns) = &ep.netns
                                && procfs::enter_netns(ns.as_ref()).is_err()
                            {
                                return None;
                            }
                            Some((t, ep.poll()))
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.ok().and_then(|h| h.join().ok().flatten())).collect()
        });
        let mut i = 0;
        for polled in polled {
            let Some((t, polled)) = polled else {
                // Not polled this turn (no thread, or its namespace not entered): asked again.
                i += 1;
                continue;
            };
            match polled {
                Some(mut rec) => {
                    rec.ts_ns = t;
                    let _ = tx.send(Sample::Endpoint(rec));
                    i += 1;
                }
                None if eps[i].kind.is_none() => {
                    // Not HTTP (or not on loopback): stop asking.
                    let _ = tx.send(Sample::Endpoint(EndpointPoll {
                        ts_ns: t,
                        addr: eps[i].addr.to_string(),
                        kind: endpoints::Kind::NotHttp,
                        local_ports: eps[i].local_ports.clone(),
                        ..Default::default()
                    }));
                    dead.push(eps.remove(i).addr);
                }
                None => i += 1,
            }
        }
        if eps.len() > MAX_PORTS_AT_ONCE {
            eps.rotate_left(MAX_PORTS_AT_ONCE);
        }
        // Every POLL_EVERY while the target is busy, every IDLE_POLL_EVERY while it idles (a
        // change to busy wakes this and shortens the wait). A poll made while busy is followed
        // by one more at the busy rate: the counters at the end of a burst (vLLM's preemptions,
        // queue lengths) are read within seconds of its last request, not ten.
        let polled = Instant::now();
        let busy_then = signal.busy();
        loop {
            let every = if signal.busy() || busy_then { POLL_EVERY } else { IDLE_POLL_EVERY };
            let left = every.saturating_sub(polled.elapsed());
            if signal.stopped() || left.is_zero() {
                break;
            }
            signal.nap(left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child's resident and swapped memory adds to the target's; a side neither read counts
    /// as 0 once the other is added (as before: the sum is always read).
    #[test]
    fn a_childs_memory_adds_to_the_targets() {
        let mut m = Mem { rss_kib: Some(100), swap_kib: Some(5), ..Default::default() };
        let c = Mem { rss_kib: Some(20), rss_file_kib: Some(7), ..Default::default() };
        add_child_mem(&mut m, &c);
        assert_eq!((m.rss_kib, m.rss_file_kib, m.rss_anon_kib, m.swap_kib), (Some(120), Some(7), Some(0), Some(5)));
    }
}
