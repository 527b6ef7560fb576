//! The machine probe runs on, read safely as root: /proc, cgroups, tracefs, the kernel's BTF,
//! files the target names, probe's own caches under /run/probe, and
//! how probe's threads stay off CPUs the server needs.
pub mod btf;
pub mod cgroup;
pub mod kernel_cache;
pub mod procfs;
pub mod run_dir;
pub mod target_file;
pub mod timer;
pub mod tracefs;
pub mod yielding;
