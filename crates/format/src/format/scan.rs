//! Items frames decoded ahead of a [`TraceReader`], on another thread: decoding a frame
//! (decompression, postcard, the format-2 records) depends on its stored bytes alone, while the
//! checks against the trace's structure need the frames in order. A [`Scan`] decodes every
//! other frame of a file; the reader takes its [`Decoded`] frames, and checks them, in place of
//! decoding them itself ([`TraceReader::next_items_reusing`]).

use super::*;
use std::sync::Arc;

/// Decodes the items frames of one file whose ordinal is `parity` modulo 2, in file order.
/// Anything it cannot read or decode ends the scan quietly: the reader meets the same bytes in
/// its order and refuses them with the right error. So does a frame holding dumped values
/// (value parts join across frames, in the reader: a trace with dumps is decoded by its reader
/// from there on), and passing the reader's budgets: the scan decompresses no more than the
/// reader would before refusing the file, and passes on no frame the reader refuses for its
/// size in memory.
pub struct Scan {
    src: FileAt,
    len: u64,
    at: u64,
    version: u16,
    parity: usize,
    /// Items frames passed so far.
    ordinal: usize,
    dctx: zstd::bulk::Decompressor<'static>,
    /// The reader's budget ([`crate::limits::decoded_budget`]), and what this scan has
    /// decompressed so far (the reader refuses a file whose frames decompress to more, and a
    /// frame whose items take more in memory).
    budget: u64,
    decompressed: u64,
    /// Items frames not to decode, by ordinal.
    skip: Option<Arc<[bool]>>,
    /// Where each items frame's header starts, by ordinal ([`frames_compared`]): the scan
    /// goes straight to the next frame it decodes rather than through every header before it.
    index: Option<Arc<[u64]>>,
    /// Frame headers read (tests check that an index spares them).
    headers: usize,
    /// Op records of frames handed back ([`Scan::recycle`]), read into again.
    spare: Spare,
}

impl Scan {
    /// Opens `path` for a scan of the items frames whose ordinal modulo 2 is `parity`; `None`
    /// when it cannot be opened or has no trace preamble (the reader says why).
    pub fn open(path: &Path, parity: usize) -> Option<Self> {
        let (src, len, version) = open_past_preamble(path)?;
        let dctx = zstd::bulk::Decompressor::new().ok()?;
        Some(Scan {
            src,
            len,
            at: PREAMBLE_LEN as u64,
            version,
            parity,
            ordinal: 0,
            dctx,
            budget: crate::limits::decoded_budget(len),
            decompressed: 0,
            skip: None,
            index: None,
            headers: 0,
            spare: Spare::default(),
        })
    }

    /// Leaves to the reader, undecoded, the items frames whose ordinal `skip` marks (frames
    /// the reader takes as their summaries, [`TraceReader::next_or_summary`]).
    pub fn skipping(mut self, skip: Arc<[bool]>) -> Self {
        self.skip = Some(skip);
        self
    }

    /// Goes straight to the items frames it decodes, by where `index` says each starts (its
    /// header's offset, by ordinal: [`frames_compared`] of this file), rather than reading every
    /// header on the way. Past the frames `index` lists, headers are read one by one again.
    pub fn indexed(mut self, index: Arc<[u64]>) -> Self {
        self.index = Some(index);
        self
    }

    /// Moves to the next items frame this scan decodes when the index knows where it starts,
    /// else to the last frame it lists (headers are read one by one from there). Each frame's
    /// ordinal is looked at once over the whole scan.
    fn jump(&mut self) {
        let Some(index) = self.index.as_ref().filter(|i| self.ordinal < i.len()) else { return };
        let wanted = |o: usize| o % 2 == self.parity && self.skip.as_ref().is_none_or(|s| s.get(o) != Some(&true));
        let last = index.len() - 1;
        let (o, at) = next_wanted_frame(index, self.ordinal, wanted).unwrap_or((last, index[last]));
        if o > self.ordinal {
            (self.at, self.ordinal) = (at, o);
            let _ = std::io::Seek::seek(&mut self.src, std::io::SeekFrom::Start(at));
        }
    }

    /// Hands back a frame this scan decoded once it is no longer needed: its op records are
    /// read into again, in place (no allocation a record), rather than freed.
    pub fn recycle(&mut self, items: Vec<Item>) {
        self.spare.keep(items);
    }

    /// Items frames passed so far, whether decoded here or not.
    pub fn passed(&self) -> usize {
        self.ordinal
    }

    /// The next items frame of this scan's parity, decoded; `None` at the end of the file, at
    /// the first frame that does not read or decode, holds dumped values or passes a budget.
    pub fn next_frame(&mut self) -> Option<Decoded> {
        loop {
            self.jump();
            self.headers += 1;
            let h = FrameHeader::read(&mut self.src).ok()??;
            let FrameHeader { kind, clen, ulen, sum } = h;
            // The reader's caps, before anything is allocated.
            let next = h.next(self.at);
            if !h.within_caps() || next > self.len {
                return None;
            }
            let at = self.at as usize;
            self.at = next;
            let ordinal = self.ordinal;
            if kind == KIND_ITEMS {
                self.ordinal += 1;
            }
            let skipped = self.skip.as_ref().is_some_and(|s| s.get(ordinal) == Some(&true));
            if kind != KIND_ITEMS || ordinal % 2 != self.parity || skipped {
                self.src.pass(clen);
                continue;
            }
            self.decompressed += ulen as u64;
            if self.decompressed > self.budget {
                return None;
            }
            let mut stored = vec![0u8; clen as usize];
            if read_up_to(&mut self.src, &mut stored).ok()? < clen as usize {
                return None;
            }
            let raw = self.dctx.decompress(&stored, ulen as usize).ok()?;
            if raw.len() != ulen as usize || xxh3_64(&raw) != sum {
                return None;
            }
            let items = decode_items_reusing(&raw, at, self.version, &mut self.spare).ok()?;
            if items.iter().map(crate::validate::weight).sum::<u64>() > self.budget || items.iter().any(|i| matches!(i, Item::Dump(_) | Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_))) {
                return None;
            }
            return Some(Decoded { ordinal, version: self.version, sum, ulen, stored: Arc::new(stored), items: Arc::new(items) });
        }
    }
}

/// `path` opened and read past a trace preamble: (the reader, the file's length, the major
/// version); `None` when it cannot be opened or has no preamble (the reader says why).
fn open_past_preamble(path: &Path) -> Option<(FileAt, u64, u16)> {
    let file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut src = FileAt::new(file);
    let mut pre = [0u8; PREAMBLE_LEN];
    if read_up_to(&mut src, &mut pre).ok()? < PREAMBLE_LEN || pre[..MAGIC.len()] != MAGIC {
        return None;
    }
    Some((src, len, u16::from_le_bytes([pre[8], pre[9]])))
}

/// What [`frame_digests`] lists of one items frame: its frame header's lengths and checksum,
/// and those of the summary frame right after it, if there is one, with where their payloads
/// start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameDigest {
    /// (compressed length, uncompressed length, xxh3-64 of the payload).
    pub items: (u32, u32, u64),
    /// The same of its summary frame ([`KIND_SUMMARY`]).
    pub summary: Option<(u32, u32, u64)>,
    /// Offsets of the items frame's payload and of its summary's (0 without one).
    pub at: (u64, u64),
}

impl FrameDigest {
    /// The same uncompressed lengths and checksums, with a summary, wherever the frames lie
    /// (the compressed lengths may differ: another zstd level or version).
    fn same_headers(&self, o: &FrameDigest) -> bool {
        let content = |h: (u32, u32, u64)| (h.1, h.2);
        content(self.items) == content(o.items) && self.summary.is_some() && self.summary.map(content) == o.summary.map(content)
    }
}

/// By ordinal, the items frames files `a` and `b` hold identically with a summary, in files of
/// the same major version: the same uncompressed lengths and xxh3-64 checksums in the headers
/// of the items frame and of its summary frame. Nothing but the frame headers is read.
///
/// The checksum is trusted here as bisect trusts every digest it compares: a frame's checksum
/// covers its records' own 64-bit digests, and two payloads that differ share a checksum with
/// probability 2⁻⁶⁴ (XXH3's, as for any two records' digests). It is what the writer computed
/// over what it recorded, so a payload corrupted on disk under an intact header reads as what
/// was recorded; a reader that decodes the frame ([`crate::format::read_trace`], `trace show`)
/// refuses it. A forged file can claim any content anyway, frames or records. Payloads stored
/// differently (another zstd level or version) compare as the same without being
/// decompressed. Empty when either file cannot be listed.
pub fn same_frames(a: &Path, b: &Path) -> Vec<bool> {
    frames_compared(a, b).0
}

/// [`same_frames`], and where each file's items frames start (their headers' offsets, by
/// ordinal, as [`frame_digests`] lists them: empty when it cannot): what a [`Scan`] of the
/// file goes by ([`Scan::indexed`]).
pub fn frames_compared(a: &Path, b: &Path) -> (Vec<bool>, [Vec<u64>; 2]) {
    let (ra, rb) = std::thread::scope(|s| {
        let rb = s.spawn(|| frame_digests(b));
        (frame_digests(a), rb.join().ok().flatten())
    });
    let starts = |r: &Option<(u16, Vec<FrameDigest>)>| r.as_ref().map_or(Vec::new(), |(_, d)| d.iter().map(|f| f.at.0 - FRAME_HEADER_LEN as u64).collect());
    let index = [starts(&ra), starts(&rb)];
    let (Some((va, da)), Some((vb, db))) = (ra, rb) else { return (Vec::new(), index) };
    (da.iter().zip(&db).map(|(p, q)| va == vb && p.same_headers(q)).collect(), index)
}

/// The first items frame from ordinal `from` on that `wanted` takes, as (ordinal, where its
/// header starts), by `index` (each items frame's header offset by ordinal, as
/// [`frames_compared`] lists them); `None` when no frame `index` lists is wanted. Each ordinal
/// is looked at once: a pass calling it from where the last call left off looks at every
/// ordinal once over the whole file.
pub(crate) fn next_wanted_frame(index: &[u64], from: usize, wanted: impl Fn(usize) -> bool) -> Option<(usize, u64)> {
    (from..index.len()).find(|&o| wanted(o)).map(|o| (o, index[o]))
}

/// Every items frame of `path`, in order, as its frame header and its summary frame's header
/// give it (nothing is decompressed: the headers are read, the payloads passed over). The
/// checksum is the xxh3-64 of the uncompressed payload: two frames with equal lengths and
/// checksums hold the same items but with probability 2⁻⁶⁴ ([`same_frames`]). `None` when the
/// file cannot be read or has
/// no trace preamble; the list stops at the first frame whose lengths do not fit the file
/// (the reader says why).
pub fn frame_digests(path: &Path) -> Option<(u16, Vec<FrameDigest>)> {
    let (mut src, len, version) = open_past_preamble(path)?;
    let (mut at, mut out) = (PREAMBLE_LEN as u64, Vec::<FrameDigest>::new());
    let mut last_kind = 0u8;
    loop {
        let Some(h) = FrameHeader::read(&mut src).ok()? else {
            return Some((version, out));
        };
        let FrameHeader { kind, clen, ulen, sum } = h;
        let next = h.next(at);
        if !h.within_caps() || next > len {
            return Some((version, out));
        }
        let payload = at + FRAME_HEADER_LEN as u64;
        match kind {
            KIND_ITEMS => out.push(FrameDigest { items: (clen, ulen, sum), summary: None, at: (payload, 0) }),
            KIND_SUMMARY if last_kind == KIND_ITEMS => {
                if let Some(last) = out.last_mut() {
                    last.summary = Some((clen, ulen, sum));
                    last.at.1 = payload;
                }
            }
            _ => {}
        }
        last_kind = kind;
        src.pass(clen);
        at = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Header, OpRecord};

    fn op(seq: u64) -> Item {
        Item::Op(OpRecord { seq, dtype: "f32".into(), shape: vec![1], digest: seq as u128, samples: vec![seq as f32], ..OpRecord::default() })
    }

    /// Reads `path` taking every frame two scans decoded ahead: the items of each frame, and
    /// the frames taken.
    fn read_ahead(path: &Path) -> (Result<Vec<Vec<Item>>>, usize) {
        let mut scans = [Scan::open(path, 0).unwrap(), Scan::open(path, 1).unwrap()];
        let mut r = TraceReader::open(path).unwrap();
        let (mut frames, mut taken) = (Vec::new(), 0);
        loop {
            let mut offered = None;
            let got = r.next_items_reusing(&mut |s| {
                let d = scans[s.ordinal % 2].next_frame().filter(|d| d.ordinal == s.ordinal);
                offered = d.as_ref().map(|d| Arc::as_ptr(&d.items));
                d
            });
            match got {
                Ok(Some(items)) => {
                    taken += usize::from(offered == Some(Arc::as_ptr(&items)));
                    frames.push(items.to_vec());
                }
                Ok(None) => return (Ok(frames), taken),
                // The frame refused was offered (and taken, had it passed the checks).
                Err(e) => return (Err(e), taken + usize::from(offered.is_some())),
            }
        }
    }

    /// Frames decoded ahead are the frames the reader decodes; a frame that fails a check fails
    /// it with the same error when taken from a scan.
    #[test]
    fn frames_decoded_ahead_read_and_refuse_as_the_reader_does() {
        let dir = std::env::temp_dir().join(format!("candle-trace-scan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let site = Item::Site { id: 0, path: "x".into(), op: "add".into() };
        let good: Vec<Item> = std::iter::once(site.clone()).chain((0..5000).map(op)).collect();
        // Record 3000 (frame 2) repeats record 2999's id: decoded fine, refused by the checks.
        let bad: Vec<Item> = std::iter::once(site).chain((0..5000).map(|s| op(if s == 3000 { 2999 } else { s }))).collect();
        for (name, items) in [("good", good), ("bad", bad)] {
            let path = dir.join(format!("{name}.trace"));
            std::fs::write(&path, encode_trace(&Header::default(), &items, None).unwrap()).unwrap();
            let plain = read_trace(&path).map(|t| t.items);
            let (ahead, taken) = read_ahead(&path);
            match (plain, ahead) {
                (Ok(p), Ok(a)) => {
                    assert_eq!(format!("{:?}", a.concat()), format!("{p:?}"));
                    assert_eq!(taken, 5, "every frame of {name} taken");
                }
                (Err(p), Err(a)) => {
                    assert_eq!(a.to_string(), p.to_string());
                    assert!(a.to_string().contains("3000"), "{a}");
                    assert_eq!(taken, 3, "frames 0 to 2 taken, the third refused");
                }
                (p, a) => panic!("{name}: read {:?}, read ahead {:?}", p.map(|v| v.len()), a.map(|v| v.len())),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A scan that goes by the frames' offsets ([`Scan::indexed`]) decodes the frames a scan
    /// reading every header decodes, skipping the same ones, and has passed as many at the end;
    /// with an index that ends early (a file cut after it was listed) it reads on header by
    /// header.
    #[test]
    fn an_indexed_scan_decodes_what_a_plain_one_does() {
        let dir = std::env::temp_dir().join(format!("candle-trace-indexed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.trace");
        let mut w = TraceWriter::create(&path, &Header::default(), None).unwrap();
        w.push(Item::Site { id: 0, path: "x".into(), op: "add".into() }).unwrap();
        for seq in 0..600u64 {
            w.push(op(seq)).unwrap();
            if seq % 50 == 49 {
                w.flush().unwrap(); // a frame and its summary frame
            }
        }
        w.finish(&crate::record::Footer { op_records: 600, ..Default::default() }).unwrap();
        let (_, digests) = frame_digests(&path).unwrap();
        assert!(digests.len() >= 12 && digests.iter().skip(1).all(|d| d.summary.is_some()), "frames with summaries");
        let index: Arc<[u64]> = digests.iter().map(|d| d.at.0 - FRAME_HEADER_LEN as u64).collect();
        let decoded = |scan: Scan| {
            let mut scan = scan;
            let frames: Vec<(usize, String)> = std::iter::from_fn(|| scan.next_frame()).map(|d| (d.ordinal, format!("{:?}", d.items))).collect();
            (frames, scan.passed())
        };
        let skip: Arc<[bool]> = (0..digests.len()).map(|o| o % 3 == 1).collect();
        for parity in 0..2 {
            let plain = decoded(Scan::open(&path, parity).unwrap().skipping(skip.clone()));
            assert!(plain.0.len() >= 3, "{plain:?}");
            assert_eq!(decoded(Scan::open(&path, parity).unwrap().skipping(skip.clone()).indexed(index.clone())), plain);
            assert_eq!(decoded(Scan::open(&path, parity).unwrap().skipping(skip.clone()).indexed(index[..5].into())), plain);
            assert_eq!(decoded(Scan::open(&path, parity).unwrap().indexed(index.clone())), decoded(Scan::open(&path, parity).unwrap()));
        }
        // Every frame skipped: an indexed scan reads the headers from the last items frame on
        // (its summary's, the footer's, the end), not every header.
        let all: Arc<[bool]> = vec![true; digests.len()].into();
        let headers = |scan: Scan| {
            let mut scan = scan;
            assert!(scan.next_frame().is_none());
            (scan.passed(), scan.headers)
        };
        let walked = headers(Scan::open(&path, 0).unwrap().skipping(all.clone()));
        assert!(walked.1 > 2 * digests.len(), "{walked:?}");
        assert_eq!(headers(Scan::open(&path, 0).unwrap().skipping(all).indexed(index)), (walked.0, 4));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A scan stops (and leaves the rest to the reader) at a frame holding dumped values, and
    /// before decompressing past the reader's budget.
    #[test]
    fn a_scan_stops_at_dumped_values_and_at_the_budget() {
        let dir = std::env::temp_dir().join(format!("candle-trace-scan-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Six frames, a dump in frame 2: the scan of even frames gives frame 0, then stops
        // there (passing it over would give frame 4).
        let dump = Item::Dump(crate::record::Dump { seq: 0, dtype: "f32".into(), shape: vec![1], shuffled: true, data: vec![0; 4] });
        let mut items: Vec<Item> = std::iter::once(Item::Site { id: 0, path: "x".into(), op: "add".into() }).chain((0..6000).map(op)).collect();
        items.insert(2100, dump);
        let path = dir.join("dump.trace");
        std::fs::write(&path, encode_trace(&Header::default(), &items, None).unwrap()).unwrap();
        let mut scan = Scan::open(&path, 0).unwrap();
        assert_eq!(scan.next_frame().map(|d| d.ordinal), Some(0));
        assert!(scan.next_frame().is_none(), "frame 2 holds a dump");
        assert_eq!(scan.passed(), 3, "stopped at frame 2");
        // Twenty frames of one site with a path of nearly 4 MiB each, a few kilobytes on disk (budget
        // 32 MiB): the reader refuses the ninth; the scan of even frames gives 8 of its 10
        // (32 MiB) and stops before decompressing the ninth.
        let mut bytes = preamble().to_vec();
        bytes.extend(frame_bytes(KIND_HEADER, &Header::default()).unwrap());
        for id in 0..20 {
            bytes.extend(items_frame_bytes(&[Item::Site { id, path: "x".repeat((4 << 20) - 100), op: "add".into() }]).unwrap());
        }
        let path = dir.join("budget.trace");
        std::fs::write(&path, &bytes).unwrap();
        assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
        let mut scan = Scan::open(&path, 0).unwrap();
        let got: Vec<usize> = std::iter::from_fn(|| scan.next_frame().map(|d| d.ordinal)).collect();
        assert_eq!(got, (0..8).map(|k| 2 * k).collect::<Vec<_>>());
        assert!(read_trace(&path).unwrap_err().to_string().contains("budget"), "the reader refuses it");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn op_at(seq: u64, site: u32, tokens: &[(u32, u32)]) -> Item {
        let tokens = tokens.iter().map(|&(row, pos)| crate::record::TokenStat { row, pos, digest: 0, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }).collect();
        Item::Op(OpRecord { seq, site, step: 2, dtype: "f32".into(), shape: vec![1], tokens, ..OpRecord::default() })
    }

    /// A file whose second items frame is summarised by `summary` (its first declares site
    /// 0), read with that frame taken as its summary: the summary, or the error.
    fn read_summarised(summary: &crate::summary::FrameSummary) -> crate::Result<Vec<String>> {
        let ops: Vec<Item> = (0..3).map(|k| op_at(k, 0, &[(0, k as u32)])).collect();
        let mut bytes = preamble().to_vec();
        bytes.extend(frame_bytes(KIND_HEADER, &crate::record::Header::default()).unwrap());
        bytes.extend(items_frame_bytes(&[Item::Site { id: 0, path: "x".into(), op: "add".into() }]).unwrap());
        bytes.extend(items_frame_bytes(&ops).unwrap());
        bytes.extend(frame_bytes(KIND_SUMMARY, summary).unwrap());
        bytes.extend(items_frame_bytes(&[op_at(3, 0, &[(0, 3)])]).unwrap());
        let mut r = TraceReader::from_bytes(&bytes, std::path::Path::new("crafted.trace"))?;
        let mut got = Vec::new();
        while let Some(next) = r.next_or_summary(&mut |_| None, &|k| k == 1)? {
            got.push(match next {
                Next::Items(items) => format!("{} items", items.len()),
                Next::Summary(s, _) => format!("summary of {} records", s.records()),
            });
        }
        Ok(got)
    }

    /// A summary read in place of its frame is checked as the frame's items would be; one that
    /// lies is refused, naming the file, before anything is allocated or indexed by it.
    #[test]
    fn a_summary_is_checked_before_it_stands_for_its_frame() {
        let ops: Vec<Item> = (0..3).map(|k| op_at(k, 0, &[(0, k as u32)])).collect();
        let good = crate::summary::FrameSummary::of(&ops, |_| (false, None)).unwrap();
        // The record after the summarised frame is numbered 3: the summary's records counted.
        assert_eq!(read_summarised(&good).unwrap(), vec!["1 items", "summary of 3 records", "1 items"]);
        let lies = [
            (crate::summary::FrameSummary { sites: vec![(5, 3)], ..good.clone() }, "names site 5"),
            (crate::summary::FrameSummary { sites: vec![(0, u32::MAX), (0, u32::MAX)], ..good.clone() }, "counts 8589934590 op records"),
            (crate::summary::FrameSummary { runs: vec![(0, 3, 0, 0, 1), (2, 2, 0, 0, 1)], ..good.clone() }, "names records 2..4 of 3"),
            (crate::summary::FrameSummary { runs: vec![(0, 1, 0, u32::MAX, 2)], ..good.clone() }, "run of 2 positions"),
            // Far more positions than the frame's bytes hold (a hang or an allocation otherwise).
            (crate::summary::FrameSummary { runs: vec![(0, 3, 0, 0, u32::MAX)], ..good.clone() }, "stands for 12884901885 per-token entries"),
            (crate::summary::FrameSummary { kept: vec![op_at(7, 0, &[])], ..good.clone() }, "keeps op record 7"),
            (crate::summary::FrameSummary { kept: vec![op_at(1, 0, &[]), op_at(0, 0, &[])], ..good.clone() }, "keeps op record 0"),
            (crate::summary::FrameSummary { kept: vec![Item::Site { id: 1, path: "y".into(), op: "add".into() }], ..good.clone() }, "other than"),
            // Fewer records than the frame holds: the next frame's first is out of sequence.
            (crate::summary::FrameSummary { sites: vec![(0, 2)], runs: vec![(0, 2, 0, 0, 1)], ..good.clone() }, "op record 3 where 2 was expected"),
        ];
        for (lie, why) in lies {
            let err = read_summarised(&lie).expect_err(why).to_string();
            assert!(err.starts_with("crafted.trace") && err.contains(why), "{why}: {err}");
        }
    }

    /// Frames whose headers (and their summaries' headers) agree are the same, and are not
    /// read: a stored payload byte changed under an unchanged header (a file corrupted on disk)
    /// leaves its frame the same, while a reader that decodes it refuses it; a header whose
    /// checksum differs makes its frame not the same.
    #[test]
    fn same_frames_compares_the_frame_headers() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.trace"), dir.path().join("b.trace"));
        let mut w = TraceWriter::create(&a, &Header::default(), None).unwrap();
        w.push(Item::Site { id: 0, path: "x".into(), op: "add".into() }).unwrap();
        for k in 0..4 {
            w.flush().unwrap();
            w.push(op_at(k, 0, &[(0, k as u32)])).unwrap();
        }
        w.finish(&crate::record::Footer { op_records: 4, ..Default::default() }).unwrap();
        std::fs::copy(&a, &b).unwrap();
        assert_eq!(same_frames(&a, &b), vec![false, true, true, true, true], "the sites' frame has no summary");
        let (_, digests) = frame_digests(&b).unwrap();
        let mut bytes = std::fs::read(&b).unwrap();
        bytes[digests[2].at.0 as usize + 3] ^= 1;
        std::fs::write(&b, &bytes).unwrap();
        assert_eq!(frame_digests(&b).unwrap().1, digests, "headers unchanged");
        assert_eq!(same_frames(&a, &b), vec![false, true, true, true, true]);
        assert!(crate::format::read_trace(&b).is_err(), "a reader decoding the frame refuses it");
        // Ordinal 3's checksum (the last 8 bytes of its 17-byte frame header) changed.
        bytes[digests[3].at.0 as usize - 1] ^= 1;
        std::fs::write(&b, &bytes).unwrap();
        assert_eq!(same_frames(&a, &b), vec![false, true, true, false, true]);
    }

    /// `bytes` (a whole trace file) with every frame's payload compressed again at `level`,
    /// its header's uncompressed length kept and its checksum that of the payload; `change` may
    /// alter a frame's payload first (by its index among all frames, the header frame being 0).
    fn recompressed(bytes: &[u8], level: i32, change: impl Fn(usize, &mut Vec<u8>)) -> Vec<u8> {
        let (mut out, mut src) = (bytes[..PREAMBLE_LEN].to_vec(), &bytes[PREAMBLE_LEN..]);
        let mut index = 0;
        while let Some(h) = FrameHeader::read(&mut src).unwrap() {
            let (payload, rest) = src.split_at(h.clen as usize);
            src = rest;
            let mut raw = zstd::bulk::decompress(payload, h.ulen as usize).unwrap();
            change(index, &mut raw);
            let packed = zstd::bulk::compress(&raw, level).unwrap();
            out.extend(FrameHeader { clen: packed.len() as u32, sum: crate::hash::xxh3_64(&raw), ..h }.bytes());
            out.extend(packed);
            index += 1;
        }
        out
    }

    /// Frames compressed differently (another zstd level, as a trace written before the level
    /// changed) are the same, without being decompressed: their headers agree; a frame holding
    /// other bytes (its header's checksum theirs) is not.
    #[test]
    fn same_frames_takes_differently_stored_payloads_as_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.trace"), dir.path().join("b.trace"));
        let mut w = TraceWriter::create(&a, &Header::default(), None).unwrap();
        w.push(Item::Site { id: 0, path: "x".into(), op: "add".into() }).unwrap();
        for k in 0..4 {
            w.flush().unwrap();
            for j in 0..50 {
                w.push(op_at(k * 50 + j, 0, &[(0, (k * 50 + j) as u32)])).unwrap();
            }
        }
        w.finish(&crate::record::Footer { op_records: 200, ..Default::default() }).unwrap();
        let bytes = std::fs::read(&a).unwrap();
        std::fs::write(&b, recompressed(&bytes, 19, |_, _| {})).unwrap();
        // The test means something only if level 19 stores some compared payload otherwise:
        // an items frame or a summary of ordinals 1 to 4 whose compressed length differs.
        let (_, da) = frame_digests(&a).unwrap();
        let (_, db) = frame_digests(&b).unwrap();
        let stored = |d: &FrameDigest| (d.items.0, d.summary.map(|s| s.0));
        let differently = (1..5).filter(|&k| stored(&da[k]) != stored(&db[k])).count();
        assert!(differently > 0, "level 19 stores no compared frame otherwise");
        assert_eq!(same_frames(&a, &b), vec![false, true, true, true, true]);
        // The file's frames: header, the sites' items frame (ordinal 0), then items and summary
        // for ordinals 1 to 4, footer. Ordinal 1's items and ordinal 2's summary hold other
        // bytes, their headers' checksums recomputed.
        let other = recompressed(&bytes, 1, |i, raw| {
            if i == 2 || i == 5 {
                let n = raw.len();
                raw[n - 1] ^= 1;
            }
        });
        std::fs::write(&b, &other).unwrap();
        assert_eq!(same_frames(&a, &b), vec![false, false, false, true, true]);
    }
}
