//! The idle sweep: wait an interval (optionally restarting the server, dropping the model from
//! the page cache, or keeping it warm with 1-token requests), then send the one short request
//! whose latency shows what the idle time cost.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;

use super::{Run, api::Sampling, args::label, client, metrics::Sweep, shell, sweep, template, trace};

/// Sleep `d`, in steps, stopping on Ctrl-C; with keep-warm, a 1-token request every `every`.
fn idle_wait(run: &Run, d: Duration, keep_warm: bool, pings: &mut u64) {
    let start = Instant::now();
    let mut last = Instant::now();
    let s = Sampling { max_tokens: 1, ..run.sampling(1) };
    while start.elapsed() < d && !client::interrupted() {
        if keep_warm && last.elapsed() >= run.args.keep_warm_every {
            let (path, body) = run.args.api.generate("Hi", &s);
            let _ = client::stream(&run.url, path, &body, Duration::from_secs(60));
            *pings += 1;
            last = Instant::now();
        }
        run.progress.update(&format!("idle {:.0}/{:.0} s", start.elapsed().as_secs_f64(), d.as_secs_f64()));
        std::thread::sleep(Duration::from_millis(100).min(d.saturating_sub(start.elapsed())).max(Duration::from_millis(1)));
    }
}

/// What every idle level shares: its layers, the model file to drop, the prompt.
pub(super) struct IdleSetup {
    layers: Vec<String>,
    model_file: Option<PathBuf>,
    prompts: Vec<sweep::Prompt>,
}

pub(super) fn idle_setup(run: &mut Run) -> anyhow::Result<IdleSetup> {
    let mut layers = Vec::new();
    if run.args.restart_cmd.is_some() {
        layers.push("restart".to_string());
    }
    if run.args.drop_cache {
        layers.push("drop_cache".to_string());
    }
    if run.args.keep_warm {
        layers.push("keep_warm".to_string());
    }
    let model_file = if run.args.drop_cache {
        let f = run
            .args
            .model_file
            .clone()
            .or_else(|| run.info.model_path.clone().map(PathBuf::from).filter(|p| p.is_file()))
            .or_else(|| run.server_pid().and_then(trace::largest_mapped_file))
            .context("--drop-cache: cannot find the model file (pass --model-file)")?;
        run.notes.push(format!(
            "--drop-cache: posix_fadvise(DONTNEED) on {} before each idle request{}. DONTNEED cannot evict pages a live process maps: the model only goes cold when no process maps it (after --stop-cmd, or while the server has unloaded the model: llama-server --sleep-idle-seconds, Ollama keep_alive); model_resident_pct shows what was in the page cache just before each request",
            f.display(),
            if run.args.stop_cmd.is_some() { " and between --stop-cmd and --restart-cmd" } else { "" }
        ));
        Some(f)
    } else {
        None
    };
    if run.args.keep_warm {
        run.notes.push(format!(
            "--keep-warm (pinned worker): a 1-token request every {:?} during each idle wait, not recorded as rows",
            run.args.keep_warm_every
        ));
    }
    let prompts = sweep::instruction_prompts(&run.url, 1, run.info.model.as_deref(), true, &run.own_prompts);
    Ok(IdleSetup { layers, model_file, prompts })
}

pub(super) fn idle_one(run: &mut Run, setup: &IdleSetup, d: Duration) -> anyhow::Result<()> {
    let s = run.sampling(run.args.idle_max_tokens);
    let model_file = &setup.model_file;
    let mut pings = 0;
    if let Some(cmd) = run.args.restart_cmd.clone() {
        run.stop_trace();
        if let Some(stop) = run.args.stop_cmd.clone() {
            run.progress.update("stopping the server");
            shell(&stop, "--stop-cmd")?;
            let t = Instant::now();
            while trace::pid_listening(run.url.port).is_some() && t.elapsed() < run.args.health_timeout {
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Some(f) = model_file {
                trace::drop_cache(f)?;
            }
        }
        run.progress.update("restarting the server");
        shell(&cmd, "--restart-cmd")?;
        run.wait_healthy()?;
        run.start_trace()?;
    }
    idle_wait(run, d, run.args.keep_warm, &mut pings);
    if client::interrupted() {
        return Ok(());
    }
    let mut notes = Vec::new();
    if let Some(f) = model_file {
        trace::drop_cache(f)?;
    }
    let resident = model_file.as_deref().or(run.args.model_file.as_deref()).and_then(trace::resident_pct);
    let pid = run.server_pid();
    let (age, rss) = pid.map(trace::process_facts).unwrap_or((None, None));
    if let Some(r) = resident {
        notes.push(format!("model file {r:.0}% in the page cache before the request"));
    }
    if pings > 0 {
        notes.push(format!("keep-warm sent {pings} requests during the idle wait"));
    }
    let mut t = template(Sweep::Idle, label(d), 1);
    t.idle_s = Some(d.as_secs_f64());
    t.layers = setup.layers.clone();
    t.model_resident_pct = resident;
    t.server_pid = pid;
    t.process_age_s = age;
    t.server_rss_mib = rss;
    let (rows, mut level) = sweep::level(&run.ctx(), &t, &setup.prompts, 1, 1, &s);
    level.notes.extend(notes);
    run.push(rows, level);
    Ok(())
}
