//! probe started while the slow request is already in flight: the request is found by the
//! kernel's TCP state, timed from its estimated arrival, named from its response, and explained
//! by what was watched plus the target's state at attach. Truth from the client's clock, the
//! cgroup's and /proc's byte counters.
mod common;

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{env_path, probe_bin, serial};
use serde_json::{Value, json};

/// A blkio v1 cgroup of the test's own, removed when dropped (its processes gone first).
struct Blkio(PathBuf);

impl Drop for Blkio {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The whole disk behind `path` as "MAJ:MIN" (a partition's parent: throttling is per disk).
fn disk_of(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).unwrap().dev();
    let (ma, mi) = (libc::major(dev), libc::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{ma}:{mi}"));
    assert!(sys.exists(), "{} is not on a block device ({ma}:{mi})", path.display());
    if sys.join("partition").exists() {
        return std::fs::read_to_string(sys.join("../dev")).unwrap().trim().to_string();
    }
    format!("{ma}:{mi}")
}

fn cgroup_read_bytes(cg: &Path, dev: &str) -> u64 {
    let t = std::fs::read_to_string(cg.join("blkio.throttle.io_service_bytes")).unwrap();
    t.lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[0] == dev && f[1] == "Read").then(|| f[2].parse().ok())?
        })
        .unwrap_or(0)
}

fn proc_read_bytes(pid: u32) -> u64 {
    let t = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    t.lines().find_map(|l| l.strip_prefix("read_bytes:")).unwrap().trim().parse().unwrap()
}

/// Sectors the disk read (/sys/block/DEV/stat, field 3), in bytes: what the device itself did.
fn disk_read_bytes(dev: &str) -> u64 {
    let t = std::fs::read_to_string(format!("/sys/dev/block/{dev}/stat")).unwrap();
    t.split_whitespace().nth(2).unwrap().parse::<u64>().unwrap() * 512
}

/// A command in a real terminal of its own (a tmux server on a socket of the test's), killed
/// when dropped.
struct Tmux(String);

impl Tmux {
    fn start(cmd: &str) -> Tmux {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = Tmux(format!("probe-test-{}-{n}", std::process::id()));
        let ok = Command::new("tmux").args(["-L", &t.0, "new-session", "-d", "-x", "200", "-y", "50", cmd]).status();
        assert!(ok.is_ok_and(|s| s.success()), "tmux new-session failed (scripts/setup.sh installs tmux)");
        // The pane stays after the command ends, for the last capture.
        let _ = Command::new("tmux").args(["-L", &t.0, "set-option", "-g", "remain-on-exit", "on"]).status();
        t
    }

    fn capture(&self) -> String {
        let o = Command::new("tmux").args(["-L", &self.0, "capture-pane", "-p", "-S", "-100"]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["-L", &self.0, "kill-server"]).status();
    }
}

/// A streamed chat from the client's side: when it was sent and when its first content chunk
/// came (the client's clock).
struct Chat {
    sent: Instant,
    first: Option<Instant>,
    done: Instant,
    /// The answer's body (SSE lines, or the JSON).
    body: String,
}

fn streamed_chat(addr: SocketAddr, max_tokens: u32) -> Chat {
    let body =
        json!({"messages": [{"role": "user", "content": "Say good morning."}], "max_tokens": max_tokens, "stream": true, "temperature": 0});
    ask(addr, "/v1/chat/completions", &body)
}

/// POST `body` to `path` and read the answer to its end: the first content is the first SSE
/// message with text (a chat delta, a completion's text, llama.cpp's `content`), or the whole
/// answer when it is not streamed.
fn ask(addr: SocketAddr, path: &str, body: &Value) -> Chat {
    ask_telling(addr, path, body, None)
}

/// [`ask`], telling `first` when the first content came.
fn ask_telling(addr: SocketAddr, path: &str, body: &Value, first_to: Option<std::sync::mpsc::Sender<()>>) -> Chat {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let sent = Instant::now();
    s.write_all(format!("{head}{body}").as_bytes()).unwrap();
    let mut first = None;
    let mut text = String::new();
    for line in BufReader::new(&s).lines().map_while(Result::ok) {
        text += &line;
        text.push('\n');
        let Some(v) = line.strip_prefix("data: ").and_then(|j| serde_json::from_str::<Value>(j).ok()) else { continue };
        let content = [&v["choices"][0]["delta"]["content"], &v["choices"][0]["text"], &v["content"]];
        if first.is_none() && content.iter().any(|c| c.as_str().is_some_and(|c| !c.is_empty())) {
            first = Some(Instant::now());
            if let Some(t) = &first_to {
                let _ = t.send(());
            }
        }
    }
    let done = Instant::now();
    let streamed = text.contains("data: ");
    let body = text.split_once("\n\n").map_or("", |x| x.1).to_string();
    Chat { sent, first: if streamed { first } else { Some(done) }, done, body }
}

/// `probe trace --pid PID` in a real terminal, its live view captured.
struct Traced {
    term: Tmux,
    pid_file: PathBuf,
    started: Instant,
}

impl Traced {
    fn start(dir: &Path, pid: u32, out: &Path) -> Traced {
        let pid_file = dir.join("probe.pid");
        let _ = std::fs::remove_file(&pid_file);
        let term = Tmux::start(&format!(
            "echo $$ > {}; exec {} trace --pid {pid} --out {}",
            pid_file.display(),
            probe_bin().display(),
            out.display()
        ));
        Traced { term, pid_file, started: Instant::now() }
    }

    /// Ctrl-C, and the screen once probe has ended.
    fn stop(self) -> String {
        let t = Instant::now();
        let probe_pid: i32 = loop {
            match std::fs::read_to_string(&self.pid_file).ok().and_then(|p| p.trim().parse().ok()) {
                Some(p) => break p,
                None if t.elapsed() < Duration::from_secs(10) => std::thread::sleep(Duration::from_millis(50)),
                None => panic!("probe did not start in its terminal: {}", self.term.capture()),
            }
        };
        // SAFETY: signalling the probe this test started.
        unsafe { libc::kill(probe_pid, libc::SIGINT) };
        let stop = Instant::now();
        // Until it is gone or a zombie (its state after the `)` of its name).
        let running = || {
            std::fs::read_to_string(format!("/proc/{probe_pid}/stat"))
                .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, r)| !r.trim_start().starts_with('Z')))
        };
        while running() && stop.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(100));
        }
        self.term.capture()
    }
}

/// The slow morning, met the way users meet it: llama-server asleep, its model out of the page
/// cache and its reads limited by its cgroup (blkio v1 `throttle.read_bps_device`, as a
/// container's limit would be); a streamed chat is sent, and probe is started 1.5 s later.
/// The request must come out named (inferred from its response), timed from the kernel's
/// estimate of its arrival (within 5% or 20 ms of the client's clock), with the IO the throttle's
/// kworker issued counted as the server's, and the limit named.
#[test]
fn attached_during_a_cold_reload_behind_an_io_limit() {
    let _serial = serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("attach-cold-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.gguf");
    std::fs::copy(env_path("LLAMA_MODEL"), &model).unwrap();
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    let size = std::fs::metadata(&model).unwrap().len();
    let dev = disk_of(&model);
    // 16 MB/s: the reload takes seconds, as on a slow disk.
    let limit: u64 = 16_000_000;
    let cg = Blkio(PathBuf::from(format!("/sys/fs/cgroup/blkio/probe-attach-{}", std::process::id())));
    std::fs::create_dir_all(&cg.0).expect("a blkio v1 cgroup (this test needs the v1 blkio hierarchy at /sys/fs/cgroup/blkio)");
    std::fs::write(cg.0.join("blkio.throttle.read_bps_device"), format!("{dev} {limit}")).unwrap();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let log = dir.join("server.log");
    let mut srv = common::spawn_owned(
        Command::new("sh")
            .args(["-c", "echo $$ > \"$0\" && exec \"$@\""])
            .arg(cg.0.join("cgroup.procs"))
            .arg(env_path("LLAMA_SERVER"))
            .arg("-m")
            .arg(&model)
            .args([
                "-c",
                "1024",
                "-np",
                "1",
                "--no-repack",
                "--sleep-idle-seconds",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap()),
    );
    common::wait_healthy(addr);
    let pid = srv.id();
    let (st, _) = common::http(addr, "POST", "/completion", Some(&json!({"prompt": "Hello", "n_predict": 2})), &[]).unwrap();
    assert_eq!(st, 200);
    common::sleep_then_evict(addr, &model);
    let log_before = std::fs::read_to_string(&log).unwrap_or_default().len();

    // The request, then probe 1.5 s later.
    let client = std::thread::spawn(move || streamed_chat(addr, 8));
    std::thread::sleep(Duration::from_millis(1500));
    let (cg_before, proc_before, disk_before) = (cgroup_read_bytes(&cg.0, &dev), proc_read_bytes(pid), disk_read_bytes(&dev));
    let out = dir.join("trace");
    let _ = std::fs::remove_dir_all(&out);
    // probe in a real terminal (tmux): its live view is captured while the request waits.
    let traced = Traced::start(&dir, pid, &out);
    let started = traced.started;
    let mut screens = Vec::new();
    while !client.is_finished() {
        std::thread::sleep(Duration::from_millis(250));
        screens.push(traced.term.capture());
    }
    let chat = client.join().unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    let after = traced.term.capture();
    let (cg_after, proc_after, disk_after) = (cgroup_read_bytes(&cg.0, &dev), proc_read_bytes(pid), disk_read_bytes(&dev));
    let end = traced.stop();
    let _ = srv.kill();
    let _ = srv.wait();
    let server_log = std::fs::read_to_string(&log).unwrap_or_default();

    let first = chat.first.expect("the client got no token");
    let client_ttft = (first - chat.sent).as_secs_f64() * 1e3;
    let watched = (first - started).as_secs_f64() * 1e3;
    eprintln!(
        "client: TTFT {client_ttft:.0} ms (probe started {:.0} ms after the request), whole answer {:.0} ms; read during the trace: cgroup {} B, /proc {} B, disk {} B; model {size} B",
        (started - chat.sent).as_secs_f64() * 1e3,
        (chat.done - chat.sent).as_secs_f64() * 1e3,
        cg_after - cg_before,
        proc_after - proc_before,
        disk_after - disk_before
    );
    // The server's own log: it woke up and loaded the model again for this request.
    assert!(server_log.len() > log_before, "the server wrote nothing after the request");

    // The live view, on the terminal while the request waited: the request, how long it has
    // waited, and the file being read with its residency and the cgroup's limit.
    let file = model.file_name().unwrap().to_str().unwrap();
    // Its head was read before attach and nothing answered yet: it is named by its client.
    let waiting = " (its head came before attach), ";
    let seen = screens.iter().find(|s| s.lines().any(|l| l.contains(waiting) && l.contains(&format!("no token yet: reading {file} ("))));
    let lines: Vec<&str> = screens.iter().flat_map(|s| s.lines()).filter(|l| l.contains(waiting)).collect();
    let seen = seen.unwrap_or_else(|| panic!("no screen showed the request reading {file}: {lines:#?}"));
    eprintln!("live view during the wait:\n{seen}");
    let line = seen.lines().find(|l| l.contains(waiting)).unwrap();
    assert!(line.contains("% resident, ") && line.contains("the cgroup allows 16.0 MB/s"), "{line}");
    eprintln!("after the first token:\n{after}");
    // Finished: its line, with what it waited on; at the end the summary, the live block gone.
    // What it waited on, longest first: reading the model among them (a second whose reads
    // completed in the next one shows the thread blocked on the page instead: CI, 2 s of
    // folio_wait_bit_common beside 1 s of reading).
    let done =
        after.lines().find(|l| l.contains(" POST /v1/chat/completions (inferred) 200 done in ")).unwrap_or_else(|| panic!("{after}"));
    let waited = done.split("before its first token: ").nth(1).unwrap_or_else(|| panic!("{done}"));
    assert!(waited.contains(&format!("reading {file} ")), "{done}");
    assert!(!end.contains("no token yet") && end.contains("recording: "), "{end}");

    let r = common::read_report(&out);
    let qs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["probe_poll"] != true).collect();
    let q = qs.iter().find(|q| q["path"] == "/v1/chat/completions").unwrap_or_else(|| panic!("the in-flight request is not named: {qs:?}"));
    assert_eq!((q["method"].as_str(), q["path_inferred"].as_bool()), (Some("POST"), Some(true)), "{q}");
    assert_eq!(q["arrival_by"], "tcp_state", "{q}");
    // TTFT from the kernel's arrival estimate: the client's clock, within 5% or 20 ms.
    let ttft = q["ttft_ms"].as_f64().unwrap_or_else(|| panic!("no TTFT for a request whose first token came after attach: {q}"));
    let tol = (0.05 * client_ttft).max(20.0);
    assert!((ttft - client_ttft).abs() <= tol, "TTFT {ttft:.0} ms, the client's clock {client_ttft:.0} ms");
    assert!(ttft >= watched - 20.0, "TTFT {ttft:.0} ms is below the part probe watched ({watched:.0} ms)");
    let arrival = q["arrival_ms"].as_f64().unwrap();
    assert!(arrival < -1000.0, "arrival {arrival} ms: the request came 1.5 s before attach");

    let v = &q["verdict"];
    let split = &v["ttft_ms"];
    assert!((split["before_attach"].as_f64().unwrap() - (-arrival)).abs() < 1.0, "{v}");
    assert!(["disk", "load"].contains(&v["slow_cause"].as_str().unwrap()), "{v}");
    let evidence = v["evidence"].to_string();
    assert!(evidence.contains("before probe attached; at attach"), "{v}");
    assert!(evidence.contains(model.to_str().unwrap()), "the model file is not named: {v}");
    assert!(evidence.contains(&format!("throttled by the cgroup's limit ({:.1} MB/s", limit as f64 / 1e6)), "the limit is not named: {v}");
    assert!(v["data_quality"].to_string().contains("before attach, by the kernel's TCP state"), "{v}");

    // The reads the throttle's kworker issued are the server's: every byte the cgroup and /proc
    // counted during the trace, and no more than the disk itself read meanwhile (bios queued by
    // the throttle before attach are read during the trace).
    let b = &r["blockio"];
    let read = b["read_bytes"].as_u64().unwrap();
    let counted = cg_after - cg_before;
    assert!(counted > 4 << 20, "the cgroup counted only {counted} B during the trace");
    assert!(proc_after - proc_before >= counted * 9 / 10, "/proc/PID/io and the cgroup disagree");
    assert!(read >= counted * 9 / 10, "block IO {read} B of the {counted} B the cgroup counted");
    assert!(read <= (disk_after - disk_before) + (1 << 20), "block IO {read} B, the disk read {} B", disk_after - disk_before);
    assert!(b["issued_for_target"].as_u64().unwrap() > 0, "no request counted as issued for the target: {b}");
    let lim = b["limits"].as_array().unwrap();
    assert!(lim.iter().any(|l| l["dev"] == dev.as_str() && l["read_bps"] == limit), "{b}");
    let files = r["files"].as_array().unwrap();
    let f = files.iter().find(|f| f["path"] == model.to_str().unwrap()).expect("the model among the files");
    assert!(f["block_reads"].as_u64().unwrap() > 0 && f["io_time_ms"].as_f64().unwrap() > 0.0, "{f}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two requests on a server that serves one at a time, probe started between: A (a long
/// stream) holds the server; once it streams (a loaded machine can take over a second), B is
/// sent, and probe is started 0.5 s later in a terminal, captured until B is answered; then
/// Ctrl-C.
struct Queued {
    a: Chat,
    b: Chat,
    started: Instant,
    screens: Vec<String>,
}

fn queued_at_attach(
    dir: &Path,
    pid: u32,
    out: &Path,
    a: impl FnOnce(std::sync::mpsc::Sender<()>) -> Chat + Send + 'static,
    b: impl FnOnce() -> Chat + Send + 'static,
) -> Queued {
    let (tx, a_streams) = std::sync::mpsc::channel();
    let a = std::thread::spawn(move || a(tx));
    a_streams.recv_timeout(Duration::from_secs(30)).expect("A streamed nothing within 30 s");
    let b = std::thread::spawn(b);
    std::thread::sleep(Duration::from_millis(500));
    let _ = std::fs::remove_dir_all(out);
    let traced = Traced::start(dir, pid, out);
    let started = traced.started;
    let mut screens = Vec::new();
    while !b.is_finished() {
        std::thread::sleep(Duration::from_millis(250));
        screens.push(traced.term.capture());
    }
    let (b, a) = (b.join().unwrap(), a.join().unwrap());
    let end = traced.stop();
    assert!(end.contains("recording: "), "{end}");
    Queued { a, b, started, screens }
}

/// A request queued behind another at attach, on llama-server with one slot: a long streamed
/// completion (A) holds the slot, a chat that is not streamed (B) waits for it, and probe is
/// started after both were sent. B must be named from its answer, timed from the kernel's
/// estimate (the client's clock), and its wait is queue: the server's own timings say how long
/// it worked, the rest it waited. A, streaming before attach, keeps a null TTFT.
#[test]
fn attached_while_a_request_waits_for_the_only_slot() {
    let _serial = serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("attach-queued-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut srv, addr) = common::llama_server_from(&env_path("LLAMA_SERVER"), &["-c", "2048", "-np", "1", "-t", "2"]);
    let pid = srv.id();
    let out = dir.join("trace");
    let Queued { a, b, started, screens } = queued_at_attach(
        &dir,
        pid,
        &out,
        move |tx| {
            let body = json!({"prompt": "1, 2, 3, 4, 5,", "n_predict": 300, "ignore_eos": true, "stream": true, "temperature": 0});
            ask_telling(addr, "/completion", &body, Some(tx))
        },
        move || {
            let body =
                json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0, "stream": false});
            ask(addr, "/v1/chat/completions", &body)
        },
    );
    let _ = srv.kill();
    let _ = srv.wait();

    let b_total = (b.done - b.sent).as_secs_f64() * 1e3;
    let answer: Value = serde_json::from_str(&b.body).unwrap_or_else(|e| panic!("B's answer: {e}: {}", b.body));
    let t = &answer["timings"];
    let worked = t["prompt_ms"].as_f64().unwrap() + t["predicted_ms"].as_f64().unwrap();
    eprintln!(
        "client: B answered in {b_total:.0} ms (the server worked {worked:.0} ms of it), sent {:.0} ms before probe started; A took {:.0} ms",
        (started - b.sent).as_secs_f64() * 1e3,
        (a.done - a.sent).as_secs_f64() * 1e3
    );
    assert!(b_total - worked > 1000.0, "B did not wait for the slot: {b_total:.0} ms, worked {worked:.0} ms");
    let queued = screens.iter().flat_map(|s| s.lines()).find(|l| l.contains("no token yet: queued behind 1 request"));
    let queued = queued.unwrap_or_else(|| panic!("no screen showed B queued: {}", screens.last().cloned().unwrap_or_default()));
    eprintln!("live view: {queued}");

    let r = common::read_report(&out);
    let qs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["probe_poll"] != true).collect();
    let qb = qs.iter().find(|q| q["path"] == "/v1/chat/completions").unwrap_or_else(|| panic!("B is not named: {qs:?}"));
    assert_eq!((qb["path_inferred"].as_bool(), qb["arrival_by"].as_str()), (Some(true), Some("tcp_state")), "{qb}");
    let ttft = qb["ttft_ms"].as_f64().unwrap_or_else(|| panic!("no TTFT for B: {qb}"));
    assert!((ttft - b_total).abs() <= (0.05 * b_total).max(20.0), "B's TTFT {ttft:.0} ms, the client's clock {b_total:.0} ms");
    let v = &qb["verdict"];
    assert_eq!(v["slow_cause"], "queue", "{v}");
    let split = &v["ttft_ms"];
    let part = |k: &str| split[k].as_f64().unwrap_or(0.0);
    let waited = part("queue") + part("before_attach");
    let truth = b_total - worked;
    assert!(
        (waited - truth).abs() <= (0.15 * truth).max(100.0),
        "queue + before attach {waited:.0} ms, the server's own timings {truth:.0} ms: {v}"
    );
    assert!(part("unexplained") < 0.1 * ttft, "{v}");
    assert!(v["evidence"].to_string().contains("arrived before it were in flight"), "{v}");
    // A streamed before attach: named from its messages, no TTFT.
    let qa = qs.iter().find(|q| q["path"] == "/completion").unwrap_or_else(|| panic!("A is not named: {qs:?}"));
    assert_eq!((qa["began_before_attach"].as_bool(), qa["ttft_ms"].as_f64()), (Some(true), None), "{qa}");

    // Every output uses the estimate: B's span starts at its arrival, before the trace began,
    // and its off-CPU flamegraph covers it.
    let o = Command::new(probe_bin()).args(["export", "--format", "otlp-json", "--force"]).arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let otlp: Value = serde_json::from_slice(&std::fs::read(out.join("otlp.json")).unwrap()).unwrap();
    let spans: Vec<&Value> =
        otlp["resourceSpans"][0]["scopeSpans"].as_array().unwrap().iter().flat_map(|s| s["spans"].as_array().unwrap()).collect();
    let attr = |sp: &Value, k: &str| sp["attributes"].as_array().unwrap().iter().find(|a| a["key"] == k).map(|a| a["value"].clone());
    let sb = spans.iter().find(|sp| attr(sp, "url.path").is_some_and(|v| v["stringValue"] == "/v1/chat/completions")).expect("B's span");
    let ns = |k: &str| sb[k].as_str().and_then(|t| t.parse::<u64>().ok()).or(sb[k].as_u64()).unwrap();
    let span_ms = (ns("endTimeUnixNano") - ns("startTimeUnixNano")) as f64 / 1e6;
    assert!((span_ms - b_total).abs() <= (0.05 * b_total).max(20.0), "B's span {span_ms:.0} ms, the client's clock {b_total:.0} ms");
    assert_eq!(attr(sb, "probe.arrival_source").map(|v| v["stringValue"].clone()), Some(json!("tcp_state")), "{sb}");
    let svg = dir.join("b-offcpu.svg");
    let id = qb["id"].to_string();
    let o =
        Command::new(probe_bin()).args(["flamegraph", "--kind", "offcpu", "--request", &id, "-o"]).arg(&svg).arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::metadata(&svg).is_ok_and(|m| m.len() > 0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Not llama.cpp's server: llama-cpp-python's (uvicorn, one request at a time behind a lock;
/// `--interrupt_requests false`, else a new request cancels the one running). A long streamed
/// completion holds it, a streamed chat waits for the lock and gets no headers until then, and
/// probe is started after both were sent.
#[test]
fn attached_while_llama_cpp_python_serves_another_request() {
    let _serial = serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("attach-python-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let s = common::PyServer::start_with(&["--interrupt_requests", "false"]);
    let (pid, addr) = (s.child.id(), s.addr);
    let out = dir.join("trace");
    let Queued { a, b, started, screens } = queued_at_attach(
        &dir,
        pid,
        &out,
        move |tx| {
            // End-of-text banned (SmolLM2's 0 and 2): A runs its whole 300 tokens.
            let body = json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 300, "stream": true, "temperature": 0, "logit_bias": {"0": -100, "2": -100}});
            ask_telling(addr, "/v1/completions", &body, Some(tx))
        },
        move || streamed_chat(addr, 8),
    );
    drop(s);

    let first = b.first.expect("B got no token");
    let b_ttft = (first - b.sent).as_secs_f64() * 1e3;
    let a_first = a.first.expect("A got no token");
    eprintln!(
        "client: B's first token after {b_ttft:.0} ms (probe started {:.0} ms after it was sent); A's first token came {:.0} ms before probe started, A took {:.0} ms",
        (started - b.sent).as_secs_f64() * 1e3,
        (started - a_first).as_secs_f64() * 1e3,
        (a.done - a.sent).as_secs_f64() * 1e3
    );
    assert!(first > started + Duration::from_millis(500), "B's first token came too soon after attach for the test to mean anything");
    assert!(a_first < started, "A's first token came after probe started");
    // While A streamed, the live view said B waited for the slot (after A's end it is B's prompt).
    let waiting: Vec<&str> = screens.iter().flat_map(|s| s.lines()).filter(|l| l.contains("no token yet")).collect();
    let live = waiting.iter().find(|l| l.contains("no token yet: queued behind 1 request")).map(|l| l.to_string());
    eprintln!("live view: {live:?}");

    let r = common::read_report(&out);
    let qs: Vec<&Value> = r["requests"].as_array().unwrap().iter().filter(|q| q["probe_poll"] != true).collect();
    let qb = qs.iter().find(|q| q["path"] == "/v1/chat/completions").unwrap_or_else(|| panic!("B is not named: {qs:?}"));
    assert_eq!((qb["path_inferred"].as_bool(), qb["arrival_by"].as_str()), (Some(true), Some("tcp_state")), "{qb}");
    let ttft = qb["ttft_ms"].as_f64().unwrap_or_else(|| panic!("no TTFT for B: {qb}"));
    assert!((ttft - b_ttft).abs() <= (0.05 * b_ttft).max(20.0), "B's TTFT {ttft:.0} ms, the client's clock {b_ttft:.0} ms");
    assert!(ttft >= (first - started).as_secs_f64() * 1e3 - 20.0, "TTFT below the part probe watched");
    let v = &qb["verdict"];
    assert_eq!(v["slow_cause"], "queue", "{v}");
    let qa = qs.iter().find(|q| q["path"] == "/v1/completions").unwrap_or_else(|| panic!("A is not named: {qs:?}"));
    assert_eq!((qa["began_before_attach"].as_bool(), qa["ttft_ms"].as_f64()), (Some(true), None), "{qa}");
    assert!(live.is_some(), "the live view did not show B queued: {waiting:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}
