//! The one percentile definition every output uses (report.json, the summaries, `probe bench`):
//! linear interpolation between the two nearest ranks, numpy's default and what `vllm bench
//! serve` reports. p50 of [1, 2, 3, 4] is 2.5.

/// The `p`th percentile (0–100) of `v`, in any order; None when empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    percentile_sorted(&s, p)
}

/// [`percentile`] of values already sorted ascending.
pub fn percentile_sorted(s: &[f64], p: f64) -> Option<f64> {
    if s.is_empty() {
        return None;
    }
    let r = p.clamp(0.0, 100.0) / 100.0 * (s.len() - 1) as f64;
    let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
    Some(s[lo] + (s[hi] - s[lo]) * (r - lo as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_between_ranks() {
        assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), Some(2.5));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.0), Some(1.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 100.0), Some(4.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 90.0), Some(4.6));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
