//! Exports for the tools people already run: pprof profiles (stacks, with sample types and
//! labels) and OpenTelemetry traces (one span per request, with its verdict). Both are written
//! from a recording directory after the fact (`probe export`), and OTLP can also be sent live
//! (`--otlp URL` on trace and watch). Encoded by hand over a small protobuf writer (`proto`).
pub mod otlp;
pub mod pprof;
mod proto;
