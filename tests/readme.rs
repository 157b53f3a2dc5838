//! The README's pasted outputs are the current binary's: each block after a
//! `<!-- readme-output: NAME -->` marker is regenerated here by running the commands the README
//! shows (through the shared fixture cache, so a run another test also needs is recorded once),
//! and compared. `tools/update-readme.sh` rewrites the blocks (`UPDATE_README=1`) and the
//! `<!-- readme-machine: ... -->` marker naming the machine they came from.
//!
//! The blocks hold bit-exact figures that depend on the CPU's kernel paths (which SIMD
//! extensions candle's matmuls dispatch to) and a `threads N (all)` row built from the core
//! count. On a machine whose fingerprint ([`machine`]) is the README's, the blocks are compared
//! exactly (durations masked); elsewhere by structure ([`skeleton`]): verdicts, token indices,
//! root ops, cause classes and the check table's conditions, with floating-point figures masked.

use crate::bert::minilm_path as minilm_dir;
use crate::util::{fixture, smollm2_walkthrough, Fixture};

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
/// Every page with pasted outputs: the README and the doc pages whose commands it runs.
const PAGES: [&str; 2] = [README, concat!(env!("CARGO_MANIFEST_DIR"), "/docs/batch-invariance.md")];

/// The stdout of command `i` of a fixture, which must have exited 0 or 1.
fn out(f: &Fixture, i: usize) -> String {
    let (code, stdout, stderr) = f.run(i);
    assert!(code == 0 || code == 1, "command {i} in {}: exit {code}: {stderr}", f.dir.display());
    stdout.to_string()
}

/// The output block `name` as the README's commands produce it now.
fn generate(name: &str) -> String {
    match name {
        "builtin-bisect" => {
            let f = fixture(&[&["record", "-o", "a.trace"], &["record", "--prefill-chunk", "1", "-o", "b.trace"], &["bisect", "a.trace", "b.trace"]]);
            out(&f, 2)
        }
        "builtin-invariant-bisect" => {
            let f =
                fixture(&[&["record", "--numerics", "invariant", "-o", "a.trace"], &["record", "--numerics", "invariant", "--prefill-chunk", "1", "-o", "b.trace"], &["bisect", "a.trace", "b.trace"]]);
            assert_eq!(f.run(2).0, 0, "identical: {}", f.run(2).1);
            out(&f, 2)
        }
        "smollm2-bisect" => out(&smollm2_walkthrough(), 2),
        "smollm2-causal" => out(&smollm2_walkthrough(), 3),
        "smollm2-check" => out(&crate::util::smollm2_check(), 0),
        "minilm-show" => {
            let m = minilm_dir();
            let m = m.to_str().expect("utf-8 path");
            let f = fixture(&[&["record", "--model", m, "--text", "A man is eating food.", "--text", "A man is eating a piece of bread.", "-o", "embed.trace"], &["show", "embed.trace"]]);
            let show = out(&f, 1);
            // The excerpt: from the non-finite line to the end of the cosine table.
            let start = show.find("first non-finite value").expect("non-finite line");
            let end = show[start..].find("\n\nper layer").map_or(show.len(), |e| start + e + 1);
            show[start..end].to_string()
        }
        "minilm-padded-bisect" => {
            let m = minilm_dir();
            let m = m.to_str().expect("utf-8 path");
            let f = fixture(&[
                &["record", "--model", m, "--text", "A man is eating food.", "-o", "alone.trace"],
                &[
                    "record",
                    "--model",
                    m,
                    "--text",
                    "A man is eating a piece of bread while sitting at the kitchen table.",
                    "--text",
                    "The quick brown fox jumps over the lazy dog near the river bank.",
                    "--text",
                    "A man is eating food.",
                    "-o",
                    "batched.trace",
                ],
                &["bisect", "alone.trace", "batched.trace"],
            ]);
            let out = out(&f, 2);
            // The excerpt: from the top through the root cause's lines.
            let end = out.find("\nhow the difference grew").map_or(out.len(), |e| e + 1);
            out[..end].to_string()
        }
        "golden-invariant" => {
            let f = fixture(&[&["check", "--numerics", "invariant", "--write-golden", "golden.trace"], &["check", "--golden", "golden.trace", "--batch", "4", "--prefill-chunk", "7"]]);
            assert_eq!(f.run(1).0, 0, "identical: {}", f.run(1).1);
            out(&f, 1)
        }
        "golden-default" => {
            let f = fixture(&[&["check", "--write-golden", "golden.trace"], &["check", "--golden", "golden.trace", "--batch", "4", "--prefill-chunk", "7"]]);
            assert_eq!(f.run(1).0, 1, "diverged: {}", f.run(1).1);
            let out = out(&f, 1);
            // The excerpt: from the top through the root cause's class.
            let end = out.find("\n  a ran it in step").map_or(out.len(), |e| e + 1);
            out[..end].to_string()
        }
        other => panic!("a page names an unknown output block {other:?}"),
    }
}

/// The machine's fingerprint for the README's figures: the architecture, the SIMD extensions
/// candle's CPU kernels dispatch on, the data caches the gemm crate sizes its matmul blocks by
/// (their sizes and ways, from Linux's `/sys/devices/system/cpu/cpu0/cache`, as gemm-common
/// reads them: two machines with the same extensions but other caches sum a matmul in another
/// order, and a padded batch's figures differ in the last bits), and the core count where it
/// shows in `trace check`'s table (a `threads N (all)` row appears only above 2 cores).
fn machine() -> String {
    let mut f: Vec<&str> = vec![std::env::consts::ARCH];
    #[cfg(target_arch = "x86_64")]
    {
        for (name, on) in [
            ("avx", std::is_x86_feature_detected!("avx")),
            ("avx2", std::is_x86_feature_detected!("avx2")),
            ("f16c", std::is_x86_feature_detected!("f16c")),
            ("fma", std::is_x86_feature_detected!("fma")),
            ("avx512f", std::is_x86_feature_detected!("avx512f")),
        ] {
            if on {
                f.push(name);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        for (name, on) in [
            ("neon", std::arch::is_aarch64_feature_detected!("neon")),
            ("fp16", std::arch::is_aarch64_feature_detected!("fp16")),
            ("dotprod", std::arch::is_aarch64_feature_detected!("dotprod")),
            ("i8mm", std::arch::is_aarch64_feature_detected!("i8mm")),
        ] {
            if on {
                f.push(name);
            }
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = if cores <= 2 { "cores<=2".to_string() } else { format!("cores={cores}") };
    format!("{}{} {cores}", f.join(" "), caches())
}

/// ` L1=32K/8 L2=1024K/8 L3=32768K/16`: each data or unified cache level of CPU 0, its size and
/// ways; empty where Linux's sysfs does not say.
fn caches() -> String {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache") else { return String::new() };
    let read = |p: &std::path::Path, name: &str| std::fs::read_to_string(p.join(name)).map(|s| s.trim().to_string()).unwrap_or_default();
    let mut levels: Vec<String> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("index")))
        .filter(|p| matches!(read(p, "type").as_str(), "Data" | "Unified"))
        .map(|p| format!(" L{}={}/{}", read(&p, "level"), read(&p, "size"), read(&p, "ways_of_associativity")))
        .collect();
    levels.sort();
    levels.concat()
}

/// The numbers in `text` as (byte range, has a decimal point or an exponent): digits, then
/// optionally `.digits` and `e[+-]digits`. Digits glued to a word or a dotted path before them
/// (`x2`, `layers.17`) are part of a name, not a number.
fn numbers(text: &str) -> Vec<(std::ops::Range<usize>, bool)> {
    let b = text.as_bytes();
    let digits = |mut j: usize| {
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        j
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let glued = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b'.');
        if !b[i].is_ascii_digit() || glued {
            i += 1;
            continue;
        }
        let mut j = digits(i);
        let mut float = false;
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            (float, j) = (true, digits(j + 1));
        }
        let sign = usize::from(j + 1 < b.len() && (b[j + 1] == b'-' || b[j + 1] == b'+'));
        if j + 1 + sign < b.len() && b[j] == b'e' && b[j + 1 + sign].is_ascii_digit() {
            (float, j) = (true, digits(j + 1 + sign));
        }
        out.push((i..j, float));
        i = j;
    }
    out
}

/// `text` with every floating-point figure replaced by `#`; integers (token indices,
/// positions, counts of rows) are kept.
fn mask_floats(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (r, float) in numbers(text) {
        if float {
            out.push_str(&text[at..r.start]);
            out.push('#');
            at = r.end;
        }
    }
    out.push_str(&text[at..]);
    out
}

/// What of an output block holds on any machine: the verdict, which generated token flipped,
/// the per-request lines, the root op and its cause class, which token `--causal` explains, the
/// non-finite line, and `trace check`'s table as (condition, vs baseline, class) without its
/// thread rows (their count follows the core count). Floating-point figures are masked.
fn skeleton(text: &str) -> Vec<String> {
    const KEPT: [&str; 9] = [
        "verdict:",
        "generated tokens:",
        "first generated token that differs:",
        "the numbers first parted here:",
        "the first difference that reached its layer's output:",
        "cause:",
        "which difference changed token",
        "first non-finite value:",
        "a row ",
    ];
    let mut out = Vec::new();
    let mut in_table = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("condition ") {
            in_table = true;
            continue;
        }
        if in_table {
            if t.is_empty() {
                in_table = false;
                continue;
            }
            let cells: Vec<&str> = t.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
            if !cells[0].starts_with("threads ") {
                let cell = |i: usize| cells.get(i).copied().unwrap_or("");
                out.push(format!("row {} | {} | {}", cell(0), cell(3), cell(5)));
            }
            continue;
        }
        if KEPT.iter().any(|k| t.starts_with(k)) {
            // A per-request line keeps what it says of the request, not the figures after it.
            let t = if t.starts_with("a row ") { t.split(": ").take(2).collect::<Vec<_>>().join(": ") } else { t.to_string() };
            out.push(mask_floats(&t));
        }
    }
    out
}

#[test]
fn skeleton_keeps_structure_and_masks_figures() {
    assert_eq!(mask_floats("max |a-b| >= 3.81e-6 (relative 6.92e-8) token 11, layers.17 x2 1.5"), "max |a-b| >= # (relative #) token 11, layers.17 x2 #");
    let check = "condition   runs  outputs  vs baseline   first root   class   logits max |Δ|\nrepeat   2   1   identical   -   -   0\nthreads 4 (all)   2   1   identical   -   -   0\nprefill-chunk 18   2   1   token 11 flips   layers.17.self_attn.softmax @ 15   shapes_differ   ≥ 0.4817\n\nsome runs differ";
    assert_eq!(skeleton(check), vec!["row repeat | identical | -", "row prefill-chunk 18 | token 11 flips | shapes_differ"]);
    let bisect = "verdict: diverged\na: x (10 op records)\nfirst generated token that differs: token 11 (position 49, row 0)\n  a: 4161 \" lived\"  margin 0.0473\nthe numbers first parted here: layers.17.self_attn.softmax (softmax)\n  cause: operand shapes differ";
    assert_eq!(
        skeleton(bisect),
        vec![
            "verdict: diverged",
            "first generated token that differs: token 11 (position 49, row 0)",
            "the numbers first parted here: layers.17.self_attn.softmax (softmax)",
            "cause: operand shapes differ"
        ]
    );
}

/// The `<!-- readme-machine: ... -->` marker's fingerprint, if the README has one.
fn readme_machine(readme: &str) -> Option<&str> {
    let m = readme.find("<!-- readme-machine: ")? + "<!-- readme-machine: ".len();
    let end = readme[m..].find(" -->")? + m;
    Some(&readme[m..end])
}

/// `text` with every duration (a number followed by " s", as `--causal` prints its re-runs'
/// wall times) replaced by `#`: the machine's speed is not part of what the README promises.
fn without_times(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (r, _) in numbers(text) {
        let after = &text[r.end..];
        let is_time = after.starts_with(" s") && after[2..].chars().next().is_none_or(|n| !n.is_alphanumeric());
        if is_time {
            out.push_str(&text[at..r.start]);
            // Column padding changes with the number's width: drop it with the number.
            while out.ends_with(' ') {
                out.pop();
            }
            out.push_str(" #");
            at = r.end;
        }
    }
    out.push_str(&text[at..]);
    out
}

#[test]
fn durations_are_masked_and_nothing_else() {
    assert_eq!(without_times("re-runs: 23 in 52.8 s\n  1 patch  2.3 s  token 45"), "re-runs: 23 in # s\n  1 patch # s  token 45");
    assert_eq!(without_times("patch   2.3 s"), without_times("patch  12.3 s"));
    assert_eq!(without_times("M=38 rows, 3 seconds, 0.0033"), "M=38 rows, 3 seconds, 0.0033");
}

/// (name, start, end) of every marked block: the byte range of its contents between the fences.
fn blocks(readme: &str) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = readme[at..].find("<!-- readme-output: ") {
        let m = at + i;
        let name_end = readme[m..].find(" -->").expect("marker end") + m;
        let name = readme[m + "<!-- readme-output: ".len()..name_end].to_string();
        let fence = readme[name_end..].find("```text\n").expect("text block after marker") + name_end + "```text\n".len();
        let close = readme[fence..].find("```").expect("closing fence") + fence;
        out.push((name, fence, close));
        at = close;
    }
    out
}

#[test]
fn pasted_outputs_are_current() {
    let update = std::env::var("UPDATE_README").as_deref() == Ok("1");
    let stale: Vec<String> = PAGES.iter().flat_map(|page| page_outputs(page, update)).collect();
    assert!(stale.is_empty(), "pasted outputs are stale: {stale:?}; run tools/update-readme.sh");
}

/// The stale blocks of `page` (`path: name`), each regenerated and compared; with `update` the
/// page is rewritten instead, with this machine's marker.
fn page_outputs(page: &str, update: bool) -> Vec<String> {
    let text = std::fs::read_to_string(page).unwrap_or_else(|e| panic!("{page}: {e}"));
    let found = blocks(&text);
    assert!(!found.is_empty(), "{page}: output markers missing");
    let here = machine();
    let exact = update || readme_machine(&text) == Some(here.as_str());
    if !exact {
        eprintln!("{page}: outputs came from {:?}, this is {here:?}: compared by structure", readme_machine(&text));
    }
    let mut new = text.clone();
    let mut stale = Vec::new();
    // Back to front, so earlier ranges stay valid while rewriting.
    for (name, start, end) in found.into_iter().rev() {
        let want = generate(&name);
        let (was, now) = if exact { (without_times(&text[start..end]), without_times(&want)) } else { (skeleton(&text[start..end]).join("\n"), skeleton(&want).join("\n")) };
        assert!(!now.is_empty(), "{name}: nothing to compare");
        if was != now {
            if let Some((x, y)) = was.lines().zip(now.lines()).find(|(x, y)| x != y) {
                eprintln!("{name}: {page} has\n  {x}\nnow\n  {y}");
            }
            stale.push(format!("{page}: {name}"));
            new.replace_range(start..end, &want);
        }
    }
    if !update {
        return stale;
    }
    let marker = format!("<!-- readme-machine: {here} -->");
    match readme_machine(&new).map(str::to_string) {
        Some(old) => new = new.replacen(&format!("<!-- readme-machine: {old} -->"), &marker, 1),
        None => panic!("{page} has no <!-- readme-machine: ... --> marker"),
    }
    std::fs::write(page, new).expect("write page");
    Vec::new()
}

/// On another machine every block is still compared by something: its skeleton holds a verdict,
/// a flipped token, a root or a table row.
#[test]
fn every_block_has_a_skeleton() {
    for page in PAGES {
        let readme = std::fs::read_to_string(page).expect("page");
        for (name, start, end) in blocks(&readme) {
            let sk = skeleton(&readme[start..end]);
            assert!(!sk.is_empty(), "{page}: {name}: nothing would be compared on another machine");
        }
        assert!(readme_machine(&readme).is_some(), "{page} has no readme-machine marker");
    }
}
