//! report.html of real recordings, checked in headless Chromium (Debian's `chromium`): the page
//! loads, its images decode, and nothing is logged to the console. The recordings:
//! tests/data/report/demo (the kernel demo: faults, block IO, TCP; no requests, no stacks) and
//! tests/data/html/llama-demo (`cargo xtask demo`: a real llama-server answering four requests,
//! with its flamegraphs). Without chromium these tests fail: run scripts/setup.sh.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use probe_user::render::html;

fn data(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data").join(p)
}

/// A fresh temporary directory with a copy of the recording (the page is written there; its
/// flamegraphs are drawn from the recording's stacks).
fn scratch(name: &str, from: &Path) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("probe-html-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(from.join("events.bin"), dir.join("events.bin")).unwrap();
    dir
}

fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return p.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n)))
        .find(|p| p.is_file())
        .expect("headless Chromium is needed to check report.html: run scripts/setup.sh (installs Debian's `chromium`) or set CHROMIUM=/path/to/chromium")
}

/// Load `page` in headless Chromium and return the DOM after load. Panics when Chromium fails,
/// the page's load marker is missing, the page's error hooks fired, or the console got a line.
fn browse(page: &Path) -> String {
    let dir = page.parent().unwrap();
    let (out, err) = (dir.join("chromium.out"), dir.join("chromium.err"));
    let t = Instant::now();
    let mut child = Command::new(chromium())
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=3000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", dir.join("chromium-profile").display()))
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("cannot start chromium: run scripts/setup.sh");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("chromium did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (dom, log) = (std::fs::read_to_string(&out).unwrap(), std::fs::read_to_string(&err).unwrap());
    eprintln!("chromium rendered {} in {:.2} s", page.display(), t.elapsed().as_secs_f64());
    assert!(status.success(), "chromium failed ({status}):\n{log}");
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE") || l.contains("Uncaught")).collect();
    assert!(console.is_empty(), "the page logged to the console:\n{}", console.join("\n"));
    if let Some(i) = dom.find("data-errors=") {
        panic!("the page's error hooks fired: {}", &dom[i..dom.len().min(i + 400)]);
    }
    assert!(
        dom.contains("data-rendered=\"ok\""),
        "the page's load marker is missing: did its script run?\n{}",
        &dom[..dom.len().min(2000)]
    );
    dom
}

/// Nothing in the page may point outside it.
fn self_contained(page: &str) {
    for bad in ["src=\"http", "href=\"http", "src=\"//", "href=\"//", "url(", "@import", "<link", "<iframe"] {
        assert!(!page.contains(bad), "the page refers to something outside it: {bad}");
    }
}

#[test]
fn llama_server_recording_renders() {
    let dir = scratch("llama", &data("html/llama-demo"));
    let (path, _) = html::write(&dir).unwrap();
    let page = std::fs::read_to_string(&path).unwrap();
    eprintln!("report.html of the llama-server recording: {} bytes", page.len());
    // A verdict row per request, with its cause and its TTFT split.
    for (id, req, stop) in [
        (1, "POST /v1/chat/completions", "requested limit"),
        (2, "POST /completion", "requested limit"),
        (3, "POST /v1/chat/completions", "client disconnect"),
        (4, "POST /v1/chat/completions", "requested limit"),
    ] {
        let at = page.find(&format!("<tr id=\"request-{id}\">")).unwrap_or_else(|| panic!("no verdict row for request {id}"));
        let row = &page[at..at + page[at..].find("</tr>").unwrap()];
        assert!(row.contains(req) && row.contains(stop) && row.contains("<svg class=\"bar\""), "{row}");
    }
    assert!(page.contains("compute 88.4"), "the ms numbers under the bar");
    // The timeline: a lane per request with its TTFT, the server's threads, TCP.
    assert!(page.contains("<svg class=\"timeline\""));
    assert!(page.contains("#1 POST /v1/chat/completions</text>") && page.contains(">TTFT 90.5 ms</text>"));
    assert!(page.contains("llama-server (pid 28239)") && page.contains("port 46233"));
    // Both flamegraphs, embedded. No "slowest against warm": the slowest first token (request
    // 1) computed its 38 prompt tokens, and the only other 38-token request (4) reused 37 of
    // them from the prompt cache: the warm baseline compares work, so it has none.
    assert_eq!(page.matches("src=\"data:image/svg+xml;base64,").count(), 2);
    assert!(!page.contains("<h2 id=\"diff\">"));
    self_contained(&page);
    assert!(page.len() < 1 << 20, "{} bytes", page.len());
    let dom = browse(&path);
    assert!(dom.contains("request-4"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn kernel_demo_recording_renders() {
    let dir = scratch("demo", &data("report/demo"));
    let (path, _) = html::write(&dir).unwrap();
    let page = std::fs::read_to_string(&path).unwrap();
    assert!(page.contains("No HTTP requests were seen"));
    assert!(page.contains("<svg class=\"timeline\"") && page.contains("major fault"));
    assert!(page.contains("<code>/work/main/target/demo/cold-weights.bin</code>"));
    assert!(page.contains("closed by</th>") && page.contains("127.0.0.1:34079"));
    self_contained(&page);
    browse(&path);
    let _ = std::fs::remove_dir_all(dir);
}

/// The bundle's report.html, masked: no directory names or addresses, and still a page that
/// renders (the masking happens before drawing, never inside the embedded images).
#[test]
fn masked_bundle_page_renders() {
    let dir = scratch("bundle", &data("html/llama-demo"));
    let a = probe_user::analysis::Analysis::of_recording(probe_user::record::read_dir(&dir).unwrap());
    let out = dir.join("bundle.tar.gz");
    let names = probe_user::render::bundle::write(&a, &out, true, true).unwrap();
    assert!(names.iter().any(|n| n == "report.html"), "{names:?}");
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(&out).unwrap()));
    let mut page = String::new();
    for e in tar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = e.path().unwrap().to_string_lossy().into_owned();
        if name.ends_with("report.html") {
            std::io::Read::read_to_string(&mut e, &mut page).unwrap();
        } else if name.ends_with(".svg") {
            // Masked before drawing: no raw `<dir>` tags in the markup, the script intact.
            let mut svg = String::new();
            std::io::Read::read_to_string(&mut e, &mut svg).unwrap();
            assert!(!svg.contains("<dir>") && !svg.contains("<ip>") && svg.contains("// Use GET parameters"), "{name}");
        }
    }
    assert!(page.contains("<tr id=\"request-1\">"));
    assert!(!page.contains("/root/.cache") && !page.contains("127.0.0.1"), "masked");
    assert!(page.contains("&lt;dir&gt;/llama-server") && page.contains("&lt;ip&gt;:46233"));
    self_contained(&page);
    let path = dir.join("masked.html");
    std::fs::write(&path, &page).unwrap();
    browse(&path);
    let _ = std::fs::remove_dir_all(dir);
}

/// The page checks its own lane labels in the browser: one longer than the label column is an
/// error (the load marker says so). A real page, with one lane label made too long, fails; the
/// page as written passes (llama_server_recording_renders). A screenshot of the real page is
/// left beside it (report.png) for people to look at.
#[test]
fn a_lane_label_that_overflows_is_caught_in_the_browser() {
    let dir = scratch("overflow", &data("html/llama-demo"));
    let (path, _) = html::write(&dir).unwrap();
    let page = std::fs::read_to_string(&path).unwrap();
    let shot = dir.join("report.png");
    let st = Command::new(chromium())
        .args(["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1400,2400", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", dir.join("chromium-shot").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", path.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success() && std::fs::metadata(&shot).unwrap().len() > 10_000, "no screenshot of report.html");
    eprintln!("screenshot: {}", shot.display());
    let label = "\">port 46233</text>";
    assert!(page.contains(label), "the demo page has no lane `port 46233`");
    let long = page.replacen(label, &format!("\">{}</text>", "W".repeat(40)), 1);
    let bad = dir.join("long-label.html");
    std::fs::write(&bad, long).unwrap();
    let caught = std::panic::catch_unwind(|| browse(&bad))
        .err()
        .map(|e| e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default());
    assert!(caught.as_deref().is_some_and(|m| m.contains("label overflows its lane")), "{caught:?}");
}
