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

/// Full container ids by name, from Docker's and Podman's state (read as files, no daemon asked).
fn ids_by_name(name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let want = name.trim_start_matches('/');
    for e in std::fs::read_dir("/var/lib/docker/containers").into_iter().flatten().flatten() {
        let Ok(t) = crate::util::output::read_recording_text(&e.path().join("config.v2.json"), 4 << 20) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&t) else { continue };
        if v["Name"].as_str().map(|n| n.trim_start_matches('/')) == Some(want)
            && let Some(id) = v["ID"].as_str()
        {
            out.push(id.to_string());
        }
    }
    for f in
        ["/var/lib/containers/storage/overlay-containers/containers.json", "/run/containers/storage/overlay-containers/containers.json"]
    {
        let Ok(t) = crate::util::output::read_recording_text(Path::new(f), 64 << 20) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&t) else { continue };
        for c in v.as_array().into_iter().flatten() {
            if c["names"].as_array().is_some_and(|n| n.iter().any(|n| n == want))
                && let Some(id) = c["id"].as_str()
            {
                out.push(id.to_string());
            }
        }
    }
    out
}

/// A container's name by its full id, from Docker's and Podman's state (as [`ids_by_name`]).
pub fn name_of_id(id: &str) -> Option<String> {
    let docker = Path::new("/var/lib/docker/containers").join(id).join("config.v2.json");
    if let Ok(t) = crate::util::output::read_recording_text(&docker, 4 << 20)
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&t)
        && let Some(n) = v["Name"].as_str()
    {
        return Some(n.trim_start_matches('/').to_string());
    }
    for f in
        ["/var/lib/containers/storage/overlay-containers/containers.json", "/run/containers/storage/overlay-containers/containers.json"]
    {
        let Ok(t) = crate::util::output::read_recording_text(Path::new(f), 64 << 20) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&t) else { continue };
        if let Some(n) = v.as_array().into_iter().flatten().find(|c| c["id"] == id).and_then(|c| c["names"][0].as_str()) {
            return Some(n.to_string());
        }
    }
    None
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
}
