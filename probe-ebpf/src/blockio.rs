//! Block IO issued on behalf of the target: insert → issue → complete, one record per request.
//!
//! Completions run in interrupt or another task's context, so requests are remembered by
//! (device, sector) at issue and matched at completion; the record carries the issuer's pid.
use aya_ebpf::maps::HashMap;
use aya_ebpf::{
    EbpfContext,
    macros::{map, raw_tracepoint, tracepoint},
    maps::LruHashMap,
    programs::{RawTracePointContext, TracePointContext},
};
use probe_common::{
    blockio::{BY_BLKCG, BY_FILE, BY_ISSUER, BlockIoEvent, BlockKey, BlockStart, FileId},
    tracepoints::{block_rq_complete as cpl, block_rq_insert as ins, block_rq_issue as iss},
};

use crate::{current_target, emit, field, header, insert_lru, now_ns};

/// Requests of the target that entered the IO scheduler and are not yet issued.
#[map(name = "BLOCK_QUEUED")]
static BLOCK_QUEUED: LruHashMap<BlockKey, BlockStart> = LruHashMap::with_max_entries(16384, 0);

/// Requests of the target that were issued and are not yet complete.
#[map(name = "BLOCK_INFLIGHT")]
static BLOCK_INFLIGHT: LruHashMap<BlockKey, BlockStart> = LruHashMap::with_max_entries(16384, 0);

/// The target's block cgroups (v1 blkio, or a v2 cgroup below the root), by cgroup id.
#[map(name = "TARGET_BLKCG")]
static TARGET_BLKCG: HashMap<u64, u32> = HashMap::with_max_entries(64, 0);

/// Files the target maps, by inode and superblock device.
#[map(name = "TARGET_FILES")]
static TARGET_FILES: HashMap<FileId, u32> = HashMap::with_max_entries(4096, 0);

/// The bio behind request `rq`: its block cgroup's id and the file of its first page (inode,
/// superblock device), each 0 when unknown.
#[inline(always)]
fn bio_owner(rq: u64, o: &probe_common::kernel::KernelOffsets) -> (u64, FileId) {
    let mut file = FileId::default();
    if o.bio_valid == 0 {
        return (0, file);
    }
    let Some(bio) = crate::task::read::<u64>(rq, o.rq_bio).filter(|&b| b != 0) else { return (0, file) };
    let cgroup = (|| {
        let blkg = crate::task::read::<u64>(bio, o.bio_blkg).filter(|&b| b != 0)?;
        let blkcg = crate::task::read::<u64>(blkg, o.blkg_blkcg).filter(|&b| b != 0)?;
        let cg = crate::task::read::<u64>(blkcg, o.blkcg_cgroup).filter(|&b| b != 0)?;
        let kn = crate::task::read::<u64>(cg, o.cgroup_kn).filter(|&b| b != 0)?;
        crate::task::read::<u64>(kn, o.kn_id)
    })()
    .unwrap_or(0);
    let host = (|| {
        let vec = crate::task::read::<u64>(bio, o.bio_io_vec).filter(|&b| b != 0)?;
        let page = crate::task::read::<u64>(vec, o.bvec_page).filter(|&b| b != 0)?;
        // The low bits of page->mapping mark anonymous and movable pages: no file behind them.
        let mapping = crate::task::read::<u64>(page, o.page_mapping).filter(|&m| m != 0 && m & 3 == 0)?;
        crate::task::read::<u64>(mapping, o.mapping_host).filter(|&h| h != 0)
    })();
    if let Some(inode) = host {
        let sb = crate::task::read::<u64>(inode, o.inode_sb).unwrap_or(0);
        file.ino = crate::task::read::<u64>(inode, o.inode_ino).unwrap_or(0);
        file.dev = if sb == 0 { 0 } else { crate::task::read::<u32>(sb, o.sb_dev).unwrap_or(0) };
    }
    (cgroup, file)
}

#[inline(always)]
fn key(ctx: &TracePointContext, dev_off: usize, sector_off: usize) -> Result<BlockKey, i64> {
    Ok(BlockKey { dev: field(ctx, dev_off)?, _pad: 0, sector: field(ctx, sector_off)? })
}

/// block:block_rq_insert and block:block_io_start (6.5+), both dev @8, sector @16: one program
/// (verified once, attached to both: `SAME_CODE` in probe-user's attach table). A request is
/// queued for the target's bio in the submitter's context: through the IO scheduler (insert),
/// or created for it (io_start, which also covers requests that bypass the scheduler and are
/// issued later from another request's completion, in interrupt context).
#[tracepoint(category = "block", name = "block_rq_insert")]
pub fn block_rq_insert(ctx: TracePointContext) -> u32 {
    let _ = queued(&ctx, ins::DEV, ins::SECTOR);
    0
}

/// Remember a request of the target until it is issued (the first of io_start / insert wins).
fn queued(ctx: &TracePointContext, dev_off: usize, sector_off: usize) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    let k = key(ctx, dev_off, sector_off)?;
    // SAFETY: presence check only.
    if unsafe { BLOCK_QUEUED.get(&k) }.is_some() {
        return Ok(());
    }
    let start = BlockStart { pid, tid, cpu: crate::cpu(), insert_ns: now_ns(), ..Default::default() };
    insert_lru(&BLOCK_QUEUED, &k, &start);
    // The code path that made this IO (the target's own context).
    crate::stack::capture(ctx.as_ptr(), probe_common::stack::STACK_IO, pid, tid, k.sector, 0, crate::stack::Take::EVENT);
    Ok(())
}

/// block:block_rq_issue (dev @8, sector @16, bytes @28): the driver takes the request. Runs in
/// the submitter's context for direct issue, or in kblockd for queued requests (matched by key).
#[tracepoint(category = "block", name = "block_rq_issue")]
pub fn block_rq_issue(ctx: TracePointContext) -> u32 {
    let _ = try_block_rq_issue(&ctx);
    0
}

fn try_block_rq_issue(ctx: &TracePointContext) -> Result<(), i64> {
    let k = key(ctx, iss::DEV, iss::SECTOR)?;
    issued(ctx.as_ptr(), k, field(ctx, iss::BYTES)?, field(ctx, iss::RWBS)?, 0);
    Ok(())
}

/// The same issue as a raw tracepoint (block_rq_issue(struct request *rq)), preferred when the
/// request offsets are known from BTF: requests are also issued from another request's
/// completion (interrupt context), where a classic tracepoint program is skipped whenever any
/// other BPF program runs on that CPU (see `block_rq_complete_raw`).
#[raw_tracepoint(tracepoint = "block_rq_issue")]
pub fn block_rq_issue_raw(ctx: RawTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let o = crate::task::offsets();
    let Some(k) = request_key(rq, &o) else { return 0 };
    let (Some(bytes), Some(flags)) = (crate::task::read::<u32>(rq, o.rq_data_len), crate::task::read::<u32>(rq, o.rq_cmd_flags)) else {
        return 0;
    };
    issued(ctx.as_ptr(), k, bytes, rwbs(flags, &o.req_bits), rq);
    0
}

/// The (device, sector) of a `struct request *`, as the classic tracepoints give it.
#[inline(always)]
fn request_key(rq: u64, o: &probe_common::kernel::KernelOffsets) -> Option<BlockKey> {
    if o.blk_valid == 0 {
        return None;
    }
    let sector = crate::task::read::<u64>(rq, o.rq_sector)?;
    let q = crate::task::read::<u64>(rq, o.rq_q)?;
    let disk = crate::task::read::<u64>(q, o.q_disk).filter(|&d| d != 0)?;
    let major = crate::task::read::<i32>(disk, o.disk_major)?;
    let minor = crate::task::read::<i32>(disk, o.disk_first_minor)?;
    Some(BlockKey { dev: ((major as u32) << 20) | (minor as u32 & 0xfffff), _pad: 0, sector })
}

/// The tracepoints' `rwbs` text from `cmd_flags`, as the kernel's blk_fill_rwbs() writes it.
/// `bits`: REQ_PREFLUSH, REQ_FUA, REQ_RAHEAD, REQ_SYNC, REQ_META bit numbers.
#[inline(always)]
fn rwbs(flags: u32, bits: &[u32; 5]) -> [u8; 8] {
    let has = |i: usize| bits[i] < 32 && flags & (1 << bits[i]) != 0;
    // Letters are packed into a u64 (at most 7: "FDEFASM"), never stored at a variable index:
    // the verifier refuses the pointer arithmetic that indexing a stack array compiles to.
    let (mut text, mut shift) = (0u64, 0u32);
    let mut put = |c: u8| {
        if shift < 56 {
            text |= u64::from(c) << shift;
            shift += 8;
        }
    };
    if has(0) {
        put(b'F');
    }
    // enum req_op (include/linux/blk_types.h): READ 0, WRITE 1, FLUSH 2, DISCARD 3, SECURE_ERASE 5.
    match flags & 0xff {
        0 => put(b'R'),
        1 => put(b'W'),
        2 => put(b'F'),
        3 => put(b'D'),
        5 => {
            put(b'D');
            put(b'E')
        }
        _ => put(b'N'),
    }
    for (i, c) in [(1, b'F'), (2, b'A'), (3, b'S'), (4, b'M')] {
        if has(i) {
            put(c);
        }
    }
    text.to_le_bytes()
}

/// The driver took request `k`: carry what was remembered at queueing (or, for a request issued
/// straight from the target's own context, start here, with its stack) into the in-flight table.
/// The stack is taken last: the verifier then walks the capture once, not once for every path
/// that reaches it with a different state (13,900 instructions walked before, 8,000 now).
#[inline(always)]
fn issued(ctx: *mut core::ffi::c_void, k: BlockKey, bytes: u32, rwbs: [u8; 8], rq: u64) {
    // SAFETY: the value is copied out before any other map operation.
    let queued = unsafe { BLOCK_QUEUED.get(&k) }.copied();
    // The raw tracepoint has the request: its bio names the block cgroup it is charged to and
    // the file it reads, whoever issues it (the cgroup throttle's kworker issues the bios over
    // the limit, long after the target queued them).
    let (cgroup, file) = if rq != 0 { bio_owner(rq, &crate::task::offsets()) } else { (0, FileId::default()) };
    let mut start = match (queued, current_target()) {
        (Some(q), _) => {
            let _ = BLOCK_QUEUED.remove(&k);
            q
        }
        (None, Some((pid, tid))) => BlockStart { pid, tid, cpu: crate::cpu(), ..Default::default() },
        (None, None) => {
            // SAFETY: u32 values copied out at once.
            let by_cg = if cgroup != 0 { unsafe { TARGET_BLKCG.get(&cgroup) }.copied() } else { None };
            let by_file = if file.ino != 0 { unsafe { TARGET_FILES.get(&file) }.copied() } else { None };
            match (by_cg, by_file) {
                (Some(pid), _) => BlockStart { pid, tid: 0, cpu: crate::cpu(), matched: BY_BLKCG, ..Default::default() },
                (None, Some(pid)) => BlockStart { pid, tid: 0, cpu: crate::cpu(), matched: BY_FILE, ..Default::default() },
                (None, None) => return,
            }
        }
    };
    if start.matched == 0 {
        start.matched = BY_ISSUER;
    }
    start.ino = file.ino;
    start.ino_dev = file.dev;
    start.bytes = bytes;
    start.rwbs = rwbs;
    start.issue_ns = now_ns();
    insert_lru(&BLOCK_INFLIGHT, &k, &start);
    if queued.is_none() && start.matched == BY_ISSUER {
        // Issued straight from the target's own context: the code path that made it.
        crate::stack::capture(ctx, probe_common::stack::STACK_IO, start.pid, start.tid, k.sector, 0, crate::stack::Take::EVENT);
    }
}

/// block:block_rq_complete (dev @8, sector @16, error @28): usually in interrupt context.
#[tracepoint(category = "block", name = "block_rq_complete")]
pub fn block_rq_complete(ctx: TracePointContext) -> u32 {
    let _ = try_block_rq_complete(&ctx);
    0
}

fn try_block_rq_complete(ctx: &TracePointContext) -> Result<(), i64> {
    let k = key(ctx, cpl::DEV, cpl::SECTOR)?;
    complete(k, field(ctx, cpl::ERROR).unwrap_or(0))
}

/// The same completion as a raw tracepoint (block_rq_complete(struct request *rq, blk_status_t
/// error, unsigned int nr_bytes)), preferred when the request offsets are known from BTF. A
/// classic tracepoint program is skipped by the kernel whenever any other tracepoint, kprobe or
/// perf BPF program is running on that CPU (one global guard), and completions arrive in
/// interrupts, on top of whatever runs there: some were lost. Raw tracepoints are only guarded
/// against themselves.
#[raw_tracepoint(tracepoint = "block_rq_complete")]
pub fn block_rq_complete_raw(ctx: RawTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let error: u64 = ctx.arg(1);
    let Some(key) = request_key(rq, &crate::task::offsets()) else { return 0 };
    // blk_status_t: 0 ok; the classic tracepoint gives an errno, so any failure reads as -EIO.
    let _ = complete(key, if error as u8 == 0 { 0 } else { -5 });
    0
}

#[inline(always)]
fn complete(k: BlockKey, error: i32) -> Result<(), i64> {
    // SAFETY: copied out before the remove below.
    let Some(start) = (unsafe { BLOCK_INFLIGHT.get(&k) }).copied() else { return Ok(()) };
    let _ = BLOCK_INFLIGHT.remove(&k);
    let mut hdr = header::<BlockIoEvent>(start.pid, start.tid);
    hdr.cpu = start.cpu;
    let ev = BlockIoEvent {
        hdr,
        dev: k.dev,
        bytes: start.bytes,
        sector: k.sector,
        insert_ns: start.insert_ns,
        issue_ns: start.issue_ns,
        complete_ns: hdr.ts_ns,
        rwbs: start.rwbs,
        error,
        matched: start.matched,
        ino: start.ino,
        ino_dev: start.ino_dev,
        _pad: 0,
    };
    emit(&ev);
    Ok(())
}
