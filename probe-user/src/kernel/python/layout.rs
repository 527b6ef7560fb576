//! Where each CPython version keeps what probe reads (the [`Layout`] table, or the running
//! interpreter's own `_Py_DebugOffsets` from 3.13), and the decoding of the bytes read with it:
//! location tables, `str` objects, module and frame names.
use probe_common::python::{PY_FRAMES_311, PY_FRAMES_312, PY_NO_CFRAME};

use super::MAX_NAME;

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
