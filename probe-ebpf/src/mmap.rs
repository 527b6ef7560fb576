//! Memory-map syscalls of the target (mmap, munmap, mremap, madvise, mlock, munlock, mlock2,
//! mprotect): arguments saved at `sys_enter_*`, one record at `sys_exit_*` with the result.
//! The file behind a mapping is resolved in userspace from /proc/PID/maps right after.
use aya_ebpf::{
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use probe_common::{
    kernel::NAME_LEN,
    mmap::{MmapArgs, MmapEvent, MmapOp},
    tracepoints::{SYSCALL_ARG0, SYSCALL_RET},
};

use crate::{current_target, emit, field, header, insert_lru, now_ns, task::file_of_fd};

/// Arguments of a syscall in progress, by tid.
#[map(name = "MMAP_ARGS")]
static MMAP_ARGS: LruHashMap<u32, MmapArgs> = LruHashMap::with_max_entries(4096, 0);

#[inline(always)]
fn enter(ctx: &TracePointContext, op: MmapOp, nargs: usize) -> Result<(), i64> {
    let Some((_, tid)) = current_target() else { return Ok(()) };
    let mut a = [0u64; 6];
    let mut i = 0;
    while i < 6 {
        if i < nargs {
            a[i] = field(ctx, SYSCALL_ARG0 + 8 * i)?;
        }
        i += 1;
    }
    let mut args = MmapArgs {
        op: op as u32,
        fd: -1,
        addr: a[0],
        len: a[1],
        arg2: a[2],
        arg3: a[3],
        arg4: a[4],
        enter_ns: now_ns(),
        ino: 0,
        dev: 0,
        _pad: 0,
        name: [0; NAME_LEN],
    };
    // mmap(addr, len, prot, flags, fd, off): name the file while the fd surely exists.
    if let MmapOp::Mmap = op {
        args.fd = a[4] as i32;
        args.arg4 = a[5];
        if let Some((ino, dev)) = file_of_fd(args.fd, &mut args.name) {
            args.ino = ino;
            args.dev = dev;
        }
    }
    insert_lru(&MMAP_ARGS, &tid, &args);
    Ok(())
}

#[inline(always)]
fn exit(ctx: &TracePointContext) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    // SAFETY: copied out before the remove below.
    let Some(a) = (unsafe { MMAP_ARGS.get(&tid) }).copied() else {
        crate::count(probe_common::Counter::Unmatched);
        return Ok(());
    };
    let _ = MMAP_ARGS.remove(&tid);
    let ret: i64 = field(ctx, SYSCALL_RET)?;
    // A file mapped executable (mmap's prot, PROT_EXEC): a library loaded.
    if a.op == MmapOp::Mmap as u32 && a.arg2 & 4 != 0 && a.fd >= 0 && ret >= 0 {
        crate::count(probe_common::Counter::ExecMaps);
    }
    let ev = MmapEvent {
        hdr: header::<MmapEvent>(pid, tid),
        op: a.op,
        fd: a.fd,
        addr: a.addr,
        len: a.len,
        arg2: a.arg2,
        arg3: a.arg3,
        arg4: a.arg4,
        ret,
        enter_ns: a.enter_ns,
        ino: a.ino,
        dev: a.dev,
        _pad: 0,
        name: a.name,
    };
    emit(&ev);
    Ok(())
}

/// One enter/exit program pair per syscall (syscalls:sys_enter_X args @16+8i, sys_exit_X ret @16).
macro_rules! syscall_pair {
    ($enter:ident, $exit:ident, $tp_enter:literal, $tp_exit:literal, $op:expr, $nargs:literal) => {
        #[tracepoint(category = "syscalls", name = $tp_enter)]
        pub fn $enter(ctx: TracePointContext) -> u32 {
            let _ = enter(&ctx, $op, $nargs);
            0
        }
        #[tracepoint(category = "syscalls", name = $tp_exit)]
        pub fn $exit(ctx: TracePointContext) -> u32 {
            let _ = exit(&ctx);
            0
        }
    };
}

syscall_pair!(mmap_enter, mmap_exit, "sys_enter_mmap", "sys_exit_mmap", MmapOp::Mmap, 6);
syscall_pair!(munmap_enter, munmap_exit, "sys_enter_munmap", "sys_exit_munmap", MmapOp::Munmap, 2);
syscall_pair!(mremap_enter, mremap_exit, "sys_enter_mremap", "sys_exit_mremap", MmapOp::Mremap, 5);
syscall_pair!(madvise_enter, madvise_exit, "sys_enter_madvise", "sys_exit_madvise", MmapOp::Madvise, 3);
syscall_pair!(mlock_enter, mlock_exit, "sys_enter_mlock", "sys_exit_mlock", MmapOp::Mlock, 2);
syscall_pair!(munlock_enter, munlock_exit, "sys_enter_munlock", "sys_exit_munlock", MmapOp::Munlock, 2);
syscall_pair!(mlock2_enter, mlock2_exit, "sys_enter_mlock2", "sys_exit_mlock2", MmapOp::Mlock2, 3);
syscall_pair!(mprotect_enter, mprotect_exit, "sys_enter_mprotect", "sys_exit_mprotect", MmapOp::Mprotect, 3);
