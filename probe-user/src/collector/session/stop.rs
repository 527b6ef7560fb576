//! The end of a session: [`stop`] (the programs switched off, what was captured drained, the
//! samplers stopped, the recording closed) and [`write_outputs`] (one analysis, every output).
use std::time::Instant;

use probe_common::EventKind;

use super::{Programs, Session, Source, Stopped};
use crate::collector::{DRAIN_RECORDS, SAMPLER_STOP, State, TraceOptions, stats};
use crate::{
    analysis::report::Report,
    kernel::probes,
    monotonic_ns,
    record::records::{self, UserRecord},
    sampler::Sampler,
};

/// Stop in this order. The counters are read at the stop (the programs' run counts, the losses)
/// and the programs are detached at once, on their own thread (the maps taken at arming stay):
/// closing a classic tracepoint waits for RCU grace periods, one tracepoint after another in the
/// kernel (about 2 s for 64 programs on a 2-CPU VM), so that runs while the ring is drained and
/// the report is made. Then everything captured up to the stop is drained (records made after it
/// are not part of the trace), the samplers are stopped with a deadline, and the recording ends.
pub(super) fn stop(
    st: &mut State,
    se: Session,
    sampler: Sampler,
    reason: &str,
    out_dir: &crate::util::output::OutDir,
    stopping: Instant,
) -> anyhow::Result<Stopped> {
    let stop_ns = monotonic_ns();
    let Session { mut kernel, bpf_unmeasured, .. } = se;
    if let Source::Own { attached, .. } = &mut kernel {
        probes::switch_off(&mut attached.ebpf);
    }
    if let Source::Member(m) = &mut kernel {
        // The kernel stops following this server; what the hub routed before is still queued.
        let pids: Vec<u32> = st.targets.lock().map(|t| t.clone()).unwrap_or_default();
        m.leave(&pids);
    }
    let runs = kernel.runs();
    let skipped = probes::skipped_runs(&runs);
    let (lost, counters) = (kernel.lost(), kernel.counters());
    // probe watch goes on to its next session: detach meanwhile, on a thread. probe trace exits
    // once its outputs are written, and hands the programs off then (see probes::hand_off).
    let (programs, mut rest): (Programs, Box<dyn crate::collector::Records>) = match kernel {
        Source::Member(m) => (Programs::Shared, m),
        Source::Own { ring, attached, .. } if st.watch.is_some() => (
            Programs::Detaching(std::thread::Builder::new().name("probe-detach".into()).spawn(move || probes::detach(*attached)).ok()),
            Box::new(ring.into_inner()),
        ),
        Source::Own { ring, attached, .. } => (Programs::Attached(attached), Box::new(ring.into_inner())),
    };
    // What was copied out unread comes first, all of it.
    let mut spilled = std::mem::take(&mut st.spill);
    while let Some(r) = crate::collector::Records::take(&mut spilled, &mut |item| st.on_record(item)) {
        r?;
    }
    let mut after_stop = 0usize;
    let records = rest.as_mut();
    loop {
        let mut late = false;
        let took = records.take(&mut |item| {
            // The header's ts_ns (probe-common EventHeader: four u32, then the u64 timestamp).
            let ts = item.get(16..24).and_then(|b| b.try_into().ok()).map_or(0, u64::from_ne_bytes);
            if ts > stop_ns {
                late = true;
                return Ok(());
            }
            st.on_record(item)
        });
        match took {
            None => break,
            Some(r) => r?,
        }
        // The ring is in reservation order: once this many later records were seen, what came
        // before the stop has been read.
        if late {
            after_stop += 1;
            if after_stop >= DRAIN_RECORDS {
                break;
            }
        }
    }
    drop(rest);
    log::info!("stop: ring drained at {:?}", stopping.elapsed());
    let (rest, abandoned) = sampler.stop(SAMPLER_STOP);
    log::info!("stop: samplers stopped at {:?}", stopping.elapsed());
    for name in abandoned {
        say!("probe: the {name} thread did not stop within {} ms; left behind", SAMPLER_STOP.as_millis());
    }
    // After a full disk: give back the reserve and write the end of the recording into it.
    let full = st.writer.resume();
    if full.is_some() {
        out_dir.release_reserve();
    }
    for v in rest {
        st.writer.sample(&v)?;
    }
    st.refresh()?;
    st.streams.finish();
    st.write_requests()?;
    // Threads still blocked when the trace ended: blocked until now.
    let now = monotonic_ns();
    for (_, mut v) in std::mem::take(&mut st.offcpu) {
        v.blocked_ns = Some(now.saturating_sub(v.ts_ns));
        v.still_blocked = true;
        st.writer.stack(&v)?;
    }
    if let Some(cut) = st.cut_frames() {
        st.writer.record(&cut)?;
    }
    st.writer.record(&stats(&lost, &counters, st, &runs, bpf_unmeasured.as_deref()))?;
    st.writer.record(&UserRecord::End(records::End { ts_ns: monotonic_ns(), reason: reason.to_string() }))?;
    st.writer.flush()?;
    let full_again = st.writer.disk_full().is_some();
    Ok(Stopped { lost, skipped, full, full_again, programs })
}

/// One analysis (streamed from the file: memory does not grow with the trace's length) and one
/// symbolization for every output. report.json first: on a full disk it is what matters.
pub(super) fn write_outputs(
    opts: &TraceOptions,
    st: State,
    stopped: &Stopped,
    reason: &str,
    out_dir: &crate::util::output::OutDir,
    stopping: Instant,
) -> anyhow::Result<Report> {
    let parsed = st.per_kind[EventKind::Data as usize];
    let kept = if st.capture_text { "kept with --capture-text" } else { "parsed in memory, not stored" };
    let skipped_total: u64 = stopped.skipped.values().sum();
    let skipped_note = if skipped_total > 0 {
        format!(", {skipped_total} program runs skipped by the kernel (another BPF program was running on that CPU)")
    } else {
        String::new()
    };
    // Room for the outputs: the reserve is not needed any more.
    out_dir.release_reserve();
    if stopped.full.is_none() {
        say!(
            "probe: stopped: {reason}; {} events received ({parsed} stream records {kept}), {} lost{skipped_note}",
            // What the last stats record counts, and so report.json's `events_received`.
            st.per_kind.iter().sum::<u64>(),
            stopped.lost.iter().sum::<u64>()
        );
    }
    log::info!("stop: recording closed at {:?}", stopping.elapsed());
    let analysis = crate::analysis::Analysis::of_dir(&opts.out, crate::analysis::Needs::ALL)?;
    let report = &analysis.report;
    log::info!("stop: recording analysed at {:?}", stopping.elapsed());
    let report_written = out_dir.write("report.json", &serde_json::to_vec_pretty(&report)?);
    if let Some(f) = &stopped.full {
        let what = f.error.to_string();
        let what = what.split(" (os error").next().unwrap_or_default();
        let end = if stopped.full_again { "; the end record did not fit either" } else { "" };
        let rep = match &report_written {
            Ok(_) => "report written from it".to_string(),
            Err(e) => format!("report.json not written ({e:#}): `probe report {}` reads it once there is room", opts.out.display()),
        };
        say!(
            "probe: stopped: the disk holding {} is full ({}) after {} events; the recording holds everything up to that point{end}; {rep}",
            opts.out.display(),
            what,
            f.events_written
        );
    } else {
        report_written?;
    }
    drop(st);
    let drawn = crate::render::flame::draw_all(&analysis.flames);
    match crate::render::html::write_for(&analysis, &drawn, out_dir) {
        Ok(page) => say!("probe: {}", page.display()),
        Err(e) => say!("probe: report.html not written: {e:#}"),
    }
    match crate::render::flame::write_defaults(&analysis.flames, &drawn, out_dir) {
        Ok(written) => {
            for (path, weight) in written {
                say!("probe: flamegraph {} (weight {weight})", path.display());
            }
        }
        Err(e) => say!("probe: flamegraphs not written: {e}"),
    }
    if let Some(ep) = &opts.otlp {
        let spans = crate::render::export::otlp::from_report(report, &analysis.meta, None);
        match ep.send(&spans) {
            Ok(_) => say!("probe: sent {} request spans to the OTLP collector", spans.spans.len()),
            Err(e) => say!("probe: request spans not sent to the OTLP collector: {e} (`probe export --otlp URL` sends them later)"),
        }
    }
    log::info!("stop: outputs written at {:?}", stopping.elapsed());
    Ok(analysis.report)
}
