//! Python frames: at each stack event of a CPython thread the kernel walks the interpreter's
//! frame chain (from the thread's `PyThreadState`, found per thread by userspace and kept in
//! [`crate::maps::PY_THREADS`]) and sends the code object and instruction pointer of each
//! frame, innermost first, in a [`PyStackEvent`] just before the stack record. Userspace names
//! the code objects (read from the target's memory, bounded) and puts the Python frames in place
//! of the interpreter's evaluation frames of the native stack.
use crate::{EventHeader, EventKind, Record};

/// Frames walked per event (a server's asyncio stack is 30–60 deep).
pub const PY_DEPTH: usize = 64;

/// Or'ed into a frame's instruction word: the frame is the first of its C-level evaluation (one
/// `_PyEval_EvalFrameDefault` call ran it and the frames above it, up to the previous entry).
pub const PY_ENTRY: u64 = 1 << 63;

/// Frame layouts the kernel program reads (the same layout spans several versions).
/// CPython 3.11: `_PyInterpreterFrame` with `f_code` @32, `previous` @48, `prev_instr` @56,
/// `is_entry` @68; the first frame of a C-level evaluation has `is_entry` set.
pub const PY_FRAMES_311: u32 = 1;
/// CPython 3.12 and 3.13: `f_code`/`f_executable` @0, `previous` @8, `prev_instr`/`instr_ptr` @56,
/// `owner` @70; a C-level evaluation starts under a shim frame owned by the C stack
/// ([`PY_OWNED_BY_CSTACK`]), sent as `[0, PY_ENTRY]`: the frame before it is an entry.
pub const PY_FRAMES_312: u32 = 2;
/// `owner` of a shim frame (CPython 3.12+ `FRAME_OWNED_BY_CSTACK`).
pub const PY_OWNED_BY_CSTACK: u8 = 3;
/// [`PyThread::cframe`] when the thread state points at its current frame directly (3.13+).
pub const PY_NO_CFRAME: u32 = u32::MAX;

/// Where a thread's current frame is: `*(tstate + cframe) + frame` (3.11, 3.12: through the
/// thread's current `_PyCFrame`), or `tstate + frame` when `cframe` is [`PY_NO_CFRAME`] (3.13).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyThread {
    pub tstate: u64,
    pub cframe: u32,
    pub frame: u32,
    /// [`PY_FRAMES_311`] or [`PY_FRAMES_312`].
    pub layout: u32,
    pub _pad: u32,
}

/// The Python frames of a thread at a stack event, innermost first: `[code object, instruction
/// pointer | PY_ENTRY]` each. Sent right before the stack record of the same event.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStackEvent {
    pub hdr: EventHeader,
    pub frames_n: u32,
    /// 1: the chain went on past [`PY_DEPTH`] frames (the outermost are missing); 2: a read failed
    /// (a torn chain: what was read is kept).
    pub cut: u32,
    pub frames: [[u64; 2]; PY_DEPTH],
}
const _: () = assert!(core::mem::size_of::<PyStackEvent>() == 32 + 16 * PY_DEPTH);
impl Record for PyStackEvent {
    const KIND: EventKind = EventKind::PyStack;
}

impl Default for PyStackEvent {
    fn default() -> Self {
        Self { hdr: Default::default(), frames_n: 0, cut: 0, frames: [[0; 2]; PY_DEPTH] }
    }
}

pub const PY_CUT_DEPTH: u32 = 1;
pub const PY_CUT_READ: u32 = 2;
