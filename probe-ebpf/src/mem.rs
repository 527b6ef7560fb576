//! Memory pressure in the target: direct reclaim (global, or against its memory cgroup's limit)
//! and compaction, timed from begin to end in the thread that did it (that time is spent on the
//! CPU, so off-CPU stacks do not see it), and OOM kills of a target process.
use aya_ebpf::{
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use probe_common::{
    mem::{MEM_COMPACTION, MEM_DIRECT_RECLAIM, MEM_MEMCG_RECLAIM, MEM_OOM_VICTIM, MemEvent},
    tracepoints::{mark_victim as ov, mm_compaction_end as ce, mm_vmscan_direct_reclaim_end as dre, mm_vmscan_memcg_reclaim_end as mre},
};

use crate::{TARGETS, current_target, emit, field, header, insert_lru, now_ns};

/// Begin time of a reclaim or compaction in progress, by (tid << 8 | what).
#[map(name = "MEM_SINCE")]
static MEM_SINCE: LruHashMap<u64, u64> = LruHashMap::with_max_entries(16384, 0);

#[inline(always)]
fn begin(what: u32) {
    if let Some((_, tid)) = current_target() {
        insert_lru(&MEM_SINCE, &(((tid as u64) << 8) | what as u64), &now_ns());
    }
}

#[inline(always)]
fn end(what: u32, nr: u64) {
    let Some((pid, tid)) = current_target() else { return };
    let key = ((tid as u64) << 8) | what as u64;
    // SAFETY: the value is copied out before the remove.
    let Some(since) = (unsafe { MEM_SINCE.get(&key) }).copied() else { return };
    let _ = MEM_SINCE.remove(&key);
    emit(&MemEvent { hdr: header::<MemEvent>(pid, tid), what, victim: 0, begin_ns: since, nr });
}

#[tracepoint(category = "vmscan", name = "mm_vmscan_direct_reclaim_begin")]
pub fn direct_reclaim_begin(_ctx: TracePointContext) -> u32 {
    begin(MEM_DIRECT_RECLAIM);
    0
}

#[tracepoint(category = "vmscan", name = "mm_vmscan_direct_reclaim_end")]
pub fn direct_reclaim_end(ctx: TracePointContext) -> u32 {
    if let Ok(nr) = field::<u64>(&ctx, dre::NR_RECLAIMED) {
        end(MEM_DIRECT_RECLAIM, nr);
    }
    0
}

#[tracepoint(category = "vmscan", name = "mm_vmscan_memcg_reclaim_begin")]
pub fn memcg_reclaim_begin(_ctx: TracePointContext) -> u32 {
    begin(MEM_MEMCG_RECLAIM);
    0
}

#[tracepoint(category = "vmscan", name = "mm_vmscan_memcg_reclaim_end")]
pub fn memcg_reclaim_end(ctx: TracePointContext) -> u32 {
    if let Ok(nr) = field::<u64>(&ctx, mre::NR_RECLAIMED) {
        end(MEM_MEMCG_RECLAIM, nr);
    }
    0
}

#[tracepoint(category = "compaction", name = "mm_compaction_begin")]
pub fn compaction_begin(_ctx: TracePointContext) -> u32 {
    begin(MEM_COMPACTION);
    0
}

#[tracepoint(category = "compaction", name = "mm_compaction_end")]
pub fn compaction_end(ctx: TracePointContext) -> u32 {
    if let Ok(status) = field::<i32>(&ctx, ce::STATUS) {
        end(MEM_COMPACTION, status as u64);
    }
    0
}

/// oom:mark_victim (pid @8, anon_rss @24, file_rss @32 in KiB): runs in the task that triggered
/// the OOM killer, which may be any process; sent when the victim is a target.
#[tracepoint(category = "oom", name = "mark_victim")]
pub fn oom_mark_victim(ctx: TracePointContext) -> u32 {
    let _ = try_oom(&ctx);
    0
}

fn try_oom(ctx: &TracePointContext) -> Result<(), i64> {
    let victim: i32 = field(ctx, ov::PID)?;
    let victim = victim as u32;
    // SAFETY: the value is a u8 copied out immediately.
    if unsafe { TARGETS.get(&victim) }.is_none() {
        return Ok(());
    }
    let anon: u64 = field(ctx, ov::ANON_RSS)?;
    let file: u64 = field(ctx, ov::FILE_RSS)?;
    let tid = aya_ebpf::helpers::bpf_get_current_pid_tgid() as u32;
    let mut hdr = header::<MemEvent>(victim, tid);
    hdr.pid = victim;
    emit(&MemEvent { hdr, what: MEM_OOM_VICTIM, victim, begin_ns: hdr.ts_ns, nr: anon + file });
    Ok(())
}
