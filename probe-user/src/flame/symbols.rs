//! What frames are called: user frames (module + file offset) by their ELF symbols (blazesym,
//! demangled), kernel addresses by the names the recording carries (crate::ksyms). Resolved once
//! per recording, for the distinct frames only.
//!
//! A module is read only as the file the target mapped (crate::target_file): through
//! /proc/PID/map_files while the process lives, else by path with the device and inode the
//! recording's `maps` records saw. A file that changed since, or is not a regular file, is not
//! read: its frames keep `module+0xoffset` names.
use std::collections::{BTreeMap, HashMap};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Source},
};

use crate::{
    procfs::Mapping,
    recording::{Recording, StackRecord, records::UserRecord},
    target_file::{self, TargetFile},
};

/// Names for (module, file offset) and kernel addresses, resolved once per recording.
#[derive(Default)]
pub struct Symbols {
    user: HashMap<(i64, u64), String>,
    /// Module id → the path frames name.
    modules: HashMap<i64, String>,
    /// GNU build IDs (hex) of the modules that were read.
    build_ids: HashMap<i64, String>,
    /// Kernel names and wait classes come from the recording (see crate::ksyms).
    pub kernel: crate::ksyms::Names,
}

fn sym_name(s: &Symbolized<'_>) -> Option<String> {
    match s {
        Symbolized::Sym(sym) => Some(sym.name.to_string()),
        Symbolized::Unknown(_) => None,
    }
}

/// What symbolization needs from a recording: its module table, the user frames its stacks
/// use (each once) and its kernel names. Grows with distinct frames, not with samples.
#[derive(Default)]
pub(crate) struct Wanted {
    modules: HashMap<i64, String>,
    /// Every distinct mapping seen per path, with its pid, in recording order.
    mapped: HashMap<String, Vec<(u32, Mapping)>>,
    offsets: BTreeMap<i64, std::collections::BTreeSet<u64>>,
}

impl Wanted {
    pub(crate) fn record(&mut self, r: &UserRecord) {
        match r {
            UserRecord::Module(m) => {
                self.modules.insert(m.id, m.path.clone());
            }
            UserRecord::Maps(m) => {
                for map in &m.mappings {
                    let seen = self.mapped.entry(map.path.clone()).or_default();
                    if !seen.iter().any(|(p, s)| *p == m.pid && s.start == map.start && s.end == map.end && s.inode == map.inode) {
                        seen.push((m.pid, map.clone()));
                    }
                }
            }
            _ => {}
        }
    }

    pub(crate) fn stack(&mut self, s: &StackRecord) {
        for &(id, off) in &s.user {
            self.offsets.entry(id).or_default().insert(off);
        }
    }

    /// Just these frames of these modules (by path, each opened as the regular file there).
    pub(crate) fn frames(modules: HashMap<i64, String>, frames: impl IntoIterator<Item = (i64, u64)>) -> Wanted {
        let mut w = Wanted { modules, ..Default::default() };
        for (id, off) in frames {
            w.offsets.entry(id).or_default().insert(off);
        }
        w
    }
}

/// The file the target mapped at `path`: one of the mappings the recording saw there (latest
/// first), or, for a recording without them, the regular file at `path`.
fn open_module(path: &str, mapped: &[(u32, Mapping)]) -> Result<TargetFile, target_file::Refused> {
    if mapped.is_empty() {
        return target_file::open_path(None, path, None, target_file::MAX_ELF_BYTES);
    }
    let mut last = None;
    for (pid, m) in mapped.iter().rev() {
        match target_file::open_mapping(Some(*pid), m, target_file::MAX_ELF_BYTES) {
            Ok(f) => return Ok(f),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or(target_file::Refused::Open { path: path.to_string(), err: std::io::ErrorKind::NotFound.into() }))
}

/// Largest module copied into memory before symbolization; a larger one is read in place.
const COPY_CAP: u64 = 512 << 20;

/// A private, sealed copy of `file` (an anonymous memfd, at most [`COPY_CAP`] bytes) for
/// blazesym, which maps what it reads: the target owns the original and could truncate it while
/// it is mapped (a SIGBUS in probe, which is root). The copy is read with plain reads (a file cut
/// meanwhile only ends early), and nobody else can change it. None: read the original in place.
fn sealed_copy(file: &std::fs::File, size: u64) -> Option<std::fs::File> {
    use std::os::fd::FromRawFd as _;
    if size > COPY_CAP {
        return None;
    }
    // SAFETY: memfd_create with a static name; the descriptor is owned by the File made from it.
    let fd = unsafe { libc::memfd_create(c"probe-module".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let mut copy = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut src = file.try_clone().ok()?;
    std::io::Seek::seek(&mut src, std::io::SeekFrom::Start(0)).ok()?;
    std::io::copy(&mut std::io::Read::take(src, size), &mut copy).ok()?;
    // SAFETY: fcntl on our own descriptor.
    let sealed =
        unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL) };
    (sealed == 0).then_some(copy)
}

/// The GNU build ID note of an ELF file, read lazily (headers and the note only).
pub(crate) fn build_id(file: &std::fs::File) -> Option<String> {
    use object::Object as _;
    let cache = object::read::ReadCache::new(file.try_clone().ok()?);
    let elf = object::File::parse(&cache).ok()?;
    let id = elf.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

impl Symbols {
    /// The symbols of a recording in memory (tests, tools).
    pub fn resolve(rec: &Recording) -> Symbols {
        let mut w = Wanted::default();
        rec.records.iter().for_each(|r| w.record(r));
        rec.stacks.iter().for_each(|s| w.stack(s));
        Symbols::of(w, crate::ksyms::Names::of(rec))
    }

    /// Resolve what a recording's frames want; `kernel` is the recording's kernel names.
    pub(crate) fn of(w: Wanted, kernel: crate::ksyms::Names) -> Symbols {
        let (modules, wanted) = (w.modules, w.offsets);
        let symbolizer = Symbolizer::new();
        let mut user = HashMap::new();
        let mut build_ids = HashMap::new();
        // Kept open until symbolization ends, so no /proc/self/fd/N names two files.
        let mut opened: Vec<TargetFile> = Vec::new();
        let mut copies: Vec<std::fs::File> = Vec::new();
        for (id, offs) in wanted {
            let offs: Vec<u64> = offs.into_iter().collect();
            let Some(path) = modules.get(&id) else { continue };
            let base = path.rsplit('/').next().unwrap_or(path);
            let names = match open_module(path, w.mapped.get(path).map_or(&[][..], |v| v.as_slice())) {
                Ok(f) => {
                    use std::os::fd::AsRawFd as _;
                    // blazesym opens by path: this one reopens exactly the verified file. Names
                    // come from its own symbol tables (debug_syms off): a debug link would name
                    // another file, chosen by whoever wrote this one.
                    if let Some(b) = build_id(&f.file) {
                        build_ids.insert(id, b);
                    }
                    let copy = sealed_copy(&f.file, f.size);
                    let fd = copy.as_ref().unwrap_or(&f.file).as_raw_fd();
                    let mut elf = Elf::new(format!("/proc/self/fd/{fd}"));
                    elf.debug_syms = false;
                    opened.push(f);
                    copies.extend(copy);
                    symbolizer.symbolize(&Source::Elf(elf), Input::FileOffset(&offs)).unwrap_or_default()
                }
                Err(e) => {
                    log::info!("{path} left unsymbolized: {e}");
                    Vec::new()
                }
            };
            for (i, off) in offs.iter().enumerate() {
                let name = names.get(i).and_then(sym_name).unwrap_or_else(|| format!("{base}+{off:#x}"));
                user.insert((id, *off), name);
            }
        }
        Symbols { user, modules, build_ids, kernel }
    }

    /// The path of module `id`.
    pub fn module(&self, id: i64) -> Option<&str> {
        self.modules.get(&id).map(String::as_str)
    }

    /// The GNU build ID of module `id`, in hex, when its file was read and has one.
    pub fn build_id(&self, id: i64) -> Option<String> {
        self.build_ids.get(&id).cloned()
    }

    pub fn user(&self, id: i64, off: u64) -> String {
        self.user
            .get(&(id, off))
            .cloned()
            .unwrap_or_else(|| if id < 0 { format!("[unknown] {off:#x}") } else { format!("[module {id}]+{off:#x}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy symbolization reads is the module as it was opened: the target truncating its
    /// file afterwards changes nothing in it, and nobody can change the copy itself.
    #[test]
    fn a_module_truncated_after_opening_is_read_from_its_sealed_copy() {
        let dir = std::env::temp_dir().join(format!("probe-symcopy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("libtarget.so");
        std::fs::copy("/bin/sh", &path).unwrap();
        let f = open_module(path.to_str().unwrap(), &[]).unwrap();
        let id = build_id(&f.file);
        assert!(id.is_some(), "/bin/sh has no build id: pick another ELF");
        let copy = sealed_copy(&f.file, f.size).expect("a sealed copy");
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
        assert_eq!(build_id(&f.file), None, "the original is cut");
        assert_eq!(build_id(&copy), id, "the copy kept the module");
        assert_eq!(copy.metadata().unwrap().len(), f.size);
        assert!(copy.set_len(0).is_err(), "the copy can be truncated");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
