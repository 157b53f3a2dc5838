//! Two runs whose prompts differ in length but whose fed sequences agree: run b's prompt is run
//! a's prompt followed by tokens a generated (or the other way round). The classic "KV-cache
//! decoding vs recomputing the whole sequence" comparison: a computed those positions one decode
//! step at a time (M=1, keys from its cache), b all in one prefill pass. Nothing differs in the
//! inputs; the positions are compared as themselves and the generated tokens by the position
//! they occupy, not by their index.
//!
//! The fed sequence of a run is its prompt's token ids followed by the tokens it generated, each
//! at the position it occupies (row 0; `--batch N` repeats the prompt).

use super::*;

/// How the fed sequences of two single-prompt runs relate.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Fed {
    /// Same prompt ids (or a side without them): compared as usual.
    Same,
    /// Different prompts that agree through the positions both hold: the shorter prompt's run
    /// generated the tokens the longer prompt holds. `skip`: that run's first `skip` generated
    /// tokens are the other's prompt (compared as inputs, not as choices).
    Continues { shorter_is_a: bool, from: u32, to: u32, skip: usize },
    /// The fed ids differ at `position`, a prompt token on at least one side.
    Differ { position: u32, explanation: String },
}

/// The fed ids of run `t` (row 0): prompt ids, then generated tokens, in position order.
fn fed_ids(t: &Trace) -> Vec<u32> {
    let mut ids = t.header.run.prompt_tokens.clone();
    for e in t.items.iter().filter_map(|i| if let Item::Token(e) = i { Some(e) } else { None }) {
        if e.pos as usize == ids.len() {
            if let Some(c) = e.rows.iter().find(|c| c.row == 0) {
                ids.push(c.token);
            }
        }
    }
    ids
}

/// How `a`'s and `b`'s fed sequences relate (see [`Fed`]); [`Fed::Same`] for batches of
/// different requests (rows are paired by request there) or when a trace holds no prompt ids.
pub(super) fn fed(a: &Trace, b: &Trace) -> Fed {
    let (pa, pb) = (&a.header.run.prompt_tokens, &b.header.run.prompt_tokens);
    if pa == pb || !a.header.run.texts.is_empty() || !b.header.run.texts.is_empty() || pa.is_empty() || pb.is_empty() {
        return Fed::Same;
    }
    let (fa, fb) = (fed_ids(a), fed_ids(b));
    let (short, long) = (pa.len().min(pb.len()), pa.len().max(pb.len()));
    match fa.iter().zip(&fb).position(|(x, y)| x != y) {
        Some(k) if k < short => Fed::Differ {
            position: k as u32,
            explanation: format!("the prompts differ ({} vs {} tokens, first difference at position {k}): the runs had different inputs, so no op is to blame", pa.len(), pb.len()),
        },
        Some(k) if k < long => {
            let (gen, fed) = if pa.len() < pb.len() { ("a", "b") } else { ("b", "a") };
            Fed::Differ {
                position: k as u32,
                explanation: format!(
                    "the prompts differ ({} vs {} tokens): {fed}'s prompt holds token {} at position {k} where {gen} generated {}, so it does not continue {gen}'s output; the runs had different inputs, so no op is to blame",
                    pa.len(),
                    pb.len(),
                    if fed == "b" { fb[k] } else { fa[k] },
                    if gen == "a" { fa[k] } else { fb[k] }
                ),
            }
        }
        // Agree through the longer prompt (a later difference is a generated token flipping).
        _ if fa.len().min(fb.len()) >= long => Fed::Continues { shorter_is_a: pa.len() < pb.len(), from: short as u32, to: long as u32, skip: long - short },
        // The shorter run did not generate as far as the longer prompt reaches: compare what is there.
        _ => Fed::Continues { shorter_is_a: pa.len() < pb.len(), from: short as u32, to: fa.len().min(fb.len()) as u32, skip: fa.len().min(fb.len()) - short },
    }
}

/// [`fed`] for traces that hold no token ids (redacted): from the prompt lengths of their
/// prefill passes and the first position whose input-id digests differ (`al`).
fn fed_by_digests(sa: &Side, sb: &Side, al: &Alignment) -> Fed {
    let (la, lb) = (sa.prompt_len(), sb.prompt_len());
    if !sa.trace.header.run.texts.is_empty() || !sb.trace.header.run.texts.is_empty() {
        return Fed::Same;
    }
    let (short, long) = (la.min(lb), la.max(lb));
    // Input ids that differ where either run was given its prompt: different inputs (a later
    // difference is a generated token, fed back, that flipped).
    if let Some(k) = al.input_differs.filter(|f| f.pos < long) {
        let lengths = if la == lb { format!("both {la} tokens") } else { format!("{la} vs {lb} tokens") };
        let (gen, fed) = if la < lb { ("a", "b") } else { ("b", "a") };
        let whose = if k.pos < short { String::new() } else { format!(", a token of {fed}'s prompt where {gen} had generated one: {fed}'s prompt does not continue {gen}'s output there") };
        return Fed::Differ {
            position: k.pos,
            explanation: format!("the prompts differ ({lengths}; their input-id digests first differ at position {}{whose}): the runs had different inputs, so no op is to blame", k.pos),
        };
    }
    if la == lb {
        return Fed::Same;
    }
    let generated = if la < lb { sa.tokens.len() } else { sb.tokens.len() } as u32;
    let to = long.min(short + generated);
    Fed::Continues { shorter_is_a: la < lb, from: short, to, skip: (to - short) as usize }
}

/// For a continuation ([`fed`] of the sides' traces, or [`fed_by_digests`] when a trace holds
/// no prompt): its positions ([`positions`]), the note saying how it was compared, and the
/// shorter prompt's side without the generated tokens the other took as prompt, so the sides'
/// tokens pair by position. When the fed ids differ, neither side's generated tokens are
/// compared (they answer different inputs). Returns the relation and the positions (empty
/// unless a continuation).
pub(super) fn align_sides<'t>(both_hold: bool, (sa, sb): (&mut Side<'t>, &mut Side<'t>), al: &Alignment, notes: &mut Vec<String>) -> (Fed, Vec<PositionCompare>) {
    let f = if both_hold { fed(sa.trace, sb.trace) } else { fed_by_digests(sa, sb, al) };
    if let Fed::Differ { position, .. } = &f {
        if !sa.tokens.is_empty() && !sb.tokens.is_empty() {
            notes.push(format!("generated tokens not compared: the sequences fed differ at position {position}, so the runs' tokens answer different inputs"));
        }
        (sa.tokens, sb.tokens) = (Vec::new(), Vec::new());
    }
    let Fed::Continues { shorter_is_a, skip, .. } = &f else { return (f, Vec::new()) };
    let ps = positions(&f, sa, sb, &heat(al, 0));
    let s = if *shorter_is_a { sa } else { sb };
    s.tokens.drain(..(*skip).min(s.tokens.len()));
    notes.extend(continuation_note(&f));
    (f, ps)
}

/// The note that says how a continuation was compared.
pub(super) fn continuation_note(f: &Fed) -> Option<String> {
    let Fed::Continues { shorter_is_a, from, to, .. } = f else { return None };
    let (s, l) = if *shorter_is_a { ("a", "b") } else { ("b", "a") };
    Some(format!(
        "{l}'s prompt continues {s}'s with the tokens {s} generated: positions {from}..{} were fed to {s} one decode step at a time (KV cache) and to {l} in its prefill; the fed ids agree, so positions are compared as themselves and generated tokens by the position they occupy",
        to.saturating_sub(1)
    ))
}

/// Per position of a continuation's shared span (`from..to`, and the first position both runs
/// predicted from): how each run computed it, the difference of the deepest layer both
/// recorded there (`heat`), and the next token each predicted from it (only a run that
/// generated the token at `position + 1` predicted it).
pub(super) fn positions(f: &Fed, sa: &Side, sb: &Side, heat: &Heat) -> Vec<PositionCompare> {
    let Fed::Continues { from, to, .. } = f else { return Vec::new() };
    let pass = |s: &Side, p: u32| -> Untrusted {
        s.forwards
            .values()
            .find(|f| f.index_pos <= p && p < f.index_pos.saturating_add(f.seq_len))
            .map(|f| match f.phase {
                candle_trace_format::record::Phase::Prefill => format!("prefill step {} (M={})", f.step, f.seq_len.saturating_mul(f.batch)),
                _ => format!("decode step {} (M={})", f.step, f.batch),
            })
            .unwrap_or_else(|| "not computed".into())
            .into()
    };
    // A redacted side's choices hold no ids: no prediction to show.
    let next = |s: &Side, p: u32| s.tokens.iter().filter(|_| ids_held(s)).find(|e| e.pos == p + 1).and_then(|e| e.rows.iter().find(|c| c.row == 0)).map(|c| c.token);
    // The last position before `to` predicted the first token both generated.
    (from.saturating_sub(1)..*to)
        .map(|p| {
            let deepest = heat.layers.iter().zip(&heat.cells).rev().find_map(|(l, cells)| cells.iter().find(|c| c.0 == p).map(|c| (l.clone(), c.1)));
            let (layer, max_abs_diff) = deepest.map_or((Untrusted::default(), None), |(l, d)| (l, Some(d)));
            PositionCompare { position: p, a_pass: pass(sa, p), b_pass: pass(sb, p), layer, max_abs_diff, a_next: next(sa, p), b_next: next(sb, p) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_format::record::{Choice, TokenEvent};

    fn run(prompt: &[u32], generated: &[u32]) -> Trace {
        let mut header = Header::default();
        header.run.prompt_tokens = prompt.to_vec();
        let items = generated
            .iter()
            .enumerate()
            .map(|(i, &token)| {
                let c = Choice { row: 0, token, text: String::new(), top: vec![(token, 1.0)], margin: 1.0, tie: false };
                Item::Token(TokenEvent { step: i as u32, index: i as u32, pos: (prompt.len() + i) as u32, rows: vec![c] })
            })
            .collect();
        Trace { path: "t.trace".into(), header, items, footer: None, truncated: false, sampling: Vec::new(), build: None, level: Default::default(), extras: Default::default() }
    }

    /// b's prompt = a's prompt + a's first 3 tokens: a continuation; a prompt token changed, or
    /// b's prompt holding a token a did not generate, is a difference at that position.
    #[test]
    fn a_prompt_that_continues_the_other_run_is_not_an_input_difference() {
        let a = run(&[1, 2, 3], &[7, 8, 9, 10]);
        let b = run(&[1, 2, 3, 7, 8, 9], &[10]);
        assert_eq!(fed(&a, &b), Fed::Continues { shorter_is_a: true, from: 3, to: 6, skip: 3 });
        assert_eq!(fed(&b, &a), Fed::Continues { shorter_is_a: false, from: 3, to: 6, skip: 3 });
        // A flip after the shared span is still a continuation (the token comparison finds it).
        assert!(matches!(fed(&a, &run(&[1, 2, 3, 7, 8, 9], &[11])), Fed::Continues { .. }));
        match fed(&a, &run(&[1, 5, 3, 7, 8, 9], &[10])) {
            Fed::Differ { position, .. } => assert_eq!(position, 1),
            f => panic!("{f:?}"),
        }
        match fed(&a, &run(&[1, 2, 3, 7, 6, 9], &[10])) {
            Fed::Differ { position, explanation } => assert!(position == 4 && explanation.contains("b's prompt holds token 6 at position 4 where a generated 8"), "{explanation}"),
            f => panic!("{f:?}"),
        }
        assert_eq!(fed(&a, &a), Fed::Same);
    }
}
