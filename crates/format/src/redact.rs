//! `trace redact`: a copy of a trace without what the user typed or the model wrote, for a public
//! bug report.
//!
//! Removed (unless kept with [`Keep`]): the prompt text and its token ids (header, and the ids of
//! every forward pass), the encoder input texts and a batch's prompts (each replaced by
//! `redacted:` and a 64-bit hash of it, so rows still pair with the same request in another
//! trace), the generated text and the generated token ids (per decode-step choice, its top-5
//! and sampling record, and in the footer), the samples of the token-id records (`input_ids`:
//! their values are the ids), and dumped values (`--dump` outputs and operands: float values of
//! the first layers tell their tokens; a repro's operands are kept, as replaying it needs them,
//! with dumped token ids zeroed). Kept: every digest and reduction, so the copy still bisects against the original
//! op by op (generated tokens are then compared through the `input_ids` digests of the steps
//! that read them), and the logits' margins.
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
    /// Keep dumped float values (`--dump` outputs and operands). Without it, and without
    /// `prompt`, they are removed: an embedding row, or any value of the first layers, tells
    /// its token to anyone with the model. A repro trace (`trace extract`: it holds the other
    /// run's record) keeps its operands whatever this says, as replaying it needs them.
    pub values: bool,
}

/// A redacted copy of a trace, and one line per kind of thing removed.
#[derive(Clone, Debug)]
pub struct Redacted {
    /// The header: prompt and texts replaced by their hashes, prompt token ids removed (unless
    /// kept).
    pub header: Header,
    /// The items, redacted (see the module docs).
    pub items: Vec<Item>,
    /// The footer with the generated texts emptied; `None` when the source is truncated.
    pub footer: Option<Footer>,
    /// The sampling records, with `chosen` zeroed and `boundary` emptied.
    pub sampling: Vec<crate::record::SamplingStep>,
    /// The original's build fingerprint (nothing in it identifies a person).
    pub build: Option<crate::record::BuildInfo>,
    /// The original's level.
    pub level: crate::site::Level,
    /// The original's settings, and its repeat-penalty records with their top tokens cleared.
    pub extras: crate::record::Extras,
    /// What was removed, e.g. "prompt text (31 characters)".
    pub removed: Vec<String>,
    /// Dumped float values kept though the prompt was not (a repro's operands, or
    /// [`Keep::values`]): the caller says they can reveal the prompt.
    pub values_kept: usize,
}

/// What stands in a redacted header for a prompt or text: this prefix and its hash.
pub const REDACTED: &str = "redacted:";

/// The stand-in for a redacted request: [`REDACTED`] and the xxh3-64 of its text, in hex.
pub fn request_hash(text: &str) -> String {
    format!("{REDACTED}{:016x}", crate::hash::xxh3_64(text.as_bytes()))
}

/// A request's identity for pairing rows across traces: its hash, from the text or from a
/// redacted stand-in ([`request_hash`]).
pub fn request_key(text: &str) -> String {
    if text.starts_with(REDACTED) {
        text.to_string()
    } else {
        request_hash(text)
    }
}

fn held(t: &str) -> bool {
    !t.is_empty() && !t.starts_with(REDACTED)
}

/// True when `h` is a redacted trace's header: its prompt or a text is a [`REDACTED`] stand-in
/// (a trace recorded with no prompt, such as an import, is not).
pub fn is_redacted(h: &Header) -> bool {
    h.run.prompt.starts_with(REDACTED) || h.run.texts.iter().any(|t| t.starts_with(REDACTED))
}

/// True when the trace holds its prompt (or encoder texts): false for a redacted trace.
pub fn holds_prompt(h: &Header) -> bool {
    held(&h.run.prompt) || !h.run.prompt_tokens.is_empty() || h.run.texts.iter().any(|t| held(t))
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
        // A trace redacted before keeps its stand-ins (and says it removed nothing more).
        if !header.run.prompt.starts_with(REDACTED) {
            count("prompt text", header.run.prompt.chars().count(), "characters");
            header.run.prompt = request_hash(&header.run.prompt);
        }
        count("prompt token ids", header.run.prompt_tokens.len(), "ids");
        header.run.prompt_tokens.clear();
        count("texts of the batch's requests", header.run.texts.iter().filter(|x| held(x)).count(), "texts");
        for x in header.run.texts.iter_mut().filter(|x| !x.starts_with(REDACTED)) {
            *x = request_hash(x);
        }
    }
    let mut input_sites = std::collections::HashSet::new();
    let mut n = Cleared::default();
    let mut items = Vec::with_capacity(t.items.len());
    for item in &t.items {
        let mut item = item.clone();
        redact_item(&mut item, keep, &mut input_sites, &mut n);
        items.push(item);
    }
    // Float values tell their tokens (an embedding row is its token's): removed unless kept,
    // or replay needs them (a repro's operands).
    let is_value = |i: &Item| matches!(i, Item::Dump(_) | Item::Operand(_) | Item::ValuePart(_));
    let repro = items.iter().any(|i| matches!(i, Item::Counterpart(_)));
    let mut values_kept = 0;
    if !keep.prompt {
        if keep.values || repro {
            values_kept = items.iter().filter(|i| is_value(i)).count() + items.iter().map(|i| if let Item::Counterpart(c) = i { c.operands.len() } else { 0 }).sum::<usize>();
        } else {
            let before = items.len();
            items.retain(|i| !is_value(i));
            count("dumped values", before - items.len(), "values");
            // The token-id values zeroed went with them.
            n.values = 0;
        }
    }
    let Cleared { ids, samples, choice_texts, values } = n;
    count("token ids of forward passes", ids, "ids");
    count("samples of token-id records", samples, "records and entries");
    count("generated tokens, text and ids", choice_texts, "tokens");
    count("dumped token-id values, zeroed", values, "values");
    let footer = t.footer.clone().map(|mut f| {
        count("generated text", f.texts.iter().filter(|x| !x.is_empty()).count(), "rows");
        f.texts.iter_mut().for_each(String::clear);
        f
    });
    let sampling = t
        .sampling
        .iter()
        .cloned()
        .map(|mut x| {
            x.chosen = 0;
            x.boundary.clear();
            x
        })
        .collect();
    // The penalised top tokens spell the text as the choices' top-5 do: cleared alike.
    let mut extras = t.extras.clone();
    count("top tokens of the repeat penalty's steps", extras.penalty.iter().filter(|x| !x.top.is_empty()).count(), "steps");
    extras.penalty.iter_mut().for_each(|x| x.top.clear());
    Redacted { header, items, footer, removed, sampling, build: t.build.clone(), level: t.level, extras, values_kept }
}

/// What [`redact_item`] cleared, counted for [`Redacted::removed`].
#[derive(Default)]
struct Cleared {
    ids: usize,
    samples: usize,
    choice_texts: usize,
    values: usize,
}

/// Clears what `item` holds of the prompt and the generated text (see the module docs), noting
/// the sites of `input` ops as they are declared.
fn redact_item(item: &mut Item, keep: &Keep, input_sites: &mut std::collections::HashSet<u32>, n: &mut Cleared) {
    match item {
        Item::Site { id, op, .. } if crate::site::Op::parse(op) == Some(crate::site::Op::Input) => {
            input_sites.insert(*id);
        }
        Item::Forward(f) if !keep.prompt => {
            n.ids += f.ids.len();
            f.ids.clear();
        }
        Item::Op(r) if !keep.prompt && (input_sites.contains(&r.site) || r.kernel == Some(Kernel::Input)) => {
            // Counted only where something is left to clear: a redacted trace redacts to itself.
            n.samples += r.samples.iter().filter(|s| **s != 0.0).count() + r.tokens.iter().filter(|t| t.samples.iter().any(|s| *s != 0.0)).count();
            r.samples.iter_mut().for_each(|s| *s = 0.0);
            r.tokens.iter_mut().for_each(|t| t.samples = [0.0; 4]);
        }
        Item::Token(e) => {
            for c in &mut e.rows {
                n.choice_texts += usize::from(!c.text.is_empty());
                c.text.clear();
                // The ids spell the text for anyone holding the tokenizer.
                c.token = 0;
                c.top.clear();
            }
        }
        Item::Dump(d) if !keep.prompt && matches!(d.dtype.as_str(), "u32" | "i64") => {
            n.values += usize::from(d.data.iter().any(|b| *b != 0));
            d.data.iter_mut().for_each(|b| *b = 0);
        }
        Item::Operand(crate::record::OperandValue::Tensor(d)) if !keep.prompt && matches!(d.dtype.as_str(), "u32" | "i64") => {
            n.values += usize::from(d.data.iter().any(|b| *b != 0));
            d.data.iter_mut().for_each(|b| *b = 0);
        }
        Item::Counterpart(c) if !keep.prompt => {
            c.header.run.prompt = request_hash(&c.header.run.prompt);
            c.header.run.prompt_tokens.clear();
            c.header.run.texts.iter_mut().for_each(|x| *x = request_hash(x));
        }
        _ => {}
    }
}

/// Writes a redacted trace to `out` with the reference writer (frames and value parts cut as
/// a recording cuts them). A source without a footer (a truncated run) gives a copy without one.
///
/// # Errors
/// [`crate::Error::Io`] when `out` cannot be written.
pub fn write(r: &Redacted, out: &std::path::Path) -> crate::Result<()> {
    let mut w = crate::format::TraceWriter::create(out, &r.header, r.build.as_ref())?;
    w.level(r.level)?;
    w.settings(&r.extras.settings)?;
    for item in &r.items {
        if let Item::Token(e) = item {
            // A recording writes a step's penalty frame, then its sampling frame, then the Token.
            w.penalty(&r.extras.penalty.iter().filter(|x| x.index == e.index).cloned().collect::<Vec<_>>())?;
            // A step's sampling records go before its Token item, as a recording writes them.
            let steps: Vec<crate::record::SamplingStep> = r.sampling.iter().filter(|x| x.index == e.index).cloned().collect();
            if !steps.is_empty() {
                w.sampling(&steps)?;
            }
        }
        w.push(item.clone())?;
    }
    match &r.footer {
        Some(f) => w.finish(f),
        None => w.close(),
    }
}
