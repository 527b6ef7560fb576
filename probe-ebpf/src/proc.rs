//! The target set: a process the target forks joins it (Ollama runs its model in a child);
//! execs and whole-process exits are reported so userspace can follow and stop.
use aya_ebpf::{helpers::bpf_get_current_comm, macros::tracepoint, programs::TracePointContext};
use probe_common::{
    proc::{PROC_EXEC, PROC_EXIT, PROC_FORK, ProcEvent},
    tracepoints::{CLONE_THREAD, sched_process_exit as ex, task_newtask as nt},
};

use crate::{TARGETS, current_target, emit, field, header, insert};

#[inline(always)]
fn send(pid: u32, tid: u32, op: u32, child: u32, group_dead: u32) {
    let ev =
        ProcEvent { hdr: header::<ProcEvent>(pid, tid), op, child, group_dead, _pad: 0, comm: bpf_get_current_comm().unwrap_or([0; 16]) };
    emit(&ev);
}

/// task:task_newtask (pid @8, clone_flags @32): runs in the parent while it creates a task.
/// New threads already share the parent's tgid; a new process is added to TARGETS here, before
/// it can run, so nothing it does is missed.
#[tracepoint(category = "task", name = "task_newtask")]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let _ = try_task_newtask(&ctx);
    0
}

fn try_task_newtask(ctx: &TracePointContext) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    let flags: u64 = field(ctx, nt::CLONE_FLAGS)?;
    if flags & CLONE_THREAD != 0 {
        return Ok(());
    }
    let child: i32 = field(ctx, nt::PID)?;
    insert(&TARGETS, &(child as u32), &1u8);
    send(pid, tid, PROC_FORK, child as u32, 0);
    Ok(())
}

/// sched:sched_process_exec (filename, pid @12): the target (or a child) became another program.
#[tracepoint(category = "sched", name = "sched_process_exec")]
pub fn sched_process_exec(_ctx: TracePointContext) -> u32 {
    if let Some((pid, tid)) = current_target() {
        send(pid, tid, PROC_EXEC, 0, 0);
    }
    0
}

/// sched:sched_process_exit (pid @24, group_dead @32): a thread exits; when the group is dead
/// the process is gone and leaves the target set.
#[tracepoint(category = "sched", name = "sched_process_exit")]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let _ = try_sched_process_exit(&ctx);
    0
}

fn try_sched_process_exit(ctx: &TracePointContext) -> Result<(), i64> {
    let Some((pid, tid)) = current_target() else { return Ok(()) };
    let group_dead: u8 = field(ctx, ex::GROUP_DEAD)?;
    if group_dead != 0 {
        let _ = TARGETS.remove(&pid);
        send(pid, tid, PROC_EXIT, tid, 1);
    }
    Ok(())
}
