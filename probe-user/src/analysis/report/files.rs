//! The files and IO tables of the [`Report`]: which file an address or a block read belongs to
//! (the mmap probe's file mappings, /proc's mapping snapshots, the page-cache fills a thread made),
//! block IO per device and per file.
use std::collections::HashMap;

use super::{
    Device, FileStat,
    build::{Builder, FileKey},
};
use crate::os::procfs::Mapping;
use probe_common::{blockio::BlockIoEvent, mmap::MmapOp};

/// A block read is charged to the file its thread last added to the page cache this recently.
pub(super) const FILE_IO_WINDOW_NS: u64 = 100_000_000;

pub(super) fn kdev(dev: u32) -> (u32, u32) {
    (dev >> 20, dev & 0xfffff)
}

/// A file mapping (or an unmap) seen by the mmap probe.
pub(super) struct FileMap {
    pub(super) pid: u32,
    pub(super) t: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) key: (u32, u32, u64),
}

/// Mapping snapshots per pid, in time order, to name the file behind an address at a time.
#[derive(Default)]
pub(super) struct MapHistory {
    pub(super) by_pid: HashMap<u32, Vec<(u64, Vec<Mapping>)>>,
}

impl MapHistory {
    /// The mapping that covered `addr` in `pid` at `ts`: the latest snapshot at or before `ts`
    /// that has it, else the earliest after (a mapping is read from /proc just after its mmap).
    pub(super) fn find(&self, pid: u32, ts: u64, addr: u64) -> Option<&Mapping> {
        let snaps = self.by_pid.get(&pid)?;
        let split = snaps.partition_point(|(t, _)| *t <= ts);
        fn hit(snap: &(u64, Vec<Mapping>), addr: u64) -> Option<&Mapping> {
            snap.1.iter().find(|m| m.start <= addr && addr < m.end)
        }
        snaps[..split].iter().rev().find_map(|s| hit(s, addr)).or_else(|| snaps[split..].iter().find_map(|s| hit(s, addr)))
    }
}

impl Builder {
    /// Pass 1: a kernel record, for the file mappings (in file order, which is time order but
    /// for records from different CPUs a few microseconds apart).
    pub(crate) fn mapping(&mut self, m: &probe_common::mmap::MmapEvent) {
        match MmapOp::try_from(m.op) {
            Ok(MmapOp::Mmap) if m.ino != 0 && !(-4095..0).contains(&m.ret) => {
                let (ma, mi) = kdev(m.dev);
                let key = (ma, mi, m.ino);
                let name = String::from_utf8_lossy(m.name.split(|&c| c == 0).next().unwrap_or_default()).to_string();
                // Names from /proc (maps and files records) win: merged after pass 1.
                self.mmap_names.entry(key).or_insert_with(|| format!("<inode {} on {ma}:{mi}>/{name}", m.ino));
                self.by_pid.entry(m.hdr.pid).or_default().push((self.file_maps.len(), vec![]));
                self.file_maps.push(FileMap {
                    pid: m.hdr.pid,
                    t: m.hdr.ts_ns,
                    start: m.ret as u64,
                    end: (m.ret as u64).saturating_add(m.len),
                    key,
                });
            }
            Ok(MmapOp::Munmap) if m.ret == 0 => {
                let u = FileMap { pid: m.hdr.pid, t: m.hdr.ts_ns, start: m.addr, end: m.addr.saturating_add(m.len), key: (0, 0, 0) };
                // Only an unmap that cuts into a file mapping matters (anonymous memory churn
                // would otherwise be kept whole).
                let Some(list) = self.by_pid.get_mut(&u.pid) else { return };
                let mut kept = false;
                for (i, cuts) in list.iter_mut() {
                    let f = &self.file_maps[*i];
                    if u.t > f.t && u.start < f.end && f.start < u.end {
                        cuts.push(self.unmaps.len());
                        kept = true;
                    }
                }
                if kept {
                    self.unmaps.push(u);
                }
            }
            _ => {}
        }
    }

    /// The file behind `addr` in `pid` at `t`.
    pub(super) fn resolve(&self, pid: u32, t: u64, addr: u64) -> Option<FileKey> {
        let live = |(i, cuts): &(usize, Vec<usize>)| {
            let m = &self.file_maps[*i];
            m.t <= t
                && m.start <= addr
                && addr < m.end
                && !cuts.iter().map(|&c| &self.unmaps[c]).any(|u| u.t < t && u.start <= addr && addr < u.end)
        };
        let hit = self.by_pid.get(&pid).and_then(|list| list.iter().rev().find(|e| live(e)).map(|e| self.file_maps[e.0].key));
        hit.or_else(|| self.maps.find(pid, t, addr).map(|m| (m.major, m.minor, m.inode)))
    }

    pub(super) fn file_of(&mut self, key: FileKey) -> &mut FileStat {
        let names = &self.file_names;
        self.files.entry(key).or_insert_with(|| FileStat {
            path: names.get(&key).cloned().unwrap_or_else(|| format!("<inode {} on {}:{}>", key.2, key.0, key.1)),
            dev: format!("{}:{}", key.0, key.1),
            inode: key.2,
            ..Default::default()
        })
    }

    /// Block IO: totals, per device, and per file by the thread that filled the page cache.
    pub(super) fn block(&mut self, b: &BlockIoEvent) {
        let rwbs = String::from_utf8_lossy(b.rwbs.split(|&c| c == 0).next().unwrap_or_default()).to_string();
        let (read, write) = (rwbs.contains('R'), rwbs.contains('W'));
        let r = &mut self.r;
        r.blockio.requests += 1;
        if b.matched != probe_common::blockio::BY_ISSUER {
            r.blockio.issued_for_target += 1;
        }
        let (ma, mi) = kdev(b.dev);
        let dev_names = &self.dev_names;
        let e = self.devs.entry(b.dev).or_insert_with(|| {
            let dev = format!("{ma}:{mi}");
            (Device { name: dev_names.get(&dev).cloned(), dev, ..Default::default() }, vec![], vec![])
        });
        e.0.requests += 1;
        if read {
            r.blockio.read_bytes += b.bytes as u64;
            e.0.read_bytes += b.bytes as u64;
        } else if write {
            r.blockio.write_bytes += b.bytes as u64;
            e.0.write_bytes += b.bytes as u64;
        }
        let device_ns = b.complete_ns.saturating_sub(b.issue_ns);
        e.1.push(device_ns as f64 / 1e3);
        if b.insert_ns != 0 {
            e.2.push(b.issue_ns.saturating_sub(b.insert_ns) as f64 / 1e3);
        }
        if read {
            let at = if b.insert_ns != 0 { b.insert_ns } else { b.issue_ns };
            // The kernel named the file behind the request's pages; else the file its thread
            // last added to the page cache (a record written before block records named it).
            let named = (b.ino != 0).then(|| {
                let (ma, mi) = kdev(b.ino_dev);
                (at, (ma, mi, b.ino))
            });
            let fill = named.or_else(|| {
                self.fills_by_tid.get(&b.hdr.tid).filter(|_| b.hdr.tid != 0).and_then(|v| {
                    let i = v.partition_point(|(t, _)| *t <= at);
                    i.checked_sub(1).map(|i| v[i]).filter(|(t, _)| at - t <= FILE_IO_WINDOW_NS)
                })
            });
            if let Some((_, key)) = fill {
                let f = self.file_of(key);
                f.block_reads += 1;
                f.io_time_ms += device_ns as f64 / 1e6;
            }
        }
    }
}

/// Bytes in a folio of 2^order pages. The order comes from the recording (the kernel's is at most
/// a few tens; a corrupt record's is anything): saturated, never a shift past 63 bits.
pub(super) fn folio_bytes(page_size: u64, order: u32) -> u64 {
    match 1u64.checked_shl(order) {
        Some(pages) if order < 64 => page_size.saturating_mul(pages),
        _ => u64::MAX,
    }
}
