//! Verified programs kept for the next trace. Arming is mostly the kernel's verifier (about 75,000
//! instructions walked, 60-80 ms of a 110-150 ms arming on two cores); a program the verifier has
//! passed stays loaded while it is pinned in bpffs, and a later trace can attach it as it is. So a
//! trace pins its programs and maps under `/sys/fs/bpf/probe/KEY/` and the next one with the same
//! key takes them: it empties the maps (state left by the last trace: its threads, sockets, stack
//! sizes, counters) and skips what was left in the ring, so a kept set starts as a new one does.
//!
//! - KEY: probe's executable (device, inode, size, mtime) and everything baked into the programs
//!   at load (the kernel's struct offsets, the ring's size, the off-CPU and stack-copy options).
//!   bpffs is a memory filesystem: the set goes with the boot, as the kernel it was verified for.
//! - One trace at a time holds the set (`/run/probe/kept.lock`, until its programs are detached:
//!   the hand-off child holds it too): another trace meanwhile loads its own, as before.
//! - What it costs: the maps' memory stays allocated between traces (the ring, 32 MiB by default,
//!   and about 28 MiB of hash tables: `bpftool map` lists them), and nothing runs: no program is
//!   attached between traces. `--no-keep` removes the set and keeps none; so does a reboot.
//! - A map is taken only with the programs verified against it: where any map had to be made
//!   again, the kept programs are unpinned first.
//!
//! Root-safe: `/sys/fs/bpf/probe` and the set's directories are made 0700 and used only when they
//! are real directories of the effective user that no one else can write ([`run_dir::open_dir`]);
//! bpffs is mounted on `/sys/fs/bpf` where nothing is, as systemd does at boot.
use std::{
    ffi::CString,
    fs::File,
    os::{
        fd::{AsRawFd as _, FromRawFd as _},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Map, MapData},
    programs::{PerfEvent, Program, RawTracePoint, TracePoint, UProbe},
};

use crate::os::run_dir;

const BPF_FS: &str = "/sys/fs/bpf";
const ROOT: &str = "/sys/fs/bpf/probe";
/// `BPF_FS_MAGIC` (include/uapi/linux/magic.h).
const BPF_FS_MAGIC: u32 = 0xcafe_4a11;
const LOCK: &std::ffi::CStr = c"kept.lock";

/// A kept set this trace holds: its directory and the lock.
pub struct Kept {
    dir: PathBuf,
    lock: File,
    /// Maps the load opened from their pins (the rest were made and pinned now).
    reused_maps: usize,
    /// Programs taken from their pins (not verified in this trace).
    pub adopted: usize,
}

/// The key of a set: everything the programs were verified with.
pub fn key(parts: &[&[u8]]) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::os::kernel_cache::exe_id().hash(&mut h);
    for p in parts {
        p.hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

/// What a trace does with kept programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Take the set an earlier trace kept, and keep this trace's (`probe trace`).
    Take,
    /// Neither take nor keep; leave the set as it is (`probe watch`, `probe doctor`).
    Leave,
    /// Keep nothing, and remove the set (`probe trace --no-keep`).
    Forget,
}

/// The set for `key`, held for this trace; or why there is none.
pub fn open(key: &str, keep: Keep) -> Result<Kept, String> {
    match keep {
        Keep::Take => {}
        Keep::Leave => return Err("not kept (this command keeps none)".into()),
        Keep::Forget => {
            if let Some(lock) = try_lock() {
                forget_all(None);
                drop(lock);
            }
            return Err("not kept (--no-keep)".into());
        }
    }
    mount_bpffs()?;
    let lock = try_lock().ok_or("another trace holds the kept programs (or /run/probe cannot hold their lock)")?;
    let root = Path::new(ROOT);
    run_dir::open_dir(root, true).ok_or_else(|| format!("{ROOT} is not a directory of root's that only root can write"))?;
    forget_all(Some(key));
    let dir = root.join(key);
    for d in [dir.clone(), dir.join("maps"), dir.join("progs")] {
        run_dir::open_dir(&d, true).ok_or_else(|| format!("{} could not be made (or is not root's alone)", d.display()))?;
    }
    Ok(Kept { dir, lock, reused_maps: 0, adopted: 0 })
}

impl Kept {
    /// Where the loader keeps the maps ([`aya::EbpfLoader::keep_maps_in`]).
    pub fn maps_dir(&self) -> PathBuf {
        self.dir.join("maps")
    }

    /// The lock's descriptor: the hand-off child holds it until the programs are detached.
    pub fn lock_fd(&self) -> i32 {
        self.lock.as_raw_fd()
    }

    /// After the load: where any map was made anew, the kept programs go (verified against maps
    /// that are gone); the maps that were kept are emptied and the ring's leftovers skipped.
    pub fn loaded(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let reused: Vec<String> = ebpf.maps_opened_from_pins().to_vec();
        self.reused_maps = reused.len();
        if reused.len() < ebpf.maps().count() {
            remove_entries(&self.dir.join("progs"));
        }
        for (name, map) in ebpf.maps_mut() {
            if reused.iter().any(|r| r == name) {
                empty(name, map).map_err(|e| anyhow::anyhow!("cannot empty the kept map {name}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Take each program from its pin, where one is kept: it is loaded and verified already.
    /// Counted in [`Kept::adopted`]; returns their names (their run counts so far are earlier
    /// traces').
    pub fn adopt<'a>(&mut self, programs: impl Iterator<Item = (&'a str, &'a mut Program)>) -> Vec<String> {
        let mut taken_names = Vec::new();
        for (name, p) in programs {
            let path = self.dir.join("progs").join(name);
            if p.fd().is_ok() || !path.exists() {
                continue;
            }
            let taken = match p {
                Program::TracePoint(_) => TracePoint::from_pin(&path).map(Program::TracePoint),
                Program::RawTracePoint(_) => RawTracePoint::from_pin(&path).map(Program::RawTracePoint),
                Program::PerfEvent(_) => PerfEvent::from_pin(&path).map(Program::PerfEvent),
                Program::UProbe(u) => UProbe::from_pin(&path, u.kind()).map(Program::UProbe),
                _ => continue,
            };
            match taken {
                Ok(t) => {
                    *p = t;
                    taken_names.push(name.to_string());
                    self.adopted += 1;
                }
                Err(e) => {
                    log::debug!("kept program {name} not taken ({e}): verified again");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        taken_names
    }

    /// Pin each loaded program that is not kept yet (verified in this trace).
    /// Returns how many were pinned.
    pub fn keep<'a>(&self, programs: impl Iterator<Item = (&'a str, &'a mut Program)>) -> usize {
        let mut n = 0;
        for (name, p) in programs {
            let path = self.dir.join("progs").join(name);
            if p.fd().is_err() || path.exists() {
                continue;
            }
            match p.pin(&path) {
                Ok(()) => n += 1,
                Err(e) => log::debug!("program {name} not kept: {e}"),
            }
        }
        n
    }

    /// Move the lock to a descriptor above every one this trace has opened so far: a process
    /// that exits (SIGKILL included) closes its descriptors in ascending order, and closing an
    /// attached tracepoint waits for the kernel (up to seconds for all of them), so the lock goes
    /// only after everything attached while arming is detached; a trace that took the set
    /// meanwhile would see each event twice.
    pub fn hold_lock_last(&mut self) {
        let top = std::fs::read_dir("/proc/self/fd")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .max()
            .unwrap_or(0);
        // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own; the new one is owned below.
        let fd = unsafe { libc::fcntl(self.lock.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top + 1) };
        if fd >= 0 {
            // SAFETY: a descriptor just made, owned by nothing else; the lock is the open file
            // description's, shared by both, so closing the old one keeps it.
            self.lock = File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
        }
    }

    /// Remove this set (it could not be taken); the lock goes with `self`.
    pub fn forget(self) {
        forget_all(None);
    }

    /// What `-v` says of the set.
    pub fn stage(&self) -> &'static str {
        if self.reused_maps == 0 { "kept_set (made)" } else { "kept_set (reused)" }
    }
}

/// What is kept now, for `probe doctor`: the sets under [`ROOT`] and their pins.
pub fn describe() -> String {
    let count = |d: &Path| std::fs::read_dir(d).map_or(0, |r| r.count());
    let sets: Vec<String> = std::fs::read_dir(ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| format!("{} ({} programs, {} maps)", e.path().display(), count(&e.path().join("progs")), count(&e.path().join("maps"))))
        .collect();
    if sets.is_empty() {
        "none: the next trace verifies its programs and keeps them for the one after".to_string()
    } else {
        format!("{}: the next trace takes them unverified; `probe trace --no-keep` removes them", sets.join(", "))
    }
}

/// The kept-set lock, taken without waiting (None: held by another trace, or no lock file).
fn try_lock() -> Option<File> {
    let f = run_dir::lock_file(Path::new(run_dir::DIR), LOCK)?;
    // SAFETY: flock on a descriptor we own.
    (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0).then_some(f)
}

/// bpffs on /sys/fs/bpf: there already (systemd mounts it), or mounted now.
fn mount_bpffs() -> Result<(), String> {
    let is_bpffs = || {
        let c = CString::new(BPF_FS).unwrap_or_default();
        // SAFETY: a NUL-terminated path and a statfs we own.
        let mut s: libc::statfs = unsafe { std::mem::zeroed() };
        unsafe { libc::statfs(c.as_ptr(), &mut s) == 0 && s.f_type as u32 == BPF_FS_MAGIC }
    };
    if is_bpffs() {
        return Ok(());
    }
    let (src, target, opts) = (c"bpf", CString::new(BPF_FS).unwrap_or_default(), c"mode=0700");
    // SAFETY: valid NUL-terminated strings.
    let rc = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), src.as_ptr(), 0, opts.as_ptr().cast()) };
    if rc != 0 && !is_bpffs() {
        return Err(format!("no bpffs on {BPF_FS} and mounting one failed ({})", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Remove every set under [`ROOT`] but `keep`'s (the lock is held).
fn forget_all(keep: Option<&str>) {
    let Ok(dir) = std::fs::read_dir(ROOT) else { return };
    for e in dir.flatten() {
        if keep.is_some_and(|k| e.file_name().as_bytes() == k.as_bytes()) {
            continue;
        }
        let p = e.path();
        remove_entries(&p.join("progs"));
        remove_entries(&p.join("maps"));
        for d in [p.join("progs"), p.join("maps"), p] {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Unpin everything in `dir` (pins only: bpffs holds nothing else of ours).
fn remove_entries(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| !t.is_dir()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The map's data, whatever its kind.
fn data(map: &mut Map) -> Option<&mut MapData> {
    Some(match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::RingBuf(d)
        | Map::StackTraceMap(d) => d,
        _ => return None,
    })
}

/// Empty a kept map as a new one is: a hash table's entries deleted, an array's values zeroed,
/// the ring's unread records skipped. The read-only globals (`.rodata*`) hold what the key says.
fn empty(name: &str, map: &mut Map) -> Result<(), String> {
    if name.starts_with(".rodata") {
        return Ok(());
    }
    let Some(d) = data(map) else { return Err("a kind of map probe does not empty".into()) };
    let info = d.info().map_err(|e| e.to_string())?;
    let fd = std::os::fd::AsFd::as_fd(d.fd()).as_raw_fd();
    let (key, value, max) = (info.key_size() as usize, info.value_size() as usize, info.max_entries());
    match map {
        Map::HashMap(_) | Map::LruHashMap(_) | Map::StackTraceMap(_) => delete_all(fd, key, value, 1),
        Map::PerCpuHashMap(_) | Map::PerCpuLruHashMap(_) => delete_all(fd, key, value.next_multiple_of(8), possible_cpus()),
        Map::Array(_) => zero_all(fd, max, value),
        Map::PerCpuArray(_) => zero_all(fd, max, value.next_multiple_of(8) * possible_cpus()),
        Map::RingBuf(_) => skip_ring(fd),
        _ => Err("a kind of map probe does not empty".into()),
    }
}

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;

/// `union bpf_attr` for the element commands.
#[repr(C, align(8))]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next: u64,
    flags: u64,
}

/// `union bpf_attr` for the batch commands.
#[repr(C, align(8))]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

pub(super) fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> Result<(), std::io::Error> {
    // SAFETY: `attr` is a bpf_attr prefix for `cmd` whose pointers address live buffers of the
    // sizes the map's key and value take.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Delete every entry of a hash table: in batches of up to 1,024 (one call each), else one by one.
fn delete_all(fd: i32, key: usize, value: usize, cpus: usize) -> Result<(), String> {
    let mut count = 1024usize;
    let mut keys = vec![0u8; key * count];
    let mut values = vec![0u8; value * cpus * count];
    let (mut token_in, mut token_out) = ([0u64; 8], [0u64; 8]);
    let mut first = true;
    loop {
        let mut a = BatchAttr {
            in_batch: if first { 0 } else { token_in.as_mut_ptr() as u64 },
            out_batch: token_out.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: count as u32,
            map_fd: fd as u32,
            elem_flags: 0,
            flags: 0,
        };
        match bpf(BPF_MAP_LOOKUP_AND_DELETE_BATCH, &mut a) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && count < 1 << 16 => {
                // One bucket holds more than a batch: a larger batch.
                count *= 4;
                keys.resize(key * count, 0);
                values.resize(value * cpus * count, 0);
                continue;
            }
            Err(_) => return delete_one_by_one(fd, key),
        }
        token_in = token_out;
        first = false;
    }
}

/// Delete every entry, asking for the first key each time (a map with no batch commands).
fn delete_one_by_one(fd: i32, key: usize) -> Result<(), String> {
    let mut k = vec![0u8; key];
    for _ in 0..(1 << 20) {
        let mut a = ElemAttr { map_fd: fd as u32, _pad: 0, key: 0, value_or_next: k.as_mut_ptr() as u64, flags: 0 };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut a) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(format!("get_next_key: {e}")),
        }
        let mut d = ElemAttr { map_fd: fd as u32, _pad: 0, key: k.as_mut_ptr() as u64, value_or_next: 0, flags: 0 };
        bpf(BPF_MAP_DELETE_ELEM, &mut d).map_err(|e| format!("delete: {e}"))?;
    }
    Err("entries kept coming".into())
}

/// Zero every value of an array (`value` bytes each, every CPU's for a per-CPU one).
fn zero_all(fd: i32, max: u32, value: usize) -> Result<(), String> {
    let mut zeros = vec![0u8; value];
    for mut i in 0..max {
        let mut a = ElemAttr { map_fd: fd as u32, _pad: 0, key: (&raw mut i) as u64, value_or_next: zeros.as_mut_ptr() as u64, flags: 0 };
        bpf(BPF_MAP_UPDATE_ELEM, &mut a).map_err(|e| format!("update [{i}]: {e}"))?;
    }
    Ok(())
}

/// Skip what the ring holds: its consumer position set to the producer's (two pages mapped: the
/// records are not touched).
fn skip_ring(fd: i32) -> Result<(), String> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    // SAFETY: a ring buffer map's first page is its consumer position (read-write), the second
    // its producer position (read-only); each mapping is checked and unmapped below.
    unsafe {
        let cons = libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        if cons == libc::MAP_FAILED {
            return Err(format!("mmap consumer page: {}", std::io::Error::last_os_error()));
        }
        let prod = libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ, libc::MAP_SHARED, fd, page as libc::off_t);
        if prod == libc::MAP_FAILED {
            libc::munmap(cons, page);
            return Err(format!("mmap producer page: {}", std::io::Error::last_os_error()));
        }
        let p = (*(prod as *const std::sync::atomic::AtomicU64)).load(std::sync::atomic::Ordering::Acquire);
        (*(cons as *const std::sync::atomic::AtomicU64)).store(p, std::sync::atomic::Ordering::Release);
        libc::munmap(prod, page);
        libc::munmap(cons, page);
    }
    Ok(())
}

/// The possible CPUs (/sys/devices/system/cpu/possible: `0-3`), as per-CPU values count them.
pub(super) fn possible_cpus() -> usize {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let last = text.trim().rsplit([',', '-']).next().and_then(|n| n.parse::<usize>().ok());
    last.map_or(1, |n| n + 1)
}
