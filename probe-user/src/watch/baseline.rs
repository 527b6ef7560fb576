//! The warm baseline `probe watch` keeps for its server in its directory (`warm-baseline.json`):
//! the TTFTs of the server's fast requests (their verdict found nothing but its own work) with
//! their prompt sizes, from every session of the last day. A restarted watch, or a session after
//! the server restarted, still knows what "warm" is: each window it analyses carries them as a
//! `warm_baseline` record, and a verdict says "3.4× this server's warm TTFT … probe watch kept".
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::log_line;
use crate::record::records::{UserRecord, Warm, WarmBaseline};

pub const FILE_NAME: &str = "warm-baseline.json";
/// Requests older than this are forgotten ("across a day").
const KEEP_FOR_MS: u64 = 24 * 3600 * 1000;
/// The newest this many are kept.
const KEEP_AT_MOST: usize = 500;
/// The file is read up to this size.
const MAX_FILE: u64 = 1 << 20;

#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
struct File {
    /// The server the requests were served by (what `probe watch` follows): another server's
    /// baseline in the same directory is not this one's.
    server: String,
    warm: Vec<Warm>,
}

pub struct Baseline {
    dir: PathBuf,
    file: File,
    /// When this session loaded it: what windows carry is what came before (this session's own
    /// warm requests are in its windows already, and the evidence says "earlier sessions").
    loaded_ms: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Baseline {
    /// The baseline kept in `dir` for `server`; empty when there is none, it is another server's,
    /// or it cannot be read (said once).
    pub fn load(dir: &Path, server: &str) -> Baseline {
        let path = dir.join(FILE_NAME);
        let mut file = File { server: server.to_string(), warm: vec![] };
        match crate::util::output::read_recording_text(&path, MAX_FILE) {
            Ok(text) => match serde_json::from_str::<File>(&text) {
                Ok(f) if f.server == server => file.warm = f.warm,
                Ok(f) => log_line!(
                    "probe watch: {} holds the warm baseline of {}, not of {server}: starting a new one",
                    path.display(),
                    crate::util::text::terminal(&f.server)
                ),
                Err(e) => log_line!("probe watch: {} cannot be read ({e}): starting a new warm baseline", path.display()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log_line!("probe watch: {} cannot be read ({e}): starting a new warm baseline", path.display()),
        }
        let loaded_ms = now_ms();
        let mut b = Baseline { dir: dir.to_path_buf(), file, loaded_ms };
        b.forget_old(loaded_ms);
        b
    }

    pub fn len(&self) -> usize {
        self.file.warm.len()
    }

    pub fn is_empty(&self) -> bool {
        self.file.warm.is_empty()
    }

    /// The record a window carries: the warm requests of earlier sessions (None: there are none).
    pub fn record(&self) -> Option<Vec<u8>> {
        let warm: Vec<Warm> = self.file.warm.iter().filter(|w| w.at_unix_ms < self.loaded_ms).cloned().collect();
        (!warm.is_empty()).then(|| crate::record::standalone(&UserRecord::WarmBaseline(WarmBaseline { warm })))
    }

    /// Learn the warm ones among `ids` (requests of `report`, just analysed); true when any was.
    pub fn learn(&mut self, report: &crate::analysis::report::Report, ids: &[(u32, u64)]) -> bool {
        let now = now_ms();
        let before = self.file.warm.len();
        for q in report.requests.iter().filter(|q| ids.contains(&(q.record.pid, q.record.id))) {
            let Some(v) = &q.verdict else { continue };
            let Some(ttft) = q.record.ttft_ms else { continue };
            if q.record.probe_poll
                || q.record.role != crate::stream::Role::Server
                || !matches!(v.slow_cause, crate::analysis::verdict::SlowCause::None | crate::analysis::verdict::SlowCause::Compute)
            {
                continue;
            }
            let (size, unit) = crate::analysis::report::build::prompt_size(&q.record);
            self.file.warm.push(Warm { size, unit: unit.into(), ttft_ms: ttft, at_unix_ms: now });
        }
        self.forget_old(now);
        self.file.warm.len() != before
    }

    fn forget_old(&mut self, now: u64) {
        self.file.warm.retain(|w| w.at_unix_ms + KEEP_FOR_MS >= now && w.ttft_ms.is_finite() && w.ttft_ms >= 0.0);
        let n = self.file.warm.len();
        if n > KEEP_AT_MOST {
            self.file.warm.drain(..n - KEEP_AT_MOST);
        }
    }

    /// Write it to the directory (replaced whole: never through a link; mode 0600).
    pub fn save(&self) {
        let write = || -> anyhow::Result<()> {
            let out = crate::util::output::OutDir::open(&self.dir)?;
            out.write(FILE_NAME, &serde_json::to_vec_pretty(&self.file)?)?;
            Ok(())
        };
        if let Err(e) = write() {
            log_line!("probe watch: the warm baseline could not be saved in {}: {e:#}", self.dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_servers_or_an_old_baseline_is_not_kept() {
        use std::os::unix::fs::DirBuilderExt as _;
        let dir = std::env::temp_dir().join(format!("probe-baseline-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        let mut b = Baseline::load(&dir, "a process listening on port 8080");
        assert!(b.is_empty());
        b.file.warm.push(Warm { size: 10, unit: "token".into(), ttft_ms: 50.0, at_unix_ms: now_ms() - 1000 });
        b.file.warm.push(Warm { size: 10, unit: "token".into(), ttft_ms: 60.0, at_unix_ms: now_ms() - KEEP_FOR_MS - 1 });
        b.save();
        let mut again = Baseline::load(&dir, "a process listening on port 8080");
        assert_eq!(again.len(), 1, "the day-old one is forgotten");
        assert!(again.record().is_some());
        // What this session learns is kept, not carried: its windows hold those requests already.
        again.loaded_ms = 0;
        assert!(again.record().is_none());
        assert!(Baseline::load(&dir, "a process listening on port 9090").is_empty());
        std::fs::write(dir.join(FILE_NAME), b"{not json").unwrap();
        assert!(Baseline::load(&dir, "a process listening on port 8080").is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
