//! probe: eBPF tracing for local LLM servers. The `probe` binary is a thin layer over this library,
//! whose folders are the data path's layers, lowest first (README, "Layout"; tests/layers.rs keeps
//! every import pointing down): `os` and `util`; `record` (the recording) and `stream` (requests
//! from socket bytes); `analysis` (the one read, the report, verdicts); `render` (every output);
//! the live parts `kernel`, `sampler`, `collector`, `watch` and `bench`; `cmd`.

pub mod analysis;
pub mod bench;
pub mod cmd;
pub mod collector;
pub mod kernel;
pub mod os;
pub mod record;
pub mod render;
pub mod sampler;
pub mod stream;
pub mod util;
pub mod watch;

/// Exit codes of the `probe` binary (documented in README.md).
pub mod exit {
    /// Everything asked for was traced, nothing was lost.
    pub const OK: i32 = 0;
    /// A recording was written, but some probes were skipped or some events were lost.
    pub const PARTIAL: i32 = 1;
    /// Nothing useful happened: bad arguments, no such pid, no permission, kernel refused.
    pub const ERROR: i32 = 2;
    /// `probe bench --fail-on-regression`: a figure got worse than the gate allows.
    pub const REGRESSION: i32 = 3;
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns()` and of every record.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A duration with `default_unit` for a bare number (`2.5` → 2.5 of it); anything with a unit
/// is read by humantime (`500ms`, `30s`, `10m`, `1h 30m`).
pub fn parse_duration_or(s: &str, default_unit: std::time::Duration) -> Result<std::time::Duration, String> {
    let s = s.trim();
    if let Ok(n) = s.parse::<f64>() {
        return if n.is_finite() && n >= 0.0 {
            Ok(default_unit.mul_f64(n))
        } else {
            Err(format!("`{s}` is not a duration: give a number and a unit, e.g. 500ms, 30s, 10m, 1h"))
        };
    }
    humantime::parse_duration(s).map_err(|_| format!("`{s}` is not a duration: give a number and a unit, e.g. 500ms, 30s, 10m, 1h"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A bad duration says which forms are accepted, not the parser's internals.
    #[test]
    fn a_bad_duration_names_the_accepted_forms() {
        assert_eq!(super::parse_duration_or("2.5", Duration::from_secs(1)).unwrap(), Duration::from_millis(2500));
        assert_eq!(super::parse_duration_or("500ms", Duration::from_secs(1)).unwrap(), Duration::from_millis(500));
        let e = super::parse_duration_or("abc", Duration::from_secs(1)).unwrap_err();
        assert_eq!(e, "`abc` is not a duration: give a number and a unit, e.g. 500ms, 30s, 10m, 1h");
        assert!(super::parse_duration_or("-1", Duration::from_secs(1)).unwrap_err().contains("e.g. 500ms"));
    }
}
