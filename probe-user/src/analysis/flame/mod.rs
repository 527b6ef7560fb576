//! Flamegraphs from a recording: stack records (frames as module + file offset, kernel
//! addresses) are symbolized with blazesym (ELF symbols, demangled C++/Rust; kernel names
//! from the recording, see crate::analysis::ksyms), folded (`root;caller;callee weight`, flamegraph.pl / speedscope format) and
//! rendered to SVG with inferno.
//! Three stages with one interface between them, as in inferno: `symbols` (what frames are
//! called), `fold` (stack samples → folded lines and weights, streamed), here in the analysis,
//! and `analysis::flame` (folded → SVG).
mod fold;
pub(crate) mod symbols;

pub(crate) use fold::Folder;
pub use fold::{Flames, Folded, folded, folded_text};
pub use symbols::Symbols;
pub(crate) use symbols::Wanted;

use crate::record::StackKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Cpu,
    Offcpu,
    Faults,
    Io,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Cpu, Kind::Offcpu, Kind::Faults, Kind::Io];

    pub fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "cpu" => Kind::Cpu,
            "offcpu" => Kind::Offcpu,
            "faults" | "fault" => Kind::Faults,
            "io" => Kind::Io,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::Cpu => "cpu",
            Kind::Offcpu => "offcpu",
            Kind::Faults => "faults",
            Kind::Io => "io",
        }
    }
    /// The stack samples this graph is made of.
    pub fn what(self) -> StackKind {
        match self {
            Kind::Cpu => StackKind::Cpu,
            Kind::Offcpu => StackKind::Offcpu,
            Kind::Faults => StackKind::Fault,
            Kind::Io => StackKind::Io,
        }
    }
    pub fn unit(self) -> &'static str {
        match self {
            Kind::Cpu => "samples",
            Kind::Offcpu => "us",
            Kind::Faults => "major faults",
            Kind::Io => "block requests",
        }
    }
}

/// Which stacks: a time window (CLOCK_MONOTONIC ns).
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    pub from_ns: Option<u64>,
    pub to_ns: Option<u64>,
    /// The window is one request's: an off-CPU wait counts only for its part inside the window,
    /// and only when it ended inside it. A thread still waiting when the request ended (an idle
    /// pool worker, an accept loop) was not on the request's path.
    pub request: bool,
}
