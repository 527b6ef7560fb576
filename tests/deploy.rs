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
    // Capabilities, not privileged; no service account token; a pinned image; the cheap
    // liveness endpoint; a NetworkPolicy for the metrics port.
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    for cap in ["BPF", "PERFMON", "SYSLOG", "SYS_PTRACE"] {
        assert!(sc["capabilities"]["add"].as_array().unwrap().iter().any(|c| c == cap), "{cap} missing: {sc}");
    }
    assert_eq!(pod["automountServiceAccountToken"], false);
    let image = c["image"].as_str().unwrap();
    assert_eq!(image.rsplit(':').next(), Some(env!("CARGO_PKG_VERSION")), "the image is pinned to the release: {image}");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(c[probe]["httpGet"]["path"], "/healthz", "{probe}");
    }
    let np = docs.iter().find(|o| o["kind"] == "NetworkPolicy").expect("a NetworkPolicy");
    assert_eq!(np["spec"]["podSelector"]["matchLabels"], ds["spec"]["selector"]["matchLabels"]);
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], "metrics");
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

/// Podman (Debian's 4.3) as root here: the runc runtime, and rlimits at or below the current ones
/// (root lacks CAP_SYS_RESOURCE on these machines; ../shared/toolchain.md).
struct Podman {
    conf: PathBuf,
    /// Containers and pods this test made, removed on drop (a failing test leaves none behind).
    made: std::cell::RefCell<Vec<(&'static str, String)>>,
}

impl Podman {
    fn new(d: &Path) -> Podman {
        let conf = d.join("containers.conf");
        std::fs::write(
            &conf,
            "[containers]\ndefault_ulimits = [\"nofile=4096:4096\", \"nproc=4096:4096\"]\n[engine]\nruntime = \"runc\"\n",
        )
        .unwrap();
        Podman { conf, made: Default::default() }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.conf);
        c
    }

    /// `podman ARGS`: its stdout, trimmed; panics with its stderr when it fails.
    fn run(&self, args: &[&str]) -> String {
        let out = self.cmd().args(args).output().expect("podman (Debian package, installed by scripts/setup.sh)");
        assert!(out.status.success(), "podman {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// `podman run -d --name NAME ARGS`, removed on drop: the container's id.
    fn start(&self, name: &str, args: &[&str]) -> String {
        let _ = self.cmd().args(["rm", "-f", "-t", "0", name]).output();
        self.made.borrow_mut().push(("container", name.to_string()));
        let mut all = vec!["run", "-d", "--name", name];
        all.extend_from_slice(args);
        self.run(&all)
    }

    fn inspect(&self, name: &str, format: &str) -> String {
        self.run(&["inspect", "-f", format, name])
    }

    fn logs(&self, name: &str) -> String {
        let out = self.cmd().args(["logs", name]).output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for (kind, name) in self.made.borrow().iter().rev() {
            let args: &[&str] = match *kind {
                "pod" => &["pod", "rm", "-f", "-t", "0"],
                "image" => &["rmi", "-f"],
                _ => &["rm", "-f", "-t", "0"],
            };
            let _ = self.cmd().args(args).arg(name).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

/// The DaemonSet container's capabilities and security options as `podman run` flags.
fn daemonset_security() -> Vec<String> {
    let ds = documents(&repo().join("deploy/kubernetes/probe.yaml")).into_iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let sc = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(sc["privileged"], false, "{sc}");
    let mut out = vec!["--cap-drop=all".to_string()];
    for c in sc["capabilities"]["add"].as_array().unwrap() {
        out.push(format!("--cap-add={}", c.as_str().unwrap()));
    }
    let unconfined = |k: &str| sc[k]["type"] == "Unconfined";
    if unconfined("seccompProfile") {
        out.push("--security-opt=seccomp=unconfined".into());
    }
    if unconfined("appArmorProfile") {
        out.push("--security-opt=apparmor=unconfined".into());
    }
    if sc["allowPrivilegeEscalation"] == false {
        out.push("--security-opt=no-new-privileges".into());
    }
    out
}

/// Wait for `line` in a container's log (`podman logs`): the first line holding it.
fn wait_log(p: &Podman, name: &str, needle: &str, within: Duration) -> String {
    let t = Instant::now();
    loop {
        let logs = p.logs(name);
        if let Some(l) = logs.lines().find(|l| l.contains(needle)) {
            return l.to_string();
        }
        assert!(t.elapsed() < within, "no `{needle}` in {name}'s log after {within:?}:\n{logs}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `GET /metrics` on `addr` once it answers.
fn scrape(addr: std::net::SocketAddr, within: Duration) -> String {
    let t = Instant::now();
    loop {
        if let Ok((200, body)) = common::http(addr, "GET", "/metrics", None, &[]) {
            return String::from_utf8(body).unwrap();
        }
        assert!(t.elapsed() < within, "no metrics on {addr} after {within:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The node agent under a real container runtime. probe's image (`cargo xtask image`: FROM
/// scratch, the binary and its libraries) runs with `--pid=host --privileged`; two llama-servers
/// run in containers of their own (an image built the same way, the model mounted), each on
/// port 8080 of its own network namespace, with other flags. `watch --all` finds both without
/// their pids or ports; a morning request (asleep, model evicted) on one is an incident labelled
/// with that container's name and id and the right verdict; a real Prometheus scrapes the
/// container labels and the slow-first-token alert fires for that container. Then the
/// DaemonSet's pod template, played as a Pod by `podman kube play`, runs the same agent and finds
/// both servers too.
#[test]
fn the_image_under_podman_finds_servers_in_containers_and_labels_them() {
    let d = scratch("deploy-podman");
    let p = Podman::new(&d);
    let image = std::env::var("PROBE_IMAGE").expect("PROBE_IMAGE: the image `cargo xtask image` built (cargo xtask test sets it)");
    let tag = format!("probe-t{}", std::process::id());
    // The servers' image, built the same way as probe's.
    let llama_image = format!("localhost/{tag}-llama:latest");
    let built = Command::new("bash")
        .arg(repo().join("scripts/image.sh"))
        .args([&llama_image, env_path("LLAMA_SERVER").to_str().unwrap(), "/usr/bin/llama-server"])
        .env("CONTAINERS_CONF", &p.conf)
        .output()
        .unwrap();
    assert!(built.status.success(), "scripts/image.sh: {}", String::from_utf8_lossy(&built.stderr));
    p.made.borrow_mut().push(("image", llama_image.clone()));
    // The model: our own copy (the morning request evicts it from the page cache), mounted read-only.
    let model = d.join("model.gguf");
    std::fs::copy(env_path("LLAMA_MODEL"), &model).unwrap();
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    let mount = format!("{}:/models/model.gguf:ro", model.display());
    let (name_a, name_b) = (format!("{tag}-llama-a"), format!("{tag}-llama-b"));
    let serve = ["-m", "/models/model.gguf", "--host", "0.0.0.0", "--port", "8080", "--no-repack"];
    let id_a =
        p.start(&name_a, &[&["-v", &mount, &llama_image][..], &serve, &["-c", "1024", "-np", "1", "--sleep-idle-seconds", "1"]].concat());
    let id_b = p.start(&name_b, &[&["-v", &mount, &llama_image][..], &serve, &["-c", "2048", "-np", "2"]].concat());
    let addr =
        |name: &str| -> std::net::SocketAddr { format!("{}:8080", p.inspect(name, "{{.NetworkSettings.IPAddress}}")).parse().unwrap() };
    let (addr_a, addr_b) = (addr(&name_a), addr(&name_b));
    for a in [addr_a, addr_b] {
        common::wait_healthy(a);
    }
    // The agent: probe's image, the node's processes and the host mounts the DaemonSet has.
    let state = d.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let agent = format!("{tag}-agent");
    let volumes = [
        "/sys/kernel/btf:/sys/kernel/btf:ro".to_string(),
        "/sys/fs/cgroup:/sys/fs/cgroup:ro".to_string(),
        "/var/lib/containers/storage/overlay-containers:/var/lib/containers/storage/overlay-containers:ro".to_string(),
        format!("{}:/var/lib/probe", state.display()),
    ];
    // Exactly the DaemonSet's capabilities and security options, not --privileged.
    let mut args: Vec<String> = ["--pid=host", "--network", "host", "--read-only", "--tmpfs", "/tmp", "-e", "NODE_NAME=node-t"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(daemonset_security());
    for v in &volumes {
        args.extend(["-v".to_string(), v.clone()]);
    }
    args.push(image.clone());
    let metrics = format!("127.0.0.1:{metrics_port}");
    args.extend(
        [
            "watch",
            "--all",
            "--dir",
            "/var/lib/probe",
            "--metrics-addr",
            &metrics,
            "--scan-every",
            "1s",
            "--slow-ttft",
            "150ms",
            "--segment",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    p.start(&agent, &args);
    // Both servers found, by what they answer, each with its container's name and id.
    for (name, id) in [(&name_a, &id_a), (&name_b, &id_b)] {
        let found = wait_log(&p, &agent, &format!("container={name} "), Duration::from_secs(30));
        assert!(found.contains("found a server") && found.contains(&format!("container_id={id}")), "{found}");
        assert!(found.contains("on port 8080") && found.contains("node=node-t"), "{found}");
    }
    // A real Prometheus scraping the agent every second, probe's alerting rules every second.
    let prom = common::prometheus::Prometheus::start(&d, &metrics, Some(&repo().join("deploy/prometheus/probe-rules.yml")));
    let query = |q: &str| prom.query(q);
    let t = Instant::now();
    while query(&format!("probe_target_up{{container=\"{name_a}\"}}")).is_empty()
        || query(&format!("probe_target_up{{container=\"{name_b}\"}}")).is_empty()
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "Prometheus has no series with the containers' labels:\n{}",
            scrape(metrics.parse().unwrap(), Duration::from_secs(1))
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // A warm request on B, then the morning request on A: asleep, its model evicted.
    let complete = |a: std::net::SocketAddr, prompt: &str| {
        let (st, body) = common::http(a, "POST", "/completion", Some(&json!({"prompt": prompt, "n_predict": 4, "seed": 1})), &[]).unwrap();
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    };
    complete(addr_b, "Hello");
    common::sleep_then_evict(addr_a, &model);
    std::thread::sleep(Duration::from_millis(300));
    let cold = Instant::now();
    complete(addr_a, "Good morning");
    let cold_ms = cold.elapsed().as_secs_f64() * 1e3;
    let line = wait_log(&p, &agent, "incident slow_ttft", Duration::from_secs(60));
    assert!(line.contains(&format!("[{name_a}-port8080]")), "the incident is A's: {line}");
    let incidents = state.join("servers").join(format!("{name_a}-port8080")).join("incidents");
    let inc = std::fs::read_dir(&incidents)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|x| x.to_string_lossy().contains("slow_ttft"))
        .unwrap_or_else(|| panic!("no slow_ttft incident in {}", incidents.display()));
    let labels: Value = serde_json::from_slice(&std::fs::read(inc.join("labels.json")).unwrap()).unwrap();
    assert_eq!((labels["container"].as_str(), labels["container_id"].as_str()), (Some(name_a.as_str()), Some(id_a.as_str())), "{labels}");
    assert_eq!(labels["node"], "node-t", "{labels}");
    let r: Value = serde_json::from_slice(&std::fs::read(inc.join("report.json")).unwrap()).unwrap();
    let q = r["requests"].as_array().unwrap().iter().find(|q| q["path"] == "/completion").expect("the request in the incident");
    let slow = q["verdict"]["slow_cause"].as_str().unwrap().to_string();
    assert!(slow == "load" || slow == "disk", "slow cause {slow} (the client saw {cold_ms:.0} ms): {q:#}");
    // The alert fires for that container, with the cause.
    let t = Instant::now();
    let firing = loop {
        let f = query("ALERTS{alertname=\"LLMSlowFirstToken\",alertstate=\"firing\"}");
        if let Some(a) = f.first() {
            break a["metric"].clone();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "LLMSlowFirstToken did not fire");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!((firing["container"].as_str(), firing["slow_cause"].as_str()), (Some(name_a.as_str()), Some(slow.as_str())), "{firing}");
    assert_eq!(firing["node"], "node-t", "{firing}");
    // SIGTERM (podman stop) ends the agent and its followers cleanly.
    p.run(&["stop", "-t", "20", &agent]);
    assert_eq!(p.inspect(&agent, "{{.State.ExitCode}}"), "0", "{}", p.logs(&agent));
    eprintln!("podman: both servers found; the morning request took {cold_ms:.0} ms ({slow}); the alert fired for {name_a}");

    // The DaemonSet's pod template as a Pod (this podman plays Pods, not DaemonSets): the image
    // built here, incidents in scratch, the node's name as the kubelet would set it.
    let ds = documents(&repo().join("deploy/kubernetes/probe.yaml")).into_iter().find(|o| o["kind"] == "DaemonSet").unwrap();
    let mut spec = ds["spec"]["template"]["spec"].clone();
    let c = &mut spec["containers"][0];
    c["image"] = json!(image);
    c["env"] = json!([{"name": "NODE_NAME", "value": "node-k"}]);
    for v in spec["volumes"].as_array_mut().unwrap() {
        if v["name"] == "incidents" {
            v["hostPath"]["path"] = json!(d.join("state-kube").display().to_string());
        }
    }
    let pod_name = format!("{tag}-kube");
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "labels": ds["spec"]["template"]["metadata"]["labels"]}, "spec": spec});
    let file = d.join("pod.json");
    std::fs::write(&file, pod.to_string()).unwrap();
    let _ = p.cmd().args(["pod", "rm", "-f", "-t", "0", &pod_name]).output();
    p.made.borrow_mut().push(("pod", pod_name.clone()));
    p.run(&["kube", "play", file.to_str().unwrap()]);
    // podman before 4.5 drops `hostPID` when it plays a pod (containers/podman#17157): the
    // agent then sees only its pod's processes, under pids the kernel does not use, and must say
    // so and stop rather than run blind. With the host's pids it finds both servers.
    let agent_k = format!("{pod_name}-probe");
    if p.inspect(&agent_k, "{{.HostConfig.PidMode}}") != "host" {
        // (The pod's restart policy starts it again: each start says the same and stops.)
        let said = wait_log(&p, &agent_k, "a PID namespace of its own", Duration::from_secs(20));
        assert!(said.contains("hostPID: true") && said.contains("--pid=host"), "{said}");
        assert!(!p.logs(&agent_k).contains("looking for LLM servers"), "the agent ran blind:\n{}", p.logs(&agent_k));
        eprintln!("podman kube play: this podman drops hostPID; the agent said so and stopped: {}", said.trim());
        return;
    }
    let infra = p.run(&["pod", "inspect", "-f", "{{.InfraContainerID}}", &pod_name]);
    let ip = p.inspect(&infra, "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}");
    let ip = ip.split_whitespace().next().unwrap_or_else(|| panic!("the played pod has no address: {ip}"));
    let kube_metrics: std::net::SocketAddr = format!("{ip}:9464").parse().unwrap();
    let t = Instant::now();
    let m = loop {
        let m = scrape(kube_metrics, Duration::from_secs(30));
        if common::prometheus_sum(&m, "probe_servers") >= 2.0 {
            break m;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the played pod did not find both servers:\n{m}\n{}",
            p.logs(&format!("{pod_name}-probe"))
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    for name in [&name_a, &name_b] {
        assert!(m.contains(&format!("container=\"{name}\"")), "{name} is not labelled in the pod's metrics:\n{m}");
    }
    assert!(m.contains("node=\"node-k\""), "{m}");
    eprintln!("podman kube play: the DaemonSet's pod found both servers");
}
