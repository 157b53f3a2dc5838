//! The reader's tests: frames read for some records, an indexed later pass.

use super::*;

/// A frame read for some of its op records ([`decode_items_only`]) gives those records,
/// decoded as a whole read decodes them, and every other item before the last of them, in
/// order; a frame cut short is refused or, cut past the last of them, read the same. Over
/// every items frame of the example traces.
#[test]
fn frames_read_for_some_records_give_those_records() {
    for name in ["gemma3-270m-fixed", "gemma3-270m-upstream", "gemma3-270m-transformers"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(format!("{name}.trace"));
        let mut r = TraceReader::open(&path).unwrap();
        assert!(r.version > 1, "{name} is in format 2 or later");
        let mut records = 0;
        while let Some((kind, raw, at)) = r.frame().unwrap() {
            if kind != KIND_ITEMS {
                continue;
            }
            let all = decode_items(&raw, at, r.version).unwrap();
            let seqs: Vec<u64> = all.iter().filter_map(|i| if let Item::Op(o) = i { Some(o.seq) } else { None }).collect();
            // Every other record, the last one not among them.
            let odd: Vec<u64> = seqs.iter().copied().filter(|s| s % 2 == 1 && Some(s) != seqs.last()).collect();
            records += odd.len();
            let last = all.iter().position(|i| matches!(i, Item::Op(o) if Some(&o.seq) == odd.last())).map_or(0, |i| i + 1);
            let want: Vec<&Item> = all[..last].iter().filter(|i| !matches!(i, Item::Op(o) if !odd.contains(&o.seq))).collect();
            let some = decode_items_only(&raw, at, &odd).unwrap();
            assert_eq!(format!("{some:?}"), format!("{want:?}"), "{name}");
            let every = decode_items_only(&raw, at, &seqs).unwrap();
            let last_op = all.iter().rposition(|i| matches!(i, Item::Op(_))).map_or(0, |i| i + 1);
            assert_eq!(format!("{every:?}"), format!("{:?}", &all[..last_op]), "{name}");
            for cut in (0..raw.len()).step_by(raw.len() / 7 + 1) {
                // Refused, or read whole up to the last record wanted: never misread.
                let got = decode_items_only(&raw[..cut], at, &odd).map(|items| format!("{items:?}"));
                assert!(got.as_ref().is_err() || got.as_ref().ok() == Some(&format!("{want:?}")), "{name}: cut at {cut} of {}", raw.len());
            }
        }
        assert!(records > 10, "{name}: {records} records read");
    }
}

/// With [`Skip::index`], a later pass goes straight to the frames it wants: the header of a
/// frame it does not want is never read (garbled, the pass reads the same items; without
/// the index, that header is refused), it stops after the last wanted frame, and a wanted
/// frame whose checksum is not the one noted is still refused.
#[test]
fn an_indexed_pass_reads_no_header_between_the_frames_it_wants() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/builtin-chunk1.trace");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let bytes = std::fs::read(&src).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let (mut r, mut skip, mut frames) = (TraceReader::open(&path).unwrap(), Skip::default(), Vec::new());
    loop {
        let (ops, sites, _) = r.position();
        let Some(items) = r.next_items().unwrap() else { break };
        skip.before.push((ops, sites));
        skip.sums.push(r.position().2);
        frames.push(items);
    }
    let index: Arc<[u64]> = crate::format::frames_compared(&path, &path).1[0].clone().into();
    assert!(frames.len() > 4 && index.len() == frames.len(), "{} frames, {} indexed", frames.len(), index.len());
    let pass = |want: &[usize], sums: &[u64], index: Option<Arc<[u64]>>| -> Result<Vec<Vec<Item>>> {
        let want = (0..sums.len()).map(|k| want.contains(&k)).collect();
        let skip = Skip { want, sums: sums.to_vec(), before: skip.before.clone(), index, ..Skip::default() };
        let mut r = TraceReader::open(&path)?.skipping(skip);
        std::iter::from_fn(|| r.next_items().transpose()).collect()
    };
    assert_eq!(pass(&[1, 3], &skip.sums, Some(index.clone())).unwrap(), vec![frames[1].clone(), frames[3].clone()]);
    // Frame 2's header garbled (kind 0, refused by any reader that reads it).
    let mut garbled = bytes.clone();
    garbled[index[2] as usize] = 0;
    std::fs::write(&path, &garbled).unwrap();
    assert_eq!(pass(&[1, 3], &skip.sums, Some(index.clone())).unwrap(), vec![frames[1].clone(), frames[3].clone()]);
    let e = pass(&[1, 3], &skip.sums, None).unwrap_err().to_string();
    assert!(e.contains("t.trace") && e.contains("frame kind"), "{e}");
    // So is everything after the last frame wanted: not read.
    let end = index[4] as usize;
    garbled[end..].iter_mut().for_each(|b| *b = 0xff);
    std::fs::write(&path, &garbled).unwrap();
    assert_eq!(pass(&[1, 3], &skip.sums, Some(index.clone())).unwrap(), vec![frames[1].clone(), frames[3].clone()]);
    // A wanted frame is still checked against the first pass's checksum.
    let mut sums = skip.sums.clone();
    sums[3] ^= 1;
    let e = pass(&[1, 3], &sums, Some(index.clone())).unwrap_err().to_string();
    assert!(e.contains("changed between two reads"), "{e}");
    // An index of another length (not this file's) is not gone by.
    let e = pass(&[1, 3], &skip.sums, Some(index[..3].into())).unwrap_err().to_string();
    assert!(e.contains("frame kind"), "{e}");
}
