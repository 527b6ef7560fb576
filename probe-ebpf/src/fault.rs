//! Page faults of the target: every major fault as a record (address + user IP), every user
//! fault counted in the kernel (minor faults are too frequent to send one by one).
use aya_ebpf::{
    EbpfContext,
    bindings::bpf_perf_event_data,
    macros::{perf_event, tracepoint},
    programs::{PerfEventContext, TracePointContext},
};
use probe_common::{
    Counter,
    fault::{FAULT_MAJOR, FaultEvent},
};

use crate::{count, current_target, emit, header};

/// perf software event PERF_COUNT_SW_PAGE_FAULTS_MAJ, period 1, opened per thread of the target
/// with inherit (so new threads and children count too). `bpf_perf_event_data.addr` is the
/// faulting address (PERF_SAMPLE_ADDR semantics), `regs.rip` the user IP at the fault.
#[perf_event]
pub fn fault_major(ctx: PerfEventContext) -> u32 {
    let _ = try_fault_major(&ctx);
    0
}

fn try_fault_major(ctx: &PerfEventContext) -> Result<(), i64> {
    let data = ctx.as_ptr() as *const bpf_perf_event_data;
    // SAFETY: the kernel passes a valid bpf_perf_event_data to perf_event programs; direct
    // context reads of `addr` and `regs` are allowed by the verifier for this program type.
    let (addr, ip) = unsafe { ((*data).addr, (*data).regs.rip) };
    // Per target thread, or per CPU (see stack::perf_target): only the targets' faults.
    let (pid, tid) = crate::stack::perf_target().ok_or(0i64)?;
    let ev = FaultEvent { hdr: header::<FaultEvent>(pid, tid), addr, ip, flags: FAULT_MAJOR, _pad: 0 };
    emit(&ev);
    crate::stack::capture(
        ctx.as_ptr().cast(),
        probe_common::stack::STACK_FAULT,
        ev.hdr.pid,
        ev.hdr.tid,
        addr,
        0,
        crate::stack::Take::EVENT,
    );
    Ok(())
}

/// exceptions:page_fault_user (address @8, ip @16, error_code @24): every user fault. Counted only.
#[tracepoint(category = "exceptions", name = "page_fault_user")]
pub fn page_fault_user(_ctx: TracePointContext) -> u32 {
    if current_target().is_some() {
        count(Counter::UserFaults);
    }
    0
}
