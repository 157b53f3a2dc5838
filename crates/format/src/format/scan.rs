//! Items frames decoded ahead of a [`TraceReader`], on another thread: decoding a frame
//! (decompression, postcard, the format-2 records) depends on its stored bytes alone, while the
//! checks against the trace's structure need the frames in order. A [`Scan`] decodes every
//! other frame of a file; the reader takes its [`Decoded`] frames, and checks them, in place of
//! decoding them itself ([`TraceReader::next_items_reusing`]).

use super::*;
use std::io::BufReader;
use std::sync::Arc;

/// Decodes the items frames of one file whose ordinal is `parity` modulo 2, in file order.
/// Anything it cannot read or decode ends the scan quietly: the reader meets the same bytes in
/// its order and refuses them with the right error. So does a frame holding dumped values
/// (value parts join across frames, in the reader: a trace with dumps is decoded by its reader
/// from there on), and passing the reader's budgets: the scan decompresses no more than the
/// reader would before refusing the file, and passes on no frame the reader refuses for its
/// size in memory.
pub struct Scan {
    src: BufReader<File>,
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
}

impl Scan {
    /// Opens `path` for a scan of the items frames whose ordinal modulo 2 is `parity`; `None`
    /// when it cannot be opened or has no trace preamble (the reader says why).
    pub fn open(path: &Path, parity: usize) -> Option<Self> {
        let file = File::open(path).ok()?;
        let len = file.metadata().ok()?.len();
        let mut src = BufReader::with_capacity(1 << 16, file);
        let mut pre = [0u8; PREAMBLE_LEN];
        if read_up_to(&mut src, &mut pre).ok()? < PREAMBLE_LEN || pre[..MAGIC.len()] != MAGIC {
            return None;
        }
        let version = u16::from_le_bytes([pre[8], pre[9]]);
        let dctx = zstd::bulk::Decompressor::new().ok()?;
        Some(Scan { src, len, at: PREAMBLE_LEN as u64, version, parity, ordinal: 0, dctx, budget: crate::limits::decoded_budget(len), decompressed: 0 })
    }

    /// Items frames passed so far, whether decoded here or not.
    pub fn passed(&self) -> usize {
        self.ordinal
    }

    /// The next items frame of this scan's parity, decoded; `None` at the end of the file, at
    /// the first frame that does not read or decode, holds dumped values or passes a budget.
    pub fn next_frame(&mut self) -> Option<Decoded> {
        loop {
            let mut h = [0u8; FRAME_HEADER_LEN];
            if self.at + FRAME_HEADER_LEN as u64 > self.len || read_up_to(&mut self.src, &mut h).ok()? < FRAME_HEADER_LEN {
                return None;
            }
            let word = |r: std::ops::Range<usize>| h[r].iter().rev().fold(0u64, |n, &b| (n << 8) | b as u64);
            let (kind, clen, ulen, sum) = (h[0], word(1..5) as u32, word(5..9) as u32, word(9..17));
            // The reader's caps, before anything is allocated.
            let next = self.at + (FRAME_HEADER_LEN + clen as usize) as u64;
            if clen > MAX_FRAME_LEN || ulen > MAX_FRAME_LEN || next > self.len {
                return None;
            }
            let at = self.at as usize;
            self.at = next;
            let ordinal = self.ordinal;
            if kind == KIND_ITEMS {
                self.ordinal += 1;
            }
            if kind != KIND_ITEMS || ordinal % 2 != self.parity {
                self.src.seek_relative(clen as i64).ok()?;
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
            let items = decode_items(&raw, at, self.version).ok()?;
            if items.iter().map(crate::validate::weight).sum::<u64>() > self.budget || items.iter().any(|i| matches!(i, Item::Dump(_) | Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_))) {
                return None;
            }
            return Some(Decoded { ordinal, version: self.version, sum, ulen, stored: Arc::new(stored), items: Arc::new(items) });
        }
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
}
