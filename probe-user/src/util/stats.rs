//! The one percentile definition every output uses (report.json, the summaries, `probe bench`):
//! linear interpolation between the two nearest ranks, numpy's default and what `vllm bench
//! serve` reports. p50 of [1, 2, 3, 4] is 2.5.

/// The `p`th percentile (0–100) of `v`, in any order; None when empty.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    percentile_sorted(&s, p)
}

/// The arithmetic mean; None when empty.
pub fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
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

/// A 95% confidence interval of a mean: `mean ± t(0.975, n-1) · sd / √n` (Student's t, the
/// sample standard deviation). It bounds where the mean of repeated runs lies, not where the
/// next single run falls (that is a prediction interval, wider by √(n+1)).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Interval {
    pub mean: f64,
    pub lo: f64,
    pub hi: f64,
    pub sd: f64,
    pub n: usize,
}

/// Student's t, two-sided 95% (0.975 quantile), by degrees of freedom 1..=30; 1.96 beyond.
const T975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093,
    2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
];

pub fn t975(df: usize) -> f64 {
    if df == 0 { f64::INFINITY } else { T975.get(df - 1).copied().unwrap_or(1.96) }
}

/// The 95% interval of the mean of `v`; None under two values.
pub fn interval(v: &[f64]) -> Option<Interval> {
    let n = v.len();
    if n < 2 {
        return None;
    }
    let mean = v.iter().sum::<f64>() / n as f64;
    let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
    let half = t975(n - 1) * sd / (n as f64).sqrt();
    Some(Interval { mean, lo: mean - half, hi: mean + half, sd, n })
}

impl Interval {
    /// The two intervals share no value: the means differ beyond their noise.
    pub fn apart(&self, o: &Interval) -> bool {
        self.hi < o.lo || o.hi < self.lo
    }
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

    #[test]
    fn t_interval_of_the_mean() {
        assert_eq!(interval(&[5.0]), None);
        let i = interval(&[9.0, 10.0, 11.0]).unwrap();
        // sd 1, t(2) 4.303: 10 ± 4.303/√3.
        assert_eq!((i.mean, i.sd, i.n), (10.0, 1.0, 3));
        assert!((i.hi - 10.0 - 4.303 / 3f64.sqrt()).abs() < 1e-9, "{i:?}");
        let far = interval(&[20.0, 21.0, 22.0]).unwrap();
        assert!(i.apart(&far) && far.apart(&i));
        assert!(!i.apart(&interval(&[11.0, 12.0, 13.0]).unwrap()));
        assert_eq!(t975(40), 1.96);
    }
}
