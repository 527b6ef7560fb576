//! The test workloads (tests/workload.rs, built as `probe-workload`): started, paused at their
//! `ready` line until the tracer is attached, then let go.
use std::{
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

pub fn workload_bin() -> &'static str {
    env!("CARGO_BIN_EXE_probe-workload")
}

/// A scratch directory on a real disk (not tmpfs), so reads go through the block layer.
pub fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A workload started and paused at its `ready` line.
pub struct Workload {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub lines: mpsc::Receiver<String>,
    pub pid: u32,
}

impl Workload {
    /// `probe-workload ARGS`.
    pub fn start(args: &[&str]) -> Self {
        Self::start_program(workload_bin().as_ref(), args)
    }

    /// Another program that speaks the same protocol (`ready PID`, waits for a line on stdin).
    pub fn start_program(program: &std::path::Path, args: &[&str]) -> Self {
        let mut child = Command::new(program).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawn workload");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let stdin = child.stdin.take();
        let mut w = Workload { child, stdin, lines, pid: 0 };
        let ready = w.wait_line("ready");
        w.pid = ready.split_whitespace().nth(1).unwrap().parse().unwrap();
        w
    }

    pub fn wait_line(&mut self, prefix: &str) -> String {
        loop {
            let l = self.lines.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("workload never printed `{prefix}`"));
            if l.starts_with(prefix) {
                return l;
            }
        }
    }

    pub fn go(&mut self) -> String {
        let mut stdin = self.stdin.take().unwrap();
        writeln!(stdin, "go").unwrap();
        let done = self.wait_line("done");
        assert!(self.child.wait().unwrap().success(), "workload failed");
        done
    }
}

/// A workload never outlives its test (one that was waited for is not signalled twice).
impl Drop for Workload {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
