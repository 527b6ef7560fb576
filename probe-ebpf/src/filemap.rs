//! Page-cache fills in the target's context: which file (device + inode) the disk reads are for.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use probe_common::{filemap::FilemapEvent, tracepoints::mm_filemap_add_to_page_cache as fm};

use crate::{current_target, emit, field, header};

/// filemap:mm_filemap_add_to_page_cache (i_ino @16, index @24, s_dev @32, order @36): one folio
/// enters the page cache. It runs in the task that caused the read (syscall, readahead, fault).
#[tracepoint(category = "filemap", name = "mm_filemap_add_to_page_cache")]
pub fn filemap_add(ctx: TracePointContext) -> u32 {
    let _ = try_filemap_add(&ctx);
    0
}

fn try_filemap_add(ctx: &TracePointContext) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    let order: u8 = field(ctx, fm::ORDER)?;
    let ev = FilemapEvent {
        hdr: header::<FilemapEvent>(pid, tid),
        ino: field(ctx, fm::I_INO)?,
        index: field(ctx, fm::INDEX)?,
        dev: field(ctx, fm::S_DEV)?,
        order: order as u32,
    };
    emit(&ev);
    Ok(())
}
