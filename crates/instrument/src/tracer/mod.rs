//! The handle an instrumented forward pass calls for every op it runs.
//!
//! The tracer gives each recorded op a sequence number, interns its (module path, op) site,
//! summarises its output ([`crate::digest`]) and pushes the record into a [`Sink`], on the
//! forward pass's thread or, with [`Tracer::with_summary_worker`], on a worker ([`worker`])
//! that holds each output until it has summarised it. An untraced tracer runs the same code
//! path and records nothing: the baseline for overhead. A `--perturb` spec makes the tracer flip
//! the lowest mantissa bit of one element of one op's output, a known fault for checking bisect.

use crate::digest::{summarize_op_into, Rows, Summary, TokenAxis};
use crate::kernel::Execute;
use crate::kernel::{Kernel, Operand};
use crate::numerics::Numerics;
use crate::patch::{Captured, Patch, SliceKey};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Tensor};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::{Footer, Forward, Item, OpRecord, Phase, Reads, Stats};
use candle_trace_format::site::{Level, Site};
use skipped::Skipped;
use std::collections::HashMap;
use worker::{Pending, Worker};

mod sink;
mod skipped;
mod steps;
pub mod worker;

pub use sink::{MemorySink, Sink};

/// A recorded (or, untraced, merely computed) op output.
#[derive(Clone, Debug)]
pub struct Node {
    /// The output tensor (after any perturbation or patch).
    pub t: Tensor,
    /// Record id; `None` when untraced. An op the run's [`Level`] skips holds an id at or above
    /// [`SKIPPED`] that stands for its nearest recorded ancestors.
    pub seq: Option<u64>,
}

impl Node {
    /// A node that was not recorded.
    pub fn plain(t: Tensor) -> Self {
        Node { t, seq: None }
    }
}

/// The token layout of an op output, relative to the current forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tok {
    /// Dim `d` is the sequence axis, holding positions `index_pos ..`.
    Seq(usize),
    /// Attention scores/probabilities `[b, heads, q, kv]`: queries at `index_pos ..`, keys `0..=p`.
    Causal,
    /// Encoder attention scores/probabilities `[b, heads, q, kv]`: every key of the row is
    /// visible (only the row's real tokens when the batch is padded).
    Keys,
    /// KV cache `[b, kv_heads, kv, head_dim]` holding positions `0 ..`; only the positions this
    /// pass wrote (`index_pos ..`) are summarised.
    Cache,
    /// `[b, ...]`: each row is the last position of the pass (logits).
    Last,
    /// No token axis (pooled sentence embeddings): only the whole-tensor digest.
    Whole,
}

pub use candle_trace_format::fields::Perturb;

/// The recording handle. See the module docs.
pub struct Tracer {
    sink: Option<Out>,
    /// Site ids by module path (foldhash: this is looked up for every op).
    sites: foldhash::HashMap<String, u32>,
    next_seq: u64,
    step: Option<u32>,
    index_pos: u32,
    seq_len: u32,
    /// Armed perturbations, each with whether it has been applied.
    perturbs: Vec<(Perturb, bool)>,
    /// Slices to overwrite, by module path.
    patches: HashMap<String, Vec<Patch>>,
    /// Slices to read out, by module path, and what was read.
    captures: HashMap<String, Vec<SliceKey>>,
    captured: HashMap<SliceKey, Captured>,
    stop_on_nonfinite: bool,
    /// Advanced once per generated token (hidden when stderr is not a terminal).
    progress: Option<Box<dyn Fn() + Send>>,
    dump: candle_trace_format::dump::DumpSpec,
    /// Whether the current forward pass is dumped (`dump`'s bound, [`candle_trace_format::dump::Passes`]).
    dump_pass: bool,
    /// Operand values written so far.
    operand_ids: HashMap<OperandKey, u64>,
    /// Sites whose weight's norm ([`Item::WeightNorm`]) is written.
    normed: std::collections::HashSet<u32>,
    /// Where each batch row's tokens are, for batches of padded requests.
    rows: Rows,
    /// The first op output holding a NaN or ±Inf that counts (a mask's -inf does not): its
    /// module path and forward pass.
    first_nonfinite: Option<(String, u32)>,
    /// What is recorded (`--level`).
    level: Level,
    /// Ops the level skipped in this forward pass and the recorded ops each stands for.
    skipped: Skipped,
    /// Which kernels ops run on.
    numerics: Numerics,
}

/// Ids of skipped ops ([`Node::seq`]) start here: far above any record id.
pub const SKIPPED: u64 = 1 << 62;

impl Tracer {
    /// A tracer that records into `sink`.
    pub fn new(sink: Box<dyn Sink>) -> Self {
        Tracer {
            sink: Some(Out::Here(sink)),
            sites: foldhash::HashMap::default(),
            next_seq: 0,
            step: None,
            index_pos: 0,
            seq_len: 0,
            perturbs: Vec::new(),
            patches: HashMap::new(),
            captures: HashMap::new(),
            captured: HashMap::new(),
            stop_on_nonfinite: false,
            progress: None,
            dump: candle_trace_format::dump::DumpSpec::None,
            dump_pass: true,
            operand_ids: HashMap::new(),
            normed: std::collections::HashSet::new(),
            rows: Rows::default(),
            first_nonfinite: None,
            level: Level::Ops,
            skipped: Skipped::default(),
            numerics: Numerics::Fixed,
        }
    }

    /// Runs every op under `numerics` ([`Numerics::Invariant`]: on the batch-invariant kernels).
    pub fn with_numerics(mut self, numerics: Numerics) -> Self {
        self.numerics = numerics;
        self
    }

    /// The numerics ops run under.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// A tracer that records nothing (ops run exactly as traced ones do).
    pub fn untraced() -> Self {
        Tracer { sink: None, ..Tracer::new(Box::new(MemorySink::default())) }
    }

    /// Records only the ops `level` keeps (see [`Level`]); the sink notes the level.
    ///
    /// # Errors
    /// The sink's, writing the level frame.
    pub fn with_level(mut self, level: Level) -> Result<Self> {
        self.level = level;
        if let Some(s) = &mut self.sink {
            s.call(move |s| s.level(level), false)?;
        }
        Ok(self)
    }

    /// Arms perturbations (see [`Perturb`]), each applied once.
    pub fn with_perturbs(mut self, p: Vec<Perturb>) -> Self {
        self.perturbs = p.into_iter().map(|p| (p, false)).collect();
        self
    }

    /// Arms patches: when the op at a patch's module path produces the patch's (row, position),
    /// that slice is overwritten with the patch's values before the output is recorded and
    /// passed on (the record is flagged `perturbed`). See [`crate::patch`].
    pub fn with_patches(mut self, patches: Vec<Patch>) -> Self {
        self.patches.clear();
        for p in patches {
            self.patches.entry(p.at.path.clone()).or_default().push(p);
        }
        self
    }

    /// Reads out the slices `keys` name as their ops produce them (after any patch or
    /// perturbation), traced or not: [`Tracer::take_captured`] returns them.
    pub fn with_captures(mut self, keys: Vec<SliceKey>) -> Self {
        self.captures.clear();
        for k in keys {
            self.captures.entry(k.path.clone()).or_default().push(k);
        }
        self
    }

    /// The slices read out so far (see [`Tracer::with_captures`]): 1-D tensors in the op's dtype.
    /// A slice produced twice keeps its first value.
    pub fn take_captured(&mut self) -> HashMap<SliceKey, Captured> {
        std::mem::take(&mut self.captured)
    }

    /// The patches that have not been written (their op never produced their position).
    pub fn patches_left(&self) -> Vec<SliceKey> {
        self.patches.values().flatten().map(|p| p.at.clone()).collect()
    }

    /// Makes `Tracer::record` return [`Error::StoppedOnNonFinite`] right after recording the
    /// first op output that holds a NaN or ±Inf (the mask's intended -inf excepted).
    pub fn with_stop_on_nonfinite(mut self, stop: bool) -> Self {
        self.stop_on_nonfinite = stop;
        self
    }

    /// Dumps the full values of the ops `spec` selects, and of their inputs (see [`candle_trace_format::dump`]).
    pub fn with_dump(mut self, spec: candle_trace_format::dump::DumpSpec) -> Self {
        self.dump = spec;
        self
    }

    /// Summarises CPU op outputs on a worker thread while the forward pass runs on (see
    /// [`worker`]): the same trace, byte for byte. Ops whose values are dumped,
    /// outputs on another device and every op under [`Tracer::with_stop_on_nonfinite`] are
    /// still summarised on the forward pass's thread. Does nothing when untraced or `on` is false.
    ///
    /// # Errors
    /// [`Error::Io`] when the thread cannot be started.
    pub fn with_summary_worker(mut self, on: bool) -> Result<Self> {
        if on {
            self.sink = match self.sink.take() {
                Some(Out::Here(sink)) => Some(Out::Worker(Worker::start(sink)?)),
                other => other,
            };
        }
        Ok(self)
    }

    /// Reports generation progress: `tick` is called once per generated token (a progress
    /// bar's increment; the recorder passes indicatif's).
    pub fn with_progress(mut self, tick: Option<Box<dyn Fn() + Send>>) -> Self {
        self.progress = tick;
        self
    }

    /// Marks one generated token on the progress report, if any.
    pub fn tick(&self) {
        if let Some(tick) = &self.progress {
            tick();
        }
    }

    /// True when records are kept.
    pub fn is_traced(&self) -> bool {
        self.sink.is_some()
    }

    /// Whether an op at module path `path` was recorded so far (always true when untraced:
    /// nothing is known then).
    pub fn ran(&self, path: &str) -> bool {
        self.sink.is_none() || self.sites.contains_key(path)
    }

    /// The armed perturbations not applied (their op never produced their position).
    pub fn perturbations_left(&self) -> Vec<&Perturb> {
        self.perturbs.iter().filter(|(_, done)| !done).map(|(p, _)| p).collect()
    }

    /// The module path and forward pass of the first recorded op output holding a NaN or ±Inf
    /// (as [`candle_trace_compare::nonfinite::is_nonfinite`] counts them); `None` while every one is
    /// finite. With a summary worker, complete once [`Tracer::finish`] has returned.
    pub fn first_nonfinite(&self) -> Option<(String, u32)> {
        match &self.sink {
            Some(Out::Worker(w)) => w.nonfinite(),
            _ => self.first_nonfinite.clone(),
        }
    }

    /// Number of forward passes begun.
    pub fn forward_passes(&self) -> u32 {
        self.step.map_or(0, |s| s + 1)
    }

    /// Absolute position of the first token of the current forward pass.
    pub fn index_pos(&self) -> u32 {
        self.index_pos
    }

    /// Number of op records made.
    pub fn op_records(&self) -> u64 {
        self.next_seq
    }

    /// Marks the start of a forward pass over positions `index_pos .. index_pos + seq_len`, fed
    /// the token ids `ids` `[batch, seq_len]` (u32).
    ///
    /// # Errors
    /// Candle errors reading `ids`, sink errors.
    pub fn begin_forward(&mut self, phase: Phase, index_pos: usize, ids: &Tensor) -> Result<()> {
        let (batch, seq_len) = ids.dims2()?;
        let step = self.step.map_or(0, |s| s + 1);
        self.step = Some(step);
        self.skipped.clear();
        self.index_pos = index_pos as u32;
        self.seq_len = seq_len as u32;
        self.dump_pass = self.dump.covers(phase, index_pos as u32, seq_len as u32);
        if self.sink.is_none() {
            return Ok(());
        }
        let item = Item::Forward(Forward { step, phase, index_pos: index_pos as u32, seq_len: seq_len as u32, batch: batch as u32, ids: ids.flatten_all()?.to_vec1::<u32>()? });
        self.push(item)
    }

    /// Sets where each batch row's tokens are (absolute positions `first .. end`), for a batch of
    /// different requests padded to one length; empty: no padding. Per-token records then
    /// number each row's positions from its own first token and leave padding out, so a row
    /// aligns with the same request run alone (see [`crate::digest::Rows`]).
    pub fn set_rows(&mut self, windows: Vec<(u32, u32)>) {
        self.rows.windows = windows;
    }

    /// Marks the end of a forward pass (the file sink writes a frame).
    pub fn end_forward(&mut self) -> Result<()> {
        match &mut self.sink {
            Some(s) => s.call(|s| s.end_forward(), true),
            None => Ok(()),
        }
    }

    /// Records an encoder run's output embeddings (one vector per input text).
    pub fn embeddings(&mut self, vectors: Vec<Vec<f32>>) -> Result<()> {
        self.push(Item::Embeddings(vectors))
    }

    /// Ends the run: hands the footer to the sink (and waits for a summary worker to empty its
    /// queue).
    ///
    /// # Errors
    /// The sink's (I/O), or the first error a summary worker met.
    pub fn finish(&mut self, footer: &Footer) -> Result<()> {
        match &mut self.sink {
            Some(Out::Here(s)) => s.finish(footer),
            Some(out @ Out::Worker(_)) => out.then_recover(|w| w.finish(footer)),
            Some(Out::Failed(_, why)) => Err(failed(why)),
            None => Ok(()),
        }
    }

    fn push(&mut self, item: Item) -> Result<()> {
        match &mut self.sink {
            Some(s) => s.push(item),
            None => Ok(()),
        }
    }

    fn axis(&self, tok: Tok, t: &Tensor) -> Option<TokenAxis> {
        let last = self.index_pos + self.seq_len.saturating_sub(1);
        Some(match tok {
            Tok::Whole => return None,
            Tok::Seq(d) => TokenAxis { seq_dim: Some(d as u32), first_pos: self.index_pos, keep_from: 0, causal: false },
            Tok::Keys => TokenAxis { seq_dim: Some(t.rank().saturating_sub(2) as u32), first_pos: self.index_pos, keep_from: 0, causal: false },
            Tok::Causal => TokenAxis { seq_dim: Some(t.rank().saturating_sub(2) as u32), first_pos: self.index_pos, keep_from: 0, causal: true },
            Tok::Cache => TokenAxis { seq_dim: Some(2), first_pos: 0, keep_from: self.index_pos, causal: false },
            Tok::Last => TokenAxis { seq_dim: None, first_pos: last, keep_from: 0, causal: false },
        })
    }

    /// Runs `kernel` on `operands` ([`Kernel::run`]) and records the output: the one path every
    /// op of an instrumented model takes. `inputs` are the op's recorded inputs with how each is
    /// read per output position (the operands are the values the kernel computes on: recorded
    /// activations, possibly reshaped, and weights, masks, tables).
    ///
    /// # Errors
    /// Candle errors from the op or from summarising, sink errors (I/O), or a perturbation of a
    /// non-float tensor.
    pub fn run(&mut self, site: &Site, kernel: Kernel, operands: &[Operand], inputs: &[(&Node, Reads)], tok: Tok) -> Result<Node> {
        let y = kernel.run_as(operands, self.numerics)?;
        self.record(site, inputs, y, tok, Some(kernel), operands)
    }

    /// Records a tensor your own code computed, at module path `path` (op `probe`): for model
    /// code that is not rewritten op by op. `t` is any float or integer tensor whose token axis
    /// `tok` describes (e.g. `Tok::Seq(1)` for `[batch, seq, hidden]`); `inputs` are the
    /// recorded nodes it was computed from, with how it reads them per position
    /// ([`Reads::Same`] for a per-token op, [`Reads::Prefix`] for causal attention), so bisect
    /// can tell an op whose output differs while its inputs matched. Patches, captures,
    /// perturbations and `--dump` apply as to any op; a probe cannot be replayed (its kernel is
    /// not known).
    ///
    /// # Errors
    /// Candle errors summarising `t` (an unsupported dtype, a token axis past its rank); sink
    /// errors.
    ///
    /// # Example
    /// ```
    /// use candle_trace_instrument::tracer::{MemorySink, Node, Tok, Tracer};
    /// use candle_trace_format::record::{Phase, Reads};
    /// use candle_core::{Device, Tensor};
    /// let mut tr = Tracer::new(Box::new(MemorySink::default()));
    /// let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
    /// tr.begin_forward(Phase::Prefill, 0, &ids)?;
    /// let x = tr.probe("embed", Tensor::ones((1, 3, 4), candle_core::DType::F32, &Device::Cpu)?, &[], Tok::Seq(1))?;
    /// let y = tr.probe("layers.0.mlp", (x.t.clone() * 2.0)?, &[(&x, Reads::Same)], Tok::Seq(1))?;
    /// tr.end_forward()?;
    /// assert_eq!((x.seq, y.seq), (Some(0), Some(1)));
    /// # Ok::<(), candle_trace_format::Error>(())
    /// ```
    pub fn probe(&mut self, path: &str, t: Tensor, inputs: &[(&Node, Reads)], tok: Tok) -> Result<Node> {
        let site = Site::new(path, candle_trace_format::site::Op::Probe);
        self.record(&site, inputs, t, tok, None, &[])
    }

    /// Records a tensor another implementation computed (`trace import` of a reference run) as
    /// the output of `site`, with no inputs and no kernel: digests, statistics and (under
    /// `--dump`) values exactly as for an op this crate ran.
    ///
    /// # Errors
    /// Candle errors summarising `t` (an unsupported dtype, a token axis past its rank); sink
    /// errors.
    pub fn record_value(&mut self, site: &Site, t: Tensor, tok: Tok) -> Result<Node> {
        self.record(site, &[], t, tok, None, &[])
    }

    /// `--perturb`: flips the lowest mantissa bit of the selected element of this op's output,
    /// once per spec. Returns the output and whether it was changed.
    fn perturb(&mut self, site: &Site, axis: Option<&TokenAxis>, t: Tensor) -> Result<(Tensor, bool)> {
        let mut t = t;
        let mut perturbed = false;
        // (element flipped, the spec that flipped it): a second flip of one element undoes it.
        let mut flipped: Vec<(usize, String)> = Vec::new();
        for (p, done) in self.perturbs.iter_mut() {
            if *done || p.path != site.path {
                continue;
            }
            let idx = match axis {
                Some(axis) => perturb_index(&t, axis, p.pos, self.rows.window(0).0)?,
                None => p.pos.is_none().then_some(0),
            };
            // The element within the position's slice (a token id on the logits): the values after
            // the token axis (after the batch dim for a Last output), as `perturb_index` steps.
            let after = axis.and_then(|a| a.seq_dim).map_or(1, |d| d as usize + 1);
            let row_len: usize = t.dims().iter().skip(after).product();
            let idx = match (idx, p.element) {
                (Some(i), Some(e)) if (e as usize) < row_len && i + (e as usize) < t.elem_count() => {
                    masked_key(axis, &self.rows, p, e, row_len, &t, i + e as usize)?;
                    Some(i + e as usize)
                }
                (Some(_), Some(e)) => {
                    return Err(Error::usage(format!(
                        "--perturb {}: element {e} is past the {row_len} values ELEMENT indexes at a position (the op's last dims after the token axis; head 0's keys for attention)",
                        p.to_arg()
                    )))
                }
                (i, _) => i,
            };
            if let Some(idx) = idx {
                if let Some((_, first)) = flipped.iter().find(|f| f.0 == idx) {
                    return Err(Error::usage(format!("--perturb {}: flips the element --perturb {first} flips (the second flip would undo the first)", p.to_arg())));
                }
                flipped.push((idx, p.to_arg()));
                t = flip_lowest_bit(&t, idx)?;
                perturbed = true;
                *done = true;
            }
        }
        Ok((t, perturbed))
    }

    /// `--causal` re-runs only (no lookup per op otherwise): overwrites the patched slices of this
    /// op's output and keeps the captured ones. Returns the output and whether it was changed.
    fn patch_and_capture(&mut self, site: &Site, axis: Option<&TokenAxis>, t: Tensor) -> Result<(Tensor, bool)> {
        let mut t = t;
        let mut perturbed = false;
        if let Some(axis) = axis.filter(|_| !self.patches.is_empty() || !self.captures.is_empty()) {
            if let Some(list) = self.patches.get_mut(&site.path) {
                let mut i = 0;
                while i < list.len() {
                    match candle_trace_format::record::slice_ranges(t.dims(), axis, &self.rows, list[i].at.row as usize, list[i].at.pos) {
                        Some(ranges) => {
                            let p = list.swap_remove(i);
                            // Whole query rows (masked keys too), key by key where both hold it.
                            let whole = match &p.rows {
                                Some(r) => crate::patch::rows_to_write(t.dims(), axis, &self.rows, &p.at, r)?,
                                None => None,
                            };
                            let (ranges, values) = whole.unwrap_or((ranges, p.values.clone()));
                            t = crate::patch::write(&t, &ranges, &values).map_err(|e| Error::usage(format!("patch {}: {e}", p.at)))?;
                            perturbed = true;
                        }
                        None => i += 1,
                    }
                }
                if list.is_empty() {
                    self.patches.remove(&site.path);
                }
            }
            if let Some(keys) = self.captures.get(&site.path) {
                for k in keys {
                    if self.captured.contains_key(k) {
                        continue;
                    }
                    if let Some(ranges) = candle_trace_format::record::slice_ranges(t.dims(), axis, &self.rows, k.row as usize, k.pos) {
                        let values = crate::patch::read(&t, &ranges)?;
                        let rows = crate::patch::query_rows(t.dims(), axis, &self.rows, k.row as usize, k.pos).map(|q| crate::patch::read(&t, &q)).transpose()?;
                        self.captured.insert(k.clone(), Captured { values, rows });
                    }
                }
            }
        }
        Ok((t, perturbed))
    }

    /// The id of `site` in the trace's site table, declared on first use.
    fn site_id(&mut self, site: &Site) -> Result<u32> {
        Ok(match self.sites.get(&site.path) {
            Some(&id) => id,
            None => {
                let id = self.sites.len() as u32;
                self.sites.insert(site.path.clone(), id);
                self.push(Item::Site { id, path: site.path.clone(), op: site.op.as_str().to_string() })?;
                id
            }
        })
    }

    /// Records one op output and returns it as a [`Node`] (perturbed when armed for this op).
    fn record(&mut self, site: &Site, inputs: &[(&Node, Reads)], t: Tensor, tok: Tok, kernel: Option<Kernel>, operands: &[Operand]) -> Result<Node> {
        let axis = self.axis(tok, &t);
        let (t, perturbed) = self.perturb(site, axis.as_ref(), t)?;
        let (t, patched) = self.patch_and_capture(site, axis.as_ref(), t)?;
        let perturbed = perturbed || patched;
        let Some(_) = self.sink else {
            return Ok(Node::plain(t));
        };
        if !self.level.keeps(&site.path, site.op) {
            let seq = self.skipped.push(inputs);
            return Ok(Node { t, seq: Some(seq) });
        }
        let site_id = self.site_id(site)?;
        self.rows.keys_last = tok == Tok::Keys;
        let seq = self.next_seq;
        self.next_seq += 1;
        let dump = self.dump_pass && self.dump.matches(&site.path);
        // A dumped linear op's weight size, once per site, for comparing by value.
        if dump && matches!(kernel, Some(Kernel::Linear | Kernel::QMatMul)) && self.normed.insert(site_id) {
            if let Some(w) = operands.get(1).map(|o| crate::values::weight_norm(site_id, o)).transpose()?.flatten() {
                self.push(Item::WeightNorm(w))?;
            }
        }
        // A dumped op keeps every operand's value (once per trace): replayable from the trace.
        let operand_ids = if dump && self.dump.operands() { operands.iter().map(|o| self.dump_operand(o)).collect::<Result<Vec<u64>>>()? } else { Vec::new() };
        let step = self.step.unwrap_or(0);
        let fields = Fields { seq, step, site: site_id, inputs, skipped: &self.skipped, t: &t, axis: axis.as_ref(), kernel: kernel.as_ref(), operands: &operand_ids, perturbed };
        let rows = &self.rows;
        if let Some(out @ Out::Worker(_)) = &mut self.sink {
            if !dump && !self.stop_on_nonfinite && t.device().is_cpu() {
                let mut rec = OpRecord::default();
                fields.fill(&mut rec);
                let p = Pending { rec, t: t.clone(), axis, rows: rows.clone(), op: site.op };
                out.then_recover(|w| w.op(p))?;
                return Ok(Node { t, seq: Some(seq) });
            }
        }
        let mut nonfinite = false;
        let mut fill = |rec: &mut OpRecord| -> Result<()> {
            fields.fill(rec);
            nonfinite = summarize_into(rec, &t, axis.as_ref(), rows, site.op)?;
            Ok(())
        };
        let pushed = match &mut self.sink {
            Some(Out::Here(s)) => s.push_op(&mut fill),
            Some(out) => {
                let mut rec = OpRecord::default();
                fill(&mut rec).and_then(|()| out.push(Item::Op(rec)))
            }
            None => unreachable!("checked above: the tracer records"),
        };
        // Noted even when the push failed (a frame that could not be written): the output was
        // summarised.
        if nonfinite && self.first_nonfinite.is_none() {
            self.first_nonfinite = Some((site.path.clone(), step));
        }
        pushed?;
        let stop = self.stop_on_nonfinite && nonfinite;
        if dump {
            let d = crate::values::encode(seq, &t)?;
            self.push(Item::Dump(d))?;
        }
        if stop {
            self.end_forward()?;
            return Err(Error::StoppedOnNonFinite { seq });
        }
        Ok(Node { t, seq: Some(seq) })
    }
}

impl Tracer {
    /// The trace's id of an operand value, writing an [`Item::Operand`] the first time.
    fn dump_operand(&mut self, o: &Operand) -> Result<u64> {
        let key = match o {
            Operand::T(t) => OperandKey::Tensor(t.id()),
            Operand::Q(QMatMul::QTensor(q)) => OperandKey::Quantized(std::sync::Arc::as_ptr(q) as usize),
            Operand::Q(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => OperandKey::Tensor(t.id()),
        };
        if let Some(&id) = self.operand_ids.get(&key) {
            return Ok(id);
        }
        let id = self.operand_ids.len() as u64;
        self.operand_ids.insert(key, id);
        let value = crate::values::encode_operand(id, o)?;
        self.push(Item::Operand(value))?;
        Ok(id)
    }
}

/// What an op record holds but its summary, for [`Fields::fill`].
struct Fields<'a> {
    seq: u64,
    step: u32,
    site: u32,
    inputs: &'a [(&'a Node, Reads)],
    /// The ops the tracer's level skipped in this forward pass.
    skipped: &'a Skipped,
    t: &'a Tensor,
    axis: Option<&'a TokenAxis>,
    kernel: Option<&'a Kernel>,
    operands: &'a [u64],
    perturbed: bool,
}

impl Fields<'_> {
    /// Sets every field of `rec` but its summary ([`summarize_into`]): on a file sink `rec` is a
    /// record of a frame already written, overwritten in place ([`Sink::push_op`]), its lists
    /// cleared and refilled.
    fn fill(&self, rec: &mut OpRecord) {
        self.skipped.ancestors_into(self.inputs, &mut rec.inputs);
        rec.seq = self.seq;
        rec.step = self.step;
        rec.site = self.site;
        rec.dtype.clear();
        rec.dtype.push_str(self.t.dtype().as_str());
        rec.shape.clear();
        rec.shape.extend(self.t.dims().iter().map(|&d| d as u32));
        rec.axis = self.axis.cloned();
        rec.kernel = self.kernel.cloned();
        rec.operands.clear();
        rec.operands.extend_from_slice(self.operands);
        rec.perturbed = self.perturbed;
    }
}

/// Sets `rec`'s digest, statistics, samples and token entries to the summary of `t`, op `op`'s
/// output ([`summarize_op_into`], into the record's own lists); returns whether the output
/// holds a NaN or ±Inf that counts ([`candle_trace_compare::nonfinite::is_nonfinite`]).
///
/// # Errors
/// As [`summarize_op_into`].
fn summarize_into(rec: &mut OpRecord, t: &Tensor, axis: Option<&TokenAxis>, rows: &Rows, op: candle_trace_format::site::Op) -> Result<bool> {
    let mut summary = Summary { digest: 0, stats: Stats::default(), samples: std::mem::take(&mut rec.samples), tokens: std::mem::take(&mut rec.tokens) };
    let done = summarize_op_into(t, axis, rows, op, &mut summary);
    (rec.digest, rec.stats, rec.samples, rec.tokens) = (summary.digest, summary.stats, summary.samples, summary.tokens);
    done?;
    Ok(candle_trace_compare::nonfinite::is_nonfinite(Some(op), rec))
}

/// Identity of an operand value within one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum OperandKey {
    Tensor(candle_core::TensorId),
    Quantized(usize),
}

/// Logical index of the element to flip: row 0, first element of the slice at row 0's own
/// position `pos` (its first real token is at absolute position `row0`; 0 without padding), or
/// at the first position this output holds. `None` when the output does not hold `pos`.
fn perturb_index(t: &Tensor, axis: &TokenAxis, pos: Option<u32>, row0: u32) -> Result<Option<usize>> {
    let dims = t.dims();
    let pos = pos.map(|p| p.saturating_add(row0));
    match axis.seq_dim.map(|d| d as usize) {
        None => Ok(match pos {
            Some(p) if p != axis.first_pos => None,
            _ => Some(0),
        }),
        Some(d) => {
            let seq = dims[d] as u32;
            let first_new = axis.first_pos.max(axis.keep_from).max(row0);
            let end = axis.first_pos + seq;
            let p = pos.unwrap_or(first_new);
            if p < first_new || p >= end {
                return Ok(None);
            }
            let inner: usize = dims[d + 1..].iter().product();
            Ok(Some((p - axis.first_pos) as usize * inner))
        }
    }
}

/// Refuses `--perturb PATH@POS#ELEMENT` on a finite value at a key its position does not see (a
/// causal attention output's key past `POS`, or outside the row's window), flat element `idx` of
/// `t`: the per-token digest leaves masked keys out and the flipped value reaches nothing later
/// (a zero weight, or a score the mask replaces), so the traces would be identical (a fresh-user
/// trial's `softmax@1#2`). A masked -inf, which flips to NaN and spreads, is flipped.
///
/// # Errors
/// [`Error::Usage`] as above; candle errors reading the element.
fn masked_key(axis: Option<&TokenAxis>, rows: &candle_trace_format::record::Rows, p: &Perturb, e: u32, inner: usize, t: &Tensor, idx: usize) -> Result<()> {
    let (Some(axis), Some(pos)) = (axis.filter(|a| a.causal || rows.keys_last), p.pos) else { return Ok(()) };
    let window = rows.window(0);
    let (k0, k1) = candle_trace_format::record::key_span(axis, rows, window, pos.saturating_add(window.0), inner);
    if (k0..k1).contains(&(e as usize)) || !t.flatten_all()?.get(idx)?.to_dtype(DType::F64)?.to_scalar::<f64>()?.is_finite() {
        return Ok(());
    }
    Err(Error::usage(format!(
        "--perturb {}: key {e} is masked at position {pos} (it sees keys {k0} to {}): a trace leaves masked keys out, and a flipped finite value there changes nothing later",
        p.to_arg(),
        k1.saturating_sub(1)
    )))
}

/// Returns a copy of `t` with the lowest mantissa bit of logical element `idx` flipped.
fn flip_lowest_bit(t: &Tensor, idx: usize) -> Result<Tensor> {
    let flat = t.flatten_all()?;
    let out = match t.dtype() {
        DType::F32 => {
            let mut v = flat.to_vec1::<f32>()?;
            v[idx] = f32::from_bits(v[idx].to_bits() ^ 1);
            Tensor::from_vec(v, t.shape(), t.device())?
        }
        DType::F16 => {
            let mut v = flat.to_vec1::<half::f16>()?;
            v[idx] = half::f16::from_bits(v[idx].to_bits() ^ 1);
            Tensor::from_vec(v, t.shape(), t.device())?
        }
        DType::BF16 => {
            let mut v = flat.to_vec1::<half::bf16>()?;
            v[idx] = half::bf16::from_bits(v[idx].to_bits() ^ 1);
            Tensor::from_vec(v, t.shape(), t.device())?
        }
        other => return Err(Error::usage(format!("--perturb: cannot flip a mantissa bit of a {} tensor", other.as_str()))),
    };
    Ok(out)
}

/// Where a traced run's items go: into the sink on this thread, or through a summary worker.
enum Out {
    Here(Box<dyn Sink>),
    Worker(Worker),
    /// The worker ended on an error (in words) and gave its sink back: the stream has a gap
    /// from there, so the sink only ends forward passes (writing what came before the error).
    Failed(Box<dyn Sink>, String),
}

impl Out {
    fn push(&mut self, item: Item) -> Result<()> {
        match self {
            Out::Here(s) => s.push(item),
            Out::Worker(_) => self.then_recover(|w| w.push(item)),
            Out::Failed(_, why) => Err(failed(why)),
        }
    }

    /// Calls `f` on the sink, here or in order on the worker (see [`Worker::call`] for
    /// `after_error`).
    fn call(&mut self, f: impl FnOnce(&mut dyn Sink) -> Result<()> + Send + 'static, after_error: bool) -> Result<()> {
        match self {
            Out::Here(s) => f(s.as_mut()),
            Out::Worker(_) => self.then_recover(|w| w.call(f, after_error)),
            Out::Failed(s, _) if after_error => f(s.as_mut()),
            Out::Failed(_, why) => Err(failed(why)),
        }
    }

    /// Runs `f` on the worker (nothing when there is none); when it fails because the worker
    /// has ended on an error and given its sink back, [`Out::Failed`] from then on.
    fn then_recover(&mut self, f: impl FnOnce(&mut Worker) -> Result<()>) -> Result<()> {
        let Out::Worker(w) = self else { return Ok(()) };
        let done = f(w);
        if let Err(e) = &done {
            if let Some(sink) = w.take_sink() {
                *self = Out::Failed(sink, e.to_string());
            }
        }
        done
    }
}

/// The error of every call but ending a forward pass once the summary worker has failed.
fn failed(why: &str) -> Error {
    Error::Candle(candle_core::Error::Msg(format!("the summary worker stopped on an earlier error: {why}")))
}
