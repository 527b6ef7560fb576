//! Safe to run as root, safe to attach to a public issue: outputs are never written through a
//! link or into another user's directory, they are private and belong to the sudo caller, a
//! server's API key reaches no artifact, and text from the target is printed escaped. The real
//! probe binary, as root, against real processes (a real llama-server for the key).
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    os::unix::fs::{MetadataExt, PermissionsExt, symlink},
    path::Path,
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

use serde_json::Value;

mod common;
use common::{
    probe_bin, start_trace,
    workload::{Workload, scratch},
};

fn probe(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(probe_bin()).args(args).envs(env.iter().copied()).stdin(Stdio::null()).output().expect("run probe")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A process to trace that lives until killed.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Sleeper {
        Sleeper(Command::new("sleep").arg("120").spawn().expect("spawn sleep"))
    }
    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A short real trace of `pid` into `out`.
fn record(pid: &str, out: &Path, env: &[(&str, &str)]) {
    let o = probe(&["trace", "--pid", pid, "--out", out.to_str().unwrap(), "--duration", "1s", "--sample-hz", "0", "--no-poll"], env);
    assert!(o.status.code().is_some_and(|c| c <= 1), "probe trace failed: {}", text(&o.stderr));
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn planted_links_and_foreign_directories_are_refused() {
    let d = scratch("links");
    let target = Sleeper::start();
    let refused = |args: &[&str], why: &str| {
        let o = probe(args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?} should be refused: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains(why), "{args:?}: {}", text(&o.stderr));
    };
    // --out a link to someone's directory: nothing is written there.
    let victim_dir = d.join("victim-dir");
    std::fs::create_dir(&victim_dir).unwrap();
    std::fs::write(victim_dir.join("keep"), b"keep").unwrap();
    symlink(&victim_dir, d.join("rec-link")).unwrap();
    refused(&["trace", "--pid", &target.pid(), "--out", d.join("rec-link").to_str().unwrap(), "--duration", "1s"], "symbolic link");
    assert_eq!(names(&victim_dir), ["keep"]);
    // --out an (empty) directory that belongs to another user.
    let foreign = d.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    refused(&["trace", "--pid", &target.pid(), "--out", foreign.to_str().unwrap(), "--duration", "1s"], "belongs to uid 65534");
    assert!(names(&foreign).is_empty());
    // A directory of other files is not a recording: refused even with --force.
    refused(&["trace", "--pid", &target.pid(), "--out", victim_dir.to_str().unwrap(), "--force"], "not a probe recording");
    assert_eq!(names(&victim_dir), ["keep"]);

    let rec = d.join("rec");
    record(&target.pid(), &rec, &[]);
    // A second trace into it needs --force.
    refused(&["trace", "--pid", &target.pid(), "--out", rec.to_str().unwrap(), "--duration", "1s"], "--force");

    // bundle -o: never through a link (even with --force), never over a file without --force.
    let victim = d.join("victim-file");
    std::fs::write(&victim, b"root's file").unwrap();
    let link = d.join("b.tar.gz");
    symlink(&victim, &link).unwrap();
    for force in [&[][..], &["--force"][..]] {
        let mut args = vec!["bundle", rec.to_str().unwrap(), "-o", link.to_str().unwrap()];
        args.extend_from_slice(force);
        refused(&args, "symbolic link");
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"root's file");
    let plain = d.join("plain.tar.gz");
    std::fs::write(&plain, b"mine").unwrap();
    refused(&["bundle", rec.to_str().unwrap(), "-o", plain.to_str().unwrap()], "--force");
    assert_eq!(std::fs::read(&plain).unwrap(), b"mine");
    let o = probe(&["bundle", rec.to_str().unwrap(), "-o", plain.to_str().unwrap(), "--force"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_ne!(std::fs::read(&plain).unwrap(), b"mine");

    // A link planted inside a recording is replaced, not followed, when outputs are written
    // again; and it is not read as the recording's own file.
    std::fs::remove_file(rec.join("timeline.json")).ok();
    symlink(&victim, rec.join("timeline.json")).unwrap();
    let o = probe(&["timeline", rec.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(std::fs::read(&victim).unwrap(), b"root's file");
    assert!(std::fs::symlink_metadata(rec.join("timeline.json")).unwrap().is_file());
    std::fs::rename(rec.join("events.bin"), d.join("events.bin")).unwrap();
    symlink(d.join("events.bin"), rec.join("events.bin")).unwrap();
    refused(&["report", rec.to_str().unwrap()], "symbolic link");
}

#[test]
fn recording_files_are_private_and_belong_to_the_sudo_caller() {
    let d = scratch("owner");
    let target = Sleeper::start();
    let sudo = [("SUDO_UID", "4321"), ("SUDO_GID", "4322")];
    let rec = d.join("rec");
    record(&target.pid(), &rec, &sudo);
    let o = probe(&["report", rec.to_str().unwrap(), "--html"], &sudo);
    assert!(o.status.code().is_some_and(|c| c <= 1), "{}", text(&o.stderr));
    let bundle = d.join("b.tar.gz");
    let o = probe(&["bundle", rec.to_str().unwrap(), "-o", bundle.to_str().unwrap()], &sudo);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));

    let m = std::fs::metadata(&rec).unwrap();
    assert_eq!((m.permissions().mode() & 0o7777, m.uid(), m.gid()), (0o700, 4321, 4322), "the recording directory");
    let files = names(&rec);
    assert!(files.iter().any(|n| n == "events.bin") && files.iter().any(|n| n == "report.html"), "{files:?}");
    for name in files.iter().map(|n| rec.join(n)).chain([bundle]) {
        let m = std::fs::symlink_metadata(&name).unwrap();
        assert!(m.is_file(), "{}", name.display());
        assert_eq!((m.permissions().mode() & 0o7777, m.uid(), m.gid()), (0o600, 4321, 4322), "{}", name.display());
    }
}

/// A streamed chat request with `headers`, read to its end.
fn chat(addr: SocketAddr, path: &str, headers: &str) -> String {
    let body = r#"{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":8,"stream":true,"seed":1}"#;
    // A server just told to start may not listen yet: connect again for up to 10 s.
    let t = std::time::Instant::now();
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if t.elapsed() < Duration::from_secs(10) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("cannot connect to {addr}: {e}"),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn an_api_key_reaches_no_artifact() {
    let d = scratch("apikey");
    let key = format!(
        "sk-probe-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |e| e.subsec_nanos())
    );
    let (mut server, addr) = common::shared_llama_server(&["--api-key", &key, "-c", "512", "-np", "1"]);
    let ids = cgroup_ids(server.id());
    let rec = d.join("rec");
    // --capture-text: even the kept request bytes must not keep the key.
    let (mut trace, _stderr, _) =
        start_trace(&["--pid", &server.id().to_string(), "--out", rec.to_str().unwrap(), "--capture-text", "--duration", "60s"]);
    let answer = chat(addr, &format!("/v1/chat/completions?api_key={key}"), &format!("Authorization: Bearer {key}\r\n"));
    assert!(answer.starts_with("HTTP/1.1 200"), "the server refused the request: {answer}");
    // The header split over two and three sends, with pauses: the server reads each part apart.
    for cuts in [vec![22usize], vec![9, 23]] {
        let answer = chat_in_parts(addr, &key, &cuts);
        assert!(answer.starts_with("HTTP/1.1 200"), "the server refused the split request: {answer}");
    }
    let refused = chat(addr, "/v1/chat/completions", "");
    assert!(refused.starts_with("HTTP/1.1 401"), "a request without the key should be refused: {refused}");
    // SAFETY: kill(2) on the trace's own pid.
    unsafe { libc::kill(trace.id() as i32, libc::SIGINT) };
    assert!(trace.wait().unwrap().code().is_some_and(|c| c <= 1));
    let _ = server.kill();

    let report: Value = serde_json::from_slice(&std::fs::read(rec.join("report.json")).unwrap()).unwrap();
    let statuses: Vec<&Value> = report["requests"].as_array().unwrap().iter().map(|q| &q["status"]).collect();
    assert!(statuses.contains(&&Value::from(200)) && statuses.contains(&&Value::from(401)), "both requests seen: {statuses:?}");
    assert!(report["target"]["cmdline"].as_str().unwrap().contains("--api-key [redacted]"), "{}", report["target"]["cmdline"]);

    let unpacked = d.join("unpacked");
    std::fs::create_dir(&unpacked).unwrap();
    for (name, mask) in [("b.tar.gz", false), ("masked.tar.gz", true)] {
        let out = d.join(name);
        let mut args = vec!["bundle", rec.to_str().unwrap(), "-o", out.to_str().unwrap()];
        if mask {
            args.push("--mask");
        }
        let o = probe(&args, &[]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        let st = Command::new("tar").arg("xzf").arg(&out).arg("-C").arg(&unpacked).status().unwrap();
        assert!(st.success());
    }
    let files: Vec<(String, Vec<u8>)> = common::all_files(&rec).into_iter().chain(common::all_files(&unpacked)).collect();
    assert!(files.len() > 10, "{:?}", files.iter().map(|f| &f.0).collect::<Vec<_>>());
    for (path, bytes) in &files {
        assert!(!bytes.windows(key.len()).any(|w| w == key.as_bytes()), "the API key is in {path}");
    }
    // The bundle holds no raw kernel address either.
    for (path, bytes) in common::all_files(&unpacked) {
        assert!(!kernel_address_in(&bytes), "a raw kernel address in {path}");
    }
    // The masked one holds none of what --mask hides, in any of its files: the server's address,
    // this machine's name, the model's directory, and the ids in the server's cgroup paths.
    let mut hidden = vec!["127.0.0.1".to_string(), common::env_path("LLAMA_MODEL").parent().unwrap().display().to_string()];
    hidden.extend(std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()).filter(|h| h.len() > 2));
    hidden.extend(ids);
    let masked: Vec<(String, Vec<u8>)> = common::all_files(&unpacked).into_iter().filter(|(p, _)| p.contains("/masked/")).collect();
    assert!(masked.iter().any(|(p, _)| p.ends_with("environment.txt")) && masked.iter().any(|(p, _)| p.ends_with("report.md")));
    for (path, bytes) in &masked {
        for h in &hidden {
            assert!(!bytes.windows(h.len()).any(|w| w == h.as_bytes()), "--mask left {h} in {path}");
        }
    }
}

/// The long hexadecimal ids (container, cgroup scope) in a process's cgroup paths.
fn cgroup_ids(pid: u32) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut ids: Vec<String> = text
        .split(|c: char| !c.is_ascii_hexdigit())
        .filter(|w| w.len() >= 12 && w.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)))
        .map(String::from)
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// A chat request whose `Authorization: Bearer KEY` line is sent in parts, cut at `cuts` (offsets
/// into that line), 150 ms apart (TCP_NODELAY: each part is its own segment and read).
fn chat_in_parts(addr: SocketAddr, key: &str, cuts: &[usize]) -> String {
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2}"#;
    let line = format!("Authorization: Bearer {key}\r\n");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n").unwrap();
    let mut from = 0;
    for &cut in cuts.iter().chain([&line.len()]) {
        std::thread::sleep(Duration::from_millis(150));
        s.write_all(&line.as_bytes()[from..cut]).unwrap();
        from = cut;
    }
    std::thread::sleep(Duration::from_millis(150));
    write!(s, "Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `0xffff` followed by 12 hex digits (a kernel address as text).
fn kernel_address_in(b: &[u8]) -> bool {
    b.windows(18).any(|w| w.starts_with(b"0xffff") && w[6..].iter().all(|c| c.is_ascii_hexdigit()))
}

#[test]
fn escape_sequences_from_the_target_are_printed_escaped() {
    let d = scratch("escapes");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut w = Workload::start(&["sse-server", &port.to_string()]);
    let rec = d.join("rec");
    let (mut trace, stderr, armed) = start_trace(&["--pid", &w.pid.to_string(), "--out", rec.to_str().unwrap(), "--duration", "30s"]);
    writeln!(w.stdin.take().unwrap(), "go").unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut answer = String::new();
    for _ in 0..50 {
        answer = chat(addr, "/v1/chat/completions", "");
        if !answer.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(answer.contains("\\u001b"), "the server sent its escapes: {answer}");
    w.wait_line("done");
    assert!(w.child.wait().unwrap().success());
    let status = trace.wait().unwrap();
    let mut stdout = String::new();
    trace.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    let log: Vec<String> = stderr.iter().collect();
    assert!(status.code().is_some_and(|c| c <= 1), "{log:?}");
    let printed = format!("{armed}\n{}\n{stdout}", log.join("\n"));
    for c in ['\x1b', '\x07', '\u{9b}'] {
        assert!(!printed.contains(c), "a raw {c:?} reached the terminal: {printed:?}");
    }
    assert!(armed.contains("sse\\x1b]0;pwn\\x07"), "the process name is shown escaped: {armed}");
    assert!(stdout.contains("stop\\x1b]0;owned\\x07\\x1b[2J"), "the server's finish_reason is shown escaped: {stdout}");

    let bundle = d.join("b.tar.gz");
    let o = probe(&["bundle", rec.to_str().unwrap(), "-o", bundle.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let unpacked = d.join("unpacked");
    std::fs::create_dir(&unpacked).unwrap();
    assert!(Command::new("tar").arg("xzf").arg(&bundle).arg("-C").arg(&unpacked).status().unwrap().success());
    let (_, md) = common::all_files(&unpacked).into_iter().find(|(p, _)| p.ends_with("report.md")).expect("report.md");
    let md = text(&md);
    assert!(!md.contains('\x1b') && !md.contains('\x07'), "{md:?}");
    assert!(md.contains("sse\\x1b]0;pwn\\x07"), "{md}");
}

/// The README's recipe for running without full root: user `nobody` with exactly the listed
/// capabilities traces a process and writes a private recording of its own.
#[test]
fn runs_as_a_user_with_the_documented_capabilities() {
    use std::os::unix::fs::PermissionsExt as _;
    let d = scratch("caps");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let target = Sleeper::start();
    let caps = "+bpf,+perfmon,+dac_read_search,+sys_ptrace,+syslog,+checkpoint_restore";
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let documented = caps.replace('+', "cap_");
    assert!(readme.contains(&documented), "README's setcap line lists {documented}");
    let rec = d.join("rec");
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", &format!("--inh-caps={caps}"), &format!("--ambient-caps={caps}")])
        .arg(probe_bin())
        .args(["trace", "--pid", &target.pid(), "--out", rec.to_str().unwrap(), "--duration", "1s", "--no-poll"])
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(o.status.code().is_some_and(|c| c <= 1), "probe as nobody with capabilities failed: {err}");
    assert!(
        err.contains("armed in") && err.contains("probes live: blockio, fault, filemap, mmap, sock, stream, cpu, offcpu, mem, proc"),
        "{err}"
    );
    let m = std::fs::metadata(rec.join("events.bin")).unwrap();
    assert_eq!((m.uid(), m.permissions().mode() & 0o777), (65534, 0o600));
}
