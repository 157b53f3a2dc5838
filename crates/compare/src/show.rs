//! `trace show`: the run, the environment, the generated text, the decode steps, and a per-layer
//! summary of one trace, as text or JSON.

pub use crate::bisect::cosine;
use crate::text::{clean, g};
use candle_trace_format::format::Trace;
use candle_trace_format::record::{Header, Item, TokenEvent};
use candle_trace_format::site::layer_group;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write;

/// One line of the per-layer summary.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSummary {
    /// `layers.{i}`, or a top-level module (`embed_tokens`, `norm`, `lm_head`).
    pub layer: String,
    /// Op records of the layer.
    pub op_records: u64,
    /// Largest |x| over the layer's outputs, the attention-mask ops' left out (their fill value,
    /// e.g. -3.40e38 for f32, stands for -inf: it is no activation).
    pub abs_max: f64,
    /// NaN and ±Inf values over its outputs (a mask's intended -inf not counted).
    pub nonfinite: u64,
    /// Outputs of attention-mask ops (`mask`, `mask_add`, `sliding_mask`) left out of `abs_max`.
    pub masks_left_out: u64,
    /// L2 norm of the layer's last recorded output (the residual stream after it).
    pub last_output_l2: f64,
}

/// The summary `show` prints.
#[derive(Clone, Debug, Serialize)]
pub struct ShowReport {
    /// The trace's file name, without directories.
    pub path: String,
    /// The file ended before its footer.
    pub truncated: bool,
    /// False for a redacted trace: no prompt text, prompt token ids or encoder texts.
    pub holds_prompt: bool,
    /// The run's header, as recorded.
    pub header: Header,
    /// How the writing binary was built (format 1.2; `None` in older traces).
    pub build: Option<candle_trace_format::record::BuildInfo>,
    /// What the run recorded (`--level`; format 2.3).
    pub level: candle_trace_format::site::Level,
    /// Op records in the trace.
    pub op_records: u64,
    /// Forward passes recorded.
    pub forward_passes: u64,
    /// Generated text per batch row: the footer's, or joined from the decode steps when it holds
    /// none.
    pub texts: Vec<String>,
    /// Why the run stopped ([`candle_trace_format::record::Footer::stop`]); `None` when truncated.
    pub stop: Option<String>,
    /// Every decode step's choices, in order.
    pub tokens: Vec<TokenEvent>,
    /// Per-layer summary, in order of first record (`input_ids` left out).
    pub layers: Vec<LayerSummary>,
    /// Every op site (module path, op) in order of first use.
    pub sites: Vec<(String, String)>,
    /// Encoder runs: the sentence embeddings, and their pairwise cosine similarities
    /// (`cosines[i][j]`, computed in f64).
    pub embeddings: Vec<Vec<f32>>,
    /// Pairwise cosine similarities of the first [`MAX_COSINE_ROWS`] embeddings.
    pub cosines: Vec<Vec<f64>>,
    /// Number of full values stored (`--dump`: op outputs and operands).
    pub dumps: u64,
    /// Their size uncompressed, in bytes.
    pub dump_bytes: u64,
    /// The first op output holding a NaN or ±Inf, if any.
    pub first_nonfinite: Option<crate::nonfinite::NonFinite>,
    /// Decode steps (and rows) where a token outside the candidate set ties a cut-off or lies
    /// within 1 ULP of it (greedy: of the top logit): the places this run is fragile.
    pub fragile: Vec<candle_trace_format::record::SamplingStep>,
    /// Sampling records in the trace (one per decode step and row; format 1.1).
    pub sampling_steps: usize,
    /// Rows holding the same request as an earlier row whose results differ from it.
    pub copies: Vec<crate::copies::CopyDisagreement>,
    /// Every sampling record (per decode step and row: candidate-set sizes after top-k and
    /// top-p, cut-offs, the draw, the chosen token and its rank; format 1.1).
    pub sampling: Vec<candle_trace_format::record::SamplingStep>,
    /// The text the model received: the prompt's token ids decoded with special tokens kept
    /// (the chat template's markers included). Set by `trace show --model`, which has the
    /// tokenizer; `None` otherwise.
    pub received: Option<String>,
    /// The run settings added in format 2.7 (the repeat penalty), as (key, JSON value) pairs.
    pub settings: candle_trace_format::record::Settings,
    /// How the repeat penalty changed each decode step's top logits, per row (format 2.7).
    pub penalty: Vec<candle_trace_format::record::PenaltyStep>,
}

/// Cosines of the first [`MAX_COSINE_ROWS`] embeddings with each other (a crafted trace may hold
/// 1024 long vectors: the full matrix would cost seconds).
fn cosine_matrix(v: &[Vec<f32>]) -> Vec<Vec<f64>> {
    let v = &v[..v.len().min(MAX_COSINE_ROWS)];
    v.iter().map(|a| v.iter().map(|b| cosine(a, b)).collect()).collect()
}

/// Embeddings whose cosines `show` computes.
pub const MAX_COSINE_ROWS: usize = 64;

/// Builds the summary of a trace.
pub fn summarize(t: &Trace) -> ShowReport {
    let mut acc = Summary { copies: Some(crate::copies::Copies::new(&t.header)), ..Summary::default() };
    t.items.iter().for_each(|item| acc.feed(item));
    let tail = candle_trace_format::format::Tail { footer: t.footer.clone(), truncated: t.truncated, sampling: t.sampling.clone(), build: t.build.clone(), level: t.level, extras: t.extras.clone() };
    acc.report(&t.path, &t.header, tail)
}

/// [`summarize`] of a trace file read a frame at a time: memory holds one frame and the summary
/// (sites, tokens, embeddings, one line a layer), whatever the trace's length.
///
/// # Errors
/// As [`candle_trace_format::format::read_trace`].
pub fn summarize_file(path: &std::path::Path) -> candle_trace_format::error::Result<ShowReport> {
    let mut reader = candle_trace_format::format::TraceReader::open(path)?;
    let mut acc = Summary { copies: Some(crate::copies::Copies::new(reader.header())), ..Summary::default() };
    while let Some(items) = reader.next_items()? {
        items.iter().for_each(|item| acc.feed(item));
    }
    let header = reader.header().clone();
    let tail = reader.finish()?;
    Ok(acc.report(path, &header, tail))
}

/// The summary being built, fed the items in file order.
#[derive(Default)]
struct Summary {
    sites: Vec<(String, String)>,
    order: Vec<String>,
    layers: HashMap<String, LayerSummary>,
    ops: u64,
    passes: u64,
    tokens: Vec<TokenEvent>,
    embeddings: Vec<Vec<f32>>,
    dumps: u64,
    dump_bytes: u64,
    nonfinite: crate::nonfinite::Scan,
    copies: Option<crate::copies::Copies>,
}

impl Summary {
    fn feed(&mut self, item: &Item) {
        self.nonfinite.feed(item);
        if let Some(c) = self.copies.as_mut() {
            c.feed(item);
        }
        match item {
            Item::Site { path, op, .. } => self.sites.push((path.clone(), op.clone())),
            Item::Forward(_) => self.passes += 1,
            Item::Token(e) => self.tokens.push(e.clone()),
            Item::Embeddings(v) => self.embeddings = v.clone(),
            Item::Dump(d) => {
                self.dumps += 1;
                self.dump_bytes += d.data.len() as u64;
            }
            Item::Operand(v) => {
                self.dumps += 1;
                self.dump_bytes += v.data().len() as u64;
            }
            Item::Counterpart(_) | Item::ValuePart(_) | Item::WeightNorm(_) => {}
            Item::Op(r) => {
                self.ops += 1;
                let (path, op) = self.sites.get(r.site as usize).map_or(("?", "?"), |(p, o)| (p.as_str(), o.as_str()));
                let key = layer_group(path);
                let kind = candle_trace_format::site::Op::parse(op);
                let nonfinite = crate::nonfinite::counted(kind, &r.stats);
                let mask = crate::nonfinite::is_mask(kind);
                let e = self.layers.entry(key.clone()).or_insert_with(|| {
                    self.order.push(key.clone());
                    LayerSummary { layer: key, op_records: 0, abs_max: 0.0, nonfinite: 0, masks_left_out: 0, last_output_l2: 0.0 }
                });
                e.op_records += 1;
                if mask {
                    e.masks_left_out += 1;
                } else {
                    e.abs_max = e.abs_max.max(r.stats.abs_max);
                }
                e.nonfinite += nonfinite;
                e.last_output_l2 = r.stats.l2;
            }
        }
    }

    fn report(mut self, path: &std::path::Path, header: &Header, t: candle_trace_format::format::Tail) -> ShowReport {
        let tokens = std::mem::take(&mut self.tokens);
        let texts = match &t.footer {
            Some(f) if f.texts.iter().any(|x| !x.is_empty()) || tokens.is_empty() => f.texts.clone(),
            _ => {
                let rows = tokens.first().map_or(0, |e: &TokenEvent| e.rows.len());
                (0..rows as u32).map(|r| tokens.iter().filter_map(|e| e.rows.iter().find(|c| c.row == r)).map(|c| c.text.as_str()).collect()).collect()
            }
        };
        let layers = std::mem::take(&mut self.order).into_iter().filter(|k| k != "input_ids").filter_map(|k| self.layers.remove(&k)).collect();
        ShowReport {
            // The file name only: a summary is pasted into public bug reports, paths carry user names.
            path: path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned()),
            truncated: t.truncated,
            holds_prompt: candle_trace_format::redact::holds_prompt(header),
            header: header.clone(),
            build: t.build,
            level: t.level,
            op_records: self.ops,
            forward_passes: self.passes,
            texts,
            stop: t.footer.as_ref().map(|f| f.stop.clone()),
            tokens,
            layers,
            cosines: cosine_matrix(&self.embeddings),
            first_nonfinite: self.nonfinite.found,
            fragile: t.sampling.iter().filter(|x| !x.boundary.is_empty()).cloned().collect(),
            sampling: t.sampling.clone(),
            received: None,
            settings: t.extras.settings.clone(),
            penalty: t.extras.penalty.clone(),
            sampling_steps: t.sampling.len(),
            copies: self.copies.take().map(crate::copies::Copies::finish).unwrap_or_default(),
            dumps: self.dumps,
            dump_bytes: self.dump_bytes,
            embeddings: self.embeddings,
            sites: self.sites,
        }
    }
}

/// At most `n` characters of `s`, with the count of the rest.
fn clip(s: &str, n: usize) -> String {
    let total = s.chars().count();
    if total <= n {
        format!("{s:?}")
    } else {
        format!("{:?}… ({} more characters)", s.chars().take(n).collect::<String>(), total - n)
    }
}

/// The op sites of a trace, one `path (op)` per line, for `--perturb`.
pub fn sites_text(s: &ShowReport) -> String {
    s.sites.iter().map(|(p, op)| format!("{} ({})\n", clean(p), clean(op))).collect()
}

/// A copy of the header with every string [`clean`]ed (through its JSON form: every field).
fn cleaned_header(h: &Header) -> Header {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::String(s) => *s = clean(s),
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            serde_json::Value::Object(m) => m.values_mut().for_each(walk),
            _ => {}
        }
    }
    let Ok(mut v) = serde_json::to_value(h) else { return h.clone() };
    walk(&mut v);
    serde_json::from_value(v).unwrap_or_else(|_| h.clone())
}

/// A copy of the summary whose strings from the trace are [`clean`]ed, for the text rendering.
fn cleaned(s: &ShowReport) -> ShowReport {
    let mut s = s.clone();
    s.header = cleaned_header(&s.header);
    s.stop = s.stop.as_deref().map(clean);
    for l in &mut s.layers {
        l.layer = clean(&l.layer);
    }
    for (p, op) in &mut s.sites {
        *p = clean(p);
        *op = clean(op);
    }
    for x in &mut s.fragile {
        x.mode = clean(&x.mode);
    }
    s
}

/// The run section's lines on what was altered and what was recorded: `--perturb`, `--level`,
/// `--dump`.
fn recording_text(o: &mut String, s: &ShowReport) {
    let run = &s.header.run;
    if let Some(p) = &run.perturb {
        let _ = writeln!(o, "  perturb      {p}");
    }
    if s.level != candle_trace_format::site::Level::Ops {
        let what = if s.level == candle_trace_format::site::Level::Layers { "each layer's output and the logits" } else { "the logits" };
        let _ = writeln!(o, "  level        {} ({what} recorded, not every op)", s.level.as_str());
    }
    if run.dump != "none" && !run.dump.is_empty() {
        let _ = writeln!(o, "  dump         {} ({} tensors stored in full, {:.1} MB uncompressed)", run.dump, s.dumps, s.dump_bytes as f64 / 1e6);
    }
}

/// The environment section: machine, build, numerics-relevant variables.
fn env_text(o: &mut String, s: &ShowReport) {
    let env = &s.header.env;
    let _ = writeln!(o, "\nenvironment");
    let _ = writeln!(o, "  candle-trace {}, candle {}, {}", env.crate_version, env.candle_version, env.rustc);
    let _ = writeln!(o, "  os           {} {}", env.os, env.arch);
    let _ = writeln!(o, "  cpu          {} [{}]", env.cpu, env.simd.join(" "));
    let _ = writeln!(o, "  device       {}, {}", env.device, crate::text::plural(env.threads, "thread"));
    let vars: Vec<String> = env.env_vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(o, "  env vars     {}", if vars.is_empty() { "(none that change numerics)".into() } else { vars.join(" ") });
    match &s.build {
        Some(b) => {
            let cpu = if b.target_cpu.is_empty() { String::new() } else { format!(", target-cpu {}", b.target_cpu) };
            let feats = if b.features.is_empty() { String::new() } else { format!(", features {}", b.features.join(",")) };
            let _ = writeln!(o, "  build        target features [{}]{}", clean(&b.target_features.join(" ")), clean(&format!("{cpu}{feats}")));
            let crates: Vec<String> = b.crates.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(o, "  crates       {}", clean(&crates.join(", ")));
        }
        None => {
            let _ = writeln!(o, "  build        not recorded (a trace older than format 1.2)");
        }
    }
}

/// The fragile steps section: sampled steps where a token outside the set ties a cut-off.
fn fragile_text(o: &mut String, s: &ShowReport) {
    sampling_text(o, s);
    if s.sampling_steps > 0 {
        if s.fragile.is_empty() {
            let _ = writeln!(o, "\nfragile steps: none (no token ties a cut-off or lies within 1 ULP of it, over {} sampling records)", s.sampling_steps);
        } else {
            let _ = writeln!(o, "\nfragile steps: a token outside the candidate set ties a cut-off or lies within 1 ULP of it ({} of {}):", s.fragile.len(), s.sampling_steps);
            for x in s.fragile.iter().take(32) {
                let toks: Vec<String> = x.boundary.iter().map(|(t, p, tie)| format!("{t} (p {p:e}{})", if *tie { ", exact tie" } else { ", 1 ULP" })).collect();
                let cut = match (x.k_cutoff, x.p_cutoff) {
                    (Some((p, l)), _) => format!("top-k cut-off p {p:e} (logit {l})"),
                    (None, Some((p, l))) => format!("top-p cut-off p {p:e} (logit {l})"),
                    _ => "top logit".to_string(),
                };
                let _ = writeln!(o, "  token {} row {} ({}): {cut}; chose {} (rank {}); outside: {}", x.index, x.row, x.mode, x.chosen, x.rank, toks.join(", "));
            }
        }
    }
}

/// Per decode step (row 0, the first 64): how the sampler chose (a greedy run: nothing).
fn sampling_text(o: &mut String, s: &ShowReport) {
    let steps: Vec<_> = s.sampling.iter().filter(|x| x.row == 0 && x.mode != "argmax").collect();
    if steps.is_empty() {
        return;
    }
    let _ = writeln!(o, "\nsampling (row 0): candidates after top-k / top-p of the vocabulary, mass of the set, draw, chosen token and its rank");
    for x in steps.iter().take(64) {
        let draw = x.draw.map_or_else(|| "-".to_string(), |d| format!("{d:.6}"));
        let cut = x.cutoff_token.map_or_else(String::new, |t| format!(", least likely kept {t}"));
        let _ = writeln!(o, "  {:>4} {:<18} {:>6} / {:<6} of {:<6} mass {:.6}  draw {draw}  chose {} (rank {}){cut}", x.index, x.mode, x.after_top_k, x.after_top_p, x.vocab, x.mass, x.chosen, x.rank);
    }
    if steps.len() > 64 {
        let _ = writeln!(o, "  … {} more steps (--format json lists every one)", steps.len() - 64);
    }
}

/// Plain-text rendering of [`summarize`].
pub fn text(s: &ShowReport) -> String {
    // The prompt is quoted with Rust's escapes (control characters included), from the raw
    // text: cleaning first would escape a newline into the same `\n` as a typed backslash-n.
    let raw_prompt = s.header.run.prompt.clone();
    let s = &cleaned(s);
    let run = &s.header.run;
    let mut o = String::new();
    let _ = writeln!(o, "trace: {}{}", s.path, if s.truncated { " (TRUNCATED: the run did not finish, or the file was cut; showing its complete frames)" } else { "" });
    let _ = writeln!(o, "\nrun");
    let m = &run.model;
    let _ = writeln!(o, "  model        {} ({} bytes, sha256 {}), {} {} layers, vocab {}, weights {}", m.name, m.size, m.sha256, m.architecture, m.n_layers, m.vocab_size, m.weights);
    let _ = writeln!(o, "  dtype        {}", run.dtype);
    prompt_text(&mut o, s, &raw_prompt);
    let sampling = match run.temperature {
        Some(t) if t >= 1e-7 => {
            let mut s = format!("temperature {t}");
            if let Some(k) = run.top_k {
                let _ = write!(s, ", top-k {k}");
            }
            if let Some(p) = run.top_p {
                let _ = write!(s, ", top-p {p}");
            }
            let _ = write!(s, ", seed {}", run.seed);
            s
        }
        _ => "greedy (argmax)".to_string(),
    };
    let penalty = crate::bisect::penalty_words(&s.settings);
    let sampling = if penalty.is_empty() { sampling } else { format!("{sampling}, {penalty}") };
    if run.pooling.is_empty() {
        let _ = writeln!(o, "  generation   max {} tokens, {sampling}", run.max_tokens);
        let chunk = if run.prefill_chunk == 0 { "whole prompt".to_string() } else { format!("{} tokens", run.prefill_chunk) };
        let _ = writeln!(o, "  knobs        prefill chunk {chunk}, batch {}, threads {}", run.batch, run.threads);
    } else {
        let _ = writeln!(o, "  knobs        batch {} (one row per text), threads {}", run.batch, run.threads);
    }
    recording_text(&mut o, s);
    env_text(&mut o, s);
    let _ =
        writeln!(o, "\noutput ({} forward passes, {} op records, {} tokens{})", s.forward_passes, s.op_records, s.tokens.len(), s.stop.as_ref().map(|x| format!(", stopped: {x}")).unwrap_or_default());
    let redacted = ids_redacted(s);
    for (r, t) in s.texts.iter().enumerate() {
        if redacted && t.is_empty() {
            let _ = writeln!(o, "  row {r}: (redacted: trace redact removed the generated text and token ids)");
        } else {
            let _ = writeln!(o, "  row {r}: {t:?}");
        }
    }
    for c in &s.copies {
        let _ = writeln!(o, "  {}", c.line());
    }
    tokens_text(&mut o, s);
    fragile_text(&mut o, s);
    let _ = writeln!(o, "\nfirst non-finite value: {}", crate::nonfinite::describe(s.first_nonfinite.as_ref()).text());
    if !s.cosines.is_empty() {
        let _ = writeln!(o, "\nembeddings: {} texts x {} dims; cosine similarity:", s.embeddings.len(), s.embeddings[0].len());
        for (i, row) in s.cosines.iter().enumerate().take(32) {
            let text = s.header.run.texts.get(i).map_or("", String::as_str);
            let row: Vec<String> = row.iter().take(32).map(|c| format!("{c:.6}")).collect();
            let _ = writeln!(o, "  [{i}] {}  {}", row.join(" "), clip(text, 60));
        }
    }
    let _ = writeln!(o, "\nper layer");
    let w = s.layers.iter().map(|l| l.layer.len()).max().unwrap_or(6).max(6);
    let _ = writeln!(o, "  {:<w$} {:>8} {:>12} {:>10} {:>14}", "module", "records", "max |x|", "non-finite", "last out L2");
    for l in &s.layers {
        let _ = writeln!(o, "  {:<w$} {:>8} {:>12} {:>10} {:>14}", l.layer, l.op_records, g(l.abs_max), l.nonfinite, g(l.last_output_l2));
    }
    let masks: u64 = s.layers.iter().map(|l| l.masks_left_out).sum();
    if masks > 0 {
        let _ = writeln!(
            o,
            "  max |x| leaves out the {masks} outputs of attention-mask ops (mask, mask_add): their fill value stands for -inf, it is no activation; non-finite counts their NaN and +Inf, not their intended -inf"
        );
    }
    o
}

/// Whether the decode steps' token ids were redacted (a recorded choice always holds its top-5).
fn ids_redacted(s: &ShowReport) -> bool {
    !s.tokens.is_empty() && s.tokens.iter().all(|e| e.rows.iter().all(|c| c.top.is_empty()))
}

/// The smallest top-1 margin and every decode step's choice (row 0); redacted ids and texts are
/// labelled so, not shown as token 0 and "".
fn tokens_text(o: &mut String, s: &ShowReport) {
    let redacted = ids_redacted(s);
    let text = |c: &candle_trace_format::record::Choice| if redacted { "redacted".to_string() } else { format!("{:?}", c.text) };
    if let Some(min) = s.tokens.iter().filter_map(|e| e.rows.iter().find(|c| c.row == 0)).min_by(|a, b| a.margin.total_cmp(&b.margin)) {
        let idx = s.tokens.iter().position(|e| e.rows.iter().find(|c| c.row == 0) == Some(min)).unwrap_or(0);
        let _ = writeln!(o, "  smallest top-1 margin: {} at generated token {idx} ({}){}", g(min.margin as f64), text(min), if min.tie { ", an exact tie" } else { "" });
    }
    if !s.tokens.is_empty() {
        let penalised = if s.penalty.is_empty() { "" } else { " after the repeat penalty, the logit before it in parentheses where it was penalised" };
        let _ = writeln!(o, "\ndecode steps (row 0): token, margin = top-1 minus top-2 logit, top-5 (id:logit){penalised}");
        for e in &s.tokens {
            let Some(c) = e.rows.iter().find(|c| c.row == 0) else { continue };
            let step = s.penalty.iter().find(|p| p.index == e.index && p.row == 0);
            let before = |id: u32, l: f32| step.and_then(|p| p.top.iter().find(|t| t.0 == id)).filter(|t| t.1.to_bits() != l.to_bits()).map_or(String::new(), |t| format!("({:.3})", t.1));
            let top: Vec<String> = if redacted { vec!["redacted".into()] } else { c.top.iter().map(|&(id, l)| format!("{id}:{l:.3}{}", before(id, l))).collect() };
            let _ = writeln!(
                o,
                "  {:>4} pos {:>5}  {:>6} {:<16} margin {:<8}{} [{}]",
                e.index,
                e.pos,
                if redacted { "?".to_string() } else { c.token.to_string() },
                text(c),
                g(c.margin as f64),
                if c.tie { " TIE" } else { "" },
                top.join(" ")
            );
        }
    }
}

/// The prompt (the raw text, quoted with escapes), the batch's prompts or the encoder's texts, and the prompt's ids.
fn prompt_text(o: &mut String, s: &ShowReport, raw_prompt: &str) {
    let run = &s.header.run;
    let m = &run.model;
    if !candle_trace_format::redact::holds_prompt(&s.header) {
        let _ = writeln!(o, "  prompt       not held: this trace was redacted (trace redact); its digests still compare");
    } else if run.texts.is_empty() {
        let _ = writeln!(o, "  prompt       {}{}", clip(raw_prompt, 300), if run.chat { " (as given; the chat template was applied)" } else { "" });
        match &s.received {
            Some(r) => {
                let _ = writeln!(o, "  received     {} (its {} token ids decoded, special tokens kept)", clip(r, 600), run.prompt_tokens.len());
            }
            None if run.chat => {
                let _ = writeln!(o, "  received     {} token ids; `trace show FILE --model MODEL` prints the text they decode to", run.prompt_tokens.len());
            }
            None => {}
        }
    } else if run.pooling.is_empty() {
        // A decoder batch of different requests: one prompt per row, left-padded.
        let _ = writeln!(o, "  prompts      {} rows, left-padded to the longest ({} token ids in all){}", run.texts.len(), run.prompt_tokens.len(), if run.chat { ", chat template" } else { "" });
        for (r, p) in run.texts.iter().enumerate().take(32) {
            let _ = writeln!(o, "    [{r}] {}", clip(p, 120));
        }
    } else {
        let _ = writeln!(o, "  texts        {} ({} token ids in all), pooling {}", run.texts.len(), run.prompt_tokens.len(), run.pooling);
        if !run.pooling.is_empty() {
            let upstream = m.config.iter().any(|(k, v)| k == "numerics" && v == "\"upstream\"");
            let _ = writeln!(
                o,
                "  numerics     {}",
                if upstream {
                    "upstream: candle-transformers' BertModel exactly (its f16/bf16 mask gives NaN: f32::MIN is -inf there)"
                } else {
                    "fixed mask: the dtype's own finite minimum (upstream's f32::MIN becomes -inf in f16/bf16)"
                }
            );
        }
    }
    if run.texts.is_empty() && candle_trace_format::redact::holds_prompt(&s.header) {
        let ids: Vec<String> = run.prompt_tokens.iter().take(48).map(u32::to_string).collect();
        let more = run.prompt_tokens.len().saturating_sub(48);
        let _ = writeln!(o, "  prompt ids   {} tokens: {}{}", run.prompt_tokens.len(), ids.join(" "), if more > 0 { format!(" … ({more} more)") } else { String::new() });
    }
}
