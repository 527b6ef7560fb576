//! Finding a target's CPython interpreter: the ELF file that defines `_PyRuntime` (its symbols
//! read through probe's verified open file), the version and its layout, and the interpreter's
//! thread list.
use std::collections::{HashMap, HashSet};

use crate::os::procfs::Mapping;

use super::MAX_THREADS;
use super::layout::{Layout, debug_offsets, layout};
use super::memory::{Memory, ProcMemory};

/// The threads of the interpreter whose `_PyRuntime` is at `runtime`: native thread id → thread
/// state (at most [`MAX_THREADS`], a loop in the list ends it).
pub fn thread_states(mem: &impl Memory, l: &Layout, runtime: u64) -> HashMap<u32, u64> {
    threads(mem, &Interp { layout: *l, runtime, eval: (String::new(), 0, 0), ..Default::default() })
}

/// An interpreter found in a target process.
#[derive(Debug, Default)]
pub(super) struct Interp {
    pub(super) layout: Layout,
    pub(super) runtime: u64,
    /// Where `_PyEval_EvalFrameDefault` is: (module path, file offsets start..end).
    pub(super) eval: (String, u64, u64),
    /// Threads put in the kernel's map, by tid.
    pub(super) threads: HashSet<u32>,
    /// `threading`'s names by tid as last read, when, and where its `_active` dict is.
    pub(super) names: HashMap<u32, String>,
    pub(super) names_read: Option<(std::time::Instant, usize)>,
    pub(super) active: Option<u64>,
}

/// The interpreter of `pid`: Ok(None) when it runs no CPython; Err(Some(why)) when it does but
/// cannot be read.
pub(super) fn find(pid: u32, files: &mut HashMap<(String, u32, u32, u64), Option<Syms>>) -> Result<Option<Interp>, Option<String>> {
    let maps = crate::os::procfs::read_maps(pid).map_err(|_| None)?;
    // The object that defines `_PyRuntime`: the python executable (static libpython) or
    // libpython3.X.so. Only files whose names say python are opened.
    let mut paths: Vec<&Mapping> = Vec::new();
    for m in &maps {
        let base = m.path.rsplit('/').next().unwrap_or(&m.path);
        if (base.starts_with("python3") || base.starts_with("libpython3")) && !paths.iter().any(|p| p.path == m.path) {
            paths.push(m);
        }
    }
    for m in paths {
        let key = (m.path.clone(), m.major, m.minor, m.inode);
        let syms = match files.get(&key) {
            Some(s) => s.clone(),
            None => {
                let s = crate::os::target_file::open_mapping(Some(pid), m, 1 << 30).ok().and_then(|f| symbols(&f));
                if files.len() < 64 {
                    files.insert(key, s.clone());
                }
                s
            }
        };
        let Some(syms) = syms else { continue };
        let base = load_base(&maps, &m.path, syms.first_load, syms.exec);
        let mem = ProcMemory(pid);
        let runtime = syms.runtime.wrapping_add(base);
        let mut head = [0u8; 4096];
        let debug = mem.read(runtime, &mut head).then(|| debug_offsets(&head)).flatten();
        let version =
            syms.version.and_then(|v| mem.u64(v.wrapping_add(base))).map(|hex| (((hex >> 24) & 0xff) as u8, ((hex >> 16) & 0xff) as u8));
        let version = version.or_else(|| version_from_name(&m.path));
        let Some((major, minor)) = version else { return Err(Some(format!("{}: no version found", m.path))) };
        let Some(layout) = debug.or_else(|| layout(major, minor)) else {
            return Err(Some(format!(
                "CPython {major}.{minor} in {} is not a version probe reads (3.11 to 3.13): native frames only",
                m.path
            )));
        };
        let interp = Interp { layout, runtime, eval: (m.path.clone(), syms.eval.0, syms.eval.1), ..Default::default() };
        if threads(&mem, &interp).is_empty() {
            return Err(Some(format!(
                "CPython {major}.{minor} in {}: no thread state found where the layout says: native frames only",
                m.path
            )));
        }
        return Ok(Some(interp));
    }
    Ok(None)
}

fn version_from_name(path: &str) -> Option<(u8, u8)> {
    let base = path.rsplit('/').next()?;
    let i = base.find("python3.")?;
    let rest = &base[i + 8..];
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((3, minor.parse().ok()?))
}

/// The interpreter's threads: native thread id → thread state address.
pub(super) fn threads(mem: &impl Memory, i: &Interp) -> HashMap<u32, u64> {
    let l = &i.layout;
    let mut out = HashMap::new();
    let Some(interp) = mem.u64(i.runtime.wrapping_add(l.interp_head)).filter(|&p| p != 0) else { return out };
    let mut t = mem.u64(interp.wrapping_add(l.threads_head)).unwrap_or(0);
    while t != 0 && out.len() < MAX_THREADS {
        let Some(tid) = mem.u64(t.wrapping_add(l.tstate_native_id)) else { break };
        if tid == 0 || tid > u64::from(u32::MAX) || out.insert(tid as u32, t).is_some() {
            break;
        }
        t = mem.u64(t.wrapping_add(l.tstate_next)).unwrap_or(0);
    }
    out
}

/// What probe needs from the interpreter's ELF file.
#[derive(Clone, Debug)]
pub(super) struct Syms {
    /// Virtual addresses of `_PyRuntime` and `Py_Version` (3.11+).
    runtime: u64,
    version: Option<u64>,
    /// `_PyEval_EvalFrameDefault` as file offsets start..end.
    eval: (u64, u64),
    first_load: u64,
    exec: bool,
}

fn symbols(f: &crate::os::target_file::TargetFile) -> Option<Syms> {
    use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
    let cache = object::ReadCache::new(&f.file);
    let elf = object::File::parse(&cache).ok()?;
    let (mut runtime, mut version, mut eval) = (None, None, None);
    // The C API is exported (extension modules link against it): the dynamic symbols hold all
    // three; the full table (tens of thousands of names) only where they do not.
    for table in 0..2 {
        let syms = if table == 0 { elf.dynamic_symbols() } else { elf.symbols() };
        for sym in syms {
            match sym.name() {
                Ok("_PyRuntime") => runtime = Some(sym.address()),
                Ok("Py_Version") => version = Some(sym.address()),
                Ok("_PyEval_EvalFrameDefault") if sym.size() > 0 => eval = Some((sym.address(), sym.size())),
                _ => {}
            }
        }
        if runtime.is_some() && version.is_some() && eval.is_some() {
            break;
        }
    }
    let (at, size) = eval?;
    let off = elf.segments().find_map(|s| {
        let (off, len) = s.file_range();
        (at >= s.address() && at < s.address() + len).then(|| at - s.address() + off)
    })?;
    let first_load = elf.segments().map(|s| s.address()).min().unwrap_or(0) & !0xfff;
    Some(Syms { runtime: runtime?, version, eval: (off, off + size), first_load, exec: elf.kind() == object::ObjectKind::Executable })
}

/// The load bias of `path` in a process: 0 for a fixed-address executable, else the start of its
/// first mapping (file offset 0) less its first segment's page.
fn load_base(maps: &[Mapping], path: &str, first_load: u64, exec: bool) -> u64 {
    if exec {
        return 0;
    }
    maps.iter().filter(|m| m.path == path && m.offset == 0).map(|m| m.start).min().map_or(0, |s| s.wrapping_sub(first_load))
}
