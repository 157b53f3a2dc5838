//! `trace redact`: a copy of a trace without what the user typed or the model wrote, for a public
//! bug report.
//!
//! Removed (unless kept with [`Keep`]): the prompt text and its token ids (header, and the ids of
//! every forward pass), the encoder input texts (each replaced by an empty string, so the batch
//! keeps its rows), the generated text (per decode-step choice and in the footer), the samples
//! of the token-id records (`input_ids`: their values are the ids), and dumped integer values
//! (token ids dumped as operands or outputs). Kept: every digest and reduction, so the copy
//! still bisects against the original op by op, and the generated token ids with their logits,
//! so bisect still names the first token that flipped.
//!
//! What redaction cannot remove: a digest of a token-id tensor is a hash of a few ids, and
//! someone holding the same model can recover them by hashing candidates. Redaction keeps the
//! text out of plain sight; it does not make the prompt secret from the model's owner.

use crate::format::Trace;
use crate::record::{Footer, Header, Item, Kernel};

/// What to keep that redaction would remove.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keep {
    /// Keep the prompt text, its token ids and the encoder texts.
    pub prompt: bool,
}

/// A redacted copy of a trace, and one line per kind of thing removed.
#[derive(Clone, Debug)]
pub struct Redacted {
    pub header: Header,
    pub items: Vec<Item>,
    pub footer: Option<Footer>,
    /// What was removed, e.g. "prompt text (31 characters)".
    pub removed: Vec<String>,
}

/// True when the trace holds its prompt (or encoder texts): false for a redacted trace.
pub fn holds_prompt(h: &Header) -> bool {
    !h.run.prompt.is_empty() || !h.run.prompt_tokens.is_empty() || h.run.texts.iter().any(|t| !t.is_empty())
}

/// Redacts `t` (see the module docs).
pub fn redact(t: &Trace, keep: &Keep) -> Redacted {
    let mut header = t.header.clone();
    let mut removed = Vec::new();
    // "what (n unit)", only when n > 0.
    let mut count = |what: &str, n: usize, unit: &str| {
        if n > 0 {
            removed.push(format!("{what} ({n} {unit})"));
        }
    };
    if !keep.prompt {
        count("prompt text", header.run.prompt.chars().count(), "characters");
        header.run.prompt.clear();
        count("prompt token ids", header.run.prompt_tokens.len(), "ids");
        header.run.prompt_tokens.clear();
        count("encoder input texts", header.run.texts.iter().filter(|x| !x.is_empty()).count(), "texts");
        for x in &mut header.run.texts {
            x.clear();
        }
    }
    let mut input_sites = std::collections::HashSet::new();
    let (mut ids, mut samples, mut choice_texts, mut values) = (0usize, 0usize, 0usize, 0usize);
    let mut items = Vec::with_capacity(t.items.len());
    for item in &t.items {
        let mut item = item.clone();
        match &mut item {
            Item::Site { id, op, .. } if op == "input" => {
                input_sites.insert(*id);
            }
            Item::Forward(f) if !keep.prompt => {
                ids += f.ids.len();
                f.ids.clear();
            }
            Item::Op(r) if !keep.prompt && (input_sites.contains(&r.site) || r.kernel == Some(Kernel::Input)) => {
                samples += r.samples.len() + r.tokens.len();
                r.samples.iter_mut().for_each(|s| *s = 0.0);
                r.tokens.iter_mut().for_each(|t| t.samples = [0.0; 4]);
            }
            Item::Token(e) => {
                for c in &mut e.rows {
                    choice_texts += usize::from(!c.text.is_empty());
                    c.text.clear();
                }
            }
            Item::Dump(d) if !keep.prompt && matches!(d.dtype.as_str(), "u32" | "i64") => {
                values += 1;
                d.data.iter_mut().for_each(|b| *b = 0);
            }
            Item::Operand(crate::record::OperandValue::Tensor(d)) if !keep.prompt && matches!(d.dtype.as_str(), "u32" | "i64") => {
                values += 1;
                d.data.iter_mut().for_each(|b| *b = 0);
            }
            Item::Counterpart(c) if !keep.prompt => {
                c.header.run.prompt.clear();
                c.header.run.prompt_tokens.clear();
                c.header.run.texts.iter_mut().for_each(String::clear);
            }
            _ => {}
        }
        items.push(item);
    }
    count("token ids of forward passes", ids, "ids");
    count("samples of token-id records", samples, "records and entries");
    count("generated token texts", choice_texts, "tokens");
    count("dumped token-id values, zeroed", values, "values");
    let footer = t.footer.clone().map(|mut f| {
        count("generated text", f.texts.iter().filter(|x| !x.is_empty()).count(), "rows");
        f.texts.iter_mut().for_each(String::clear);
        f
    });
    Redacted { header, items, footer, removed }
}

/// Writes a redacted trace to `out` with the reference writer (frames and value parts cut as
/// a recording cuts them). A source without a footer (a truncated run) gives a copy without one.
///
/// # Errors
/// [`crate::Error::Io`] when `out` cannot be written.
pub fn write(r: &Redacted, out: &std::path::Path) -> crate::Result<()> {
    let mut w = crate::format::TraceWriter::create(out, &r.header)?;
    for item in &r.items {
        w.push(item.clone())?;
    }
    match &r.footer {
        Some(f) => w.finish(f),
        None => w.flush(),
    }
}
