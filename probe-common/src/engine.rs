//! The inference engine's own view: llama.cpp's C API entry points, by uprobe, in whatever object
//! of the target holds them (the server binary with libllama linked in, or libllama.so).
//!
//! - A **step** is one call of a decode entry: `llama_decode(ctx, llama_batch)` (the classic API,
//!   the batch passed by value), `llama_encode` (same), or `llama_process(ctx, type, batch_ext *)`
//!   (the newer API). Its record is sent at the return (uretprobe): begin, end, return code, the
//!   batch's token count and how many tokens each sequence contributed.
//!   - Classic batches are read at the entry from the struct (public in llama.h: `n_tokens`, then
//!     the `pos`, `n_seq_id` and `seq_id` arrays), up to [`SCAN_TOKENS`] tokens.
//!   - Extended batches (`llama_batch_ext`, an opaque struct) are never read: their composition is
//!     counted from the public calls that fill them (`llama_batch_ext_clear`, `_add_token`,
//!     `_add_embd`), whose values are arguments.
//! - **Memory events**: `llama_memory_seq_rm` (and the older `llama_kv_self_seq_rm` /
//!   `llama_kv_cache_seq_rm`) with their sequence and range; `llama_memory_clear` (and older
//!   names): a prompt cache dropped or kept.
//! - **Runtime init**: model load and context creation, begin to end.
use crate::{EventHeader, EventKind, Record};

/// Sequences told apart per step: ids 0..SEQS (llama-server's slot ids, a binding's 0). Tokens of
/// higher ids are counted in [`EngineEvent::other_tokens`].
pub const SEQS: usize = 32;
/// Tokens of a classic batch whose sequence and position are read one by one (a decode step has
/// one a sequence). The rest of a longer batch (a prompt) are counted for the sequence of its
/// last token: callers add a sequence's prompt tokens together. [`EngineEvent::scanned`] says
/// how many were read one by one. Small, so that the kernel's verifier walks the loop quickly.
pub const SCAN_TOKENS: u32 = 8;

/// A step: `llama_decode` (classic batch).
pub const ENGINE_DECODE: u32 = 1;
/// A step: `llama_encode` (classic batch).
pub const ENGINE_ENCODE: u32 = 2;
/// A step: `llama_process` (extended batch); `arg` is its `llama_process_type` (0 encode, 1 decode).
pub const ENGINE_PROCESS: u32 = 3;
/// `llama_memory_seq_rm` and older names: `seq`, `p0`, `p1`; `ret` its bool.
pub const ENGINE_SEQ_RM: u32 = 4;
/// `llama_memory_clear` and older names.
pub const ENGINE_CLEAR: u32 = 5;
/// Model load, begin to end (`ret`: the model pointer, 0 when it failed).
pub const ENGINE_MODEL_LOAD: u32 = 6;
/// Context creation, begin to end (`ret`: the context pointer).
pub const ENGINE_CONTEXT_INIT: u32 = 7;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineEvent {
    /// `ts_ns` is the end (the return), or the call for the point events.
    pub hdr: EventHeader,
    /// `ENGINE_*`.
    pub what: u32,
    /// `llama_process`: its type argument. Else 0.
    pub arg: u32,
    /// When the call began.
    pub begin_ns: u64,
    /// The first argument: the `llama_context *` (steps), the memory or context (memory events).
    pub ctx: u64,
    /// The return value (sign-extended int, bool, or pointer).
    pub ret: i64,
    /// Tokens in the batch.
    pub n_tokens: u32,
    /// Tokens whose sequence was read one by one (classic: at most [`SCAN_TOKENS`], the rest
    /// counted for the last token's sequence; extended: every token).
    pub scanned: u32,
    /// Memory events: the sequence (-1: every sequence) and the range [p0, p1) (-1: open).
    pub seq: i32,
    pub p0: i32,
    pub p1: i32,
    /// Scanned tokens of sequences with ids of [`SEQS`] or more.
    pub other_tokens: u32,
    /// Tokens per sequence id.
    pub seq_tokens: [u16; SEQS],
    /// Classic batches: the largest position per sequence in this batch, +1 (0: none). The KV
    /// length the step reaches. Extended batches: 0 (positions are set through a pointer).
    pub seq_pos_end: [u32; SEQS],
}
const _: () = assert!(core::mem::size_of::<EngineEvent>() == 272);
impl Record for EngineEvent {
    const KIND: EventKind = EventKind::Engine;
}

impl Default for EngineEvent {
    fn default() -> Self {
        Self {
            hdr: Default::default(),
            what: 0,
            arg: 0,
            begin_ns: 0,
            ctx: 0,
            ret: 0,
            n_tokens: 0,
            scanned: 0,
            seq: 0,
            p0: 0,
            p1: 0,
            other_tokens: 0,
            seq_tokens: [0; SEQS],
            seq_pos_end: [0; SEQS],
        }
    }
}

/// An extended batch being filled (`llama_batch_ext_add_*` since its last clear), by batch pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchFill {
    pub n_tokens: u32,
    pub other_tokens: u32,
    pub seq_tokens: [u16; SEQS],
}

impl Default for BatchFill {
    fn default() -> Self {
        Self { n_tokens: 0, other_tokens: 0, seq_tokens: [0; SEQS] }
    }
}

pub const fn what_name(what: u32) -> &'static str {
    match what {
        ENGINE_DECODE => "decode",
        ENGINE_ENCODE => "encode",
        ENGINE_PROCESS => "process",
        ENGINE_SEQ_RM => "seq_rm",
        ENGINE_CLEAR => "clear",
        ENGINE_MODEL_LOAD => "model_load",
        ENGINE_CONTEXT_INIT => "context_init",
        _ => "unknown",
    }
}
