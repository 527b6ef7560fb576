//! The engine probe: finds llama.cpp's C API entry points in the objects a target maps (the
//! server binary with libllama linked in, libllama.so, a runner's binary) and attaches the
//! `engine_*` uprobes to them (probe-ebpf/src/engine.rs). Entry points are found by symbol, in
//! `.symtab` and `.dynsym` (a stripped binary keeps its exports in `.dynsym`); each is attached
//! for every process that maps the file, the kernel programs keeping the targets' calls only.
//!
//! Which API generation a target calls decides what a step carries:
//! - `llama_process(ctx, type, llama_batch_ext *)`: the batch is opaque; its composition comes
//!   from `llama_batch_ext_clear` / `_add_token` / `_add_embd`, whose arguments are the values. The
//!   three must all be present with `llama_process` (one API generation), else steps are timed
//!   and counted without their sequences, and the report says why.
//! - `llama_decode(ctx, llama_batch)`: the struct is public (llama.h since 2023: n_tokens, token,
//!   embd, pos, n_seq_id, seq_id, logits) and read at the entry. An object that has
//!   `llama_decode` without `llama_batch_init` is older than that struct: its steps are timed and
//!   its batches left out.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
};

use anyhow::Context as _;
use aya::{
    Ebpf,
    programs::{Program, UProbe, uprobe::UProbeScope},
};

use crate::{os::procfs, os::target_file};

/// What an entry point is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// `llama_process`: a step on an opaque `llama_batch_ext`, whose composition the fills give.
    ExtStep,
    /// `llama_decode`: a step on the public `llama_batch`; an object that has it without
    /// `llama_batch_init` is older than that struct.
    Decode,
    /// `llama_encode`: a step on the public `llama_batch`, of the encoder.
    Encode,
    /// `llama_batch_ext_clear`: a fill starts (not probed where `llama_process` forgets it).
    FillClear,
    /// `llama_batch_ext_add_token`.
    FillToken,
    /// `llama_batch_ext_add_embd`.
    FillEmbd,
    Memory,
    Init,
}

impl Role {
    fn step(self) -> bool {
        matches!(self, Role::ExtStep | Role::Decode | Role::Encode)
    }

    fn fill(self) -> bool {
        matches!(self, Role::FillClear | Role::FillToken | Role::FillEmbd)
    }
}

crate::closed_set! {
    /// Every program of the engine probe (probe-ebpf/src/engine.rs), by its name in the object;
    /// loaded only when an entry point is found.
    Prog {
        #[default]
        Process = "engine_process",
        Decode = "engine_decode",
        /// `llama_decode`'s and `llama_encode`'s entry where the object's `llama_batch` is older
        /// than the layout probe reads: steps timed, batches left out.
        DecodeOpaque = "engine_decode_opaque",
        Encode = "engine_encode",
        Ret = "engine_ret",
        RetI32 = "engine_ret_i32",
        BatchClear = "engine_batch_clear",
        BatchAdd = "engine_batch_add",
        SeqRm = "engine_seq_rm",
        Clear = "engine_clear",
        ModelLoad = "engine_model_load",
        ContextInit = "engine_context_init",
    }
}

/// One entry point: its names (newest first: the first found is attached; an older name is
/// often a wrapper of the newer one), the entry program, the return program.
struct Entry {
    names: &'static [&'static str],
    enter: Prog,
    ret: Option<Prog>,
    role: Role,
}

const ENTRIES: &[Entry] = &[
    Entry { names: &["llama_process"], enter: Prog::Process, ret: Some(Prog::RetI32), role: Role::ExtStep },
    Entry { names: &["llama_decode"], enter: Prog::Decode, ret: Some(Prog::RetI32), role: Role::Decode },
    Entry { names: &["llama_encode"], enter: Prog::Encode, ret: Some(Prog::RetI32), role: Role::Encode },
    Entry { names: &["llama_batch_ext_clear"], enter: Prog::BatchClear, ret: None, role: Role::FillClear },
    Entry { names: &["llama_batch_ext_add_token"], enter: Prog::BatchAdd, ret: None, role: Role::FillToken },
    Entry { names: &["llama_batch_ext_add_embd"], enter: Prog::BatchAdd, ret: None, role: Role::FillEmbd },
    Entry {
        names: &["llama_memory_seq_rm", "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm"],
        enter: Prog::SeqRm,
        ret: Some(Prog::Ret),
        role: Role::Memory,
    },
    Entry {
        names: &["llama_memory_clear", "llama_kv_self_clear", "llama_kv_cache_clear"],
        enter: Prog::Clear,
        ret: None,
        role: Role::Memory,
    },
    Entry {
        names: &["llama_model_load_from_file", "llama_load_model_from_file"],
        enter: Prog::ModelLoad,
        ret: Some(Prog::Ret),
        role: Role::Init,
    },
    Entry {
        names: &["llama_init_from_model", "llama_new_context_with_model"],
        enter: Prog::ContextInit,
        ret: Some(Prog::Ret),
        role: Role::Init,
    },
];

/// The symbol whose presence dates an object's `llama_batch` (llama.h since 2023): not attached.
const BATCH_INIT: &str = "llama_batch_init";

/// A symbol the search looks for: a name of an entry point, or [`BATCH_INIT`].
#[derive(Clone, Copy)]
enum Wanted {
    Entry,
    BatchInit,
}

/// Every program of the engine probe, by name (`probes::attach` sets them apart).
pub const PROGRAMS: &[&str] = Prog::WORDS;

/// Objects bigger than this are not searched for entry points (bytes of string table read).
const MAX_STRTAB: u64 = 64 << 20;

/// One object of a target that holds entry points.
#[derive(Debug)]
pub struct Found {
    /// The path the target mapped it by (for the report).
    pub path: String,
    /// The file, by device and inode.
    pub ident: target_file::Ident,
    /// How it is attached: the verified open file, by its `/proc/self/fd/N` link (exactly the
    /// mapped file, whatever its path now names; in a container too).
    file: target_file::TargetFile,
    /// (symbol, file offset) of every entry point present, by entry index.
    entries: Entries,
    /// It defines `llama_batch_init`: its `llama_batch` is the layout probe reads (llama.h since 2023).
    batch_init: bool,
}

impl Found {
    /// It has the entry point of this role.
    fn has(&self, role: Role) -> bool {
        self.entries.keys().any(|&i| ENTRIES[i].role == role)
    }
}

/// What the search found, and what it looked at.
#[derive(Debug, Default)]
pub struct Search {
    pub found: Vec<Found>,
    /// Every executable file looked at (found or not): a later search skips them.
    pub seen: Vec<target_file::Ident>,
    /// Executable objects looked at (basenames), for the "not found in …" line.
    pub looked: Vec<String>,
    /// Objects that could not be read, and why.
    pub unreadable: Vec<String>,
}

/// Search the executable mappings of `pids` for entry points (each file once).
pub fn search(pids: &[u32]) -> Search {
    let maps: Vec<(u32, procfs::Mapping)> =
        pids.iter().flat_map(|&pid| procfs::read_maps(pid).unwrap_or_default().into_iter().map(move |m| (pid, m))).collect();
    search_mappings(&maps)
}

/// Search these mappings (pid, mapping) for entry points: the executable ones, each file once
/// (what an unchanged file held is taken from the last search: [`Kept`]).
pub fn search_mappings(maps: &[(u32, procfs::Mapping)]) -> Search {
    let mut out = Search::default();
    let mut seen = HashSet::new();
    let mut kept = Kept::load(std::path::Path::new(crate::os::run_dir::DIR));
    for (pid, m) in maps {
        let pid = *pid;
        {
            if !m.perms.contains('x') || !seen.insert(target_file::Ident::of(m)) {
                continue;
            }
            out.seen.push(target_file::Ident::of(m));
            let base = m.path.rsplit('/').next().unwrap_or(&m.path).to_string();
            out.looked.push(base);
            match target_file::open_mapping(Some(pid), m, target_file::MAX_ELF_BYTES) {
                Ok(file) => match kept.entry_points(&file) {
                    Ok((entries, batch_init)) if !entries.is_empty() => {
                        out.found.push(Found { path: m.path.clone(), ident: target_file::Ident::of(m), file, entries, batch_init })
                    }
                    Ok(_) => {}
                    Err(e) => out.unreadable.push(format!("{}: {e:#}", m.path)),
                },
                Err(e) => out.unreadable.push(e.to_string()),
            }
        }
    }
    kept.store(std::path::Path::new(crate::os::run_dir::DIR));
    out
}

/// The entry points of the object files searched before, kept in `/run/probe` from one trace to
/// the next (reading a server's symbols took 30-50 ms of CPU beside arming's verification, on a
/// 2-core box), by file: device, inode, size, and mtime and ctime to the nanosecond (a file
/// rewritten or replaced is read again). For this build of probe only (its table of entry points).
struct Kept {
    by_file: HashMap<String, (Entries, bool)>,
    /// Files read in this search, to keep.
    fresh: Vec<String>,
}

/// The cache file in `/run/probe`, and the most files it keeps (the latest searched first).
const KEPT_NAME: &str = "engine-entries";
const KEPT_FILES: usize = 256;

impl Kept {
    fn load(dir: &std::path::Path) -> Kept {
        let text = crate::os::kernel_cache::load_bytes(dir, &crate::os::kernel_cache::per_exe(KEPT_NAME), &Self::key(), 1 << 20)
            .and_then(|b| String::from_utf8(b).ok());
        let by_file = text.iter().flat_map(|t| t.lines()).filter_map(parse_kept).collect();
        Kept { by_file, fresh: Vec::new() }
    }

    fn key() -> String {
        format!("engine entries 1 exe {}", crate::os::kernel_cache::exe_id())
    }

    /// [`entry_points`] of `f`, as kept when the file is unchanged.
    fn entry_points(&mut self, f: &target_file::TargetFile) -> anyhow::Result<(Entries, bool)> {
        let Some(id) = file_id(&f.file) else { return entry_points(f) };
        if let Some(hit) = self.by_file.get(&id) {
            return Ok(hit.clone());
        }
        let found = entry_points(f)?;
        self.by_file.insert(id.clone(), found.clone());
        self.fresh.push(id);
        Ok(found)
    }

    /// Keep what this search read, with the files kept before (up to [`KEPT_FILES`]). Best effort.
    fn store(self, dir: &std::path::Path) {
        if self.fresh.is_empty() {
            return;
        }
        let fresh: HashSet<&String> = self.fresh.iter().collect();
        let order = self.fresh.iter().chain(self.by_file.keys().filter(|k| !fresh.contains(k)));
        let lines: Vec<String> =
            order.take(KEPT_FILES).filter_map(|id| self.by_file.get(id).map(|(e, b)| render_kept(id, e, *b))).collect();
        crate::os::kernel_cache::store_bytes(dir, &crate::os::kernel_cache::per_exe(KEPT_NAME), &Self::key(), lines.join("\n").as_bytes());
    }
}

/// What identifies an object file's contents: device, inode, size, mtime and ctime (ns).
fn file_id(f: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = f.metadata().ok()?;
    Some(format!("{}:{}:{}:{}.{}:{}.{}", m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()))
}

/// `ID BATCH_INIT(0|1) [ENTRY/NAME/OFFSET]...`: an entry by its index in [`ENTRIES`] and its name's
/// index in the entry's names.
fn render_kept(id: &str, entries: &Entries, batch_init: bool) -> String {
    let mut line = format!("{id} {}", u8::from(batch_init));
    for (&i, &(name, off)) in entries {
        let j = ENTRIES[i].names.iter().position(|n| *n == name).unwrap_or(0);
        line.push_str(&format!(" {i}/{j}/{off}"));
    }
    line
}

fn parse_kept(line: &str) -> Option<(String, (Entries, bool))> {
    let mut words = line.split(' ');
    let id = words.next().filter(|w| !w.is_empty())?.to_string();
    let batch_init = match words.next()? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    let mut entries = Entries::new();
    for w in words {
        let mut parts = w.split('/');
        let (i, j, off): (usize, usize, u64) = (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
        if parts.next().is_some() {
            return None;
        }
        entries.insert(i, (*ENTRIES.get(i)?.names.get(j)?, off));
    }
    Some((id, (entries, batch_init)))
}

/// Entry points found in one file: (symbol, file offset) by entry index.
type Entries = BTreeMap<usize, (&'static str, u64)>;

/// The entry points of one ELF file: (symbol, file offset) by entry index, and whether it defines
/// `llama_batch_init`, in one pass over its symbols. Only files whose string tables name `llama_`
/// are read further (a Python with torch maps hundreds of objects).
fn entry_points(f: &target_file::TargetFile) -> anyhow::Result<(Entries, bool)> {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    let cache = object::ReadCache::new(&f.file);
    let elf = object::File::parse(&cache).context("not an ELF file")?;
    let names_llama = [".dynstr", ".strtab"]
        .iter()
        .any(|s| elf.section_by_name(s).is_some_and(|sec| sec.size() <= MAX_STRTAB && sec.data().is_ok_and(|d| memmem(d, b"llama_"))));
    let mut out = BTreeMap::new();
    if !names_llama {
        return Ok((out, false));
    }
    let mut batch_init = false;
    let wanted: HashMap<&'static str, Wanted> =
        ENTRIES.iter().flat_map(|e| e.names.iter().map(|n| (*n, Wanted::Entry))).chain([(BATCH_INIT, Wanted::BatchInit)]).collect();
    let mut by_name: HashMap<&'static str, u64> = HashMap::new();
    for sym in elf.symbols().chain(elf.dynamic_symbols()) {
        if !sym.is_definition() || sym.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        // The table's own name (static) for the file's.
        let name = match wanted.get_key_value(name) {
            Some((&name, Wanted::Entry)) => name,
            Some((_, Wanted::BatchInit)) => {
                batch_init = true;
                continue;
            }
            None => continue,
        };
        if let Some(off) = file_offset(&elf, sym.address()) {
            by_name.insert(name, off);
        }
    }
    for (i, e) in ENTRIES.iter().enumerate() {
        if let Some(&name) = e.names.iter().find(|n| by_name.contains_key(**n)) {
            out.insert(i, (name, by_name[name]));
        }
    }
    Ok((out, batch_init))
}

/// The file offset of a virtual address: through the loadable segment that holds it.
fn file_offset<'d, R: object::ReadRef<'d>>(elf: &object::File<'d, R>, addr: u64) -> Option<u64> {
    use object::{Object as _, ObjectSegment as _};
    elf.segments().find_map(|s| {
        let (off, size) = s.file_range();
        (addr >= s.address() && addr < s.address() + size).then(|| addr - s.address() + off)
    })
}

fn memmem(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// What attaching the engine probe did: attached entry points ("llama_process in llama-server"),
/// what was left out and why.
#[derive(Debug, Default)]
pub struct Attached {
    pub attached: Vec<String>,
    pub skipped: Vec<String>,
    /// At least one decode entry point is attached.
    pub live: bool,
}

/// Attach the engine programs to what `search` found. Programs are loaded on first use.
/// Where the engine's programs are found: the whole object, or the share of it a thread was given
/// (`probes::attach` verifies them beside the other programs).
pub trait Programs {
    fn program_mut(&mut self, p: Prog) -> Option<&mut Program>;
}

impl Programs for Ebpf {
    fn program_mut(&mut self, p: Prog) -> Option<&mut Program> {
        Ebpf::program_mut(self, p.name())
    }
}

impl Programs for HashMap<&str, &mut Program> {
    fn program_mut(&mut self, p: Prog) -> Option<&mut Program> {
        self.get_mut(p.name()).map(|p| &mut **p)
    }
}

pub fn attach(ebpf: &mut impl Programs, s: &Search) -> Attached {
    let mut out = Attached::default();
    if s.found.is_empty() {
        let mut looked: Vec<&str> = s.looked.iter().map(String::as_str).collect();
        looked.dedup();
        let shown = looked.iter().take(8).copied().collect::<Vec<_>>().join(", ");
        let more = if looked.len() > 8 { format!(" and {} more", looked.len() - 8) } else { String::new() };
        out.skipped.push(format!(
            "engine probes: no llama.cpp entry point (llama_process, llama_decode) found in {shown}{more}: not a llama.cpp engine, or its symbols are stripped"
        ));
        out.skipped.extend(s.unreadable.iter().map(|u| format!("engine probes: {u}")));
        return out;
    }
    // Programs the kernel refused: not tried again for the next object.
    let mut refused: HashSet<Prog> = HashSet::new();
    for f in &s.found {
        let base = f.path.rsplit('/').next().unwrap_or(&f.path);
        let ext = f.has(Role::ExtStep);
        let fill_ok = f.has(Role::FillClear) && f.has(Role::FillToken);
        // The classic `llama_batch` layout is the one probe reads when the object has the API that
        // introduced it (`llama_batch_init`, with `llama_decode`, in llama.h since Sept. 2023).
        let classic_ok = !f.has(Role::Decode) || f.batch_init;
        let missing: Vec<&str> = ENTRIES.iter().enumerate().filter(|(i, _)| !f.entries.contains_key(i)).map(|(_, e)| e.names[0]).collect();
        if !missing.is_empty() {
            out.skipped.push(format!("engine probes: {} not found in {base}", missing.join(", ")));
        }
        if ext && !fill_ok {
            out.skipped.push(format!(
                "engine probes: {base} has llama_process without llama_batch_ext_clear/_add_token: steps are timed, their sequences left out"
            ));
        }
        if !classic_ok {
            out.skipped.push(format!(
                "engine probes: {base} has llama_decode but no llama_batch_init (a llama_batch older than llama.h of 2023): steps are timed, batches left out"
            ));
        }
        let fd_path = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&f.file.file)));
        for (&i, &(name, off)) in &f.entries {
            let e = &ENTRIES[i];
            if e.role.fill() && !fill_ok {
                continue;
            }
            // llama_process takes (and forgets) its batch's fill: no probe on the clear.
            if e.role == Role::FillClear && ext {
                continue;
            }
            let classic = matches!(e.role, Role::Decode | Role::Encode);
            let enter = if classic && !classic_ok { Prog::DecodeOpaque } else { e.enter };
            let programs: Vec<Prog> = std::iter::once(enter).chain(e.ret).collect();
            let mut ok = true;
            for &prog in &programs {
                if refused.contains(&prog) {
                    ok = false;
                    break;
                }
                if let Err(err) = attach_one(ebpf, prog, off, &fd_path) {
                    if ebpf.program_mut(prog).is_some_and(|p| p.fd().is_err()) {
                        refused.insert(prog);
                    }
                    // The first line of the cause (a verifier log runs to megabytes).
                    let cause = err.root_cause().to_string();
                    let cause: String = cause.lines().next().unwrap_or_default().chars().take(240).collect();
                    out.skipped.push(format!("engine probes: {name} in {base}: {err}: {cause}"));
                    ok = false;
                    break;
                }
            }
            if ok {
                out.attached.push(format!("{name} in {base}"));
                out.live |= e.role.step();
            }
        }
    }
    out
}

fn attach_one(ebpf: &mut impl Programs, program: Prog, offset: u64, target: &std::path::Path) -> anyhow::Result<()> {
    let p: &mut UProbe = ebpf.program_mut(program).with_context(|| format!("program {program} missing from the object"))?.try_into()?;
    let t = std::time::Instant::now();
    if p.fd().is_err() {
        p.load().with_context(|| format!("the verifier refused {program}"))?;
    }
    let v = t.elapsed();
    p.attach(offset, target, UProbeScope::AllProcesses).with_context(|| format!("cannot attach {program}"))?;
    log::debug!("engine {program}: verified {v:?}, attached {:?}", t.elapsed() - v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_lines_round_trip_and_bad_ones_are_dropped() {
        let entries: Entries = [(0, ("llama_process", 4096)), (4, ("llama_batch_ext_add_token", 81920))].into_iter().collect();
        let line = render_kept("2049:77:1000:1.5:2.6", &entries, true);
        assert_eq!(parse_kept(&line), Some(("2049:77:1000:1.5:2.6".to_string(), (entries, true))));
        assert_eq!(parse_kept("id 0"), Some(("id".to_string(), (Entries::new(), false))));
        for bad in ["", "id", "id 2", "id 1 999/0/5", "id 1 0/9/5", "id 1 0/0", "id 1 0/0/5/6", "id 1 0/0/x"] {
            assert_eq!(parse_kept(bad), None, "{bad:?}");
        }
    }

    /// An object file's entry points are kept for the next search while the file is unchanged,
    /// and read again once it changes (its mtime here).
    #[test]
    fn kept_entries_follow_the_file() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("probe-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let obj = dir.join("true");
        std::fs::copy("/usr/bin/true", &obj).unwrap();
        let open = || {
            let file = std::fs::File::open(&obj).unwrap();
            target_file::TargetFile { size: file.metadata().unwrap().len(), file, opened: obj.clone() }
        };
        let mut kept = Kept::load(&dir);
        assert!(kept.by_file.is_empty());
        assert_eq!(kept.entry_points(&open()).unwrap(), (Entries::new(), false));
        assert_eq!(kept.fresh.len(), 1, "read, to keep");
        kept.store(&dir);
        let mut again = Kept::load(&dir);
        assert_eq!(again.by_file.len(), 1, "kept for the next search");
        assert_eq!(again.entry_points(&open()).unwrap(), (Entries::new(), false));
        assert!(again.fresh.is_empty(), "taken from what was kept, not read");
        // The file changes: read again.
        let f = std::fs::File::options().write(true).open(&obj).unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60)).unwrap();
        drop(f);
        let mut changed = Kept::load(&dir);
        changed.entry_points(&open()).unwrap();
        assert_eq!(changed.fresh.len(), 1, "a changed file is read again");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
