//! Loads GGUF files (layout: the GGUF spec of ggml, as read by candle's `quantized::gguf_file`):
//! llama, qwen2, qwen3 and phi3 into the instrumented [`Llama`], gemma3 into [`Gemma3`], with the
//! hyper-parameters, tensor names and rope convention of candle-transformers'
//! `quantized_llama`, `quantized_qwen2`, `quantized_qwen3`, `quantized_phi3` and
//! `quantized_gemma3` `ModelWeights::from_gguf`.

use crate::gemma3::{Gemma3, Gemma3Block, Gemma3Config, Gemma3Weights};
use crate::llama::{BlockWeights, Flavour, GateUpProj, Llama, LlamaConfig, LlamaWeights, QkvProj, RopeSpec};
use crate::positioned::Positioned;
use crate::tokenizer::TextTokenizer;
use crate::{Decoder, LoadedModel, WeightDtype};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_trace_format::error::{Error, Result};
use candle_trace_format::record::ModelInfo;
use candle_trace_instrument::ops::Weight;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

/// A GGUF file read through a buffer: candle reads the metadata a few bytes a call (two read
/// calls and more a vocabulary string), which unbuffered is a system call each (Gemma 3's
/// 262 144-token vocabulary: a million calls, 3 s of a load), and asks the position before each
/// string, which [`Positioned`] answers without a call. Tensors are then read from it by
/// [`gguf_file::Content::tensor`], which seeks to each.
pub type GgufFile = Positioned<BufReader<File>>;

/// Opens a GGUF file and reads its header (metadata and tensor table; the layout is ggml's GGUF
/// spec, as candle's `gguf_file` reads it), keeping the file open for its tensors.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Model`] when `path` is a folder, has no
/// GGUF magic bytes, or its header does not read.
pub fn open(path: &Path) -> Result<(gguf_file::Content, GgufFile)> {
    if path.is_dir() {
        return Err(Error::model(path, "is a directory; expected a GGUF file"));
    }
    let mut file = Positioned::new(BufReader::new(File::open(path).map_err(|e| Error::io(path, e))?));
    let mut magic = [0u8; 4];
    let is_gguf = file.read_exact(&mut magic).is_ok() && &magic == b"GGUF";
    if !is_gguf {
        return Err(Error::model(path, "not a GGUF file (no GGUF magic bytes)"));
    }
    file.seek(SeekFrom::Start(0)).map_err(|e| Error::io(path, e))?;
    let ct = gguf_file::Content::read(&mut file).map_err(|e| Error::model(path, format!("unreadable GGUF: {e}")))?;
    Ok((ct, file))
}

/// Architectures this loader runs.
pub const SUPPORTED: &[&str] = &["llama", "qwen2", "qwen3", "phi3", "gemma3"];

/// Hex sha256 and size of a file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read.
pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((candle_trace_compare::text::hex(&h.finalize()), size))
}

/// The `{arch}.*` metadata as (key, value) pairs for the header, sorted: strings only under
/// keys that change numerics, as for folders.
fn public_config(ct: &gguf_file::Content, arch: &str) -> Vec<(String, String)> {
    let prefix = format!("{arch}.");
    let mut c: Vec<(String, String)> = ct
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .filter(|(k, v)| !v.contains("String(") || super::config_entry_is_public(k, &v.replace("String(", "\"")))
        .collect();
    c.sort();
    c
}

/// Loads a GGUF file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Model`] when it is not a GGUF file, its
/// architecture is not in [`SUPPORTED`], a hyper-parameter or tensor is missing, or its tokenizer
/// metadata is unusable.
pub fn load(path: &Path, dtype: WeightDtype, device: &Device) -> Result<LoadedModel> {
    let (ct, mut file) = open(path)?;
    let md = |k: &str| ct.metadata.get(k).ok_or_else(|| Error::model(path, format!("GGUF metadata has no {k}")));
    let arch = md("general.architecture")?.to_string().map_err(|e| Error::model(path, format!("general.architecture: {e}")))?.clone();
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(Error::model(path, format!("unsupported architecture '{arch}' (supported: {})", SUPPORTED.join(", "))));
    }
    // The tokenizer and the file's digest are built beside the weights (of Gemma 3's start, about
    // 1.3 s and 0.2 s of CPU); a failure is reported in that order: tokenizer, weights, digest.
    let (tokenizer, built, digest) = std::thread::scope(|s| {
        let tokenizer = s.spawn(|| TextTokenizer::from_gguf_metadata(&ct.metadata));
        let digest = s.spawn(|| sha256_file(path));
        let built = match arch.as_str() {
            "gemma3" => gemma3(&ct, &mut file, path, dtype, device),
            _ => llama(&ct, &mut file, path, &arch, dtype, device),
        };
        (join(tokenizer), built, join(digest))
    });
    let tokenizer = tokenizer.map_err(|e| Error::model(path, e))?;
    let built = built?;
    let (sha256, size) = digest?;
    let info = ModelInfo {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        size,
        sha256,
        architecture: arch.clone(),
        n_layers: built.n_layer as u32,
        vocab_size: built.vocab as u32,
        weights: built.weights,
        config: public_config(&ct, &arch),
    };
    Ok(LoadedModel { model: built.model, tokenizer, info })
}

/// A scoped thread's result, its panic carried on to the caller.
fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// What an architecture's builder hands back: the model and what the header says of it.
struct Built {
    model: Decoder,
    n_layer: usize,
    vocab: usize,
    /// The quantization of the first projection (`q4_1`), or of the embeddings.
    weights: String,
}

/// A metadata value as a usize.
fn md_usize(ct: &gguf_file::Content, path: &Path, k: &str) -> Result<usize> {
    let v = ct.metadata.get(k).ok_or_else(|| Error::model(path, format!("GGUF metadata has no {k}")))?;
    v.to_u32().map(|v| v as usize).map_err(|e| Error::model(path, format!("{k}: {e}")))
}

/// A metadata value as an f32, `default` when absent.
fn md_f32(ct: &gguf_file::Content, k: &str, default: f32) -> f32 {
    ct.metadata.get(k).and_then(|v| v.to_f32().ok()).unwrap_or(default)
}

/// One GGUF file's tensors read as an architecture's builder needs them: quantized or dense
/// weights per `--dtype`, RMSNorm weights in the activation dtype, and the embeddings, final
/// norm and output projection every decoder has.
struct Reader<'a> {
    ct: &'a gguf_file::Content,
    file: &'a mut GgufFile,
    path: &'a Path,
    dtype: WeightDtype,
    device: &'a Device,
    /// `{arch}.attention.layer_norm_rms_epsilon`.
    rms_eps: f64,
}

/// What every decoder file holds besides its blocks.
struct Ends {
    /// `[vocab, hidden]` in the activation dtype.
    embed_tokens: Tensor,
    vocab: usize,
    /// The embeddings' quantization (`q8_0`), in lower case.
    embed_kind: String,
    norm: candle_nn::RmsNorm,
    /// `output.weight`, or the embeddings when tied.
    lm_head: Weight,
}

impl<'a> Reader<'a> {
    fn new(ct: &'a gguf_file::Content, file: &'a mut GgufFile, path: &'a Path, arch: &str, dtype: WeightDtype, device: &'a Device) -> Result<Self> {
        let key = format!("{arch}.attention.layer_norm_rms_epsilon");
        let rms_eps =
            ct.metadata.get(&key).ok_or_else(|| Error::model(path, format!("GGUF metadata has no {key}")))?.to_f32().map_err(|e| Error::model(path, format!("layer_norm_rms_epsilon: {e}")))? as f64;
        Ok(Reader { ct, file, path, dtype, device, rms_eps })
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor> {
        self.ct.tensor(self.file, name, self.device).map_err(|e| Error::model(self.path, format!("tensor {name}: {e}")))
    }

    /// A projection, quantized as in the file or dense in `--dtype`, with an optional bias
    /// (dequantized; qwen2's q/k/v).
    fn weight(&mut self, name: &str, bias: Option<&str>) -> Result<Weight> {
        let q = self.tensor(name)?;
        self.projection(q, bias)
    }

    fn projection(&mut self, q: QTensor, bias: Option<&str>) -> Result<Weight> {
        let bias = bias.map(|b| self.tensor(b)).transpose()?.map(|b| b.dequantize(self.device)).transpose()?;
        Ok(match self.dtype {
            WeightDtype::Quantized => Weight::Quantized(QMatMul::from_qtensor(q)?, bias),
            WeightDtype::Dense(d) => Weight::Dense(candle_nn::Linear::new(q.dequantize(self.device)?.to_dtype(d)?, bias.map(|b| b.to_dtype(d)).transpose()?)),
        })
    }

    fn norm(&mut self, name: &str) -> Result<candle_nn::RmsNorm> {
        let q = self.tensor(name)?;
        Ok(candle_nn::RmsNorm::new(q.dequantize(self.device)?.to_dtype(self.dtype.activations())?, self.rms_eps))
    }

    /// The embeddings, the final norm and the output projection.
    fn ends(&mut self) -> Result<Ends> {
        let embed_q = self.tensor("token_embd.weight")?;
        let embed_kind = format!("{:?}", embed_q.dtype()).to_lowercase();
        let vocab = embed_q.shape().dims()[0];
        let embed_tokens = embed_q.dequantize(self.device)?.to_dtype(self.dtype.activations())?;
        let norm = self.norm("output_norm.weight")?;
        // Tied embeddings: no `output.weight`. Asked of the file's tensor table rather than
        // learnt from a failed read, whose candle error captures a backtrace under
        // RUST_BACKTRACE=1 and symbolises it when formatted (about 50 ms of a SmolLM2 load);
        // and a present `output.weight` that does not read is then an error, not a silent
        // fallback to the embeddings. Tied, the embedding's tensor is the head's, not read twice,
        // and dense, its dequantized copy too (the same bits: `--dtype` is the activations').
        let tied = !self.ct.tensor_infos.contains_key("output.weight");
        let lm_head = match (tied, self.dtype) {
            (true, WeightDtype::Dense(_)) => Weight::Dense(candle_nn::Linear::new(embed_tokens.clone(), None)),
            (true, WeightDtype::Quantized) => self.projection(embed_q, None)?,
            (false, _) => {
                let head = self.tensor("output.weight")?;
                self.projection(head, None)?
            }
        };
        Ok(Ends { embed_tokens, vocab, embed_kind, norm, lm_head })
    }
}

/// The llama-family architectures of GGUF files, as their candle-transformers models read them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    /// quantized_llama: interleaved rope.
    Llama,
    /// quantized_qwen2: NeoX rope, q/k/v biases, head size `hidden / heads`.
    Qwen2,
    /// quantized_qwen3: per-head q/k norms, `attention.key_length` head size, rope tables in
    /// `general.dtype` (f16 when absent), flash attention on CPU.
    Qwen3,
    /// quantized_phi3: fused `attn_qkv` and gate/up `ffn_up`, NeoX rope at base 10 000.
    Phi3,
}

/// `quantized_llama`'s model (`llama.*` metadata, interleaved rope), `quantized_qwen2`'s
/// (`qwen2.*`: NeoX rope over the whole head, q/k/v biases added after the quantized matmul, the
/// head size `hidden / heads`), `quantized_qwen3`'s (`qwen3.*`: q/k RMS-normed per head, head size
/// `attention.key_length`, rotary tables computed in `general.dtype`) or `quantized_phi3`'s
/// (`phi3.*`: fused q/k/v and gate/up projections; the rotary base is 10 000 whatever
/// `rope.freq_base` says, as upstream reads it).
fn llama(ct: &gguf_file::Content, file: &mut GgufFile, path: &Path, arch: &str, dtype: WeightDtype, device: &Device) -> Result<Built> {
    let fam = match arch {
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "phi3" => Family::Phi3,
        _ => Family::Llama,
    };
    let (qwen2, qwen3, phi3) = (fam == Family::Qwen2, fam == Family::Qwen3, fam == Family::Phi3);
    let u = |k: &str| md_usize(ct, path, &format!("{arch}.{k}"));
    let (hidden, n_head, n_kv_head, n_layer) = (u("embedding_length")?, u("attention.head_count")?, u("attention.head_count_kv")?, u("block_count")?);
    if n_head == 0 || n_kv_head == 0 || hidden % n_head != 0 || n_head % n_kv_head != 0 {
        return Err(Error::model(path, "inconsistent head counts in GGUF metadata"));
    }
    let head_dim = if qwen3 { u("attention.key_length")? } else { hidden / n_head };
    if head_dim == 0 || head_dim % 2 != 0 || head_dim > 1 << 16 {
        return Err(Error::model(path, format!("head size {head_dim} is not a positive even number of at most 65536")));
    }
    let rope_dim = if qwen2 || qwen3 { head_dim } else { u("rope.dimension_count")? };
    if phi3 && rope_dim != head_dim {
        return Err(Error::model(path, format!("phi3.rope.dimension_count {rope_dim} differs from the head size {head_dim}: partial rotary embeddings are not supported")));
    }
    let rope_base = if phi3 { 10_000.0 } else { md_f32(ct, &format!("{arch}.rope.freq_base"), 10000.0) };
    if ct.metadata.get(&format!("{arch}.expert_count")).and_then(|v| v.to_u32().ok()).unwrap_or(0) > 1 {
        return Err(Error::model(path, "mixture-of-experts files are not supported yet"));
    }
    if n_layer > super::MAX_LAYERS {
        return Err(Error::model(path, format!("{arch}.block_count {n_layer} is over the {} this tool takes", super::MAX_LAYERS)));
    }
    let mut r = Reader::new(ct, file, path, arch, dtype, device)?;
    let rms_eps = r.rms_eps;
    let ends = r.ends()?;
    let mut weights_kind = String::new();
    let mut blocks = Vec::new();
    for i in 0..n_layer {
        let (block, kind) = llama_block(&mut r, i, fam, (n_head, n_kv_head, head_dim))?;
        if weights_kind.is_empty() {
            weights_kind = kind;
        }
        blocks.push(block);
    }
    let (vocab, act) = (ends.vocab, dtype.activations());
    let cfg = LlamaConfig {
        flavour: if qwen3 { Flavour::Qwen3 } else { Flavour::QuantizedLlama },
        n_layer,
        n_head,
        n_kv_head,
        hidden,
        rope_dim,
        rope_base,
        rms_eps,
        vocab,
        rope_neox: fam != Family::Llama,
        head_dim,
        sliding_window: None,
        window: None,
    };
    let rope = if qwen3 {
        // quantized_qwen3 computes its tables in `general.dtype`: 0 is f32, anything else or
        // nothing is f16; they are converted to the activations' dtype when used.
        let table = match ct.metadata.get("general.dtype").map(|v| v.to_u32()) {
            Some(Ok(0)) => DType::F32,
            _ => DType::F16,
        };
        RopeSpec::f64_powers(head_dim, rope_base as f64, Some(table))
    } else {
        RopeSpec::standard(rope_dim, rope_base)
    };
    let weights = LlamaWeights { embed_tokens: ends.embed_tokens, blocks, norm: ends.norm, lm_head: ends.lm_head };
    let model = Llama::new(cfg, weights, &rope, act, device)?;
    Ok(Built { model: Decoder::Llama(model), n_layer, vocab, weights: if weights_kind.is_empty() { ends.embed_kind } else { weights_kind } })
}

/// Layer `i`'s weights in a llama-family GGUF file (`blk.{i}.*`), and the dtype its first
/// projection is stored in. `dims`: (query heads, KV heads, head size), checked against phi3's
/// fused projections.
fn llama_block(r: &mut Reader, i: usize, fam: Family, (n_head, n_kv_head, head_dim): (usize, usize, usize)) -> Result<(BlockWeights, String)> {
    let (qwen2, qwen3, phi3) = (fam == Family::Qwen2, fam == Family::Qwen3, fam == Family::Phi3);
    let path = r.path;
    let n = |x: &str| format!("blk.{i}.{x}");
    let first = r.tensor(&n(if phi3 { "attn_qkv.weight" } else { "attn_q.weight" }))?;
    let kind = format!("{:?}", first.dtype()).to_lowercase();
    let (qkv, gate_up) = if phi3 {
        let rows = |t: &QTensor| t.shape().dims().first().copied().unwrap_or(0);
        let up = r.tensor(&n("ffn_up.weight"))?;
        if rows(&first) != (n_head + 2 * n_kv_head) * head_dim || rows(&up) % 2 != 0 {
            return Err(Error::model(path, format!("blk.{i}: attn_qkv has {} rows (expected {}), ffn_up {} (expected an even number)", rows(&first), (n_head + 2 * n_kv_head) * head_dim, rows(&up))));
        }
        (QkvProj::Fused(r.projection(first, None)?), GateUpProj::Fused(r.projection(up, None)?))
    } else {
        let bias = |x: &str| qwen2.then(|| n(&format!("{x}.bias")));
        let (bq, bk, bv) = (bias("attn_q"), bias("attn_k"), bias("attn_v"));
        let qkv = QkvProj::Split { q: r.projection(first, bq.as_deref())?, k: r.weight(&n("attn_k.weight"), bk.as_deref())?, v: r.weight(&n("attn_v.weight"), bv.as_deref())? };
        (qkv, GateUpProj::Split { gate: r.weight(&n("ffn_gate.weight"), None)?, up: r.weight(&n("ffn_up.weight"), None)? })
    };
    let qk_norm = if qwen3 { Some((r.norm(&n("attn_q_norm.weight"))?, r.norm(&n("attn_k_norm.weight"))?)) } else { None };
    let block = BlockWeights {
        qkv,
        o_proj: r.weight(&n("attn_output.weight"), None)?,
        gate_up,
        down_proj: r.weight(&n("ffn_down.weight"), None)?,
        input_layernorm: r.norm(&n("attn_norm.weight"))?,
        post_attention_layernorm: r.norm(&n("ffn_norm.weight"))?,
        qk_norm,
    };
    Ok((block, kind))
}

/// `quantized_gemma3`'s model (`gemma3.*` metadata; see [`super::gemma3`]).
fn gemma3(ct: &gguf_file::Content, file: &mut GgufFile, path: &Path, dtype: WeightDtype, device: &Device) -> Result<Built> {
    let u = |k: &str| md_usize(ct, path, &format!("gemma3.{k}"));
    let (n_layer, hidden, n_head, n_kv_head, head_dim) = (u("block_count")?, u("embedding_length")?, u("attention.head_count")?, u("attention.head_count_kv")?, u("attention.key_length")?);
    if n_layer > super::MAX_LAYERS {
        return Err(Error::model(path, format!("gemma3.block_count {n_layer} is over the {} this tool takes", super::MAX_LAYERS)));
    }
    if n_head == 0 || n_kv_head == 0 || head_dim == 0 || n_head % n_kv_head != 0 || head_dim % 2 != 0 {
        return Err(Error::model(path, "inconsistent head counts in GGUF metadata"));
    }
    let sliding_window = u("attention.sliding_window")?;
    let sliding_window_type = md_usize(ct, path, "gemma3.attention.sliding_window_type").unwrap_or(6);
    let mut r = Reader::new(ct, file, path, "gemma3", dtype, device)?;
    let rms_eps = r.rms_eps;
    let ends = r.ends()?;
    let mut weights = ends.embed_kind.clone();
    let mut blocks = Vec::with_capacity(n_layer);
    for i in 0..n_layer {
        let n = |x: &str| format!("blk.{i}.{x}.weight");
        let q = r.tensor(&n("attn_q"))?;
        if i == 0 {
            weights = format!("{:?}", q.dtype()).to_lowercase();
        }
        blocks.push(Gemma3Block {
            q_proj: r.projection(q, None)?,
            k_proj: r.weight(&n("attn_k"), None)?,
            v_proj: r.weight(&n("attn_v"), None)?,
            o_proj: r.weight(&n("attn_output"), None)?,
            q_norm: r.norm(&n("attn_q_norm"))?,
            k_norm: r.norm(&n("attn_k_norm"))?,
            input_layernorm: r.norm(&n("attn_norm"))?,
            post_attention_layernorm: r.norm(&n("post_attention_norm"))?,
            pre_feedforward_layernorm: r.norm(&n("ffn_norm"))?,
            post_feedforward_layernorm: r.norm(&n("post_ffw_norm"))?,
            gate_proj: r.weight(&n("ffn_gate"), None)?,
            up_proj: r.weight(&n("ffn_up"), None)?,
            down_proj: r.weight(&n("ffn_down"), None)?,
        });
    }
    let (vocab, act) = (ends.vocab, dtype.activations());
    let cfg = Gemma3Config {
        n_layer,
        n_head,
        n_kv_head,
        hidden,
        head_dim,
        rms_eps,
        vocab,
        sliding_window,
        sliding_window_type,
        rope_base: md_f32(ct, "gemma3.rope.freq_base", 1_000_000.0),
        rope_base_local: md_f32(ct, "gemma3.rope.local_freq_base", 10_000.0),
    };
    let w = Gemma3Weights { embed_tokens: ends.embed_tokens, blocks, norm: ends.norm, lm_head: ends.lm_head };
    Ok(Built { model: Decoder::Gemma3(Gemma3::new(cfg, w, act, device)?), n_layer, vocab, weights })
}
