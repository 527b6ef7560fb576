//! Python frames (`probe_user::kernel::python`): the target's memory is untrusted, so the decoder
//! reads an image made of the input: a code object's names, first line and location table, an
//! interpreter's thread list and `threading`'s thread names, `_Py_DebugOffsets`, with pointers anywhere (null, out of the image,
//! into themselves). Nothing may panic, loop or allocate without bound; a frame named must name
//! what the image holds. Also the merge of Python into native frames with arbitrary entry flags.
//!
//! Input: a layout byte (bit 0: 3.11 else 3.12; bit 1: take `_Py_DebugOffsets` from the image
//! when it parses), code address u32, instruction u32, runtime address u32, native frame count
//! u8; then the image (the rest), mapped at 0x10000.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probe_fuzz::Input;
use probe_user::kernel::python::{self as py, Memory};

const BASE: u64 = 0x10000;

struct Image<'a>(&'a [u8]);

impl Memory for Image<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        if buf.is_empty() || buf.len() > py::MAX_READ {
            return false;
        }
        let Some(off) = addr.checked_sub(BASE) else { return false };
        let Some(src) = usize::try_from(off).ok().and_then(|o| self.0.get(o..o.checked_add(buf.len())?)) else { return false };
        buf.copy_from_slice(src);
        true
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let which = inp.u8();
    let code = BASE + u64::from(inp.u32() % 0x20000);
    let instr = BASE + u64::from(inp.u32() % 0x20000);
    let runtime = BASE + u64::from(inp.u32() % 0x20000);
    let natives = inp.u8() % 64;
    let image = inp.bytes(usize::MAX);
    let mem = Image(image);
    let mut layout = py::layout(3, if which & 1 != 0 { 11 } else { 12 }).unwrap();
    if which & 2 != 0
        && let Some(l) = py::debug_offsets(image)
    {
        layout = l;
    }
    if let Some(name) = py::frame_text(&mem, &layout, code, instr) {
        assert!(name.len() < 8 * 1024, "a frame name of {} bytes", name.len());
    }
    let threads = py::thread_states(&mem, &layout, runtime);
    assert!(threads.len() <= 4096);
    // `threading`'s names: sys.modules → threading → _active → each Thread's attributes,
    // dicts, split values and ints as the image holds them (3.13's inline values too).
    for l in [layout, py::Layout { version: (3, 13), ..layout }] {
        let mut active = None;
        let names = py::thread_names(&mem, &l, runtime, &mut active);
        assert!(names.len() <= 4096 && names.values().all(|n| n.len() < 8 * 1024));
    }
    // Every table read from the image as a location table, from every start.
    for start in 0..image.len().min(64) {
        let _ = py::line_of(&image[start..], i64::from(which), u64::from(natives));
    }
    let _ = py::unicode_text(image, &layout);
    // Merge: native frames (module = byte & 3, 2 meaning "eval") with the image's words as
    // Python frames, entry flags and shims as they come.
    let native: Vec<(i64, u64)> = image.iter().take(usize::from(natives)).map(|b| (i64::from(b & 3), u64::from(*b))).collect();
    let frames: Vec<[u64; 2]> = image
        .chunks_exact(16)
        .take(64)
        .map(|c| [u64::from_le_bytes(c[..8].try_into().unwrap()), u64::from_le_bytes(c[8..].try_into().unwrap())])
        .collect();
    let merged = py::merge(&native, &frames, |m, _| m == 2, |c, _| c);
    let evals = native.iter().filter(|(m, _)| *m == 2).count();
    let named = frames.iter().filter(|f| f[0] != 0).count();
    // Every native frame but the replaced evaluation frames stays, every Python frame but shims
    // appears once.
    let kept = merged.iter().filter(|(m, _)| *m != probe_user::record::records::PY_MODULE).count();
    assert!(
        kept <= native.len() && kept + evals >= native.len(),
        "{kept} of {} native frames kept, {evals} evaluation frames",
        native.len()
    );
    assert_eq!(merged.iter().filter(|(m, _)| *m == probe_user::record::records::PY_MODULE).count(), named);
});
