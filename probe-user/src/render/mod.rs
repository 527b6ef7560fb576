//! What probe shows people, each from the analysis: the text summary, the HTML page, Markdown
//! and the bug-report bundle, the Perfetto timeline, flamegraphs, pprof and OTLP.
//! (The live view of `probe trace` is the collector's: it is made from records as they come.)
pub mod bundle;
pub mod diff;
pub mod export;
pub mod flame;
pub mod html;
pub mod perfetto;
pub mod system;
pub mod text;
