//! The trace file: round trip, recovery of every complete frame from a file cut at any byte,
//! refusals, and the example trace in traces/ (written by an earlier build) still reads.

use crate::util::{record_builtin, tmp};
use candle_trace::format::{decode_trace, read_trace, PREAMBLE_LEN};
use candle_trace::generate::GenConfig;
use candle_trace::record::Item;
use std::path::Path;

#[test]
fn every_cut_recovers_complete_frames_or_refuses_cleanly() {
    let d = tmp();
    let path = d.path().join("a.trace");
    let full = record_builtin(&path, "hi", GenConfig { max_tokens: 3, ..GenConfig::default() }, None, None);
    assert!(!full.truncated && full.footer.is_some());
    let bytes = std::fs::read(&path).unwrap();
    let mut last_items = 0;
    let mut truncated_reads = 0;
    for cut in 0..bytes.len() {
        match decode_trace(&bytes[..cut], Path::new("cut.trace")) {
            Ok(t) => {
                assert!(t.truncated, "cut at {cut} not reported as truncated");
                assert!(t.items.len() >= last_items, "cut at {cut} lost items");
                assert_eq!(t.items[..], full.items[..t.items.len()]);
                last_items = t.items.len();
                truncated_reads += 1;
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(cut < PREAMBLE_LEN + 200 || msg.contains("truncated"), "cut at {cut}: {msg}");
                assert!(msg.starts_with("cut.trace: "), "{msg}");
            }
        }
    }
    assert!(truncated_reads > 0);
    assert_eq!(last_items, full.items.len());
    // Every forward pass is its own frame: the prefix after the header holds whole passes.
    let forwards = full.items.iter().filter(|i| matches!(i, Item::Forward(_))).count();
    assert_eq!(forwards, 3);
}

#[test]
fn bytes_after_footer_are_refused() {
    let d = tmp();
    let path = d.path().join("a.trace");
    record_builtin(&path, "hi", GenConfig { max_tokens: 1, ..GenConfig::default() }, None, None);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(b"xyz");
    let e = decode_trace(&bytes, Path::new("t.trace")).unwrap_err().to_string();
    assert_eq!(e, "t.trace: 3 bytes after the footer frame at byte 14045".replace("14045", &(bytes.len() - 3).to_string()));
}

/// `traces/builtin-chunk1.trace` and `traces/builtin-whole.trace` were written by
/// `trace record --prompt "Hello, candle!" --max-tokens 4 [--prefill-chunk 1]` on the builtin model; they must keep reading,
/// and bisect must keep naming the same root cause in them.
#[test]
fn example_traces_still_read_and_bisect() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let a = read_trace(&dir.join("builtin-whole.trace")).unwrap();
    let b = read_trace(&dir.join("builtin-chunk1.trace")).unwrap();
    assert_eq!(a.header.run.prompt, "Hello, candle!");
    assert_eq!(b.header.run.prefill_chunk, 1);
    assert!(!a.truncated && !b.truncated);
    let r = candle_trace::bisect::bisect(&a, &b).unwrap();
    assert_eq!(r.verdict, "diverged");
    let expected = std::fs::read_to_string(dir.join("builtin-bisect.expected")).unwrap();
    let d = r.first_divergence.unwrap();
    assert_eq!(format!("{} @ {}", d.path.as_str(), d.position), expected.trim());
}

/// Format 1.2's build fingerprint: written after the header, shown by `show`, kept by `redact`.
#[test]
fn build_fingerprint_is_written_shown_and_kept() {
    let d = crate::util::tmp();
    let t = d.path().join("t.trace");
    let (code, _, err) = crate::util::trace_s(&["record", "--max-tokens", "2", "-o", crate::util::p(&t)]);
    assert_eq!(code, 0, "{err}");
    let tr = candle_trace::format::read_trace(&t).unwrap();
    let b = tr.build.clone().expect("a build frame");
    assert!(b.crates.iter().any(|(k, v)| k == "candle-core" && v == "0.11.1"), "{b:?}");
    assert!(!b.target_features.is_empty());
    let (_, show, _) = crate::util::trace_s(&["show", crate::util::p(&t)]);
    assert!(show.contains("  build        target features [") && show.contains("candle-core 0.11.1"), "{show}");
    let r = d.path().join("r.trace");
    assert_eq!(crate::util::trace_s(&["redact", crate::util::p(&t), "-o", crate::util::p(&r)]).0, 0);
    assert_eq!(candle_trace::format::read_trace(&r).unwrap().build, Some(b));
}

/// A second pass over a file (bisect's) reads only the items frames it wants, the others
/// neither decompressed nor decoded, and refuses a file whose frames changed since the first.
#[test]
fn a_later_pass_reads_only_wanted_frames_and_refuses_a_changed_file() {
    use candle_trace::format::{Skip, TraceReader};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/builtin-chunk1.trace");
    let (frames, mut skip) = first_pass(&path);
    assert!(frames.len() > 3, "{} frames", frames.len());
    // Only the third frame: its items, checked from the record ids and sites before it.
    skip.want = (0..frames.len()).map(|i| i == 2).collect();
    let mut again = TraceReader::open(&path).unwrap().skipping(Skip { want: skip.want.clone(), sums: skip.sums.clone(), before: skip.before.clone(), ..Skip::default() });
    assert_eq!(again.next_items().unwrap().as_ref(), Some(&frames[2]));
    assert_eq!(again.next_items().unwrap(), None);
    // A checksum other than the first pass saw: the file changed in between.
    skip.sums[1] ^= 1;
    let mut changed = TraceReader::open(&path).unwrap().skipping(skip);
    let e = changed.next_items().unwrap_err().to_string();
    assert!(e.contains("builtin-chunk1.trace") && e.contains("changed between two reads"), "{e}");
}

/// A file cut shorter between the two passes is refused, not read as if it ended there.
#[test]
fn a_later_pass_refuses_a_file_cut_in_between() {
    use candle_trace::format::TraceReader;
    let d = crate::util::tmp();
    let (path, bytes) = example_copy(d.path(), "cut.trace");
    let (frames, mut skip) = first_pass(&path);
    skip.want = vec![false; frames.len()];
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let mut again = TraceReader::open(&path).unwrap().skipping(skip);
    let e = loop {
        match again.next_items() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("a file cut in half read to its end"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(e.contains("changed between two reads"), "{e}");
}

/// With `Skip::index`, a later pass goes straight to the frames it wants: the header of a
/// frame it does not want is never read (garbled, the pass reads the same items; without the
/// index, that header is refused), it stops after the last wanted frame, and a wanted frame
/// whose checksum is not the one noted is still refused.
#[test]
fn an_indexed_pass_reads_no_header_between_the_frames_it_wants() {
    use candle_trace::format::{Skip, TraceReader};
    use std::sync::Arc;
    let d = crate::util::tmp();
    let (path, bytes) = example_copy(d.path(), "t.trace");
    let (frames, noted) = first_pass(&path);
    let index: Arc<[u64]> = candle_trace::format::frames_compared(&path, &path).1[0].clone().into();
    assert!(frames.len() > 4 && index.len() == frames.len(), "{} frames, {} indexed", frames.len(), index.len());
    let pass = |want: &[usize], sums: &[u64], index: Option<Arc<[u64]>>| -> candle_trace::error::Result<Vec<Vec<Item>>> {
        let want = (0..sums.len()).map(|k| want.contains(&k)).collect();
        let skip = Skip { want, sums: sums.to_vec(), before: noted.before.clone(), index, ..Skip::default() };
        let mut r = TraceReader::open(&path)?.skipping(skip);
        std::iter::from_fn(|| r.next_items().transpose()).collect()
    };
    let want = vec![frames[1].clone(), frames[3].clone()];
    assert_eq!(pass(&[1, 3], &noted.sums, Some(index.clone())).unwrap(), want);
    // Frame 2's header garbled (kind 0, refused by any reader that reads it).
    let mut garbled = bytes.clone();
    garbled[index[2] as usize] = 0;
    std::fs::write(&path, &garbled).unwrap();
    assert_eq!(pass(&[1, 3], &noted.sums, Some(index.clone())).unwrap(), want);
    let e = pass(&[1, 3], &noted.sums, None).unwrap_err().to_string();
    assert!(e.contains("t.trace") && e.contains("frame kind"), "{e}");
    // So is everything after the last frame wanted: not read.
    garbled[index[4] as usize..].iter_mut().for_each(|b| *b = 0xff);
    std::fs::write(&path, &garbled).unwrap();
    assert_eq!(pass(&[1, 3], &noted.sums, Some(index.clone())).unwrap(), want);
    // A wanted frame is still checked against the first pass's checksum.
    let mut sums = noted.sums.clone();
    sums[3] ^= 1;
    let e = pass(&[1, 3], &sums, Some(index.clone())).unwrap_err().to_string();
    assert!(e.contains("changed between two reads"), "{e}");
    // An index of another length (not this file's) is not gone by.
    let e = pass(&[1, 3], &noted.sums, Some(index[..3].into())).unwrap_err().to_string();
    assert!(e.contains("frame kind"), "{e}");
}

/// traces/builtin-chunk1.trace copied to `name` in `dir`: the copy's path and the bytes.
fn example_copy(dir: &Path, name: &str) -> (std::path::PathBuf, Vec<u8>) {
    let path = dir.join(name);
    let bytes = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/builtin-chunk1.trace")).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    (path, bytes)
}

/// A first pass over `path` as bisect's notes it: each items frame's items, and a `Skip` with
/// the (op records, sites) before each frame and its checksum (no frame wanted yet).
fn first_pass(path: &Path) -> (Vec<Vec<Item>>, candle_trace::format::Skip) {
    let mut r = candle_trace::format::TraceReader::open(path).unwrap();
    let (mut frames, mut skip) = (Vec::new(), candle_trace::format::Skip::default());
    loop {
        let (ops, sites, _) = r.position();
        let Some(items) = r.next_items().unwrap() else { break };
        skip.before.push((ops, sites));
        skip.sums.push(r.position().2);
        frames.push(items);
    }
    (frames, skip)
}

/// The rows `| index | \`Name ...\` |` of the table that follows `heading` in
/// docs/trace-format.md: (index, variant name).
fn doc_table(doc: &str, heading: &str) -> Vec<(u8, String)> {
    let start = doc.find(heading).unwrap_or_else(|| panic!("docs/trace-format.md has no {heading:?}"));
    let mut rows = Vec::new();
    for line in doc[start..].lines().skip(1).skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let (Ok(i), Some(name)) = (cells[1].parse::<u8>(), cells[2].strip_prefix('`')) {
            rows.push((i, name.split(|c: char| !c.is_alphanumeric()).next().unwrap().to_string()));
        }
    }
    rows
}

/// (index, variant name) of every variant of `T` that postcard decodes from its index followed
/// by zero bytes (every field zero, empty or `None`): the enum as the reader knows it.
fn code_table<T: serde::de::DeserializeOwned + std::fmt::Debug>() -> Vec<(u8, String)> {
    (0u8..=127)
        .filter_map(|i| {
            let mut b = vec![i];
            b.extend([0u8; 4096]);
            let v: T = postcard::take_from_bytes(&b).ok()?.0;
            let d = format!("{v:?}");
            Some((i, d.split(|c: char| !c.is_alphanumeric()).next().unwrap().to_string()))
        })
        .collect()
}

/// docs/trace-format.md and the reader agree: the preamble's bytes, the frame kinds, and the
/// `Kernel` and `Item` tables (every index and name, none missing on either side).
#[test]
fn the_format_doc_and_the_reader_agree() {
    use candle_trace::format::*;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/trace-format.md")).unwrap();
    // The worked example's preamble is what the writer writes.
    let hex: Vec<String> = preamble().iter().map(|b| format!("{b:02X}")).collect();
    for (offset, bytes) in [(0, &hex[..8]), (8, &hex[8..10]), (10, &hex[10..11]), (11, &hex[11..12])] {
        let line = format!("{offset:<8}{}", bytes.join(" "));
        assert!(doc.contains(&line), "docs/trace-format.md's worked preamble lacks {line:?}");
    }
    assert!(doc.contains(&format!("`{MINOR:02}` for what this build writes (format {VERSION}.{MINOR})")), "the preamble section names another minor version than {VERSION}.{MINOR}");
    assert!(doc.contains(&format!("# candle-trace trace file format, version {VERSION}")));
    for (kind, what) in [(KIND_HEADER, "`Header`"), (KIND_ITEMS, "`Vec<Item>`"), (KIND_FOOTER, "`Footer`")] {
        assert!(doc.contains(&format!("| {kind}    | {what}")), "frame kind {kind}");
    }
    assert!(doc.contains(&format!("optional frame kind {KIND_SAMPLING}")) && doc.contains(&format!("optional frame kind {KIND_BUILD}")));
    let kernels = code_table::<candle_trace::record::Kernel>();
    assert_eq!(kernels.len(), 23, "{kernels:?}");
    assert_eq!(doc_table(&doc, "`Kernel`: an enum"), kernels);
    let items = code_table::<Item>();
    assert_eq!(doc_table(&doc, "`Item`: an enum"), items);
    // The newest kernels and items are the minor versions' (Evolution).
    assert!(doc.contains(&format!("2.2 adds `Kernel::{}`", kernels[21].1)));
    assert!(doc.contains(&format!("2.3 adds optional frame kind {KIND_LEVEL}")) && doc.contains(&format!("optional frame kind {KIND_LEVEL}, format 2.3")));
    assert!(doc.contains("2.4 adds `Tokens::WholeLow`"));
    assert!(doc.contains(&format!("2.5 adds optional frame kind {KIND_SUMMARY} (frame summaries)")) && doc.contains(&format!("optional frame kind {KIND_SUMMARY}, format 2.5")));
    let (kernel, item) = (kernels.last().unwrap(), items.last().unwrap());
    assert!(doc.contains(&format!("2.6 adds\n  `Kernel::{}` ({}) and `Item::{}` ({})", kernel.1, kernel.0, item.1, item.0)), "the newest kernel and item are named in Evolution");
    assert_eq!(MINOR, 7, "a newer minor version is named in Evolution, and here");
    assert!(doc.contains(&format!("2.7 adds optional frame kinds {KIND_SETTINGS}\n  (run settings) and {KIND_PENALTY} (repeat-penalty steps)")));
    assert!(doc.contains(&format!("(optional frame kinds {KIND_SETTINGS} and {KIND_PENALTY}, format 2.7)")));
}
