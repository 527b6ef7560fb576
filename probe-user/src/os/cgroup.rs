//! Targets named the way container users name them: a cgroup (`--cgroup`, v2, under
//! /sys/fs/cgroup) or a container (`--container ID|NAME`: Docker, Podman, containerd and CRI-O
//! put each container in a cgroup whose directory carries its id; names are looked up in
//! Docker's and Podman's own state files). Every process in the cgroup is traced, followed as
//! processes join it and leave it.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

pub const ROOT: &str = "/sys/fs/cgroup";

/// `--cgroup PATH`: relative to /sys/fs/cgroup, or absolute inside it.
pub fn resolve(spec: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(spec);
    let path = if p.is_absolute() { p.to_path_buf() } else { Path::new(ROOT).join(spec.trim_start_matches('/')) };
    let canon = path.canonicalize().with_context(|| format!("no cgroup {} (see /proc/PID/cgroup for a process's)", path.display()))?;
    if !canon.starts_with(ROOT) || !canon.join("cgroup.procs").exists() {
        bail!("{} is not a cgroup v2 directory under {ROOT}", canon.display());
    }
    Ok(canon)
}

/// Every pid in the cgroup and its descendant cgroups.
/// The cgroup (v2) a process is in, as /proc/PID/cgroup names it ("/user.slice/...").
pub fn of_pid(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::")).map(|p| p.trim().to_string())
}

pub fn procs(cg: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let mut stack = vec![cg.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()).filter(|&p| p != 0));
        }
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The process that stands for the cgroup in reports: the topmost one listening on a TCP port
/// (the server), else the topmost one (the container's first process).
pub fn main_pid(pids: &[u32]) -> Option<u32> {
    let listening: Vec<u32> = pids.iter().copied().filter(|&p| !crate::os::procfs::listen_ports(p).is_empty()).collect();
    crate::os::procfs::topmost(&listening).or_else(|| crate::os::procfs::topmost(pids))
}

/// The id a container's cgroup directory names, if it names one: `docker-ID.scope`,
/// `libpod-ID.scope`, `cri-containerd-ID.scope`, `crio-ID.scope`, or a bare 64-hex `ID`
/// (cgroupfs drivers: /docker/ID).
pub(crate) fn container_id(dir_name: &str) -> Option<&str> {
    // systemd: `libpod-ID.scope`; cgroupfs: `libpod-ID` (podman's `libpod_parent/libpod-ID`) or
    // the bare id (Docker's `/docker/ID`, the kubelet's `pod<uid>/ID`).
    let s = dir_name.strip_suffix(".scope").unwrap_or(dir_name);
    let id = ["docker-", "libpod-", "cri-containerd-", "crio-"].iter().find_map(|p| s.strip_prefix(p)).unwrap_or(s);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// Docker's `config.v2.json` of one container: the fields probe reads.
#[derive(serde::Deserialize)]
struct DockerConfig {
    #[serde(rename = "ID")]
    id: String,
    #[serde(rename = "Name", default)]
    name: String,
}

/// One container of Podman's `containers.json`: the fields probe reads.
#[derive(serde::Deserialize)]
struct PodmanContainer {
    #[serde(default)]
    id: String,
    #[serde(default)]
    names: Vec<String>,
}

const DOCKER_STATE: &str = "/var/lib/docker/containers";
const PODMAN_STATE: [&str; 2] =
    ["/var/lib/containers/storage/overlay-containers/containers.json", "/run/containers/storage/overlay-containers/containers.json"];

/// A Docker container's config (read as a file, capped; None when absent or not Docker's shape).
fn docker(dir: &Path) -> Option<DockerConfig> {
    let t = crate::util::output::read_recording_text(&dir.join("config.v2.json"), 4 << 20).ok()?;
    serde_json::from_str(&t).ok()
}

/// Podman's containers, from each of its state files that can be read.
fn podman() -> impl Iterator<Item = PodmanContainer> {
    PODMAN_STATE.iter().flat_map(|f| {
        let t = crate::util::output::read_recording_text(Path::new(f), 64 << 20).ok();
        t.and_then(|t| serde_json::from_str::<Vec<PodmanContainer>>(&t).ok()).unwrap_or_default()
    })
}

/// Full container ids by name, from Docker's and Podman's state (read as files, no daemon asked).
fn ids_by_name(name: &str) -> Vec<String> {
    let want = name.trim_start_matches('/');
    let docker = std::fs::read_dir(DOCKER_STATE).into_iter().flatten().flatten().filter_map(|e| docker(&e.path()));
    let mut out: Vec<String> = docker.filter(|c| c.name.trim_start_matches('/') == want).map(|c| c.id).collect();
    out.extend(podman().filter(|c| !c.id.is_empty() && c.names.iter().any(|n| n == want)).map(|c| c.id));
    out
}

/// A container's name by its full id, from Docker's and Podman's state (as [`ids_by_name`]).
pub fn name_of_id(id: &str) -> Option<String> {
    if let Some(c) = docker(&Path::new(DOCKER_STATE).join(id))
        && !c.name.is_empty()
    {
        return Some(c.name.trim_start_matches('/').to_string());
    }
    podman().find(|c| c.id == id).and_then(|c| c.names.into_iter().next())
}

/// Container cgroup directories under `root` (at most 8 levels down): (id, path).
fn container_cgroups(root: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(id) = container_id(&name) {
                out.push((id.to_string(), e.path()));
            } else if depth < 8 {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    out
}

/// `--container ID|NAME`: the cgroup of the container with that id (or unique id prefix of at
/// least 4 characters) or name.
pub fn find_container(spec: &str) -> anyhow::Result<PathBuf> {
    find_container_in(Path::new(ROOT), spec)
}

pub fn find_container_in(root: &Path, spec: &str) -> anyhow::Result<PathBuf> {
    let all = container_cgroups(root);
    let mut ids = ids_by_name(spec);
    if ids.is_empty() {
        if spec.len() < 4 || !spec.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("no container named {spec} (give its name, or at least 4 characters of its id)");
        }
        ids = all.iter().filter(|(id, _)| id.starts_with(&spec.to_ascii_lowercase())).map(|(id, _)| id.clone()).collect();
        ids.sort();
        ids.dedup();
    }
    match ids.as_slice() {
        [] => bail!("no running container {spec}: no cgroup under {} names it", root.display()),
        [id] => {
            let mut paths: Vec<&PathBuf> = all.iter().filter(|(i, _)| i == id).map(|(_, p)| p).collect();
            paths.sort_by_key(|p| p.components().count());
            paths.first().map(|p| p.to_path_buf()).with_context(|| format!("container {spec} ({id}) is not running: it has no cgroup"))
        }
        many => bail!(
            "{spec} names {} containers ({}): give more of the id",
            many.len(),
            many.iter().map(|i| &i[..12]).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_from_cgroup_names() {
        let id = "a".repeat(64);
        assert_eq!(container_id(&format!("docker-{id}.scope")), Some(id.as_str()));
        assert_eq!(container_id(&format!("libpod-{id}.scope")), Some(id.as_str()));
        assert_eq!(container_id(&format!("libpod-{id}")), Some(id.as_str()), "podman on cgroupfs");
        assert_eq!(container_id(&format!("cri-containerd-{id}.scope")), Some(id.as_str()));
        assert_eq!(container_id(&id), Some(id.as_str()));
        assert_eq!(container_id(&format!("libpod-conmon-{id}.scope")), None);
        assert_eq!(container_id("system.slice"), None);
        assert_eq!(container_id("user-1000.slice"), None);
    }

    #[test]
    fn docker_and_podman_state_read_for_ids_and_names() {
        let dir = std::env::temp_dir().join(format!("probe-docker-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let id = "b".repeat(64);
        let config = format!(r#"{{"State":{{"Running":true}},"ID":"{id}","Name":"/llama","Config":{{"Env":["A=1"]}}}}"#);
        std::fs::write(dir.join("config.v2.json"), config).unwrap();
        let c = docker(&dir).unwrap();
        assert_eq!((c.id.as_str(), c.name.as_str()), (id.as_str(), "/llama"));
        std::fs::write(dir.join("config.v2.json"), r#"{"Name":"/no-id"}"#).unwrap();
        assert!(docker(&dir).is_none(), "a config without an id is not a container's");
        std::fs::remove_dir_all(&dir).unwrap();
        let podman: Vec<PodmanContainer> =
            serde_json::from_str(r#"[{"id":"c1","names":["ollama"],"image":"x"},{"names":["no id"]},{"id":"c3"}]"#).unwrap();
        let got: Vec<(&str, Vec<&str>)> = podman.iter().map(|c| (c.id.as_str(), c.names.iter().map(String::as_str).collect())).collect();
        assert_eq!(got, [("c1", vec!["ollama"]), ("", vec!["no id"]), ("c3", vec![])]);
    }
}
