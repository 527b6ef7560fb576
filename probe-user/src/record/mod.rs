//! Recording a trace: what probe reads from the kernel and /proc to write down (issue 42's
//! record layer). `attach`: the target's state right after the probes are armed.
pub mod attach;
pub mod kernel_cache;
pub mod peer;
pub mod python;
