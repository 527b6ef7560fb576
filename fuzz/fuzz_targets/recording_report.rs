//! A recording (`events.bin` bytes) through everything `probe report` does with it: the reader,
//! the report built in memory and streamed (the two must agree), the text summary, report.json,
//! the timeline, the flamegraphs and the HTML page; report.json reads back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probe_user::{
    analysis::flame,
    analysis::ksyms,
    analysis::report,
    record::{self, records::UserRecord},
    render::html,
    render::perfetto,
};

fuzz_target!(|data: &[u8]| {
    let Ok(mut rec) = record::parse(data, "events.bin") else { return };
    let r = report::build(&rec);
    let streamed = probe_user::analysis::Analysis::report_bytes(data).expect("the streamed reader refuses what the whole reader read");
    // `probe trace` reports from memory, `probe report` streams: the same recording, the same report.
    if rec.events_not_kept == 0 && rec.stacks_not_kept == 0 {
        assert_eq!(r, streamed, "the streamed report differs from the one built in memory");
    }
    let _ = probe_user::render::text::render(&r);
    let json = serde_json::to_string(&r).expect("report.json serializes");
    // Read back, not compared: serde_json may parse a float's last digit differently.
    let _: report::Report = serde_json::from_str(&json).expect("report.json reads back");
    let names = ksyms::Names::of(&rec);
    let trace = perfetto::build(&rec, &r, &names);
    // Symbolization opens the files the recording names: not here (the input names any path).
    rec.records.retain(|u| !matches!(u, UserRecord::Module(_)));
    let flames = flame::Flames::of(&rec, flame::Window::default());
    let page = html::render(&r, &trace, &html::flamegraphs(&probe_user::render::flame::draw_all(&flames)), None);
    assert!(page.ends_with("</body></html>\n"));
    // Text from the recording (names, paths, the server's JSON) is escaped: one script, the page's.
    assert_eq!(page.to_ascii_lowercase().matches("<script").count(), 1, "markup from the recording reached the page");
});
