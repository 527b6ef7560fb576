//! The timeline of the HTML report: Chrome trace-event JSON (what `probe timeline` writes) drawn
//! as one SVG. A group per process (requests, the target, block IO, TCP, and whatever else the
//! trace names), a lane per thread, a small line chart per counter series ("ph":"C", any name).
//! Slices and instants that touch within a pixel are merged into one element, and the element
//! count is capped, so a long trace still gives a small page; what was merged or left out is
//! said in the hover title or under the chart. Times in the trace are µs.
use std::{collections::BTreeMap, fmt::Write as _};

use crate::{
    analysis::ksyms::Wait,
    render::perfetto::{Details, MetaName, Num, Phase, RequestMark, SockMark, TraceEvent, Track},
};

use super::escape;

/// Width of the plot area and of the lane labels, px.
pub const WIDTH: f64 = 1000.0;
const LABEL: f64 = 200.0;
const LANE: f64 = 16.0;
const COUNTER: f64 = 34.0;
const GROUP: f64 = 18.0;
const AXIS: f64 = 22.0;
/// At most this many rects, lines, polylines and labels in the chart.
pub const MAX_ELEMENTS: usize = 6000;
/// At most this many lanes (threads, devices, counter series).
pub const MAX_LANES: usize = 120;
/// A group with more lanes than this shares rows between lanes that do not overlap in time
/// (a long trace's requests, connections).
const PACK_OVER: usize = 24;
/// At most this many rows per group, so one group cannot crowd out the others.
const MAX_GROUP_ROWS: usize = 48;
/// Nested slices (a request and its wait for the first token) are drawn inset, this deep at most.
const MAX_DEPTH: usize = 3;

struct Slice {
    ts: f64,
    dur: f64,
    name: String,
    kind: Kind,
    args: Option<Details>,
    depth: usize,
}

struct Instant {
    ts: f64,
    name: String,
    kind: Kind,
}

/// What a slice or instant is, for its colour, its legend and how it is drawn: read from the
/// kind of its details and the closed sets its name comes from. Anything else (a memory stall,
/// an engine step) is coloured by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A request's slice, named "#id method path".
    Request,
    /// A mark on a request's track: the wait for the first token, the first token, a token.
    Mark(RequestMark),
    /// A target thread off the CPU.
    Wait(Wait),
    MajorFault,
    /// A TCP reset, received or sent.
    Reset,
    /// A TCP state change, named "from → to".
    StateChange,
    /// A memory-map call.
    Mmap,
    /// A block request, named "RWBS size KiB".
    BlockIo,
    Other,
}

impl Kind {
    fn of(name: &str, args: Option<&Details>) -> Kind {
        match args {
            Some(Details::Request(_)) => Kind::Request,
            Some(Details::Fault(_)) => Kind::MajorFault,
            Some(Details::Mmap(_)) => Kind::Mmap,
            Some(Details::BlockIo(_)) => Kind::BlockIo,
            Some(Details::Sock(_)) if name.parse::<SockMark>().is_ok() => Kind::Reset,
            Some(Details::Sock(_)) => Kind::StateChange,
            _ => name.parse().map(Kind::Mark).or_else(|_| name.parse().map(Kind::Wait)).unwrap_or(Kind::Other),
        }
    }
}

#[derive(Default)]
struct Lane {
    slices: Vec<Slice>,
    instants: Vec<Instant>,
}

/// How a counter series is labelled: by its counter's name alone, or the name and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    Name,
    NameAndKey,
}

impl Label {
    /// A series whose key is a word of its counter's name ("server requests deferred" /
    /// "deferred", "GPU 0 power W" / "W") says it once.
    fn of(name: &str, key: &str) -> Label {
        if name.split_whitespace().any(|w| w == key) { Label::Name } else { Label::NameAndKey }
    }

    fn text(self, name: &str, key: &str) -> String {
        match self {
            Label::Name => name.to_string(),
            Label::NameAndKey => format!("{name} {key}"),
        }
    }
}

/// A counter series: its label, set as it is read, and its (ts, value) samples.
struct Series {
    label: Label,
    points: Vec<(f64, f64)>,
}

#[derive(Default)]
struct Process {
    name: Option<String>,
    /// The timeline's own track this process is, by its name.
    track: Option<Track>,
    threads: BTreeMap<u64, String>,
    lanes: BTreeMap<u64, Lane>,
    /// (counter name, series key) → its samples.
    counters: BTreeMap<(String, String), Series>,
}

const PALETTE: [&str; 10] = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

/// The colour of a slice or instant: its kind's, or one from its name's hash.
fn color(kind: Kind, name: &str) -> &'static str {
    match kind {
        Kind::Mark(RequestMark::UntilFirstToken) => "#f28e2b",
        Kind::Mark(RequestMark::FirstToken) => "#000000",
        Kind::Mark(RequestMark::Token) => "#555555",
        Kind::Wait(Wait::Io) => "#d62728",
        Kind::Wait(Wait::PageFault) => "#ff7f0e",
        Kind::Wait(Wait::Memory) => "#9467bd",
        Kind::Wait(Wait::Swap) => "#c5b0d5",
        Kind::Wait(Wait::Lock) => "#8c8c8c",
        Kind::Wait(Wait::Sleep) => "#bcbd22",
        Kind::Wait(Wait::Poll) => "#17becf",
        Kind::Wait(Wait::Network) => "#1f77b4",
        Kind::Wait(Wait::Other) => "#c7c7c7",
        Kind::MajorFault => "#ff7f0e",
        Kind::Reset => "#d62728",
        Kind::Request => "#c6dbef",
        // A state change: coloured by the state it enters.
        Kind::StateChange => hashed(entered(name)),
        Kind::Mmap => "#8d6e63",
        // Colour by the operation, not the size.
        Kind::BlockIo => hashed(operation(name)),
        Kind::Other => hashed(name),
    }
}

/// A colour of the palette from a name's hash.
fn hashed(name: &str) -> &'static str {
    let h = name.bytes().fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
    PALETTE[h as usize % PALETTE.len()]
}

/// The state a TCP state change ("A → B") enters.
fn entered(name: &str) -> &str {
    name.rsplit_once(" → ").map_or(name, |(_, to)| to)
}

/// A block request's operation: its name's first word.
fn operation(name: &str) -> &str {
    name.split(' ').next().unwrap_or(name)
}

/// What a colour stands for in the legend.
fn legend_name(kind: Kind, name: &str) -> String {
    match kind {
        Kind::Request => "request".into(),
        Kind::Mmap => "memory-map calls".into(),
        Kind::StateChange => format!("→ {}", entered(name)),
        Kind::BlockIo => format!("block {}", operation(name)),
        _ => name.into(),
    }
}

/// The group a process's lanes go in: requests first, then the target's threads, block IO,
/// TCP, anything else.
fn rank(track: Option<Track>) -> u8 {
    match track {
        Some(Track::Requests) => 0,
        Some(Track::BlockIo) => 2,
        Some(Track::Tcp) => 3,
        _ => 1,
    }
}

fn parse(events: &[TraceEvent]) -> (BTreeMap<u64, Process>, f64) {
    let mut procs: BTreeMap<u64, Process> = BTreeMap::new();
    let mut end = 0f64;
    for e in events {
        let (pid, tid, name) = (e.pid, e.tid, e.name.clone());
        let ts = e.ts.unwrap_or(0.0).max(0.0);
        let p = procs.entry(pid).or_default();
        match e.ph {
            Phase::Meta => {
                let Some(Details::Name(label)) = &e.args else { continue };
                match name.parse() {
                    Ok(MetaName::ProcessName) => {
                        p.track = label.name.parse().ok();
                        p.name = Some(label.name.clone());
                    }
                    Ok(MetaName::ThreadName) => {
                        p.threads.insert(tid, label.name.clone());
                    }
                    Err(_) => {}
                }
            }
            Phase::Complete => {
                let dur = e.dur.unwrap_or(0.0).max(0.0);
                end = end.max(ts + dur);
                let kind = Kind::of(&name, e.args.as_ref());
                p.lanes.entry(tid).or_default().slices.push(Slice { ts, dur, name, kind, args: e.args.clone(), depth: 0 });
            }
            Phase::Instant => {
                end = end.max(ts);
                let kind = Kind::of(&name, e.args.as_ref());
                p.lanes.entry(tid).or_default().instants.push(Instant { ts, name, kind });
            }
            Phase::Counter => {
                end = end.max(ts);
                let Some(Details::Counter(values)) = &e.args else { continue };
                for (key, v) in values {
                    if let Some(v) = v.map(Num::as_f64).filter(|v| v.is_finite()) {
                        let series = p.counters.entry((name.clone(), key.clone()));
                        series.or_insert_with(|| Series { label: Label::of(&name, key), points: Vec::new() }).points.push((ts, v));
                    }
                }
            }
        }
    }
    for p in procs.values_mut() {
        for lane in p.lanes.values_mut() {
            // Outer slices first, then nesting depth from the slices still open at each start.
            lane.slices.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(b.dur.total_cmp(&a.dur)));
            let mut open: Vec<f64> = Vec::new();
            for s in &mut lane.slices {
                open.retain(|&e| e > s.ts);
                s.depth = open.len().min(MAX_DEPTH);
                open.push(s.ts + s.dur);
            }
            lane.instants.sort_by(|a, b| a.ts.total_cmp(&b.ts));
        }
        for v in p.counters.values_mut() {
            v.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }
    procs.retain(|_, p| !p.lanes.is_empty() || !p.counters.is_empty());
    (procs, end)
}

/// First and last time (µs) of anything in a lane.
fn extent(lane: &Lane) -> (f64, f64) {
    let times = lane.slices.iter().flat_map(|s| [s.ts, s.ts + s.dur]).chain(lane.instants.iter().map(|i| i.ts));
    times.fold((f64::INFINITY, 0.0), |(a, b), t| (a.min(t), b.max(t)))
}

/// The rows a process's lanes are drawn in: one each, or, past [`PACK_OVER`] lanes, packed
/// first-fit by time so lanes that never overlap (with a few px between) share a row.
fn rows(p: &Process, scale: f64) -> Vec<Vec<(&u64, &Lane)>> {
    if p.lanes.len() <= PACK_OVER {
        return p.lanes.iter().map(|l| vec![l]).collect();
    }
    let mut lanes: Vec<(&u64, &Lane, (f64, f64))> = p.lanes.iter().map(|(t, l)| (t, l, extent(l))).collect();
    lanes.sort_by(|a, b| a.2.0.total_cmp(&b.2.0));
    let mut rows: Vec<(f64, Vec<(&u64, &Lane)>)> = Vec::new();
    for (tid, lane, (first, last)) in lanes {
        match rows.iter_mut().find(|(end, _)| *end + 3.0 <= first * scale) {
            Some(row) => {
                row.0 = last * scale;
                row.1.push((tid, lane));
            }
            None => rows.push((last * scale, vec![(tid, lane)])),
        }
    }
    rows.into_iter().map(|(_, r)| r).collect()
}

fn ms(us: f64) -> String {
    let m = us / 1e3;
    if m.abs() >= 100.0 {
        format!("{m:.0} ms")
    } else if m.abs() >= 1.0 {
        format!("{m:.1} ms")
    } else {
        format!("{m:.3} ms")
    }
}

/// A short summary of an event's details for its hover title.
fn args_text(args: Option<&Details>) -> String {
    let fields = args.map(Details::fields).unwrap_or_default();
    if fields.is_empty() {
        return String::new();
    }
    let mut t: String = fields.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ");
    if t.chars().count() > 300 {
        t = t.chars().take(300).collect::<String>() + "…";
    }
    format!("\n{t}")
}

/// A tick step of 1, 2 or 5 × 10^k µs giving about `n` ticks over `span` µs.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1.0);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|s| *s >= raw).unwrap_or(10.0 * p)
}

/// The chart's SVG and the notes to print under it (what was merged or left out).
pub struct Chart {
    pub svg: String,
    pub elements: usize,
    pub notes: Vec<String>,
}

struct Out {
    body: String,
    elements: usize,
    dropped: usize,
}

impl Out {
    /// Room for one more element? Counts the ones that are not drawn.
    fn room(&mut self) -> bool {
        if self.elements >= MAX_ELEMENTS {
            self.dropped += 1;
            return false;
        }
        self.elements += 1;
        true
    }
}

/// One merged run of slices of the same name and depth in a lane, in px and µs.
struct Run<'a> {
    x0: f64,
    x1: f64,
    n: usize,
    busy: f64,
    first: &'a Slice,
    last_end: f64,
}

fn draw_slices(o: &mut Out, lane: &Lane, y: f64, scale: f64) {
    // Group by (depth, name) in time order, so runs never merge different things.
    let mut by: BTreeMap<(usize, &str), (Kind, Vec<&Slice>)> = BTreeMap::new();
    for s in &lane.slices {
        by.entry((s.depth, s.name.as_str())).or_insert((s.kind, Vec::new())).1.push(s);
    }
    for ((depth, name), (kind, slices)) in by {
        let inset = 1.0 + depth as f64 * 3.0;
        let h = (LANE - 2.0 * inset).max(3.0);
        let flush = |o: &mut Out, r: &Run| {
            if !o.room() {
                return;
            }
            let w = (r.x1 - r.x0).max(1.0);
            // A merged run is as opaque as it is busy: sparse waits do not look like one long one.
            let density = (r.busy * scale / w).clamp(0.15, 1.0);
            let opacity = if density < 0.95 { format!(" fill-opacity=\"{density:.2}\"") } else { String::new() };
            let title = if r.n == 1 {
                format!("{}: {} at {}{}", r.first.name, ms(r.first.dur), ms(r.first.ts), args_text(r.first.args.as_ref()))
            } else {
                format!("{} × {}: {} in total, {} to {}", r.n, r.first.name, ms(r.busy), ms(r.first.ts), ms(r.last_end))
            };
            let _ = write!(
                o.body,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"{h:.1}\" fill=\"{}\"{opacity}><title>{}</title></rect>",
                LABEL + r.x0,
                y + inset,
                color(kind, name),
                escape(&title)
            );
        };
        let mut run: Option<Run> = None;
        for s in slices {
            let (x0, x1) = (s.ts * scale, (s.ts + s.dur) * scale);
            match &mut run {
                // Touching within a pixel: one element.
                Some(r) if x0 <= r.x1 + 1.0 => {
                    r.x1 = r.x1.max(x1);
                    r.n += 1;
                    r.busy += s.dur;
                    r.last_end = r.last_end.max(s.ts + s.dur);
                }
                _ => {
                    if let Some(r) = run.take() {
                        flush(o, &r);
                    }
                    run = Some(Run { x0, x1, n: 1, busy: s.dur, first: s, last_end: s.ts + s.dur });
                }
            }
        }
        if let Some(r) = run {
            flush(o, &r);
        }
    }
}

fn draw_instants(o: &mut Out, lane: &Lane, y: f64, scale: f64) {
    let mut by: BTreeMap<&str, (Kind, Vec<f64>)> = BTreeMap::new();
    for i in &lane.instants {
        by.entry(i.name.as_str()).or_insert((i.kind, Vec::new())).1.push(i.ts);
    }
    for (name, (kind, times)) in by {
        let strong = kind == Kind::Mark(RequestMark::FirstToken);
        let mut i = 0;
        while i < times.len() {
            // Everything within a pixel of the first: one tick.
            let x = times[i] * scale;
            let j = i + times[i..].iter().take_while(|t| *t * scale < x + 1.0).count();
            let x = LABEL + x;
            if o.room() {
                let title = if j - i == 1 {
                    format!("{name} at {}", ms(times[i]))
                } else {
                    format!("{} × {name}, {} to {}", j - i, ms(times[i]), ms(times[j - 1]))
                };
                let _ = write!(
                    o.body,
                    "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{}\" stroke-width=\"{}\"><title>{}</title></line>",
                    y + if strong { 0.0 } else { 3.0 },
                    y + LANE - if strong { 0.0 } else { 3.0 },
                    color(kind, name),
                    if strong { 2 } else { 1 },
                    escape(&title)
                );
            }
            i = j;
        }
    }
}

fn draw_counter(o: &mut Out, label: &str, pts: &[(f64, f64)], y: f64, scale: f64, stroke: &str) {
    let (lo, hi) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), p| (l.min(p.1), h.max(p.1)));
    let last = pts.last().map_or(0.0, |p| p.1);
    let top = y + 3.0;
    let height = COUNTER - 8.0;
    let yv = |v: f64| if hi > lo { top + height * (1.0 - (v - lo) / (hi - lo)) } else { top + height / 2.0 };
    // Per pixel column: the first, lowest, highest and last value, in time order.
    let mut points = String::new();
    let mut i = 0;
    while i < pts.len() {
        let col = (pts[i].0 * scale).floor();
        let j = i + pts[i..].iter().take_while(|p| (p.0 * scale).floor() == col).count();
        let slice = &pts[i..j];
        let (mut lo_i, mut hi_i) = (0, 0);
        for (k, p) in slice.iter().enumerate() {
            if p.1 < slice[lo_i].1 {
                lo_i = k;
            }
            if p.1 > slice[hi_i].1 {
                hi_i = k;
            }
        }
        let mut keep = vec![0, lo_i, hi_i, slice.len() - 1];
        keep.sort_unstable();
        keep.dedup();
        for k in keep {
            let _ = write!(points, "{:.1},{:.1} ", LABEL + slice[k].0 * scale, yv(slice[k].1));
        }
        i = j;
    }
    let fmt = |v: f64| if v.abs() >= 100.0 || v == v.trunc() { format!("{v:.0}") } else { format!("{v:.2}") };
    let title = format!("{label}: min {}, max {}, last {} ({} samples)", fmt(lo), fmt(hi), fmt(last), pts.len());
    if o.room() {
        let _ = write!(
            o.body,
            "<rect x=\"{LABEL}\" y=\"{y:.1}\" width=\"{WIDTH}\" height=\"{:.1}\" fill=\"#f7f7f7\"><title>{}</title></rect>",
            COUNTER - 2.0,
            escape(&title)
        );
    }
    if o.room() {
        let _ = write!(
            o.body,
            "<polyline fill=\"none\" stroke=\"{stroke}\" stroke-width=\"1.2\" points=\"{}\"><title>{}</title></polyline>",
            points.trim_end(),
            escape(&title)
        );
    }
    if o.room() {
        let _ = write!(
            o.body,
            "<text x=\"{:.1}\" y=\"{:.1}\" class=\"lbl\" text-anchor=\"end\">{}</text>",
            LABEL - 4.0,
            y + COUNTER - 7.0,
            escape(&format!("{} … {}", fmt(lo), fmt(hi)))
        );
    }
}

/// Where the drawing is: the next lane's top, the lanes drawn and left out, the legend so far.
struct Cursor {
    y: f64,
    lanes: usize,
    lanes_left: usize,
    /// Legend name → colour, of everything drawn.
    used: BTreeMap<String, &'static str>,
    /// Counter series drawn so far: each takes the next colour of the palette.
    counter_index: usize,
}

/// Draw the trace. Never fails: an empty or foreign document gives an empty chart and a note.
pub fn svg(events: &[TraceEvent]) -> Chart {
    let (procs, end) = parse(events);
    let mut o = Out { body: String::new(), elements: 0, dropped: 0 };
    let mut notes = Vec::new();
    if procs.is_empty() || end <= 0.0 {
        notes.push("the timeline has no events to draw".to_string());
        return Chart { svg: String::new(), elements: 0, notes };
    }
    let scale = WIDTH / end;
    let mut order: Vec<(&u64, &Process)> = procs.iter().collect();
    order.sort_by_key(|(pid, p)| (rank(p.track), **pid));
    let mut c = Cursor { y: AXIS, lanes: 0, lanes_left: 0, used: BTreeMap::new(), counter_index: 0 };
    for (pid, p) in order {
        draw_process(&mut o, &mut c, *pid, p, scale);
    }
    let height = c.y + 4.0;
    let axis = axis(end, scale, height);
    if o.dropped > 0 {
        notes.push(format!(
            "{} more elements not drawn (at most {MAX_ELEMENTS}): open timeline.json in the Perfetto UI for everything",
            o.dropped
        ));
    }
    if c.lanes_left > 0 {
        notes.push(format!("{} more lanes not drawn (at most {MAX_LANES})", c.lanes_left));
    }
    let legend: Vec<String> =
        c.used.iter().map(|(name, c)| format!("<span class=\"sw\" style=\"background:{c}\"></span>{}", escape(name))).collect();
    let total = LABEL + WIDTH + 10.0;
    let svg = format!(
        "<div class=\"legend\">{}</div><svg class=\"timeline\" data-label-width=\"{LABEL:.0}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{total:.0}\" height=\"{height:.0}\" viewBox=\"0 0 {total:.0} {height:.0}\" role=\"img\" aria-label=\"timeline\">{axis}{}</svg>",
        legend.join(" "),
        o.body
    );
    Chart { svg, elements: o.elements, notes }
}

/// One process's group: its name, a row per lane (or per packed row of lanes), then a small
/// chart per counter series; past the caps, lanes are counted as left out.
fn draw_process(o: &mut Out, c: &mut Cursor, pid: u64, p: &Process, scale: f64) {
    let group = p.name.clone().unwrap_or_else(|| format!("pid {pid}"));
    if c.lanes >= MAX_LANES {
        c.lanes_left += p.lanes.len() + p.counters.len();
        return;
    }
    if o.room() {
        let _ = write!(o.body, "<text x=\"2\" y=\"{:.1}\" class=\"grp\">{}</text>", c.y + GROUP - 5.0, escape(&group));
    }
    c.y += GROUP;
    let label = |tid: &u64| {
        p.threads.get(tid).cloned().unwrap_or_else(|| match (p.track, tid) {
            (Some(Track::Tcp), 0) => "port not seen".into(),
            (Some(Track::Tcp), _) => format!("port {tid}"),
            _ => format!("tid {tid}"),
        })
    };
    let rows = rows(p, scale);
    let packed = rows.len() < p.lanes.len();
    let mut group_rows = 0;
    for row in &rows {
        if c.lanes >= MAX_LANES || group_rows >= MAX_GROUP_ROWS {
            c.lanes_left += row.len();
            continue;
        }
        c.lanes += 1;
        group_rows += 1;
        let mut text = label(row[0].0);
        if row.len() > 1 {
            text = format!("{} +{}", text.chars().take(22).collect::<String>(), row.len() - 1);
        }
        if o.room() {
            let _ = write!(
                o.body,
                "<text x=\"8\" y=\"{:.1}\" class=\"lbl\">{}</text>",
                c.y + LANE - 4.0,
                escape(&text.chars().take(30).collect::<String>())
            );
        }
        for (_, lane) in row {
            for (kind, n) in lane.slices.iter().map(|s| (s.kind, &s.name)).chain(lane.instants.iter().map(|i| (i.kind, &i.name))) {
                c.used.entry(legend_name(kind, n)).or_insert_with(|| color(kind, n));
            }
            draw_slices(o, lane, c.y, scale);
            draw_instants(o, lane, c.y, scale);
            if !packed {
                draw_ttft(o, lane, c.y, scale);
            }
        }
        c.y += LANE;
    }
    for ((name, key), series) in &p.counters {
        if c.lanes >= MAX_LANES || group_rows >= MAX_GROUP_ROWS {
            c.lanes_left += 1;
            continue;
        }
        c.lanes += 1;
        group_rows += 1;
        let label = series.label.text(name, key);
        if o.room() {
            let _ = write!(
                o.body,
                "<text x=\"8\" y=\"{:.1}\" class=\"lbl\">{}</text>",
                c.y + 12.0,
                escape(&label.chars().take(30).collect::<String>())
            );
        }
        draw_counter(o, &label, &series.points, c.y, scale, PALETTE[c.counter_index % PALETTE.len()]);
        c.counter_index += 1;
        c.y += COUNTER;
    }
}

/// The TTFT in words, right of everything in the lane (or left of it), never over it.
fn draw_ttft(o: &mut Out, lane: &Lane, y: f64, scale: f64) {
    let (first, last) = extent(lane);
    let (first, last) = (first * scale, last * scale);
    for s in lane.slices.iter().filter(|s| s.kind == Kind::Mark(RequestMark::UntilFirstToken)) {
        let at = if last + 70.0 < WIDTH {
            Some((last + 4.0, "start"))
        } else if first > 70.0 {
            Some((first - 4.0, "end"))
        } else {
            None
        };
        if let Some((x, anchor)) = at.filter(|_| o.room()) {
            let _ = write!(
                o.body,
                "<text x=\"{:.1}\" y=\"{:.1}\" class=\"ttft\" text-anchor=\"{anchor}\">TTFT {}</text>",
                LABEL + x,
                y + LANE - 4.0,
                ms(s.dur)
            );
        }
    }
}

/// The time axis over `end` µs: ticks with their time and grid lines down to `height`.
fn axis(end: f64, scale: f64, height: f64) -> String {
    let step = tick_step(end, 8.0);
    let mut axis = String::new();
    let mut t = 0.0;
    while t <= end {
        let x = LABEL + t * scale;
        let label = if end >= 10e6 {
            format!("{:.0} s", t / 1e6)
        } else if end >= 1e6 {
            format!("{:.1} s", t / 1e6)
        } else {
            format!("{:.0} ms", t / 1e3)
        };
        let _ = write!(
            axis,
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{height:.1}\" class=\"grid\"/><text x=\"{x:.1}\" y=\"12\" class=\"lbl\" text-anchor=\"middle\">{label}</text>",
            AXIS - 6.0
        );
        t += step;
    }
    axis
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_named_by_its_counter_says_it_once() {
        assert_eq!(Label::of("server requests deferred", "deferred"), Label::Name);
        assert_eq!(Label::of("CPU MHz (mean)", "MHz"), Label::Name);
        assert_eq!(Label::of("GPU 0 clock MHz", "sm"), Label::NameAndKey);
        assert_eq!(Label::NameAndKey.text("GPU 0 clock MHz", "sm"), "GPU 0 clock MHz sm");
    }
}
