//! The writer: frames out as the run goes, each with one `write_all`, so a run killed at any
//! moment leaves every completed frame readable.

use super::*;

/// [`frame_bytes`] with a zstd context the caller keeps (a writer reuses one for every frame,
/// instead of making one a frame).
pub(super) fn frame_bytes_with<T: serde::Serialize>(z: &mut zstd::bulk::Compressor<'static>, kind: u8, value: &T) -> std::result::Result<Vec<u8>, String> {
    let raw = postcard::to_stdvec(value).map_err(|e| format!("cannot encode frame: {e}"))?;
    let packed = z.compress(&raw).map_err(|e| format!("cannot compress frame: {e}"))?;
    if raw.len() > MAX_FRAME_LEN as usize || packed.len() > MAX_FRAME_LEN as usize {
        return Err("frame over the 64 MiB cap".into());
    }
    let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + packed.len());
    frame.extend_from_slice(&FrameHeader { kind, clen: packed.len() as u32, ulen: raw.len() as u32, sum: xxh3_64(&raw) }.bytes());
    frame.extend_from_slice(&packed);
    Ok(frame)
}

/// Streams a trace to a file.
pub struct TraceWriter {
    path: PathBuf,
    file: File,
    pending: Vec<Item>,
    pending_token_stats: usize,
    /// Bytes of dumped values queued.
    pending_value_bytes: usize,
    items: u64,
    /// Frames written so far (header included).
    frames: u64,
    /// Crash tests only ([`crate::crash`]): where to SIGKILL this process.
    kill_at: Option<crate::crash::KillPoint>,
    /// The zstd context every frame is compressed with.
    zstd: zstd::bulk::Compressor<'static>,
    /// Per site id declared so far: whether its path is the logits' and its op (for the frame
    /// summaries, [`crate::summary::FrameSummary::of`]).
    sites: Vec<(bool, Option<crate::site::Op>)>,
}

impl TraceWriter {
    /// Creates (truncates) `path` and writes the preamble, the header frame and, when given, the
    /// build fingerprint frame: the recorder passes its own build's
    /// (`candle_trace_run::env::build_info`), copies of a trace (`redact`, `extract`) the
    /// original's, and `None` writes no such frame.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be created or written.
    pub fn create(path: &Path, header: &Header, build: Option<&crate::record::BuildInfo>) -> Result<Self> {
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.write_all(&preamble()).map_err(|e| Error::io(path, e))?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            file,
            pending: Vec::new(),
            pending_token_stats: 0,
            pending_value_bytes: 0,
            items: 0,
            frames: 0,
            kill_at: crate::crash::kill_point(),
            zstd: zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| Error::io(path, std::io::Error::other(e)))?,
            sites: Vec::new(),
        };
        w.write_frame(KIND_HEADER, header)?;
        if let Some(b) = build {
            w.write_frame(KIND_BUILD, b)?;
        }
        Ok(w)
    }

    /// Writes the level frame ([`super::KIND_LEVEL`]) when `level` is not
    /// [`crate::site::Level::Ops`]: call right after [`TraceWriter::create`], before any item.
    ///
    /// # Errors
    /// [`Error::Io`] when the frame cannot be written.
    pub fn level(&mut self, level: crate::site::Level) -> Result<()> {
        if level == crate::site::Level::Ops {
            return Ok(());
        }
        self.write_frame(KIND_LEVEL, &level)
    }

    /// Queues one item; writes a frame when [`ITEMS_PER_FRAME`] items or
    /// [`TOKEN_STATS_PER_FRAME`] per-token entries are queued.
    pub fn push(&mut self, mut item: Item) -> Result<()> {
        // Values larger than a part go out as ValuePart items first, then the item with the rest.
        let data = match &mut item {
            Item::Dump(d) => Some(&mut d.data),
            Item::Operand(v) => Some(v.data_mut()),
            _ => None,
        };
        if let Some(data) = data {
            if data.len() > VALUE_PART_BYTES {
                let rest = data.split_off(data.len() - data.len() % VALUE_PART_BYTES);
                let head = std::mem::replace(data, rest);
                for part in head.chunks(VALUE_PART_BYTES) {
                    self.push(Item::ValuePart(part.to_vec()))?;
                }
            }
        }
        let value_bytes = match &item {
            Item::ValuePart(p) => p.len(),
            Item::Dump(d) => d.data.len(),
            Item::Operand(v) => v.data().len(),
            _ => 0,
        };
        if value_bytes > 0 {
            if value_bytes + 4096 > MAX_FRAME_LEN as usize {
                return Err(Error::usage(format!("{}: a dumped tensor of {} MiB does not fit the {} MiB frame cap; narrow --dump", self.path.display(), value_bytes >> 20, MAX_FRAME_LEN >> 20)));
            }
            // Values go in frames of their own once they would crowd the cap.
            if self.pending_value_bytes + value_bytes > VALUE_BYTES_PER_FRAME {
                self.flush()?;
            }
            self.pending_value_bytes += value_bytes;
        }
        match &item {
            Item::Op(r) => self.pending_token_stats += r.tokens.len(),
            Item::Site { path, op, .. } => self.sites.push((crate::summary::is_logits_path(path), crate::site::Op::parse(op))),
            _ => {}
        }
        self.pending.push(item);
        self.items += 1;
        if self.pending.len() >= ITEMS_PER_FRAME || self.pending_token_stats >= TOKEN_STATS_PER_FRAME {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the queued items as one frame (nothing when none are queued), followed by its
    /// summary frame ([`KIND_SUMMARY`]) when it has one.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let items = std::mem::take(&mut self.pending);
        self.pending_token_stats = 0;
        self.pending_value_bytes = 0;
        self.write_frame(KIND_ITEMS, &crate::compact::encode_items(&items))?;
        let sites = &self.sites;
        let summary = crate::summary::FrameSummary::of(&items, |id| sites.get(id as usize).copied().unwrap_or((false, None)));
        // Optional: one that cannot be encoded within the caps is left out (bisect decodes the
        // frame instead).
        match summary.map(|s| frame_bytes_with(&mut self.zstd, KIND_SUMMARY, &s)) {
            Some(Ok(frame)) => self.write_bytes(&frame),
            _ => Ok(()),
        }
    }

    /// Writes one decode step's sampling records as an optional frame ([`KIND_SAMPLING`]),
    /// after the items queued so far.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be written.
    pub fn sampling(&mut self, steps: &[crate::record::SamplingStep]) -> Result<()> {
        self.flush()?;
        self.write_frame(KIND_SAMPLING, &steps)
    }

    /// Number of items pushed so far.
    pub fn items(&self) -> u64 {
        self.items
    }

    /// Flushes the queued items and writes the footer frame; the file is then complete.
    pub fn finish(mut self, footer: &Footer) -> Result<()> {
        self.finish_in_place(footer)
    }

    /// [`TraceWriter::finish`] through a reference (for use behind `dyn Sink`); call it once.
    /// The footer's `items` is set to the number of items written.
    pub fn finish_in_place(&mut self, footer: &Footer) -> Result<()> {
        self.flush()?;
        let footer = Footer { items: self.items, ..footer.clone() };
        self.write_frame(KIND_FOOTER, &footer)?;
        // Durable on disk; special files (/dev/null, pipes) cannot be synced and need not be.
        if self.file.metadata().map(|m| m.is_file()).unwrap_or(false) {
            self.file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(())
    }

    fn write_frame<T: serde::Serialize>(&mut self, kind: u8, value: &T) -> Result<()> {
        let frame = frame_bytes_with(&mut self.zstd, kind, value).map_err(|e| Error::trace(&self.path, e))?;
        self.write_bytes(&frame)
    }

    /// Writes one whole frame with one `write_all` (and kills the process there in crash tests).
    fn write_bytes(&mut self, frame: &[u8]) -> Result<()> {
        let index = self.frames;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && k.mid_frame) {
            // Half the frame reaches the file, then the process dies.
            let _ = self.file.write_all(&frame[..frame.len() / 2]);
            k.kill();
        }
        self.file.write_all(frame).map_err(|e| Error::io(&self.path, e))?;
        self.frames += 1;
        if let Some(k) = self.kill_at.filter(|k| k.frame == index && !k.mid_frame) {
            k.kill();
        }
        Ok(())
    }
}
