//! The builtin model: a small llama-architecture decoder whose weights come from a fixed seed and
//! whose tokenizer is byte-level, so `trace record` runs on a fresh machine with nothing downloaded.
//!
//! Weights are drawn from SplitMix64 (Steele, Lea, Flood 2014; the constants of Java's
//! `SplittableRandom`) mapped to uniform values in `[-a, a)` with `a = 1/sqrt(fan_in)`, so they are
//! the same bits on every platform. Layers: [`CONFIG`]. Dense weights; `--dtype f16|bf16` converts.

use super::llama::{BlockWeights, Llama, LlamaConfig, LlamaWeights};
use super::{LoadedModel, WeightDtype};
use crate::error::{Error, Result};
use crate::ops::Weight;
use crate::record::ModelInfo;
use crate::tokenizer::TextTokenizer;
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

/// The seed of the builtin weights.
pub const SEED: u64 = 0x5EED_C0DE;
/// Feed-forward width.
pub const FFN: usize = 176;
/// Shape of the builtin model: 4 layers, hidden 64, 4 query heads over 2 KV heads, vocab 258.
pub const CONFIG: LlamaConfig = LlamaConfig {
    n_layer: 4,
    n_head: 4,
    n_kv_head: 2,
    hidden: 64,
    rope_dim: 16,
    rope_base: 10000.0,
    rms_eps: 1e-5,
    vocab: 258,
    rope_neox: false,
};

/// SplitMix64 stream.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-a, a): top 24 bits as a fraction.
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
    fn tensor(&mut self, rows: usize, cols: usize, a: f32, device: &Device) -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols).map(|_| self.uniform(a)).collect();
        Tensor::from_vec(v, (rows, cols), device)
    }
    fn norm(&mut self, n: usize, device: &Device) -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..n).map(|_| 1.0 + self.uniform(0.1)).collect();
        Tensor::from_vec(v, n, device)
    }
}

/// Builds the builtin model in `dtype` (`q` is refused: the builtin weights are dense).
///
/// # Errors
/// [`Error::Usage`] for `--dtype q`; candle errors otherwise.
pub fn load(dtype: WeightDtype, device: &Device) -> Result<LoadedModel> {
    let WeightDtype::Dense(d) = dtype else {
        return Err(Error::usage("--dtype q: the builtin model has dense weights; use f32, f16 or bf16"));
    };
    let c = CONFIG;
    let mut rng = SplitMix64(SEED);
    let kv = c.n_kv_head * c.head_dim();
    let lin = |rng: &mut SplitMix64, out: usize, inp: usize| -> Result<Weight> {
        let w = rng.tensor(out, inp, 1.0 / (inp as f32).sqrt(), device)?.to_dtype(d)?;
        Ok(Weight::Dense(candle_nn::Linear::new(w, None)))
    };
    let embed_tokens = rng.tensor(c.vocab, c.hidden, 1.0, device)?.to_dtype(d)?;
    let mut blocks = Vec::new();
    for _ in 0..c.n_layer {
        blocks.push(BlockWeights {
            q_proj: lin(&mut rng, c.hidden, c.hidden)?,
            k_proj: lin(&mut rng, kv, c.hidden)?,
            v_proj: lin(&mut rng, kv, c.hidden)?,
            o_proj: lin(&mut rng, c.hidden, c.hidden)?,
            gate_proj: lin(&mut rng, FFN, c.hidden)?,
            up_proj: lin(&mut rng, FFN, c.hidden)?,
            down_proj: lin(&mut rng, c.hidden, FFN)?,
            input_layernorm: rng.norm(c.hidden, device)?.to_dtype(d)?,
            post_attention_layernorm: rng.norm(c.hidden, device)?.to_dtype(d)?,
        });
    }
    let norm = rng.norm(c.hidden, device)?.to_dtype(d)?;
    let lm_head = lin(&mut rng, c.vocab, c.hidden)?;
    let model = Llama::new(c.clone(), LlamaWeights { embed_tokens, blocks, norm, lm_head }, d, device)?;
    let desc = format!("candle-trace builtin llama v1 seed={SEED:#x} {:?} ffn={FFN}", CONFIG);
    let sha256 = Sha256::digest(desc.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    let info = ModelInfo {
        name: "builtin".into(),
        size: 0,
        sha256,
        architecture: "llama".into(),
        n_layers: c.n_layer as u32,
        vocab_size: c.vocab as u32,
        weights: "f32".into(),
    };
    Ok(LoadedModel { model, tokenizer: TextTokenizer::byte_level(), info })
}
