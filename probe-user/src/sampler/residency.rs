//! How much of a file is in the page cache: `cachestat(2)` (Linux 6.5+, also counts pages evicted
//! since the file was opened... by anyone) with a `mincore(2)` fallback over a read-only mapping
//! that is never touched (so it faults nothing in and pins nothing).
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Residency {
    pub path: String,
    pub bytes: u64,
    pub pages: u64,
    pub resident: u64,
    /// Pages of the file evicted from the cache (cachestat only; since boot, per inode history).
    pub evicted: Option<u64>,
}

impl Residency {
    pub fn share(&self) -> f64 {
        if self.pages == 0 { 1.0 } else { self.resident as f64 / self.pages as f64 }
    }
}

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

pub fn measure(path: &str) -> Option<Residency> {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::File::open(path).ok()?;
    let bytes = f.metadata().ok()?.len();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let pages = bytes.div_ceil(page);
    let mut r = Residency { path: path.to_string(), bytes, pages, ..Default::default() };
    if bytes == 0 {
        return Some(r);
    }
    let range = CachestatRange { off: 0, len: 0 }; // len 0: to the end of the file
    let mut cs = Cachestat::default();
    // SAFETY: valid fd, pointers to live structs of the layout the syscall expects, flags 0.
    let rc = unsafe { libc::syscall(SYS_CACHESTAT, f.as_raw_fd(), &range as *const CachestatRange, &mut cs as *mut Cachestat, 0) };
    if rc == 0 {
        r.resident = cs.nr_cache.min(pages);
        r.evicted = Some(cs.nr_evicted);
        return Some(r);
    }
    // SAFETY: a fresh read-only shared mapping of the whole file, never dereferenced; unmapped below.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), bytes as usize, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    if addr == libc::MAP_FAILED {
        return None;
    }
    let mut vec = vec![0u8; pages as usize];
    // SAFETY: addr..addr+bytes is our mapping; vec has one byte per page.
    let ok = unsafe { libc::mincore(addr, bytes as usize, vec.as_mut_ptr()) } == 0;
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(addr, bytes as usize) };
    if !ok {
        return None;
    }
    r.resident = vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
    Some(r)
}

/// Regular files of at least `min_bytes` that `pid` maps or has open: model weights.
pub fn big_files(pid: u32, min_bytes: u64) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mapped = crate::procfs::read_maps(pid).unwrap_or_default().into_iter().map(|m| m.path);
    let open = crate::procfs::open_files(pid).into_iter().map(|f| f.path);
    for p in mapped.chain(open) {
        if !p.starts_with('/') || out.contains(&p) {
            continue;
        }
        if std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.len() >= min_bytes) {
            out.push(p);
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
        let r = super::measure(p.to_str().unwrap()).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(r.bytes, 1 << 20);
        assert!(r.share() > 0.9, "{r:?}");
    }
}
