//! Text tokenization for the models this crate traces.
//!
//! This module turns prompts into token ids and token ids back into text. It
//! owns two tokenizers: a GPT-2 style byte-level BPE tokenizer rebuilt from the
//! `tokenizer.*` metadata embedded in a GGUF file (vocabulary, merges, special
//! tokens, pre-tokenizer flavour and chat template), and a trivial byte-level
//! tokenizer for the builtin seeded model (one id per byte plus BOS/EOS). Chat
//! templates are rendered by [`crate::chat`]; SentencePiece vocabularies are
//! built by [`crate::spm`].

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::{AddedToken, Tokenizer};

/// The pre-tokenizer regex of `tokenizer.ggml.pre = "qwen2"` (Qwen 2/2.5 files).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `token_type` value of a control (special) token.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF `token_type` value of a user-defined token.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Id of `<|bos|>` in the builtin byte-level tokenizer.
const BYTE_BOS_ID: u32 = 256;
/// Id of `<|eos|>` in the builtin byte-level tokenizer.
const BYTE_EOS_ID: u32 = 257;
const BYTE_BOS: &str = "<|bos|>";
const BYTE_EOS: &str = "<|eos|>";

/// Which algorithm does the actual work.
enum Backend {
    /// A `tokenizers` BPE pipeline built from GGUF metadata.
    Bpe(Box<Tokenizer>),
    /// One id per byte, plus two special ids.
    Bytes,
}

/// A text tokenizer: encode, decode, special tokens, optional chat template.
pub struct TextTokenizer {
    backend: Backend,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// Whether the model asks for BOS to be prepended (GGUF `add_bos_token`).
    add_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Bpe(_) => "bpe",
            Backend::Bytes => "bytes",
        };
        f.debug_struct("TextTokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Reads an integer of any GGUF integer type.
fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn md_string<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(format!("GGUF metadata {key} is not a string")),
    }
}

fn md_string_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>, String> {
    let arr = match md.get(key) {
        None => return Err(format!("GGUF metadata has no {key}")),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(format!("GGUF metadata {key} is not an array")),
    };
    arr.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(format!("GGUF metadata {key}[{i}] is not a string")),
        })
        .collect()
}

/// `tokenizer.ggml.merges`: each "a b" as the pair (a, b).
fn md_merges(md: &HashMap<String, Value>) -> Result<Merges, String> {
    let merges_raw = md_string_array(md, "tokenizer.ggml.merges")?;
    let mut merges: Merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| format!("GGUF metadata tokenizer.ggml.merges[{i}] has no space: {m:?}"))?;
        merges.push((a.to_string(), b.to_string()));
    }
    Ok(merges)
}

/// `tokenizer.ggml.token_type`: one type per token (empty when absent).
fn md_token_types(md: &HashMap<String, Value>, n_tokens: usize) -> Result<Vec<i64>, String> {
    let token_types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(Value::Array(a)) => {
            a.iter().enumerate().map(|(i, v)| value_as_i64(v).ok_or_else(|| format!("GGUF metadata tokenizer.ggml.token_type[{i}] is not an integer"))).collect::<Result<_, _>>()?
        }
        Some(_) => return Err("GGUF metadata tokenizer.ggml.token_type is not an array".to_string()),
    };
    if !token_types.is_empty() && token_types.len() != n_tokens {
        return Err(format!("GGUF metadata tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {n_tokens}", token_types.len()));
    }
    Ok(token_types)
}

fn md_token_id(md: &HashMap<String, Value>, key: &str, n_tokens: usize) -> Result<Option<u32>, String> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = value_as_i64(v).ok_or_else(|| format!("GGUF metadata {key} is not an integer"))?;
    if id < 0 || id as u64 >= n_tokens as u64 {
        return Err(format!("GGUF metadata {key} = {id} is outside the vocabulary (size {n_tokens})"));
    }
    Ok(Some(id as u32))
}

impl TextTokenizer {
    /// Build from GGUF metadata (`candle_core::quantized::gguf_file::Content.metadata`).
    ///
    /// Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with keys
    /// `tokenizer.ggml.tokens` (id = index), `tokenizer.ggml.merges` ("a b"
    /// strings), `tokenizer.ggml.token_type` (3 = control, 4 = user-defined;
    /// both become special tokens that are matched in text and skipped in
    /// decode), `tokenizer.ggml.bos_token_id` / `eos_token_id`,
    /// `tokenizer.ggml.add_bos_token`, `tokenizer.ggml.pre` (`"smollm"` splits
    /// every digit into its own pre-token before the GPT-2 byte-level regex;
    /// `"default"`, `"gpt2"` or absent use only the byte-level regex) and
    /// `tokenizer.chat_template`.
    ///
    /// Errors are one-line messages naming the missing or unsupported key or value.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self, String> {
        let model = md_string(md, "tokenizer.ggml.model")?.ok_or_else(|| "GGUF metadata has no tokenizer.ggml.model".to_string())?;
        match model {
            "gpt2" => {}
            "llama" => return Self::sentencepiece(md),
            _ => return Err(format!("unsupported tokenizer model '{model}' (supported: gpt2, llama)")),
        }

        let pre_kind = md_string(md, "tokenizer.ggml.pre")?.unwrap_or("default");
        if !matches!(pre_kind, "default" | "gpt2" | "smollm" | "qwen2") {
            return Err(format!("unsupported tokenizer.ggml.pre '{pre_kind}' (supported: smollm, qwen2, gpt2, default)"));
        }

        let tokens = md_string_array(md, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err("GGUF metadata tokenizer.ggml.tokens is empty".to_string());
        }
        let n_tokens = tokens.len();
        if u32::try_from(n_tokens).is_err() {
            return Err(format!("GGUF metadata tokenizer.ggml.tokens is too long ({n_tokens})"));
        }

        let merges = md_merges(md)?;
        let token_types = md_token_types(md, n_tokens)?;

        let bos_id = md_token_id(md, "tokenizer.ggml.bos_token_id", n_tokens)?;
        let eos_id = md_token_id(md, "tokenizer.ggml.eos_token_id", n_tokens)?;
        let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("GGUF metadata tokenizer.ggml.add_bos_token is not a bool".to_string()),
        };
        let chat_template = md_string(md, "tokenizer.chat_template")?.map(str::to_string);

        // Vocabulary: the token string at index i has id i. Should a string
        // appear twice, the first id keeps it.
        let mut vocab = Vocab::default();
        for (id, tok) in tokens.iter().enumerate() {
            vocab.entry(tok.to_string()).or_insert(id as u32);
        }
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| format!("cannot build BPE model from GGUF metadata: {e}"))?;

        let byte_level = ByteLevel::new(false, true, true);
        let pre: PreTokenizerWrapper = match pre_kind {
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
            // Qwen2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the Split of Qwen's
            // tokenizer.json): case-insensitive contractions, letters with one leading non-letter,
            // single digits, punctuation runs, newlines; then bytes without GPT-2's regex.
            "qwen2" => {
                let split = Split::new(SplitPattern::Regex(QWEN2_SPLIT.into()), SplitDelimiterBehavior::Isolated, false).map_err(|e| format!("cannot build the qwen2 pre-tokenizer: {e}"))?;
                Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
            }
            _ => byte_level.into(),
        };

        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(pre));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

        let specials: Vec<AddedToken> =
            token_types.iter().enumerate().filter(|(_, t)| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED).map(|(id, _)| AddedToken::from(tokens[id], true)).collect();
        tokenizer.add_special_tokens(specials).map_err(|e| format!("cannot add the GGUF special tokens: {e}"))?;

        let vocab_size = n_tokens.max(tokenizer.get_vocab_size(true));
        Ok(Self { backend: Backend::Bpe(Box::new(tokenizer)), vocab_size, bos_id, eos_id, add_bos, chat_template })
    }

    /// A SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`) from GGUF metadata:
    /// `tokens`, `scores`, `token_type`, `add_space_prefix` (default true, as llama.cpp),
    /// `unknown_token_id`, `bos_token_id`, `eos_token_id`, `add_bos_token` (default true) and
    /// `tokenizer.chat_template` (see [`crate::spm`]).
    fn sentencepiece(md: &HashMap<String, Value>) -> Result<Self, String> {
        let tokens = md_string_array(md, "tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(format!("GGUF metadata tokenizer.ggml.tokens holds {n} tokens"));
        }
        let numbers = |key: &str, f: &dyn Fn(&Value) -> Option<f64>| -> Result<Vec<f64>, String> {
            match md.get(key) {
                Some(Value::Array(a)) if a.len() == n => a.iter().enumerate().map(|(i, v)| f(v).ok_or_else(|| format!("GGUF metadata {key}[{i}] is not a number"))).collect(),
                Some(Value::Array(a)) => Err(format!("GGUF metadata {key} has {} entries but tokenizer.ggml.tokens has {n}", a.len())),
                Some(_) => Err(format!("GGUF metadata {key} is not an array")),
                None => Err(format!("GGUF metadata has no {key}")),
            }
        };
        let scores: Vec<f32> = numbers("tokenizer.ggml.scores", &|v| v.to_f32().ok().map(f64::from))?.into_iter().map(|x| x as f32).collect();
        let types: Vec<i64> = numbers("tokenizer.ggml.token_type", &|v| value_as_i64(v).map(|x| x as f64))?.into_iter().map(|x| x as i64).collect();
        let flag = |key: &str, default: bool| match md.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(format!("GGUF metadata {key} is not a bool")),
        };
        let pieces = crate::spm::Pieces {
            tokens: &tokens,
            scores: &scores,
            types: &types,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true)?,
            unk_id: md_token_id(md, "tokenizer.ggml.unknown_token_id", n)?,
        };
        let tokenizer = crate::spm::tokenizer(&pieces)?;
        Ok(Self {
            backend: Backend::Bpe(Box::new(tokenizer)),
            vocab_size: n,
            bos_id: md_token_id(md, "tokenizer.ggml.bos_token_id", n)?,
            eos_id: md_token_id(md, "tokenizer.ggml.eos_token_id", n)?,
            add_bos: flag("tokenizer.ggml.add_bos_token", true)?,
            chat_template: md_string(md, "tokenizer.chat_template")?.map(str::to_string),
        })
    }

    /// Loads a Hugging Face `tokenizer.json` (any model the `tokenizers` crate reads). Its own
    /// padding and truncation settings are turned off (one prompt is one sequence). `bos`/`eos`
    /// are the model's ids (from config.json), `chat_template` the one in tokenizer_config.json.
    ///
    /// Errors: a one-line message when the file cannot be read or parsed.
    pub fn from_tokenizer_json(path: &std::path::Path, bos_id: Option<u32>, eos_id: Option<u32>, chat_template: Option<String>) -> Result<Self, String> {
        let mut tokenizer = Tokenizer::from_file(path).map_err(|e| format!("cannot read tokenizer: {}", e.to_string().lines().next().unwrap_or("")))?;
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
        let vocab_size = tokenizer.get_vocab_size(true);
        Ok(Self { backend: Backend::Bpe(Box::new(tokenizer)), vocab_size, bos_id, eos_id, add_bos: false, chat_template })
    }

    /// The `tokenizers` pipeline behind a GGUF or tokenizer.json tokenizer (`None` for the
    /// builtin byte-level one): lets tools write it out as a tokenizer.json.
    pub fn hf_tokenizer(&self) -> Option<&Tokenizer> {
        match &self.backend {
            Backend::Bpe(t) => Some(t),
            Backend::Bytes => None,
        }
    }

    /// Byte-level tokenizer of the builtin seeded model: ids 0..=255 are the
    /// bytes, 256 = `"<|bos|>"`, 257 = `"<|eos|>"`; vocab size 258. No chat
    /// template. Decoding of invalid UTF-8 is lossy.
    pub fn byte_level() -> Self {
        Self { backend: Backend::Bytes, vocab_size: 258, bos_id: Some(BYTE_BOS_ID), eos_id: Some(BYTE_EOS_ID), add_bos: false, chat_template: None }
    }

    /// Number of token ids (including special tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Id of the beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Id of the end-of-sequence token, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Whether the model's metadata asks callers to prepend BOS
    /// (`tokenizer.ggml.add_bos_token`; false when absent). [`Self::encode`]
    /// never adds it by itself.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The raw chat template, if the model carries one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Encode text. Special-token strings such as `"<|im_start|>"` appearing
    /// in the text are recognised as their special ids. Never adds BOS by itself.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.backend {
            Backend::Bpe(tok) => tok.encode_fast(text, false).map(|enc| enc.get_ids().to_vec()).map_err(|e| format!("tokenization failed: {e}")),
            Backend::Bytes => Ok(encode_bytes(text)),
        }
    }

    /// Decode ids to text. Special tokens (control and user-defined) are
    /// skipped. Ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(format!("token id {bad} is outside the vocabulary (size {})", self.vocab_size));
        }
        match &self.backend {
            Backend::Bpe(tok) => tok.decode(ids, true).map_err(|e| format!("detokenization failed: {e}")),
            Backend::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&id| id < 256).map(|&id| id as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// Decode ids to text with special tokens kept (a chat template's markers): the text the
    /// model received. Ids outside the vocabulary are an error.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, String> {
        match &self.backend {
            Backend::Bpe(tok) if ids.iter().all(|&id| (id as usize) < self.vocab_size) => tok.decode(ids, false).map_err(|e| format!("detokenization failed: {e}")),
            _ => self.decode(ids),
        }
    }

    /// An incremental detokenizer for one row of generated ids ([`TokenStream`]).
    pub fn stream(&self) -> TokenStream<'_> {
        let inner = match &self.backend {
            Backend::Bpe(tok) => StreamInner::Bpe(tok.decode_stream(true)),
            Backend::Bytes => StreamInner::Bytes(Vec::new()),
        };
        TokenStream { vocab_size: self.vocab_size, inner }
    }

    /// Renders the chat template for one user turn followed by the assistant's prompt, with a
    /// Jinja engine ([`crate::chat::render`]): `bos_token` and `eos_token` are this tokenizer's
    /// texts for its BOS and EOS ids.
    ///
    /// Errors: `"has no chat template"`, or the template's one-line rendering error.
    pub fn apply_chat_template(&self, user_prompt: &str) -> Result<String, String> {
        let template = self.chat_template.as_deref().ok_or_else(|| "has no chat template".to_string())?;
        let text = |id: Option<u32>| -> String {
            match (&self.backend, id) {
                (Backend::Bpe(t), Some(id)) => t.id_to_token(id).unwrap_or_default(),
                _ => String::new(),
            }
        };
        crate::chat::render(template, user_prompt, &text(self.bos_id), &text(self.eos_id))
    }
}

/// Encodes text for the builtin byte-level model: every byte is its own id,
/// except the literal strings `<|bos|>` and `<|eos|>`, which become ids 256 and 257.
fn encode_bytes(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix(BYTE_BOS) {
            ids.push(BYTE_BOS_ID);
            rest = after;
        } else if let Some(after) = rest.strip_prefix(BYTE_EOS) {
            ids.push(BYTE_EOS_ID);
            rest = after;
        } else {
            // Copy plain bytes up to the next possible special string.
            let first = rest.chars().next().map_or(1, char::len_utf8);
            let next = rest[first..].find("<|").map_or(rest.len(), |p| p + first);
            ids.extend(rest.as_bytes()[..next].iter().map(|&b| b as u32));
            rest = &rest[next..];
        }
    }
    ids
}

/// Detokenizes a row of generated ids one id at a time, in time linear in the row's length:
/// `tokenizers`' `DecodeStream` for BPE tokenizers (it re-decodes only the last few ids), an
/// incremental UTF-8 decoder for the byte-level one. Each [`TokenStream::step`] returns the text
/// the id adds: empty while the id ends inside a multi-byte character (the character comes with
/// the id that completes it), `U+FFFD` for bytes that can never form one. The pieces of a row
/// concatenate to the row's decoded text, but for an unfinished character at its very end.
/// Special tokens add no text.
pub struct TokenStream<'a> {
    vocab_size: usize,
    inner: StreamInner<'a>,
}

type BpeStream<'a> =
    tokenizers::DecodeStream<'a, tokenizers::ModelWrapper, tokenizers::NormalizerWrapper, tokenizers::PreTokenizerWrapper, tokenizers::PostProcessorWrapper, tokenizers::DecoderWrapper>;

enum StreamInner<'a> {
    Bpe(BpeStream<'a>),
    /// Bytes of a character not yet complete.
    Bytes(Vec<u8>),
}

impl TokenStream<'_> {
    /// The text `id` adds to the row.
    ///
    /// # Errors
    /// An id outside the vocabulary, or a detokenization failure, as a one-line message.
    pub fn step(&mut self, id: u32) -> Result<String, String> {
        if id as usize >= self.vocab_size {
            return Err(format!("token id {id} is outside the vocabulary (size {})", self.vocab_size));
        }
        match &mut self.inner {
            StreamInner::Bpe(s) => s.step(id).map(Option::unwrap_or_default).map_err(|e| format!("detokenization failed: {e}")),
            StreamInner::Bytes(pending) => {
                if id < 256 {
                    pending.push(id as u8);
                }
                let mut out = String::new();
                loop {
                    match std::str::from_utf8(pending) {
                        Ok(text) => {
                            out.push_str(text);
                            pending.clear();
                            break;
                        }
                        Err(e) => {
                            let ok = e.valid_up_to();
                            out.push_str(std::str::from_utf8(&pending[..ok]).unwrap_or_default());
                            match e.error_len() {
                                Some(bad) => {
                                    out.push(char::REPLACEMENT_CHARACTER);
                                    pending.drain(..ok + bad);
                                }
                                None => {
                                    pending.drain(..ok);
                                    break;
                                }
                            }
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen2_split_isolates_digits_and_keeps_leading_spaces() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let split = Split::new(SplitPattern::Regex(QWEN2_SPLIT.into()), SplitDelimiterBehavior::Isolated, false).unwrap();
        let mut p = PreTokenizedString::from("Hello world 123!!\nIt's");
        split.pre_tokenize(&mut p).unwrap();
        let parts: Vec<String> = p.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(s, _, _)| s.to_string()).collect();
        assert_eq!(parts, ["Hello", " world", " ", "1", "2", "3", "!!\n", "It", "'s"]);
    }

    #[test]
    fn byte_stream_waits_for_whole_characters() {
        let tok = TextTokenizer::byte_level();
        let mut st = tok.stream();
        let ids = [0x68, 0xC3, 0xA9, 0xFF, 0xE6, 0x97, 0xA5, BYTE_EOS_ID, 0x61];
        let pieces: Vec<String> = ids.iter().map(|&i| st.step(i).unwrap()).collect();
        assert_eq!(pieces, ["h", "", "é", "\u{FFFD}", "", "", "日", "", "a"]);
        assert_eq!(pieces.concat(), tok.decode(&ids).unwrap());
        assert!(st.step(300).is_err());
    }

    #[test]
    fn bytes_encoding_handles_partial_markers() {
        assert_eq!(encode_bytes("<|x<|bos|>"), vec![60, 124, 120, 256]);
        assert_eq!(encode_bytes("<|eos|"), vec![60, 124, 101, 111, 115, 124]);
    }
}
