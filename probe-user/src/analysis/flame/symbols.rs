//! What frames are called: user frames (module + file offset) by their ELF symbols (blazesym,
//! demangled), kernel addresses by the names the recording carries (crate::analysis::ksyms). Resolved once
//! per recording, for the distinct frames only.
//!
//! A module is read only as the file the target mapped (crate::os::target_file): through
//! /proc/PID/map_files while the process lives, else by path with the device and inode the
//! recording's `maps` records saw. A file that changed since, or is not a regular file, is not
//! read: its frames keep `module+0xoffset` names.
use std::collections::{BTreeMap, HashMap};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Source},
};

use crate::{
    os::procfs::Mapping,
    os::target_file::{self, TargetFile},
    record::records::PY_MODULE,
    record::{Recording, StackRecord, records::UserRecord},
};

/// Names for (module, file offset) and kernel addresses, resolved once per recording.
#[derive(Default)]
pub struct Symbols {
    user: HashMap<(i64, u64), String>,
    /// Module id → the path frames name.
    modules: HashMap<i64, String>,
    /// GNU build IDs (hex) of the modules that were read.
    build_ids: HashMap<i64, String>,
    /// Kernel names and wait classes come from the recording (see crate::analysis::ksyms).
    pub kernel: crate::analysis::ksyms::Names,
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
    /// Python frames by id (`pyframes` records).
    python: HashMap<u64, String>,
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
            UserRecord::PyFrames(p) => {
                for (id, name) in &p.frames {
                    self.python.insert(*id, name.clone());
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

/// Largest module copied into memory for blazesym (one at a time, dropped once read); a larger
/// one is read by [`own_symbols`], with plain bounded reads: no module is ever mapped in place.
const COPY_CAP: u64 = 512 << 20;
/// The most bytes of symbol and string tables [`own_symbols`] reads from one module.
const TABLES_CAP: u64 = 256 << 20;

/// A private, sealed copy of `file` (an anonymous memfd, at most [`COPY_CAP`] bytes) for
/// blazesym, which maps what it reads: the target owns the original and could truncate it while
/// it is mapped (a SIGBUS in probe, which is root). The copy is read with plain reads (a file cut
/// meanwhile only ends early), and nobody else can change it. None: no copy could be made.
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

/// Names for file offsets of a module too large to copy, from its own symbol tables (`.symtab`,
/// else `.dynsym`) read through `object`'s ReadCache: plain reads of the headers and the tables
/// only (at most [`TABLES_CAP`] bytes), so a file the target truncates meanwhile ends a read
/// early instead of killing probe. Demangled as blazesym does (Rust, then C++). None: the tables
/// could not be read or are over the cap.
fn own_symbols(file: &std::fs::File, offs: &[u64]) -> Option<Vec<Option<String>>> {
    use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};
    let cache = object::read::ReadCache::new(file.try_clone().ok()?);
    let elf = object::File::parse(&cache).ok()?;
    let tables: u64 = [".symtab", ".strtab", ".dynsym", ".dynstr"].iter().filter_map(|n| elf.section_by_name(n)).map(|s| s.size()).sum();
    if tables > TABLES_CAP {
        return None;
    }
    let mut syms: Vec<(u64, u64, String)> = elf
        .symbols()
        .chain(elf.dynamic_symbols())
        .filter(|s| s.kind() == object::SymbolKind::Text && s.address() != 0)
        .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
        .collect();
    syms.sort();
    syms.dedup_by_key(|s| s.0);
    let segments: Vec<(u64, u64, u64)> = elf.segments().map(|s| (s.address(), s.file_range().0, s.file_range().1)).collect();
    Some(
        offs.iter()
            .map(|&off| {
                let &(vaddr, start, _) = segments.iter().find(|(_, start, size)| *start <= off && off < start + size)?;
                let addr = vaddr + (off - start);
                let i = syms.partition_point(|s| s.0 <= addr).checked_sub(1)?;
                let (at, size, name) = &syms[i];
                (*size == 0 || addr < at + size).then(|| demangle(name))
            })
            .collect(),
    )
}

/// A symbol's name demangled (Rust's legacy and v0 schemes, then Itanium C++), else as it is.
fn demangle(name: &str) -> String {
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}");
    }
    cpp_demangle::Symbol::new(name).ok().and_then(|s| s.demangle().ok()).unwrap_or_else(|| name.to_string())
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
        Symbols::of(w, crate::analysis::ksyms::Names::of(rec))
    }

    /// Resolve what a recording's frames want; `kernel` is the recording's kernel names.
    pub(crate) fn of(w: Wanted, kernel: crate::analysis::ksyms::Names) -> Symbols {
        let (modules, mut wanted) = (w.modules, w.offsets);
        let mut user = HashMap::new();
        // Python frames were named while tracing.
        for off in wanted.remove(&PY_MODULE).unwrap_or_default() {
            let name = w.python.get(&off).cloned().unwrap_or_else(|| format!("[python frame {off}]"));
            user.insert((PY_MODULE, off), name);
        }
        let symbolizer = Symbolizer::new();
        let mut build_ids = HashMap::new();
        // Kept open until symbolization ends, so no /proc/self/fd/N names two files. A copy is
        // dropped as soon as it was read: at most one module's copy is held at a time.
        let mut opened: Vec<TargetFile> = Vec::new();
        for (id, offs) in wanted {
            let offs: Vec<u64> = offs.into_iter().collect();
            let Some(path) = modules.get(&id) else { continue };
            let base = path.rsplit('/').next().unwrap_or(path);
            let names: Vec<Option<String>> = match open_module(path, w.mapped.get(path).map_or(&[][..], |v| v.as_slice())) {
                Ok(f) => {
                    use std::os::fd::AsRawFd as _;
                    if let Some(b) = build_id(&f.file) {
                        build_ids.insert(id, b);
                    }
                    let names = match sealed_copy(&f.file, f.size) {
                        // blazesym opens by path: this one reopens exactly the sealed copy. Names
                        // come from its own symbol tables (debug_syms off): a debug link would
                        // name another file, chosen by whoever wrote this one.
                        Some(copy) => {
                            let mut elf = Elf::new(format!("/proc/self/fd/{}", copy.as_raw_fd()));
                            elf.debug_syms = false;
                            let got = symbolizer.symbolize(&Source::Elf(elf), Input::FileOffset(&offs)).unwrap_or_default();
                            got.iter().map(sym_name).collect()
                        }
                        None => own_symbols(&f.file, &offs).unwrap_or_else(|| {
                            log::info!(
                                "{path} left unsymbolized: {} MiB, too large to copy, and its symbol tables could not be read",
                                f.size >> 20
                            );
                            Vec::new()
                        }),
                    };
                    opened.push(f);
                    names
                }
                Err(e) => {
                    log::info!("{path} left unsymbolized: {e}");
                    Vec::new()
                }
            };
            for (i, off) in offs.iter().enumerate() {
                let name = names.get(i).cloned().flatten().unwrap_or_else(|| format!("{base}+{off:#x}"));
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

    /// The reader for modules too large to copy names what blazesym names, read from the same
    /// file: exported functions of this process's libc (those alone at their address: aliases
    /// may be named either way), at their start and inside them.
    #[test]
    fn the_own_reader_agrees_with_blazesym() {
        use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let path =
            maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains("/libc.so")).expect("libc mapped").to_string();
        let data = std::fs::read(&path).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let funcs: Vec<_> =
            elf.dynamic_symbols().filter(|s| s.kind() == object::SymbolKind::Text && s.address() != 0 && s.size() > 4).collect();
        let mut at: HashMap<u64, std::collections::HashSet<String>> = HashMap::new();
        for s in elf.symbols().chain(elf.dynamic_symbols()) {
            at.entry(s.address()).or_default().insert(s.name().unwrap_or_default().to_string());
        }
        let mut offs = Vec::new();
        for s in funcs.iter().filter(|s| at[&s.address()].len() == 1).take(40) {
            let seg = elf.segments().find(|g| g.address() <= s.address() && s.address() < g.address() + g.size()).unwrap();
            let off = s.address() - seg.address() + seg.file_range().0;
            offs.extend([off, off + 2]);
        }
        assert!(offs.len() >= 20, "{path} has too few functions alone at their address");
        let f = std::fs::File::open(&path).unwrap();
        let ours = own_symbols(&f, &offs).unwrap();
        let mut elf = Elf::new(&path);
        elf.debug_syms = false;
        let theirs: Vec<Option<String>> =
            Symbolizer::new().symbolize(&Source::Elf(elf), Input::FileOffset(&offs)).unwrap().iter().map(sym_name).collect();
        assert_eq!(ours, theirs);
        assert!(ours.iter().all(Option::is_some), "{ours:?}");
    }
}
