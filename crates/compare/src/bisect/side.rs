//! One trace as bisect reads it: its records indexed by (site, row, position), its forward
//! passes, dumps and rows, and the request each row holds.

use super::*;

/// One trace, indexed for alignment.
pub(super) struct Side<'a> {
    pub(super) trace: &'a Trace,
    /// Site id → (path, op).
    pub(super) sites: Vec<(&'a str, &'a str)>,
    pub(super) site_by_path: HashMap<&'a str, u32>,
    /// Op records in seq order (seq = index for a well-formed trace).
    pub(super) recs: Vec<&'a OpRecord>,
    pub(super) rec_by_seq: HashMap<u64, usize>,
    /// (site, row, pos) → (record index, token index): first occurrence.
    pub(super) at: HashMap<(u32, u32, u32), (usize, usize)>,
    pub(super) forwards: HashMap<u32, &'a Forward>,
    pub(super) tokens: Vec<&'a TokenEvent>,
    /// Output dumps by record seq (the dump whose shape is the record's).
    pub(super) dumps: HashMap<u64, Vec<&'a Dump>>,
    /// This trace's batch row → the row it is compared as (run a's row holding the same
    /// request); rows absent here are not compared. `None`: every row as itself.
    pub(super) rows: Option<HashMap<u32, u32>>,
    /// The inverse: compared row → this trace's own row.
    pub(super) own_rows: HashMap<u32, u32>,
    /// The pooled embeddings (encoder runs), one per own row.
    pub(super) embeddings: Option<&'a Vec<Vec<f32>>>,
    /// The batch holds padded rows (token-id records cover fewer positions than their shape).
    pub(super) padded: bool,
    /// Op records in the whole trace (the trace read may hold only those the report needs).
    pub(super) records: usize,
}

impl<'a> Side<'a> {
    pub(super) fn new(trace: &'a Trace, rows: Option<HashMap<u32, u32>>) -> Result<Self> {
        // Several own rows may hold one compared row's request: the first of them answers for it.
        let mut own_rows: HashMap<u32, u32> = HashMap::new();
        for (&own, &cmp) in rows.iter().flatten() {
            let e = own_rows.entry(cmp).or_insert(own);
            *e = (*e).min(own);
        }
        let mut s = Side {
            records: 0,
            rows,
            own_rows,
            embeddings: None,
            padded: false,
            trace,
            sites: Vec::new(),
            site_by_path: HashMap::new(),
            recs: Vec::new(),
            rec_by_seq: HashMap::new(),
            at: HashMap::new(),
            forwards: HashMap::new(),
            tokens: Vec::new(),
            dumps: HashMap::new(),
        };
        for item in &trace.items {
            match item {
                Item::Site { id, path, op } => {
                    if *id as usize != s.sites.len() {
                        return Err(Error::trace(&trace.path, format!("site ids out of order at site {id}")));
                    }
                    s.sites.push((path, op));
                    s.site_by_path.insert(path, *id);
                }
                Item::Forward(f) => {
                    s.forwards.insert(f.step, f);
                }
                Item::Op(r) => {
                    if r.site as usize >= s.sites.len() {
                        return Err(Error::trace(&trace.path, format!("record {} names unknown site {}", r.seq, r.site)));
                    }
                    let ri = s.recs.len();
                    s.rec_by_seq.insert(r.seq, ri);
                    if r.kernel == Some(candle_trace_format::record::Kernel::Input) && candle_trace_format::limits::elements(&r.shape) != Some(r.tokens.len() as u64) && r.shape.len() == 2 {
                        s.padded = true;
                    }
                    for (ti, t) in r.tokens.iter().enumerate() {
                        let Some(row) = s.compared_row(t.row) else { continue };
                        s.at.entry((r.site, row, t.pos)).or_insert((ri, ti));
                    }
                    s.recs.push(r);
                }
                Item::Token(t) => s.tokens.push(t),
                Item::Embeddings(v) => s.embeddings = Some(v),
                Item::Dump(d) => s.dumps.entry(d.seq).or_default().push(d),
                Item::Operand(_) | Item::Counterpart(_) | Item::ValuePart(_) | Item::WeightNorm(_) => {}
            }
        }
        s.records = s.recs.len();
        Ok(s)
    }

    /// The row own row `r` is compared as (`None`: not compared).
    pub(super) fn compared_row(&self, r: u32) -> Option<u32> {
        match &self.rows {
            None => Some(r),
            Some(m) => m.get(&r).copied(),
        }
    }

    /// This trace's own row for compared row `r`.
    pub(super) fn own_row(&self, r: u32) -> u32 {
        match &self.rows {
            None => r,
            Some(_) => self.own_rows.get(&r).copied().unwrap_or(u32::MAX),
        }
    }

    pub(super) fn path(&self, site: u32) -> &'a str {
        self.sites[site as usize].0
    }

    pub(super) fn token(&self, site: u32, row: u32, pos: u32) -> Option<(&'a OpRecord, &'a TokenStat)> {
        self.at.get(&(site, row, pos)).map(|&(ri, ti)| (self.recs[ri], &self.recs[ri].tokens[ti]))
    }

    /// The (row, pos) slice of record `r`'s dumped output, decoded (unpadded traces only: a
    /// padded row's positions are its own, not the tensor's).
    pub(super) fn slice(&self, r: &OpRecord, row: u32, pos: u32) -> Option<(candle_trace_format::dump::Values, Vec<usize>)> {
        if self.padded {
            return None;
        }
        let row = self.own_row(row);
        let shape: Vec<u32> = r.shape.clone();
        let d = self.dumps.get(&r.seq)?.iter().find(|d| d.shape == shape)?;
        let v = candle_trace_format::dump::decode(d).ok()?;
        let dims: Vec<usize> = shape.iter().map(|&x| x as usize).collect();
        let idx: Vec<usize> = match &r.axis {
            Some(axis) => candle_trace_format::record::token_slice(&dims, axis, row, pos)?.into_iter().flatten().collect(),
            None => (0..v.f64.len()).collect(),
        };
        Some((v, idx))
    }

    /// Positions of the prompt: the positions the prefill passes covered.
    pub(super) fn prompt_len(&self) -> u32 {
        self.forwards.values().filter(|f| f.phase == candle_trace_format::record::Phase::Prefill).map(|f| f.index_pos.saturating_add(f.seq_len)).max().unwrap_or(0)
    }

    pub(super) fn record(&self, seq: u64) -> Option<&'a OpRecord> {
        self.rec_by_seq.get(&seq).map(|&i| self.recs[i])
    }

    /// Record `seq`'s entry at (compared row, pos).
    pub(super) fn entry(&self, seq: u64, row: u32, pos: u32) -> Option<(&'a OpRecord, &'a TokenStat)> {
        let r = self.record(seq)?;
        r.tokens.iter().find(|t| t.pos == pos && self.compared_row(t.row) == Some(row)).map(|t| (r, t))
    }

    pub(super) fn execution(&self, step: u32) -> String {
        match self.forwards.get(&step) {
            Some(f) => format!(
                "step {} ({:?}, positions {}..{}, batch {}, {} tokens)",
                f.step,
                f.phase,
                f.index_pos,
                u64::from(f.index_pos) + u64::from(f.seq_len),
                f.batch,
                u64::from(f.seq_len) * u64::from(f.batch)
            )
            // The step's token count, not the op's M: an op may see fewer rows (lm_head the
            // last position of each row), and its shape is printed beside this.
            .replace(", 1 tokens)", ", 1 token)")
            .replace("Prefill", "prefill")
            .replace("Decode", "decode"),
            None => format!("step {step}"),
        }
    }
}

pub(super) fn entry_view(side: &Side, r: &OpRecord, t: &TokenStat) -> EntryView {
    EntryView {
        seq: r.seq,
        step: r.step,
        execution: side.execution(r.step).into(),
        dtype: r.dtype.as_str().into(),
        shape: r.shape.clone(),
        sum: t.sum,
        abs_max: t.abs_max,
        nonfinite: t.nonfinite,
        samples: t.samples,
    }
}

/// Each batch row's request: the texts (encoder runs, and decoder runs of several prompts), or
/// the prompt in every row.
pub(super) fn row_inputs(h: &Header) -> Vec<String> {
    if h.run.texts.is_empty() {
        vec![h.run.prompt.clone(); (h.run.batch as usize).clamp(1, candle_trace_format::limits::MAX_ROWS)]
    } else {
        h.run.texts.clone()
    }
}

/// Each batch row's request identity ([`candle_trace_format::redact::request_key`]: a hash, so a redacted
/// trace's rows still pair with the original's).
pub(super) fn row_keys(h: &Header) -> Vec<String> {
    crate::copies::row_keys(h)
}

/// What a report says of one trace.
pub(super) fn side_info(s: &Side) -> SideInfo {
    SideInfo {
        // The file name only: reports are pasted into public bug reports, paths carry user names.
        path: s.trace.path.file_name().map_or_else(|| s.trace.path.display().to_string(), |n| n.to_string_lossy().into_owned()).into(),
        truncated: s.trace.truncated,
        op_records: s.records,
        tokens: s.tokens.len(),
        text: s.tokens.iter().filter_map(|t| t.rows.iter().find(|c| c.row == 0)).map(|c| c.text.as_str()).collect::<String>().into(),
    }
}
