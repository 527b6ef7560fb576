//! The subcommands: one module each, with its clap `Args` and its `run` (main.rs holds the
//! command list, completions and man pages), and the parsers of the values they take.
use std::time::Duration;

pub mod bundle;
pub mod diff;
pub mod doctor;
pub mod export;
pub mod flamegraph;
pub mod report;
pub mod timeline;
pub mod trace;
pub mod watch;

/// The highest `--hz`: perf refuses rates above its `perf_event_max_sample_rate`, and more than
/// this per thread only measures probe itself.
/// The context of every command's error when a recording directory cannot be read.
pub fn cannot_read(dir: &std::path::Path) -> String {
    format!("cannot read the recording in {}", dir.display())
}

pub const MAX_HZ: u64 = 10_000;

/// The largest ring buffer (`--ring-mb`); `ring_mb << 20` must fit the kernel's u32.
pub const MAX_RING_MB: u32 = 1024;

/// The smallest `--max-size`: the start of a recording (meta, maps) takes tens of KiB.
pub const MIN_MAX_SIZE: u64 = 64 << 10;

/// `--duration`: `30s`, `2m`, `500ms`, `1h 30m` (humantime); a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::parse_duration_or(s, Duration::from_secs(1))
}

/// `trace --duration`: a duration, not zero (a trace of nothing).
pub fn parse_trace_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("a trace of 0 seconds records nothing: give a duration such as 30s, or leave it out to trace until Ctrl-C".into());
    }
    Ok(d)
}

/// `watch --window`/`--segment`: a duration of at least a second.
pub fn parse_window(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!("`{s}` is under a second: give e.g. 2m"));
    }
    Ok(d)
}

/// `--ring-mb`: a power of two from 1 to [`MAX_RING_MB`].
pub fn parse_ring_mb(s: &str) -> Result<u32, String> {
    let n: u32 = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number of MiB"))?;
    if n == 0 || n > MAX_RING_MB || !n.is_power_of_two() {
        return Err(format!("must be a power of two from 1 to {MAX_RING_MB} (MiB), e.g. 16"));
    }
    Ok(n)
}

/// `--sample-hz`: a finite number from 0 (off) to 1000.
pub fn parse_sample_hz(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() || !(0.0..=1000.0).contains(&v) {
        return Err(format!("`{s}` is out of range: give 0 (off) to 1000 samples per second"));
    }
    Ok(v)
}

/// `--python-budget`: a percentage of one core.
pub fn parse_budget(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().trim_end_matches('%').parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() || !(0.0..=100.0).contains(&v) {
        return Err(format!("`{s}` is out of range: give 0 (no limit) to 100 (percent of one core)"));
    }
    Ok(v)
}

/// `--max-size`: bytes, or a number with K, M, G or T (powers of 1024; `B`/`iB` may follow).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{s}`: unknown unit `{c}`: use K, M, G or T (e.g. 500M)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: f64 = num.trim().parse().map_err(|_| format!("`{s}` is not a size: use e.g. 500M, 2G or a number of bytes"))?;
    let bytes = n * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < MIN_MAX_SIZE as f64 || bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("`{s}` is out of range: give at least {} KiB, e.g. 100M", MIN_MAX_SIZE >> 10));
    }
    Ok(bytes as u64)
}

/// The size the user gave, written back the same way (for the end reason).
pub fn max_size_text(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

pub fn watch_scope(s: &str) -> Result<crate::watch::scope::Scope, String> {
    crate::watch::scope::Scope::parse(s)
}

pub fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("`{s}`: give a label as KEY=VALUE"))?;
    let ok = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !k.starts_with(|c: char| c.is_ascii_digit());
    if !ok {
        return Err(format!("`{k}` is not a label name: letters, digits and _, not starting with a digit"));
    }
    Ok((k.to_string(), v.to_string()))
}
