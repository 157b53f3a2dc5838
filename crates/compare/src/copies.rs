//! Copies of one request inside one trace (the same prompt or text in several batch rows) that
//! did not compute the same bits. A batch's rows are independent requests: two rows holding the
//! same one must agree bit for bit unless a kernel mixes rows (a reduction split across the
//! batch, an atomic, a row-dependent code path). Reported by `bisect` (for each trace) and
//! `show`.

use crate::untrusted::Untrusted;
use candle_trace_format::format::Trace;
use candle_trace_format::record::Item;
use serde::Serialize;
use std::collections::HashMap;

/// Two rows of one trace holding the same request whose results differ.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CopyDisagreement {
    /// The first row holding the request.
    pub row: u32,
    /// Another row holding it, compared with `row`.
    pub copy: u32,
    /// Op outputs (op, position) of the two rows whose digests differ.
    pub outputs_differ: u64,
    /// The first such output in execution order: its module path.
    pub path: Untrusted,
    /// And its token position (`None`: nothing per position differs).
    pub position: Option<u32>,
    /// The first generated-token index whose token differs between the two rows.
    pub first_token_differs: Option<u32>,
    /// The pooled embeddings (encoder runs) differ in some bit.
    pub embeddings_differ: bool,
}

impl CopyDisagreement {
    /// One line: "rows 0 and 3 hold the same request but differ: …".
    pub fn line(&self) -> String {
        let mut parts = Vec::new();
        if self.outputs_differ > 0 {
            let at = self.position.map(|p| format!(" @ {p}")).unwrap_or_default();
            parts.push(format!("{} op outputs differ, first {}{at}", self.outputs_differ, self.path.text()));
        }
        if let Some(k) = self.first_token_differs {
            parts.push(format!("generated token {k} differs"));
        }
        if self.embeddings_differ {
            parts.push("the embeddings differ".into());
        }
        format!("rows {} and {} hold the same request but differ: {}", self.row, self.copy, parts.join("; "))
    }
}

/// Each batch row's request identity: the texts (encoder runs, and decoder runs of several
/// prompts), or the prompt in every row, each as [`candle_trace_format::redact::request_key`]
/// (a hash, so a redacted trace's rows still pair with the original's). Bisect pairs rows by it.
pub fn row_keys(h: &candle_trace_format::record::Header) -> Vec<String> {
    let r = &h.run;
    let inputs: Vec<&str> = if r.texts.is_empty() { vec![r.prompt.as_str(); (r.batch as usize).clamp(1, candle_trace_format::limits::MAX_ROWS)] } else { r.texts.iter().map(String::as_str).collect() };
    inputs.into_iter().map(candle_trace_format::redact::request_key).collect()
}

/// Every row of `t` that holds the same request as an earlier row, compared with that first
/// row: op outputs by per-position digest, generated tokens, pooled embeddings. Only pairs
/// that differ are returned.
pub fn disagreements(t: &Trace) -> Vec<CopyDisagreement> {
    let mut c = Copies::new(&t.header);
    t.items.iter().for_each(|i| c.feed(i));
    c.finish()
}

/// [`disagreements`] fed one item at a time (a trace read a frame at a time).
pub struct Copies {
    /// Copy row → the first row holding its request.
    of: HashMap<u32, u32>,
    found: HashMap<u32, CopyDisagreement>,
    sites: HashMap<u32, String>,
}

impl Copies {
    /// The rows of a trace with header `h` to compare.
    pub fn new(h: &candle_trace_format::record::Header) -> Self {
        let keys = row_keys(h);
        let mut first: HashMap<&str, u32> = HashMap::new();
        let of = keys
            .iter()
            .enumerate()
            .filter_map(|(r, k)| {
                let f = *first.entry(k.as_str()).or_insert(r as u32);
                (f != r as u32).then_some((r as u32, f))
            })
            .collect();
        Copies { of, found: HashMap::new(), sites: HashMap::new() }
    }

    fn entry(&mut self, copy: u32) -> &mut CopyDisagreement {
        let row = self.of[&copy];
        self.found.entry(copy).or_insert_with(|| CopyDisagreement { row, copy, outputs_differ: 0, path: Untrusted::default(), position: None, first_token_differs: None, embeddings_differ: false })
    }

    /// Compares the copies in `item`.
    pub fn feed(&mut self, item: &Item) {
        if self.of.is_empty() {
            return;
        }
        match item {
            Item::Site { id, path, .. } => {
                self.sites.insert(*id, path.clone());
            }
            Item::Op(r) => {
                let at: HashMap<(u32, u32), u64> = r.tokens.iter().map(|s| ((s.row, s.pos), s.digest)).collect();
                for s in &r.tokens {
                    let Some(&first) = self.of.get(&s.row) else { continue };
                    if at.get(&(first, s.pos)).is_some_and(|d| *d != s.digest) {
                        let path: Untrusted = self.sites.get(&r.site).map_or("?", String::as_str).into();
                        let e = self.entry(s.row);
                        if e.outputs_differ == 0 {
                            (e.path, e.position) = (path, Some(s.pos));
                        }
                        e.outputs_differ += 1;
                    }
                }
            }
            Item::Token(ev) => {
                let by_row: HashMap<u32, u32> = ev.rows.iter().map(|c| (c.row, c.token)).collect();
                for c in &ev.rows {
                    if self.of.get(&c.row).is_some_and(|f| by_row.get(f).is_some_and(|t| *t != c.token)) {
                        self.entry(c.row).first_token_differs.get_or_insert(ev.index);
                    }
                }
            }
            Item::Embeddings(v) => {
                let pairs: Vec<(u32, u32)> = self.of.iter().map(|(&c, &r)| (c, r)).collect();
                for (copy, row) in pairs {
                    if let (Some(x), Some(y)) = (v.get(copy as usize), v.get(row as usize)) {
                        if x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits()) {
                            self.entry(copy).embeddings_differ = true;
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// The rows that differ from their request's first row, by row.
    pub fn finish(self) -> Vec<CopyDisagreement> {
        let mut out: Vec<CopyDisagreement> = self.found.into_values().collect();
        out.sort_by_key(|d| d.copy);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::{Header, OpRecord, TokenStat};

    fn stat(row: u32, pos: u32, digest: u64) -> TokenStat {
        TokenStat { row, pos, digest, sum: 0.0, abs_max: 0.0, nonfinite: 0, samples: [0.0; 4] }
    }

    /// A batch of three copies of one text whose row 2 differs from row 0 at one op and in its
    /// embedding; row 1 agrees. Another text in row 3 is not a copy.
    #[test]
    fn a_copy_that_differs_is_reported_with_where() {
        let mut header = Header::default();
        header.run.texts = vec!["x".into(), "x".into(), "x".into(), "y".into()];
        let rec = |seq: u64, site: u32, d2: u64| Item::Op(OpRecord { seq, site, tokens: vec![stat(0, 1, 7), stat(1, 1, 7), stat(2, 1, d2), stat(3, 1, 9)], ..Default::default() });
        let items = vec![
            Item::Site { id: 0, path: "layers.0.attention.self.query".into(), op: "linear".into() },
            Item::Site { id: 1, path: "layers.0.attention.self.softmax".into(), op: "softmax".into() },
            rec(0, 0, 7),
            rec(1, 1, 8),
            rec(2, 0, 8),
            Item::Embeddings(vec![vec![1.0, 2.0], vec![1.0, 2.0], vec![1.0, 2.5], vec![0.0, 0.0]]),
        ];
        let t = Trace { path: "t.trace".into(), header, items, footer: None, truncated: false, sampling: Vec::new(), build: None, level: Default::default(), extras: Default::default() };
        let d = disagreements(&t);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].row, d[0].copy, d[0].outputs_differ, d[0].position, d[0].embeddings_differ), (0, 2, 2, Some(1), true));
        assert_eq!(d[0].path.as_str(), "layers.0.attention.self.softmax");
        assert!(d[0].line().starts_with("rows 0 and 2 hold the same request but differ: 2 op outputs differ, first layers.0.attention.self.softmax @ 1"), "{}", d[0].line());
    }
}
