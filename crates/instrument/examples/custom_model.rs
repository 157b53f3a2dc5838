//! Trace your own candle model: a small two-layer transformer written here with candle and
//! candle_nn (not an architecture candle-trace ships), recorded twice in process, the second
//! time with layer 1's MLP computed in bf16, then bisected. Bisect names `layers.1.mlp` at
//! position 0: the first op whose output differs while its inputs matched.
//!
//! Run: `cargo run --release -p candle-trace-instrument --example custom_model`. It names this
//! crate alone (besides candle): candle-trace-instrument re-exports the record types, the trace
//! and bisect from the format and comparison crates it depends on.
//!
//! Each value the model computes is recorded where it is made with [`Tracer::probe`]: the module
//! path (Hugging Face style), the tensor, the recorded nodes it was computed from and how it reads
//! them per token position ([`Reads::Same`] per token, [`Reads::Prefix`] for causal attention),
//! and its token axis ([`Tok::Seq`]). Models written op by op with `candle_trace_instrument::ops` record
//! each op the same way, and can be replayed from a trace.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_trace_instrument::bisect::bisect;
use candle_trace_instrument::record::{Header, Phase, Reads};
use candle_trace_instrument::tracer::{MemorySink, Node, Tok, Tracer};

/// One block: causal self-attention (one head), then an MLP, each with a residual.
struct Block {
    q: candle_nn::Linear,
    k: candle_nn::Linear,
    v: candle_nn::Linear,
    up: Tensor,
    down: Tensor,
}

struct Model {
    embed: candle_nn::Embedding,
    blocks: Vec<Block>,
    head: candle_nn::Linear,
    hidden: usize,
}

impl Model {
    /// Weights from a fixed seed: vocab 64, hidden 32, MLP 64, two blocks.
    fn new(dev: &Device) -> candle_core::Result<Self> {
        let (vocab, hidden, mlp) = (64, 32, 64);
        // A fixed pseudo-random fill (the same weights on every machine), in [-0.3, 0.3).
        let salt = std::cell::Cell::new(0u64);
        let w = |r: usize, c: usize| {
            salt.set(salt.get() + 1);
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ salt.get();
            let v: Vec<f32> = (0..r * c)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
                })
                .collect();
            Tensor::from_vec(v, (r, c), dev)
        };
        let lin = |r: usize, c: usize| -> candle_core::Result<candle_nn::Linear> { Ok(candle_nn::Linear::new(w(r, c)?, None)) };
        let blocks = (0..2)
            .map(|_| Ok(Block { q: lin(hidden, hidden)?, k: lin(hidden, hidden)?, v: lin(hidden, hidden)?, up: w(mlp, hidden)?, down: w(hidden, mlp)? }))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Model { embed: candle_nn::Embedding::new(w(vocab, hidden)?, hidden), blocks, head: lin(vocab, hidden)?, hidden })
    }

    /// One forward pass over `ids` `[1, seq]`; layer `bf16_layer`'s MLP runs in bf16 if given.
    /// Returns the logits `[1, seq, vocab]`.
    fn forward(&self, tr: &mut Tracer, ids: &Tensor, bf16_layer: Option<usize>) -> candle_trace_instrument::Result<Tensor> {
        tr.begin_forward(Phase::Prefill, 0, ids)?;
        let seq = ids.dim(1)?;
        let mut x: Node = tr.probe("embed_tokens", self.embed.forward(ids)?, &[], Tok::Seq(1))?;
        let mask: Vec<f32> = (0..seq).flat_map(|i| (0..seq).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
        let mask = Tensor::from_vec(mask, (seq, seq), ids.device())?;
        for (i, b) in self.blocks.iter().enumerate() {
            let (q, k, v) = (b.q.forward(&x.t)?, b.k.forward(&x.t)?, b.v.forward(&x.t)?);
            let scores = (q.matmul(&k.t()?)? / (self.hidden as f64).sqrt())?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            // Attention mixes positions 0..=p: it reads a prefix of its input.
            let attn = tr.probe(&format!("layers.{i}.self_attn"), (&x.t + probs.matmul(&v)?)?, &[(&x, Reads::Prefix)], Tok::Seq(1))?;
            let dt = if bf16_layer == Some(i) { DType::BF16 } else { DType::F32 };
            let h = attn.t.to_dtype(dt)?.broadcast_matmul(&b.up.t()?.to_dtype(dt)?)?.gelu()?;
            let h = h.broadcast_matmul(&b.down.t()?.to_dtype(dt)?)?.to_dtype(DType::F32)?;
            x = tr.probe(&format!("layers.{i}.mlp"), (&attn.t + h)?, &[(&attn, Reads::Same)], Tok::Seq(1))?;
        }
        let logits = tr.probe("lm_head", self.head.forward(&x.t)?, &[(&x, Reads::Same)], Tok::Seq(1))?;
        tr.end_forward()?;
        Ok(logits.t)
    }
}

/// Runs the model once into memory and returns the recording as a trace named `name`.
fn record(model: &Model, ids: &Tensor, bf16_layer: Option<usize>, name: &str) -> candle_trace_instrument::Result<candle_trace_instrument::format::Trace> {
    let sink = MemorySink::default();
    let mut tr = Tracer::new(Box::new(sink.clone()));
    model.forward(&mut tr, ids, bf16_layer)?;
    // Both recordings share one header: same model, same settings (the knob is the code's).
    Ok(sink.trace(name, &Header::default()))
}

fn main() -> candle_trace_instrument::Result<()> {
    let dev = Device::Cpu;
    let model = Model::new(&dev)?;
    let ids = Tensor::new(&[[3u32, 14, 15, 9, 26, 5, 35, 8]], &dev)?;
    let a = record(&model, &ids, None, "f32.trace")?;
    let b = record(&model, &ids, Some(1), "mlp1-bf16.trace")?;
    let r = bisect(&a, &b)?;
    println!("verdict: {}", r.verdict);
    let d = r.first_divergence.as_ref().expect("the bf16 MLP differs");
    println!("root: {} at position {} (its inputs matched bit for bit), max |a-b| >= {:.3e}", d.path.text(), d.position, d.max_abs_diff);
    for l in &r.growth {
        println!("  {:<14} {}/{} ops differ", l.layer.text(), l.ops_differing, l.ops_compared);
    }
    assert_eq!((d.path.as_str(), d.position), ("layers.1.mlp", 0));
    Ok(())
}
