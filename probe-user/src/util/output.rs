//! Files probe writes for the person who ran it, made safely as root (below the renderers: html
//! and bundle both use it).
//!
//! probe runs under sudo, often in a directory other users can write to. So no output is made by
//! path: a recording directory is created new (0700) or checked to be the caller's own, held
//! open, and every file in it is made with `openat(O_CREAT|O_EXCL|O_NOFOLLOW)`, mode 0600, and
//! handed to the sudo caller with `fchown` on the open descriptor. A planted link is never
//! followed and a file that exists is replaced only by unlinking the name first, inside a
//! directory nobody else can write. A single output named by the user (`bundle -o`) is never
//! written through a link and never overwritten without `--force`.
use std::{
    ffi::CString,
    fs::File,
    io::{self, Write as _},
    os::{
        fd::{AsFd, AsRawFd as _, FromRawFd as _},
        unix::{ffi::OsStrExt as _, fs::MetadataExt as _},
    },
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};

/// The event log of a recording (`record::FILE_NAME`): what makes a directory a recording.
pub const RECORDING_FILE: &str = "events.bin";

/// Space a trace keeps free on the recording's disk while it runs (see [`OutDir::reserve`]).
pub const RESERVE_FILE: &str = ".reserve";

/// Names probe writes into a recording directory: what `--force` may replace, and nothing else.
pub fn is_probe_output(name: &str) -> bool {
    matches!(name, RECORDING_FILE | RESERVE_FILE | "report.json" | "report.html" | "timeline.json")
        || (name.starts_with("flame-") && (name.ends_with(".svg") || name.ends_with(".folded")))
        || (name.starts_with("pprof-") && name.ends_with(".pb.gz"))
        || name == "otlp.json"
}

/// (uid, gid) of the user who ran sudo, if probe runs under sudo.
/// Honoured only when probe runs as root (real uid 0): anyone else can set SUDO_UID.
pub fn sudo_caller() -> Option<(u32, u32)> {
    // SAFETY: getuid has no failure mode and touches no memory.
    if unsafe { libc::getuid() } != 0 {
        return None;
    }
    let id = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    Some((id("SUDO_UID")?, id("SUDO_GID")?))
}

/// The uid whose files probe may touch: the sudo caller, else whoever runs probe.
fn caller_uid() -> u32 {
    // SAFETY: geteuid has no failure mode and touches no memory.
    sudo_caller().map_or_else(|| unsafe { libc::geteuid() }, |(u, _)| u)
}

/// Files made under sudo belong to the user who ran sudo, not root: change the owner of the
/// open file (never by path, which a link could redirect).
pub fn give_to_caller(f: &impl AsFd) {
    if let Some((uid, gid)) = sudo_caller() {
        let _ = std::os::unix::fs::fchown(f, Some(uid), Some(gid));
    }
}

fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a file name"))
}

/// A directory probe writes into, held open: files are made inside it relative to its descriptor.
#[derive(Debug)]
pub struct OutDir {
    dir: File,
    path: PathBuf,
}

impl OutDir {
    /// A directory for a new recording: created with mode 0700. An existing directory is used
    /// only if it is the caller's own and empty, or, with `force`, holds a probe recording
    /// (its earlier outputs are removed; nothing else is).
    pub fn create_recording(path: &Path, force: bool) -> anyhow::Result<OutDir> {
        let shown = path.display();
        match Self::make(path) {
            Ok(d) => {
                d.seal()?;
                Ok(d)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let st = std::fs::symlink_metadata(path).with_context(|| format!("cannot inspect {shown}"))?;
                if st.file_type().is_symlink() {
                    bail!("{shown} is a symbolic link; probe does not write through links: give a new directory to --out");
                }
                if !st.is_dir() {
                    bail!("{shown} exists and is not a directory; give a new directory to --out");
                }
                let d = Self::open_dir(path)?;
                let st = d.dir.metadata()?;
                if st.uid() != caller_uid() {
                    bail!(
                        "{shown} belongs to uid {}, not to you: probe does not write into another user's directory; choose a new --out",
                        st.uid()
                    );
                }
                let names = d.names()?;
                if !names.is_empty() {
                    if !names.iter().any(|n| n == RECORDING_FILE) {
                        bail!("{shown} exists and is not empty (and is not a probe recording); choose a new --out");
                    }
                    if !force {
                        bail!("{shown} already holds a recording; choose a new --out, or add --force to replace it");
                    }
                    for n in names.iter().filter(|n| is_probe_output(n)) {
                        d.unlink(n)?;
                    }
                }
                d.seal()?;
                Ok(d)
            }
            Err(e) => Err(e).with_context(|| format!("cannot create the recording directory {shown}")),
        }
    }

    /// A directory of results (`probe bench --out`): created with mode 0700, or an existing one
    /// of the caller's that others cannot write to ([`OutDir::open`]).
    pub fn create_or_open(path: &Path) -> anyhow::Result<OutDir> {
        match Self::make(path) {
            Ok(d) => {
                d.seal()?;
                Ok(d)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Self::open(path),
            Err(e) => Err(e).with_context(|| format!("cannot create {}", path.display())),
        }
    }

    /// An existing recording directory, to write derived files (report, flamegraphs, timeline)
    /// beside the recording. Refused when it belongs to someone else or others can write to it.
    pub fn open(path: &Path) -> anyhow::Result<OutDir> {
        let d = Self::open_dir(path)?;
        let st = d.dir.metadata()?;
        // SAFETY: geteuid has no failure mode and touches no memory.
        let me = unsafe { libc::geteuid() };
        if st.uid() != caller_uid() && st.uid() != me {
            bail!(
                "{} belongs to uid {}: probe does not write into another user's directory; copy the recording to a directory of yours",
                path.display(),
                st.uid()
            );
        }
        if st.mode() & 0o022 != 0 {
            bail!(
                "{} can be written by other users (mode {:o}); `chmod go-w` it or copy the recording elsewhere",
                path.display(),
                st.mode() & 0o7777
            );
        }
        Ok(d)
    }

    fn open_dir(path: &Path) -> anyhow::Result<OutDir> {
        let (parent, name) = Self::parent(path).with_context(|| format!("cannot open the directory {}", path.display()))?;
        Self::open_at(&parent, &name, path).with_context(|| format!("cannot open the directory {}", path.display()))
    }

    /// The parent directory of `path`, held open, and the last component's name.
    fn parent(path: &Path) -> io::Result<(File, std::ffi::CString)> {
        let name = path.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no directory"))?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let c = cstr(parent.as_os_str().as_bytes())?;
        // SAFETY: `c` is a NUL-terminated path that lives for the call; the result is checked.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok((unsafe { File::from_raw_fd(fd) }, cstr(name.as_bytes())?))
    }

    /// `name` in the open `parent`, never through a link (O_NOFOLLOW): a link swapped in for
    /// the directory is refused, not followed.
    fn open_at(parent: &File, name: &std::ffi::CStr, path: &Path) -> io::Result<OutDir> {
        // SAFETY: openat relative to a descriptor we own; `name` lives for the call.
        let fd = unsafe {
            libc::openat(parent.as_raw_fd(), name.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(OutDir { dir: unsafe { File::from_raw_fd(fd) }, path: path.to_path_buf() })
    }

    /// A new directory, made (0700) and opened from its parent's descriptor. What was opened
    /// must be what was made: ours, closed to others (0700 less the umask) and empty. Another directory swapped in between
    /// (even root's) is refused; `AlreadyExists` is returned as it is.
    fn make(path: &Path) -> io::Result<OutDir> {
        let (parent, name) = Self::parent(path)?;
        // SAFETY: mkdirat relative to a descriptor we own; `name` lives for the call.
        if unsafe { libc::mkdirat(parent.as_raw_fd(), name.as_ptr(), 0o700) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let d = Self::open_at(&parent, &name, path)?;
        let st = d.dir.metadata()?;
        // SAFETY: geteuid has no failure mode and touches no memory.
        let me = unsafe { libc::geteuid() };
        if st.uid() != me || st.mode() & 0o077 != 0 || !d.names()?.is_empty() {
            return Err(io::Error::other(format!(
                "{} was replaced by another directory (uid {}, mode {:o}) while probe created it; choose another",
                path.display(),
                st.uid(),
                st.mode() & 0o7777
            )));
        }
        Ok(d)
    }

    /// Mode 0700 and the caller as owner, set on the open directory.
    fn seal(&self) -> io::Result<()> {
        // SAFETY: fchmod on a descriptor this value owns.
        if unsafe { libc::fchmod(self.dir.as_raw_fd(), 0o700) } != 0 {
            return Err(io::Error::last_os_error());
        }
        give_to_caller(&self.dir);
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Entry names in the directory (not "." or "..").
    pub(crate) fn names(&self) -> io::Result<Vec<String>> {
        // Through /proc/self/fd: the directory this value holds, whatever its path is now.
        let listed = std::fs::read_dir(format!("/proc/self/fd/{}", self.dir.as_raw_fd()))?;
        Ok(listed.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
    }

    fn unlink(&self, name: &str) -> io::Result<()> {
        let c = cstr(name.as_bytes())?;
        // SAFETY: unlinkat relative to a directory descriptor this value owns; `c` lives for the call.
        let rc = unsafe { libc::unlinkat(self.dir.as_raw_fd(), c.as_ptr(), 0) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::NotFound {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Make file `name` (a plain name, no '/') in the directory, new: an earlier file of that name
    /// is unlinked first (a link is removed, never followed). Mode 0600, owned by the caller.
    pub fn create(&self, name: &str) -> io::Result<File> {
        if name.contains('/') || name.is_empty() || name == "." || name == ".." {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a plain file name")));
        }
        self.unlink(name)?;
        let f = create_at(self.dir.as_raw_fd(), name)?;
        give_to_caller(&f);
        Ok(f)
    }

    /// Hold `bytes` of the disk in [`RESERVE_FILE`] (allocated, not sparse; 0600, the caller's):
    /// given back with [`OutDir::release_reserve`] when the disk fills, so the end of the
    /// recording and its report still fit.
    pub fn reserve(&self, bytes: u64) -> io::Result<()> {
        let f = self.create(RESERVE_FILE)?;
        // SAFETY: fallocate on a descriptor owned by `f`, which lives for the call.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            drop(f);
            self.release_reserve();
            return Err(e);
        }
        // A filesystem without fallocate: write the zeros.
        let r = (&f).write_all(&vec![0u8; bytes as usize]).and_then(|()| f.sync_all());
        if r.is_err() {
            self.release_reserve();
        }
        r
    }

    /// Give the reserved space back (nothing happens when there is none).
    pub fn release_reserve(&self) {
        let _ = self.unlink(RESERVE_FILE);
    }

    /// [`OutDir::create`] and write `bytes`; returns the file's path.
    pub fn write(&self, name: &str, bytes: &[u8]) -> anyhow::Result<PathBuf> {
        let path = self.path.join(name);
        let mut f = self.create(name).with_context(|| format!("cannot create {}", path.display()))?;
        f.write_all(bytes).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(path)
    }
}

/// openat(dir, name, O_CREAT|O_EXCL|O_NOFOLLOW|O_WRONLY, 0600).
fn create_at(dir: i32, name: &str) -> io::Result<File> {
    let c = cstr(name.as_bytes())?;
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `c` is NUL-terminated and lives for the call; the result is checked.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// A single output file the user named (`-o`): created new, mode 0600, owned by the caller. An
/// existing file is an error unless `force`; a link there is refused even with `force`.
pub fn create_file(path: &Path, force: bool) -> anyhow::Result<File> {
    let shown = path.display();
    let name = path.file_name().and_then(|n| n.to_str()).with_context(|| format!("{shown} does not name a file"))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let c = cstr(parent.as_os_str().as_bytes())?;
    // SAFETY: `c` is NUL-terminated and lives for the call; the result is checked.
    let dirfd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if dirfd < 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("cannot open the directory of {shown}"));
    }
    // SAFETY: `dirfd` was just opened and is owned by nothing else.
    let dir = unsafe { File::from_raw_fd(dirfd) };
    match create_at(dir.as_raw_fd(), name) {
        Ok(f) => {
            give_to_caller(&f);
            Ok(f)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let st = std::fs::symlink_metadata(path).with_context(|| format!("cannot inspect {shown}"))?;
            if st.file_type().is_symlink() {
                bail!("{shown} is a symbolic link; probe does not write through links: remove it or choose another name");
            }
            if !force {
                bail!("{shown} exists; choose another name or add --force to replace it");
            }
            if !st.is_file() {
                bail!("{shown} exists and is not a regular file; probe replaces only files");
            }
            let cn = cstr(name.as_bytes())?;
            // SAFETY: unlinkat relative to the directory held above; `cn` lives for the call.
            if unsafe { libc::unlinkat(dir.as_raw_fd(), cn.as_ptr(), 0) } != 0 {
                return Err(io::Error::last_os_error()).with_context(|| format!("cannot replace {shown}"));
            }
            let f = create_at(dir.as_raw_fd(), name).with_context(|| format!("cannot create {shown}"))?;
            give_to_caller(&f);
            Ok(f)
        }
        Err(e) => Err(e).with_context(|| format!("cannot create {shown}")),
    }
}

/// [`create_file`] and write `bytes`.
pub fn write_file(path: &Path, bytes: &[u8], force: bool) -> anyhow::Result<()> {
    let mut f = create_file(path, force)?;
    f.write_all(bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Open a file of a recording for reading: never through a link, never blocking (a FIFO planted
/// in its place), and only a regular file.
pub fn open_recording_file(path: &Path) -> io::Result<File> {
    let c = cstr(path.as_os_str().as_bytes())?;
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
    // SAFETY: `c` is NUL-terminated and lives for the call; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), flags) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ELOOP) {
            io::Error::new(io::ErrorKind::InvalidInput, "a symbolic link: probe reads recordings only from regular files")
        } else {
            e
        });
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let f = unsafe { File::from_raw_fd(fd) };
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
    }
    Ok(f)
}

/// The text of a file of a recording ([`open_recording_file`]), at most `cap` bytes.
pub fn read_recording_text(path: &Path, cap: u64) -> io::Result<String> {
    use std::io::Read as _;
    let mut s = String::new();
    open_recording_file(path)?.take(cap).read_to_string(&mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("probe-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_link_in_the_way_is_refused_and_its_target_untouched() {
        let d = scratch("link");
        let victim = d.join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let out = d.join("out.tar.gz");
        std::os::unix::fs::symlink(&victim, &out).unwrap();
        for force in [false, true] {
            let e = create_file(&out, force).unwrap_err();
            assert!(format!("{e:#}").contains("symbolic link"), "{e:#}");
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        // A recording directory that is a link is refused too.
        std::os::unix::fs::symlink(&d, d.join("rec")).unwrap();
        assert!(format!("{:#}", OutDir::create_recording(&d.join("rec"), true).unwrap_err()).contains("symbolic link"));
        // And a planted link is not read as a recording file.
        std::os::unix::fs::symlink(&victim, d.join("events.bin")).unwrap();
        assert!(open_recording_file(&d.join("events.bin")).is_err());
    }

    #[test]
    fn outputs_are_new_private_files_and_replace_only_with_force() {
        use std::os::unix::fs::PermissionsExt as _;
        let d = scratch("files");
        let out = d.join("b.tar.gz");
        write_file(&out, b"one", false).unwrap();
        assert_eq!(std::fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(format!("{:#}", write_file(&out, b"two", false).unwrap_err()).contains("--force"));
        write_file(&out, b"two", true).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"two");

        let rec = d.join("rec");
        let od = OutDir::create_recording(&rec, false).unwrap();
        assert_eq!(std::fs::metadata(&rec).unwrap().permissions().mode() & 0o777, 0o700);
        od.write(RECORDING_FILE, b"x").unwrap();
        // A link planted inside is replaced, not followed.
        std::os::unix::fs::symlink(d.join("victim2"), rec.join("report.json")).unwrap();
        od.write("report.json", b"{}").unwrap();
        assert!(!d.join("victim2").exists());
        assert!(OutDir::create_recording(&rec, false).is_err(), "an existing recording needs --force");
        std::fs::write(rec.join("notes.txt"), b"mine").unwrap();
        OutDir::create_recording(&rec, true).unwrap();
        assert!(!rec.join("report.json").exists() && rec.join("notes.txt").exists(), "only probe's own files are removed");
        // Not a recording: refused even with --force.
        let other = d.join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("a"), b"").unwrap();
        assert!(OutDir::create_recording(&other, true).is_err());
        assert!(open_recording_file(&d.join("missing")).is_err());
    }
}
