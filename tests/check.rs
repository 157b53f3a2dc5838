//! `trace check`: one input run many ways, one table row per condition; the plan run by any
//! scheduler (`xargs -P 2` here) collects to the same table; golden traces for CI; markdown that
//! renders; the HTML report opened in headless Chromium.

use crate::util::{json, p, tmp, trace_s};
use std::path::Path;

const ARGS: [&str; 8] = ["--max-tokens", "8", "--runs", "2", "--vary", "threads,batch,prefill-chunk,dtype,padded-batch", "--format", "json"];

fn rows(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["rows"].as_array().expect("rows").clone()
}

fn row<'a>(rows: &'a [serde_json::Value], knob: &str, value: &str) -> &'a serde_json::Value {
    rows.iter().find(|r| r["knob"] == knob && r["value"] == value).unwrap_or_else(|| panic!("no row {knob} {value}: {rows:?}"))
}

#[test]
fn builtin_table_names_what_differs() {
    let d = tmp();
    let out = d.path().join("check");
    let (code, stdout, err) = trace_s(&[&["check", "--out", p(&out)][..], &ARGS[..]].concat());
    assert_eq!(code, 1, "some conditions differ on the builtin model: {err}");
    assert!(err.trim().is_empty(), "no progress bar when stderr is not a terminal: {err:?}");
    let v = json(&stdout);
    let rows = rows(&v);
    // The conditions: repeat, threads 1/2(/all), batch 1/2/4/8, prefill chunk whole/1/7/one that
    // does not divide the 30-token prompt, dtypes f32/f16/bf16, the prompt among other requests.
    for (k, val) in [
        ("repeat", "-"),
        ("threads", "1"),
        ("threads", "2"),
        ("batch", "8"),
        ("prefill-chunk", "whole"),
        ("prefill-chunk", "1"),
        ("prefill-chunk", "7"),
        ("prefill-chunk", "14"),
        ("dtype", "bf16"),
        ("padded-batch", "3 requests"),
    ] {
        let r = row(&rows, k, val);
        assert_eq!(r["runs"], 2, "{r}");
        // The whole prompt is the baseline's own setting: its runs are the repeats, not recorded again.
        let own = out.join(format!("{}-{}-1.trace", k, val.replace(' ', "_")));
        assert_eq!(own.is_file(), val != "whole", "{}", own.display());
    }
    for (k, val) in [("repeat", "-"), ("threads", "1"), ("threads", "2"), ("batch", "1"), ("prefill-chunk", "whole"), ("dtype", "f32")] {
        let r = row(&rows, k, val);
        assert_eq!((r["verdict"].as_str(), r["unique_outputs"].as_u64()), (Some("identical"), Some(1)), "{r}");
        assert!(r["bisect"].is_null() && r["root"].is_null());
    }
    // Chunked prefill and another dtype differ, and each row names its root, class and command.
    for (k, val, class) in [("prefill-chunk", "1", "shapes_differ"), ("batch", "2", "shapes_differ"), ("dtype", "f16", "dtype_differs")] {
        let r = row(&rows, k, val);
        assert_ne!(r["verdict"], "identical", "{r}");
        assert_eq!(r["class"], class, "{r}");
        assert!(r["root"].as_str().is_some_and(|s| s.contains(" @ ")), "{r}");
        let cmd = r["bisect"].as_str().unwrap();
        assert!(cmd.starts_with("trace bisect ") && cmd.contains("baseline.trace"), "{cmd}");
    }
    assert_eq!(v["identical"], false);
    assert!(v["missing"].as_array().unwrap().is_empty());
    // Text: a table with one line per condition, and the commands for the failing rows.
    let (code, text, _) = trace_s(&["check", "--collect", p(&out)]);
    assert_eq!(code, 1);
    assert!(text.contains("condition") && text.contains("prefill-chunk 1") && text.contains("to see why:"), "{text}");
}

/// The plan, run by `xargs -P 2`, collects to the table the in-process check gives.
#[test]
fn plan_run_by_xargs_collects_to_the_same_table() {
    let d = tmp();
    let (inproc, planned) = (d.path().join("inproc"), d.path().join("planned"));
    let (code, a, err) = trace_s(&[&["check", "--out", p(&inproc)][..], &ARGS[..]].concat());
    assert_eq!(code, 1, "{err}");
    let (code, msg, err) = trace_s(&[&["check", "--plan", p(&planned)][..], &ARGS[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(msg.contains("jobs.txt"), "{msg}");
    let jobs = std::fs::read_to_string(planned.join("jobs.txt")).unwrap();
    // One line per trace: the whole-prompt condition's runs are the repeats' traces.
    let manifest = json(&std::fs::read_to_string(planned.join("manifest.json")).unwrap());
    let traces: std::collections::BTreeSet<&str> = manifest["jobs"].as_array().unwrap().iter().map(|j| j["trace"].as_str().unwrap()).collect();
    assert_eq!(jobs.lines().count(), traces.len(), "{jobs}");
    assert!(manifest["jobs"].as_array().unwrap().len() > traces.len() && !jobs.contains("whole"), "{jobs}");
    let st = std::process::Command::new("sh").arg("-c").arg(format!("xargs -d '\\n' -n 1 -P 2 sh -c < {}", crate::util::p(&planned.join("jobs.txt")))).status().expect("xargs");
    assert!(st.success());
    let (code, b, err) = trace_s(&["check", "--collect", p(&planned), "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let strip = |s: &str| -> Vec<serde_json::Value> {
        rows(&json(s))
            .into_iter()
            .map(|mut r| {
                r.as_object_mut().unwrap().remove("bisect");
                r
            })
            .collect()
    };
    assert_eq!(strip(&a), strip(&b));
    // A trace not (yet) recorded is named, and the check does not pass.
    std::fs::remove_file(planned.join("threads-1-2.trace")).unwrap();
    let (code, b, _) = trace_s(&["check", "--collect", p(&planned), "--format", "json"]);
    assert_eq!(code, 1);
    let v = json(&b);
    assert_eq!(v["missing"], serde_json::json!(["threads-1-2.trace"]));
    assert_eq!(row(&rows(&v), "threads", "1")["runs"], 1);
    // Refusals: an existing check folder, an unknown knob, a varied knob also fixed.
    for (args, want) in [
        (vec!["check", "--plan", p(&planned)], "already holds a check"),
        (vec!["check", "--vary", "colour", "--out", p(&d.path().join("x"))], "--vary colour"),
        (vec!["check", "--vary", "batch", "--batch", "2", "--out", p(&d.path().join("y"))], "also sets --batch"),
        (vec!["check", "--collect", p(d.path())], "no manifest.json"),
    ] {
        let (code, _, err) = trace_s(&args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.starts_with("trace: error:") && err.contains(want) && err.lines().count() == 1, "{args:?}: {err}");
    }
}

#[test]
fn golden_passes_on_a_repeat_and_fails_on_another_prefill_chunk() {
    let d = tmp();
    let g = d.path().join("golden.trace");
    let (code, _, err) = trace_s(&["check", "--write-golden", p(&g), "--max-tokens", "8"]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = trace_s(&["check", "--golden", p(&g)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("verdict: identical"), "{out}");
    let kept = d.path().join("kept");
    let (code, out, err) = trace_s(&["check", "--golden", p(&g), "--prefill-chunk", "1", "--out", p(&kept)]);
    assert_eq!(code, 1, "{err}");
    assert!(out.starts_with("verdict: diverged") && out.contains("run.prefill_chunk"), "the bisect summary: {out}");
    // The run recorded here is kept in --out, for bisect, bundle or extract (it was deleted).
    let fresh = kept.join("this-machine.trace");
    assert!(err.contains("note: kept the run recorded here as") && err.contains("this-machine.trace"), "{err}");
    let (code, again, _) = trace_s(&["bisect", p(&g), p(&fresh)]);
    assert_eq!((code, again.lines().nth(3)), (1, out.lines().nth(3)), "the same report: {again}");
    let (code, _, err) = trace_s(&["check", "--golden", p(&d.path().join("none.trace"))]);
    assert_eq!(code, 2);
    assert!(err.contains("none.trace"), "{err}");
    // A cut golden is bad input (exit 2), not a run that diverged from it (exit 1).
    let bytes = std::fs::read(&g).unwrap();
    let cut = d.path().join("cut.trace");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let (code, out, err) = trace_s(&["check", "--golden", p(&cut)]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("cut.trace") && err.contains("is truncated") && err.contains("--write-golden") && err.lines().count() == 1, "{err}");
}

/// A condition whose every run is missing: the table names the trace and says runs are
/// missing, not that they differ (found by a fresh-user trial), and the check does not pass.
#[test]
fn collect_with_a_condition_missing_says_missing_not_differ() {
    let d = tmp();
    let planned = d.path().join("plan");
    let (code, _, err) = trace_s(&["check", "--plan", p(&planned), "--max-tokens", "2", "--runs", "1", "--vary", "threads"]);
    assert_eq!(code, 0, "{err}");
    let st = std::process::Command::new("sh").arg("-c").arg(format!("xargs -d '\\n' -n 1 -P 2 sh -c < {}", p(&planned.join("jobs.txt")))).status().expect("xargs");
    assert!(st.success());
    std::fs::remove_file(planned.join("threads-1-1.trace")).unwrap();
    let (code, text, err) = trace_s(&["check", "--collect", p(&planned)]);
    assert_eq!(code, 1, "{err}");
    assert!(text.contains("missing: threads-1-1.trace") && text.contains("some runs are missing") && !text.contains("differ from the baseline"), "{text}");
}

/// `--golden` with another model than the golden's: refused in one line naming both and the
/// file's sha256, before anything is recorded (it failed on the other model's missing chat
/// template, or recorded a whole run and then named a scratch path; found by a fresh-user
/// trial); a folder against a GGUF golden is said to be one.
#[test]
fn golden_with_another_model_is_refused_by_name() {
    let (s, gm) = (crate::util::smollm2_path(), crate::util::gemma3_path());
    let d = tmp();
    let g = d.path().join("golden.trace");
    let (code, _, err) = trace_s(&["check", "--write-golden", p(&g), "--model", p(&s), "--chat", "--max-tokens", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = trace_s(&["check", "--golden", p(&g), "--model", p(&gm), "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not the model --golden") && err.contains("SmolLM2-135M-Instruct.Q4_1.gguf") && err.contains("a5fd3b62230aa5ec") && err.lines().count() == 1, "{err}");
    let folder = d.path().join("folder");
    std::fs::create_dir(&folder).unwrap();
    let (code, _, err) = trace_s(&["check", "--golden", p(&g), "--model", p(&folder), "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("a folder, but --golden") && err.lines().count() == 1, "{err}");
}

/// Markdown as GitHub renders it: every table's rows have the header's cell count, code fences
/// and `<details>` are closed.
fn well_formed_markdown(md: &str) {
    let cells = |l: &str| l.replace("\\|", "").matches('|').count();
    let mut table: Option<usize> = None;
    for l in md.lines() {
        if l.starts_with('|') {
            match table {
                None => table = Some(cells(l)),
                Some(n) => assert_eq!(cells(l), n, "table row with another cell count: {l}\n{md}"),
            }
        } else {
            table = None;
        }
    }
    assert_eq!(md.lines().filter(|l| l.starts_with("```")).count() % 2, 0, "unclosed code fence:\n{md}");
    assert_eq!(md.matches("<details>").count(), md.matches("</details>").count(), "unclosed <details>:\n{md}");
}

#[test]
fn markdown_reports_are_well_formed() {
    let d = tmp();
    let out = d.path().join("check");
    let (_, md, err) = trace_s(&["check", "--out", p(&out), "--max-tokens", "8", "--runs", "1", "--vary", "prefill-chunk", "--format", "markdown"]);
    assert!(md.contains("| condition |"), "{md}{err}");
    // The model and environment travel with the table, and its columns are explained.
    assert!(md.contains("| baseline's model and environment |") && md.contains("| model | builtin |") && md.contains("| candle | 0.11.1 |"), "{md}");
    assert!(md.contains("*outputs*: distinct generated token sequences"), "{md}");
    well_formed_markdown(&md);
    let (code, md, _) = trace_s(&["bisect", p(&out.join("baseline.trace")), p(&out.join("prefill-chunk-1-1.trace")), "--format", "markdown"]);
    assert_eq!(code, 1);
    well_formed_markdown(&md);
    // Settings first; the commands that reproduce both runs; the rest folded.
    let settings = md.find("run.prefill_chunk").expect("settings table");
    let root = md.find("**Root cause:**").expect("root");
    assert!(settings < root, "{md}");
    assert!(md.contains("trace record --prompt 'Tell me about Richard Feynman.' --max-tokens 8") && md.contains("--prefill-chunk 1"), "{md}");
    assert!(md.contains("<details><summary>"), "{md}");
}

/// The headless Chromium binary; `None` (the caller skips, saying so) when there is none and
/// `CI` is not set.
pub(crate) fn chromium_bin() -> Option<&'static str> {
    let bin =
        ["chromium", "chromium-browser", "google-chrome"].into_iter().find(|b| std::process::Command::new("sh").arg("-c").arg(format!("command -v {b}")).output().is_ok_and(|o| o.status.success()));
    if bin.is_none() {
        assert!(std::env::var("CI").is_err(), "headless Chromium is missing (.ci/run installs Debian's chromium)");
        eprintln!("SKIPPED: no chromium on this machine; the HTML report was not opened in a browser");
    }
    bin
}

/// Chromium's headless `--dump-dom` on `file`: the DOM after load, and the console lines.
pub(crate) fn chromium(file: &Path) -> Option<(String, Vec<String>)> {
    let bin = chromium_bin()?;
    let o = std::process::Command::new(bin)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", "--window-size=1300,2000", "--dump-dom"])
        .arg(format!("file://{}", file.display()))
        .output()
        .expect("run chromium");
    assert!(o.status.success(), "chromium failed: {}", String::from_utf8_lossy(&o.stderr));
    let console = String::from_utf8_lossy(&o.stderr).lines().filter(|l| l.contains(":CONSOLE")).map(String::from).collect();
    Some((String::from_utf8_lossy(&o.stdout).into_owned(), console))
}

#[test]
fn html_report_opens_in_headless_chromium() {
    let d = tmp();
    // The console check catches a page error (a control, so the check below can fail).
    let bad = d.path().join("bad.html");
    std::fs::write(&bad, "<html><body><script>throw new Error('boom')</script></body></html>").unwrap();
    let Some((_, console)) = chromium(&bad) else { return };
    assert!(console.iter().any(|l| l.contains("boom")), "{console:?}");
    let out = d.path().join("check");
    let (code, _, err) = trace_s(&["check", "--out", p(&out), "--max-tokens", "8", "--runs", "1", "--vary", "prefill-chunk"]);
    assert_eq!(code, 1, "{err}");
    let (a, b) = (out.join("baseline.trace"), out.join("prefill-chunk-1-1.trace"));
    let html = d.path().join("report.html");
    let (code, msg, err) = trace_s(&["report", p(&a), p(&b), "-o", p(&html)]);
    assert_eq!(code, 1, "{err}");
    assert!(msg.contains("layers charted"), "{msg}");
    let page = std::fs::read_to_string(&html).unwrap();
    assert_eq!(page.matches("http://").count(), page.matches("xmlns=\"http://www.w3.org/2000/svg\"").count(), "nothing loaded from the network (only the SVG namespace)");
    assert!(!page.contains("<script") && !page.contains("https://"));
    // The commands to reproduce, one a line (a fresh-user trial found them joined by a literal
    // backslash-n, which a shell reads as one broken command).
    let pre = page.split("<h2>To reproduce</h2>\n<pre>").nth(1).and_then(|s| s.split("</pre>").next()).expect("the reproduce commands");
    let lines: Vec<&str> = pre.lines().collect();
    assert!(lines.len() == 2 && lines.iter().all(|l| l.starts_with("trace record ")) && !pre.contains("\\n"), "{pre:?}");
    let (dom, console) = chromium(&html).expect("chromium");
    assert!(console.is_empty(), "console messages: {console:?}");
    // One point per layer: embed_tokens, layers.0-3, norm, lm_head (input_ids holds token ids,
    // not activations: left out).
    let ta = candle_trace::format::read_trace(&a).unwrap();
    let tb = candle_trace::format::read_trace(&b).unwrap();
    let layers = candle_trace::bisect::layer_profile(&ta, &tb).unwrap();
    assert_eq!(layers.len(), 7);
    assert_eq!(dom.matches("<circle ").count(), layers.len() + 1, "one point per layer, and the root's layer ringed");
    assert_eq!(dom.matches("class=\"pt root\"").count(), 1);
    // The heatmap: a cell per (layer, position) compared, the root cause boxed, axis titles.
    assert!(dom.matches("class=\"cell\"").count() > 7, "heatmap cells");
    assert!(dom.contains("class=\"mark root\"") && dom.contains(">token position</text>") && dom.contains(">layer</text>"), "marks and axis titles");
    assert!(dom.contains("<h2>To reproduce</h2>") && dom.contains("--prefill-chunk 1"), "the reproduce commands");
    assert_fits(&page, d.path());
    for l in &layers {
        assert!(dom.contains(&format!("data-layer=\"{}\"", l.layer.html())), "{:?}", l.layer);
    }
    // The token strips and the root with its class.
    assert!(dom.contains("class=\"strip\"") && dom.contains("Root cause:") && dom.contains("operand shapes differ"), "{dom}");
}

/// Nothing of report page `page` runs past the page's width at 1300 px (the page itself has no
/// script: a copy in `dir` gets one that writes the widths into the title).
pub(crate) fn assert_fits(page: &str, dir: &Path) {
    let probe = dir.join("probe.html");
    std::fs::write(&probe, page.replace("</body>", "<script>document.title='W '+document.documentElement.scrollWidth+' '+window.innerWidth</script></body>")).unwrap();
    let (probed, _) = chromium(&probe).expect("chromium");
    let title = probed.split("<title>").nth(1).and_then(|t| t.split("</title>").next()).unwrap_or("");
    let w: Vec<u32> = title.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    assert!(w.len() == 2 && w[0] <= w[1], "horizontal overflow at 1300 px: {title}");
}

/// Cases a fresh reader found: a prompt holding a line break (and shell syntax) must neither
/// split a job line nor run anything; jobs run from any directory; markdown escapes HTML; a
/// command printed for pasting gives back exactly the same bytes in bash.
#[test]
fn hostile_prompts_stay_data() {
    let d = tmp();
    let planned = d.path().join("plan");
    let prompt = "hi\ntouch PWNED #'$(touch PWNED2)\t<details>";
    let (code, _, err) = trace_s(&["check", "--plan", p(&planned), "--runs", "1", "--vary", "padded-batch", "--max-tokens", "4", "--prompt", prompt]);
    assert_eq!(code, 0, "{err}");
    let jobs = std::fs::read_to_string(planned.join("jobs.txt")).unwrap();
    assert_eq!(jobs.lines().count(), 5, "baseline, repeat, three padded batches: one line each\n{jobs}");
    // The companion sets: 3, 2 and 5 requests, the prompt among them with its exact bytes.
    for (file, n) in [("prompts.txt", 3), ("prompts-2.txt", 2), ("prompts-3.txt", 5)] {
        let lines: Vec<String> = std::fs::read_to_string(planned.join(file)).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!((lines.len(), lines.iter().filter(|l| *l == prompt).count()), (n, 1), "{file}: {lines:?}");
        assert!(lines.iter().any(|l| l.len() > prompt.len()) && (n == 2 || lines.iter().any(|l| l.len() < prompt.len())), "{file}: longer and shorter requests");
    }
    assert!(!jobs.contains("PWNED"), "the prompt is not on the command lines: {jobs}");
    // Run the jobs from another directory.
    let elsewhere = d.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let st = std::process::Command::new("sh").arg("-c").arg(format!("xargs -d '\\n' -n 1 -P 2 sh -c < {}", p(&planned.join("jobs.txt")))).current_dir(&elsewhere).status().unwrap();
    assert!(st.success());
    assert!(!elsewhere.join("PWNED").exists() && !elsewhere.join("PWNED2").exists());
    let t = candle_trace::format::read_trace(&planned.join("baseline.trace")).unwrap();
    assert_eq!(t.header.run.prompt, prompt, "the prompt's exact bytes");
    let (code, md, _) = trace_s(&["check", "--collect", p(&planned), "--format", "markdown"]);
    assert!(code <= 1);
    assert!(!md.contains("<details>\\t") && md.contains("&lt;details&gt;"), "{md}");
    well_formed_markdown(&md);
    // A copied-in trace of another run is not counted as this job's.
    std::fs::copy(planned.join("baseline.trace"), planned.join("padded-batch-3_requests-1.trace")).unwrap();
    let (_, out, _) = trace_s(&["check", "--collect", p(&planned), "--format", "json"]);
    assert!(json(&out)["missing"].to_string().contains("holds another run"), "{out}");
    // The quoting of pasted commands round-trips through bash.
    let q = candle_trace::check::shell_quote(prompt);
    let o = std::process::Command::new("bash").arg("-c").arg(format!("printf %s {q}")).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), prompt);
}

/// `trace check` takes what `record` does: an encoder's sentence (`--text`, its batch knob
/// embedding N copies), a batch of requests as the baseline (`--prompts-file`), the sampler
/// and the device; every job's trace holds them. Knobs that cannot apply are refused.
#[test]
fn check_covers_what_record_takes() {
    let d = tmp();
    let header = |dir: &Path, name: &str| candle_trace::format::read_trace(&dir.join(name)).unwrap().header;
    // An encoder: N copies of the sentence in the batch-N runs.
    let m = crate::bert::minilm_path();
    let enc = d.path().join("enc");
    let (code, out, err) = trace_s(&["check", "--model", p(&m), "--text", "A man is eating food.", "--runs", "1", "--vary", "batch", "--out", p(&enc), "--format", "json", "--quiet"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(rows(&json(&out)).len(), 5, "repeat and batch 1, 2, 4, 8: {out}");
    let h = header(&enc, "batch-8-1.trace");
    assert_eq!((h.run.texts.len(), h.run.texts.iter().all(|t| t == "A man is eating food.")), (8, true));
    let (code, _, err) = trace_s(&["check", "--model", p(&m), "--text", "x", "--vary", "prefill-chunk", "--out", p(&d.path().join("no")), "--quiet"]);
    assert!(code == 2 && err.contains("no prefill chunks"), "{err}");
    // A batch of requests as the baseline; an empty line in the file is skipped, and `record`
    // says so.
    let reqs = d.path().join("requests.txt");
    std::fs::write(&reqs, "Hi\n\nTell me about Richard Feynman.\n").unwrap();
    let (_, _, err) = trace_s(&["record", "--prompts-file", p(&reqs), "--max-tokens", "1", "-o", p(&d.path().join("r.trace"))]);
    assert!(err.contains("1 empty line(s) skipped"), "{err}");
    let batch = d.path().join("batch");
    let (code, out, err) = trace_s(&["check", "--prompts-file", p(&reqs), "--runs", "1", "--max-tokens", "4", "--vary", "threads", "--out", p(&batch), "--format", "json", "--quiet"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(json(&out)["requests"].as_array().unwrap().len(), 2, "{out}");
    assert_eq!(header(&batch, "threads-1-1.trace").run.texts, ["Hi", "Tell me about Richard Feynman."]);
    // Every request's logits count in a row's max |a-b| (it read the first request's only).
    // These two (a fresh-user trial's) differ more in the second request at chunk 1 and 7.
    let pc = d.path().join("pc");
    let two = d.path().join("two.txt");
    std::fs::write(&two, "Hi!\nTell me a joke.\n").unwrap();
    let (code, out, err) = trace_s(&["check", "--prompts-file", p(&two), "--runs", "1", "--max-tokens", "4", "--vary", "prefill-chunk", "--out", p(&pc), "--format", "json", "--quiet"]);
    assert!(code <= 1, "{out}{err}");
    let mut differ = 0;
    for row in rows(&json(&out)).iter().filter(|r| r["trace"].is_string()) {
        let (_, b, _) = trace_s(&["bisect", p(&pc.join("baseline.trace")), p(&pc.join(row["trace"].as_str().unwrap())), "--format", "json"]);
        let per_request: Vec<f64> = json(&b)["rows"].as_array().unwrap().iter().map(|x| x["logits_max_abs_diff"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).fold(0.0, f64::max)).collect();
        let all = per_request.iter().copied().fold(0.0, f64::max);
        assert_eq!(row["logits_max_abs_diff"].as_f64(), Some(all), "{row} vs {per_request:?}");
        differ += usize::from(per_request.len() == 2 && per_request[1] > per_request[0]);
    }
    assert!(differ > 0, "a row where the second request's logits differ more than the first's: {out}");
    let (code, _, err) = trace_s(&["check", "--prompts-file", p(&reqs), "--vary", "batch", "--out", p(&d.path().join("no2")), "--quiet"]);
    assert!(code == 2 && err.contains("already a batch"), "{err}");
    // What every job would refuse is refused before anything is written.
    let refused = d.path().join("refused");
    for (args, want) in [
        (vec!["--top-k", "20"], "apply only when sampling"),
        (vec!["--device", "gpu"], "expected cpu"),
        (vec!["--text", "x"], "encoder"),
        (vec!["--max-tokens", "0"], "at least 1"),
        (vec!["--text", "x", "--max-tokens", "4"], "--max-tokens with --text: "),
    ] {
        let (code, _, err) = trace_s(&[&["check", "--runs", "1", "--out", p(&refused), "--quiet"][..], &args[..]].concat());
        assert!(code == 2 && err.contains(want), "{args:?}: {err}");
        assert!(!refused.join("manifest.json").exists(), "{args:?} left a plan behind");
    }
    // A knob named twice is planned once.
    let (code, _, err) = trace_s(&["check", "--vary", "threads,threads", "--runs", "1", "--plan", p(&d.path().join("twice"))]);
    assert_eq!(code, 0, "{err}");
    let jobs = std::fs::read_to_string(d.path().join("twice/jobs.txt")).unwrap();
    let mut threads = vec![1, 2, std::thread::available_parallelism().map_or(1, |n| n.get())];
    threads.sort_unstable();
    threads.dedup();
    assert_eq!(jobs.lines().count(), 2 + threads.len(), "baseline, repeat, one run per thread count: {jobs}");
    // The sampler and the device reach every run.
    let sampled = d.path().join("sampled");
    let (code, out, err) = trace_s(&[
        "check",
        "--temperature",
        "0.8",
        "--top-k",
        "5",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--device",
        "cpu",
        "--runs",
        "1",
        "--max-tokens",
        "4",
        "--vary",
        "threads",
        "--out",
        p(&sampled),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let h = header(&sampled, "threads-2-1.trace");
    assert_eq!((h.run.temperature, h.run.top_k, h.run.top_p, h.run.seed, h.env.device.as_str()), (Some(0.8), Some(5), Some(0.9), 7, "cpu"));
}

/// `trace record` fixes candle's thread count once at candle's own default (candle otherwise
/// reads /proc/cpuinfo at every matmul): the same threads, so the same ops as `--threads N`.
/// The header keeps the count in effect (`env.threads`), never `RAYON_NUM_THREADS`: a user's
/// `RAYON_NUM_THREADS=1` under `--threads 2` was stored as if it applied, and a run on one
/// thread by the variable differed from one by `--threads 1` (a fresh-user trial).
#[test]
fn the_pinned_thread_count_is_candles_own_and_not_reported_as_set() {
    let d = tmp();
    let run = |out: &Path, extra: &[&str], var: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_trace"));
        c.args([&["record", "--max-tokens", "6", "--quiet", "-o", p(out)][..], extra].concat()).env_remove("RAYON_NUM_THREADS").env_remove("CANDLE_NUM_THREADS");
        if let Some(v) = var {
            c.env("RAYON_NUM_THREADS", v);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        candle_trace::format::TraceReader::open(out).unwrap().header().clone()
    };
    let pinned = d.path().join("pinned.trace");
    let h = run(&pinned, &[], None);
    if std::env::var_os("RAYON_NUM_THREADS").is_none() && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        assert_eq!(h.env.threads as usize, candle_core::utils::get_num_threads(), "candle's own default");
    }
    let n = h.env.threads.to_string();
    let explicit = d.path().join("explicit.trace");
    let e = run(&explicit, &["--threads", &n], None);
    assert_eq!(e.env.threads, h.env.threads);
    let (code, out, err) = trace_s(&["bisect", p(&pinned), p(&explicit)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("verdict: identical"), "{out}");
    // The variable under --threads: the flag's count, and the variable not kept.
    let over = run(&d.path().join("over.trace"), &["--threads", "2"], Some("1"));
    assert!(over.env.threads == 2 && over.env.env_vars.iter().all(|(k, _)| k != "RAYON_NUM_THREADS"), "{:?}", over.env);
    // One thread by the variable and by the flag: the same run.
    let (by_var, by_flag) = (d.path().join("var1.trace"), d.path().join("flag1.trace"));
    assert_eq!(run(&by_var, &[], Some("1")).env.threads, 1);
    run(&by_flag, &["--threads", "1"], None);
    let (code, out, err) = trace_s(&["bisect", p(&by_var), p(&by_flag)]);
    assert!(code == 0 && !out.contains("env_vars") && !out.contains("RAYON"), "{out}{err}");
    // A child of `trace check` runs on the same count.
    let golden = d.path().join("golden.trace");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_trace")).args(["check", "--write-golden", p(&golden), "--max-tokens", "4"]).env_remove("RAYON_NUM_THREADS").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let g = candle_trace::format::TraceReader::open(&golden).unwrap().header().clone();
    assert_eq!(g.env.threads, h.env.threads);
}
