//! `cargo xtask demo`: a real llama-server traced through a slow morning request, ordinary ones
//! and one under busy loops, probe printing the verdicts.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::setup::{bin, build, elevated, give_back_files, llama, root, sudo_ready};
use crate::workload::{Llama, http, http_get, wait_for};

/// The main job end to end: a real llama-server with SmolLM2-135M, traced by probe while it
/// answers a morning request (asleep, the model evicted: load and disk, the model file named), a
/// few ordinary requests (one cut short by the client), the same request warm, and under three
/// busy loops (cpu_contention, naming them); probe prints the verdicts.
pub(crate) fn demo() -> anyhow::Result<()> {
    sudo_ready()?;
    build()?;
    let dir = root().join("target/demo");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The server sleeps (unloads its model) after 2 s idle: the slow morning scene.
    let srv = Llama::start(&["-c", "2048", "-np", "2", "--metrics", "--sleep-idle-seconds", "2"], Some(&dir.join("llama-server.log")))?;
    let addr = srv.addr.clone();
    let rec = dir.join("recording");
    // The slow morning: asleep, and the model file gone from the page cache (before probe
    // attaches, so that the demo's own polls are not in the recording).
    asleep_and_evicted(&addr, &llama()?.1)?;
    // Only probe runs as root (through sudo for a normal user); the recording is yours.
    let mut probe = elevated(bin("probe")).args(["trace", "--pid", &srv.pid(), "--out"]).arg(&rec).spawn()?;
    wait_for(&rec.join("events.bin"), Duration::from_secs(30))?;
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the morning request (server asleep, model not in the page cache): {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    let chat = |n: u32, stream: bool| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"Write a short story about a lighthouse."}}],"max_tokens":{n},"stream":{stream},"temperature":0}}"#
        )
    };
    let steps: [(&str, String, Option<usize>, &str); 4] = [
        ("/v1/chat/completions", chat(32, true), None, "streamed chat, max_tokens 32"),
        (
            "/completion",
            r#"{"prompt":"The lighthouse keeper","n_predict":16,"stream":true}"#.to_string(),
            None,
            "native /completion, n_predict 16",
        ),
        ("/v1/chat/completions", chat(200, true), Some(5), "streamed chat, the client leaves after 5 events"),
        ("/v1/chat/completions", chat(12, false), None, "non-streamed chat, max_tokens 12"),
    ];
    for (path, body, cut, what) in steps {
        let (status, events) = http(&addr, path, &body, cut)?;
        println!("demo: {what}: {status}, {events} SSE events read");
    }
    // The same request as the morning one, warm: the baseline the verdicts compare with.
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the same request, warm: {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    // A request under a CPU hog: busy loops under a name of their own hold both CPUs.
    let hogs = CpuHogs::start(3)?;
    let t = Instant::now();
    let (status, _) = http(&addr, "/v1/chat/completions", &morning_body(), None)?;
    println!("demo: the same request under 3 busy loops (cpuhog): {status}, {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    drop(hogs);
    // A prompt longer than a slot's context (-c 2048 over -np 2 slots: 1024 tokens each): the
    // server refuses it, and says both sizes.
    let long = "The lighthouse keeper wrote in his log every night. ".repeat(150);
    let body = long_body(&long)?;
    let (status, _) = http(&addr, "/v1/chat/completions", &body, None)?;
    println!("demo: a prompt longer than a slot's context: {status}");
    std::thread::sleep(Duration::from_millis(500));
    // SIGINT, as Ctrl-C would: probe writes report.json and prints the summary.
    // Through sudo as well: a user may not signal the root-owned sudo (it relays the signal).
    elevated("kill").args(["-INT", &probe.id().to_string()]).status()?;
    let status = probe.wait()?;
    give_back_files();
    println!("\ndemo: probe exited with {status}; recording and report.json in {}", rec.display());
    Ok(())
}

/// The demo's morning request: a short question (the reload, not the prompt, is the wait), a
/// short answer, not streamed, its prompt computed every time (the warm repeat did as much work).
/// Both bodies are written out byte for byte as a `json!` value printed them (keys in order): the
/// recording holds what the server was sent.
pub(crate) fn morning_body() -> String {
    let prompt = "Good morning. What should the lighthouse keeper write in his log tonight?";
    format!(r#"{{"cache_prompt":false,"max_tokens":8,"messages":[{{"content":"{prompt}","role":"user"}}],"stream":false,"temperature":0}}"#)
}

/// A request for at most 8 tokens after `prompt`, not streamed.
fn long_body(prompt: &str) -> anyhow::Result<String> {
    let content = serde_json::to_string(prompt)?;
    Ok(format!(r#"{{"max_tokens":8,"messages":[{{"content":{content},"role":"user"}}],"stream":false}}"#))
}

/// The one field of llama-server's /props the demo waits on.
#[derive(Deserialize)]
struct Props {
    #[serde(default)]
    is_sleeping: bool,
}

/// Wait until llama-server says it sleeps (`--sleep-idle-seconds`: its model unmapped), then drop
/// the model file from the page cache (DONTNEED evicts the clean pages of a file nobody maps):
/// the machine the morning after.
pub(crate) fn asleep_and_evicted(addr: &str, model: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let props = http_get(addr, "/props").and_then(|b| serde_json::from_str::<Props>(&b).ok());
        if props.is_some_and(|p| p.is_sleeping) {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("llama-server did not go to sleep within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let f = std::fs::File::open(model).with_context(|| format!("cannot open {model}"))?;
    // SAFETY: a valid descriptor for the call; posix_fadvise only advises the kernel.
    unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Busy loops named `cpuhog` (a link to /bin/sh: a process is named by what it was run as);
/// killed when dropped.
pub(crate) struct CpuHogs(Vec<std::process::Child>);

impl CpuHogs {
    fn start(n: usize) -> anyhow::Result<CpuHogs> {
        let link = root().join("target/demo/cpuhog");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/bin/sh", &link)?;
        let kids = (0..n).map(|_| Command::new(&link).args(["-c", "while :; do :; done"]).spawn()).collect::<Result<_, _>>()?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(CpuHogs(kids))
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        for k in &mut self.0 {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request bodies are the bytes the `json!` values gave before.
    #[test]
    fn bodies_as_before() {
        let prompt = "Good morning. What should the lighthouse keeper write in his log tonight?";
        let morning = serde_json::json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0, "stream": false, "cache_prompt": false});
        assert_eq!(morning_body(), morning.to_string());
        for long in ["The lighthouse keeper wrote in his log every night. ".repeat(150), "a \"quoted\"\nline".to_string()] {
            let body = serde_json::json!({"messages": [{"role": "user", "content": long}], "max_tokens": 8, "stream": false});
            assert_eq!(long_body(&long).unwrap(), body.to_string());
        }
    }

    /// llama-server's /props: asleep only when it says so.
    #[test]
    fn props_sleeping() {
        let sleeping = |b: &str| serde_json::from_str::<Props>(b).ok().is_some_and(|p| p.is_sleeping);
        assert!(sleeping(r#"{"is_sleeping":true,"total_slots":2}"#));
        assert!(!sleeping(r#"{"is_sleeping":false}"#));
        assert!(!sleeping(r#"{"total_slots":2}"#));
        assert!(!sleeping("not json"));
    }
}
