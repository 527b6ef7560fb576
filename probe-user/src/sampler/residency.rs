//! How much of a file is in the page cache: `cachestat(2)` (Linux 6.5+, also counts pages evicted
//! since the file was opened... by anyone) with a `mincore(2)` fallback over a read-only mapping
//! that is never touched (so it faults nothing in and pins nothing). A model file is opened once
//! (crate::os::target_file: the file the target maps or holds open, verified) and measured through
//! that descriptor: never re-opened by a path the target could point somewhere else.
use std::{fs::File, os::fd::AsRawFd as _};

use crate::{
    os::target_file::{self, Ident},
    record::samples::Residency,
};

#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

const SYS_CACHESTAT: libc::c_long = 451;

/// A model file watched for residency: opened and verified once, measured through `file`.
#[derive(Debug)]
pub struct Watched {
    /// The path the target knew it by when it was found (the name in the records).
    pub path: String,
    pub ident: Ident,
    file: File,
}

impl Watched {
    pub fn measure(&self) -> Option<Residency> {
        measure(&self.file, &self.path)
    }

    /// Whether `n` pages of the file, spread over it from `seed`, are all in the page cache: a
    /// look at a wholly resident file that costs `n` one-page cachestat calls, not a walk of its
    /// whole page tree. None where cachestat(2) is missing (then only a full measure tells).
    pub fn sampled_resident(&self, n: u64, seed: u64) -> Option<bool> {
        for at in self.sample_pages(n, seed)? {
            if !self.page_cached(at)? {
                return Some(false);
            }
        }
        Some(true)
    }

    /// `n` pages spread over the file from `seed` and whether each is in the page cache now: what
    /// [`Watched::pages_unchanged`] compares with later. None where cachestat(2) is missing.
    pub fn page_states(&self, n: u64, seed: u64) -> Option<Vec<(u64, bool)>> {
        self.sample_pages(n, seed)?.into_iter().map(|at| Some((at, self.page_cached(at)?))).collect()
    }

    /// Whether each page of `known` is still in (or still out of) the page cache: a file partly
    /// resident and steady looked at without a walk of its page tree. None where cachestat(2) is
    /// missing.
    pub fn pages_unchanged(&self, known: &[(u64, bool)]) -> Option<bool> {
        for &(at, was) in known {
            if self.page_cached(at)? != was {
                return Some(false);
            }
        }
        Some(true)
    }

    /// Evenly spaced strata of the file's pages, a position in each from `seed` (a different one
    /// for each seed).
    fn sample_pages(&self, n: u64, seed: u64) -> Option<Vec<u64>> {
        if std::env::var_os("PROBE_NO_CACHESTAT").is_some() {
            return None;
        }
        let pages = self.file.metadata().ok()?.len().div_ceil(page_size());
        if pages == 0 {
            return Some(Vec::new());
        }
        let stratum = pages.div_ceil(n.max(1)).max(1);
        Some((0..n).map(|i| (i * stratum + splitmix(seed.wrapping_add(i)) % stratum).min(pages - 1)).collect())
    }

    /// Whether page `at` of the file is in the page cache (one-page cachestat).
    fn page_cached(&self, at: u64) -> Option<bool> {
        let page = page_size();
        let range = CachestatRange { off: at * page, len: page };
        let mut cs = Cachestat::default();
        // SAFETY: as in `measure`: valid fd, live structs of the syscall's layout, flags 0.
        let rc =
            unsafe { libc::syscall(SYS_CACHESTAT, self.file.as_raw_fd(), &range as *const CachestatRange, &mut cs as *mut Cachestat, 0) };
        (rc == 0).then_some(cs.nr_cache > 0)
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
}

/// A 64-bit mix of `x` (splitmix64's finaliser): sample positions that differ from look to look.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The residency of the open file `f` (named `path` in the result).
pub fn measure(f: &File, path: &str) -> Option<Residency> {
    let md = f.metadata().ok()?;
    let bytes = md.len();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let pages = bytes.div_ceil(page);
    use std::os::unix::fs::MetadataExt as _;
    let mut r = Residency { path: path.to_string(), bytes, pages, inode: md.ino(), mtime_unix_s: md.mtime(), ..Default::default() };
    if bytes == 0 {
        return Some(r);
    }
    if std::env::var_os("PROBE_NO_CACHESTAT").is_none() {
        let range = CachestatRange { off: 0, len: 0 }; // len 0: to the end of the file
        let mut cs = Cachestat::default();
        // SAFETY: valid fd, pointers to live structs of the layout the syscall expects, flags 0.
        let rc = unsafe { libc::syscall(SYS_CACHESTAT, f.as_raw_fd(), &range as *const CachestatRange, &mut cs as *mut Cachestat, 0) };
        if rc == 0 {
            r.resident = cs.nr_cache.min(pages);
            r.evicted = Some(cs.nr_evicted);
            return Some(r);
        }
    }
    r.resident = mincore_resident(f, bytes, page)?;
    Some(r)
}

/// The most of a file one mincore(2) window maps (its vector: a byte per page, 256 KiB here).
const MINCORE_WINDOW: u64 = 1 << 30;
/// The most data extents (SEEK_DATA … SEEK_HOLE) and windows one measurement walks: a file made
/// of a million tiny extents is not measured (None, said once) rather than walked for minutes.
const MINCORE_EXTENTS: usize = 4096;
const MINCORE_WINDOWS: usize = 16384;

/// Resident pages of `f` (`bytes` long) by mincore(2), the fallback where cachestat(2) is
/// missing (before Linux 6.5): over the file's allocated blocks only (a hole has no pages to
/// count: a sparse file's size says nothing of its cost here), in windows of at most
/// [`MINCORE_WINDOW`], each a read-only shared mapping that is never touched (it faults nothing
/// in) and is unmapped before the next.
fn mincore_resident(f: &File, bytes: u64, page: u64) -> Option<u64> {
    let fd = f.as_raw_fd();
    let (mut resident, mut at, mut extents, mut windows) = (0u64, 0u64, 0usize, 0usize);
    let mut vec = Vec::new();
    while at < bytes {
        // SAFETY: lseek on a descriptor we hold; only its offset changes (nothing reads through it).
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            // ENXIO: no data past `at`. Another error: SEEK_DATA unsupported, all of it is data.
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return windows_resident(fd, at, bytes, page, &mut vec, &mut windows).map(|n| resident + n);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { bytes } else { (hole as u64).min(bytes) };
        extents += 1;
        if extents > MINCORE_EXTENTS {
            log::info!("residency: a file of more than {MINCORE_EXTENTS} extents is not measured by mincore");
            return None;
        }
        resident += windows_resident(fd, (data as u64) / page * page, end, page, &mut vec, &mut windows)?;
        at = end.max(data as u64 + 1);
    }
    Some(resident)
}

/// Resident pages of `from..to` of `fd`, a window at a time.
fn windows_resident(fd: i32, from: u64, to: u64, page: u64, vec: &mut Vec<u8>, windows: &mut usize) -> Option<u64> {
    let mut resident = 0;
    let mut at = from;
    while at < to {
        *windows += 1;
        if *windows > MINCORE_WINDOWS {
            log::info!("residency: a file of more than {MINCORE_WINDOWS} GiB of data is not measured by mincore");
            return None;
        }
        let len = (to - at).min(MINCORE_WINDOW);
        // SAFETY: a fresh read-only shared mapping of `len` bytes at `at` (page-aligned), never
        // dereferenced; unmapped below.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ, libc::MAP_SHARED, fd, at as libc::off_t) };
        if addr == libc::MAP_FAILED {
            return None;
        }
        vec.clear();
        vec.resize(len.div_ceil(page) as usize, 0);
        // SAFETY: addr..addr+len is our mapping; vec has one byte per page of it.
        let ok = unsafe { libc::mincore(addr, len as usize, vec.as_mut_ptr()) } == 0;
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(addr, len as usize) };
        if !ok {
            return None;
        }
        resident += vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
        at += len;
    }
    Some(resident)
}

/// Regular files of at least `min_bytes` that `pid` maps or has open (model weights), other than
/// the `known` ones, opened and verified (a mapped file through /proc/PID/map_files, an open one
/// below the target's root with the device and inode its descriptor has).
pub fn big_files(pid: u32, min_bytes: u64, known: &[Ident]) -> Vec<Watched> {
    let mut seen: Vec<Ident> = known.to_vec();
    let mut out = Vec::new();
    let mut keep = |path: &str, ident: Ident, opened: Result<target_file::TargetFile, target_file::Refused>| match opened {
        Ok(t) if t.size >= min_bytes => out.push(Watched { path: path.to_string(), ident, file: t.file }),
        Ok(_) => {}
        Err(e) => log::debug!("residency: {e}"),
    };
    for m in crate::os::procfs::read_maps(pid).unwrap_or_default() {
        let ident = Ident::of(&m);
        if !seen.contains(&ident) {
            seen.push(ident);
            keep(&m.path, ident, target_file::open_mapping(Some(pid), &m, u64::MAX));
        }
    }
    for f in crate::os::procfs::open_files(pid) {
        let ident = Ident { major: f.major, minor: f.minor, inode: f.inode };
        if f.path.starts_with('/') && !seen.contains(&ident) {
            seen.push(ident);
            keep(&f.path, ident, target_file::open_path(Some(pid), &f.path, Some(ident), u64::MAX));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_file_just_written_is_resident() {
        let p = std::env::temp_dir().join(format!("probe-residency-{}", std::process::id()));
        std::fs::write(&p, vec![1u8; 1 << 20]).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let r = super::measure(&f, p.to_str().unwrap()).unwrap();
        // The fallback counts the same pages.
        let page = 4096;
        let by_mincore = super::mincore_resident(&f, 1 << 20, page).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(r.bytes, 1 << 20);
        assert!(r.share() > 0.9, "{r:?}");
        assert_eq!(by_mincore, r.resident, "{r:?}");
    }

    /// The sampled look agrees with the kernel: a file just written is all in the page cache;
    /// once its pages are dropped (written back, then POSIX_FADV_DONTNEED) a sampled page is
    /// missing, and a full measure is asked for.
    #[test]
    fn sampled_pages_see_a_file_leave_the_page_cache() {
        use std::os::fd::AsRawFd as _;
        let p = std::env::temp_dir().join(format!("probe-sampled-{}", std::process::id()));
        std::fs::write(&p, vec![7u8; 4 << 20]).unwrap();
        let file = std::fs::File::open(&p).unwrap();
        let w =
            super::Watched { path: p.display().to_string(), ident: crate::os::target_file::Ident { major: 0, minor: 0, inode: 0 }, file };
        assert_eq!(w.sampled_resident(16, 1), Some(true));
        std::fs::File::open(&p).unwrap().sync_all().unwrap();
        // SAFETY: fadvise on a descriptor we hold; it only drops clean cached pages.
        assert_eq!(unsafe { libc::posix_fadvise(w.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
        let full = w.measure().unwrap();
        std::fs::remove_file(&p).unwrap();
        assert!(full.resident < full.pages / 2, "the kernel kept the pages: {full:?}");
        assert_eq!(w.sampled_resident(16, 2), Some(false));
    }
}
