//! `probe diff`: what changed between a slow request and a fast one, or between two recordings.
//! Both sides are sets of requests of an [`Analysis`] (one request, the warm baseline, every
//! request of a recording); the diff sets their verdicts side by side (the TTFT split first,
//! then token gaps and stop causes), draws differential flamegraphs with inferno, and says what
//! was different around them: files read, the model's page-cache residency, competitors for the
//! CPU, the server's command line, build and model file, the kernel and the clocks. Only what
//! differs is said. [`Diff`] is diff.json; `render::diff` draws and writes it.
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::{
    analysis::Analysis,
    analysis::flame::{Folded, Kind},
    analysis::report::{Report, Request},
    analysis::verdict::{SlowCause, Split, SplitPart},
};

crate::closed_set! {
    /// What a diff compares: requests of one recording, or two recordings.
    Mode {
        #[default]
        Requests = "requests",
        Recordings = "recordings",
    }
}

crate::closed_set! {
    /// What a differential flamegraph's weights are divided by on each side.
    Normalised {
        #[default]
        PerRequest = "per request",
        PerGeneratedToken = "per generated token",
    }
}

/// diff.json's layout version.
pub const SCHEMA_VERSION: u32 = 1;

/// A part of the TTFT split moved by less than this (ms, and share of the TTFT change) is not
/// named as the explanation.
const MIN_PART_MS: f64 = 5.0;

/// A frame "grew" or "shrank" when its weight moved by at least this share of the larger
/// side's total, and by more than three standard deviations of sampling noise (on-CPU
/// samples and counts: √(a+b)).
pub const FRAME_SHARE: f64 = 0.05;

/// The on-CPU work per token (or request) is "nearly unchanged" when its total moved by less
/// than this share and no frame grew or shrank.
const SAME_TOTAL: f64 = 0.15;

/// How a side's requests were chosen, in words (diff.md says it).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Side {
    /// The recording directory.
    pub dir: String,
    /// "request 3 (the slowest first token)", "the warm baseline: requests 4, 5", "every request (12)".
    pub label: String,
    pub requests: Vec<u64>,
    /// Output tokens over its requests (usage, the server's timings, else content chunks).
    pub tokens: u64,
}

/// A figure on both sides (A, the baseline; B, the one being explained) and B − A.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Delta {
    pub a: f64,
    pub b: f64,
    pub delta: f64,
}

impl Delta {
    fn of(a: f64, b: f64) -> Delta {
        Delta { a, b, delta: b - a }
    }
    pub fn pct(&self) -> Option<f64> {
        (self.a.abs() > 1e-9).then(|| self.delta * 100.0 / self.a)
    }
}

/// One part of the TTFT split (crate::analysis::verdict::Split), mean per request, ms.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Part {
    pub part: SplitPart,
    #[serde(flatten)]
    pub ms: Delta,
}

/// How many requests of a side ended (or were slow) for a cause.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Count {
    pub cause: String,
    pub a: u64,
    pub b: u64,
}

/// A file read from disk before the first token, mean bytes per request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FileDelta {
    pub path: String,
    pub a_bytes: f64,
    pub b_bytes: f64,
}

/// A model file's share in the page cache before the requests (mean over them), 0–1.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ResidentDelta {
    pub path: String,
    pub a: Option<f64>,
    pub b: Option<f64>,
}

/// Another process holding a CPU the server waited for, mean ms per request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CompetitorDelta {
    pub who: String,
    pub a_ms: f64,
    pub b_ms: f64,
}

/// Something about the server or the machine that differs between the two recordings.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Change {
    pub what: String,
    pub a: String,
    pub b: String,
}

/// A frame (a function, a wait class) whose weight moved, normalised.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FrameDelta {
    pub frame: String,
    pub a: f64,
    pub b: f64,
}

/// One kind's differential flamegraph.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FlameDiff {
    /// cpu, offcpu.
    pub kind: String,
    /// samples, us.
    pub unit: String,
    /// "per request" or "per generated token": what each side's weights are divided by.
    pub normalised: Normalised,
    /// Those numbers: requests or generated tokens of each side.
    pub a_n: f64,
    pub b_n: f64,
    /// Each side's total weight per request or token.
    pub total: Delta,
    /// Frames (inclusive weight) that grew and shrank beyond noise, largest change first.
    pub grew: Vec<FrameDelta>,
    pub shrank: Vec<FrameDelta>,
    /// The share of the weight that moved between stacks: Σ|b − a| / (Σa + Σb), 0–1.
    pub moved: f64,
    /// No frame grew or shrank and the total moved by under 15%.
    pub nearly_unchanged: bool,
    /// The files written (names in the output directory).
    pub svg: String,
    pub folded: String,
}

/// diff.json.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Diff {
    pub schema_version: u32,
    /// "requests" (sides chosen by request) or "recordings" (every request of each).
    pub mode: Mode,
    pub a: Side,
    pub b: Side,
    /// The one sentence a maintainer can act on.
    pub headline: String,
    /// Mean TTFT per request, ms, and each part of its split.
    pub ttft_ms: Option<Delta>,
    pub split: Vec<Part>,
    /// The part that explains most of the TTFT change, and how much of it.
    pub explained_by: Option<SplitPart>,
    pub explained_share: Option<f64>,
    /// Decode time per generated token after the first (content chunk times), ms.
    pub per_token_ms: Option<Delta>,
    /// The slowest token gap (p99 of each request's gaps, mean), ms.
    pub gap_p99_ms: Option<Delta>,
    pub e2e_ms: Option<Delta>,
    /// Output tokens per request.
    pub tokens: Option<Delta>,
    pub slow_causes: Vec<Count>,
    pub stop_causes: Vec<Count>,
    pub files: Vec<FileDelta>,
    pub model_resident: Vec<ResidentDelta>,
    pub competitors: Vec<CompetitorDelta>,
    /// Major page faults and pages swapped in, per request (recordings) when they differ.
    pub faults: Vec<Change>,
    /// What differs about the server and the machine (recordings only; empty when the same).
    pub setup: Vec<Change>,
    /// What makes the two not the same server: a different build or model file. `probe diff`
    /// refuses these without --force.
    pub mismatch: Vec<String>,
    pub flames: Vec<FlameDiff>,
    /// Why there is no differential flamegraph, when there is none.
    pub no_flames: Option<String>,
    pub notes: Vec<String>,
}

/// The requests a diff can compare: what the server was sent (not probe's own polls), with a
/// first token.
fn comparable(r: &Report) -> impl Iterator<Item = &Request> {
    r.requests.iter().filter(|q| !q.probe_poll && q.ttft_ms.is_some())
}

/// The default pair of one recording: its slowest first token (B) against its warm baseline
/// (A, [`warm_baseline`]).
pub fn default_pair(r: &Report) -> Result<(Vec<u64>, u64), String> {
    let slowest = slowest(r)?;
    Ok((warm_baseline(r, slowest)?, slowest))
}

/// The request with the slowest first token.
pub fn slowest(r: &Report) -> Result<u64, String> {
    comparable(r)
        .max_by(|a, b| a.ttft_ms.unwrap_or(0.0).total_cmp(&b.ttft_ms.unwrap_or(0.0)))
        .map(|q| q.id)
        .ok_or_else(|| "no request with a first token in this recording: nothing to compare".into())
}

/// Request `id`'s warm baseline: the other requests of a similar prompt size (within 2×, tokens
/// with tokens) whose verdict found nothing but the server's own work, as the verdicts' warm
/// baseline is chosen.
pub fn warm_baseline(r: &Report, id: u64) -> Result<Vec<u64>, String> {
    let q = comparable(r).find(|q| q.id == id).ok_or_else(|| format!("no request {id} with a first token in this recording"))?;
    let (size, unit) = crate::analysis::report::prompt_size(&q.record);
    let warm: Vec<u64> = comparable(r)
        .filter(|o| o.id != id)
        .filter(|o| o.verdict.as_ref().is_some_and(|v| matches!(v.slow_cause, SlowCause::None | SlowCause::Compute)))
        .filter(|o| {
            let (n, u) = crate::analysis::report::prompt_size(&o.record);
            u == unit && crate::analysis::report::similar_size(n, size)
        })
        .map(|o| o.id)
        .collect();
    if warm.is_empty() {
        return Err(format!(
            "no warm baseline in this trace for request {id}: no other request of a similar prompt size ({size} {unit}s, within 2×) was served without a slow cause; name the requests with --request N --against M"
        ));
    }
    Ok(warm)
}

/// One side: an analysis and the requests it holds.
pub struct Input<'a> {
    pub analysis: &'a Analysis,
    pub dir: String,
    pub label: String,
    pub ids: Vec<u64>,
}

impl Input<'_> {
    fn requests(&self) -> Vec<&Request> {
        let r = &self.analysis.report;
        self.ids.iter().filter_map(|id| r.requests.iter().find(|q| q.id == *id)).collect()
    }
}

/// Output tokens of a request: the server's count, else its content chunks.
fn tokens(q: &Request) -> u64 {
    crate::stream::payload::output_tokens(&q.stop, q.chunks as usize).0
}

fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    crate::util::stats::mean(&v.into_iter().collect::<Vec<_>>())
}

/// Σ(last − first content chunk) / Σ(chunks − 1): decode time per token after the first.
fn per_token(qs: &[&Request]) -> Option<f64> {
    let (mut ms, mut n) = (0.0, 0u64);
    for q in qs {
        if let (Some(f), Some(l)) = (q.chunk_times_ms.first(), q.chunk_times_ms.last())
            && q.chunk_times_ms.len() >= 2
        {
            ms += l - f;
            n += q.chunk_times_ms.len() as u64 - 1;
        }
    }
    (n > 0).then(|| ms / n as f64)
}

/// The slowest request of an analysis against its warm baseline, when it has both (the page's
/// and the bundle's diff section): the diff and its two sides.
pub fn against_baseline(a: &Analysis) -> Option<(Diff, Input<'_>, Input<'_>)> {
    let (warm, slow) = default_pair(&a.report).ok()?;
    let label = |w: &[u64]| format!("the warm baseline: request(s) {}", w.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
    let ia = Input { analysis: a, dir: "this recording".into(), label: label(&warm), ids: warm };
    let ib =
        Input { analysis: a, dir: "this recording".into(), label: format!("request {slow} (the slowest first token)"), ids: vec![slow] };
    let d = compare(&ia, &ib, false, true).ok()?;
    Some((d, ia, ib))
}

/// Compare B against A. `recordings`: each side is a whole recording (its flamegraphs are the
/// recording's, per generated token); else each side is its requests' windows, per request.
/// Two recordings of different builds or model files are refused unless `force`.
pub fn compare(a: &Input<'_>, b: &Input<'_>, recordings: bool, force: bool) -> anyhow::Result<Diff> {
    let (qa, qb) = (a.requests(), b.requests());
    let side = |i: &Input<'_>, qs: &[&Request]| Side {
        dir: i.dir.clone(),
        label: i.label.clone(),
        requests: i.ids.clone(),
        tokens: qs.iter().map(|q| tokens(q)).sum(),
    };
    let mut d = Diff {
        schema_version: SCHEMA_VERSION,
        mode: if recordings { Mode::Recordings } else { Mode::Requests },
        a: side(a, &qa),
        b: side(b, &qb),
        ..Default::default()
    };
    let both = |f: &dyn Fn(&[&Request]) -> Option<f64>| Some(Delta::of(f(&qa)?, f(&qb)?));
    d.ttft_ms = both(&|qs| mean(qs.iter().filter_map(|q| q.ttft_ms)));
    d.e2e_ms = both(&|qs| mean(qs.iter().filter_map(|q| q.end_ms)));
    d.per_token_ms = both(&per_token);
    d.gap_p99_ms = both(&|qs| mean(qs.iter().filter_map(|q| q.chunk_gaps.as_ref().map(|g| g.p99_ms))));
    d.tokens = both(&|qs| mean(qs.iter().map(|q| tokens(q) as f64)));
    // The split, mean per request over the requests that have one.
    let split = |qs: &[&Request]| -> Option<[f64; 10]> {
        let parts: Vec<[f64; 10]> = qs.iter().filter_map(|q| q.verdict.as_ref()?.ttft_ms.as_ref().map(Split::parts)).collect();
        (!parts.is_empty()).then(|| std::array::from_fn(|i| parts.iter().map(|p| p[i]).sum::<f64>() / parts.len() as f64))
    };
    if let (Some(pa), Some(pb)) = (split(&qa), split(&qb)) {
        d.split = SplitPart::ALL.iter().enumerate().map(|(i, &part)| Part { part, ms: Delta::of(pa[i], pb[i]) }).collect();
    }
    causes(&mut d, &qa, &qb);
    around(&mut d, &qa, &qb);
    // Two recordings: what differs about the server and the machine.
    if !std::ptr::eq(a.analysis, b.analysis) {
        setup(&mut d, &a.analysis.report, &b.analysis.report, &a.analysis.meta, &b.analysis.meta);
        if !d.mismatch.is_empty() && !force {
            anyhow::bail!(
                "not the same server: {}. Compare them anyway with --force (a different command line alone is compared, not refused)",
                d.mismatch.join("; ")
            );
        }
    }
    if recordings {
        faults(&mut d, &a.analysis.report, &b.analysis.report, qa.len(), qb.len());
    }
    flames(&mut d, a, b, &qa, &qb, recordings);
    d.headline = headline(&mut d);
    Ok(d)
}

fn causes(d: &mut Diff, qa: &[&Request], qb: &[&Request]) {
    let count = |qs: &[&Request], f: &dyn Fn(&crate::analysis::verdict::Verdict) -> String| {
        let mut m: BTreeMap<String, u64> = BTreeMap::new();
        for v in qs.iter().filter_map(|q| q.verdict.as_ref()) {
            *m.entry(f(v)).or_default() += 1;
        }
        m
    };
    let merge = |a: BTreeMap<String, u64>, b: BTreeMap<String, u64>| -> Vec<Count> {
        let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        keys.into_iter().map(|k| Count { cause: k.clone(), a: a.get(k).copied().unwrap_or(0), b: b.get(k).copied().unwrap_or(0) }).collect()
    };
    d.slow_causes = merge(count(qa, &|v| v.slow_cause.name().into()), count(qb, &|v| v.slow_cause.name().into()));
    d.stop_causes = merge(count(qa, &|v| v.stop_cause.name().into()), count(qb, &|v| v.stop_cause.name().into()));
}

/// Files read, model residency and competitors, mean per request; only what differs.
fn around(d: &mut Diff, qa: &[&Request], qb: &[&Request]) {
    let per = |qs: &[&Request], f: &dyn Fn(&crate::analysis::verdict::Verdict, &mut BTreeMap<String, f64>)| {
        let mut m = BTreeMap::new();
        let vs: Vec<_> = qs.iter().filter_map(|q| q.verdict.as_ref()).collect();
        for v in &vs {
            f(v, &mut m);
        }
        m.values_mut().for_each(|x: &mut f64| *x /= vs.len().max(1) as f64);
        m
    };
    let files = |v: &crate::analysis::verdict::Verdict, m: &mut BTreeMap<String, f64>| {
        for f in &v.files_read {
            *m.entry(f.path.clone()).or_default() += f.bytes as f64;
        }
    };
    let (fa, fb) = (per(qa, &files), per(qb, &files));
    let keys: BTreeSet<&String> = fa.keys().chain(fb.keys()).collect();
    d.files = keys
        .into_iter()
        .map(|k| FileDelta { path: k.clone(), a_bytes: fa.get(k).copied().unwrap_or(0.0), b_bytes: fb.get(k).copied().unwrap_or(0.0) })
        // A MiB, or twice as much.
        .filter(|f| (f.b_bytes - f.a_bytes).abs() >= (1u64 << 20) as f64 || f.b_bytes > 2.0 * f.a_bytes || f.a_bytes > 2.0 * f.b_bytes)
        .collect();
    d.files.sort_by(|x, y| (y.b_bytes - y.a_bytes).abs().total_cmp(&(x.b_bytes - x.a_bytes).abs()));
    let resident = |qs: &[&Request]| {
        let mut m: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for v in qs.iter().filter_map(|q| q.verdict.as_ref()) {
            for r in &v.model_resident {
                m.entry(r.path.clone()).or_default().push(r.share);
            }
        }
        m.into_iter().map(|(k, v)| (k, crate::util::stats::mean(&v).unwrap_or(0.0))).collect::<BTreeMap<_, _>>()
    };
    let (ra, rb) = (resident(qa), resident(qb));
    let keys: BTreeSet<&String> = ra.keys().chain(rb.keys()).collect();
    d.model_resident = keys
        .into_iter()
        .map(|k| ResidentDelta { path: k.clone(), a: ra.get(k).copied(), b: rb.get(k).copied() })
        .filter(|r| match (r.a, r.b) {
            (Some(a), Some(b)) => (a - b).abs() >= 0.05,
            _ => true,
        })
        .collect();
    let comp = |v: &crate::analysis::verdict::Verdict, m: &mut BTreeMap<String, f64>| {
        for c in &v.competitors {
            // By name: the same job restarted has another pid.
            let who = c.comm.clone().unwrap_or_else(|| format!("pid {}", c.pid));
            *m.entry(who).or_default() += c.held();
        }
    };
    let (ca, cb) = (per(qa, &comp), per(qb, &comp));
    let keys: BTreeSet<&String> = ca.keys().chain(cb.keys()).collect();
    d.competitors = keys
        .into_iter()
        .map(|k| CompetitorDelta { who: k.clone(), a_ms: ca.get(k).copied().unwrap_or(0.0), b_ms: cb.get(k).copied().unwrap_or(0.0) })
        .filter(|c| (c.b_ms - c.a_ms).abs() >= 1.0)
        .collect();
    d.competitors.sort_by(|x, y| (y.b_ms - y.a_ms).abs().total_cmp(&(x.b_ms - x.a_ms).abs()));
}

/// The server's command line (flag by flag), executable, build, model files, kernel, clocks,
/// slots: what differs. A different build id or model file is a mismatch.
fn setup(d: &mut Diff, a: &Report, b: &Report, ma: &crate::record::records::Meta, mb: &crate::record::records::Meta) {
    let mut ch = |what: &str, x: String, y: String| {
        if x != y {
            d.setup.push(Change { what: what.into(), a: x, b: y });
        }
    };
    // The command line as flags with their values, so that `-t 1` → `-t 2` is one change.
    let (fa, fb) = (flags(&ma.cmdline), flags(&mb.cmdline));
    let keys: BTreeSet<&String> = fa.keys().chain(fb.keys()).collect();
    for k in keys {
        let show = |m: &BTreeMap<String, String>| {
            m.get(k).map_or("(not given)".to_string(), |v| if v.is_empty() { "(given)".into() } else { v.clone() })
        };
        ch(&format!("command line {k}"), show(&fa), show(&fb));
    }
    ch("executable", ma.exe.clone(), mb.exe.clone());
    let opt = |s: &Option<String>| s.clone().unwrap_or_else(|| "?".into());
    ch("build id", opt(&ma.exe_build_id), opt(&mb.exe_build_id));
    ch("kernel", ma.kernel.clone(), mb.kernel.clone());
    let ep = |r: &Report| r.system.server.first().cloned().unwrap_or_default();
    let (ea, eb) = (ep(a), ep(b));
    ch("server build", opt(&ea.build_info), opt(&eb.build_info));
    let num = |n: Option<u64>| n.map_or("?".into(), |n| n.to_string());
    ch("slots", num(ea.total_slots), num(eb.total_slots));
    ch("context per slot", num(ea.n_ctx_slot), num(eb.n_ctx_slot));
    let mhz = |r: &Report| r.system.cpu_freq.max_mhz.map_or("?".into(), |m| format!("{m:.0} MHz"));
    ch("CPU max clock", mhz(a), mhz(b));
    let share = |r: &Report| {
        let f = &r.system.cpu_freq;
        f.share_min.zip(f.share_max).map(|(l, h)| format!("{:.0}–{:.0}% of max", l * 100.0, h * 100.0))
    };
    if let (Some(sa), Some(sb)) = (share(a), share(b)) {
        ch("CPU clock while tracing", sa, sb);
    }
    let gpu = |r: &Report| {
        r.system
            .gpu
            .per_device
            .iter()
            .map(|g| format!("GPU {}: SM {}–{} MHz", g.index, num(g.sm_mhz_min.map(u64::from)), num(g.sm_mhz_max.map(u64::from))))
            .collect::<Vec<_>>()
            .join(", ")
    };
    ch("GPU clocks", gpu(a), gpu(b));
    // Model files: by path, then size, inode and mtime (never a hash).
    let models = |r: &Report| r.system.model_files.iter().map(|m| (m.path.clone(), m.clone())).collect::<BTreeMap<_, _>>();
    let (xa, xb) = (models(a), models(b));
    let pa: Vec<&String> = xa.keys().collect();
    let pb: Vec<&String> = xb.keys().collect();
    if pa != pb {
        let l = |v: &[&String]| {
            if v.is_empty() { "(none seen)".to_string() } else { v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ") }
        };
        ch("model files", l(&pa), l(&pb));
    }
    let mut mismatch = vec![];
    for (p, m) in &xa {
        let Some(n) = xb.get(p) else { continue };
        let id = |m: &crate::analysis::system::ModelFile| {
            format!(
                "{} bytes, inode {}, modified {}",
                m.bytes,
                m.inode.map_or("?".into(), |i| i.to_string()),
                m.mtime_unix_s.map_or("?".into(), |t| t.to_string())
            )
        };
        if m.bytes != n.bytes
            || (m.inode.is_some() && n.inode.is_some() && m.inode != n.inode)
            || (m.mtime_unix_s.is_some() && n.mtime_unix_s.is_some() && m.mtime_unix_s != n.mtime_unix_s)
        {
            d.setup.push(Change { what: format!("model file {p}"), a: id(m), b: id(n) });
            mismatch.push(format!("the model file {p} is not the same file ({} / {})", id(m), id(n)));
        }
    }
    if pa != pb && !pa.is_empty() && !pb.is_empty() {
        mismatch.push("the servers mapped different model files".into());
    }
    if let (Some(x), Some(y)) = (&ma.exe_build_id, &mb.exe_build_id)
        && x != y
    {
        mismatch.push(format!("the server executables are different builds (build id {x} / {y})"));
    }
    d.mismatch = mismatch;
}

/// A command line's flags and their values: `-t 1 --port 8080 --no-mmap` → {-t: 1, --port: 8080,
/// --no-mmap: ""}; `--flag=value` too. Words before the first flag are the program.
pub fn flags(cmdline: &str) -> BTreeMap<String, String> {
    let words: Vec<&str> = cmdline.split_whitespace().collect();
    let mut m = BTreeMap::new();
    let mut i = 0;
    while i < words.len() {
        let w = words[i];
        // A negative number is a value, not a flag.
        let is_flag = |w: &str| w.starts_with('-') && w.len() > 1 && w.parse::<f64>().is_err();
        if is_flag(w) {
            if let Some((k, v)) = w.split_once('=') {
                m.insert(k.to_string(), v.to_string());
            } else if i + 1 < words.len() && !is_flag(words[i + 1]) {
                m.insert(w.to_string(), words[i + 1].to_string());
                i += 1;
            } else {
                m.insert(w.to_string(), String::new());
            }
        }
        i += 1;
    }
    m
}

fn faults(d: &mut Diff, a: &Report, b: &Report, na: usize, nb: usize) {
    let per = |x: u64, n: usize| x as f64 / n.max(1) as f64;
    let (ma, mb) = (per(a.faults.major, na), per(b.faults.major, nb));
    if (ma - mb).abs() >= 10.0 && (ma > 1.5 * mb || mb > 1.5 * ma) {
        d.faults.push(Change { what: "major page faults per request".into(), a: format!("{ma:.0}"), b: format!("{mb:.0}") });
    }
    let (sa, sb) = (per(a.system.memory.pswpin, na), per(b.system.memory.pswpin, nb));
    if (sa - sb).abs() >= 1.0 {
        d.faults.push(Change { what: "pages swapped in per request".into(), a: format!("{sa:.0}"), b: format!("{sb:.0}") });
    }
}

/// The on-CPU and off-CPU differential flamegraphs.
/// One side's folded stacks of `kind`. A recording's on-CPU graph is all of it (an idle server
/// spends next to no CPU); its off-CPU graph is its requests' windows (a pool thread idle for
/// the whole trace is not the requests' time); a set of requests is their windows.
pub fn gather(i: &Input<'_>, kind: Kind, recordings: bool) -> Folded {
    if recordings && kind == Kind::Cpu {
        return i.analysis.folded(kind);
    }
    let mut f = Folded::new();
    for id in &i.ids {
        for (k, w) in i.analysis.request_flames.get(id).and_then(|m| m.get(&kind)).into_iter().flatten() {
            *f.entry(k.clone()).or_default() += w;
        }
    }
    f
}

fn flames(d: &mut Diff, a: &Input<'_>, b: &Input<'_>, qa: &[&Request], qb: &[&Request], recordings: bool) {
    let gather = |i: &Input<'_>, kind: Kind| gather(i, kind, recordings);
    // Per generated token for recordings (the same prompts may give other lengths of answer);
    // per request for requests.
    let (na, nb, per) = if recordings && d.a.tokens > 0 && d.b.tokens > 0 {
        (d.a.tokens as f64, d.b.tokens as f64, Normalised::PerGeneratedToken)
    } else {
        (qa.len().max(1) as f64, qb.len().max(1) as f64, Normalised::PerRequest)
    };
    let mut why_none = vec![];
    for kind in [Kind::Cpu, Kind::Offcpu] {
        let (fa, fb) = (gather(a, kind), gather(b, kind));
        if fa.is_empty() || fb.is_empty() {
            let side = if fa.is_empty() { &a.dir } else { &b.dir };
            why_none.push(format!(
                "no {} stacks in {side}{}",
                kind.name(),
                if fa.is_empty() && fb.is_empty() { " nor the other" } else { "" }
            ));
            continue;
        }
        let mut f = frame_diff(&fa, &fb, na, nb, kind);
        (f.normalised, f.a_n, f.b_n) = (per, na, nb);
        (f.folded, f.svg) = (format!("diff-{}.folded", kind.name()), format!("diff-{}.svg", kind.name()));
        d.flames.push(f);
    }
    if d.flames.is_empty() {
        let offcpu = a
            .analysis
            .meta
            .probes
            .iter()
            .chain(&b.analysis.meta.probes)
            .any(|p| p.name == crate::record::records::Subsystem::Offcpu && p.live);
        d.no_flames = Some(format!(
            "{}{}",
            why_none.join("; "),
            if offcpu { "" } else { " (traced without the cpu and offcpu probes? `probe trace` takes them by default)" }
        ));
    }
}

/// Weight per frame, normalised. On-CPU: where the CPU was spent, by the innermost frame (the
/// same function reached through another thread's path is the same work: a thread pool that
/// moves work from the main thread to its workers changes every stack, not the work). Off-CPU:
/// inclusive (each frame once per stack: the wait class, the function that blocked), less the
/// frames nearly every stack has (`__schedule`, the process), which say nothing.
fn by_frame(f: &Folded, n: f64, kind: Kind) -> BTreeMap<String, f64> {
    let mut m: BTreeMap<String, f64> = BTreeMap::new();
    for (stack, &w) in f {
        if kind == Kind::Cpu {
            if let Some(leaf) = stack.rsplit(';').next() {
                *m.entry(leaf.to_string()).or_default() += w as f64 / n;
            }
            continue;
        }
        let frames: BTreeSet<&str> = stack.split(';').skip(1).collect();
        for fr in frames {
            *m.entry(fr.to_string()).or_default() += w as f64 / n;
        }
    }
    m
}

fn frame_diff(fa: &Folded, fb: &Folded, na: f64, nb: f64, kind: Kind) -> FlameDiff {
    let (ta, tb) = (fa.values().sum::<u64>() as f64 / na, fb.values().sum::<u64>() as f64 / nb);
    let (mut xa, mut xb) = (by_frame(fa, na, kind), by_frame(fb, nb, kind));
    if kind != Kind::Cpu {
        let everywhere: Vec<String> =
            xa.iter().filter(|(k, v)| **v >= 0.9 * ta && xb.get(*k).is_some_and(|b| *b >= 0.9 * tb)).map(|(k, _)| k.clone()).collect();
        for k in everywhere {
            xa.remove(&k);
            xb.remove(&k);
        }
    }
    // Noise: on-CPU samples and counts are Poisson (sd √count, in raw counts); blocked time is
    // not a count, and only the share rule applies to it.
    let noise = |fr: &str| {
        if kind == Kind::Offcpu {
            return 0.0;
        }
        let (ra, rb) = (xa.get(fr).copied().unwrap_or(0.0) * na, xb.get(fr).copied().unwrap_or(0.0) * nb);
        // In normalised units: √(ra)/na and √(rb)/nb, combined.
        3.0 * (ra / (na * na) + rb / (nb * nb)).sqrt()
    };
    let floor = FRAME_SHARE * ta.max(tb);
    let keys: BTreeSet<&String> = xa.keys().chain(xb.keys()).collect();
    let mut moved: Vec<FrameDelta> = keys
        .into_iter()
        .map(|k| FrameDelta { frame: k.clone(), a: xa.get(k).copied().unwrap_or(0.0), b: xb.get(k).copied().unwrap_or(0.0) })
        .filter(|f| (f.b - f.a).abs() >= floor && (f.b - f.a).abs() > noise(&f.frame))
        .collect();
    // The frames of one call path move together: one of them says it (a wait class first).
    moved.sort_by(|x, y| {
        (y.b - y.a).abs().total_cmp(&(x.b - x.a).abs()).then_with(|| y.frame.starts_with('[').cmp(&x.frame.starts_with('[')))
    });
    let mut seen: Vec<(f64, f64)> = vec![];
    moved.retain(|f| {
        let same = seen.iter().any(|(a, b)| (a - f.a).abs() <= 1e-9 * a.abs().max(1.0) && (b - f.b).abs() <= 1e-9 * b.abs().max(1.0));
        seen.push((f.a, f.b));
        !same
    });
    let (grew, shrank): (Vec<FrameDelta>, Vec<FrameDelta>) = moved.into_iter().partition(|f| f.b > f.a);
    // Σ|b − a| over the frames compared (on-CPU: over where the CPU was spent), normalised.
    let dist: f64 = if kind == Kind::Cpu {
        let frames: BTreeSet<&String> = xa.keys().chain(xb.keys()).collect();
        frames.iter().map(|k| (xb.get(*k).copied().unwrap_or(0.0) - xa.get(*k).copied().unwrap_or(0.0)).abs()).sum()
    } else {
        let stacks: BTreeSet<&String> = fa.keys().chain(fb.keys()).collect();
        stacks.iter().map(|k| (fb.get(*k).copied().unwrap_or(0) as f64 / nb - fa.get(*k).copied().unwrap_or(0) as f64 / na).abs()).sum()
    };
    let total = Delta::of(ta, tb);
    let nearly_unchanged = grew.is_empty() && shrank.is_empty() && total.pct().is_some_and(|p| p.abs() < SAME_TOTAL * 100.0);
    FlameDiff {
        kind: kind.name().into(),
        unit: kind.unit().into(),
        total,
        grew: grew.into_iter().take(12).collect(),
        shrank: shrank.into_iter().take(12).collect(),
        moved: if ta + tb > 0.0 { dist / (ta + tb) } else { 0.0 },
        nearly_unchanged,
        ..Default::default()
    }
}

pub fn mib(b: f64) -> String {
    crate::util::text::bytes(b.max(0.0) as u64)
}

/// The one sentence: the TTFT change and the part that explains most of it, with its evidence;
/// else the decode time per token; else "no difference".
fn headline(d: &mut Diff) -> String {
    let mut out = vec![];
    if let Some(t) = d.ttft_ms {
        let best = d
            .split
            .iter()
            .filter(|p| p.part != SplitPart::Unexplained)
            .max_by(|x, y| (x.ms.delta * t.delta.signum()).total_cmp(&(y.ms.delta * t.delta.signum())));
        let named = best.filter(|p| {
            p.ms.delta.abs() >= MIN_PART_MS && p.ms.delta.abs() >= 0.25 * t.delta.abs() && p.ms.delta.signum() == t.delta.signum()
        });
        let first = format!("{:+.0} ms to the first token ({:.0} → {:.0} ms)", t.delta, t.a, t.b);
        if t.delta.abs() < MIN_PART_MS.max(0.05 * t.a) {
            out.push(format!("the first token took about as long ({:.0} → {:.0} ms)", t.a, t.b));
        } else if let Some(p) = named {
            d.explained_by = Some(p.part);
            d.explained_share = Some(p.ms.delta / t.delta);
            let why = part_words(d, p.part);
            // disk and load together are one story (a model read back): say both.
            let pair = if matches!(p.part, SplitPart::Disk | SplitPart::Load) {
                let other = if p.part == SplitPart::Disk { SplitPart::Load } else { SplitPart::Disk };
                d.split
                    .iter()
                    .find(|x| x.part == other)
                    .filter(|x| x.ms.delta >= MIN_PART_MS)
                    .map(|x| format!(" and {other} {:+.0} ms", x.ms.delta))
                    .unwrap_or_default()
            } else {
                String::new()
            };
            out.push(format!("{first}: {} {:+.0} ms{pair}{why}", p.part.words(), p.ms.delta));
        } else {
            out.push(format!("{first}, spread over the parts of the split: no one part explains it (see the table)"));
        }
    }
    if let Some(p) = d.per_token_ms
        && let Some(pct) = p.pct()
        && pct.abs() >= 5.0
    {
        out.push(format!("decoding took {:.1} → {:.1} ms per token ({pct:+.0}%)", p.a, p.b));
    }
    let setup: Vec<String> = d
        .setup
        .iter()
        .filter(|c| c.what.starts_with("command line"))
        .map(|c| format!("{} {} → {}", c.what.trim_start_matches("command line "), c.a, c.b))
        .collect();
    if !setup.is_empty() {
        out.push(format!("the server ran with {}", setup.join(", ")));
    }
    if out.is_empty() {
        return "no difference in the first token or the decode time".into();
    }
    let mut s = out.join("; ");
    if let Some(c) = s.get_mut(0..1) {
        c.make_ascii_uppercase();
    }
    s + "."
}

/// What the evidence says about a part's change: the file read back, the competitor, ...
fn part_words(d: &Diff, part: SplitPart) -> String {
    match part {
        SplitPart::Disk | SplitPart::Load => match d.files.iter().find(|f| f.b_bytes > f.a_bytes) {
            Some(f) => {
                let cached = d
                    .model_resident
                    .iter()
                    .find(|r| r.path == f.path)
                    .and_then(|r| r.b)
                    .map(|s| format!(", {:.0}% of it cached before", s * 100.0))
                    .unwrap_or_default();
                format!(": {} was read from disk ({} vs {}{cached})", f.path, mib(f.b_bytes), mib(f.a_bytes))
            }
            None if part == SplitPart::Load => ": the model was loaded again (mapped from the page cache)".into(),
            None => String::new(),
        },
        SplitPart::CpuContention => match d.competitors.iter().find(|c| c.b_ms > c.a_ms) {
            Some(c) => format!(": other processes held the CPUs, most of all {} ({:.0} ms vs {:.0} ms)", c.who, c.b_ms, c.a_ms),
            None => ": waiting for a CPU".into(),
        },
        SplitPart::Memory => ": faulting memory back in (swap) or reclaiming it".into(),
        SplitPart::Queue => ": waiting behind other requests".into(),
        SplitPart::Power => ": the clocks ramping up from idle".into(),
        SplitPart::Compute => {
            let p = d.per_token_ms.map(|p| format!("; the decode time per token went {:.1} → {:.1} ms", p.a, p.b)).unwrap_or_default();
            format!(": the server's own prompt work{p}")
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_pair_with_their_values() {
        let f = flags("/bin/llama-server -m /m.gguf -t 2 --no-mmap --port=8080 --temp -1");
        assert_eq!(f["-t"], "2");
        assert_eq!(f["--no-mmap"], "");
        assert_eq!(f["--port"], "8080");
        assert_eq!(f["--temp"], "-1");
        assert_eq!(f["-m"], "/m.gguf");
    }

    fn folded(v: &[(&str, u64)]) -> Folded {
        v.iter().map(|(k, w)| (k.to_string(), *w)).collect()
    }

    /// The same profile twice is nearly unchanged; one that spends 400 more samples in a frame
    /// names it, and the differential SVG (inferno) draws it.
    #[test]
    fn a_grown_frame_is_named_and_noise_is_not() {
        let a = folded(&[("srv;main;decode;matmul", 1000), ("srv;main;decode;softmax", 200), ("srv;main;http", 50)]);
        let same = folded(&[("srv;main;decode;matmul", 1010), ("srv;main;decode;softmax", 195), ("srv;main;http", 52)]);
        let f = frame_diff(&a, &same, 1.0, 1.0, Kind::Cpu);
        assert!(f.nearly_unchanged && f.grew.is_empty() && f.shrank.is_empty(), "{f:?}");
        let b = folded(&[
            ("srv;main;decode;matmul", 1000),
            ("srv;main;decode;softmax", 200),
            ("srv;main;http", 50),
            ("srv;main;load;read_model", 400),
        ]);
        let f = frame_diff(&a, &b, 1.0, 1.0, Kind::Cpu);
        assert!(!f.nearly_unchanged);
        let names: Vec<&str> = f.grew.iter().map(|g| g.frame.as_str()).collect();
        assert_eq!(names, ["read_model"], "on-CPU: where the time was spent");
        // Off-CPU: the wait and the function that blocked, not the frames every stack has.
        let f = frame_diff(&a, &b, 1.0, 1.0, Kind::Offcpu);
        let names: Vec<&str> = f.grew.iter().map(|g| g.frame.as_str()).collect();
        // One call path (load;read_model) grew: said once.
        assert!(names == ["load"] || names == ["read_model"], "{names:?}");
        assert!(!names.contains(&"matmul"), "{names:?}");
        // Per request: twice the requests with twice the work is the same.
        let double: Folded = a.iter().map(|(k, w)| (k.clone(), w * 2)).collect();
        assert!(frame_diff(&a, &double, 1.0, 2.0, Kind::Cpu).nearly_unchanged);
        let (text, svg) = crate::render::diff::differential(&a, &b, 1.0, 1.0, Kind::Cpu, "t").unwrap();
        assert!(text.lines().any(|l| l == "srv;main;load;read_model 0 400"), "{text}");
        assert!(String::from_utf8_lossy(&svg).contains("read_model"));
    }
}
