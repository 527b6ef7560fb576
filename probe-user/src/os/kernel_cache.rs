//! What probe keeps about the running kernel from one trace to the next, in `/run/probe` (a
//! tmpfs: gone at the next boot, as the kernel it describes may be):
//! - the kernel struct offsets probe's programs need (read from the kernel's BTF, 5–6 MB: 10–20 ms
//!   on the critical path of arming), keyed by the kernel's build id, the BTF file's size and
//!   probe's own executable (another build of probe may want other fields);
//! - the kernel's text symbols (`ksyms`), keyed by the boot, the kernel and its modules.
//!
//! A stale entry is never used: it is replaced.
//!
//! Root-safe: the directory and the files pass [`run_dir`]'s checks; a file is replaced by rename,
//! never written in place.
use std::{
    ffi::CString,
    fs::File,
    io::{Read as _, Write as _},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::Path,
};

use probe_common::kernel::KernelOffsets;

use super::run_dir;

const NAME: &str = "kernel-offsets";
const MAGIC: &str = "probe kernel offsets 1";
const WORDS: usize = std::mem::size_of::<KernelOffsets>() / 4;
const _: () = assert!(std::mem::size_of::<KernelOffsets>().is_multiple_of(4));

/// What identifies the offsets: the running kernel (its GNU build id, else its version string),
/// its BTF's size, and this executable (device, inode, size, mtime).
pub fn key() -> String {
    let kernel = kernel_id();
    let btf = std::fs::metadata("/sys/kernel/btf/vmlinux").map(|m| m.len()).unwrap_or(0);
    format!("kernel {kernel} btf {btf} exe {}", exe_id())
}

/// `base` for this executable: `base-HASH` of [`exe_id`]. What another build of probe keeps goes
/// in a file of its own, so that two builds run by turns (a bench beside the last release) do
/// not replace each other's.
pub fn per_exe(base: &str) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    exe_id().hash(&mut h);
    format!("{base}-{:016x}", h.finish())
}

/// This executable: device, inode, size, mtime (another build of probe may keep other things).
pub fn exe_id() -> String {
    std::fs::metadata("/proc/self/exe")
        .map(|m| format!("{}:{}:{}:{}.{}", m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
        .unwrap_or_default()
}

/// The running kernel: its GNU build id, else its version string.
pub fn kernel_id() -> String {
    std::fs::read("/sys/kernel/notes")
        .ok()
        .and_then(|n| build_id(&n))
        .unwrap_or_else(|| std::fs::read_to_string("/proc/version").unwrap_or_default().trim().to_string())
}

/// The GNU build id in an ELF note section (`/sys/kernel/notes`), as hex.
fn build_id(notes: &[u8]) -> Option<String> {
    let mut pos = 0usize;
    let u32_at = |o: usize| notes.get(o..o + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize);
    while pos + 12 <= notes.len() {
        let (namesz, descsz, kind) = (u32_at(pos)?, u32_at(pos + 4)?, u32_at(pos + 8)?);
        let name_at = pos + 12;
        let desc_at = name_at + namesz.div_ceil(4) * 4;
        let end = desc_at.checked_add(descsz.div_ceil(4) * 4)?;
        if end > notes.len() {
            return None;
        }
        if kind == 3 && notes.get(name_at..name_at + namesz)? == b"GNU\0" {
            return Some(notes[desc_at..desc_at + descsz].iter().map(|b| format!("{b:02x}")).collect());
        }
        pos = end;
    }
    None
}

/// The cached offsets for `key` in `dir`, if there are any and they are ours.
pub fn load(dir: &Path, key: &str) -> Option<KernelOffsets> {
    parse(&String::from_utf8(read(dir, &per_exe(NAME), 16 << 10)?).ok()?, key)
}

/// The bytes kept as `name` in `dir` for `key`, mapped rather than read: nothing is copied and
/// only the pages a reader touches are faulted in (the kernel's symbol table is 3–4 MB, a few
/// pages of which name the frames of a trace). Safe to keep: a kept file is replaced by rename,
/// never written in place, so the mapped file does not change under the reader.
pub fn map_bytes(dir: &Path, name: &str, key: &str, max: u64) -> Option<Mapped> {
    let f = open_kept(dir, name, max)?;
    // SAFETY: a read-only mapping of a regular file of ours that is only ever replaced by rename,
    // never truncated or written in place while mapped.
    let map = unsafe { memmap2::Mmap::map(&f) }.ok()?;
    let head = format!("{MAGIC}\n{key}\n");
    map.starts_with(head.as_bytes()).then(|| Mapped { map, body: head.len() })
}

/// A kept file mapped read-only ([`map_bytes`]): its body, after the magic line and the key.
pub struct Mapped {
    map: memmap2::Mmap,
    body: usize,
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.body..]
    }
}

/// Keep `body` as `name` in `dir` for `key` (best effort, as [`store`]).
pub fn store_bytes(dir: &Path, name: &str, key: &str, body: &[u8]) {
    let mut all = format!("{MAGIC}\n{key}\n").into_bytes();
    all.extend_from_slice(body);
    write(dir, name, &all);
}

/// The body kept as `name` in `dir` for `key` (what [`store_bytes`] wrote), read whole: at most
/// `max` bytes, when it passes [`open_kept`]'s checks.
pub fn load_bytes(dir: &Path, name: &str, key: &str, max: u64) -> Option<Vec<u8>> {
    let all = read(dir, name, max)?;
    all.strip_prefix(format!("{MAGIC}\n{key}\n").as_bytes()).map(<[u8]>::to_vec)
}

/// File `name` of `dir`, at most `max` bytes, read whole when it passes [`open_kept`]'s checks.
fn read(dir: &Path, name: &str, max: u64) -> Option<Vec<u8>> {
    let mut f = open_kept(dir, name, max)?;
    let mut bytes = Vec::with_capacity(f.metadata().ok()?.len() as usize);
    f.read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// File `name` of `dir`, opened read-only, when it is at most `max` bytes and passes
/// [`run_dir::open_in`]'s checks, in a directory that passes [`run_dir::open_dir`].
fn open_kept(dir: &Path, name: &str, max: u64) -> Option<File> {
    let f = run_dir::open_in(&run_dir::open_dir(dir, false)?, &CString::new(name).ok()?, libc::O_RDONLY)?;
    (f.metadata().ok()?.len() <= max).then_some(f)
}

fn parse(text: &str, key: &str) -> Option<KernelOffsets> {
    let mut lines = text.lines();
    if lines.next()? != MAGIC || lines.next()? != key {
        return None;
    }
    let words: Vec<u32> = lines.next()?.split(' ').map(str::parse).collect::<Result<_, _>>().ok()?;
    if words.len() != WORDS {
        return None;
    }
    let mut k = KernelOffsets::default();
    // SAFETY: KernelOffsets is #[repr(C)] and made of u32 fields only (size checked above, at
    // compile time a multiple of 4): any WORDS u32 values are a valid KernelOffsets.
    unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), (&raw mut k).cast::<u32>(), WORDS) };
    Some(k)
}

/// The offsets as the u32 words they are.
pub fn words(k: &KernelOffsets) -> &[u32] {
    // SAFETY: as in `parse`: WORDS u32 fields, read as such.
    unsafe { std::slice::from_raw_parts((k as *const KernelOffsets).cast::<u32>(), WORDS) }
}

fn render(k: &KernelOffsets, key: &str) -> String {
    let words: Vec<String> = words(k).iter().map(u32::to_string).collect();
    format!("{MAGIC}\n{key}\n{}\n", words.join(" "))
}

/// Keep `k` for `key` in `dir` (made 0700 if missing). Best effort: a directory that is not ours,
/// a read-only /run, any error: nothing is kept, the next trace reads BTF again.
pub fn store(dir: &Path, key: &str, k: &KernelOffsets) {
    write(dir, &per_exe(NAME), render(k, key).as_bytes());
}

/// Replace file `name` of `dir` (made 0700 if missing) with `text`: written to a new file
/// (`O_EXCL`, never following a link), then renamed over. Best effort.
fn write(dir: &Path, name: &str, text: &[u8]) {
    let Some(d) = run_dir::open_dir(dir, true) else { return };
    let tmp = format!(".{name}.{}", std::process::id());
    let (Ok(tmp_c), Ok(name_c)) = (CString::new(tmp.as_str()), CString::new(name)) else { return };
    // SAFETY: valid directory fd and NUL-terminated name; O_EXCL|O_NOFOLLOW: never an existing file or link.
    let fd = unsafe {
        libc::openat(
            d.as_raw_fd(),
            tmp_c.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return;
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let ok = f.write_all(text).is_ok();
    drop(f);
    // SAFETY: both names are under the same directory fd, NUL-terminated.
    let moved = ok && unsafe { libc::renameat(d.as_raw_fd(), tmp_c.as_ptr(), d.as_raw_fd(), name_c.as_ptr()) } == 0;
    if !moved {
        // SAFETY: as above.
        unsafe { libc::unlinkat(d.as_raw_fd(), tmp_c.as_ptr(), 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_offsets_come_back_only_for_their_key() {
        let dir = std::env::temp_dir().join(format!("probe-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let k = KernelOffsets { valid: 1, task_files: 3104, files_fdt: 32, ..Default::default() };
        assert_eq!(load(&dir, "a"), None);
        store(&dir, "a", &k);
        assert_eq!(load(&dir, "a"), Some(k));
        assert_eq!(load(&dir, "b"), None, "another kernel or build of probe");
        // A group-writable directory is not trusted.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o770)).unwrap();
        assert_eq!(load(&dir, "a"), None);
        let _ = std::fs::remove_dir_all(&dir);
        // A link in its place is not followed.
        let target = std::env::temp_dir().join(format!("probe-kcache-t-{}", std::process::id()));
        std::fs::create_dir_all(&target).unwrap();
        std::os::unix::fs::symlink(&target, &dir).unwrap();
        store(&dir, "a", &k);
        assert!(std::fs::read_dir(&target).unwrap().next().is_none());
        let _ = std::fs::remove_file(&dir);
        let _ = std::fs::remove_dir_all(&target);
    }

    #[test]
    fn kept_bytes_come_back_only_for_their_key() {
        let dir = std::env::temp_dir().join(format!("probe-kcache-bytes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        store_bytes(&dir, "t", "boot 1", &[0, 1, 2, 255]);
        assert_eq!(map_bytes(&dir, "t", "boot 1", 1 << 20).as_deref(), Some(&[0u8, 1, 2, 255][..]));
        assert!(map_bytes(&dir, "t", "boot 2", 1 << 20).is_none(), "another boot");
        assert!(map_bytes(&dir, "t", "boot 1", 8).is_none(), "over its bound");
        // Replaced while mapped (by rename, as every store): the mapping keeps what it mapped.
        let kept = map_bytes(&dir, "t", "boot 1", 1 << 20).unwrap();
        store_bytes(&dir, "t", "boot 1", &[7; 4096]);
        assert_eq!(&kept[..], &[0u8, 1, 2, 255][..]);
        assert_eq!(map_bytes(&dir, "t", "boot 1", 1 << 20).map(|m| m.len()), Some(4096));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_build_id_note_is_read() {
        let mut n = Vec::new();
        for (name, kind, desc) in [(&b"Xen\0"[..], 1u32, &[9u8, 9, 9][..]), (b"GNU\0", 3, &[0xde, 0xad, 0xbe, 0xef, 1])] {
            n.extend((name.len() as u32).to_ne_bytes());
            n.extend((desc.len() as u32).to_ne_bytes());
            n.extend(kind.to_ne_bytes());
            n.extend(name);
            n.extend(desc);
            n.resize(n.len().div_ceil(4) * 4, 0);
        }
        assert_eq!(build_id(&n).as_deref(), Some("deadbeef01"));
        assert_eq!(build_id(&n[..20]), None);
    }
}
