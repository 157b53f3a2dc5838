//! Integration tests for `candle_trace::tokenizer`: exact token ids for the
//! SmolLM2-135M-Instruct GGUF tokenizer (reference ids from Hugging Face
//! transformers' conversion of the same file), decode round trips, the ChatML
//! prompt, and the builtin byte-level tokenizer.

use candle_trace::tokenizer::TextTokenizer;

use crate::util::smollm2_path;

fn smollm2_tokenizer() -> TextTokenizer {
    let path = smollm2_path();
    let (content, _) = candle_trace::models::gguf::open(&path).expect("read the GGUF header");
    TextTokenizer::from_gguf_metadata(&content.metadata).expect("build tokenizer")
}

const CASES: &[(&str, &[u32])] = &[
    ("Tell me about Richard Feynman.", &[31530, 549, 563, 7778, 6173, 1744, 1483, 30]),
    ("In 1945, 12345 apples cost $3.50!", &[788, 216, 33, 41, 36, 37, 28, 216, 33, 34, 35, 36, 37, 13855, 1708, 1885, 35, 30, 37, 32, 17]),
    ("naïve café — 東京 🚀", &[3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122, 15107, 244, 218]),
    ("<|im_start|>user\nTell me about Richard Feynman.<|im_end|>\n<|im_start|>assistant\n", &[1, 4093, 198, 31530, 549, 563, 7778, 6173, 1744, 1483, 30, 2, 198, 1, 520, 9531, 198]),
];

#[test]
fn smollm2_metadata() {
    let tok = smollm2_tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
}

#[test]
fn smollm2_reference_encodings() {
    let tok = smollm2_tokenizer();
    for (text, expected) in CASES {
        let ids = tok.encode(text).expect("encode");
        assert_eq!(&ids, expected, "encoding of {text:?}");
    }
}

#[test]
fn smollm2_decode_round_trip() {
    let tok = smollm2_tokenizer();
    for (text, expected) in &CASES[..3] {
        assert_eq!(tok.decode(expected).expect("decode"), *text);
    }
    // Special tokens are skipped when decoding.
    let (_, chat_ids) = CASES[3];
    assert_eq!(tok.decode(chat_ids).expect("decode"), "user\nTell me about Richard Feynman.\nassistant\n");
}

#[test]
fn smollm2_decode_rejects_out_of_range_id() {
    let tok = smollm2_tokenizer();
    assert!(tok.decode(&[49152]).is_err());
}

#[test]
fn smollm2_chat_template() {
    let tok = smollm2_tokenizer();
    let prompt = tok.apply_chat_template("Tell me about Richard Feynman.").expect("chat template");
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nTell me about Richard Feynman.<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // The rendered prompt tokenizes with the special markers as single ids.
    let ids = tok.encode(&prompt).expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
}

#[test]
fn byte_level_round_trip() {
    let tok = TextTokenizer::byte_level();
    assert_eq!(tok.vocab_size(), 258);
    assert_eq!(tok.bos_id(), Some(256));
    assert_eq!(tok.eos_id(), Some(257));

    let text = "naïve café — 東京 🚀";
    let ids = tok.encode(text).expect("encode");
    assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(tok.decode(&ids).expect("decode"), text);

    let ids = tok.encode("<|bos|>hi <|eos|>").expect("encode");
    assert_eq!(ids, vec![256, 104, 105, 32, 257]);
    assert_eq!(tok.decode(&ids).expect("decode"), "hi ");

    assert!(tok.decode(&[258]).is_err());
    assert_eq!(tok.decode(&[0xE6, 0x9D]).expect("decode"), "\u{FFFD}");
    assert!(tok.apply_chat_template("hi").is_err());
}

#[test]
fn unsupported_metadata_errors() {
    use candle_core::quantized::gguf_file::Value;
    use std::collections::HashMap;

    let mut md = HashMap::new();
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert!(err.contains("tokenizer.ggml.model"), "{err}");

    md.insert("tokenizer.ggml.model".to_string(), Value::String("bert".into()));
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert_eq!(err, "unsupported tokenizer model 'bert' (supported: gpt2, llama)");

    // SentencePiece ("llama"): pieces, scores and types must all be there and agree.
    md.insert("tokenizer.ggml.model".to_string(), Value::String("llama".into()));
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert_eq!(err, "GGUF metadata has no tokenizer.ggml.tokens");
    md.insert("tokenizer.ggml.tokens".to_string(), Value::Array(vec![Value::String("a".into()), Value::String("b".into())]));
    md.insert("tokenizer.ggml.scores".to_string(), Value::Array(vec![Value::F32(0.0)]));
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert_eq!(err, "GGUF metadata tokenizer.ggml.scores has 1 entries but tokenizer.ggml.tokens has 2");
    md.remove("tokenizer.ggml.tokens");
    md.remove("tokenizer.ggml.scores");

    md.insert("tokenizer.ggml.model".to_string(), Value::String("gpt2".into()));
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert_eq!(err, "GGUF metadata has no tokenizer.ggml.tokens");

    md.insert("tokenizer.ggml.pre".to_string(), Value::String("llama-bpe".into()));
    let err = TextTokenizer::from_gguf_metadata(&md).unwrap_err();
    assert!(err.contains("'llama-bpe'"), "{err}");
}

/// Streaming detokenization (one id at a time) gives the whole row's text, characters split
/// across byte-fallback tokens included, and an empty piece until a character is complete.
#[test]
fn smollm2_stream_matches_whole_decode() {
    let tok = smollm2_tokenizer();
    let text = " héllo wörld, 日本語 🎉 and 12345 numbers\nnew line";
    let ids = tok.encode(text).unwrap();
    let mut st = tok.stream();
    let pieces: Vec<String> = ids.iter().map(|&i| st.step(i).unwrap()).collect();
    assert_eq!(pieces.concat(), tok.decode(&ids).unwrap());
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().any(String::is_empty), "🎉 spans several byte tokens: {pieces:?}");
    assert!(tok.stream().step(tok.vocab_size() as u32).is_err());
}
