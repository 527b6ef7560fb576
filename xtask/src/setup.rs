//! The machine and the builds: the repository root, running commands, setup, the release
//! build and its packages (.deb, OCI image), root through sudo, and the setup scripts that
//! install the workloads (llama-server, vLLM, llama-cpp-python, AIPerf, the manifest checkers).
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

pub(crate) fn root() -> PathBuf {
    let xtask = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().map(PathBuf::from).unwrap_or(xtask)
}

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

pub(crate) fn setup() -> anyhow::Result<()> {
    run(Command::new("bash").arg(root().join("scripts/setup.sh")))
}

pub(crate) fn build() -> anyhow::Result<()> {
    setup()?;
    run(Command::new("cargo").current_dir(root()).args(["build", "--release", "-p", "probe-user", "-p", "probe-tests"]))
}

/// Build the .deb (scripts/deb.sh: cargo-deb, cached) from the built probe; its path.
pub(crate) fn deb() -> anyhow::Result<PathBuf> {
    let out =
        Command::new("bash").arg(root().join("scripts/deb.sh")).stderr(Stdio::inherit()).output().context("cannot run scripts/deb.sh")?;
    if !out.status.success() {
        bail!("scripts/deb.sh failed: {}", out.status);
    }
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(root().join(path))
}

pub(crate) fn bin(name: &str) -> PathBuf {
    root().join("target/release").join(name)
}

pub(crate) fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

pub(crate) fn require_root() -> anyhow::Result<()> {
    if !is_root() {
        bail!("this needs root: it loads BPF programs (run it with sudo)");
    }
    Ok(())
}

/// Whether what loads BPF programs goes through sudo. The README's commands run as a normal
/// user: cargo lives in the user's ~/.cargo/bin (outside sudo's PATH), and building as root
/// would leave root-owned files in target/ and ~/.cache/probe. So xtask builds as the user and
/// elevates only the processes that need root (probe, the test binaries). PROBE_SUDO=1 takes
/// that path as root too.
pub(crate) fn via_sudo() -> bool {
    !is_root() || std::env::var("PROBE_SUDO").is_ok_and(|v| v == "1")
}

/// Ask for the password once, up front (sudo remembers it for the run), when [`via_sudo`].
pub(crate) fn sudo_ready() -> anyhow::Result<()> {
    if !via_sudo() {
        return Ok(());
    }
    let found = Command::new("sudo").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !found {
        bail!("this loads BPF programs: run it as root, or install sudo (xtask builds as you and runs only probe and the tests as root)");
    }
    run(Command::new("sudo").arg("-v")).context("sudo refused")
}

/// `program` as root: itself when xtask is root, else `sudo -E program` (the environment kept:
/// the tests' paths and PROBE_* settings).
pub(crate) fn elevated(program: impl AsRef<std::ffi::OsStr>) -> Command {
    if via_sudo() {
        let mut c = Command::new("sudo");
        c.arg("-E").arg("--").arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// After a run through sudo: what root made in target/ and in the cache (recordings, test
/// scratch, vLLM's caches) goes back to the user.
pub(crate) fn give_back_files() {
    if !via_sudo() || is_root() {
        return;
    }
    let id = |flag: &str| {
        Command::new("id").arg(flag).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
    };
    let owner = format!("{}:{}", id("-u"), id("-g"));
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let mut cmd = Command::new("sudo");
    cmd.args(["find"])
        .arg(root().join("target"))
        .arg(home.join(".cache"))
        .args(["-xdev", "-user", "0", "-exec", "chown", "-h", &owner, "{}", "+"]);
    let _ = cmd.stderr(Stdio::null()).status();
}

/// The host's target triple (cargo's runner variable is named after it).
pub(crate) fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc").arg("-vV").output().context("cannot run rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .context("rustc -vV printed no host")
}

/// Run a setup script that prints `KEY=value` lines; returns the values of `keys`.
pub(crate) fn script_vars(script: &str, env: &[(&str, &str)], keys: &[&str]) -> anyhow::Result<Vec<String>> {
    script_vars_args(script, &[], env, keys)
}

/// The same, with arguments.
pub(crate) fn script_vars_args(script: &str, args: &[&str], env: &[(&str, &str)], keys: &[&str]) -> anyhow::Result<Vec<String>> {
    let out = Command::new("bash").arg(root().join(script)).args(args).envs(env.iter().copied()).stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("{script} failed (see above)");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    keys.iter()
        .map(|k| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .map(String::from)
                .with_context(|| format!("{script} printed no {k}"))
        })
        .collect()
}

/// Build (or find cached) llama-server and the SmolLM2 model: (server, model) paths.
pub(crate) fn llama() -> anyhow::Result<(String, String)> {
    let v = script_vars("scripts/llama.sh", &[], &["LLAMA_SERVER", "LLAMA_MODEL"])?;
    Ok((v[0].clone(), v[1].clone()))
}

/// Install (or find cached) the CPU vLLM and the model converted for it: (python, model folder).
pub(crate) fn vllm(gguf: &str) -> anyhow::Result<(String, String)> {
    let v = script_vars("scripts/vllm.sh", &[("LLAMA_MODEL", gguf)], &["VLLM_PYTHON", "VLLM_MODEL"])?;
    Ok((v[0].clone(), v[1].clone()))
}

/// Install (or find cached) llama-cpp-python's server, built here: its venv's python.
pub(crate) fn llama_python() -> anyhow::Result<String> {
    let v = script_vars("scripts/llama-python.sh", &[], &["LLAMA_PYTHON"])?;
    Ok(v[0].clone())
}

/// The official schema checkers for deploy/kubernetes/ (PyPI kubernetes-validate, npm
/// @kubernetes-models/prometheus-operator): their folder.
pub(crate) fn manifests() -> anyhow::Result<String> {
    let v = script_vars("scripts/manifests.sh", &[], &["KUBE_VALIDATE"])?;
    Ok(v[0].clone())
}

/// probe's OCI image (scripts/image.sh), built from the release binary: its tag.
/// `as_root`: in root's image store (the container tests run as root), through sudo when xtask
/// is not root.
pub(crate) fn image(engine: Option<&str>, save: Option<&Path>, as_root: bool) -> anyhow::Result<String> {
    let version = Command::new(bin("probe")).arg("--version").output().context("cannot run the built probe")?;
    let version = String::from_utf8_lossy(&version.stdout).split_whitespace().nth(1).unwrap_or("dev").to_string();
    let tag = format!("localhost/probe:{version}");
    let probe = bin("probe");
    let env: Vec<(&str, &str)> = engine.map(|e| vec![("ENGINE", e)]).unwrap_or_default();
    let args = [tag.as_str(), probe.to_str().context("a non-UTF-8 target path")?, "/usr/bin/probe"];
    let v = if as_root && via_sudo() {
        let mut all = vec!["bash".to_string(), root().join("scripts/image.sh").display().to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let out = elevated("env").args(env.iter().map(|(k, v)| format!("{k}={v}"))).args(&all).stderr(Stdio::inherit()).output()?;
        if !out.status.success() {
            bail!("scripts/image.sh failed (see above)");
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        vec![text.lines().find_map(|l| l.strip_prefix("IMAGE=")).context("scripts/image.sh printed no IMAGE")?.to_string()]
    } else {
        script_vars_args("scripts/image.sh", &args, &env, &["IMAGE"])?
    };
    let engine = engine.map(str::to_string).unwrap_or_else(|| {
        if Command::new("podman").arg("--version").output().is_ok_and(|o| o.status.success()) { "podman".into() } else { "docker".into() }
    });
    let mut tag_latest = if as_root { elevated(&engine) } else { Command::new(&engine) };
    run(tag_latest.args(["tag", &tag, "localhost/probe:latest"]))?;
    if let Some(file) = save {
        let _ = std::fs::remove_file(file);
        let mut c = if as_root { elevated(&engine) } else { Command::new(&engine) };
        c.arg("save").arg("-o").arg(file);
        if engine == "podman" {
            c.args(["--format", "oci-archive"]);
        }
        run(c.arg(&tag))?;
        println!("image: saved {tag} to {}", file.display());
    }
    Ok(v[0].clone())
}

/// AIPerf (PyPI) for the side-by-side bench test.
pub(crate) fn aiperf() -> anyhow::Result<String> {
    let v = script_vars("scripts/aiperf.sh", &[], &["AIPERF"])?;
    Ok(v[0].clone())
}
