//! The README's pasted outputs are the current binary's: each block after a
//! `<!-- readme-output: NAME -->` marker is regenerated here by running the commands the README
//! shows, and compared. `tools/update-readme.sh` rewrites the blocks (`UPDATE_README=1`).

use crate::bert::minilm_path as minilm_dir;
use crate::util::smollm2_path;
use std::path::Path;
use std::process::Command;

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");

/// Runs `trace` in `dir` and returns its stdout.
fn run(dir: &Path, args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_trace")).args(args).current_dir(dir).output().expect("run trace");
    assert!(o.status.code().is_some_and(|c| c <= 1), "trace {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).expect("utf-8 output")
}

/// The output block `name` as the README's commands produce it now.
fn generate(name: &str) -> String {
    let d = tempfile::tempdir().expect("temp dir");
    let dir = d.path();
    match name {
        "builtin-bisect" => {
            run(dir, &["record", "-o", "a.trace"]);
            run(dir, &["record", "--prefill-chunk", "1", "-o", "b.trace"]);
            run(dir, &["bisect", "a.trace", "b.trace"])
        }
        "smollm2-bisect" => {
            let m = smollm2_path();
            let m = m.to_str().expect("utf-8 path");
            let base = ["record", "--model", m, "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "48"];
            run(dir, &[&base[..], &["-o", "whole.trace"]].concat());
            run(dir, &[&base[..], &["--prefill-chunk", "1", "-o", "chunk1.trace"]].concat());
            run(dir, &["bisect", "whole.trace", "chunk1.trace"])
        }
        "smollm2-causal" => {
            let _one_at_a_time = crate::util::heavy();
            let m = smollm2_path();
            let m = m.to_str().expect("utf-8 path");
            let base = ["record", "--model", m, "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "48"];
            run(dir, &[&base[..], &["-o", "whole.trace"]].concat());
            run(dir, &[&base[..], &["--prefill-chunk", "1", "-o", "chunk1.trace"]].concat());
            run(dir, &["bisect", "whole.trace", "chunk1.trace", "--causal", "--model", m, "--causal-out", "patched.trace"])
        }
        "smollm2-check" => {
            let _one_at_a_time = crate::util::heavy();
            let m = smollm2_path();
            let m = m.to_str().expect("utf-8 path");
            run(
                dir,
                &["check", "--model", m, "--chat", "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "32", "--runs", "3", "--vary", "threads,prefill-chunk,batch", "--out", "check"],
            )
        }
        "minilm-show" => {
            let m = minilm_dir();
            let m = m.to_str().expect("utf-8 path");
            run(dir, &["record", "--model", m, "--text", "A man is eating food.", "--text", "A man is eating a piece of bread.", "-o", "embed.trace"]);
            let show = run(dir, &["show", "embed.trace"]);
            // The excerpt: from the non-finite line to the end of the cosine table.
            let start = show.find("first non-finite value").expect("non-finite line");
            let end = show[start..].find("\n\nper layer").map_or(show.len(), |e| start + e + 1);
            show[start..end].to_string()
        }
        "minilm-padded-bisect" => {
            let m = minilm_dir();
            let m = m.to_str().expect("utf-8 path");
            run(dir, &["record", "--model", m, "--text", "A man is eating food.", "-o", "alone.trace"]);
            run(
                dir,
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
            );
            let out = run(dir, &["bisect", "alone.trace", "batched.trace"]);
            // The excerpt: from the top through the root cause's lines.
            let end = out.find("\nhow the difference grew").map_or(out.len(), |e| e + 1);
            out[..end].to_string()
        }
        other => panic!("README names an unknown output block {other:?}"),
    }
}

/// `text` with every duration (a number followed by " s", as `--causal` prints its re-runs'
/// wall times) replaced by `#`: the machine's speed is not part of what the README promises.
fn without_times(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut num = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() || (c == '.' && !num.is_empty()) {
            num.push(c);
            continue;
        }
        let is_time = c == ' ' && chars.peek() == Some(&'s') && !num.is_empty() && {
            let mut ahead = chars.clone();
            ahead.next();
            ahead.peek().is_none_or(|n| !n.is_alphanumeric())
        };
        if is_time {
            // Column padding changes with the number's width: drop it with the number.
            while out.ends_with(' ') {
                out.pop();
            }
            out.push_str(" #");
        } else {
            out.push_str(&num);
        }
        num.clear();
        out.push(c);
    }
    out.push_str(&num);
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
    let readme = std::fs::read_to_string(README).expect("README");
    let found = blocks(&readme);
    assert!(found.len() >= 3, "README markers missing");
    let update = std::env::var("UPDATE_README").as_deref() == Ok("1");
    let mut new = readme.clone();
    let mut stale = Vec::new();
    // Back to front, so earlier ranges stay valid while rewriting.
    for (name, start, end) in found.into_iter().rev() {
        let want = generate(&name);
        let (was, now) = (without_times(&readme[start..end]), without_times(&want));
        if was != now {
            if let Some((x, y)) = was.lines().zip(now.lines()).find(|(x, y)| x != y) {
                eprintln!("{name}: README has\n  {x}\nnow\n  {y}");
            }
            stale.push(name);
            new.replace_range(start..end, &want);
        }
    }
    if update {
        std::fs::write(README, new).expect("write README");
    } else {
        assert!(stale.is_empty(), "README outputs are stale: {stale:?}; run tools/update-readme.sh");
    }
}
