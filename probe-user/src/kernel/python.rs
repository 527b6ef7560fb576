//! Python frames of CPython targets (3.11, 3.12, 3.13): which threads are Python threads and where
//! their frame chain starts (for the kernel's walk, probe_common::python), what each code object
//! the walk sent is called (`module.qualname (file.py:line)`), and the merge of those frames into
//! the native stack in place of the interpreter's evaluation frames, as `py-spy --native` does.
//!
//! The target's memory is untrusted input: every read is bounded (process_vm_readv of at most
//! [`MAX_READ`] bytes), every pointer is checked for null and every count capped; a chain that
//! tears while read ends there. No file of the target is mapped: its ELF symbols are read
//! through probe's verified open file (crate::os::target_file).
use std::collections::{HashMap, HashSet};

use probe_common::python::{PY_ENTRY, PY_FRAMES_311, PY_FRAMES_312, PY_NO_CFRAME, PyStackEvent, PyThread};

use crate::os::procfs::Mapping;

use crate::record::records::PY_MODULE;
/// Most bytes one read of the target's memory takes.
pub const MAX_READ: usize = 64 << 10;
/// Most threads read from one interpreter's list.
const MAX_THREADS: usize = 4096;
/// Most characters of a name or file name kept.
const MAX_NAME: usize = 512;
/// Most distinct Python frames named per trace (then frames are named by code address).
const MAX_FRAMES: usize = 1 << 18;

/// Where a CPython version keeps what probe reads, in bytes from the start of each struct.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub version: (u8, u8),
    /// `_PyRuntime.interpreters.head`.
    pub interp_head: u64,
    /// `PyInterpreterState.threads.head`.
    pub threads_head: u64,
    pub tstate_next: u64,
    pub tstate_native_id: u64,
    /// `PyThreadState.cframe` (3.11, 3.12) or PY_NO_CFRAME.
    pub tstate_cframe: u32,
    /// `_PyCFrame.current_frame`, or `PyThreadState.current_frame` (3.13).
    pub frame: u32,
    pub frames: u32,
    pub code_filename: u64,
    pub code_name: u64,
    pub code_qualname: u64,
    pub code_firstlineno: u64,
    pub code_linetable: u64,
    pub code_adaptive: u64,
    /// sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject).
    pub ascii_size: u64,
    pub compact_size: u64,
    /// `PyInterpreterState.modules` (3.11) or `.imports.modules` (3.12+): `sys.modules`.
    pub interp_modules: u64,
    /// `PyHeapTypeObject.ht_cached_keys`: the shared keys of a class's instances' attributes.
    pub type_cached_keys: u64,
}

/// The table, by minor version (x86-64 and aarch64 Linux: LP64, the same layout). Offsets from
/// CPython's headers (the structs as py-spy's generated bindings spell them) and checked here
/// against a running 3.11 (tests/python.rs). 3.10 keeps frames as objects
/// (`PyFrameObject`, `tstate->frame`) and has no `native_thread_id`: not read.
pub fn layout(major: u8, minor: u8) -> Option<Layout> {
    let base = Layout {
        version: (major, minor),
        interp_head: 40,
        threads_head: 16,
        tstate_next: 8,
        tstate_native_id: 160,
        tstate_cframe: 56,
        frame: 8,
        frames: PY_FRAMES_311,
        code_filename: 112,
        code_name: 120,
        code_qualname: 128,
        code_firstlineno: 72,
        code_linetable: 136,
        code_adaptive: 184,
        ascii_size: 48,
        compact_size: 72,
        interp_modules: 888,
        type_cached_keys: 872,
    };
    match (major, minor) {
        (3, 11) => Some(base),
        (3, 12) => Some(Layout {
            threads_head: 72,
            tstate_native_id: 144,
            frame: 0,
            frames: PY_FRAMES_312,
            code_firstlineno: 68,
            code_adaptive: 192,
            ascii_size: 40,
            compact_size: 56,
            interp_modules: 944,
            type_cached_keys: 880,
            ..base
        }),
        // 3.13 and later: `_Py_DebugOffsets` in the running interpreter ([`debug_offsets`]).
        _ => None,
    }
}

/// CPython 3.13+ starts `_PyRuntime` with `_Py_DebugOffsets` (cookie "xdebugpy", the version,
/// then the offsets tools need): the layout from the interpreter itself. `b` is the start of
/// `_PyRuntime` (at least 512 bytes). None when the cookie is not there or a value is out of
/// reason (a torn or foreign struct).
pub fn debug_offsets(b: &[u8]) -> Option<Layout> {
    if b.get(..8)? != b"xdebugpy" {
        return None;
    }
    let w = |i: usize| -> Option<u64> { Some(u64::from_le_bytes(b.get(i * 8..i * 8 + 8)?.try_into().ok()?)) };
    let hex = w(1)?;
    let (major, minor) = (((hex >> 24) & 0xff) as u8, ((hex >> 16) & 0xff) as u8);
    // 3.14 tags its frame pointers (`_PyStackRef`): not read until checked on one.
    if (major, minor) != (3, 13) {
        return None;
    }
    // runtime_state {size, finalizing, interpreters_head} from word 2; interpreter_state {size,
    // id, next, threads_head, ...13 words}; thread_state {size, prev, next, interp,
    // current_frame, thread_id, native_thread_id, datastack_chunk, status}; interpreter_frame
    // {size, previous, executable, instr_ptr, localsplus, owner}; code_object {size, filename,
    // name, qualname, linetable, firstlineno, argcount, localsplusnames, localspluskinds,
    // co_code_adaptive}.
    let rt = 2;
    let is = rt + 3;
    let ts = is + 13;
    let fr = ts + 9;
    let co = fr + 6;
    let small = |v: u64| (v < 1 << 20).then_some(v);
    // The frame layout the kernel reads must be the one this table names.
    if (w(fr + 1)?, w(fr + 2)?, w(fr + 3)?, w(fr + 5)?) != (8, 0, 56, 70) {
        return None;
    }
    Some(Layout {
        version: (major, minor),
        interp_head: small(w(rt + 2)?)?,
        threads_head: small(w(is + 3)?)?,
        tstate_next: small(w(ts + 2)?)?,
        tstate_native_id: small(w(ts + 6)?)?,
        tstate_cframe: PY_NO_CFRAME,
        frame: u32::try_from(small(w(ts + 4)?)?).ok()?,
        frames: PY_FRAMES_312,
        code_filename: small(w(co + 1)?)?,
        code_name: small(w(co + 2)?)?,
        code_qualname: small(w(co + 3)?)?,
        code_linetable: small(w(co + 4)?)?,
        code_firstlineno: small(w(co + 5)?)?,
        code_adaptive: small(w(co + 9)?)?,
        ascii_size: 40,
        compact_size: 56,
        interp_modules: small(w(is + 5)?)?,
        // sizeof(PyTypeObject) 416 + the heap type's method tables and three names (not in
        // the debug offsets).
        type_cached_keys: 880,
    })
}

/// The line of code unit `index` from a 3.11+ location table (`co_linetable`), starting at
/// `first` (`co_firstlineno`); None when the table does not reach it or says "no location".
/// Bounded by the table: every entry consumes at least one byte.
pub fn line_of(table: &[u8], first: i64, index: u64) -> Option<i64> {
    let mut i = 0usize;
    let mut line = first;
    let mut at = 0u64;
    let varint = |i: &mut usize| -> Option<u64> {
        let mut v = 0u64;
        let mut shift = 0;
        loop {
            let b = *table.get(*i)?;
            *i += 1;
            v |= u64::from(b & 63).checked_shl(shift)?;
            if b & 64 == 0 || shift >= 60 {
                return Some(v);
            }
            shift += 6;
        }
    };
    while i < table.len() {
        let b = table[i];
        if b & 0x80 == 0 {
            // Not the start of an entry: a torn table.
            return None;
        }
        i += 1;
        let code = (b >> 3) & 15;
        let len = u64::from(b & 7) + 1;
        let (delta, known) = match code {
            15 => (0, false),
            14 => {
                let u = varint(&mut i)?;
                let d = if u & 1 != 0 { -((u >> 1) as i64) } else { (u >> 1) as i64 };
                for _ in 0..3 {
                    varint(&mut i)?;
                }
                (d, true)
            }
            13 => {
                let u = varint(&mut i)?;
                (if u & 1 != 0 { -((u >> 1) as i64) } else { (u >> 1) as i64 }, true)
            }
            10..=12 => {
                i += 2;
                (i64::from(code) - 10, true)
            }
            _ => {
                i += 1;
                (0, true)
            }
        };
        line = line.saturating_add(delta);
        if index < at + len {
            return known.then_some(line);
        }
        at += len;
    }
    None
}

/// A `str` object's text from its first bytes `b` (at least the header; the characters follow):
/// compact ASCII or compact 1/2/4-byte kinds; None for any other shape (a legacy string, a
/// torn object). At most [`MAX_NAME`] characters.
pub fn unicode_text(b: &[u8], l: &Layout) -> Option<String> {
    let len = u64::from_le_bytes(b.get(16..24)?.try_into().ok()?);
    let state = u32::from_le_bytes(b.get(32..36)?.try_into().ok()?);
    // state: interned 2 bits, kind 3, compact 1, ascii 1.
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1 == 1, (state >> 6) & 1 == 1);
    if !compact || len > 1 << 20 {
        return None;
    }
    let n = (len as usize).min(MAX_NAME);
    let (start, width) = if ascii { (l.ascii_size as usize, 1) } else { (l.compact_size as usize, kind as usize) };
    if !matches!(width, 1 | 2 | 4) {
        return None;
    }
    let data = b.get(start..start + n * width)?;
    Some(match width {
        1 if ascii => data.iter().map(|&c| char::from(c & 0x7f)).collect(),
        1 => data.iter().map(|&c| char::from(c)).collect(),
        2 => data.chunks_exact(2).map(|c| char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]]))).unwrap_or('?')).collect(),
        _ => data.chunks_exact(4).map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('?')).collect(),
    })
}

/// A module's dotted name from its file: the path below `site-packages/`, `dist-packages/` or
/// `lib/pythonX.Y/`, else the file's stem (`llama_cpp/server/app.py` → `llama_cpp.server.app`).
pub fn module_of(file: &str) -> String {
    let rel = ["site-packages/", "dist-packages/"]
        .iter()
        .find_map(|m| file.rfind(m).map(|i| &file[i + m.len()..]))
        .or_else(|| {
            let i = file.rfind("/lib/python3")?;
            let rest = &file[i + 5..];
            rest.find('/').map(|j| &rest[j + 1..])
        })
        .unwrap_or_else(|| file.rsplit('/').next().unwrap_or(file));
    let rel = rel.strip_suffix(".py").unwrap_or(rel);
    let rel = rel.strip_suffix("/__init__").unwrap_or(rel);
    rel.replace('/', ".")
}

/// One frame's name: `module.qualname (file.py:line)`.
pub fn frame_name(qualname: &str, file: &str, line: Option<i64>) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let module = module_of(file);
    let q = if module.is_empty() || file.starts_with('<') { qualname.to_string() } else { format!("{module}.{qualname}") };
    match line {
        Some(l) => format!("{q} ({base}:{l})"),
        None => format!("{q} ({base})"),
    }
}

/// Merge a stack's native frames (innermost first) with its Python frames (innermost first,
/// [`PY_ENTRY`] ending each C-level evaluation's group): each native frame for which `is_eval`
/// holds is replaced by the next group of Python frames; groups left over (the native unwind
/// stopped short) go outermost. `py_id` names a Python frame (its code object and instruction).
pub fn merge(
    native: &[(i64, u64)],
    py: &[[u64; 2]],
    is_eval: impl Fn(i64, u64) -> bool,
    mut py_id: impl FnMut(u64, u64) -> u64,
) -> Vec<(i64, u64)> {
    // A 3.12+ shim frame (`[0, PY_ENTRY]`) says the frame before it is an entry.
    let mut folded: Vec<[u64; 2]> = Vec::with_capacity(py.len());
    for f in py {
        match (f[0], folded.last_mut()) {
            (0, Some(last)) => last[1] |= f[1] & PY_ENTRY,
            (0, None) => {}
            _ => folded.push(*f),
        }
    }
    let py = &folded[..];
    let mut groups: Vec<&[[u64; 2]]> = Vec::new();
    let mut start = 0;
    for (i, f) in py.iter().enumerate() {
        if f[1] & PY_ENTRY != 0 {
            groups.push(&py[start..=i]);
            start = i + 1;
        }
    }
    if start < py.len() {
        groups.push(&py[start..]);
    }
    let mut out = Vec::with_capacity(native.len() + py.len());
    let mut g = groups.into_iter();
    let mut push = |out: &mut Vec<(i64, u64)>, group: &[[u64; 2]]| {
        out.extend(group.iter().map(|f| (PY_MODULE, py_id(f[0], f[1] & !PY_ENTRY))));
    };
    for &(m, off) in native {
        if is_eval(m, off)
            && let Some(group) = g.next()
        {
            push(&mut out, group);
            continue;
        }
        out.push((m, off));
    }
    for group in g {
        push(&mut out, group);
    }
    out
}

/// Bounded reads of a live process's memory.
pub trait Memory {
    /// Read `buf.len()` bytes at `addr` (at most [`MAX_READ`]); false when any is unreadable.
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool;

    fn u64(&self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }
}

/// A process's memory through process_vm_readv (root, or the same user with ptrace access).
pub struct ProcMemory(pub u32);

impl Memory for ProcMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        if buf.is_empty() || buf.len() > MAX_READ || addr == 0 {
            return false;
        }
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buf.len() };
        // SAFETY: one local iovec over `buf` (valid for its length), one remote range the kernel
        // checks; nothing else is touched.
        let n = unsafe { libc::process_vm_readv(self.0 as libc::pid_t, &local, 1, &remote, 1, 0) };
        n == buf.len() as isize
    }
}

/// A code object as read: its names, first line and location table.
#[derive(Clone, Debug)]
struct Code {
    qualname: String,
    file: String,
    first: i64,
    table: Vec<u8>,
}

/// Read code object `addr` of a process with layout `l`.
fn read_code(mem: &impl Memory, l: &Layout, addr: u64) -> Option<Code> {
    let mut head = [0u8; 256];
    let need = (l.code_adaptive as usize).min(head.len());
    if !mem.read(addr, &mut head[..need]) {
        return None;
    }
    let word = |off: u64| -> Option<u64> { Some(u64::from_le_bytes(head.get(off as usize..off as usize + 8)?.try_into().ok()?)) };
    let text = |p: u64| read_str(mem, l, p);
    let qualname = text(word(l.code_qualname)?).or_else(|| text(word(l.code_name)?))?;
    let file = text(word(l.code_filename)?).unwrap_or_default();
    let first = i64::from(i32::from_le_bytes(head.get(l.code_firstlineno as usize..l.code_firstlineno as usize + 4)?.try_into().ok()?));
    let table = word(l.code_linetable)
        .and_then(|p| {
            // A bytes object: size at 16, bytes from 32.
            let size = mem.u64(p.wrapping_add(16))? as usize;
            let mut t = vec![0u8; size.min(MAX_READ)];
            (size > 0 && mem.read(p.wrapping_add(32), &mut t)).then_some(t)
        })
        .unwrap_or_default();
    Some(Code { qualname, file, first, table })
}

/// The text of the `str` object at `p` (at most [`MAX_NAME`] characters).
fn read_str(mem: &impl Memory, l: &Layout, p: u64) -> Option<String> {
    let mut b = vec![0u8; l.compact_size as usize + MAX_NAME * 4];
    // A short string near the end of a mapping: read its header first, then what it holds.
    if !mem.read(p, &mut b[..l.ascii_size as usize]) {
        return None;
    }
    let len = u64::from_le_bytes(b[16..24].try_into().ok()?).min(MAX_NAME as u64) as usize;
    let want = (l.compact_size as usize + len * 4).min(b.len());
    if !mem.read(p, &mut b[..want]) && !mem.read(p, &mut b[..(l.ascii_size as usize + len).min(want)]) {
        return None;
    }
    unicode_text(&b, l)
}

/// Whether the `str` object at `p` is the ASCII text `name` (one read of its header and
/// characters; attribute and module names are ASCII).
fn str_is(mem: &impl Memory, l: &Layout, p: u64, name: &str) -> bool {
    let n = l.ascii_size as usize + name.len();
    let mut b = vec![0u8; n];
    if p == 0 || !mem.read(p, &mut b) {
        return false;
    }
    let len = u64::from_le_bytes(b[16..24].try_into().unwrap_or_default());
    let state = u32::from_le_bytes(b[32..36].try_into().unwrap_or_default());
    // Compact ASCII (state bits 5 and 6), of this length, these characters.
    len == name.len() as u64 && (state >> 5) & 3 == 3 && &b[l.ascii_size as usize..] == name.as_bytes()
}

/// Most entries read from one dict.
const MAX_ENTRIES: usize = 2048;

/// A dict keys object's entries as (key, value) pointers, in insertion order (the value is
/// null in a split table: the values are the owner's), at most [`MAX_ENTRIES`].
fn keys_entries(mem: &impl Memory, keys: u64) -> Option<Vec<(u64, u64)>> {
    // dk_refcnt, dk_log2_size, dk_log2_index_bytes, dk_kind, dk_version, dk_usable,
    // dk_nentries, then the index table and the entries (3.11-3.13 with the GIL).
    let mut head = [0u8; 32];
    if keys == 0 || !mem.read(keys, &mut head) {
        return None;
    }
    let (log2_index_bytes, kind) = (head[9], head[10]);
    let n = usize::try_from(u64::from_le_bytes(head[24..32].try_into().ok()?)).ok()?;
    if log2_index_bytes > 24 || kind > 2 || n > 1 << 24 {
        return None;
    }
    // General (kind 0): hash, key, value; unicode and split: key, value.
    let width = if kind == 0 { 24 } else { 16 };
    let n = n.min(MAX_ENTRIES).min(MAX_READ / width);
    let mut b = vec![0u8; n * width];
    if n > 0 && !mem.read(keys.checked_add(32 + (1u64 << log2_index_bytes))?, &mut b) {
        return None;
    }
    let word = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().unwrap_or_default());
    Some(b.chunks_exact(width).map(|c| if width == 24 { (word(c, 8), word(c, 16)) } else { (word(c, 0), word(c, 8)) }).collect())
}

/// A values array's `i`th value: `values` as the object holds it (3.13's carries a header).
fn split_value(mem: &impl Memory, l: &Layout, values: u64, i: usize) -> Option<u64> {
    let header = if l.version >= (3, 13) { 8 } else { 0 };
    mem.u64(values.checked_add(header + 8 * i as u64)?).filter(|&v| v != 0)
}

/// A dict's (key, value) pairs, deleted entries left out.
fn dict_items(mem: &impl Memory, l: &Layout, d: u64) -> Option<Vec<(u64, u64)>> {
    // ob_refcnt, ob_type, ma_used, ma_version_tag, ma_keys, ma_values.
    let keys = mem.u64(d.checked_add(32)?)?;
    let values = mem.u64(d.checked_add(40)?)?;
    let entries = keys_entries(mem, keys)?;
    Some(
        entries
            .into_iter()
            .enumerate()
            .filter_map(|(i, (k, v))| {
                let v = if values != 0 { split_value(mem, l, values, i)? } else { v };
                (k != 0 && v != 0).then_some((k, v))
            })
            .collect(),
    )
}

/// `d[name]` for a dict with string keys.
fn dict_get(mem: &impl Memory, l: &Layout, d: u64, name: &str) -> Option<u64> {
    dict_items(mem, l, d)?.into_iter().find(|&(k, _)| str_is(mem, l, k, name)).map(|(_, v)| v)
}

/// Instance attribute `name` of the object at `obj` (an instance of a Python class with a
/// managed dict, as every class without `__slots__` has since 3.11): from its dict when one
/// was made, else from its values and the class's shared keys.
fn attr(mem: &impl Memory, l: &Layout, obj: u64, name: &str) -> Option<u64> {
    let tp = mem.u64(obj.checked_add(8)?)?;
    let dict_or_values = mem.u64(obj.checked_sub(24)?)?;
    let values = match l.version {
        // 3.11: the dict three words before the object, its values four.
        (3, 11) if dict_or_values == 0 => mem.u64(obj.checked_sub(32)?)?,
        // 3.12: one word, tagged 1 when it holds values.
        (3, 12) if dict_or_values & 1 == 1 => dict_or_values - 1,
        // 3.13: the values inline after the object (tp_basicsize), with a `valid` byte.
        (3, 13) if dict_or_values == 0 => {
            let v = obj.checked_add(mem.u64(tp.checked_add(32)?)?)?;
            let mut head = [0u8; 4];
            (mem.read(v, &mut head) && head[3] != 0).then_some(v)?
        }
        _ if dict_or_values != 0 => return dict_get(mem, l, dict_or_values, name),
        _ => return None,
    };
    let keys = mem.u64(tp.checked_add(l.type_cached_keys)?)?;
    let i = keys_entries(mem, keys)?.iter().position(|&(k, _)| str_is(mem, l, k, name))?;
    split_value(mem, l, values, i)
}

/// A small non-negative `int` object's value (30-bit digits; at most three read).
fn long_value(mem: &impl Memory, l: &Layout, p: u64) -> Option<u64> {
    let mut b = [0u8; 36];
    if !mem.read(p, &mut b[..28]) {
        return None;
    }
    let size = u64::from_le_bytes(b[16..24].try_into().ok()?);
    // 3.11: ob_size, the digit count (negative below zero); 3.12+: lv_tag, count << 3 | sign.
    let n = if l.version >= (3, 12) {
        if size & 3 == 2 {
            return None;
        }
        size >> 3
    } else {
        if (size as i64) < 0 {
            return None;
        }
        size
    };
    if n > 3 || (n > 1 && !mem.read(p, &mut b[..24 + 4 * n as usize])) {
        return None;
    }
    (0..n as usize).try_fold(0u64, |v, i| {
        let d = u64::from(u32::from_le_bytes(b[24 + 4 * i..28 + 4 * i].try_into().ok()?) & 0x3fff_ffff);
        Some(v | d.checked_shl(30 * i as u32)?)
    })
}

/// The interpreter's `threading` threads by native thread id: `threading._active`'s `Thread`
/// objects, each with its `_name` and `_native_id` (set as the thread starts). `active` caches
/// where the `_active` dict is (a module global, made once).
pub fn thread_names(mem: &impl Memory, l: &Layout, runtime: u64, active: &mut Option<u64>) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    let found = match *active {
        Some(a) => Some(a),
        None => (|| {
            let interp = mem.u64(runtime.checked_add(l.interp_head)?).filter(|&p| p != 0)?;
            let modules = mem.u64(interp.checked_add(l.interp_modules)?)?;
            let threading = dict_get(mem, l, modules, "threading")?;
            // PyModuleObject: ob_refcnt, ob_type, md_dict.
            let globals = mem.u64(threading.checked_add(16)?)?;
            dict_get(mem, l, globals, "_active")
        })(),
    };
    let Some(a) = found else { return out };
    let Some(items) = dict_items(mem, l, a) else {
        *active = None;
        return out;
    };
    *active = Some(a);
    for (_, thread) in items.into_iter().take(MAX_THREADS) {
        let name = attr(mem, l, thread, "_name").and_then(|p| read_str(mem, l, p));
        let tid = attr(mem, l, thread, "_native_id").and_then(|p| long_value(mem, l, p));
        if let (Some(name), Some(tid)) = (name, tid.and_then(|t| u32::try_from(t).ok()).filter(|&t| t != 0)) {
            out.insert(tid, name);
        }
    }
    out
}

/// The line a frame of code object `code` (read as `c`) was at: its instruction pointer `instr`
/// as a code unit index into the code's bytecode.
fn line_at(c: &Code, l: &Layout, code: u64, instr: u64) -> Option<i64> {
    let index = instr.checked_sub(code.checked_add(l.code_adaptive)?)? / 2;
    line_of(&c.table, c.first, index)
}

/// A frame's name as a trace writes it, read from `mem` (None: the code object could not be
/// read): what [`Pythons::merge_into`] does for each frame, without its caches. For the fuzz
/// target and tests: the target's memory is whatever `mem` holds.
pub fn frame_text(mem: &impl Memory, l: &Layout, code: u64, instr: u64) -> Option<String> {
    let c = read_code(mem, l, code)?;
    Some(frame_name(&c.qualname, &c.file, line_at(&c, l, code, instr)))
}

/// The threads of the interpreter whose `_PyRuntime` is at `runtime`: native thread id → thread
/// state (at most [`MAX_THREADS`], a loop in the list ends it).
pub fn thread_states(mem: &impl Memory, l: &Layout, runtime: u64) -> HashMap<u32, u64> {
    threads(mem, &Interp { layout: *l, runtime, eval: (String::new(), 0, 0), ..Default::default() })
}

/// An interpreter found in a target process.
#[derive(Debug, Default)]
struct Interp {
    layout: Layout,
    runtime: u64,
    /// Where `_PyEval_EvalFrameDefault` is: (module path, file offsets start..end).
    eval: (String, u64, u64),
    /// Threads put in the kernel's map, by tid.
    threads: HashSet<u32>,
    /// `threading`'s names by tid as last read, when, and where its `_active` dict is.
    names: HashMap<u32, String>,
    names_read: Option<(std::time::Instant, usize)>,
    active: Option<u64>,
}

/// The Python side of a trace: the interpreters of the targets, their threads in the kernel's
/// map, and the names of the frames seen.
#[derive(Default)]
pub struct Pythons {
    procs: HashMap<u32, Option<Interp>>,
    /// The last Python frames per thread, waiting for their stack record.
    pending: HashMap<u32, Box<PyStackEvent>>,
    /// Each thread's Python frames at its last off-CPU stack (for the ones sent as the same).
    last_offcpu: HashMap<u32, Box<PyStackEvent>>,
    codes: HashMap<(u32, u64), Option<Code>>,
    ids: HashMap<(u32, u64, i64), u64>,
    /// Frame ids by (pid, code object, instruction): what `ids` gives without the line's lookup.
    by_instr: HashMap<(u32, u64, u64), u64>,
    /// Frame names not written to the recording yet.
    pub new_names: Vec<(u64, String)>,
    /// What was said about processes that could not be read (once each).
    pub notes: Vec<String>,
    /// Python stacks merged, and those whose frames could not be named.
    pub merged: u64,
    pub unnamed: u64,
    /// A thread of a Python target showed up that the kernel's map may not hold yet.
    pub dirty: bool,
    /// Threads `threading` named (or renamed) since the last look: (pid, tid, name).
    pub new_thread_names: Vec<(u32, u32, String)>,
    /// CPU time this process spent on Python frames (reading threads, naming code), ns: the
    /// thread's own clock (a drain at idle priority waits behind the server: wall time would
    /// count the server's work).
    pub work_ns: u64,
    /// Why Python frames were turned off during the trace ([`Pythons::turn_off`]).
    pub off: Option<String>,
    last_refresh: Option<std::time::Instant>,
    /// What each interpreter file's ELF symbols gave, by (path, device, inode): read once per
    /// file, not once per process (vLLM and multiprocessing servers start many).
    files: HashMap<(String, u32, u32, u64), Option<Syms>>,
}

impl Pythons {
    /// Look at the targets: a process not seen before is checked for a CPython interpreter
    /// (once); every interpreter's thread list is read again and the kernel's map brought up to
    /// date (threads started since, threads gone).
    pub fn refresh(&mut self, pids: &[u32], map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        self.dirty = false;
        if self.off.is_some() {
            return;
        }
        let t0 = thread_cpu_ns();
        self.refresh_now(pids, map);
        self.work_ns += thread_cpu_ns().saturating_sub(t0);
    }

    /// Python frames cost more than their budget: every thread leaves the kernel's map (the walk
    /// stops), nothing is read from the targets any more, and `why` is kept for the report.
    pub fn turn_off(&mut self, why: String, map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        if let Some(map) = map.as_mut() {
            for interp in self.procs.values().flatten() {
                for tid in &interp.threads {
                    let _ = map.remove(tid);
                }
            }
        }
        self.procs.clear();
        self.pending.clear();
        self.last_offcpu.clear();
        self.off = Some(why);
    }

    fn refresh_now(&mut self, pids: &[u32], map: &mut Option<aya::maps::HashMap<aya::maps::MapData, u32, PyThread>>) {
        self.last_refresh = Some(std::time::Instant::now());
        for &pid in pids {
            if !self.procs.contains_key(&pid) {
                let found = find(pid, &mut self.files);
                let interp = match found {
                    Ok(i) => i,
                    Err(Some(why)) => {
                        self.notes.push(format!("pid {pid}: Python frames not read: {why}"));
                        None
                    }
                    Err(None) => None,
                };
                self.procs.insert(pid, interp);
            }
            let Some(Some(interp)) = self.procs.get_mut(&pid) else { continue };
            let Some(map) = map.as_mut() else { continue };
            let mem = ProcMemory(pid);
            let now = threads(&mem, interp);
            for (&tid, &tstate) in &now {
                let l = &interp.layout;
                let t = PyThread { tstate, cframe: l.tstate_cframe, frame: l.frame, layout: l.frames, _pad: 0 };
                if map.get(&tid, 0).ok() != Some(t) {
                    let _ = map.insert(tid, t, 0);
                }
            }
            for gone in interp.threads.iter().filter(|t| !now.contains_key(t)) {
                let _ = map.remove(gone);
            }
            interp.threads = now.into_keys().collect();
            Self::name_threads(&mem, pid, interp, &mut self.new_thread_names);
        }
        self.procs.retain(|pid, _| pids.contains(pid));
    }

    /// Read `threading`'s thread names when the interpreter's threads changed and one has no
    /// name yet (a thread is in the interpreter's list a moment before `threading` registers
    /// it); threads no Python code started (a C library's pool calling in) never get one, so a
    /// thread set that stays the same is read again only every 5 s.
    fn name_threads(mem: &impl Memory, pid: u32, interp: &mut Interp, out: &mut Vec<(u32, u32, String)>) {
        let unnamed = interp.threads.iter().any(|t| !interp.names.contains_key(t));
        let due = match interp.names_read {
            None => true,
            Some((at, n)) => n != interp.threads.len() || at.elapsed() >= std::time::Duration::from_secs(5),
        };
        if !unnamed || !due {
            return;
        }
        interp.names_read = Some((std::time::Instant::now(), interp.threads.len()));
        let names = thread_names(mem, &interp.layout, interp.runtime, &mut interp.active);
        for (tid, name) in names {
            if interp.names.get(&tid) != Some(&name) {
                out.push((pid, tid, name.clone()));
                interp.names.insert(tid, name);
            }
        }
        interp.names.retain(|t, _| interp.threads.contains(t));
    }

    /// Whether a CPython target was found during the trace (also after [`Pythons::turn_off`]).
    pub fn any_seen(&self) -> bool {
        self.off.is_some() || self.any()
    }

    /// Whether any target runs a CPython this version reads.
    pub fn any(&self) -> bool {
        self.procs.values().any(Option::is_some)
    }

    /// A new thread of `pid` was seen: when `pid` runs a CPython, its thread list is read again
    /// soon ([`Pythons::due`]), so a thread started after attach (a thread pool's worker) gets
    /// its Python frames within a drain turn or two, not at the next second.
    pub fn new_thread(&mut self, pid: u32) {
        if matches!(self.procs.get(&pid), Some(Some(_))) {
            self.dirty = true;
        }
    }

    /// A new thread waits and the last read is 50 ms old or more.
    pub fn due(&self) -> bool {
        self.dirty && self.last_refresh.is_none_or(|t| t.elapsed() >= std::time::Duration::from_millis(50))
    }

    /// A thread's Python frames arrived; its stack record follows.
    pub fn frames(&mut self, ev: Box<PyStackEvent>) {
        if self.pending.len() >= 16384 && !self.pending.contains_key(&ev.hdr.tid) {
            self.pending.clear();
        }
        self.pending.insert(ev.hdr.tid, ev);
    }

    /// The native frames of a stack record of (`pid`, `tid`) at `ts_ns`, merged with the Python
    /// frames sent just before it (none: unchanged). `is_module(id, path)`: native module `id` is
    /// the file at `path`. An off-CPU stack the kernel sent as the same as the thread's last
    /// (`same`: no walk, no Python frames sent) gets the Python frames of that last one.
    pub fn merge_into(&mut self, at: StackAt, native: Vec<(i64, u64)>, is_module: impl Fn(i64, &str) -> bool) -> Vec<(i64, u64)> {
        let StackAt { pid, tid, ts_ns, offcpu, same } = at;
        let (ev, fresh) = match self.pending.remove(&tid) {
            Some(ev) => (ev, true),
            None if same && offcpu => match self.last_offcpu.remove(&tid) {
                Some(ev) if ev.hdr.pid == pid => (ev, false),
                _ => return native,
            },
            None => return native,
        };
        let t0 = thread_cpu_ns();
        let merged = self.merge_event(pid, if fresh { ts_ns } else { ev.hdr.ts_ns }, &ev, native, is_module);
        self.work_ns += thread_cpu_ns().saturating_sub(t0);
        if offcpu {
            if self.last_offcpu.len() >= 16384 && !self.last_offcpu.contains_key(&tid) {
                self.last_offcpu.clear();
            }
            self.last_offcpu.insert(tid, ev);
        }
        merged
    }

    fn merge_event(
        &mut self,
        pid: u32,
        ts_ns: u64,
        ev: &PyStackEvent,
        native: Vec<(i64, u64)>,
        is_module: impl Fn(i64, &str) -> bool,
    ) -> Vec<(i64, u64)> {
        // Sent in the same program run, just before: never after the stack, never long before.
        if ev.hdr.pid != pid || ev.hdr.ts_ns > ts_ns || ts_ns - ev.hdr.ts_ns > 1_000_000 {
            return native;
        }
        let Some(Some(interp)) = self.procs.get(&pid) else { return native };
        let layout = interp.layout;
        let (eval_path, lo, hi) = (&interp.eval.0, interp.eval.1, interp.eval.2);
        let n = (ev.frames_n as usize).min(ev.frames.len());
        let mem = ProcMemory(pid);
        let is_eval = |m: i64, off: u64| off >= lo && off < hi && is_module(m, eval_path);
        let mut unnamed = 0u64;
        let (codes, ids, new_names, by_instr) = (&mut self.codes, &mut self.ids, &mut self.new_names, &mut self.by_instr);
        let merged = merge(&native, &ev.frames[..n], is_eval, |code, instr| {
            // A frame seen before at the same instruction: its id at once (a thread that
            // switches thousands of times a second, a spin-wait's yield, repeats its stack).
            if let Some(&id) = by_instr.get(&(pid, code, instr)) {
                return id;
            }
            let c = codes.entry((pid, code)).or_insert_with(|| read_code(&mem, &layout, code));
            let line = c.as_ref().and_then(|c| line_at(c, &layout, code, instr));
            let key = (pid, code, line.unwrap_or(-1));
            if let Some(&id) = ids.get(&key) {
                if by_instr.len() < 4 * MAX_FRAMES {
                    by_instr.insert((pid, code, instr), id);
                }
                return id;
            }
            let id = ids.len() as u64;
            let text = match c {
                Some(c) => frame_name(&c.qualname, &c.file, line),
                None => {
                    unnamed += 1;
                    format!("[python code {code:#x}]")
                }
            };
            if ids.len() < MAX_FRAMES {
                ids.insert(key, id);
                new_names.push((id, text));
                if by_instr.len() < 4 * MAX_FRAMES {
                    by_instr.insert((pid, code, instr), id);
                }
            }
            id
        });
        self.unnamed += unnamed;
        self.merged += 1;
        merged
    }
}

/// Which stack record [`Pythons::merge_into`] merges into.
#[derive(Clone, Copy, Debug)]
pub struct StackAt {
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// An off-CPU stack, and one the kernel sent as the same as the thread's last.
    pub offcpu: bool,
    pub same: bool,
}

/// The calling thread's CPU time, ns.
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write; the clock id is a constant.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// What Python frames may cost: their own work (the kernel's walks and this process's reading
/// and naming) as a share of one core over the last [`Budget::WINDOW`], looked at each second.
pub struct Budget {
    /// The most they may take, a share of one core (0.01: 1%).
    pub share: f64,
    looks: std::collections::VecDeque<(u64, u64)>,
}

impl Budget {
    /// The window a share is taken over: long enough that naming a server's code at attach
    /// (a burst of reads) is spread, short enough to stop a steady cost within seconds.
    pub const WINDOW_NS: u64 = 5_000_000_000;

    pub fn new(share: f64) -> Budget {
        Budget { share, looks: Default::default() }
    }

    /// A look at `now_ns` with `spent_ns` spent so far: the share over the last window when it
    /// is over the budget (a full window must have passed).
    pub fn over(&mut self, now_ns: u64, spent_ns: u64) -> Option<f64> {
        self.looks.push_back((now_ns, spent_ns));
        while self.looks.len() > 2 && self.looks[1].0 + Self::WINDOW_NS <= now_ns {
            self.looks.pop_front();
        }
        let &(t0, s0) = self.looks.front()?;
        let dt = now_ns.checked_sub(t0).filter(|&d| d >= Self::WINDOW_NS)?;
        let share = spent_ns.saturating_sub(s0) as f64 / dt as f64;
        (share > self.share).then_some(share)
    }
}

/// The interpreter of `pid`: Ok(None) when it runs no CPython; Err(Some(why)) when it does but
/// cannot be read.
fn find(pid: u32, files: &mut HashMap<(String, u32, u32, u64), Option<Syms>>) -> Result<Option<Interp>, Option<String>> {
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
fn threads(mem: &impl Memory, i: &Interp) -> HashMap<u32, u64> {
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
struct Syms {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The share is taken over a full window, the oldest look kept just outside it.
    #[test]
    fn the_budget_is_a_share_of_a_core_over_five_seconds() {
        const S: u64 = 1_000_000_000;
        let mut b = Budget::new(0.01);
        // 8 ms a second: under 1%.
        for i in 0..10 {
            assert_eq!(b.over(i * S, i * 8_000_000), None, "second {i}");
        }
        // A burst of 40 ms in one second, then calm: 48 ms over the window is under 5 s × 1%
        // (50 ms), so it stays on.
        let mut b = Budget::new(0.01);
        assert_eq!(b.over(0, 0), None);
        assert_eq!(b.over(S, 40_000_000), None);
        for i in 2..8 {
            assert_eq!(b.over(i * S, 40_000_000 + (i - 1) * 1_000_000), None, "second {i}");
        }
        // 15 ms a second: over, once a window has passed, and not before.
        let mut b = Budget::new(0.01);
        for i in 0..5 {
            assert_eq!(b.over(i * S, i * 15_000_000), None, "second {i}");
        }
        let share = b.over(5 * S, 75_000_000).unwrap();
        assert!((share - 0.015).abs() < 1e-9, "{share}");
    }

    /// A made-up address space: regions at their addresses.
    #[derive(Default)]
    struct Image(Vec<(u64, Vec<u8>)>);

    impl Memory for Image {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            let Some((at, b)) = self.0.iter().find(|(at, b)| addr >= *at && addr + buf.len() as u64 <= at + b.len() as u64) else {
                return false;
            };
            let o = (addr - at) as usize;
            buf.copy_from_slice(&b[o..o + buf.len()]);
            true
        }
    }

    impl Image {
        fn words(&mut self, at: u64, w: &[u64]) {
            self.0.push((at, w.iter().flat_map(|w| w.to_le_bytes()).collect()));
        }

        /// A compact ASCII `str`.
        fn str(&mut self, at: u64, l: &Layout, text: &str) {
            let mut b = vec![0u8; l.ascii_size as usize];
            b[16..24].copy_from_slice(&(text.len() as u64).to_le_bytes());
            b[32..36].copy_from_slice(&(1u32 << 2 | 1 << 5 | 1 << 6).to_le_bytes());
            b.extend_from_slice(text.as_bytes());
            b.push(0);
            self.0.push((at, b));
        }

        /// A dict keys object of `kind` with these (key, value) entries.
        fn keys(&mut self, at: u64, kind: u8, entries: &[(u64, u64)]) {
            let mut b = vec![0u8; 40];
            b[8] = 3;
            b[9] = 3;
            b[10] = kind;
            b[24..32].copy_from_slice(&(entries.len() as u64).to_le_bytes());
            for &(k, v) in entries {
                if kind == 0 {
                    b.extend_from_slice(&0u64.to_le_bytes());
                }
                b.extend_from_slice(&k.to_le_bytes());
                b.extend_from_slice(&v.to_le_bytes());
            }
            self.0.push((at, b));
        }

        /// An `int` of one or two 30-bit digits.
        fn int(&mut self, at: u64, l: &Layout, v: u64) {
            let digits = if v >> 30 == 0 { vec![v] } else { vec![v & 0x3fff_ffff, v >> 30] };
            let n = digits.len() as u64;
            let size = if l.version >= (3, 12) { n << 3 } else { n };
            let mut b: Vec<u8> = [1u64, 0, size].iter().flat_map(|w| w.to_le_bytes()).collect();
            b.extend(digits.iter().flat_map(|&d| (d as u32).to_le_bytes()));
            self.0.push((at, b));
        }
    }

    /// `threading._active` as each version keeps it: sys.modules and the module globals as
    /// dicts of strings, `_active` keyed by ints, and each `Thread`'s `_name` and `_native_id`
    /// in its class's shared keys with the values where the version keeps them (3.11: a pointer
    /// four words before the object; 3.12: three words before, tagged; 3.13: inline after the
    /// object, behind a header), or in a dict of its own once one was made. Only 3.11 runs here.
    #[test]
    fn threads_are_named_as_threading_names_them() {
        for version in [(3, 11), (3, 12), (3, 13)] {
            let l = Layout { version, interp_modules: 888, ..layout(3, if version == (3, 11) { 11 } else { 12 }).unwrap() };
            let mut m = Image::default();
            let (runtime, interp, modules, threading, globals, active) = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000);
            m.words(runtime + l.interp_head, &[interp]);
            m.words(interp + l.interp_modules, &[modules]);
            // sys.modules = {"sys": 0x9999, "threading": <module>}: a unicode-keyed dict.
            m.str(0x10_000, &l, "sys");
            m.str(0x10_100, &l, "threading");
            m.words(modules, &[1, 0, 2, 0, 0x3100, 0]);
            m.keys(0x3100, 1, &[(0x10_000, 0x9999), (0x10_100, threading)]);
            m.words(threading, &[1, 0, globals]);
            m.str(0x10_200, &l, "_limbo");
            m.str(0x10_300, &l, "_active");
            m.words(globals, &[1, 0, 2, 0, 0x5100, 0]);
            m.keys(0x5100, 1, &[(0x10_200, 0x9999), (0x10_300, active)]);
            // _active = {ident: Thread}: int keys, a general table.
            let (t1, t2, cls) = (0x20_000, 0x21_000, 0x22_000);
            m.words(active, &[1, 0, 2, 0, 0x6100, 0]);
            m.keys(0x6100, 0, &[(0x30_000, t1), (0x30_100, t2)]);
            // The class's shared keys: _target, _name, _native_id.
            m.str(0x10_400, &l, "_target");
            m.str(0x10_500, &l, "_name");
            m.str(0x10_600, &l, "_native_id");
            m.words(cls + l.type_cached_keys, &[0x22_400]);
            m.words(cls + 32, &[16]);
            m.keys(0x22_400, 2, &[(0x10_400, 0), (0x10_500, 0), (0x10_600, 0)]);
            m.str(0x40_000, &l, "MainThread");
            m.int(0x40_100, &l, 4242);
            m.str(0x40_200, &l, "Thread-2 (worker)");
            m.int(0x40_300, &l, 1 << 31 | 77);
            // t1: values in the version's place; t2: a dict of its own.
            let values = [0u64, 0x40_000, 0x40_100];
            match version {
                (3, 11) => {
                    m.words(t1 - 32, &[0x23_000, 0, 0, 0, 1, cls]);
                    m.words(0x23_000, &values);
                }
                (3, 12) => {
                    m.words(t1 - 24, &[0x23_000 | 1, 0, 0, 1, cls]);
                    m.words(0x23_000, &values);
                }
                _ => {
                    m.words(t1 - 24, &[0, 0, 0, 1, cls, 0x0100_0303, 0, 0x40_000, 0x40_100]);
                }
            }
            m.words(t2 - 32, &[0, 0x24_000, 0, 0, 1, cls]);
            m.words(0x24_000, &[1, 0, 2, 0, 0x24_100, 0]);
            m.keys(0x24_100, 1, &[(0x10_500, 0x40_200), (0x10_600, 0x40_300)]);
            let mut at = None;
            let names = thread_names(&m, &l, runtime, &mut at);
            let want: HashMap<u32, String> = [(4242, "MainThread".to_string()), (1 << 31 | 77, "Thread-2 (worker)".to_string())].into();
            assert_eq!(names, want, "{version:?}");
            assert_eq!(at, Some(active));
            // A torn object: no name, no panic.
            m.0.retain(|(a, _)| *a != 0x40_300);
            assert_eq!(thread_names(&m, &l, runtime, &mut at).len(), 1);
        }
    }

    #[test]
    fn names_read_like_pythons_own() {
        assert_eq!(module_of("/opt/venv/lib/python3.11/site-packages/llama_cpp/server/app.py"), "llama_cpp.server.app");
        assert_eq!(module_of("/usr/lib/python3.11/asyncio/base_events.py"), "asyncio.base_events");
        assert_eq!(module_of("/usr/lib/python3/dist-packages/pkg/__init__.py"), "pkg");
        assert_eq!(module_of("/srv/plugin.py"), "plugin");
        assert_eq!(frame_name("Spin.run", "/srv/plugin.py", Some(12)), "plugin.Spin.run (plugin.py:12)");
        assert_eq!(frame_name("<module>", "<string>", None), "<module> (<string>)");
    }

    /// Entries of each form: short (code 0–9, one byte), one-line (10–12, two bytes), no column
    /// (13, a signed varint), long (14, four varints), none (15).
    #[test]
    fn location_tables_give_the_line_of_each_instruction() {
        let t = [
            0x80 | (13 << 3) | 1, // 2 units, line +1 (svarint 2)
            2,
            0x80 | (11 << 3), // 1 unit, line +1, columns
            4,
            9,
            0x80 | (14 << 3) | 2, // 3 units, line -2 (svarint 5), end line, columns
            5,
            0,
            1,
            1,
            0x80 | (15 << 3), // 1 unit, no location
            0x80 | (3 << 3),  // 1 unit, same line
            7,
        ];
        let at = |i| line_of(&t, 10, i);
        assert_eq!((at(0), at(1), at(2), at(3), at(5), at(6), at(7)), (Some(11), Some(11), Some(12), Some(10), Some(10), None, Some(10)));
        assert_eq!(at(8), None, "past the table");
        assert_eq!(line_of(&[0x01, 0x02], 1, 0), None, "a torn table");
    }

    #[test]
    fn strings_of_each_kind() {
        let l = layout(3, 11).unwrap();
        let mut ascii = vec![0u8; 48];
        ascii[16] = 5;
        ascii[32] = (1 << 5) | (1 << 6) | (1 << 2);
        ascii.extend_from_slice(b"hello");
        assert_eq!(unicode_text(&ascii, &l).as_deref(), Some("hello"));
        let mut wide = vec![0u8; 72];
        wide[16] = 2;
        wide[32] = (1 << 5) | (2 << 2);
        wide.extend_from_slice(&0x00e9u16.to_le_bytes());
        wide.extend_from_slice(&0x4e2du16.to_le_bytes());
        assert_eq!(unicode_text(&wide, &l).as_deref(), Some("é中"));
        let mut legacy = ascii.clone();
        legacy[32] = 0;
        assert_eq!(unicode_text(&legacy, &l), None);
        assert_eq!(unicode_text(&ascii[..50], &l), None, "cut short");
    }

    /// Each evaluation frame of the native stack gets its group of Python frames, in order; a
    /// group left over goes outermost.
    #[test]
    fn python_frames_take_the_place_of_the_evaluation_frames() {
        let native = [(1, 10), (2, 500), (1, 20), (2, 510), (1, 30)];
        let py = [[100, 1], [101, 2 | PY_ENTRY], [102, 3 | PY_ENTRY], [103, 4]];
        let out = merge(&native, &py, |m, _| m == 2, |code, _| code);
        assert_eq!(out, vec![(1, 10), (PY_MODULE, 100), (PY_MODULE, 101), (1, 20), (PY_MODULE, 102), (1, 30), (PY_MODULE, 103)]);
        assert_eq!(merge(&native, &[], |m, _| m == 2, |c, _| c), native.to_vec(), "no Python frames: unchanged");
        // 3.12+: shims instead of entry flags.
        let shims = [[100, 1], [101, 2], [0, PY_ENTRY], [102, 3], [0, PY_ENTRY], [103, 4]];
        assert_eq!(merge(&native, &shims, |m, _| m == 2, |code, _| code), out);
    }
}
