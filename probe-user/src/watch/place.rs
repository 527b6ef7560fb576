//! Where a server runs, as labels every metric, incident and span of `probe watch` carries: the
//! node, the container (id from the cgroup path, name from the runtime's state files) and, on
//! Kubernetes, the pod (uid from the cgroup path, name and namespace from the kubelet's
//! /var/log/pods directory names). Read from files only: no runtime daemon or API server is
//! asked. Every value is bounded (one per server), never per request.
use std::path::Path;

/// An incident's labels, as a JSON object of strings.
pub const LABELS_FILE: &str = "labels.json";

/// Label names, in the order they are written (Prometheus label names).
pub const NODE: &str = "node";
pub const CONTAINER_ID: &str = "container_id";
pub const CONTAINER: &str = "container";
pub const POD_UID: &str = "pod_uid";
pub const POD: &str = "pod";
pub const NAMESPACE: &str = "namespace";

/// The labels of process `pid`: `node` always, the others where they are known.
pub fn labels(pid: u32, pod_logs: &Path) -> Vec<(String, String)> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut out = vec![(NODE.to_string(), node())];
    let (container, pod_uid) = parse_cgroups(&cgroups);
    if let Some(id) = container {
        if let Some(name) = crate::os::cgroup::name_of_id(&id) {
            out.push((CONTAINER.into(), name));
        }
        out.push((CONTAINER_ID.into(), id));
    }
    if let Some(uid) = pod_uid {
        if let Some((ns, name)) = pod_of_uid(pod_logs, &uid) {
            out.push((NAMESPACE.into(), ns));
            out.push((POD.into(), name));
        }
        out.push((POD_UID.into(), uid));
    }
    out
}

/// The node's name: `NODE_NAME` (set from the pod's `spec.nodeName` in the DaemonSet), else the
/// host name.
pub fn node() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|n| n.trim().chars().take(253).collect())
        .unwrap_or_else(|| "unknown".into())
}

/// (container id, pod uid) from /proc/PID/cgroup text: the innermost directory naming a container
/// (`docker-ID.scope`, `libpod-ID.scope`, `cri-containerd-ID.scope`, `crio-ID.scope`, a bare
/// 64-hex id) and a `pod<uid>` directory under `kubepods` (cgroupfs: `pod1234-…`; systemd:
/// `kubepods-burstable-pod1234_….slice`, underscores for dashes).
pub fn parse_cgroups(text: &str) -> (Option<String>, Option<String>) {
    let (mut container, mut pod) = (None, None);
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else { continue };
        let dirs: Vec<&str> = path.split('/').filter(|d| !d.is_empty()).collect();
        if container.is_none() {
            container = dirs.iter().rev().find_map(|d| crate::os::cgroup::container_id(d)).map(str::to_string);
        }
        if pod.is_none() && dirs.iter().any(|d| d.starts_with("kubepods")) {
            pod = dirs.iter().find_map(|d| pod_uid(d));
        }
    }
    (container, pod)
}

/// The pod uid a cgroup directory names: `pod<uid>` or `…-pod<uid with _>.slice`.
fn pod_uid(dir: &str) -> Option<String> {
    let d = dir.strip_suffix(".slice").unwrap_or(dir);
    let at = d.rfind("pod")?;
    if at > 0 && !d[..at].ends_with('-') {
        return None;
    }
    let uid = d[at + 3..].replace('_', "-");
    let ok = uid.len() == 36
        && uid.bytes().enumerate().all(|(i, b)| if [8, 13, 18, 23].contains(&i) { b == b'-' } else { b.is_ascii_hexdigit() });
    ok.then_some(uid)
}

/// (namespace, name) of the pod with `uid`: the kubelet keeps each pod's logs in
/// `/var/log/pods/NAMESPACE_NAME_UID/` (names and namespaces have no `_`).
pub fn pod_of_uid(pod_logs: &Path, uid: &str) -> Option<(String, String)> {
    std::fs::read_dir(pod_logs).ok()?.flatten().find_map(|e| {
        let n = e.file_name().to_str()?.to_string();
        let rest = n.strip_suffix(uid)?.strip_suffix('_')?;
        let (ns, name) = rest.split_once('_')?;
        (!ns.is_empty() && !name.is_empty()).then(|| (ns.to_string(), name.to_string()))
    })
}

/// OpenTelemetry's names for the labels (resource attributes of spans and logs).
pub fn otel_name(label: &str) -> &str {
    match label {
        NODE => "k8s.node.name",
        CONTAINER_ID => "container.id",
        CONTAINER => "container.name",
        POD_UID => "k8s.pod.uid",
        POD => "k8s.pod.name",
        NAMESPACE => "k8s.namespace.name",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1d3c2b1a0918273645546372819aabbccddeeff00112233445566778899aab";
    const UID: &str = "0b7c6a3e-1d2f-4e5a-9b8c-7d6e5f4a3b2c";

    #[test]
    fn containers_and_pods_from_cgroup_paths() {
        // cgroupfs driver, v1 and v2.
        let v1 = format!("12:pids:/kubepods/burstable/pod{UID}/{ID}\n0::/\n");
        assert_eq!(parse_cgroups(&v1), (Some(ID.into()), Some(UID.into())));
        // systemd driver, containerd.
        let sd = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{ID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(parse_cgroups(&sd), (Some(ID.into()), Some(UID.into())));
        // Podman, no pod; a plain process.
        assert_eq!(parse_cgroups(&format!("0::/machine.slice/libpod-{ID}.scope/container\n")), (Some(ID.into()), None));
        assert_eq!(parse_cgroups("0::/user.slice/user-1000.slice/session-2.scope\n"), (None, None));
        // "pod" inside another word is not a pod.
        assert_eq!(parse_cgroups(&format!("0::/kubepods/ipod{UID}\n")), (None, None));
    }

    #[test]
    fn pod_names_from_the_kubelets_log_directories() {
        let d = std::env::temp_dir().join(format!("probe-pods-{}", std::process::id()));
        std::fs::create_dir_all(d.join(format!("llm_llama-0_{UID}"))).unwrap();
        std::fs::create_dir_all(d.join("other_x_00000000-0000-0000-0000-000000000000")).unwrap();
        assert_eq!(pod_of_uid(&d, UID), Some(("llm".into(), "llama-0".into())));
        assert_eq!(pod_of_uid(&d, "11111111-0000-0000-0000-000000000000"), None);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
