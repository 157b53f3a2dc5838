//! BERT sentence encoder: bit-exact parity with candle-transformers' `BertModel` on
//! all-MiniLM-L6-v2 (f32, and f16 against upstream's encoder with a representable mask), the
//! cosine of two sentences, the trace an embedding run records, and bad model folders.
//!
//! Tests that need the MiniLM folder fail when it is missing, with a message naming
//! `tools/fetch-models.sh`. The rest build a tiny BERT folder in a temp dir.

use crate::util::{json, p, tmp, trace_s};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Module, VarBuilder};
use candle_trace::encoder::{embed, load_folder, tokenize, LoadedEncoder, Pooling};
use candle_trace::record::Item;
use candle_trace::show::cosine;
use candle_trace::tracer::{MemorySink, Tracer};
use candle_transformers::models::bert::{BertEncoder, BertModel, Config};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const MINILM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/all-MiniLM-L6-v2");

const SENTENCES: [&str; 2] = ["A man is eating food.", "A man is eating a piece of bread."];

/// Path of the all-MiniLM-L6-v2 folder. A test that needs it fails when it is missing (never a
/// silent pass), with a message naming `tools/fetch-models.sh`.
pub fn minilm_path() -> PathBuf {
    let path = PathBuf::from(MINILM);
    assert!(path.join("model.safetensors").is_file(), "model folder {} is missing: run tools/fetch-models.sh first", path.display());
    path
}

fn texts() -> Vec<String> {
    SENTENCES.iter().map(|s| s.to_string()).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t.to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect(),
        DType::F16 => t.to_vec1::<half::f16>().unwrap().into_iter().map(|x| x.to_bits() as u32).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>().unwrap().into_iter().map(|x| x.to_bits() as u32).collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

fn assert_bit_identical(ours: &Tensor, reference: &Tensor, what: &str) {
    assert_eq!(ours.dims(), reference.dims(), "{what}: shapes");
    assert_eq!(ours.dtype(), reference.dtype(), "{what}: dtypes");
    let (a, b) = (bits(ours), bits(reference));
    let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert_eq!(differ, 0, "{what}: {differ} of {} values differ", a.len());
}

fn memory_tracer() -> (Tracer, MemorySink) {
    let sink = MemorySink::default();
    (Tracer::new(Box::new(sink.clone())), sink)
}

/// Upstream's weights and config for `dir`, in `dtype`.
fn upstream_vb(dir: &Path, dtype: DType) -> (VarBuilder<'static>, Config) {
    let cfg: Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], dtype, &Device::Cpu).unwrap() };
    (vb, cfg)
}

/// Sentence-transformers pooling with plain candle ops, in f32: masked mean, then L2 norm.
fn reference_pool(hidden: &Tensor, mask: &Tensor) -> Vec<Vec<f32>> {
    let hidden = hidden.to_dtype(DType::F32).unwrap();
    let m = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let summed = hidden.broadcast_mul(&m).unwrap().sum(1).unwrap();
    let mean = summed.broadcast_div(&m.sum(1).unwrap()).unwrap();
    let norm = mean.sqr().unwrap().sum_keepdim(D::Minus1).unwrap().sqrt().unwrap().maximum(1e-12).unwrap();
    mean.broadcast_div(&norm).unwrap().to_vec2::<f32>().unwrap()
}

/// Our embeddings and hidden states for the two sentences.
fn ours(enc: &mut LoadedEncoder) -> (Tensor, Vec<Vec<f32>>) {
    let batch = tokenize(enc, &texts()).unwrap();
    let mut tr = Tracer::untraced();
    let out = enc.model.forward(&mut tr, &batch.input_ids, &batch.token_type_ids, &batch.attention_mask).unwrap();
    let (mut tr, _) = memory_tracer();
    let emb = embed(enc, &texts(), &mut tr).unwrap();
    (out.hidden.t, emb)
}

#[test]
fn minilm_f32_matches_candle_transformers_bit_for_bit() {
    let dir = minilm_path();
    let mut enc = load_folder(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(enc.pooling, Pooling::MeanNormalize);
    // Named by architecture and sha256, never by the folder (traces are public attachments).
    assert_eq!(enc.info.name, "bert-53aa51172d14");
    assert_eq!(enc.info.sha256, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db");
    assert_eq!((enc.info.architecture.as_str(), enc.info.n_layers, enc.info.vocab_size, enc.info.weights.as_str()), ("bert", 6, 30522, "f32"));

    let batch = tokenize(&enc, &texts()).unwrap();
    // [CLS] a man is eating food . [SEP], padded to the second sentence's 11 tokens.
    assert_eq!(batch.tokens[0], vec![101, 1037, 2158, 2003, 5983, 2833, 1012, 102]);
    assert_eq!(batch.input_ids.dims(), &[2, 11]);
    assert_eq!(batch.attention_mask.sum_all().unwrap().to_scalar::<u32>().unwrap(), 8 + 11);

    let (vb, cfg) = upstream_vb(&dir, DType::F32);
    let upstream = BertModel::load(vb, &cfg).unwrap();
    let reference = upstream.forward(&batch.input_ids, &batch.token_type_ids, Some(&batch.attention_mask)).unwrap();
    let (hidden, emb) = ours(&mut enc);
    assert_bit_identical(&hidden, &reference, "f32 hidden states");

    let ref_emb = reference_pool(&reference, &batch.attention_mask);
    assert_eq!(emb.len(), 2);
    assert_eq!(emb[0].len(), 384);
    for (a, b) in emb.iter().zip(&ref_emb) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "f32 pooled embeddings differ");
    }
    let c = cosine(&emb[0], &emb[1]);
    let c_ref = cosine(&ref_emb[0], &ref_emb[1]);
    eprintln!("all-MiniLM-L6-v2 f32 cosine: {c}");
    assert_eq!(c, c_ref);
    assert!((0.75..0.76).contains(&c), "cosine {c}");
}

/// Upstream `BertModel` builds its additive mask with `f32::MIN`, which rounds to −∞ in f16 and
/// bf16, so `(1 − 1) · −∞ = NaN` reaches every score: its half-precision output is all NaN, and
/// parity with it is not meaningful. Ours uses the dtype's own finite minimum. The reference here
/// is upstream's `BertEncoder` (all layers; public) fed upstream's embedding computation (written
/// out with the same candle ops) and the mask built with the dtype's minimum.
fn half_parity(dtype: DType, min: Tensor) {
    let dir = minilm_path();
    let name = dtype.as_str();
    let mut enc = load_folder(&dir, dtype, &Device::Cpu).unwrap();
    assert_eq!(enc.info.weights, "f32", "weights as stored");
    let batch = tokenize(&enc, &texts()).unwrap();
    let (vb, cfg) = upstream_vb(&dir, dtype);

    let broken = BertModel::load(vb.clone(), &cfg).unwrap();
    let nan = broken.forward(&batch.input_ids, &batch.token_type_ids, Some(&batch.attention_mask)).unwrap();
    let nan_count = nan.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().filter(|x| x.is_nan()).count();
    assert_eq!(nan_count, nan.elem_count(), "upstream's {name} mask no longer overflows: test parity against BertModel directly");

    // Upstream's BertEmbeddings::forward, op for op.
    let e = vb.pp("embeddings");
    let word = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, e.pp("word_embeddings")).unwrap();
    let position = candle_nn::embedding(cfg.max_position_embeddings, cfg.hidden_size, e.pp("position_embeddings")).unwrap();
    let token_type = candle_nn::embedding(cfg.type_vocab_size, cfg.hidden_size, e.pp("token_type_embeddings")).unwrap();
    let ln = candle_nn::layer_norm(cfg.hidden_size, cfg.layer_norm_eps, e.pp("LayerNorm")).unwrap();
    let seq_len = batch.input_ids.dim(1).unwrap();
    let x = (word.forward(&batch.input_ids).unwrap() + token_type.forward(&batch.token_type_ids).unwrap()).unwrap();
    let pos_ids = Tensor::new((0..seq_len as u32).collect::<Vec<_>>().as_slice(), &Device::Cpu).unwrap();
    let x = x.broadcast_add(&position.forward(&pos_ids).unwrap()).unwrap();
    let x = ln.forward(&x).unwrap();
    // get_extended_attention_mask with the dtype's minimum instead of f32::MIN.
    let m = batch.attention_mask.unsqueeze(1).unwrap().unsqueeze(1).unwrap().to_dtype(dtype).unwrap();
    let ext = (m.ones_like().unwrap() - &m).unwrap().broadcast_mul(&min).unwrap();
    let encoder = BertEncoder::load(vb.pp("encoder"), &cfg).unwrap();
    let reference = encoder.forward(&x, &ext).unwrap();

    let (hidden, emb) = ours(&mut enc);
    assert_eq!(hidden.dtype(), dtype);
    assert_bit_identical(&hidden, &reference, &format!("{name} hidden states"));
    let ref_emb = reference_pool(&reference, &batch.attention_mask);
    for (a, b) in emb.iter().zip(&ref_emb) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} pooled embeddings differ");
    }
    let c = cosine(&emb[0], &emb[1]);
    eprintln!("all-MiniLM-L6-v2 {name} cosine: {c}");
    assert_eq!(c, cosine(&ref_emb[0], &ref_emb[1]));
    assert!((0.74..0.77).contains(&c), "cosine {c}");
}

#[test]
fn minilm_f16_matches_candle_transformers_encoder_bit_for_bit() {
    half_parity(DType::F16, Tensor::new(half::f16::MIN, &Device::Cpu).unwrap());
}

#[test]
fn minilm_bf16_matches_candle_transformers_encoder_bit_for_bit() {
    half_parity(DType::BF16, Tensor::new(half::bf16::MIN, &Device::Cpu).unwrap());
}

#[test]
fn minilm_trace_names_every_op() {
    let dir = minilm_path();
    let mut enc = load_folder(&dir, DType::F32, &Device::Cpu).unwrap();
    let (mut tr, sink) = memory_tracer();
    let emb = embed(&mut enc, &texts(), &mut tr).unwrap();
    let items = sink.items.lock().unwrap();
    let forwards: Vec<_> = items.iter().filter_map(|i| if let Item::Forward(f) = i { Some(f) } else { None }).collect();
    assert_eq!(forwards.len(), 1);
    assert_eq!((forwards[0].batch, forwards[0].seq_len, forwards[0].index_pos), (2, 11, 0));
    assert_eq!(emb.len(), 2);
    assert!(!items.iter().any(|i| matches!(i, Item::Embeddings(_))), "the caller records the embeddings");
    let sites: HashMap<&str, &str> = items.iter().filter_map(|i| if let Item::Site { path, op, .. } = i { Some((path.as_str(), op.as_str())) } else { None }).collect();
    for (path, op) in [
        ("input_ids", "input"),
        ("embeddings.word_embeddings", "embedding"),
        ("embeddings.LayerNorm", "layer_norm"),
        ("encoder.layer.0.attention.self.query", "linear"),
        ("encoder.layer.0.attention.self.scores", "matmul"),
        ("encoder.layer.0.attention.self.scale", "scale"),
        ("encoder.layer.0.attention.self.mask_add", "mask_add"),
        ("encoder.layer.0.attention.self.softmax", "softmax"),
        ("encoder.layer.0.attention.self.attn_v", "matmul"),
        ("encoder.layer.0.attention.output.dense", "linear"),
        ("encoder.layer.0.attention.output.residual", "add"),
        ("encoder.layer.0.attention.output.LayerNorm", "layer_norm"),
        ("encoder.layer.5.intermediate.act", "gelu"),
        ("encoder.layer.5.output.LayerNorm", "layer_norm"),
        ("pooler.mean", "mean_pool"),
        ("pooler.normalize", "normalize"),
    ] {
        assert_eq!(sites.get(path), Some(&op), "site {path}");
    }
    let model_paths: Vec<&str> = enc.model.sites().map(|s| s.path.as_str()).collect();
    for path in sites.keys() {
        assert!(model_paths.contains(path), "{path} not in sites()");
    }
    assert!(!sites.contains_key("pooler.to_f32"), "f32 activations need no conversion");
    // 9 embedding-level records + 16 per layer + mean + normalize.
    assert_eq!(tr.op_records(), 9 + 16 * 6 + 2);
}

// ---- tiny BERT folders, no download needed ----

const TINY_CONFIG: &str = r#"{"model_type": "bert", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
  "num_attention_heads": 2, "intermediate_size": 16, "hidden_act": "gelu", "max_position_embeddings": 16,
  "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}"#;

const TINY_TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]}, "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4, "b": 5, "c": 6, "d": 7}, "unk_token": "[UNK]"}}"#;

/// A complete tiny BERT folder (weights from a fixed formula) with mean+normalize pooling,
/// leaving out the tensor `skip`.
pub(crate) fn tiny_folder(dir: &Path, skip: Option<&str>) {
    std::fs::write(dir.join("config.json"), TINY_CONFIG).unwrap();
    std::fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER).unwrap();
    std::fs::write(
        dir.join("modules.json"),
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::write(dir.join("1_Pooling/config.json"), r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}"#).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("embeddings.word_embeddings.weight".into(), vec![8, 8]),
        ("embeddings.position_embeddings.weight".into(), vec![16, 8]),
        ("embeddings.token_type_embeddings.weight".into(), vec![2, 8]),
        ("embeddings.LayerNorm.weight".into(), vec![8]),
        ("embeddings.LayerNorm.bias".into(), vec![8]),
    ];
    for i in 0..2 {
        let l = format!("encoder.layer.{i}");
        for (m, o, n) in
            [("attention.self.query", 8, 8), ("attention.self.key", 8, 8), ("attention.self.value", 8, 8), ("attention.output.dense", 8, 8), ("intermediate.dense", 16, 8), ("output.dense", 8, 16)]
        {
            shapes.push((format!("{l}.{m}.weight"), vec![o, n]));
            shapes.push((format!("{l}.{m}.bias"), vec![o]));
        }
        for m in ["attention.output.LayerNorm", "output.LayerNorm"] {
            shapes.push((format!("{l}.{m}.weight"), vec![8]));
            shapes.push((format!("{l}.{m}.bias"), vec![8]));
        }
    }
    let mut tensors = HashMap::new();
    for (k, (name, shape)) in shapes.into_iter().enumerate() {
        if Some(name.as_str()) == skip {
            continue;
        }
        let n: usize = shape.iter().product();
        let t = (Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap() * (0.37 + k as f64 * 0.11)).unwrap().sin().unwrap().reshape(shape).unwrap();
        tensors.insert(name, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
}

/// Asserts a one-line `Error::Model` naming `path` and containing `needle`.
fn refused(dir: &Path, path: &Path, needle: &str) {
    let err = match load_folder(dir, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    };
    assert!(matches!(err, candle_trace::Error::Model { .. }), "{err:?}");
    let msg = err.to_string();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg} should name {}", path.display());
    assert!(msg.contains(needle), "{msg} should say {needle:?}");
}

#[test]
fn tiny_folder_embeds() {
    let d = tmp();
    tiny_folder(d.path(), None);
    let mut enc = load_folder(d.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(enc.pooling, Pooling::MeanNormalize);
    assert_eq!(enc.pooling.as_str(), "mean+normalize");
    assert_eq!(enc.info.n_layers, 2);
    let texts: Vec<String> = vec!["a b c".into(), "d".into(), "a b c d a b c d a b c d a b c d a b".into()];
    let batch = tokenize(&enc, &texts).unwrap();
    assert_eq!(batch.tokens[1], vec![2, 7, 3]);
    assert_eq!(batch.tokens[2].len(), 16, "truncated at max_position_embeddings");
    let (mut tr, _) = memory_tracer();
    let emb = embed(&mut enc, &texts, &mut tr).unwrap();
    assert_eq!(emb.len(), 3);
    for v in &emb {
        assert_eq!(v.len(), 8);
        let n: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((n - 1.0).abs() < 1e-5, "norm {n}");
    }
    // Padding is hidden: the short text alone gives the same embedding (within rounding).
    let alone = embed(&mut enc, &texts[1..2], &mut Tracer::untraced()).unwrap();
    assert!(cosine(&alone[0], &emb[1]) > 0.99999);
    // Half precision runs (the f32::MIN mask would make it all NaN) and records the conversion.
    let mut half = load_folder(d.path(), DType::BF16, &Device::Cpu).unwrap();
    let (mut tr, sink) = memory_tracer();
    let emb16 = embed(&mut half, &texts, &mut tr).unwrap();
    assert!(emb16.iter().flatten().all(|x| x.is_finite()));
    assert!(cosine(&emb16[1], &emb[1]) > 0.99);
    let items = sink.items.lock().unwrap();
    assert!(items.iter().any(|i| matches!(i, Item::Site { path, .. } if path == "pooler.to_f32")));
    // No text, or a dtype the model cannot run in.
    assert!(matches!(embed(&mut enc, &[], &mut Tracer::untraced()), Err(candle_trace::Error::Usage(_))));
    let err = load_folder(d.path(), DType::U32, &Device::Cpu).err().expect("u32 refused");
    assert!(err.to_string().contains("dtype u32"), "{err}");
}

#[test]
fn cls_pooling_and_plain_folder() {
    let d = tmp();
    tiny_folder(d.path(), None);
    std::fs::write(d.path().join("1_Pooling/config.json"), r#"{"pooling_mode_mean_tokens": false, "pooling_mode_cls_token": true}"#).unwrap();
    let enc = load_folder(d.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(enc.pooling, Pooling::ClsNormalize);
    std::fs::remove_file(d.path().join("modules.json")).unwrap();
    let mut enc = load_folder(d.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(enc.pooling, Pooling::Mean, "no modules.json: sentence-transformers' fallback");
    let (mut tr, sink) = memory_tracer();
    embed(&mut enc, &["a b".to_string()], &mut tr).unwrap();
    let items = sink.items.lock().unwrap();
    assert!(!items.iter().any(|i| matches!(i, Item::Site { path, .. } if path == "pooler.normalize")));
    drop(items);
    // A decoder's flags are refused, not ignored: one forward pass embeds the sentences.
    let o = d.path().join("o.trace");
    for (flag, says) in [(["--max-tokens", "5"], "--max-tokens with --text: "), (["--temperature", "0.5"], "the sampling flags apply to decoders")] {
        let (code, _, err) = trace_s(&[&["record", "--model", p(d.path()), "--text", "a b", "--quiet", "-o", p(&o)][..], &flag[..]].concat());
        assert_eq!(code, 2, "{flag:?}: {err}");
        assert!(err.contains(says) && err.lines().count() == 1, "{flag:?}: {err}");
    }
    assert!(!o.exists());
}

/// A sharded encoder folder embeds bit for bit as the single file does.
#[test]
fn sharded_folder_embeds_the_same() {
    let d = tmp();
    tiny_folder(d.path(), None);
    let texts: Vec<String> = vec!["a b c".into(), "d".into()];
    let mut enc = load_folder(d.path(), DType::F32, &Device::Cpu).unwrap();
    let single = embed(&mut enc, &texts, &mut Tracer::untraced()).unwrap();
    crate::util::shard_folder(d.path());
    let mut enc = load_folder(d.path(), DType::F32, &Device::Cpu).unwrap();
    let sharded = embed(&mut enc, &texts, &mut Tracer::untraced()).unwrap();
    let b = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(b(&single), b(&sharded));
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    refused(d.path(), &d.path().join("model-00002-of-00002.safetensors"), "shard named by model.safetensors.index.json is missing");
}

/// modules.json names subfolders of the model folder only; a layer count from config.json is
/// checked before anything is sized by it.
#[test]
fn module_paths_and_layer_counts_are_checked() {
    let d = tmp();
    tiny_folder(d.path(), None);
    let modules = std::fs::read_to_string(d.path().join("modules.json")).unwrap().replace("\"1_Pooling\"", "\"../1_Pooling\"");
    std::fs::write(d.path().join("modules.json"), modules).unwrap();
    refused(d.path(), &d.path().join("modules.json"), "is not a subfolder of the model folder");
    tiny_folder(d.path(), None);
    std::fs::write(d.path().join("config.json"), TINY_CONFIG.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1000000000")).unwrap();
    refused(d.path(), &d.path().join("config.json"), "num_hidden_layers 1000000000 is over the 4096");
}

#[test]
fn folder_without_config_json() {
    let d = tmp();
    tiny_folder(d.path(), None);
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    refused(d.path(), d.path(), "no config.json");
    let missing = d.path().join("nope");
    refused(&missing, &missing, "no such folder");
    refused(&d.path().join("model.safetensors"), &d.path().join("model.safetensors"), "not a folder");
}

#[test]
fn folder_without_tokenizer_json() {
    let d = tmp();
    tiny_folder(d.path(), None);
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    refused(d.path(), &d.path().join("tokenizer.json"), "missing");
}

#[test]
fn safetensors_missing_a_tensor() {
    let d = tmp();
    tiny_folder(d.path(), Some("encoder.layer.1.attention.self.key.bias"));
    refused(d.path(), &d.path().join("model.safetensors"), "missing tensor encoder.layer.1.attention.self.key.bias");
}

#[test]
fn unsupported_model_type() {
    let d = tmp();
    tiny_folder(d.path(), None);
    std::fs::write(d.path().join("config.json"), TINY_CONFIG.replace("\"bert\"", "\"roberta\"")).unwrap();
    refused(d.path(), &d.path().join("config.json"), "unsupported model_type 'roberta'");
    std::fs::write(d.path().join("config.json"), "{not json").unwrap();
    refused(d.path(), &d.path().join("config.json"), "invalid JSON");
}

/// Bisect on an encoder: a one-bit perturbation of a softmax is named as the root cause (the
/// attention inputs are compared over every key of the row), and the cosine shown by `show` is the
/// reference one.
#[test]
fn minilm_record_show_and_perturb_bisect() {
    use crate::util::{p, tmp, trace_s};
    let dir = minilm_path();
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--model", p(&dir), "--text", "A man is eating food.", "--text", "A man is eating a piece of bread."];
    let (code, _, err) = trace_s(&[&base[..], &["-o", p(&a)]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = trace_s(&[&base[..], &["--perturb", "encoder.layer.2.attention.self.softmax@3", "-o", p(&b)]].concat());
    assert_eq!(code, 0, "{err}");
    let (_, show, _) = trace_s(&["show", p(&a)]);
    assert!(show.contains("[0] 1.000000 0.755337"), "{show}");
    // The padded row's additive mask fill (f32::MIN) is no activation: left out, and said so.
    assert!(!show.contains("3.40e38") && show.contains("max |x| leaves out the 6 outputs of attention-mask ops"), "{show}");
    let (_, js, _) = trace_s(&["show", p(&a), "--format", "json"]);
    let layers = crate::util::json(&js)["layers"].as_array().unwrap().clone();
    let l0 = layers.iter().find(|l| l["layer"] == "encoder.layer.0").unwrap();
    assert!(l0["masks_left_out"] == 1 && l0["abs_max"].as_f64().unwrap() < 1e4, "{l0}");
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let fd = &v["first_divergence"];
    assert_eq!((fd["path"].as_str(), fd["position"].as_u64(), fd["layer"].as_u64()), (Some("encoder.layer.2.attention.self.softmax"), Some(3), Some(2)), "{out}");
    let (code, _, _) = trace_s(&["bisect", p(&a), p(&a)]);
    assert_eq!(code, 0);
    // The same texts in the other row order: each request's embedding is the same, and the
    // pooled batch outputs (no token axis, their rows swapped) are not compared whole (it said
    // "diverged": a fresh-user trial).
    let c = d.path().join("c.trace");
    assert_eq!(trace_s(&["record", "--model", p(&dir), "--text", "A man is eating a piece of bread.", "--text", "A man is eating food.", "-o", p(&c)]).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&c)]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("verdict: identical") && out.contains("2 batch output(s) without a token axis were not compared"), "{out}");
}

/// Encoder runs: decoder-only knobs and impossible perturbations are refused before running;
/// a batch that repeats a text compares row by row (no "inputs differ").
#[test]
fn minilm_knobs_perturb_checks_and_rows() {
    use crate::util::{p, tmp, trace_s};
    let dir = minilm_path();
    let d = tmp();
    let o = d.path().join("x.trace");
    let m = p(&dir);
    for (args, needle) in [
        (vec!["--batch", "0"], "--batch"),
        (vec!["--prefill-chunk", "1"], "--prefill-chunk"),
        (vec!["--perturb", "encoder.layer.9.attention.self.softmax"], "no op at that module path"),
        (vec!["--perturb", "encoder.layer.0.attention.self.softmax@50"], "never computed"),
        (vec!["--perturb", "input_ids"], "integers"),
    ] {
        let (code, _, err) = trace_s(&[&["record", "--model", m, "--text", "A man is eating food.", "-o", p(&o)][..], &args[..]].concat());
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle) && err.lines().count() == 1, "{args:?}: {err}");
        assert!(!o.exists());
    }
    let (one, two) = (d.path().join("one.trace"), d.path().join("two.trace"));
    assert_eq!(trace_s(&["record", "--model", m, "--text", "A man is eating food.", "-o", p(&one)]).0, 0);
    assert_eq!(trace_s(&["record", "--model", m, "--text", "A man is eating food.", "--text", "A man is eating food.", "-o", p(&two)]).0, 0);
    let (_, out, _) = trace_s(&["bisect", p(&one), p(&two), "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["inputs_differ"].is_null(), "{out}");
}

/// A text alone vs eight copies of it in one batch: eight per-request answers, each copy paired
/// with the text alone (many to one), none "without a counterpart"; copies that agree with each
/// other are not reported by bisect or show.
#[test]
fn minilm_eight_copies_each_get_an_answer() {
    use crate::util::{json, p, tmp, trace_s};
    let dir = minilm_path();
    let d = tmp();
    let (one, eight) = (d.path().join("one.trace"), d.path().join("eight.trace"));
    let text = ["--text", "A man is eating food."];
    assert_eq!(trace_s(&[&["record", "--model", p(&dir), "-o", p(&one)][..], &text[..]].concat()).0, 0);
    assert_eq!(trace_s(&[&["record", "--model", p(&dir), "-o", p(&eight)][..], &text.repeat(8)[..]].concat()).0, 0);
    let (_, out, _) = trace_s(&["bisect", p(&one), p(&eight), "--format", "json"]);
    let v = json(&out);
    let rows = v["rows"].as_array().unwrap();
    let pairs: Vec<(u64, u64)> = rows.iter().map(|r| (r["a_row"].as_u64().unwrap(), r["b_row"].as_u64().unwrap())).collect();
    assert_eq!(pairs, (0..8).map(|b| (0, b)).collect::<Vec<_>>(), "{out}");
    assert!(rows.iter().all(|r| r["embedding"]["dims"] == 384), "every copy's embedding compared: {out}");
    let notes = v["notes"].to_string();
    assert!(!notes.contains("no counterpart") && !notes.contains("hold the same request but differ"), "{notes}");
    let (_, shown, _) = trace_s(&["show", p(&eight)]);
    assert!(!shown.contains("hold the same request"), "{shown}");
    // The other way round: every copy in a answers against the one in b.
    let (_, out, _) = trace_s(&["bisect", p(&eight), p(&one), "--format", "json"]);
    let v = json(&out);
    let pairs: Vec<(u64, u64)> = v["rows"].as_array().unwrap().iter().map(|r| (r["a_row"].as_u64().unwrap(), r["b_row"].as_u64().unwrap())).collect();
    assert_eq!(pairs, (0..8).map(|a| (a, 0)).collect::<Vec<_>>(), "{out}");
    assert!(!v["notes"].to_string().contains("no counterpart"), "{out}");
}

/// Every kind of encoder op replays from its dumped operands to the recorded bits.
#[test]
fn minilm_ops_replay() {
    use crate::util::{p, tmp, trace_s};
    let dir = minilm_path();
    let d = tmp();
    let a = d.path().join("a.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(&dir), "--text", "A man is eating food.", "--text", "A man.", "--dump", "all", "-o", p(&a)]);
    assert_eq!(code, 0, "{err}");
    let kinds = crate::replay::replay_each_kind(&a);
    for k in ["Input", "Embedding", "LayerNorm { eps: 1e-12 }", "Gelu { erf: true }", "MeanPool", "Normalize", "Softmax { fused: false }"] {
        assert!(kinds.contains(k), "{k} missing from {kinds:?}");
    }
}

/// `--numerics upstream` reproduces candle-transformers' `BertModel` exactly, its half-precision
/// mask included: a padded f16 batch gives NaN hidden states, bit for bit as upstream's.
#[test]
fn minilm_f16_upstream_numerics_match_bert_model_nan_included() {
    let dir = minilm_path();
    let mut enc = load_folder(&dir, DType::F16, &Device::Cpu).unwrap();
    enc.model.set_upstream_mask().unwrap();
    let batch = tokenize(&enc, &texts()).unwrap();
    let (vb, cfg) = upstream_vb(&dir, DType::F16);
    let upstream = BertModel::load(vb, &cfg).unwrap().forward(&batch.input_ids, &batch.token_type_ids, Some(&batch.attention_mask)).unwrap();
    let (hidden, _) = ours(&mut enc);
    assert!(hidden.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| x.is_nan()));
    assert_bit_identical(&hidden, &upstream, "f16 hidden states, upstream numerics");
}

/// `trace check` of an encoder: its rows say whether the embedding differs and by how much (the
/// table said "numbers differ, tokens same" and "below resolution" under a logits column for an
/// f16 embedding 1.86e-4 away; found by a fresh-user trial).
#[test]
fn check_of_an_encoder_reports_the_embedding() {
    let m = minilm_path();
    let d = tmp();
    let out = d.path().join("chk");
    let (code, json_out, err) = trace_s(&["check", "--model", p(&m), "--text", "A man is eating food.", "--runs", "1", "--vary", "dtype", "--out", p(&out), "--format", "json", "--quiet"]);
    assert_eq!(code, 1, "{err}");
    let v = json(&json_out);
    let row = v["rows"].as_array().unwrap().iter().find(|r| r["knob"] == "dtype" && r["value"] == "f16").unwrap().clone();
    assert_eq!((row["verdict"].as_str(), row["encoder"].as_bool()), (Some("embedding_differs"), Some(true)), "{row}");
    assert!(row["logits_max_abs_diff"].as_f64().unwrap() > 1e-5, "the embedding's own difference: {row}");
    let (_, text, _) = trace_s(&["check", "--collect", p(&out)]);
    assert!(text.contains("embedding max |Δ|") && text.contains("embedding differs") && !text.contains("tokens same") && !text.contains("below resolution"), "{text}");
}
