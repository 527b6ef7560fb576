//! Builds probe-ebpf for the BPF target with the nightly toolchain (aya-build) and leaves the
//! object in OUT_DIR for `include_bytes_aligned!`. bpf-linker is taken from the setup cache.
//! `AYA_BUILD_SKIP=1` (aya-build's own switch) leaves an empty object instead: for builds that
//! never load the programs and must not build them (the fuzz targets, with sanitizer flags).
use std::{env, path::PathBuf};

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    if env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
        let out = PathBuf::from(env::var_os("OUT_DIR").ok_or_else(|| anyhow::anyhow!("OUT_DIR not set"))?);
        std::fs::write(out.join("probe"), b"")?;
        println!("cargo:warning=AYA_BUILD_SKIP set: no eBPF programs in this build (it cannot trace)");
        return Ok(());
    }
    let cache = env::var_os("PROBE_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/probe")))
        .unwrap_or_default();
    let bin = cache.join("bin");
    if !bin.join("bpf-linker").exists() && which_bpf_linker().is_none() {
        anyhow::bail!("bpf-linker not found in {} or PATH: run `cargo xtask setup` (or scripts/setup.sh) first", bin.display());
    }
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin];
    paths.extend(env::split_paths(&path));
    // SAFETY: build scripts are single-threaded here; the child cargo inherits PATH.
    unsafe { env::set_var("PATH", env::join_paths(paths)?) };
    println!("cargo:rerun-if-env-changed=PROBE_CACHE");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../probe-ebpf");
    aya_build::build_ebpf([aya_build::Package { name: "probe-ebpf", root_dir: root, ..Default::default() }], aya_build::Toolchain::Nightly)
}

fn which_bpf_linker() -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?).map(|p| p.join("bpf-linker")).find(|p| p.exists())
}
