//! Tests of the streaming bisect: frames shared and summarised, root causes kept in pass 1,
//! threads that end with the pass.

use super::*;
use candle_trace_format::record::{Forward, Header, InputRef, OpRecord, Phase, Reads, TokenAxis, TokenStat};

/// A decoder-shaped run: sites `layers.L.opK`, one token a forward pass, each op reading the
/// one before; `part`: the record whose digest differs in run b.
fn run(steps: u32, part: Option<u64>) -> Vec<Item> {
    let (layers, ops) = (4u32, 5u32);
    let mut items: Vec<Item> = (0..layers * ops).map(|s| Item::Site { id: s, path: format!("layers.{}.op{}", s / ops, s % ops), op: "add".into() }).collect();
    let mut seq = 0u64;
    for step in 0..steps {
        items.push(Item::Forward(Forward { step, phase: if step == 0 { Phase::Prefill } else { Phase::Decode }, index_pos: step, seq_len: 1, batch: 1, ids: vec![step % 50] }));
        for site in 0..layers * ops {
            let d = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ if part == Some(seq) { 1 } else { 0 };
            let token = TokenStat { row: 0, pos: step, digest: d, sum: (d % 97) as f64, abs_max: 1.0, nonfinite: 0, samples: [1.0, 0.5, -1.0, (d % 13) as f32] };
            items.push(Item::Op(OpRecord {
                seq,
                step,
                site,
                inputs: if site == 0 { Vec::new() } else { vec![InputRef { seq: seq - 1, reads: Reads::Same }] },
                dtype: "f32".into(),
                shape: vec![1, 1, 8],
                digest: d as u128,
                samples: token.samples.to_vec(),
                tokens: vec![token],
                axis: Some(TokenAxis { seq_dim: Some(1), first_pos: step, keep_from: 0, causal: false }),
                ..OpRecord::default()
            }));
            seq += 1;
        }
    }
    items
}

/// A reading thread does not wait for a frame the other file's scan has passed (dropped
/// while this thread was behind), takes one that is there, and one that comes while it
/// waits.
#[test]
fn find_does_not_wait_for_a_frame_the_scan_passed() {
    let frame = |ordinal| Decoded { ordinal, version: 2, sum: 0, ulen: 0, stored: Arc::default(), items: Arc::default() };
    let stored = |ordinal| Stored { ordinal, version: 2, sum: 0, ulen: 0, bytes: &[] };
    // Frame 5 passed and not in the channel (its sender alive): not waited for, however long.
    let (tx, rx) = sync_channel(4);
    let (hungry, passed) = (AtomicBool::new(false), AtomicUsize::new(6));
    let (done, gave_up) = sync_channel(1);
    let look = std::thread::spawn(move || {
        let _ = done.send(find(&stored(5), &rx, Wait::Unless(&hungry, &passed), &mut None).is_none());
        (rx, hungry, passed)
    });
    assert_eq!(gave_up.recv_timeout(std::time::Duration::from_secs(10)), Ok(true), "waited for a frame the scan passed");
    let (rx, hungry, passed) = look.join().unwrap();
    let t = std::time::Instant::now();
    tx.send(frame(4)).unwrap();
    tx.send(frame(5)).unwrap();
    assert_eq!(find(&stored(5), &rx, Wait::Unless(&hungry, &passed), &mut None).map(|d| d.ordinal), Some(5), "the stale frame 4 is passed over");
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "no wait");
    let later = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        tx.send(frame(7)).unwrap();
        tx
    });
    assert_eq!(find(&stored(7), &rx, Wait::Unless(&hungry, &passed), &mut None).map(|d| d.ordinal), Some(7), "waited for it");
    drop(later.join());
}

/// Frames stored the same in both files are decoded once and compared whole; the report is
/// the in-memory bisect's, which reads item by item. Run b differs at record 5 013 (layer 2,
/// op 3 of step 250: 250 × 20 + 13), after about 6 frames both files hold.
#[test]
fn frames_both_files_hold_are_decoded_once_with_the_same_report() {
    let dir = std::env::temp_dir().join(format!("candle-trace-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (pa, pb) = (dir.join("a.trace"), dir.join("b.trace"));
    let (a, b) = (run(300, None), run(300, Some(5013)));
    std::fs::write(&pa, candle_trace_format::format::encode_trace(&Header::default(), &a, None).unwrap()).unwrap();
    std::fs::write(&pb, candle_trace_format::format::encode_trace(&Header::default(), &b, None).unwrap()).unwrap();
    let (streamed, ta, tb) = bisect_files(&pa, &pb).unwrap();
    let (ma, mb) = (candle_trace_format::format::read_trace(&pa).unwrap(), candle_trace_format::format::read_trace(&pb).unwrap());
    let in_memory = crate::bisect::bisect(&ma, &mb).unwrap();
    let root = streamed.first_divergence.as_ref().expect("a root");
    assert_eq!((root.path.as_str(), root.position), ("layers.2.op3", 250));
    assert_eq!(serde_json::to_value(&streamed).unwrap(), serde_json::to_value(&in_memory).unwrap());
    assert_eq!((ta.items.is_empty(), tb.items.is_empty()), (false, false));
    // Frames were compared whole. How many depends on thread timing (a reading thread stops
    // waiting for the other file's scan when pass 1 waits for it): a few tries.
    let mut tries = (0..5).map(|_| {
        let (mut xa, mut xb) = Pass1::pair(TraceReader::open(&pa).unwrap(), TraceReader::open(&pb).unwrap(), Frames::default());
        let al = Alignment::run(candle_trace_format::site::Level::Ops, &mut xa, &mut xb, None, [&pa, &pb]).unwrap();
        assert_eq!((al.compared, al.records(0), al.differing), (6000, 6000, 1));
        assert_eq!(xa.shared_frames, xb.shared_frames);
        xa.shared_frames
    });
    assert!(tries.any(|n| n >= 1), "no frame compared whole in 5 tries");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `items` with the trace writer, a frame a forward pass (as the recorder flushes),
/// so every frame after the first (which declares the sites) has a summary.
fn write(path: &Path, items: &[Item]) {
    let mut w = candle_trace_format::format::TraceWriter::create(path, &Header::default(), None).unwrap();
    for item in items {
        if matches!(item, Item::Forward(_)) {
            w.flush().unwrap();
        }
        w.push(item.clone()).unwrap();
    }
    w.finish(&candle_trace_format::record::Footer { op_records: 6000, forward_passes: 300, ..Default::default() }).unwrap();
}

/// Frames both files hold identically, with their summaries, are compared from the
/// summaries without being decoded, and the report is the in-memory bisect's: run b
/// differs at record 5 013 (step 250); both runs hold a NaN at record 2 005 (step 100),
/// whose frame is decoded (the first non-finite value is still to be found there).
#[test]
fn frames_both_files_hold_are_compared_from_their_summaries_with_the_same_report() {
    let dir = std::env::temp_dir().join(format!("candle-trace-summary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (pa, pb) = (dir.join("a.trace"), dir.join("b.trace"));
    let nan = |mut items: Vec<Item>| {
        for item in &mut items {
            if let Item::Op(r) = item {
                if r.seq == 2005 {
                    r.stats.nan = 1;
                    r.tokens[0].nonfinite = 1;
                }
            }
        }
        items
    };
    write(&pa, &nan(run(300, None)));
    write(&pb, &nan(run(300, Some(5013))));
    let (streamed, ..) = bisect_files(&pa, &pb).unwrap();
    let (ma, mb) = (candle_trace_format::format::read_trace(&pa).unwrap(), candle_trace_format::format::read_trace(&pb).unwrap());
    let in_memory = crate::bisect::bisect(&ma, &mb).unwrap();
    let root = streamed.first_divergence.as_ref().expect("a root");
    assert_eq!((root.path.as_str(), root.position), ("layers.2.op3", 250));
    assert_eq!(serde_json::to_value(&streamed).unwrap(), serde_json::to_value(&in_memory).unwrap());
    let frames = super::frames(&pa, &pb, true);
    let summarised = frames.summarised.clone();
    // The sites are a frame of their own (no summary), then a frame a step.
    assert_eq!((summarised.len(), summarised.iter().filter(|&&x| x).count()), (301, 299), "all but the sites' frame and the differing one");
    let (mut xa, mut xb) = Pass1::pair(TraceReader::open(&pa).unwrap(), TraceReader::open(&pb).unwrap(), frames);
    let al = Alignment::run(candle_trace_format::site::Level::Ops, &mut xa, &mut xb, None, [&pa, &pb]).unwrap();
    assert_eq!((al.compared, al.records(0), al.records(1), al.differing), (6000, 6000, 6000, 1));
    assert_eq!(al.nonfinite()[0].as_ref().map(|n| n.seq), Some(2005));
    assert_eq!(al.layer_output(3), Some("layers.3.op4"));
    // Decoded too: step 0's frame (trace a's first forward pass is not known before it)
    // and step 100's (the NaN).
    assert_eq!((xa.summarised_frames, xb.summarised_frames), (297, 297));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Root causes pass 1 finds are kept as it reads them, and pass 2 reads none of their
/// frames again; the report is the in-memory bisect's. Run b's first op of every step from
/// step 200 on differs (it reads nothing: each is a root, 100 in 100 frames), and what reads
/// it computes the same output.
#[test]
fn root_causes_are_kept_in_pass_1() {
    let dir = std::env::temp_dir().join(format!("candle-trace-keep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (pa, pb) = (dir.join("a.trace"), dir.join("b.trace"));
    let mut b = run(300, None);
    for item in &mut b {
        if let Item::Op(r) = item {
            if r.site == 0 && r.step >= 200 {
                r.digest ^= 1;
                r.tokens[0].digest ^= 1;
            }
        }
    }
    write(&pa, &run(300, None));
    write(&pb, &b);
    let (mut xa, mut xb) = Pass1::pair(TraceReader::open(&pa).unwrap(), TraceReader::open(&pb).unwrap(), super::frames(&pa, &pb, true));
    let al = Alignment::run(candle_trace_format::site::Level::Ops, &mut xa, &mut xb, None, [&pa, &pb]).unwrap();
    let roots = al.roots();
    assert_eq!((roots.len(), roots[0].seq_a, roots[99].seq_b), (100, 4000, 5980));
    // The 100 differing frames (and some of the first ones, decoded on both sides) were
    // compared whole, record by record (Alignment::pairs); the report below is still the
    // in-memory bisect's, which reads item by item.
    assert!(xa.shared_frames >= 100 && xa.shared_frames == xb.shared_frames, "{} {}", xa.shared_frames, xb.shared_frames);
    for (x, seqs) in [(&xa, roots.iter().map(|f| f.seq_a).collect::<HashSet<_>>()), (&xb, roots.iter().map(|f| f.seq_b).collect())] {
        assert_eq!(x.found, seqs, "every root's record kept in pass 1");
        let kept: HashSet<u64> = x.kept.iter().filter_map(|i| if let Item::Op(r) = i { Some(r.seq) } else { None }).collect();
        assert!(seqs.is_subset(&kept));
    }
    let (streamed, ta, _) = bisect_files(&pa, &pb).unwrap();
    let (ma, mb) = (candle_trace_format::format::read_trace(&pa).unwrap(), candle_trace_format::format::read_trace(&pb).unwrap());
    assert_eq!(serde_json::to_value(&streamed).unwrap(), serde_json::to_value(crate::bisect::bisect(&ma, &mb).unwrap()).unwrap());
    let root = streamed.first_divergence.as_ref().expect("a root");
    assert_eq!((root.path.as_str(), root.position), ("layers.0.op0", 200));
    // The traces as the report read them hold each root's record once, as recorded.
    let ops: Vec<&OpRecord> = ta.items.iter().filter_map(|i| if let Item::Op(r) = i { Some(r) } else { None }).collect();
    assert_eq!(ops.iter().filter(|r| r.site == 0 && r.step >= 200).count(), 100);
    assert!(ops.windows(2).all(|w| w[0].seq < w[1].seq), "in id order, once each");
    let recorded = |seq: u64| ma.items.iter().find_map(|i| if let Item::Op(r) = i { (r.seq == seq).then_some(r) } else { None });
    assert!(ops.iter().all(|r| Some(*r) == recorded(r.seq)));
    let _ = std::fs::remove_dir_all(&dir);
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// The thread count once it has fallen to `want`, or after 5 s, what it is then. A joined
/// thread has finished, but the kernel may list it in /proc/self/task for a moment longer:
/// `pthread_join` returns when the thread clears its id, before the kernel reaps the task.
fn threads_settled_at(want: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let n = threads();
        if n <= want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Regression (found by fuzzing the streaming bisect): pass 1 dropped before its file ended
/// (an error on the other side) left the decoding thread running, with its reader's buffers,
/// after the bisect returned. Dropping it now stops and joins the thread. Counts the threads
/// of this process (Linux's /proc; one test at a time, as `.cargo/config.toml` runs them).
#[cfg(target_os = "linux")]
#[test]
fn a_pass_dropped_early_leaves_no_thread() {
    let op = |seq: u64| OpRecord { seq, dtype: "f32".into(), shape: vec![1], digest: seq as u128, ..OpRecord::default() };
    let items: Vec<Item> = std::iter::once(Item::Site { id: 0, path: "x".into(), op: "add".into() }).chain((0..20_000).map(|s| Item::Op(op(s)))).collect();
    let path = std::env::temp_dir().join(format!("candle-trace-pass1-{}.trace", std::process::id()));
    std::fs::write(&path, candle_trace_format::format::encode_trace(&Header::default(), &items, None).unwrap()).unwrap();
    let before = threads();
    let mut p = Pass1::new(TraceReader::open(&path).unwrap(), None, Arc::new([]), Arc::new([]));
    assert!(p.next_into(&mut |_| Ok(())).unwrap(), "read one item");
    assert_eq!(threads(), before + 1, "pass 1 decodes on its own thread");
    drop(p);
    assert_eq!(threads_settled_at(before), before, "the decoding thread outlived its pass");
    // A pair: two reading and two scanning threads, all gone with the passes.
    let (mut a, b) = Pass1::pair(TraceReader::open(&path).unwrap(), TraceReader::open(&path).unwrap(), Frames::default());
    assert!(a.next_into(&mut |_| Ok(())).unwrap(), "read one item");
    assert_eq!(threads(), before + 4, "two reading and two scanning threads");
    drop(a);
    drop(b);
    assert_eq!(threads_settled_at(before), before, "a thread outlived its pass");
    let _ = std::fs::remove_file(&path);
}
