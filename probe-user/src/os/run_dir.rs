//! probe's own directory, `/run/probe` (a tmpfs: gone at the next boot), and its files: the
//! kernel caches (`kernel_cache`) and the lock files of the hand-off (`kernel::loaded`).
//!
//! Root-safe: the directory is made 0700 and must be a real directory owned by the effective user
//! with no group or other write; a file is opened with `O_NOFOLLOW` under that directory's
//! descriptor and used only when it is a regular file of ours that no one else can write.
use std::{
    ffi::{CStr, CString},
    fs::File,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::Path,
};

pub const DIR: &str = "/run/probe";

/// `dir`, opened without following a link, if it is a directory of the effective user's that no one
/// else can write; made (0700) when missing and `create`.
pub(crate) fn open_dir(dir: &Path, create: bool) -> Option<OwnedFd> {
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    if create {
        // SAFETY: NUL-terminated path. EEXIST is fine: what exists is checked below.
        unsafe { libc::mkdir(c.as_ptr(), 0o700) };
    }
    // SAFETY: NUL-terminated path; the fd is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let m = File::from(fd.try_clone().ok()?).metadata().ok()?;
    (m.is_dir() && ours(&m)).then_some(fd)
}

/// File `name` of the directory `d` ([`open_dir`]), opened with `flags` (`O_CREAT` makes it 0600)
/// never through a link, when it is a regular file of ours that no one else can write.
pub(crate) fn open_in(d: &OwnedFd, name: &CStr, flags: libc::c_int) -> Option<File> {
    // SAFETY: a valid directory fd and NUL-terminated name; O_NOFOLLOW: never through a link.
    let fd = unsafe { libc::openat(d.as_raw_fd(), name.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let m = f.metadata().ok()?;
    (m.is_file() && ours(&m)).then_some(f)
}

/// Lock file `name` of `dir` (both made if missing), opened read-write, when it passes
/// [`open_in`]'s checks. None: no locking (a directory that is not ours, a read-only /run).
pub fn lock_file(dir: &Path, name: &CStr) -> Option<File> {
    open_in(&open_dir(dir, true)?, name, libc::O_RDWR | libc::O_CREAT)
}

/// Owned by the effective user, with no group or other write.
fn ours(m: &std::fs::Metadata) -> bool {
    // SAFETY: geteuid cannot fail.
    m.uid() == unsafe { libc::geteuid() } && m.mode() & 0o022 == 0
}
