//! Checks every decoded item of a trace against the trace's own structure, so that consumers
//! (`show`, `bisect`, `replay`) only ever index what exists: sites are numbered 0, 1, 2… as they
//! are declared; an op record names a declared site, is numbered next in sequence, and reads
//! only earlier records; shapes pass [`crate::limits::elements`]; value bytes are exactly what
//! their dtype and shape need; embeddings are all of one length. Also weighs items, for the
//! reader's memory budget ([`crate::limits::decoded_budget`]).

use crate::limits;
use crate::record::{Dump, Header, Item, OpRecord, OperandValue};
use std::mem::size_of;

/// Running state of the checks over one trace's item stream.
#[derive(Debug, Default)]
pub struct Checker {
    sites: u32,
    next_seq: u64,
    /// A frame summary's sites, record by record (kept for its capacity).
    summary_sites: Vec<u32>,
}

impl Checker {
    /// Op records seen so far.
    pub fn op_records(&self) -> u64 {
        self.next_seq
    }

    /// Continues the checks after frames read before and skipped now (bisect's second pass):
    /// `op_records` records and `sites` sites precede the next item.
    pub fn resume(&mut self, op_records: u64, sites: u32) {
        self.next_seq = op_records;
        self.sites = sites;
    }

    /// Sites declared so far.
    pub fn sites(&self) -> u32 {
        self.sites
    }

    /// Checks one item, in stream order.
    ///
    /// # Errors
    /// One sentence saying what is wrong with the item.
    pub fn item(&mut self, item: &Item) -> Result<(), String> {
        match item {
            Item::Site { id, .. } => {
                if *id != self.sites {
                    return Err(format!("site {id} declared where site {} was expected", self.sites));
                }
                self.sites += 1;
            }
            Item::Op(r) => {
                if r.seq != self.next_seq {
                    return Err(format!("op record {} where {} was expected: a frame is missing or repeated", r.seq, self.next_seq));
                }
                if r.site >= self.sites {
                    return Err(format!("op record {} names site {}, but {} sites are declared", r.seq, r.site, self.sites));
                }
                record(r)?;
                if let Some(i) = r.inputs.iter().find(|i| i.seq >= r.seq) {
                    return Err(format!("op record {} reads record {}, which is not an earlier one", r.seq, i.seq));
                }
                self.next_seq += 1;
            }
            Item::Forward(f) => {
                if f.index_pos.checked_add(f.seq_len).is_none() {
                    return Err(format!(
                        "forward pass {} covers positions {}..{}, past the last position a trace can hold ({})",
                        f.step,
                        f.index_pos,
                        u64::from(f.index_pos) + u64::from(f.seq_len),
                        u32::MAX
                    ));
                }
                let want = (f.batch as u64).checked_mul(f.seq_len as u64);
                if !f.ids.is_empty() && want != Some(f.ids.len() as u64) {
                    return Err(format!("forward pass {} holds {} token ids for batch {} x {} positions", f.step, f.ids.len(), f.batch, f.seq_len));
                }
            }
            Item::Embeddings(v) => {
                if let Some(first) = v.first() {
                    if v.iter().any(|e| e.len() != first.len()) {
                        return Err("embeddings of different lengths".into());
                    }
                }
            }
            Item::Counterpart(c) => {
                header(&c.header)?;
                record(&c.record)?;
            }
            Item::WeightNorm(w) => {
                if w.site >= self.sites {
                    return Err(format!("a weight norm names site {}, but {} sites are declared", w.site, self.sites));
                }
                if !(w.max_row_l2.is_finite() && w.max_row_l2 >= 0.0) {
                    return Err(format!("the weight norm of site {} is {}, not a finite norm", w.site, w.max_row_l2));
                }
            }
            Item::Token(_) | Item::Dump(_) | Item::Operand(_) | Item::ValuePart(_) => {}
        }
        Ok(())
    }
}

impl Checker {
    /// Checks the summary `s` of the items frame that comes next (`frame_bytes` long,
    /// uncompressed), in place of its items (bisect, for a frame two runs hold identically), and
    /// moves on past the frame's records: the per-token entries it stands for fit the frame;
    /// every record names a declared site; every run of positions names one of the frame's
    /// records and ends within u32 positions; the kept items are forward passes, tokens and op
    /// records of the frame, in order, each as [`Checker::item`] checks it, at the site the
    /// summary gives it.
    ///
    /// # Errors
    /// One sentence saying what is wrong with the summary.
    pub fn summary(&mut self, s: &crate::summary::FrameSummary, frame_bytes: u32) -> Result<(), String> {
        let (first, records) = (self.next_seq, s.records());
        if records > limits::MAX_ITEMS_PER_FRAME || records > s.items as u64 {
            return Err(format!("a frame summary counts {records} op records in a frame of {} items", s.items));
        }
        // Each per-token entry takes bytes of the frame: the runs cannot stand for more.
        let entries = s.entries();
        if entries > frame_bytes as u64 / crate::summary::MIN_TOKEN_BYTES {
            return Err(format!("a frame summary stands for {entries} per-token entries, more than its frame of {frame_bytes} bytes holds"));
        }
        let mut sites = std::mem::take(&mut self.summary_sites);
        s.sites_into(&mut sites);
        let checked = self.summary_kept(s, &sites, first, records);
        self.summary_sites = sites;
        checked
    }

    /// [`Checker::summary`] past the counts: `sites` is the summary's sites, record by record.
    fn summary_kept(&mut self, s: &crate::summary::FrameSummary, sites: &[u32], first: u64, records: u64) -> Result<(), String> {
        if let Some(bad) = sites.iter().find(|&&x| x >= self.sites) {
            return Err(format!("a frame summary names site {bad}, but {} sites are declared", self.sites));
        }
        for k in s.runs() {
            if k.records == 0 || k.record as u64 + k.records as u64 > records || k.len == 0 || k.pos.checked_add(k.len - 1).is_none() {
                return Err(format!("a frame summary's run of {} positions from {} names records {}..{} of {records}", k.len, k.pos, k.record, k.record as u64 + k.records as u64));
            }
        }
        if s.kept.len() as u64 > s.items as u64 {
            return Err(format!("a frame summary counts {} items for {records} records and {} kept", s.items, s.kept.len()));
        }
        for item in &s.kept {
            match item {
                Item::Op(r) => {
                    // Records before it are in the frame: checked as if they had been read.
                    if r.seq < self.next_seq || r.seq >= first + records || sites[(r.seq - first) as usize] != r.site {
                        return Err(format!("a frame summary keeps op record {} at site {}, which the frame does not hold there", r.seq, r.site));
                    }
                    self.next_seq = r.seq;
                    self.item(item)?;
                }
                Item::Forward(_) | Item::Token(_) => self.item(item)?,
                _ => return Err("a frame summary keeps an item other than a forward pass, a token or an op record".into()),
            }
        }
        self.next_seq = first + records;
        Ok(())
    }
}

/// Checks what one op record says of itself: a known dtype and a shape within the caps.
fn record(r: &OpRecord) -> Result<(), String> {
    if limits::dtype_size(&r.dtype).is_none() {
        return Err(format!("op record {} has unknown dtype {:?}", r.seq, r.dtype));
    }
    if limits::elements(&r.shape).is_none() {
        return Err(format!("op record {} has shape {:?}, over the caps", r.seq, r.shape));
    }
    Ok(())
}

/// Checks a dense value: known dtype, byte length exactly what the shape needs.
fn dump(d: &Dump) -> Result<(), String> {
    crate::dump::check(d).map(|_| ()).map_err(|e| e.to_string())
}

/// Checks an operand value: dense ones by [`crate::dump::check`]; quantized ones have a known GGML type, a
/// last dimension made of whole blocks, and exactly the bytes that type and shape need.
pub fn operand(v: &OperandValue) -> Result<(), String> {
    match v {
        OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => dump(d),
        OperandValue::Quantized { id, ggml_dtype, shape, data } => match limits::ggml_bytes(ggml_dtype, shape) {
            None => Err(format!("operand {id}: quantization type {ggml_dtype:?} with shape {shape:?} is unknown or not whole blocks")),
            Some(n) if n != data.len() as u64 => Err(format!("operand {id}: {} bytes where {ggml_dtype} of shape {shape:?} needs {n}", data.len())),
            Some(_) => Ok(()),
        },
    }
}

/// Checks the values of a trace once value parts are joined (dense values as `dump`, operands as [`operand`]).
///
/// # Errors
/// One sentence naming the value.
pub fn values(items: &[Item]) -> Result<(), String> {
    for item in items {
        match item {
            Item::Dump(d) => dump(d)?,
            Item::Operand(v) => operand(v)?,
            Item::Counterpart(c) => c.operands.iter().try_for_each(operand)?,
            _ => {}
        }
    }
    Ok(())
}

fn strings<'a>(xs: impl IntoIterator<Item = &'a String>) -> u64 {
    xs.into_iter().map(|s| (size_of::<String>() + s.len()) as u64).sum()
}

fn list<T>(xs: &[T]) -> u64 {
    std::mem::size_of_val(xs) as u64
}

/// Checks what the header says of itself: a batch of at most [`limits::MAX_ROWS`] rows.
///
/// # Errors
/// One sentence saying what is wrong.
pub fn header(h: &Header) -> Result<(), String> {
    if h.run.batch as usize > limits::MAX_ROWS {
        return Err(format!("the header's batch of {} rows is over the cap of {}", h.run.batch, limits::MAX_ROWS));
    }
    Ok(())
}

/// Bytes the header takes in memory (approximately: sizes of the structs and their contents).
pub fn header_weight(h: &Header) -> u64 {
    let (r, e) = (&h.run, &h.env);
    size_of::<Header>() as u64
        + strings([&r.model.name, &r.model.sha256, &r.model.architecture, &r.model.weights, &r.dtype, &r.prompt, &r.dump, &r.pooling])
        + r.model.config.iter().map(|(k, v)| strings([k, v])).sum::<u64>()
        + list(&r.prompt_tokens)
        + strings(&r.texts)
        + strings(r.perturb.iter())
        + strings([&e.crate_version, &e.candle_version, &e.rustc, &e.os, &e.arch, &e.cpu, &e.device])
        + strings(&e.simd)
        + e.env_vars.iter().map(|(k, v)| strings([k, v])).sum::<u64>()
}

fn record_weight(r: &OpRecord) -> u64 {
    list(&r.inputs) + r.dtype.len() as u64 + list(&r.shape) + list(&r.samples) + list(&r.tokens) + list(&r.operands)
}

fn value_weight(v: &OperandValue) -> u64 {
    match v {
        OperandValue::Tensor(d) | OperandValue::QMatMulTensor(d) => (d.dtype.len() + d.data.len()) as u64 + list(&d.shape),
        OperandValue::Quantized { ggml_dtype, shape, data, .. } => (ggml_dtype.len() + data.len()) as u64 + list(shape),
    }
}

/// Bytes one item takes in memory (approximately: its size and its contents').
pub fn weight(item: &Item) -> u64 {
    size_of::<Item>() as u64
        + match item {
            Item::Site { path, op, .. } => (path.len() + op.len()) as u64,
            Item::Forward(f) => list(&f.ids),
            Item::Op(r) => record_weight(r),
            Item::Token(t) => list(&t.rows) + t.rows.iter().map(|c| c.text.len() as u64 + list(&c.top)).sum::<u64>(),
            Item::Embeddings(v) => v.iter().map(|e| (size_of::<Vec<f32>>() as u64) + list(e)).sum(),
            Item::Dump(d) => (d.dtype.len() + d.data.len()) as u64 + list(&d.shape),
            Item::Operand(v) => value_weight(v),
            Item::Counterpart(c) => {
                size_of::<crate::record::Counterpart>() as u64
                    + header_weight(&c.header)
                    + record_weight(&c.record)
                    + c.operands.iter().map(|v| size_of::<OperandValue>() as u64 + value_weight(v)).sum::<u64>()
            }
            Item::ValuePart(p) => p.len() as u64,
            Item::WeightNorm(_) => 0,
        }
}
