//! The recording directory's event log, `events.bin` (format v1, documented in docs/recording.md).
//!
//! A file header (`PROBEREC`, version) then frames: `u32 len | u16 type | u16 0 | payload`, in
//! native byte order. Type 1 = one kernel record as probe-common lays it out; type 2 = one JSON
//! object written by userspace (meta, maps, files, stats, end). The writer flushes at least once
//! a second, so a `probe` killed by SIGKILL leaves a readable file; the reader keeps every whole
//! frame and reports a torn tail or a corrupt frame instead of failing.
use std::{
    fs::File,
    io::{self, BufWriter, Read, Write},
    path::Path,
};

use crate::decode::{self, Event};

pub const FILE_NAME: &str = "events.bin";
pub const MAGIC: &[u8; 8] = b"PROBEREC";
pub const VERSION: u32 = 1;
pub const FRAME_KERNEL: u16 = 1;
pub const FRAME_JSON: u16 = 2;
/// No frame is larger than this; a larger length means the file is corrupt.
pub const MAX_FRAME: u32 = 16 << 20;

pub struct Writer {
    out: BufWriter<File>,
    pub bytes: u64,
}

impl Writer {
    pub fn create(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut out = BufWriter::with_capacity(1 << 20, File::create(dir.join(FILE_NAME))?);
        out.write_all(MAGIC)?;
        out.write_all(&VERSION.to_ne_bytes())?;
        out.write_all(&0u32.to_ne_bytes())?;
        Ok(Self { out, bytes: 16 })
    }

    fn frame(&mut self, ty: u16, payload: &[u8]) -> io::Result<()> {
        self.out.write_all(&(payload.len() as u32).to_ne_bytes())?;
        self.out.write_all(&ty.to_ne_bytes())?;
        self.out.write_all(&0u16.to_ne_bytes())?;
        self.out.write_all(payload)?;
        self.bytes += 8 + payload.len() as u64;
        Ok(())
    }

    pub fn kernel(&mut self, record: &[u8]) -> io::Result<()> {
        self.frame(FRAME_KERNEL, record)
    }

    pub fn json(&mut self, value: &serde_json::Value) -> io::Result<()> {
        self.frame(FRAME_JSON, &serde_json::to_vec(value).map_err(io::Error::other)?)
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// A recording read back: every event and JSON record that was whole, and what was not.
#[derive(Debug, Default)]
pub struct Recording {
    pub events: Vec<Event>,
    pub json: Vec<serde_json::Value>,
    /// Human-readable problems: torn tail, corrupt frame, undecodable records (counted).
    pub problems: Vec<String>,
    pub undecodable: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("{path} is not a probe recording (bad magic); expected a directory written by `probe trace`")]
    BadMagic { path: String },
    #[error("{path} is recording format v{found}; this probe reads v{VERSION}")]
    Version { path: String, found: u32 },
}

/// Read `DIR/events.bin`.
pub fn read_dir(dir: &Path) -> Result<Recording, ReadError> {
    let path = dir.join(FILE_NAME);
    let mut buf = Vec::new();
    File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut buf))
        .map_err(|source| ReadError::Io { path: path.display().to_string(), source })?;
    parse(&buf, &path.display().to_string())
}

pub fn parse(buf: &[u8], path: &str) -> Result<Recording, ReadError> {
    if buf.len() < 16 || &buf[..8] != MAGIC {
        return Err(ReadError::BadMagic { path: path.into() });
    }
    let found = u32::from_ne_bytes(buf[8..12].try_into().unwrap_or_default());
    if found != VERSION {
        return Err(ReadError::Version { path: path.into(), found });
    }
    let mut rec = Recording::default();
    let mut pos = 16usize;
    while pos < buf.len() {
        let Some(head) = buf.get(pos..pos + 8) else {
            rec.problems.push(torn(pos, buf.len()));
            break;
        };
        let len = u32::from_ne_bytes([head[0], head[1], head[2], head[3]]);
        let ty = u16::from_ne_bytes([head[4], head[5]]);
        if len > MAX_FRAME || !(ty == FRAME_KERNEL || ty == FRAME_JSON) {
            rec.problems.push(format!(
                "corrupt frame at byte {pos} (type {ty}, length {len}): the {} bytes after it were ignored",
                buf.len() - pos
            ));
            break;
        }
        let end = pos + 8 + len as usize;
        let Some(payload) = buf.get(pos + 8..end) else {
            rec.problems.push(torn(pos, buf.len()));
            break;
        };
        match ty {
            FRAME_KERNEL => match decode::decode(payload) {
                Ok(ev) => rec.events.push(ev),
                Err(_) => rec.undecodable += 1,
            },
            _ => match serde_json::from_slice(payload) {
                Ok(v) => rec.json.push(v),
                Err(_) => rec.undecodable += 1,
            },
        }
        pos = end;
    }
    if rec.undecodable > 0 {
        rec.problems.push(format!("{} records could not be decoded and were skipped", rec.undecodable));
    }
    Ok(rec)
}

fn torn(pos: usize, len: usize) -> String {
    format!(
        "recording ends mid-record at byte {pos} (probe was killed or the disk filled): the last {} bytes were ignored",
        len - pos
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use probe_common::{EventHeader, EventKind, fault::FaultEvent};

    fn sample(dir: &Path) -> Vec<u8> {
        let mut w = Writer::create(dir).unwrap();
        w.json(&serde_json::json!({"type": "meta", "pid": 1})).unwrap();
        for i in 0..3u64 {
            let ev = FaultEvent {
                hdr: EventHeader { kind: EventKind::Fault as u32, pid: 1, tid: 1, cpu: 0, ts_ns: i },
                addr: 0x1000 * i,
                ..Default::default()
            };
            w.kernel(&decode::encode(&ev)).unwrap();
        }
        w.flush().unwrap();
        std::fs::read(dir.join(FILE_NAME)).unwrap()
    }

    #[test]
    fn reads_back_what_was_written() {
        let dir = std::env::temp_dir().join(format!("probe-rec-{}", std::process::id()));
        let bytes = sample(&dir);
        let rec = parse(&bytes, "x").unwrap();
        assert_eq!(rec.events.len(), 3);
        assert_eq!(rec.json.len(), 1);
        assert!(rec.problems.is_empty());

        // Every truncation keeps all whole frames before it and says what was cut.
        for cut in 17..bytes.len() {
            let r = parse(&bytes[..cut], "x").unwrap();
            let j = 16 + 8 + serde_json::to_vec(&serde_json::json!({"type": "meta", "pid": 1})).unwrap().len();
            let whole = [j, j + 56, j + 112, j + 168];
            let want_events = whole.iter().filter(|&&w| w <= cut).count().saturating_sub(1);
            assert_eq!(r.events.len(), want_events, "cut at {cut}");
            assert_eq!(r.problems.len(), usize::from(!whole.contains(&cut) && cut > 16), "cut at {cut}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn corrupt_frames_and_bad_files_are_reported() {
        let dir = std::env::temp_dir().join(format!("probe-rec-c-{}", std::process::id()));
        let mut bytes = sample(&dir);
        let second = 16 + 8 + serde_json::to_vec(&serde_json::json!({"type": "meta", "pid": 1})).unwrap().len();
        bytes[second..second + 4].copy_from_slice(&u32::MAX.to_ne_bytes());
        let r = parse(&bytes, "x").unwrap();
        assert_eq!(r.events.len(), 0);
        assert_eq!(r.json.len(), 1);
        assert!(r.problems[0].contains(&format!("corrupt frame at byte {second}")), "{:?}", r.problems);
        assert!(matches!(parse(b"hello world, not a recording", "x"), Err(ReadError::BadMagic { .. })));
        std::fs::remove_dir_all(&dir).ok();
    }
}
