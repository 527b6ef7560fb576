//! What probe shows people, each from the analysis: the text summary, the HTML page, Markdown
//! and the bug-report bundle, the Perfetto timeline, flamegraphs, pprof and OTLP.
//! (The live view of `probe trace` is the collector's: it is made from records as they come.)
pub mod bundle;
pub mod diff;
pub mod export;
pub mod flame;
pub mod html;
pub mod perfetto;
pub mod system;
pub mod text;

use crate::analysis::report::Unwind;

/// How many user stacks unwound to the end, "93% of 1200": the one wording the summary, the
/// page and the bundle say it in.
pub fn unwound_share(u: &Unwind) -> String {
    format!("{:.0}% of {}", u.success_rate * 100.0, u.samples)
}

/// The stacks sentence's tail, "user stacks unwound to the end: 93% of 1200 (1.5 us each)";
/// `micro` is the microsecond sign the output can show ("us" in text, "µs" on the page).
pub fn unwound(u: &Unwind, micro: &str) -> String {
    format!("user stacks unwound to the end: {} ({:.1} {micro} each)", unwound_share(u), u.us_per_sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwound_says_share_count_and_cost() {
        let u = Unwind { success_rate: 0.934, samples: 1200, us_per_sample: 1.46, ..Default::default() };
        assert_eq!(unwound_share(&u), "93% of 1200");
        assert_eq!(unwound(&u, "µs"), "user stacks unwound to the end: 93% of 1200 (1.5 µs each)");
    }
}
