//! The report pages docs/bug-reports.md shows, made and photographed by headless Chromium at
//! 1300 px: the README walkthrough pair (SmolLM2 Q4_1, whole prompt vs prefill chunks of 18) and a
//! padded batch (the same prompt alone vs between a longer and a shorter request). Each page has
//! its marks, its paired row, and nothing past the page's width. With `UPDATE_SCREENSHOTS=1` the
//! screenshots replace docs/images/report-{walkthrough,padded}.png (`tools/report-screenshots.sh`).

use crate::check::{assert_fits, chromium, chromium_bin};
use crate::util::{p, smollm2_path, smollm2_walkthrough, tmp, trace_s};
use std::path::Path;

/// A PNG's (width, height), from its IHDR chunk.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert!(png.len() > 24 && png.starts_with(b"\x89PNG\r\n\x1a\n") && &png[12..16] == b"IHDR", "not a PNG");
    let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

/// `trace report a b` as a page in `dir/name.html`, checked in Chromium, then its screenshot
/// (1300 × 2600 px): in docs/images with `UPDATE_SCREENSHOTS=1`, in `dir` otherwise. The DOM.
fn page(a: &Path, b: &Path, dir: &Path, name: &str) -> String {
    let html = dir.join(format!("{name}.html"));
    let (code, msg, err) = trace_s(&["report", p(a), p(b), "-o", p(&html)]);
    assert_eq!(code, 1, "the pair diverges: {msg}{err}");
    let (dom, console) = chromium(&html).expect("chromium");
    assert!(console.is_empty(), "console messages: {console:?}");
    assert_fits(&std::fs::read_to_string(&html).unwrap(), dir);
    assert!(dom.contains("class=\"mark root\"") && dom.contains(">token position</text>") && dom.contains(">layer</text>"), "{name}: the root's mark and axis titles");
    let out = if std::env::var("UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") {
        let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/images");
        std::fs::create_dir_all(&images).unwrap();
        images.join(format!("report-{name}.png"))
    } else {
        dir.join(format!("report-{name}.png"))
    };
    let st = std::process::Command::new(chromium_bin().expect("chromium"))
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,2600"])
        .arg(format!("--screenshot={}", out.display()))
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("run chromium");
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert_eq!(png_size(&std::fs::read(&out).unwrap()), (1300, 2600), "{}", out.display());
    dom
}

#[test]
fn report_pages_in_the_docs() {
    if chromium_bin().is_none() {
        return;
    }
    let f = smollm2_walkthrough();
    let d = tmp();
    let dom = page(&f.path("whole.trace"), &f.path("chunk18.trace"), d.path(), "walkthrough");
    // The flip (token 11) and the earliest entry (an absorbed softmax difference) are marked.
    assert!(dom.contains("class=\"mark flip\"") && dom.contains("class=\"mark entry\""), "walkthrough marks");
    // A padded batch: the same request as b's row 1; the page follows that row and names the pairing.
    let m = smollm2_path();
    let batch = d.path().join("batch.trace");
    let prompts = ["Write a short poem about the sea, the wind and the boats coming home at night.", "Tell me about Richard Feynman.", "Hi!"];
    let (code, _, err) = trace_s(&["record", "--model", p(&m), "--chat", "--max-tokens", "16", "--prompt", prompts[0], "--prompt", prompts[1], "--prompt", prompts[2], "-o", p(&batch)]);
    assert_eq!(code, 0, "{err}");
    let dom = page(&f.path("whole.trace"), &batch, d.path(), "padded");
    assert!(dom.contains("run.requests") && dom.contains("1 request, row 0 is b's row 1") && dom.contains("3 requests, row 1 is a's row 0; rows 0, 2 only in b"), "the pairing in the settings");
    assert!(!dom.contains(">run.prompt<"), "no prompt of another request in the settings");
}
