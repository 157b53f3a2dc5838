//! Hugging Face folders: the instrumented decoder matches candle-transformers' `models::llama`
//! (SmolLM2 folder made from the GGUF), `models::qwen2` and `models::mistral` (small seeded
//! folders written here) bit for bit, in f32 and in a half type; the SmolLM2 folder records and
//! bisects like the GGUF file; bad folders are one-line errors.

use crate::util::{p, smollm2_hf_path, tmp, trace_s};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_trace::models::hf;
use candle_trace::record::Phase;
use candle_trace::tracer::{MemorySink, Tracer};
use std::collections::HashMap;
use std::path::Path;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn vb(dir: &Path, dtype: DType) -> VarBuilder<'static> {
    unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], dtype, &Device::Cpu).unwrap() }
}

/// Runs `prompt` (in `chunk`-sized pieces) then 2 greedy decode steps through ours, under
/// upstream's numerics (`--numerics upstream`: in f16 and bf16, candle's softmax), and through
/// `upstream(ids, index_pos)`, asserting identical logits bits at every pass.
fn compare(dir: &Path, dtype: DType, prompt: &[u32], chunk: usize, mut upstream: impl FnMut(&Tensor, usize) -> Tensor) {
    let (mut ours, _, _) = hf::load_decoder(dir, dtype, &Device::Cpu).unwrap();
    ours.set_upstream_numerics();
    let mut tr = Tracer::new(Box::new(MemorySink::default()));
    let mut pos = 0;
    let mut logits = None;
    for part in prompt.chunks(chunk) {
        let ids = Tensor::new(part, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let a = upstream(&ids, pos);
        let b = ours.forward(&mut tr, &ids, pos, Phase::Prefill).unwrap();
        assert_eq!(bits(&a), bits(&b), "{dtype:?} prefill logits differ at {pos}");
        pos += part.len();
        logits = Some(b);
    }
    let mut logits = logits.unwrap();
    for _ in 0..2 {
        let next = logits.argmax(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
        let ids = Tensor::new(&[next], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let a = upstream(&ids, pos);
        let b = ours.forward(&mut tr, &ids, pos, Phase::Decode).unwrap();
        assert_eq!(bits(&a), bits(&b), "{dtype:?} decode logits differ at {pos}");
        pos += 1;
        logits = b;
    }
}

fn llama_parity(dtype: DType, chunk: usize) {
    use candle_transformers::models::llama as up;
    let dir = smollm2_hf_path();
    let cfg: up::LlamaConfig = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let model = up::Llama::load(vb(&dir, dtype), &cfg).unwrap();
    let mut cache = up::Cache::new(true, dtype, &cfg, &Device::Cpu).unwrap();
    let prompt = [1u32, 4093, 198, 31530, 549, 563, 7778, 6173, 1744, 1483, 30, 2, 198, 1, 520, 9531, 198];
    compare(&dir, dtype, &prompt, chunk, |ids, pos| model.forward(ids, pos, &mut cache).unwrap());
}

#[test]
fn llama_folder_f32_matches_models_llama() {
    llama_parity(DType::F32, usize::MAX);
}

#[test]
fn llama_folder_f32_chunked_matches_models_llama() {
    llama_parity(DType::F32, 5);
}

#[test]
fn llama_folder_bf16_matches_models_llama() {
    llama_parity(DType::BF16, usize::MAX);
}

/// Deterministic pseudo-random weights (SplitMix64 → uniform [-a, a)).
struct Rng(u64);
impl Rng {
    fn tensor(&mut self, shape: &[usize], a: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = self.0;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

/// Writes a small seeded decoder folder: hidden 64, 2 layers, 4 heads over 2 KV heads, vocab 97.
pub(crate) fn seeded_folder(dir: &Path, config: serde_json::Value, qkv_bias: bool, lm_head: bool) {
    let (h, i, v, kv) = (64usize, 96usize, 97usize, 32usize);
    let mut rng = Rng(7);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert("model.embed_tokens.weight".into(), rng.tensor(&[v, h], 1.0));
    t.insert("model.norm.weight".into(), (rng.tensor(&[h], 0.1) + 1.0).unwrap());
    if lm_head {
        t.insert("lm_head.weight".into(), rng.tensor(&[v, h], 0.125));
    }
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for (name, out, inp) in
            [("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h), ("self_attn.o_proj", h, h), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)]
        {
            t.insert(format!("{p}.{name}.weight"), rng.tensor(&[out, inp], 1.0 / (inp as f32).sqrt()));
            if qkv_bias && ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"].contains(&name) {
                t.insert(format!("{p}.{name}.bias"), rng.tensor(&[out], 0.1));
            }
        }
        t.insert(format!("{p}.input_layernorm.weight"), (rng.tensor(&[h], 0.1) + 1.0).unwrap());
        t.insert(format!("{p}.post_attention_layernorm.weight"), (rng.tensor(&[h], 0.1) + 1.0).unwrap());
    }
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

pub(crate) fn qwen2_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "sliding_window": 4096, "max_window_layers": 2,
        "tie_word_embeddings": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "use_sliding_window": false, "hidden_act": "silu"
    })
}

pub(crate) fn mistral_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "mistral", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 6, "hidden_act": "silu"
    })
}

pub(crate) const PROMPT: [u32; 11] = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46];

fn qwen2_parity(dtype: DType, chunk: usize) {
    use candle_transformers::models::qwen2 as up;
    let d = tmp();
    seeded_folder(d.path(), qwen2_config(), true, false);
    let cfg: up::Config = serde_json::from_value(qwen2_config()).unwrap();
    let mut model = up::ModelForCausalLM::new(&cfg, vb(d.path(), dtype)).unwrap();
    compare(d.path(), dtype, &PROMPT, chunk, |ids, pos| model.forward(ids, pos).unwrap().squeeze(1).unwrap());
}

fn mistral_parity(dtype: DType, chunk: usize) {
    use candle_transformers::models::mistral as up;
    let d = tmp();
    seeded_folder(d.path(), mistral_config(), false, true);
    let cfg: up::Config = serde_json::from_value(mistral_config()).unwrap();
    let mut model = up::Model::new(&cfg, vb(d.path(), dtype)).unwrap();
    compare(d.path(), dtype, &PROMPT, chunk, |ids, pos| model.forward(ids, pos).unwrap().squeeze(1).unwrap());
}

#[test]
fn qwen2_folder_f32_matches_models_qwen2() {
    qwen2_parity(DType::F32, usize::MAX);
    qwen2_parity(DType::F32, 4);
}

#[test]
fn qwen2_folder_bf16_matches_models_qwen2() {
    qwen2_parity(DType::BF16, usize::MAX);
}

#[test]
fn mistral_folder_f32_matches_models_mistral() {
    mistral_parity(DType::F32, usize::MAX);
    mistral_parity(DType::F32, 4);
}

#[test]
fn mistral_folder_f16_matches_models_mistral() {
    mistral_parity(DType::F16, usize::MAX);
}

/// The SmolLM2 folder records and bisects like the GGUF file: whole vs one-token prefill diverge
/// and bisect names an op whose inputs matched.
#[test]
fn smollm2_folder_records_and_bisects() {
    let dir = smollm2_hf_path();
    let d = tmp();
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--model", p(&dir), "--chat", "--max-tokens", "12"];
    let (code, text_a, err) = trace_s(&[&base[..], &["-o", p(&a)]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(text_a.starts_with("Richard Feynman was a renowned physicist"), "{text_a}");
    assert_eq!(trace_s(&[&base[..], &["--prefill-chunk", "1", "-o", p(&b)]].concat()).0, 0);
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["first_divergence"]["inputs_matched"], true, "{out}");
    let (_, show, _) = trace_s(&["show", p(&a)]);
    assert!(show.contains("model        llama-dd7fdc71150b") && show.contains("llama 30 layers") && !show.contains("smollm2-hf"), "{show}");
}

/// A sharded folder (model.safetensors.index.json) loads the same weights as the single file:
/// identical logits bits, and a name and sha256 from the shards' hashes.
#[test]
fn sharded_folder_gives_the_same_logits() {
    let d = tmp();
    seeded_folder(d.path(), qwen2_config(), true, false);
    let run = |dir: &Path| {
        let (mut m, _, info) = hf::load_decoder(dir, DType::F32, &Device::Cpu).unwrap();
        let ids = Tensor::new(&[3u32, 14, 15, 92, 65], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        (bits(&m.forward(&mut Tracer::untraced(), &ids, 0, Phase::Prefill).unwrap()), info)
    };
    let (single, info1) = run(d.path());
    crate::util::shard_folder(d.path());
    let (sharded, info2) = run(d.path());
    assert_eq!(single, sharded);
    assert_ne!(info1.sha256, info2.sha256, "a sharded folder hashes its shards' hashes");
    assert!(info2.name.starts_with("qwen2-") && info2.size > 0, "{info2:?}");
    // An index naming a file outside the folder is refused, one line.
    let index = d.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap().replacen("model-00001-of-00002", "../model-00001-of-00002", 1);
    std::fs::write(&index, text).unwrap();
    let err = hf::load_decoder(d.path(), DType::F32, &Device::Cpu).err().expect("refused").to_string();
    assert!(err.contains("not a file of this folder") && !err.contains('\n'), "{err}");
    // One tensor in both shards: which copy loads would depend on file names.
    let text = std::fs::read_to_string(&index).unwrap().replace("../model-00001-of-00002", "model-00001-of-00002");
    std::fs::write(&index, text).unwrap();
    let one = d.path().join("model-00001-of-00002.safetensors");
    let mut t = candle_core::safetensors::load(&one, &Device::Cpu).unwrap();
    let other = candle_core::safetensors::load(d.path().join("model-00002-of-00002.safetensors"), &Device::Cpu).unwrap();
    let (name, tensor) = other.iter().next().unwrap();
    t.insert(name.clone(), tensor.clone());
    candle_core::safetensors::save(&t, &one).unwrap();
    let err = hf::load_decoder(d.path(), DType::F32, &Device::Cpu).err().expect("refused").to_string();
    assert!(err.contains(&format!("tensor {name} is in two shards")), "{err}");
}

/// Counts and files a crafted folder gives are checked before they size anything: a layer
/// count of 10^12, a tokenizer_config.json that is a device.
#[test]
fn crafted_folder_sizes_and_files_are_refused() {
    let d = tmp();
    let mut cfg = qwen2_config();
    cfg["num_hidden_layers"] = serde_json::json!(1_000_000_000_000u64);
    seeded_folder(d.path(), qwen2_config(), true, false);
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    let err = hf::load_decoder(d.path(), DType::F32, &Device::Cpu).err().expect("refused").to_string();
    assert!(err.contains("num_hidden_layers 1000000000000 is over the 4096"), "{err}");
    std::fs::write(d.path().join("config.json"), qwen2_config().to_string()).unwrap();
    word_tokenizer(d.path());
    std::os::unix::fs::symlink("/dev/zero", d.path().join("tokenizer_config.json")).unwrap();
    let o = d.path().join("x.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(d.path()), "-o", p(&o)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tokenizer_config.json") && err.contains("not a regular file") && err.lines().count() == 1, "{err}");
}

#[test]
fn bad_folders_are_one_line_errors() {
    let d = tmp();
    let o = d.path().join("x.trace");
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let check = |args: &[&str], needles: &[&str]| {
        let (code, _, err) = trace_s(args);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        for n in needles {
            assert!(err.contains(n), "missing {n:?} in {err}");
        }
    };
    check(&["record", "--model", p(&empty), "-o", p(&o)], &["empty", "no config.json"]);
    let gpt = d.path().join("gpt");
    std::fs::create_dir(&gpt).unwrap();
    std::fs::write(gpt.join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    check(&["record", "--model", p(&gpt), "-o", p(&o)], &["unsupported architecture 'gpt2'", "llama, qwen2, mistral, bert"]);
    let q = d.path().join("qwen");
    seeded_folder(&q, qwen2_config(), true, false);
    check(&["record", "--model", p(&q), "-o", p(&o)], &["qwen", "no tokenizer.json"]);
    check(&["record", "--model", p(&q), "--dtype", "q", "-o", p(&o)], &["--dtype q needs a GGUF file"]);
    // A safetensors file missing one tensor.
    let m = d.path().join("missing");
    seeded_folder(&m, mistral_config(), false, true);
    let mut t = candle_core::safetensors::load(m.join("model.safetensors"), &Device::Cpu).unwrap();
    t.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&t, m.join("model.safetensors")).unwrap();
    let err = hf::load_decoder(&m, DType::F32, &Device::Cpu).err().expect("missing tensor refused").to_string();
    assert!(err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing") && !err.contains('\n'), "{err}");
}

/// A tokenizer.json for the seeded folders: words `t0` … `t96` are ids 0 … 96.
fn word_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..97).map(|i| (format!("t{i}"), serde_json::json!(i))).collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

/// One huge embedding value for token 65 meets a large norm weight: in f16 the first input norm
/// overflows at the position of token 65 only, from finite inputs.
fn nonfinite_folder(dir: &Path) {
    seeded_folder(dir, mistral_config(), false, true);
    let path = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut emb = t["model.embed_tokens.weight"].to_vec2::<f32>().unwrap();
    emb[65] = vec![0.0; 64];
    emb[65][0] = 65000.0;
    t.insert("model.embed_tokens.weight".into(), Tensor::new(emb, &Device::Cpu).unwrap());
    let mut w = t["model.layers.0.input_layernorm.weight"].to_vec1::<f32>().unwrap();
    w[0] = 10000.0;
    t.insert("model.layers.0.input_layernorm.weight".into(), Tensor::new(w, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&t, &path).unwrap();
    word_tokenizer(dir);
}

#[test]
fn first_nonfinite_names_op_layer_and_position() {
    let d = tmp();
    nonfinite_folder(d.path());
    let o = d.path().join("nf.trace");
    // Token 65 sits at position 4 of the prompt.
    let prompt = "t3 t14 t15 t92 t65 t35 t89";
    let (code, _, err) = trace_s(&["record", "--model", p(d.path()), "--dtype", "f16", "--prompt", prompt, "--max-tokens", "3", "-o", p(&o)]);
    assert_eq!(code, 0, "{err}");
    let t = candle_trace::format::read_trace(&o).unwrap();
    let n = candle_trace::nonfinite::first_nonfinite(&t).expect("a non-finite value");
    assert_eq!((n.path.as_str(), n.op.as_str(), n.layer, n.position, n.row), ("layers.0.input_layernorm", "rms_norm", Some(0), Some(4), Some(0)));
    assert!(n.inputs_finite, "{n:?}");
    assert!(n.pos_inf + n.neg_inf + n.nan > 0);
    let (_, show, _) = trace_s(&["show", p(&o)]);
    assert!(show.contains("first non-finite value: layers.0.input_layernorm (rms_norm), layer 0, step 0 at token position 4"), "{show}");
    assert!(show.contains("this op made it"), "{show}");
    // --stop-on-nonfinite ends the run right there, with a complete trace.
    let s = d.path().join("stop.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(d.path()), "--dtype", "f16", "--prompt", prompt, "--max-tokens", "3", "--stop-on-nonfinite", "-o", p(&s)]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("stopped: nonfinite"), "{err}");
    let st = candle_trace::format::read_trace(&s).unwrap();
    assert!(!st.truncated);
    assert!(st.footer.as_ref().unwrap().stop.starts_with("nonfinite"));
    let last = st
        .items
        .iter()
        .rev()
        .find_map(|i| match i {
            candle_trace::record::Item::Op(r) => Some(r.seq),
            _ => None,
        })
        .unwrap();
    assert_eq!(last, n.seq, "the run ends with the op that made the first non-finite value");
    // f32 stays finite: bisect reports each side's first non-finite value.
    let f = d.path().join("f32.trace");
    assert_eq!(trace_s(&["record", "--model", p(d.path()), "--dtype", "f32", "--prompt", prompt, "--max-tokens", "3", "-o", p(&f)]).0, 0);
    let (_, out, _) = trace_s(&["bisect", p(&f), p(&o), "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["nonfinite"]["a"].is_null(), "{out}");
    assert_eq!(v["nonfinite"]["b"]["path"], "layers.0.input_layernorm");
}

/// A config.json change (same weights) shows up as a setting that differs.
#[test]
fn config_changes_are_listed_as_settings() {
    let d = tmp();
    let (x, y) = (d.path().join("m1"), d.path().join("m2"));
    seeded_folder(&x, mistral_config(), false, true);
    word_tokenizer(&x);
    let mut cfg = mistral_config();
    cfg["rope_theta"] = serde_json::json!(500000.0);
    seeded_folder(&y, cfg, false, true);
    word_tokenizer(&y);
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    for (m, o) in [(&x, &a), (&y, &b)] {
        let (code, _, err) = trace_s(&["record", "--model", p(m), "--prompt", "t1 t2 t3 t4", "--max-tokens", "2", "-o", p(o)]);
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, _) = trace_s(&["bisect", p(&a), p(&b), "--format", "json"]);
    assert_eq!(code, 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let diff: Vec<(&str, &str, &str)> = v["env_diff"].as_array().unwrap().iter().map(|e| (e["key"].as_str().unwrap(), e["a"].as_str().unwrap(), e["b"].as_str().unwrap())).collect();
    // Shown as the config's JSON, not as a string holding it.
    assert!(diff.contains(&("run.model.config.rope_theta", "10000.0", "500000.0")), "{diff:?}");
    // The first op to see rope_theta is the rotary embedding of layer 0.
    assert_eq!(v["first_divergence"]["path"], "layers.0.self_attn.rope_q", "{out}");
    // The model's config: the class, and a remedy naming the key with both values.
    assert_eq!(v["first_divergence"]["class"], "model_differs", "{out}");
    assert!(v["groups"][0]["remedy"].as_str().unwrap().contains("run.model.config.rope_theta (a 10000.0, b 500000.0)"), "{out}");
}

/// Every op kind of each folder architecture replays from a `--dump all` trace to the recorded
/// bits (llama in bf16, so its f32 attention and the cast back are included).
#[test]
fn folder_architectures_replay_every_op_kind() {
    let d = tmp();
    let llama = serde_json::json!({
        "model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false
    });
    for (name, cfg, bias, head, dtype) in [("llama", llama, false, true, "bf16"), ("qwen2", qwen2_config(), true, false, "f32"), ("mistral", mistral_config(), false, true, "f16")] {
        let dir = d.path().join(name);
        seeded_folder(&dir, cfg, bias, head);
        word_tokenizer(&dir);
        let o = d.path().join(format!("{name}.trace"));
        let (code, _, err) = trace_s(&["record", "--model", p(&dir), "--dtype", dtype, "--prompt", "t1 t2 t3 t4 t5", "--max-tokens", "3", "--dump", "all", "-o", p(&o)]);
        assert_eq!(code, 0, "{name}: {err}");
        let kinds = crate::replay::replay_each_kind(&o);
        assert!(kinds.len() >= 13, "{name}: {kinds:?}");
    }
}

/// An additive mask (qwen2): a NaN among query 3's masked keys of layer 0's mask makes layer
/// 0's output at position 3 NaN, so layer 1's keys and values at position 3; through
/// `scores + mask` (NaN + -inf is NaN) and attention's zero weights (0 × NaN) it reaches layer
/// 1's queries 0..=2 too. Bisect names the perturbed mask and position, not layer 1's mask at
/// position 0, whose own keys looked identical.
#[test]
fn nan_among_masked_keys_of_an_additive_mask_is_named_where_it_entered() {
    let d = tmp();
    seeded_folder(d.path(), qwen2_config(), true, false);
    word_tokenizer(d.path());
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--model", p(d.path()), "--prompt", "t3 t14 t15 t92 t65 t35 t89", "--max-tokens", "2"];
    let (code, _, err) = trace_s(&[&base[..], &["-o", p(&a)]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = trace_s(&[&base[..], &["--perturb", "layers.0.self_attn.mask@3#6", "-o", p(&b)]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b)]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("the numbers first parted here: layers.0.self_attn.mask (mask_add)\n  layer 0, token position 3 of the row"), "{out}");
    assert!(out.contains("cause: a fault injected by --perturb"), "{out}");
}
