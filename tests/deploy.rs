//! The node agent's deployment files against the official checkers: the Kubernetes manifests
//! with PyPI `kubernetes-validate` (built-in kinds, strict) and the Prometheus operator's own
//! models (npm `@kubernetes-models/prometheus-operator`), the alerting rules with `promtool`; a
//! broken copy of each must fail (the checkers check). The DaemonSet's arguments start a real
//! `probe watch --all`, and its PodMonitor selects its pods.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

mod common;
use common::{env_path, probe_bin, workload::scratch};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The YAML documents of `file` as JSON, read by PyYAML (kubernetes-validate's own reader).
fn documents(file: &Path) -> Vec<Value> {
    let py = env_path("KUBE_VALIDATE").join("venv/bin/python");
    let out = Command::new(py)
        .args(["-c", "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))"])
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// kubernetes-validate --strict on `file`: (passed, its output).
fn kube_validate(file: &Path) -> (bool, String) {
    let out = Command::new(env_path("KUBE_VALIDATE").join("venv/bin/kubernetes-validate")).arg("--strict").arg(file).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The operator's models on each object: (passed, output).
fn operator_validate(d: &Path, objects: &[Value]) -> (bool, String) {
    let files: Vec<PathBuf> = objects
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let f = d.join(format!("object-{i}.json"));
            std::fs::write(&f, o.to_string()).unwrap();
            f
        })
        .collect();
    let out = Command::new("node")
        .arg(repo().join("tests/data/deploy/validate.mjs"))
        .arg(env_path("KUBE_VALIDATE"))
        .args(&files)
        .output()
        .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_daemonset_passes_the_official_schemas_and_a_broken_one_does_not() {
    let d = scratch("deploy-kube");
    let file = repo().join("deploy/kubernetes/probe.yaml");
    let (ok, said) = kube_validate(&file);
    assert!(ok, "{said}");
    assert!(said.contains("daemonset/probe") && said.contains("namespace/probe"), "{said}");
    // A typo'd field the schema does not have, and a wrong type: both refused.
    let text = std::fs::read_to_string(&file).unwrap();
    for (from, to) in [("hostPID: true", "hostPid: true"), ("containerPort: 9464", "containerPort: \"metrics\"")] {
        assert!(text.contains(from));
        let broken = d.join("broken.yaml");
        std::fs::write(&broken, text.replacen(from, to, 1)).unwrap();
        let (ok, said) = kube_validate(&broken);
        assert!(!ok, "kubernetes-validate took `{to}`: {said}");
    }
    // What the agent needs: the node's processes, privileges, the host mounts, a readiness probe
    // on the metrics port, limits, and the node's name.
    let docs = documents(&file);
    let ds = docs.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], true);
    let mounts: Vec<&str> = c["volumeMounts"].as_array().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
    for m in ["/sys/kernel/btf", "/sys/fs/cgroup", "/sys/kernel/tracing", "/var/log/pods", "/var/lib/probe"] {
        assert!(mounts.contains(&m), "{m} not mounted: {mounts:?}");
    }
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "metrics");
    assert!(c["resources"]["limits"]["memory"].is_string() && c["resources"]["requests"]["cpu"].is_string());
    assert_eq!(c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");
    let args: Vec<String> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
    let addr = args.iter().skip_while(|a| *a != "--metrics-addr").nth(1).unwrap();
    assert_eq!(addr.rsplit(':').next().unwrap(), c["ports"][0]["containerPort"].to_string());
    // The arguments start a real node agent (metrics on a free port here, its state in scratch).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut args = args.clone();
    let i = args.iter().position(|a| a == "--metrics-addr").unwrap();
    args[i + 1] = format!("127.0.0.1:{port}");
    let i = args.iter().position(|a| a == "--dir").unwrap();
    args[i + 1] = d.join("state").display().to_string();
    let mut agent = Command::new(probe_bin()).args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let t = Instant::now();
    let scraped = loop {
        if let Ok((200, body)) = common::http(format!("127.0.0.1:{port}").parse().unwrap(), "GET", "/metrics", None, &[]) {
            break String::from_utf8(body).unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the DaemonSet's args did not start an agent serving metrics");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(scraped.contains("probe_servers{"), "{scraped}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
}

#[test]
fn the_podmonitor_and_the_rules_pass_the_operators_models() {
    let d = scratch("deploy-operator");
    let docs = documents(&repo().join("deploy/kubernetes/probe-podmonitor.yaml"));
    let pm = docs.iter().find(|o| o["kind"] == "PodMonitor").unwrap().clone();
    // It selects the DaemonSet's pods, on the port named in the pod.
    let ds = documents(&repo().join("deploy/kubernetes/probe.yaml")).into_iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the PodMonitor selects {k}={v}, the pods are {labels}");
    }
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"]);
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["honorLabels"], true, "probe's pod/namespace labels are the server's");
    // The alerting rules, as a PrometheusRule, and checked by promtool as a rule file.
    let rules_file = repo().join("deploy/prometheus/probe-rules.yml");
    let out = Command::new("promtool").arg("check").arg("rules").arg(&rules_file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let groups = documents(&rules_file)[0]["groups"].clone();
    let rule = json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "probe", "namespace": "probe"}, "spec": {"groups": groups}});
    let (ok, said) = operator_validate(&d, &[pm.clone(), rule]);
    assert!(ok, "{said}");
    // Broken copies: a wrong type in each.
    let mut bad_pm = pm;
    bad_pm["spec"]["podMetricsEndpoints"][0]["honorLabels"] = json!("yes");
    let bad_rule = json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"}, "spec": {"groups": [{"rules": [{"alert": 1}]}]}});
    for bad in [bad_pm, bad_rule] {
        let (ok, said) = operator_validate(&d, &[bad]);
        assert!(!ok, "the operator's models took a broken object: {said}");
    }
    // Every rule's `for` is at most 30 s (the rules page on verdicts, not on old news).
    for g in groups.as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let f = r["for"].as_str().unwrap_or("0s");
            assert!(["0s", "30s"].contains(&f) || f.ends_with('s') && f.trim_end_matches('s').parse::<u32>().is_ok_and(|s| s <= 30), "{r}");
        }
    }
}
