//! The reader's tests: frames read for some records.

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
