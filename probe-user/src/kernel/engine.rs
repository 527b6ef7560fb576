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
    Step,
    Fill,
    Memory,
    Init,
}

/// One entry point: its names (newest first: the first found is attached; an older name is
/// often a wrapper of the newer one), the entry program, the return program.
struct Entry {
    names: &'static [&'static str],
    enter: &'static str,
    ret: Option<&'static str>,
    role: Role,
}

const ENTRIES: &[Entry] = &[
    Entry { names: &["llama_process"], enter: "engine_process", ret: Some("engine_ret_i32"), role: Role::Step },
    Entry { names: &["llama_decode"], enter: "engine_decode", ret: Some("engine_ret_i32"), role: Role::Step },
    Entry { names: &["llama_encode"], enter: "engine_encode", ret: Some("engine_ret_i32"), role: Role::Step },
    Entry { names: &["llama_batch_ext_clear"], enter: "engine_batch_clear", ret: None, role: Role::Fill },
    Entry { names: &["llama_batch_ext_add_token"], enter: "engine_batch_add", ret: None, role: Role::Fill },
    Entry { names: &["llama_batch_ext_add_embd"], enter: "engine_batch_add", ret: None, role: Role::Fill },
    Entry {
        names: &["llama_memory_seq_rm", "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm"],
        enter: "engine_seq_rm",
        ret: Some("engine_ret"),
        role: Role::Memory,
    },
    Entry {
        names: &["llama_memory_clear", "llama_kv_self_clear", "llama_kv_cache_clear"],
        enter: "engine_clear",
        ret: None,
        role: Role::Memory,
    },
    Entry {
        names: &["llama_model_load_from_file", "llama_load_model_from_file"],
        enter: "engine_model_load",
        ret: Some("engine_ret"),
        role: Role::Init,
    },
    Entry {
        names: &["llama_init_from_model", "llama_new_context_with_model"],
        enter: "engine_context_init",
        ret: Some("engine_ret"),
        role: Role::Init,
    },
];

/// Every program of the engine probe (loaded only when an entry point is found).
pub const PROGRAMS: &[&str] = &[
    "engine_process",
    "engine_decode",
    "engine_decode_opaque",
    "engine_encode",
    "engine_ret",
    "engine_ret_i32",
    "engine_batch_clear",
    "engine_batch_add",
    "engine_seq_rm",
    "engine_clear",
    "engine_model_load",
    "engine_context_init",
];

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
    fn has(&self, name: &str) -> bool {
        self.entries.values().any(|(n, _)| *n == name)
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

/// Search these mappings (pid, mapping) for entry points: the executable ones, each file once.
pub fn search_mappings(maps: &[(u32, procfs::Mapping)]) -> Search {
    let mut out = Search::default();
    let mut seen = HashSet::new();
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
                Ok(file) => match entry_points(&file) {
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
    out
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
    let wanted: HashMap<&str, usize> = ENTRIES.iter().enumerate().flat_map(|(i, e)| e.names.iter().map(move |n| (*n, i))).collect();
    let mut by_name: HashMap<&'static str, u64> = HashMap::new();
    for sym in elf.symbols().chain(elf.dynamic_symbols()) {
        if !sym.is_definition() || sym.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        batch_init |= name == "llama_batch_init";
        let Some(&i) = wanted.get(name) else { continue };
        let Some(&name) = ENTRIES[i].names.iter().find(|n| **n == name) else { continue };
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
    fn program_mut(&mut self, name: &str) -> Option<&mut Program>;
}

impl Programs for Ebpf {
    fn program_mut(&mut self, name: &str) -> Option<&mut Program> {
        Ebpf::program_mut(self, name)
    }
}

impl Programs for HashMap<&str, &mut Program> {
    fn program_mut(&mut self, name: &str) -> Option<&mut Program> {
        self.get_mut(name).map(|p| &mut **p)
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
    let mut refused: HashSet<&str> = HashSet::new();
    for f in &s.found {
        let base = f.path.rsplit('/').next().unwrap_or(&f.path);
        let ext = f.has("llama_process");
        let fill_ok = ["llama_batch_ext_clear", "llama_batch_ext_add_token"].iter().all(|n| f.has(n));
        // The classic `llama_batch` layout is the one probe reads when the object has the API that
        // introduced it (`llama_batch_init`, with `llama_decode`, in llama.h since Sept. 2023).
        let classic_ok = !f.has("llama_decode") || f.batch_init;
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
            if e.role == Role::Fill && !fill_ok {
                continue;
            }
            // llama_process takes (and forgets) its batch's fill: no probe on the clear.
            if name == "llama_batch_ext_clear" && ext {
                continue;
            }
            let enter = if e.enter != "engine_process" && e.role == Role::Step && !classic_ok { "engine_decode_opaque" } else { e.enter };
            let programs: Vec<&str> = std::iter::once(enter).chain(e.ret).collect();
            let mut ok = true;
            for prog in &programs {
                if refused.contains(prog) {
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
                out.live |= e.role == Role::Step;
            }
        }
    }
    out
}

fn attach_one(ebpf: &mut impl Programs, program: &str, offset: u64, target: &std::path::Path) -> anyhow::Result<()> {
    let p: &mut UProbe = ebpf.program_mut(program).with_context(|| format!("program {program} missing from the object"))?.try_into()?;
    if p.fd().is_err() {
        p.load().with_context(|| format!("the verifier refused {program}"))?;
    }
    p.attach(offset, target, UProbeScope::AllProcesses).with_context(|| format!("cannot attach {program}"))?;
    Ok(())
}
