//! Parity of the GGUF architectures no small real file ships for (qwen2, qwen3, phi3): seeded
//! files written with candle's GGUF writer, logits bit for bit against candle-transformers'
//! `quantized_qwen2`, `quantized_qwen3` and `quantized_phi3` (whole and chunked prefill, then
//! decode, traced and untraced), and batches where upstream fails.

use crate::parity::compare_logits;
use crate::util::{p, smollm2_path, tmp, trace_s};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_trace::models::{gguf, LoadedModel, WeightDtype};
use candle_trace::record::Phase;
use candle_trace::tracer::{MemorySink, Tracer};
use std::path::Path;

/// Deterministic values in `[-scale, scale)` (SplitMix64), for seeded model files.
fn seeded(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (seed << 32 ^ i).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Shapes of a seeded file: 2 layers, hidden 64, 4 query heads, MLP width 128.
const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const FFN: usize = 128;
const VOCAB: usize = 49152;

/// A seeded GGUF file of architecture `arch` written with candle's GGUF writer, with SmolLM2's
/// tokenizer metadata (its vocabulary size). The MLP's input projections are Q8_0; the
/// embeddings and output projection are `head`, the other weights f32: a Q8_0 matmul rounds its
/// input to 8 bits per block, so it would hide a one-ULP difference in the op before it, and a
/// parity test must see every bit:
/// - `qwen2`: 2 KV heads of 16, q/k/v biases;
/// - `qwen3`: `kv_heads` KV heads of 32 (`attention.key_length` 32, so the heads are wider than
///   `hidden / heads`), q/k norms, embeddings tied to the output;
/// - `phi3`: 4 KV heads of 16, fused `attn_qkv` and gate/up `ffn_up`.
pub fn write_seeded_gguf(path: &Path, arch: &str, kv_heads: usize, head: GgmlDType) {
    use gguf_file::Value;
    let dev = Device::Cpu;
    let (smol, _) = candle_trace::models::gguf::open(&smollm2_path()).unwrap();
    let (heads, head_dim) = (4usize, if arch == "qwen3" { 32 } else { HIDDEN / 4 });
    let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
    let mut seed = 0u64;
    let mut q = |dims: &[usize], scale: f32, dtype: GgmlDType| {
        seed += 1;
        let t = Tensor::from_vec(seeded(dims.iter().product(), seed, scale), dims, &dev).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![("token_embd.weight".into(), q(&[VOCAB, HIDDEN], 1.0, head)), ("output_norm.weight".into(), q(&[HIDDEN], 1.0, GgmlDType::F32))];
    if arch == "phi3" {
        tensors.push(("output.weight".into(), q(&[VOCAB, HIDDEN], 0.5, head)));
    }
    for l in 0..LAYERS {
        let n = |x: &str| format!("blk.{l}.{x}");
        tensors.push((n("attn_norm.weight"), q(&[HIDDEN], 1.0, GgmlDType::F32)));
        tensors.push((n("ffn_norm.weight"), q(&[HIDDEN], 1.0, GgmlDType::F32)));
        tensors.push((n("attn_output.weight"), q(&[HIDDEN, q_dim], 0.2, GgmlDType::F32)));
        tensors.push((n("ffn_down.weight"), q(&[HIDDEN, FFN], 0.2, GgmlDType::F32)));
        if arch == "phi3" {
            tensors.push((n("attn_qkv.weight"), q(&[q_dim + 2 * kv_dim, HIDDEN], 0.2, GgmlDType::F32)));
            tensors.push((n("ffn_up.weight"), q(&[2 * FFN, HIDDEN], 0.2, GgmlDType::Q8_0)));
            continue;
        }
        tensors.push((n("attn_q.weight"), q(&[q_dim, HIDDEN], 0.2, GgmlDType::F32)));
        tensors.push((n("attn_k.weight"), q(&[kv_dim, HIDDEN], 0.2, GgmlDType::F32)));
        tensors.push((n("attn_v.weight"), q(&[kv_dim, HIDDEN], 0.2, GgmlDType::F32)));
        tensors.push((n("ffn_gate.weight"), q(&[FFN, HIDDEN], 0.2, GgmlDType::Q8_0)));
        tensors.push((n("ffn_up.weight"), q(&[FFN, HIDDEN], 0.2, GgmlDType::Q8_0)));
        if arch == "qwen2" {
            tensors.push((n("attn_q.bias"), q(&[q_dim], 0.5, GgmlDType::F32)));
            tensors.push((n("attn_k.bias"), q(&[kv_dim], 0.5, GgmlDType::F32)));
            tensors.push((n("attn_v.bias"), q(&[kv_dim], 0.5, GgmlDType::F32)));
        }
        if arch == "qwen3" {
            tensors.push((n("attn_q_norm.weight"), q(&[head_dim], 1.0, GgmlDType::F32)));
            tensors.push((n("attn_k_norm.weight"), q(&[head_dim], 1.0, GgmlDType::F32)));
        }
    }
    let k = |x: &str| format!("{arch}.{x}");
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (k("context_length"), Value::U32(4096)),
        (k("embedding_length"), Value::U32(HIDDEN as u32)),
        (k("block_count"), Value::U32(LAYERS as u32)),
        (k("feed_forward_length"), Value::U32(FFN as u32)),
        (k("attention.head_count"), Value::U32(heads as u32)),
        (k("attention.head_count_kv"), Value::U32(kv_heads as u32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("rope.freq_base"), Value::F32(if arch == "phi3" { 10_000.0 } else { 1_000_000.0 })),
        (k("rope.dimension_count"), Value::U32(head_dim as u32)),
    ];
    if arch == "qwen3" {
        md.push((k("attention.key_length"), Value::U32(head_dim as u32)));
    }
    md.extend(smol.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())));
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
}

/// A model's forward pass: (token ids, position) to logits.
type Forward = Box<dyn FnMut(&Tensor, usize) -> candle_core::Result<Tensor>>;

/// candle-transformers' model of `arch`, loaded from `path`.
fn upstream(path: &Path, arch: &str) -> Forward {
    use candle_transformers::models::{quantized_phi3, quantized_qwen2, quantized_qwen3};
    let dev = Device::Cpu;
    let (ct, mut f) = candle_trace::models::gguf::open(path).unwrap();
    match arch {
        "qwen2" => {
            let mut m = quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, &dev).unwrap();
            Box::new(move |ids, pos| m.forward(ids, pos))
        }
        "qwen3" => {
            let mut m = quantized_qwen3::ModelWeights::from_gguf(ct, &mut f, &dev).unwrap();
            Box::new(move |ids, pos| m.forward(ids, pos))
        }
        _ => {
            let mut m = quantized_phi3::ModelWeights::from_gguf(false, ct, &mut f, &dev).unwrap();
            Box::new(move |ids, pos| m.forward(ids, pos))
        }
    }
}

fn load(path: &Path) -> LoadedModel {
    gguf::load(path, WeightDtype::Quantized, &Device::Cpu).unwrap()
}

/// Whole prefill traced, chunks of 3 traced, whole untraced: each then 3 decode steps, every
/// forward pass's logits bit for bit against upstream. Returns the paths the traced whole run
/// recorded.
fn parity(path: &Path, arch: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for (chunk, traced) in [(usize::MAX, true), (3, true), (usize::MAX, false)] {
        let mut up = upstream(path, arch);
        let mut ours = load(path);
        let prompt = ours.tokenizer.encode("Tell me about Richard Feynman.").unwrap();
        let sink = MemorySink::default();
        let mut tr = if traced { Tracer::new(Box::new(sink.clone())) } else { Tracer::untraced() };
        compare_logits(&mut |ids, pos| up(ids, pos).unwrap(), &mut ours.model, &prompt, chunk, 3, &mut tr);
        if traced && paths.is_empty() {
            let t = sink.trace("t", &candle_trace::record::Header::default());
            paths = t.items.iter().filter_map(|i| if let candle_trace::record::Item::Site { path, .. } = i { Some(path.clone()) } else { None }).collect();
        }
    }
    paths
}

/// Two copies of one prompt in a batch: our rows agree with each other bit for bit and with the
/// prompt alone to within `tol` (batch 2 may run other kernels than batch 1). Returns the batch.
fn batch_2(path: &Path, tol: f32) -> Tensor {
    let dev = Device::Cpu;
    let mut ours = load(path);
    let prompt = ours.tokenizer.encode("Tell me about Richard Feynman.").unwrap();
    let one = Tensor::new(prompt.as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
    let two = one.repeat((2, 1)).unwrap();
    let mut tr = Tracer::new(Box::new(MemorySink::default()));
    let alone = ours.model.forward(&mut tr, &one, 0, Phase::Prefill).unwrap();
    ours.model.clear_kv_cache();
    let both = ours.model.forward(&mut tr, &two, 0, Phase::Prefill).unwrap();
    let rows: Vec<Vec<f32>> = (0..2).map(|r| both.get(r).unwrap().to_vec1::<f32>().unwrap()).collect();
    assert_eq!(rows[0], rows[1], "batch rows differ");
    let diff = (both.get(0).unwrap() - alone.squeeze(0).unwrap()).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(diff <= tol, "batch row differs from the prompt alone by {diff}");
    two
}

/// qwen2 (seeded file): bit for bit against `quantized_qwen2`; the q/k/v biases are recorded as
/// operands of their projections; a batch of two prompts records from the command line; batch 2
/// works where upstream fails.
#[test]
fn qwen2_gguf_logits_bit_identical_to_quantized_qwen2() {
    let d = tmp();
    let path = d.path().join("qwen2.gguf");
    write_seeded_gguf(&path, "qwen2", 2, GgmlDType::F32);
    let paths = parity(&path, "qwen2");
    assert!(paths.iter().any(|p| p == "layers.1.self_attn.q_proj"), "{paths:?}");
    let (code, _, err) = trace_s(&["record", "--model", p(&path), "--prompt", "Hi", "--prompt", "Hello there", "--max-tokens", "3", "-o", p(&d.path().join("q.trace"))]);
    assert_eq!(code, 0, "{err}");
    let (code, shown, _) = trace_s(&["show", p(&d.path().join("q.trace"))]);
    assert_eq!(code, 0);
    assert!(shown.contains("qwen2 2 layers"), "{shown}");
    // Upstream takes the last position without making it contiguous: a quantized output
    // projection (as in real files) fails at batch > 1.
    write_seeded_gguf(&path, "qwen2", 2, GgmlDType::Q8_0);
    let two = batch_2(&path, 1e-4);
    let err = upstream(&path, "qwen2")(&two, 0).expect_err("upstream batch-2 prefill was expected to fail");
    assert!(err.to_string().contains("contiguous"), "unexpected upstream error: {err}");
}

/// qwen3 (seeded files, 2 and 1 KV heads: candle's decode kernel has its own path for two query
/// heads per KV head): bit for bit against `quantized_qwen3`, whose CPU attention at batch 1 is
/// candle_nn's flash kernels, recorded here as one `flash_attn` op after the per-head q/k norms.
#[test]
fn qwen3_gguf_logits_bit_identical_to_quantized_qwen3() {
    let d = tmp();
    for kv in [2, 1] {
        let path = d.path().join(format!("qwen3-kv{kv}.gguf"));
        write_seeded_gguf(&path, "qwen3", kv, GgmlDType::F32);
        let paths = parity(&path, "qwen3");
        for want in ["layers.0.self_attn.q_norm", "layers.0.self_attn.k_norm", "layers.1.self_attn.flash_attn"] {
            assert!(paths.iter().any(|p| p == want), "{want} not in {paths:?}");
        }
        assert!(!paths.iter().any(|p| p.ends_with("softmax")), "{paths:?}");
    }
}

/// qwen3 batches: upstream panics at batch > 1 on the CPU (its CPU model keeps only the flash
/// kernels' caches, and batch > 1 unwraps the other one). Here the batch runs the unfused
/// attention with a causal mask and agrees with the prompt alone to rounding; bisect of batch 1
/// against batch 2 says where the graphs part.
#[test]
fn qwen3_batch_2_works_where_upstream_panics() {
    let d = tmp();
    let path = d.path().join("qwen3.gguf");
    write_seeded_gguf(&path, "qwen3", 2, GgmlDType::Q8_0);
    let two = batch_2(&path, 1e-4);
    let mut up = upstream(&path, "qwen3");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| up(&two, 0).is_ok()));
    assert!(caught.is_err(), "upstream quantized_qwen3 was expected to panic at batch 2 on the CPU");
    // Batch 1 against batch 2: no op is to blame, the attention ran as another graph.
    let (x, y) = (d.path().join("b1.trace"), d.path().join("b2.trace"));
    for (out, batch) in [(&x, "1"), (&y, "2")] {
        let (code, _, err) = trace_s(&["record", "--model", p(&path), "--max-tokens", "3", "--batch", batch, "-o", p(out)]);
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, _) = trace_s(&["bisect", p(&x), p(&y)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("the op graphs differ here: layers.0.self_attn.o_proj") && out.contains("a read layers.0.self_attn.flash_attn; b read layers.0.self_attn.attn_v"), "{out}");
    // At batch 4 a projection's kernel also changes, at a later position: the graphs still part
    // first, and the later root is named in a note.
    let z = d.path().join("b4.trace");
    let (code, _, err) = trace_s(&["record", "--model", p(&path), "--max-tokens", "3", "--batch", "4", "-o", p(&z)]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = trace_s(&["bisect", p(&x), p(&z)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("the op graphs differ here: layers.0.self_attn.o_proj (token position 1"), "{out}");
    // A repro holds one op: the graphs' parting is said instead.
    let (code, _, err) = trace_s(&["extract", p(&x), p(&y), "-o", p(&d.path().join("r.trace"))]);
    assert!(code != 0 && err.contains("the op graphs differ instead (at layers.0.self_attn.o_proj"), "{err}");
    // A flash_attn perturbation where it does not run says why.
    let (code, _, err) = trace_s(&["record", "--model", p(&path), "--max-tokens", "2", "--batch", "2", "--perturb", "layers.0.self_attn.flash_attn@2", "-o", p(&z)]);
    assert!(code == 2 && err.contains("no op at that path ran in this run"), "{err}");
}

/// phi3 (seeded file): bit for bit against `quantized_phi3`, the fused projections recorded at
/// `qkv_proj` and `gate_up_proj`; batch 2 works where upstream fails.
#[test]
fn phi3_gguf_logits_bit_identical_to_quantized_phi3() {
    let d = tmp();
    let path = d.path().join("phi3.gguf");
    write_seeded_gguf(&path, "phi3", 4, GgmlDType::F32);
    let paths = parity(&path, "phi3");
    for want in ["layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj", "layers.1.mlp.act"] {
        assert!(paths.iter().any(|p| p == want), "{want} not in {paths:?}");
    }
    // Upstream's last position is not contiguous at batch > 1: a dense output projection takes
    // it, a quantized one (as in real files) fails.
    write_seeded_gguf(&path, "phi3", 4, GgmlDType::Q8_0);
    let two = batch_2(&path, 1e-4);
    let err = upstream(&path, "phi3")(&two, 0).expect_err("upstream batch-2 prefill was expected to fail");
    assert!(err.to_string().contains("contiguous"), "unexpected upstream error: {err}");
}

/// qwen3's recorded ops replay to the recorded bits, the flash kernel both in prefill (several
/// queries) and in decode steps (one); and whole against chunked prefill bisects to a root.
#[test]
fn qwen3_flash_attention_replays_and_chunking_bisects() {
    let d = tmp();
    let path = d.path().join("qwen3.gguf");
    write_seeded_gguf(&path, "qwen3", 2, GgmlDType::F32);
    let (a, b) = (d.path().join("a.trace"), d.path().join("b.trace"));
    let base = ["record", "--model", p(&path), "--prompt", "Tell me about Richard Feynman.", "--max-tokens", "3", "--dump", "layers.0.*"];
    let (code, _, err) = trace_s(&[&base[..], &["-o", p(&a)]].concat());
    assert_eq!(code, 0, "{err}");
    let kinds = crate::replay::replay_each_kind(&a);
    assert!(kinds.iter().any(|k| k.starts_with("FlashAttn")) && kinds.iter().any(|k| k == "QMatMul"), "{kinds:?}");
    let t = candle_trace::format::read_trace(&a).unwrap();
    let flash: Vec<&candle_trace::record::OpRecord> = t
        .items
        .iter()
        .filter_map(|i| match i {
            candle_trace::record::Item::Op(r) if matches!(r.kernel, Some(candle_trace::record::Kernel::FlashAttn { .. })) && !r.operands.is_empty() => Some(r),
            _ => None,
        })
        .collect();
    let queries: Vec<u32> = flash.iter().map(|r| r.shape[2]).collect();
    assert!(queries.len() >= 3 && queries[0] > 1 && queries[1..].iter().all(|&q| q == 1), "{queries:?}");
    for r in &flash {
        let rep = candle_trace::replay::replay(&t, Some(r.seq), None, &Device::Cpu).unwrap();
        assert!(rep.matches_recording && rep.deterministic, "flash_attn #{}: {rep:?}", r.seq);
    }
    // Several ops dumped: the refusal lists some to choose from.
    let (code, _, err) = trace_s(&["replay", p(&a)]);
    assert!(code == 2 && err.contains("choose one with --op SEQ: 2 (layers.0.input_layernorm), 3 (layers.0.self_attn.q_proj)"), "{err}");
    // The kernel runs in f32 only: another dtype is refused in one line.
    let (code, _, err) = trace_s(&["replay", p(&a), "--op", &flash[0].seq.to_string(), "--dtype", "bf16"]);
    assert!(code == 2 && err.contains("replay with --dtype bf16: the op refuses its converted operands") && err.trim().lines().count() == 1, "{err}");
    let (code, _, err) = trace_s(&[&base[..], &["--prefill-chunk", "2", "-o", p(&b)]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = trace_s(&["bisect", p(&a), p(&b)]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("the numbers first parted here: layers.0."), "{out}");
}
