//! The writer: frames out as the run goes, each with one `write_all`, so a run killed at any
//! moment leaves every completed frame readable.

use super::output::{encode, Frames, Job, Output};
use super::*;
use crate::record::OpRecord;

/// One whole frame (17-byte frame header and zstd payload) of kind `kind` holding the postcard
/// bytes `raw`, compressed with the zstd context the caller keeps (a writer reuses one for every
/// frame, instead of making one a frame).
///
/// # Errors
/// A message when it cannot be compressed or a length passes [`MAX_FRAME_LEN`].
pub(super) fn pack(z: &mut zstd::bulk::Compressor<'static>, kind: u8, raw: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut frame = Vec::new();
    pack_into(z, kind, raw, &mut Vec::new(), &mut frame)?;
    Ok(frame)
}

/// [`pack`] into `frame` (cleared first), compressing through `packed` (a buffer the caller
/// keeps too): both only grow, so a writer that keeps them allocates nothing for a frame no
/// larger than the ones before, and neither is zero-filled.
///
/// # Errors
/// As [`pack`].
pub(super) fn pack_into(z: &mut zstd::bulk::Compressor<'static>, kind: u8, raw: &[u8], packed: &mut Vec<u8>, frame: &mut Vec<u8>) -> std::result::Result<(), String> {
    packed.clear();
    packed.reserve(zstd::zstd_safe::compress_bound(raw.len()));
    z.compress_to_buffer(raw, packed).map_err(|e| format!("cannot compress frame: {e}"))?;
    if raw.len() > MAX_FRAME_LEN as usize || packed.len() > MAX_FRAME_LEN as usize {
        return Err("frame over the 64 MiB cap".into());
    }
    frame.clear();
    frame.reserve(FRAME_HEADER_LEN + packed.len());
    frame.extend_from_slice(&FrameHeader { kind, clen: packed.len() as u32, ulen: raw.len() as u32, sum: xxh3_64(raw) }.bytes());
    frame.extend_from_slice(packed);
    Ok(())
}

/// Streams a trace to a file: queues items, cuts them into frames and hands each frame to the
/// writing thread (the private `format::output` module), which encodes, compresses and writes it while the
/// caller goes on.
pub struct TraceWriter {
    path: PathBuf,
    /// The frame being filled: its first `filled` items; the rest are the items of a frame
    /// already written, to be overwritten in place ([`TraceWriter::push_op`]).
    pending: Vec<Item>,
    filled: usize,
    pending_token_stats: usize,
    /// Bytes of dumped values queued.
    pending_value_bytes: usize,
    items: u64,
    /// Where the frames go.
    out: Output,
}

impl TraceWriter {
    /// Creates (truncates) `path` and writes the preamble, the header frame and, when given, the
    /// build fingerprint frame: the recorder passes its own build's
    /// (`candle_trace_instrument::env::build_info`), copies of a trace (`redact`, `extract`) the
    /// original's, and `None` writes no such frame. Later frames are written on a thread of
    /// the writer's own; [`TraceWriter::finish`] waits for them.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be created or written.
    pub fn create(path: &Path, header: &Header, build: Option<&crate::record::BuildInfo>) -> Result<Self> {
        let frames = Self::start(path, header, build)?;
        Ok(Self::over(path, Output::thread(frames)))
    }

    /// [`TraceWriter::create`], writing every frame on the caller's thread (the file is the
    /// same, byte for byte): each frame is in the file when the call that cut it returns.
    ///
    /// # Errors
    /// As [`TraceWriter::create`].
    pub fn create_here(path: &Path, header: &Header, build: Option<&crate::record::BuildInfo>) -> Result<Self> {
        let frames = Self::start(path, header, build)?;
        Ok(Self::over(path, Output::Here(Box::new(frames), None)))
    }

    /// The file with its preamble, header and build frames written.
    fn start(path: &Path, header: &Header, build: Option<&crate::record::BuildInfo>) -> Result<Frames> {
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.write_all(&preamble()).map_err(|e| Error::io(path, e))?;
        let mut frames = Frames::new(path, file)?;
        frames.run(Job::Frame(KIND_HEADER, encode(path, header)?))?;
        if let Some(b) = build {
            frames.run(Job::Frame(KIND_BUILD, encode(path, b)?))?;
        }
        Ok(frames)
    }

    /// A writer with nothing queued, writing into `out`.
    fn over(path: &Path, out: Output) -> Self {
        TraceWriter { path: path.to_path_buf(), pending: Vec::new(), filled: 0, pending_token_stats: 0, pending_value_bytes: 0, items: 0, out }
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

    /// Writes the settings frame ([`super::KIND_SETTINGS`]) when `settings` holds a pair: call
    /// right after [`TraceWriter::create`] (and [`TraceWriter::level`]), before any item.
    ///
    /// # Errors
    /// [`Error::Io`] when the frame cannot be written.
    pub fn settings(&mut self, settings: &crate::record::Settings) -> Result<()> {
        if settings.0.is_empty() {
            return Ok(());
        }
        self.write_frame(KIND_SETTINGS, settings)
    }

    /// Queues one item; cuts a frame when [`ITEMS_PER_FRAME`] items or
    /// [`TOKEN_STATS_PER_FRAME`] per-token entries are queued.
    ///
    /// # Errors
    /// [`Error::Usage`] for a dumped value over the frame cap; as [`TraceWriter::flush`].
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
            // A repro's other run carries its operand values whole (not split into parts).
            Item::Counterpart(c) => c.operands.iter().map(|v| v.data().len()).sum(),
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
        if let Item::Op(r) = &item {
            self.pending_token_stats += r.tokens.len();
        }
        match self.pending.get_mut(self.filled) {
            Some(slot) => *slot = item,
            None => self.pending.push(item),
        }
        self.filled += 1;
        self.pushed()
    }

    /// Queues one op record, filled in place by `fill`: into a record of a frame already
    /// written, whose lists keep their memory, when one stands at this place (every field then
    /// holds what the old record held, so `fill` sets each one, clearing the lists before
    /// refilling them), else into [`OpRecord::default`]. No record is moved, and filling one
    /// allocates nothing once its lists have the room. The record is then queued as
    /// [`TraceWriter::push`] queues an item; when `fill` fails it is not (nothing is queued).
    ///
    /// # Errors
    /// `fill`'s error; as [`TraceWriter::flush`].
    pub fn push_op(&mut self, fill: &mut dyn FnMut(&mut OpRecord) -> Result<()>) -> Result<()> {
        let at = self.filled;
        if !matches!(self.pending.get(at), Some(Item::Op(_))) {
            let item = Item::Op(OpRecord::default());
            match self.pending.get_mut(at) {
                Some(slot) => *slot = item,
                None => self.pending.push(item),
            }
        }
        let Some(Item::Op(rec)) = self.pending.get_mut(at) else { unreachable!("an op record was put at {at}") };
        fill(rec)?;
        self.pending_token_stats += rec.tokens.len();
        self.filled += 1;
        self.pushed()
    }

    /// Counts the item just queued and cuts a frame when [`ITEMS_PER_FRAME`] items or
    /// [`TOKEN_STATS_PER_FRAME`] per-token entries are queued.
    fn pushed(&mut self) -> Result<()> {
        self.items += 1;
        if self.filled >= ITEMS_PER_FRAME || self.pending_token_stats >= TOKEN_STATS_PER_FRAME {
            self.flush()?;
        }
        Ok(())
    }

    /// Cuts the queued items into one frame (nothing when none are queued), followed in the
    /// file by its summary frame ([`KIND_SUMMARY`]) when it has one, and hands it to the writing
    /// thread: it reaches the file once the thread has compressed it (with
    /// [`TraceWriter::create_here`], before this returns).
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Trace`] when an earlier frame could not be written (the
    /// writing thread's error, returned once in full and then in words), or, writing here,
    /// this one.
    pub fn flush(&mut self) -> Result<()> {
        if self.filled == 0 {
            return Ok(());
        }
        self.pending.truncate(self.filled);
        let room = self.filled;
        let items = std::mem::take(&mut self.pending);
        self.filled = 0;
        self.pending_token_stats = 0;
        self.pending_value_bytes = 0;
        let sent = self.out.send(&self.path, Job::Items(items));
        // The next frame fills a frame already written (writing here: this one), or a list with
        // room for this one's items.
        self.pending = self.out.written_back().unwrap_or_else(|| Vec::with_capacity(room));
        sent
    }

    /// Writes one decode step's sampling records as an optional frame ([`KIND_SAMPLING`]),
    /// after the items queued so far.
    ///
    /// # Errors
    /// As [`TraceWriter::flush`].
    pub fn sampling(&mut self, steps: &[crate::record::SamplingStep]) -> Result<()> {
        self.flush()?;
        self.write_frame(KIND_SAMPLING, &steps)
    }

    /// Flushes the queued items, then writes one decode step's repeat-penalty records as a
    /// penalty frame ([`super::KIND_PENALTY`]); nothing for an empty list.
    ///
    /// # Errors
    /// As [`TraceWriter::flush`].
    pub fn penalty(&mut self, steps: &[crate::record::PenaltyStep]) -> Result<()> {
        if steps.is_empty() {
            return Ok(());
        }
        self.flush()?;
        self.write_frame(KIND_PENALTY, &steps)
    }

    /// Number of items pushed so far.
    pub fn items(&self) -> u64 {
        self.items
    }

    /// Flushes the queued items, writes the footer frame and waits until every frame is in the
    /// file, synced; the file is then complete.
    ///
    /// # Errors
    /// As [`TraceWriter::flush`]; [`Error::Io`] when the file cannot be synced.
    pub fn finish(mut self, footer: &Footer) -> Result<()> {
        self.finish_in_place(footer)
    }

    /// [`TraceWriter::finish`] through a reference (for use behind `dyn Sink`); call it once.
    /// The footer's `items` is set to the number of items written.
    ///
    /// # Errors
    /// As [`TraceWriter::finish`].
    pub fn finish_in_place(&mut self, footer: &Footer) -> Result<()> {
        self.flush()?;
        // No frame follows: the records kept to be filled again are freed now, not when the
        // writer is dropped.
        self.pending = Vec::new();
        let footer = Footer { items: self.items, ..footer.clone() };
        self.out.send(&self.path, Job::Footer(encode(&self.path, &footer)?))?;
        self.out.end(&self.path)
    }

    /// Flushes the queued items and waits until every frame is in the file, without a footer
    /// (a copy of a truncated trace stays truncated). Unlike dropping the writer, this returns
    /// an error met writing the last frames.
    ///
    /// # Errors
    /// As [`TraceWriter::flush`].
    pub fn close(mut self) -> Result<()> {
        self.flush()?;
        self.out.end(&self.path)
    }

    fn write_frame<T: serde::Serialize>(&mut self, kind: u8, value: &T) -> Result<()> {
        let raw = encode(&self.path, value)?;
        self.out.send(&self.path, Job::Frame(kind, raw))
    }
}

impl Drop for TraceWriter {
    /// Waits for the frames handed over (a run that ends without [`TraceWriter::finish`] still
    /// has them in its file); the items queued and not cut into a frame are dropped, and so is
    /// any error writing the frames ([`TraceWriter::close`] returns it).
    fn drop(&mut self) {
        let _ = self.out.end(&self.path);
    }
}
