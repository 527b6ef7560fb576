//! `report.html`: one self-contained page (no network, no fonts, inline CSS, a few lines of
//! inline JS that the page does not need) with the verdicts first, an SVG timeline drawn from the
//! trace-event JSON, the flamegraphs as embedded images, and the tables of the text summary.
//! [`render`] is pure: it shows only what report.json and the timeline hold (request metadata,
//! never prompt or response text). [`write`] reads a recording directory and writes the page.
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

use crate::{
    analysis::flame,
    analysis::report::{Closer, Report},
    analysis::verdict::Split,
    util::text::bytes,
};

pub mod chart;

pub const FILE_NAME: &str = "report.html";

/// Text for HTML and SVG, in element content and in quoted attribute values.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            // Control characters are not allowed in HTML text; show them, do not pass them on.
            c if c.is_control() && c != '\n' && c != '\t' => o.push('\u{fffd}'),
            c => o.push(c),
        }
    }
    o
}

/// Standard base64 (RFC 4648, padded), for data: URLs.
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut o = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                o.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                o.push('=');
            }
        }
    }
    o
}

/// The causes of a TTFT split, in bar order, with their colours.
pub const CAUSES: [(&str, &str); 10] = [
    ("queue", "#9467bd"),
    ("disk", "#d62728"),
    ("memory", "#ff7f0e"),
    ("cpu_contention", "#17becf"),
    ("power", "#e6c700"),
    ("load", "#8c564b"),
    ("compute", "#2ca02c"),
    ("unexplained", "#bdbdbd"),
    ("before_attach", "#636363"),
    ("steal", "#393b79"),
];

/// The split as ms per cause (in [`CAUSES`] order) adding up to the TTFT exactly: each cause
/// is clipped to what is left of the TTFT, and what the split leaves uncovered is unexplained.
pub fn segments(split: &Split, ttft: f64) -> [f64; 10] {
    let vals = split.parts();
    let mut left = if ttft.is_finite() { ttft.max(0.0) } else { 0.0 };
    let mut out = [0.0; 10];
    for (o, v) in out.iter_mut().zip(vals) {
        let v = if v.is_finite() { v.clamp(0.0, left) } else { 0.0 };
        *o = v;
        left -= v;
    }
    out[7] += left;
    out
}

/// Pixel widths of the stacked bar: the longest TTFT in the table gets `full` px.
pub fn bar_widths(segs: &[f64; 10], ttft: f64, longest: f64, full: f64) -> [f64; 10] {
    let bar = if longest > 0.0 { full * ttft / longest } else { 0.0 };
    segs.map(|ms| if ttft > 0.0 { bar * ms / ttft } else { 0.0 })
}

const BAR: f64 = 240.0;
/// Larger flamegraphs are named, not embedded (base64 adds a third), to keep the page light.
const MAX_FLAME_BYTES: usize = 4 << 20;

fn ms(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| escape(&v.to_string())).unwrap_or_else(|| "–".into())
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        return String::new();
    }
    format!("<ul>{}</ul>", items.iter().map(|i| format!("<li>{}</li>", escape(i))).collect::<String>())
}

/// The stacked TTFT bar of one request, with the ms numbers under it.
fn ttft_bar(split: &Split, ttft: f64, longest: f64) -> String {
    let segs = segments(split, ttft);
    let widths = bar_widths(&segs, ttft, longest, BAR);
    let mut o = format!("<svg class=\"bar\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{BAR}\" height=\"14\" viewBox=\"0 0 {BAR} 14\">");
    let mut x = 0.0;
    for (((name, c), w), v) in CAUSES.iter().zip(widths).zip(segs) {
        if v > 0.0 {
            let _ = write!(
                o,
                "<rect x=\"{x:.2}\" y=\"1\" width=\"{w:.2}\" height=\"12\" fill=\"{c}\"><title>{name} {} ms</title></rect>",
                ms(v)
            );
        }
        x += w;
    }
    o.push_str("</svg><div class=\"nums\">");
    let parts: Vec<String> = CAUSES
        .iter()
        .zip(segs)
        .filter(|(_, v)| *v > 0.0)
        .map(|((name, c), v)| format!("<span class=\"sw\" style=\"background:{c}\"></span>{name} {}", ms(v)))
        .collect();
    o.push_str(&parts.join(" · "));
    o.push_str(" ms</div>");
    o
}

/// The lines every one of two or more lists holds.
fn common_lines<'a>(mut lists: impl Iterator<Item = &'a [String]>) -> Vec<String> {
    let Some(first) = lists.next() else { return vec![] };
    let mut common: Vec<String> = first.to_vec();
    let mut n = 1;
    for l in lists {
        common.retain(|c| l.contains(c));
        n += 1;
    }
    if n < 2 { vec![] } else { common }
}

fn verdicts(o: &mut String, r: &Report) {
    let _ = writeln!(o, "<h2 id=\"verdicts\">Verdicts</h2>");
    if r.requests.is_empty() {
        let _ = writeln!(o, "<p class=\"muted\">No HTTP requests were seen on the target's sockets.</p>");
        return;
    }
    let legend: Vec<String> = CAUSES.iter().map(|(n, c)| format!("<span class=\"sw\" style=\"background:{c}\"></span>{n}")).collect();
    let _ = writeln!(o, "<p class=\"legend\">Time to first token by cause: {}</p>", legend.join(" "));
    let longest = r.requests.iter().filter_map(|q| q.ttft_ms).fold(0.0, f64::max);
    // A data-quality line every request carries (no power data, a probe not live) is true of
    // the trace: said once above the table, not on every row.
    let common = common_lines(r.requests.iter().map(|q| q.verdict.as_ref().map_or(&[][..], |v| v.data_quality.as_slice())));
    if !common.is_empty() {
        let _ = writeln!(o, "<div class=\"dq\">Data quality, for every request: {}</div>", list(&common));
    }
    let _ = writeln!(
        o,
        "<table class=\"verdicts\"><thead><tr><th>#</th><th>request</th><th>status</th><th>TTFT ms</th><th>TTFT split</th><th>slow cause</th><th>stop cause</th><th>evidence</th><th>data quality</th></tr></thead><tbody>"
    );
    for q in &r.requests {
        let v = q.verdict.as_ref();
        let bar = match (v.and_then(|v| v.ttft_ms.as_ref()), q.ttft_ms) {
            (Some(s), Some(t)) => ttft_bar(s, t, longest),
            (_, Some(_)) => "<span class=\"muted\">not split</span>".into(),
            _ => "<span class=\"muted\">no first token seen</span>".into(),
        };
        let slow = v.map_or("–", |v| v.slow_cause.name());
        let _ = writeln!(
            o,
            "<tr id=\"request-{}\"><td>{}</td><td><code>{} {}</code></td><td>{}</td><td class=\"n\">{}</td><td>{bar}</td><td class=\"cause {}\">{}</td><td>{}</td><td>{}</td><td class=\"dq\">{}</td></tr>",
            q.id,
            q.id,
            escape(q.method.as_deref().unwrap_or("?")),
            escape(q.path.as_deref().unwrap_or("?")),
            opt(q.status),
            q.ttft_ms.map(ms).unwrap_or_else(|| "–".into()),
            if v.is_none_or(|v| v.slow_cause == crate::analysis::verdict::SlowCause::None) { "" } else { "slow" },
            escape(slow),
            escape(&v.map(|v| v.stop_cause.words()).unwrap_or_else(|| "–".into())),
            v.map(|v| list(&v.evidence.iter().cloned().chain(q.engine.as_ref().map(|e| e.words())).collect::<Vec<_>>()))
                .unwrap_or_default(),
            v.map(|v| list(&v.data_quality.iter().filter(|l| !common.contains(l)).cloned().collect::<Vec<_>>())).unwrap_or_default()
        );
    }
    let _ = writeln!(o, "</tbody></table>");
}

fn header(o: &mut String, r: &Report) {
    let t = &r.target;
    let _ = writeln!(o, "<h1>probe report: {} (pid {})</h1>", escape(&t.comm), t.pid);
    let _ = writeln!(o, "<table class=\"kv\">");
    let row = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "<tr><th>{k}</th><td>{v}</td></tr>");
    };
    row(o, "command line", format!("<code>{}</code>", escape(&t.cmdline)));
    let stopped = t.end_reason.as_ref().map(|e| format!(", stopped: {}", escape(e))).unwrap_or_default();
    row(o, "traced", format!("{:.1} s, {}{stopped}", r.duration_s, r.events_phrase()));
    let others: Vec<String> = t.processes.iter().filter(|p| p.pid != t.pid).map(|p| format!("{} ({})", p.pid, escape(&p.comm))).collect();
    if !others.is_empty() {
        row(o, "also traced", others.join(", "));
    }
    let lost: u64 = r.lost_events.values().sum();
    let per: Vec<String> = r.lost_events.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{} {n}", escape(k))).collect();
    row(o, "lost events", if lost == 0 { "none".into() } else { format!("<b class=\"bad\">{lost}</b> ({})", per.join(", ")) });
    let skipped: Vec<String> = r
        .probes
        .iter()
        .filter(|p| !p.live)
        .map(|p| format!("{}: {}", escape(p.name.name()), escape(&serde_json::to_string(&p.skipped).unwrap_or_default())))
        .collect();
    let live: Vec<String> = r.probes.iter().filter(|p| p.live).map(|p| escape(p.name.name())).collect();
    row(
        o,
        "probes",
        format!(
            "{}{}",
            if live.is_empty() { "–".into() } else { live.join(", ") },
            if skipped.is_empty() { String::new() } else { format!("; <b class=\"bad\">skipped</b>: {}", skipped.join("; ")) }
        ),
    );
    if !r.problems.is_empty() {
        row(o, "problems", list(&r.problems.iter().map(ToString::to_string).collect::<Vec<_>>()));
    }
    let _ = writeln!(o, "</table>");
}

fn flames(o: &mut String, flames: &[(String, String)]) {
    let _ = writeln!(o, "<h2 id=\"flamegraphs\">Flamegraphs</h2>");
    if flames.is_empty() {
        let _ = writeln!(o, "<p class=\"muted\">No stacks in this recording (the cpu and offcpu probes record them).</p>");
        return;
    }
    let _ = writeln!(
        o,
        "<p class=\"muted\">Shown as images; the interactive SVGs (zoom, search) are the flame-*.svg files beside this page.</p>"
    );
    for (kind, svg) in flames {
        if svg.len() > MAX_FLAME_BYTES {
            let _ = writeln!(
                o,
                "<p>{}: {} of SVG, too large to embed: open flame-{}.svg beside this page.</p>",
                escape(kind),
                bytes(svg.len() as u64),
                escape(kind)
            );
            continue;
        }
        // An <img> never runs the SVG's own script: no errors, no network, nothing to escape.
        let _ = writeln!(
            o,
            "<figure><figcaption>{}</figcaption><img class=\"flame\" alt=\"{} flamegraph\" src=\"data:image/svg+xml;base64,{}\"></figure>",
            escape(kind),
            escape(kind),
            base64(svg.as_bytes())
        );
    }
}

fn tables(o: &mut String, r: &Report) {
    files_table(o, r);
    blockio_table(o, r);
    connections_table(o, r);
    requests_table(o, r);
    stacks_line(o, r);
}

/// Files read, largest first.
fn files_table(o: &mut String, r: &Report) {
    let _ = writeln!(o, "<h2 id=\"files\">Files read</h2>");
    if r.files.is_empty() {
        let _ = writeln!(o, "<p class=\"muted\">Nothing was read from storage through the page cache.</p>");
    } else {
        let _ = writeln!(
            o,
            "<table><thead><tr><th>path</th><th>major faults</th><th>read</th><th>block reads</th><th>io time ms</th></tr></thead><tbody>"
        );
        for f in r.files.iter().take(100) {
            let _ = writeln!(
                o,
                "<tr><td><code>{}</code></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{:.1}</td></tr>",
                escape(&f.path),
                f.major_faults,
                bytes(f.read_bytes),
                f.block_reads,
                f.io_time_ms
            );
        }
        let _ = writeln!(o, "</tbody></table>");
        if r.files.len() > 100 {
            let _ = writeln!(o, "<p class=\"muted\">{} more in report.json</p>", r.files.len() - 100);
        }
    }
}

/// Block IO per device, page faults and memory maps.
fn blockio_table(o: &mut String, r: &Report) {
    let b = &r.blockio;
    let _ = writeln!(
        o,
        "<h2 id=\"blockio\">Block IO</h2><p>{} requests, {} read, {} written</p>",
        b.requests,
        bytes(b.read_bytes),
        bytes(b.write_bytes)
    );
    if !b.devices.is_empty() {
        let _ = writeln!(
            o,
            "<table><thead><tr><th>device</th><th>requests</th><th>read</th><th>written</th><th>latency p50 / p90 / p99 / max µs</th><th>queue p50 / p99 µs</th></tr></thead><tbody>"
        );
        for d in &b.devices {
            let (l, q) = (&d.latency_us, &d.queue_us);
            let _ = writeln!(
                o,
                "<tr><td>{} {}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{:.0} / {:.0} / {:.0} / {:.0}</td><td class=\"n\">{}</td></tr>",
                escape(&d.dev),
                escape(d.name.as_deref().unwrap_or("")),
                d.requests,
                bytes(d.read_bytes),
                bytes(d.write_bytes),
                l.p50,
                l.p90,
                l.p99,
                l.max,
                if q.count == 0 { "–".into() } else { format!("{:.0} / {:.0}", q.p50, q.p99) }
            );
        }
        let _ = writeln!(o, "</tbody></table>");
    }
    let minor = r.faults.minor.map(|m| m.to_string()).unwrap_or_else(|| "not counted".into());
    let _ = writeln!(
        o,
        "<h2 id=\"faults\">Page faults</h2><p>{} major ({} outside file mappings), {minor} minor</p>",
        r.faults.major, r.faults.major_unresolved
    );
    let counts: Vec<String> = r.mmap_counts.iter().map(|(k, v)| format!("{v} {}", escape(k))).collect();
    let _ = writeln!(o, "<h2 id=\"mmaps\">Memory maps</h2><p>{}</p>", if counts.is_empty() { "none".into() } else { counts.join(", ") });
    let named: Vec<_> = r.mmaps.iter().filter(|m| m.path.is_some()).take(50).collect();
    if !named.is_empty() {
        let _ = writeln!(o, "<table><thead><tr><th>at s</th><th>pid</th><th>call</th><th>length</th><th>file</th></tr></thead><tbody>");
        for m in named {
            let _ = writeln!(
                o,
                "<tr><td class=\"n\">{:.3}</td><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{}</td><td><code>{}</code></td></tr>",
                m.t_ms / 1e3,
                m.pid,
                escape(&m.op.name()),
                bytes(m.len),
                escape(m.path.as_deref().unwrap_or(""))
            );
        }
        let _ = writeln!(o, "</tbody></table>");
    }
}

/// The TCP connections and how each ended.
fn connections_table(o: &mut String, r: &Report) {
    let _ = writeln!(o, "<h2 id=\"connections\">TCP connections: {}</h2>", r.connections.len());
    if !r.connections.is_empty() {
        let _ = writeln!(
            o,
            "<table><thead><tr><th>local</th><th>peer</th><th>opened ms</th><th>closed ms</th><th>closed by</th><th>reset</th><th>states</th></tr></thead><tbody>"
        );
        for c in r.connections.iter().take(200) {
            let _ = writeln!(
                o,
                "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"small\">{}</td></tr>",
                escape(&c.local),
                escape(&c.peer),
                c.opened_ms.map(ms).unwrap_or_else(|| "–".into()),
                c.closed_ms.map(ms).unwrap_or_else(|| "–".into()),
                if c.closed_by == Closer::None { "still open".into() } else { escape(c.closed_by.name()) },
                escape(c.reset.name()),
                escape(&c.states.join(" → "))
            );
        }
        let _ = writeln!(o, "</tbody></table>");
    }
}

/// The requests table.
fn requests_table(o: &mut String, r: &Report) {
    if !r.requests.is_empty() {
        let _ = writeln!(o, "<h2 id=\"requests\">Requests: {}</h2>", r.requests.len());
        let _ = writeln!(
            o,
            "<table><thead><tr><th>#</th><th>request</th><th>status</th><th>arrival ms</th><th>TTFB ms</th><th>TTFT ms</th><th>total ms</th><th>chunks</th><th>gap p50 / p99 / max ms</th><th>max tokens</th><th>finish</th><th>ended</th><th>server's final message</th><th>HTTP framing ended</th></tr></thead><tbody>"
        );
        for q in &r.requests {
            let finish = q.stop.finish_reason.clone().or(q.stop.stop_type.clone()).or(q.stop.done_reason.clone()).or(q
                .stop
                .error
                .as_ref()
                .map(|_| "error".into()));
            let ended = q.ended();
            // Typed, as report.json has them (a lookup by key name once missed them all).
            let gaps =
                q.chunk_gaps.as_ref().map_or_else(|| "–".into(), |g| format!("{} / {} / {}", ms(g.p50_ms), ms(g.p99_ms), ms(g.max_ms)));
            let _ = writeln!(
                o,
                "<tr><td>{}</td><td><code>{} {}</code></td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                q.id,
                escape(q.method.as_deref().unwrap_or("?")),
                escape(q.path.as_deref().unwrap_or("?")),
                opt(q.status),
                q.arrival_ms.map(ms).unwrap_or_else(|| "–".into()),
                q.ttfb_ms.map(ms).unwrap_or_else(|| "–".into()),
                q.ttft_ms.map(ms).unwrap_or_else(|| "–".into()),
                q.end_ms.map(ms).unwrap_or_else(|| "–".into()),
                q.chunks,
                gaps,
                opt(q.max_tokens),
                opt(finish),
                escape(&ended),
                if q.content_complete {
                    "yes"
                } else if q.partial {
                    "no (partly seen)"
                } else {
                    "no"
                },
                if q.transport_complete { "yes" } else { "no" }
            );
        }
        let _ = writeln!(o, "</tbody></table>");
    }
}

/// The stack samples: how many, how deep, how many unwound to the end.
fn stacks_line(o: &mut String, r: &Report) {
    if !r.stacks.is_empty() {
        let per: Vec<String> =
            r.stacks.iter().map(|(k, s)| format!("{} {} (median depth {})", s.stacks, escape(k), s.median_depth)).collect();
        let _ = writeln!(o, "<h2 id=\"stacks\">Stacks</h2><p>{}; {}</p>", per.join(", "), crate::render::unwound(&r.unwind, "µs"));
    }
}

const STYLE: &str = "body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}code{font-size:.92em;word-break:break-all}
table.kv th{width:9em}ul{margin:0;padding-left:1.1em}.muted{color:#777}.bad{color:#b00}.small{font-size:.85em}
td.cause.slow{font-weight:bold;color:#b00}td.dq{font-size:.85em;color:#666}.nums{font-size:.8em;color:#444;white-space:nowrap}
.sw{display:inline-block;width:.8em;height:.8em;margin:0 .25em 0 .6em;vertical-align:-.05em;border:1px solid #0002}
.legend{font-size:.85em}svg.timeline{display:block;margin-top:.4em}svg text.lbl{font-size:10px;fill:#333}
svg text.grp{font-size:11px;font-weight:bold;fill:#111}svg text.ttft{font-size:9px;fill:#a0400b}svg line.grid{stroke:#eee}
.scroll{overflow-x:auto}figure{margin:1em 0}figcaption{font-weight:bold}img.flame{max-width:100%;border:1px solid #ddd}
nav a{margin-right:1em}";

/// Error hooks before anything else, and a marker once the page (and its images) loaded: the
/// headless-browser test reads both. The page does not need the script.
const SCRIPT: &str = "(function(){var errs=[];function note(m){errs.push(String(m));document.documentElement.setAttribute('data-errors',errs.join(' | '));}
window.addEventListener('error',function(e){var t=e.target;note(t&&t!==window&&(t.src||t.href)?'cannot load '+(t.src||t.href).slice(0,80):e.message);},true);
window.addEventListener('unhandledrejection',function(e){note('unhandled rejection: '+e.reason);});
document.addEventListener('securitypolicyviolation',function(e){note('blocked by the page policy: '+e.blockedURI);});
var ce=console.error;console.error=function(){note(Array.prototype.join.call(arguments,' '));return ce.apply(console,arguments);};
window.addEventListener('load',function(){var imgs=document.images;for(var i=0;i<imgs.length;i++){if(!imgs[i].complete||!imgs[i].naturalWidth){note('image not drawn: '+imgs[i].alt);}}
var tl=document.querySelector('svg.timeline');var lw=tl?Number(tl.getAttribute('data-label-width')):0;var lbls=tl?tl.querySelectorAll('text.lbl[x=\"8\"]'):[];for(var j=0;j<lbls.length;j++){var l=lbls[j];if(8+l.getComputedTextLength()>lw){note('label overflows its lane: '+l.textContent);}}
document.body.setAttribute('data-rendered',errs.length?'errors':'ok');});})();";

/// The page. `timeline` is the trace crate::render::perfetto::build makes (its events drawn as they are,
/// never re-read from JSON); `flames` are (kind, SVG text) pairs.
/// The diff section of the page: the slowest request against its warm baseline, and its
/// differential flamegraphs (name, SVG).
pub struct DiffSection<'a> {
    pub diff: &'a crate::analysis::diff::Diff,
    pub svgs: Vec<(String, String)>,
}

/// The slowest request of an analysis against its warm baseline, when it has both and its
/// stacks were folded per request (`Needs::per_request`); `clean` renames frames.
pub fn diff_of(
    a: &crate::analysis::Analysis,
    clean: &dyn Fn(&str) -> String,
) -> Option<(crate::analysis::diff::Diff, crate::render::diff::Drawn)> {
    let (d, ia, ib) = crate::analysis::diff::against_baseline(a)?;
    let drawn = crate::render::diff::draw(&d, &ia, &ib, clean).ok()?;
    Some((d, drawn))
}

fn diff_section(o: &mut String, s: &DiffSection<'_>) {
    let d = s.diff;
    let _ = writeln!(o, "<h2 id=\"diff\">Slowest against warm</h2>");
    let _ = writeln!(o, "<p><strong>{}</strong></p>", escape(&d.headline));
    let _ = writeln!(
        o,
        "<p class=\"muted\">A: {}; B: {}. `probe diff` writes this as diff.md and diff.json.</p>",
        escape(&d.a.label),
        escape(&d.b.label)
    );
    let _ = writeln!(o, "<table><tr><th></th><th>A</th><th>B</th><th>B − A</th></tr>");
    let mut row = |name: &str, x: &crate::analysis::diff::Delta| {
        let _ = writeln!(o, "<tr><td>{}</td><td>{:.0} ms</td><td>{:.0} ms</td><td>{:+.0} ms</td></tr>", escape(name), x.a, x.b, x.delta);
    };
    if let Some(t) = &d.ttft_ms {
        row("TTFT", t);
    }
    for p in d.split.iter().filter(|p| p.ms.a.abs() >= 0.5 || p.ms.b.abs() >= 0.5) {
        row(&format!("↳ {}", p.part), &p.ms);
    }
    let _ = writeln!(o, "</table>");
    for f in &d.flames {
        let _ = writeln!(
            o,
            "<p>{} ({}, {}): {}</p>",
            escape(&f.kind),
            escape(&f.unit),
            f.normalised,
            escape(&crate::render::diff::flame_words(f))
        );
    }
    for (name, svg) in &s.svgs {
        if svg.len() > MAX_FLAME_BYTES {
            let _ = writeln!(o, "<p>{}: too large to embed.</p>", escape(name));
            continue;
        }
        let _ = writeln!(
            o,
            "<figure><figcaption>{} (red: more in B, blue: less)</figcaption><img class=\"flame\" alt=\"{} differential flamegraph\" src=\"data:image/svg+xml;base64,{}\"></figure>",
            escape(name),
            escape(name),
            base64(svg.as_bytes())
        );
    }
}

pub fn render(
    r: &Report,
    timeline: &crate::render::perfetto::Trace,
    flamegraphs: &[(String, String)],
    diff: Option<&DiffSection<'_>>,
) -> String {
    let mut o = String::with_capacity(64 * 1024);
    let _ = writeln!(o, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    // Nothing may be fetched: the page works offline and cannot leak anything when opened.
    let _ = writeln!(
        o,
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
    );
    let _ = writeln!(o, "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
    let _ = writeln!(o, "<meta name=\"generator\" content=\"probe {}\">", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(o, "<title>probe report: {} (pid {})</title>", escape(&r.target.comm), r.target.pid);
    let _ = writeln!(o, "<style>{STYLE}</style>\n<script>{SCRIPT}</script>\n</head><body>");
    let _ = writeln!(
        o,
        "<nav><a href=\"#verdicts\">verdicts</a><a href=\"#system\">system</a><a href=\"#timeline\">timeline</a><a href=\"#flamegraphs\">flamegraphs</a><a href=\"#files\">files</a><a href=\"#blockio\">block IO</a><a href=\"#connections\">connections</a></nav>"
    );
    header(&mut o, r);
    verdicts(&mut o, r);
    let system = crate::render::system::render(&r.system);
    let _ = writeln!(o, "<h2 id=\"system\">System</h2>\n<pre>{}</pre>", escape(system.trim_start_matches("\nSystem:\n").trim_end()));
    let chart = chart::svg(&timeline.events);
    let _ = writeln!(o, "<h2 id=\"timeline\">Timeline</h2>");
    let _ = writeln!(
        o,
        "<p class=\"muted\">Hover for details. Requests: the wait for the first token, then each token; threads: off-CPU time by what they waited for; block IO per device; TCP state changes; counters. timeline.json opens in the Perfetto UI.</p>"
    );
    let _ = writeln!(o, "<div class=\"scroll\">{}</div>", chart.svg);
    for n in &chart.notes {
        let _ = writeln!(o, "<p class=\"muted\">{}</p>", escape(n));
    }
    if let Some(d) = diff {
        diff_section(&mut o, d);
    }
    flames(&mut o, flamegraphs);
    tables(&mut o, r);
    let _ = writeln!(o, "</body></html>");
    o
}

/// The flamegraphs for the page, from the SVGs drawn once for the files beside it
/// (`render::flame::draw_all`): (kind, SVG text).
pub fn flamegraphs(drawn: &[(flame::Kind, Vec<u8>)]) -> Vec<(String, String)> {
    drawn.iter().map(|(kind, svg)| (kind.name().to_string(), String::from_utf8_lossy(svg).into_owned())).collect()
}

/// Write `dir/report.html` for a recording already analysed, with its flamegraphs as drawn
/// (`render::flame::draw_all`); returns its path.
pub fn write_for(
    a: &crate::analysis::Analysis,
    drawn: &[(flame::Kind, Vec<u8>)],
    dir: &crate::util::output::OutDir,
) -> anyhow::Result<PathBuf> {
    let diff = diff_of(a, &|s: &str| s.to_string());
    let section = diff.as_ref().map(|(d, drawn)| DiffSection {
        diff: d,
        svgs: drawn
            .iter()
            .filter(|(n, _)| n.ends_with(".svg"))
            .map(|(n, b)| (n.clone(), String::from_utf8_lossy(b).into_owned()))
            .collect(),
    });
    let page = render(&a.report, &crate::render::perfetto::of(a), &flamegraphs(drawn), section.as_ref());
    dir.write(FILE_NAME, page.as_bytes())
}

/// Read the recording in `dir` (two passes) and write `dir/report.html`; returns its path and the report.
pub fn write(dir: &Path) -> anyhow::Result<(PathBuf, Report)> {
    let a = crate::analysis::Analysis::of_dir(dir, crate::analysis::Needs::ALL)
        .with_context(|| format!("cannot read the recording in {}", dir.display()))?;
    let out = crate::util::output::OutDir::open(dir)?;
    Ok((write_for(&a, &crate::render::flame::draw_all(&a.flames), &out)?, a.report))
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    /// Events as their JSON reads.
    fn events(ev: Vec<Value>) -> Vec<crate::render::perfetto::TraceEvent> {
        serde_json::from_value(Value::Array(ev)).unwrap()
    }
    use super::*;
    use serde_json::json;

    #[test]
    fn escapes_markup_quotes_and_controls() {
        assert_eq!(escape(r#"<script>alert("x")</script> & 'y'"#), "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;");
        assert_eq!(escape("/models/a&b.gguf"), "/models/a&amp;b.gguf");
        assert_eq!(escape("a\u{1b}[31mb\0"), "a\u{fffd}[31mb\u{fffd}");
        assert_eq!(escape("ünïcode → ok\n"), "ünïcode → ok\n");
        assert_eq!(escape("&amp;"), "&amp;amp;");
    }

    #[test]
    fn a_line_true_of_every_request_is_said_once() {
        let a = vec!["no power data: no GPU".to_string(), "arrived 5 ms before attach".to_string()];
        let b = vec!["no power data: no GPU".to_string()];
        assert_eq!(common_lines([a.as_slice(), b.as_slice()].into_iter()), vec!["no power data: no GPU".to_string()]);
        assert!(common_lines([a.as_slice()].into_iter()).is_empty(), "one request keeps its own lines");
        assert!(common_lines([a.as_slice(), &[][..]].into_iter()).is_empty());
    }

    #[test]
    fn base64_matches_rfc4648() {
        for (i, o) in
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE="), ("foobar", "Zm9vYmFy")]
        {
            assert_eq!(base64(i.as_bytes()), o);
        }
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
    }

    #[test]
    fn split_bar_adds_up_to_the_ttft() {
        let split = Split { queue: 10.0, disk: 50.0, load: 20.0, compute: 15.0, unexplained: 5.0, ..Default::default() };
        let segs = segments(&split, 100.0);
        assert_eq!(segs.iter().sum::<f64>(), 100.0);
        let w = bar_widths(&segs, 100.0, 400.0, BAR);
        assert!((w.iter().sum::<f64>() - BAR / 4.0).abs() < 1e-9, "{w:?}");
        assert!((w[1] - BAR / 4.0 * 0.5).abs() < 1e-9);
        // Overlapping causes are clipped; a split short of the TTFT leaves the rest unexplained.
        let over = Split { disk: 80.0, memory: 80.0, ..Default::default() };
        let segs = segments(&over, 100.0);
        assert_eq!(segs, [0.0, 80.0, 20.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let short = Split { compute: 30.0, ..Default::default() };
        let segs = segments(&short, 100.0);
        assert_eq!((segs[6], segs[7]), (30.0, 70.0));
        let w = bar_widths(&segs, 100.0, 100.0, BAR);
        assert!((w.iter().sum::<f64>() - BAR).abs() < 1e-9);
        assert_eq!(segments(&split, f64::NAN).iter().sum::<f64>(), 0.0);
    }

    #[test]
    fn timeline_caps_elements_and_merges_subpixel_slices() {
        // 200 000 slices of 1 µs every 10 µs on 50 threads, and a counter sampled 100 000 times.
        let mut ev = vec![json!({"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "server"}})];
        for i in 0..200_000u64 {
            ev.push(json!({"ph": "X", "name": if i % 3 == 0 { "[io wait]" } else { "[lock wait]" }, "pid": 7, "tid": i % 50, "ts": i * 10, "dur": 1}));
        }
        for i in 0..100_000u64 {
            ev.push(json!({"ph": "C", "name": "gpu clock", "pid": 9, "tid": 0, "ts": i * 20, "args": {"MHz": (i % 17) * 100}}));
        }
        let chart = chart::svg(&events(ev));
        assert!(chart.elements <= chart::MAX_ELEMENTS);
        assert!(chart.svg.len() < 400_000, "{} bytes", chart.svg.len());
        assert!(chart.svg.contains(" × [lock wait]"), "merged runs say how many slices they hold");
        assert!(chart.svg.contains("gpu clock MHz: min 0, max 1600"));

        // 300 requests one after the other: packed into a couple of rows, not 300 lanes.
        let mut ev = vec![json!({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "requests"}})];
        for i in 0..300u64 {
            ev.push(
                json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": format!("#{i} POST /v1/chat/completions")}}),
            );
            ev.push(json!({"ph": "X", "name": format!("#{i} POST /v1/chat/completions"), "pid": 1, "tid": i, "ts": i * 2_000_000, "dur": 1_500_000}));
            ev.push(json!({"ph": "X", "name": "until first token", "pid": 1, "tid": i, "ts": i * 2_000_000, "dur": 300_000}));
        }
        let chart = chart::svg(&events(ev));
        assert!(chart.svg.contains(">#0 POST /v1/chat/compl +149</text>"), "two rows of 150");
        assert!(chart.notes.is_empty(), "{:?}", chart.notes);
        assert!(chart.svg.contains("#299 POST /v1/chat/completions: 1500 ms at 598000 ms"));

        // Far more distinct things than the cap: the rest is counted, not silently dropped.
        let ev: Vec<Value> = (0..20_000u64)
            .map(|i| json!({"ph": "X", "name": format!("n{i}"), "pid": 1, "tid": i % 10, "ts": i * 1000, "dur": 10}))
            .collect();
        let chart = chart::svg(&events(ev));
        assert_eq!(chart.elements, chart::MAX_ELEMENTS);
        assert!(chart.notes.iter().any(|n| n.contains("more elements not drawn")), "{:?}", chart.notes);
    }

    #[test]
    fn page_escapes_what_it_shows() {
        let mut r = Report::default();
        r.target.comm = "<b>srv</b>".into();
        r.target.cmdline = "llama-server -m \"/m/<x>.gguf\" --alias 'a&b'".into();
        r.problems.push(crate::record::problem::Problem::Said("<img src=x onerror=alert(1)>".into()));
        let tl = json!({"traceEvents": [{"ph": "X", "name": "<script>", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]});
        let tl: crate::render::perfetto::Trace = serde_json::from_value(tl).unwrap();
        let page = render(&r, &tl, &[("cpu".into(), "<svg xmlns=\"http://www.w3.org/2000/svg\"/>".into())], None);
        assert!(!page.contains("<b>srv") && !page.contains("<img src=x") && !page.contains("<script>\""));
        assert!(page.contains("&lt;b&gt;srv&lt;/b&gt;") && page.contains("&quot;/m/&lt;x&gt;.gguf&quot;") && page.contains("a&amp;b"));
        assert!(page.contains("&lt;script&gt;"));
        assert_eq!(page.matches("<script>").count(), 1, "only the page's own script");
        assert!(
            !page.contains("http://") || page.matches("http://").count() == page.matches("xmlns=\"http://www.w3.org/2000/svg\"").count(),
            "no links out"
        );
    }
}
