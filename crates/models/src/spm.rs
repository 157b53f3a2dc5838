//! SentencePiece tokenizers from GGUF metadata (`tokenizer.ggml.model = "llama"`: Llama 2,
//! Gemma, Mistral, Phi-3 files), built on the `tokenizers` crate.
//!
//! A SentencePiece BPE model ships pieces and scores, not merges. Its encoder (as llama.cpp's
//! `llm_tokenizer_spm` runs it) starts from the characters of the text, spaces written `▁`
//! (U+2581), and repeatedly merges the adjacent pair whose concatenation is a piece of highest
//! score, the leftmost on ties; characters left outside the vocabulary become their UTF-8 bytes
//! (`<0xXX>` pieces). The same result comes from a BPE model whose merges are every split of
//! every piece into two pieces, ranked by the whole piece's score (the conversion Hugging Face's
//! `convert_slow_tokenizer` makes), which is what this module builds. Control and user-defined
//! pieces are matched in the raw text before anything else (control ones as special tokens,
//! left out of decoded text).

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormalizerSequence};
use tokenizers::{AddedToken, Tokenizer};

/// The word-boundary mark SentencePiece writes for a space.
pub const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary as a GGUF file stores it.
#[derive(Debug, Clone)]
pub struct Pieces<'a> {
    /// `tokenizer.ggml.tokens`: the piece of id `i` at index `i`.
    pub tokens: &'a [&'a str],
    /// `tokenizer.ggml.scores`: one per piece (higher merges first).
    pub scores: &'a [f32],
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    pub types: &'a [i64],
    /// `tokenizer.ggml.add_space_prefix`: a `▁` is put before the text (Llama 2: true; Gemma:
    /// false).
    pub add_space_prefix: bool,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<u32>,
}

/// GGUF `token_type` of a control token.
const CONTROL: i64 = 3;
/// GGUF `token_type` of a user-defined token.
const USER_DEFINED: i64 = 4;
/// GGUF `token_type` of a byte piece (`<0x41>`).
const BYTE: i64 = 6;

/// The merges of a SentencePiece vocabulary: each split of each piece into two pieces, ranked by
/// the piece's score (highest first), then by its id, then by the ids of the two halves.
pub fn merges(p: &Pieces) -> Vec<(String, String)> {
    // foldhash: two lookups per split of every piece (Gemma 3: 262 144 pieces).
    let mut ids: foldhash::HashMap<&str, usize> = foldhash::HashMap::with_capacity_and_hasher(p.tokens.len(), Default::default());
    for (i, t) in p.tokens.iter().enumerate() {
        ids.entry(t).or_insert(i);
    }
    // (score, piece id, left id, right id)
    let mut ranked: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (i, piece) in p.tokens.iter().enumerate() {
        if matches!(p.types.get(i), Some(&CONTROL | &USER_DEFINED | &BYTE)) {
            continue;
        }
        for (k, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(k);
            if let (Some(&a), Some(&b)) = (ids.get(l), ids.get(r)) {
                ranked.push((p.scores.get(i).copied().unwrap_or(0.0), i, a, b));
            }
        }
    }
    // Every key is unique (a piece's splits differ in their halves): an unstable sort is exact.
    ranked.sort_unstable_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)).then(x.3.cmp(&y.3)));
    ranked.into_iter().map(|(_, _, a, b)| (p.tokens[a].to_string(), p.tokens[b].to_string())).collect()
}

/// Builds the tokenizer: BPE over the merges above with byte fallback, spaces written `▁` (and
/// one put first when `add_space_prefix`), control and user-defined pieces as special tokens;
/// decoding turns `▁` back into spaces and byte pieces back into bytes.
///
/// # Errors
/// A one-line message when the vocabulary does not make a BPE model.
pub fn tokenizer(p: &Pieces) -> Result<Tokenizer, String> {
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (i, t) in p.tokens.iter().enumerate() {
        vocab.entry(t.to_string()).or_insert(i as u32);
    }
    let mut bpe = BPE::builder().vocab_and_merges(vocab, merges(p)).byte_fallback(true);
    if let Some(unk) = p.unk_id.and_then(|i| p.tokens.get(i as usize)) {
        bpe = bpe.unk_token(unk.to_string());
    }
    let bpe = bpe.build().map_err(|e| format!("cannot build the SentencePiece model from GGUF metadata: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    let replace = Replace::new(" ", SPACE).map_err(|e| e.to_string())?;
    let normalizer: NormalizerWrapper = if p.add_space_prefix { NormalizerSequence::new(vec![Prepend::new(SPACE.to_string()).into(), replace.into()]).into() } else { replace.into() };
    tok.with_normalizer(Some(normalizer)).map_err(|e| e.to_string())?;
    let mut decoders = vec![Replace::new(SPACE, " ").map_err(|e| e.to_string())?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if p.add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    // Control pieces are special (left out of decoded text); user-defined ones (Gemma's runs of
    // newlines, spaces and tabs) are matched in the raw text too, but decode as their text.
    let pieces_of = |kind: i64| -> Vec<AddedToken> {
        p.types.iter().enumerate().filter(|(_, t)| **t == kind).filter_map(|(i, _)| p.tokens.get(i)).map(|t| AddedToken::from(t.to_string(), kind == CONTROL).normalized(false)).collect()
    };
    tok.add_special_tokens(pieces_of(CONTROL)).map_err(|e| format!("cannot add the control pieces: {e}"))?;
    tok.add_tokens(pieces_of(USER_DEFINED)).map_err(|e| format!("cannot add the user-defined pieces: {e}"))?;
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_rank_by_the_merged_piece_score() {
        let tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<0x61>"];
        let scores = [0.0, -1.0, -1.0, -1.0, -2.0, -0.5, -3.0, 0.0];
        let types = [2, 1, 1, 1, 1, 1, 1, 6];
        let p = Pieces { tokens: &tokens, scores: &scores, types: &types, add_space_prefix: false, unk_id: Some(0) };
        let m = merges(&p);
        let s = |a: &str, b: &str| (a.to_string(), b.to_string());
        // bc (-0.5) before ab (-2), before the two splits of abc (-3).
        assert_eq!(m, vec![s("b", "c"), s("a", "b"), s("a", "bc"), s("ab", "c")]);
        let t = tokenizer(&p).unwrap();
        // "abc": b+c merges first (higher score), then a+bc.
        assert_eq!(t.encode("abc", false).unwrap().get_ids(), &[6]);
        assert_eq!(t.encode("ab", false).unwrap().get_ids(), &[4]);
        // 'z' is not a piece and has no byte piece: unknown.
        assert_eq!(t.encode("bz", false).unwrap().get_ids(), &[2, 0]);
    }
}
