//! Opening a file the target names (a mapped ELF, a model file), as root, without letting the
//! target choose what root opens: through `/proc/PID/map_files/START-END` (exactly the mapped file,
//! even renamed or deleted) or `/proc/PID/root/PATH` while the process lives, the plain path only
//! after it is gone; never blocking (`O_NONBLOCK`: a FIFO at the path does not hang the caller);
//! and only a regular file whose device and inode are the ones the kernel reported for the
//! mapping (`fstat`), so a device (`/dev/zero`, `/dev/nvidia0`) or a file swapped in at the same
//! path is refused with the reason, never read.
use std::{
    fs::File,
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use crate::os::procfs::Mapping;

/// ELF files bigger than this are not parsed for unwinding (bytes): no real binary is this big,
/// and a mapping of something huge must not become probe's memory.
pub const MAX_ELF_BYTES: u64 = 4 << 30;

/// Which file a mapping or an open file is, as the kernel reported it (/proc/PID/maps, fd links).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ident {
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
}

impl Ident {
    pub fn of(m: &Mapping) -> Ident {
        Ident { major: m.major, minor: m.minor, inode: m.inode }
    }
}

impl std::fmt::Display for Ident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{} inode {}", self.major, self.minor, self.inode)
    }
}

/// Why a target's file was not opened. Each says what it found and what that means.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("cannot open {path}: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("{path} is a {kind}, not a regular file: not read (a device or FIFO at a mapped path never ends or blocks)")]
    NotRegular { path: String, kind: &'static str },
    #[error("{path} is {got}, but the target mapped {want}: the file was replaced since, not read")]
    Changed { path: String, want: Ident, got: Ident },
    #[error("{path} is {size} bytes, over the {cap}-byte limit: not read")]
    TooBig { path: String, size: u64, cap: u64 },
}

/// A verified open file of the target: regular, the expected one, opened where it said.
#[derive(Debug)]
pub struct TargetFile {
    pub file: File,
    /// Size in bytes (fstat).
    pub size: u64,
    /// The path it was opened by (`/proc/PID/map_files/...`, `/proc/PID/root/...` or the plain path).
    pub opened: PathBuf,
}

fn kind(ft: std::fs::FileType) -> &'static str {
    if ft.is_fifo() {
        "FIFO"
    } else if ft.is_char_device() {
        "character device"
    } else if ft.is_block_device() {
        "block device"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// btrfs reports a subvolume's anonymous device in `st_dev` but the superblock's in
/// /proc/PID/maps, so only the inode can be compared there.
fn dev_comparable(f: &File) -> bool {
    use std::os::fd::AsRawFd as _;
    const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, pointer to a live statfs.
    let rc = unsafe { libc::fstatfs(f.as_raw_fd(), &mut s) };
    rc != 0 || s.f_type as i64 != BTRFS_SUPER_MAGIC
}

/// Open `path` read-only without blocking or following a last-component symlink (unless it is a
/// /proc magic link: `magic`), then check with fstat that it is a regular file, that it is
/// `want` when known, and not over `cap` bytes.
pub fn open_verified(path: &Path, magic: bool, want: Option<Ident>, cap: u64) -> Result<TargetFile, Refused> {
    let shown = || path.display().to_string();
    let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    if !magic {
        flags |= libc::O_NOFOLLOW;
    }
    let file = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path).map_err(|err| Refused::Open { path: shown(), err })?;
    let meta = file.metadata().map_err(|err| Refused::Open { path: shown(), err })?;
    if !meta.file_type().is_file() {
        return Err(Refused::NotRegular { path: shown(), kind: kind(meta.file_type()) });
    }
    if let Some(want) = want {
        let got = Ident { major: libc::major(meta.dev()), minor: libc::minor(meta.dev()), inode: meta.ino() };
        let same_dev = (got.major, got.minor) == (want.major, want.minor) || !dev_comparable(&file);
        if got.inode != want.inode || !same_dev {
            return Err(Refused::Changed { path: shown(), want, got });
        }
    }
    if meta.len() > cap {
        return Err(Refused::TooBig { path: shown(), size: meta.len(), cap });
    }
    Ok(TargetFile { file, size: meta.len(), opened: path.to_path_buf() })
}

/// The name the kernel gives a mapping in /proc/PID/map_files (lowercase hex, no padding).
pub fn map_files_path(pid: u32, start: u64, end: u64) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{start:x}-{end:x}"))
}

/// `path` as the target sees it: below its root (its mount namespace, its chroot).
pub fn root_path(pid: u32, path: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root/{}", path.trim_start_matches('/')))
}

/// Open the first of `ways` that exists; its verdict (accepted or refused) is final, so a
/// refused file is never replaced by another found at a later way.
fn first_that_opens(ways: &[(PathBuf, bool)], want: Option<Ident>, cap: u64) -> Result<TargetFile, Refused> {
    let mut last = None;
    for (p, magic) in ways {
        match open_verified(p, *magic, want, cap) {
            Err(e @ Refused::Open { .. }) => last = Some(e),
            r => return r,
        }
    }
    Err(last.unwrap_or(Refused::Open { path: String::new(), err: std::io::ErrorKind::NotFound.into() }))
}

/// The file a mapping of `pid` maps: map_files while the mapping exists, else the path below the
/// target's root, else (the process is gone) the plain path; always checked against the
/// mapping's device and inode.
pub fn open_mapping(pid: Option<u32>, m: &Mapping, cap: u64) -> Result<TargetFile, Refused> {
    let mut ways = Vec::new();
    if let Some(pid) = pid {
        ways.push((map_files_path(pid, m.start, m.end), true));
    }
    ways.extend(path_ways(pid, &m.path));
    first_that_opens(&ways, Some(Ident::of(m)), cap)
}

/// A file `pid` named by `path` (an open file's link, a module of a recording), checked against
/// `want` when known: below the target's root while it lives, else the plain path.
pub fn open_path(pid: Option<u32>, path: &str, want: Option<Ident>, cap: u64) -> Result<TargetFile, Refused> {
    first_that_opens(&path_ways(pid, path), want, cap)
}

fn path_ways(pid: Option<u32>, path: &str) -> Vec<(PathBuf, bool)> {
    let alive = pid.filter(|&p| Path::new(&format!("/proc/{p}/root")).exists());
    match alive {
        Some(p) => vec![(root_path(p, path), false)],
        None => vec![(PathBuf::from(path), false)],
    }
}

#[cfg(test)]
mod tests {
    use std::{ffi::CString, os::unix::ffi::OsStrExt as _, time::Duration};

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("probe-target-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mkfifo(p: &Path) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
    }

    /// `f` on another thread, which must answer within 2 s (a blocking open never would).
    fn within_2s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(2)).expect("blocked for 2 s")
    }

    fn ident(p: &Path) -> Ident {
        let m = std::fs::metadata(p).unwrap();
        Ident { major: libc::major(m.dev()), minor: libc::minor(m.dev()), inode: m.ino() }
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let d = scratch("fifo");
        let p = d.join("lib.so");
        mkfifo(&p);
        let r = within_2s(move || open_verified(&p, false, None, u64::MAX));
        assert!(matches!(r, Err(Refused::NotRegular { kind: "FIFO", .. })), "{r:?}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn dev_zero_is_refused() {
        let r = within_2s(|| open_verified(Path::new("/dev/zero"), false, None, u64::MAX));
        assert!(matches!(r, Err(Refused::NotRegular { kind: "character device", .. })), "{r:?}");
    }

    #[test]
    fn another_inode_is_refused() {
        let d = scratch("ino");
        let (a, b) = (d.join("a"), d.join("b"));
        std::fs::write(&a, b"mapped").unwrap();
        std::fs::write(&b, b"swapped in").unwrap();
        let r = open_verified(&b, false, Some(ident(&a)), u64::MAX);
        assert!(matches!(r, Err(Refused::Changed { .. })), "{r:?}");
        let mut other_dev = ident(&b);
        other_dev.major ^= 1;
        if dev_comparable(&File::open(&b).unwrap()) {
            let r = open_verified(&b, false, Some(other_dev), u64::MAX);
            assert!(matches!(r, Err(Refused::Changed { .. })), "{r:?}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_regular_file_is_accepted_and_capped() {
        let d = scratch("ok");
        let p = d.join("weights.bin");
        std::fs::write(&p, vec![7u8; 4096]).unwrap();
        let f = open_verified(&p, false, Some(ident(&p)), u64::MAX).unwrap();
        assert_eq!(f.size, 4096);
        let r = open_verified(&p, false, Some(ident(&p)), 4095);
        assert!(matches!(r, Err(Refused::TooBig { size: 4096, .. })), "{r:?}");
        let link = d.join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(matches!(open_verified(&link, false, None, u64::MAX), Err(Refused::Open { .. })), "a symlink was followed");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A mapping whose file was renamed away, with a FIFO at its old path: map_files still gives
    /// the mapped file (this needs root, as probe has).
    #[test]
    fn a_mapping_is_opened_through_map_files_after_a_swap() {
        use std::os::fd::AsRawFd as _;
        let d = scratch("map");
        let p = d.join("lib.so");
        std::fs::write(&p, vec![3u8; 8192]).unwrap();
        let f = File::open(&p).unwrap();
        // SAFETY: a fresh private read-only mapping of a file we own, unmapped below.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
        assert_ne!(addr, libc::MAP_FAILED);
        let maps = crate::os::procfs::read_maps(std::process::id()).unwrap();
        let m = maps.iter().find(|m| m.start == addr as u64).unwrap().clone();
        std::fs::rename(&p, d.join("moved")).unwrap();
        mkfifo(&p);
        let pid = std::process::id();
        let got = within_2s(move || open_mapping(Some(pid), &m, u64::MAX).map(|t| (t.size, t.opened)));
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(addr, 8192) };
        let (size, opened) = got.unwrap();
        assert_eq!(size, 8192);
        assert!(opened.starts_with(format!("/proc/{pid}/map_files/")), "{}", opened.display());
        let _ = std::fs::remove_dir_all(&d);
    }
}
