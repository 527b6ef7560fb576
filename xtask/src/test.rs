//! `cargo xtask test`: every test (unit, golden and kernel tests), as root where they load BPF
//! programs.
use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::setup::{
    aiperf, bin, build, deb, give_back_files, host_triple, image, llama, llama_python, manifests, root, sudo_ready, via_sudo, vllm,
};

pub(crate) fn test(args: &[String]) -> anyhow::Result<()> {
    sudo_ready()?;
    build()?;
    // The .deb the packaging test installs (tests/kernel.rs).
    let deb = deb()?;
    let (server, model) = llama()?;
    let (vllm_python, vllm_model) = vllm(&model)?;
    let llama_python = llama_python()?;
    let aiperf = aiperf()?;
    let kube_validate = manifests()?;
    // The image the container tests run (tests/deploy.rs), in root's store.
    let probe_image = image(None, None, true)?;
    // Pass cargo's output through and close with one total line over every test binary.
    let mut cargo = Command::new("cargo");
    if via_sudo() {
        // cargo builds as the user and runs each test binary through sudo (the kernel tests load
        // BPF programs): the aya template's `runner = "sudo -E"`, for this run only.
        let var = format!("CARGO_TARGET_{}_RUNNER", host_triple()?.to_uppercase().replace(['-', '.'], "_"));
        cargo.env(var, "sudo -E");
        let clients = PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/probe/clients");
        cargo.env("PROBE_CLIENTS", std::env::var_os("PROBE_CLIENTS").map_or(clients, PathBuf::from));
    }
    let mut child = cargo
        .current_dir(root())
        .env("PROBE_BIN", bin("probe"))
        .env("PROBE_DEB", deb)
        .env("LLAMA_SERVER", server)
        .env("LLAMA_MODEL", model)
        .env("VLLM_PYTHON", vllm_python)
        .env("VLLM_MODEL", vllm_model)
        .env("LLAMA_PYTHON", llama_python)
        .env("AIPERF", aiperf)
        .env("PROBE_IMAGE", probe_image)
        .env("KUBE_VALIDATE", kube_validate)
        // A failing test's message, not a backtrace of the test harness, is what CI's log keeps.
        .env("RUST_BACKTRACE", "0")
        .args(["test", "--release", "--workspace", "--exclude", "probe-ebpf", "--no-fail-fast"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run cargo test")?;
    let (mut passed, mut failed, mut ignored) = (0u64, 0u64, 0u64);
    // Each failing test's name and the first lines of its panic, repeated after the total.
    let (mut failures, mut in_failure): (Vec<String>, usize) = (Vec::new(), 0);
    for line in BufReader::new(child.stdout.take().context("cargo test stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if line.starts_with("---- ") && line.ends_with(" stdout ----") {
            failures.push(line.clone());
            in_failure = 0;
        } else if line.starts_with("thread '") && line.contains("panicked at") {
            failures.push(line.clone());
            in_failure = 6;
        } else if in_failure > 0 {
            in_failure -= 1;
            failures.push(format!("    {}", line.chars().take(600).collect::<String>()));
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            let count = |what: &str| -> u64 {
                rest.split(';').find_map(|p| p.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse().ok()).unwrap_or(0)
            };
            passed += count("passed");
            failed += count("failed");
            ignored += count("ignored");
        }
    }
    let status = child.wait()?;
    give_back_files();
    if !failures.is_empty() {
        println!("\nfailures:\n{}", failures.join("\n"));
    }
    println!("\ntests: {passed} passed, {failed} failed, {ignored} skipped");
    if !status.success() || failed > 0 {
        bail!("tests failed ({status})");
    }
    if passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}
