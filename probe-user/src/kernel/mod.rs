//! The kernel side of a trace: the probe table and its attach, the engine's uprobes, the
//! target's unwind tables and Python frames.
pub mod attach;
pub mod engine;
pub mod kept;
mod loaded;
pub mod percpu;
pub mod probes;
mod programs;
pub mod python;
mod table;
pub mod unwind;
