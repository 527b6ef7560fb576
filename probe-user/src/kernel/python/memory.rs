//! Bounded reads of a target's memory ([`Memory`]) and the CPython objects read through them:
//! code objects, `str`s, dicts, instance attributes, small `int`s and `threading`'s thread names.
use std::collections::HashMap;

use super::layout::{Layout, frame_name, line_of, unicode_text};
use super::{MAX_NAME, MAX_READ, MAX_THREADS};

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
pub(super) struct Code {
    pub(super) qualname: String,
    pub(super) file: String,
    first: i64,
    table: Vec<u8>,
}

/// Read code object `addr` of a process with layout `l`.
pub(super) fn read_code(mem: &impl Memory, l: &Layout, addr: u64) -> Option<Code> {
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
pub(super) fn line_at(c: &Code, l: &Layout, code: u64, instr: u64) -> Option<i64> {
    let index = instr.checked_sub(code.checked_add(l.code_adaptive)?)? / 2;
    line_of(&c.table, c.first, index)
}

/// A frame's name as a trace writes it, read from `mem` (None: the code object could not be
/// read): what [`super::Pythons::merge_into`] does for each frame, without its caches. For the fuzz
/// target and tests: the target's memory is whatever `mem` holds.
pub fn frame_text(mem: &impl Memory, l: &Layout, code: u64, instr: u64) -> Option<String> {
    let c = read_code(mem, l, code)?;
    Some(frame_name(&c.qualname, &c.file, line_at(&c, l, code, instr)))
}
