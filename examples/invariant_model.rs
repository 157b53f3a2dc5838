//! Batch invariance in your own candle model: a small llama-style transformer written here (RMS
//! norms, causal multi-head attention, a GELU MLP), its kernels swapped for
//! `candle_trace_kernels`' batch-invariant ones, and the claim checked with the tracer.
//!
//! Run: `cargo run --release --example invariant_model` (the tests run it too:
//! `cargo test --release --example invariant_model`).
//!
//! One request (40 tokens) is run alone, then left-padded in a batch beside two longer requests,
//! the way a server batches. Each run is recorded with [`Tracer::probe`]; the batched run tells
//! the tracer where each row's tokens are ([`Tracer::set_rows`]), so the request's row is
//! compared position by position with its lone run, and [`bisect`] names the first op whose
//! output differs. With candle's kernels (`candle_nn::Linear`, a masked `softmax_last_dim`,
//! `rms_norm`) the padded row's attention differs, and with it every op after: the softmax sums
//! the masked keys of the padding, which changes the order of its additions. With the invariant
//! kernels the three swaps below keep every recorded value of the request bit for bit:
//!
//! | candle | `candle_trace_kernels` |
//! |---|---|
//! | `candle_nn::Linear::new(w, b)` | `Linear::new(&w, b.as_ref())?` |
//! | `q·kᵀ`, masked softmax, `p·v` | `attention(&q, &k, &v, scale, causal, &key_ranges)?` |
//! | `candle_nn::ops::rms_norm(x, a, eps)` | `rms_norm(x, a, eps)?` |
//!
//! `attention` takes each batch row's valid key range (here: from its first real token) and never
//! reads the keys outside it; the other two need nothing more than the swap.

use candle_core::{Device, Module, Tensor};
use candle_trace::bisect::{bisect, Report};
use candle_trace::record::{Footer, Header, Phase, Reads};
use candle_trace::tracer::{MemorySink, Node, Tok, Tracer};

/// Which kernels the model's ops run on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernels {
    /// candle's and candle_nn's own (what a model written with candle_nn runs).
    Candle,
    /// `candle_trace_kernels`: each row's output depends on that row's inputs alone.
    Invariant,
}

const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const MLP: usize = 128;
const LAYERS: usize = 2;
const EPS: f32 = 1e-5;

/// A projection, as candle_nn's layer or as the invariant one (the same weight).
struct Proj {
    candle: candle_nn::Linear,
    invariant: candle_trace_kernels::Linear,
}

impl Proj {
    fn new(w: Tensor) -> candle_core::Result<Self> {
        Ok(Proj { invariant: candle_trace_kernels::Linear::new(&w, None)?, candle: candle_nn::Linear::new(w, None) })
    }

    /// `x @ Wᵀ` for `x` `[b, seq, k]`.
    fn forward(&self, x: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
        match k {
            Kernels::Candle => self.candle.forward(x),
            Kernels::Invariant => self.invariant.forward(x),
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    mlp_norm: Tensor,
    up: Proj,
    down: Proj,
}

struct Model {
    embed: candle_nn::Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    head: Proj,
}

/// `x / sqrt(mean(x²) + eps) · alpha` over the last dim.
fn rms_norm(x: &Tensor, alpha: &Tensor, k: Kernels) -> candle_core::Result<Tensor> {
    match k {
        Kernels::Candle => candle_nn::ops::rms_norm(x, alpha, EPS),
        Kernels::Invariant => candle_trace_kernels::rms_norm(x, alpha, EPS),
    }
}

/// Causal attention of `q`, `k`, `v` `[b, heads, seq, d]`, row `r`'s keys starting at `pads[r]`
/// (its left padding). Returns `[b, heads, seq, d]`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, pads: &[usize], kernels: Kernels) -> candle_core::Result<Tensor> {
    let (b, _, seq, d) = q.dims4()?;
    let scale = 1.0 / (d as f32).sqrt();
    match kernels {
        Kernels::Invariant => candle_trace_kernels::attention(q, k, v, scale, true, &pads.iter().map(|&p| (p, seq)).collect::<Vec<_>>()),
        Kernels::Candle => {
            // Key j is masked for query i when it is in the future or padding (a padded query
            // keeps itself, so its row is finite; the tracer leaves padding out).
            let mask: Vec<f32> =
                (0..b).flat_map(|r| (0..seq * seq).map(move |ij| (r, ij / seq, ij % seq))).map(|(r, i, j)| if j > i || (j < pads[r] && j != i) { f32::NEG_INFINITY } else { 0.0 }).collect();
            let mask = Tensor::from_vec(mask, (b, 1, seq, seq), q.device())?;
            let scores = (q.matmul(&k.t()?)? * scale as f64)?.broadcast_add(&mask)?;
            candle_nn::ops::softmax_last_dim(&scores)?.matmul(v)
        }
    }
}

impl Model {
    /// Weights from a fixed seed (the same on every machine), in [-0.3, 0.3) scaled by the fan-in.
    fn new(dev: &Device) -> candle_core::Result<Self> {
        let salt = std::cell::Cell::new(0u64);
        let w = |r: usize, c: usize| {
            salt.set(salt.get() + 1);
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ salt.get();
            let scale = 0.6 * (16.0 / c as f32).sqrt();
            let v: Vec<f32> = (0..r * c)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
                })
                .collect();
            Tensor::from_vec(v, (r, c), dev)
        };
        let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, dev)?;
        let layers = (0..LAYERS)
            .map(|_| {
                Ok(Layer {
                    attn_norm: ones.clone(),
                    q: Proj::new(w(HIDDEN, HIDDEN)?)?,
                    k: Proj::new(w(HIDDEN, HIDDEN)?)?,
                    v: Proj::new(w(HIDDEN, HIDDEN)?)?,
                    o: Proj::new(w(HIDDEN, HIDDEN)?)?,
                    mlp_norm: ones.clone(),
                    up: Proj::new(w(MLP, HIDDEN)?)?,
                    down: Proj::new(w(HIDDEN, MLP)?)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Model { embed: candle_nn::Embedding::new(w(VOCAB, HIDDEN)?, HIDDEN), layers, norm: ones, head: Proj::new(w(VOCAB, HIDDEN)?)? })
    }

    /// One forward pass over `ids` `[b, seq]`, row `r` left-padded by `pads[r]` tokens, every
    /// value recorded under its Hugging Face module path. Returns the logits `[b, seq, vocab]`.
    fn forward(&self, tr: &mut Tracer, ids: &Tensor, pads: &[usize], k: Kernels) -> candle_trace::Result<Tensor> {
        let (b, seq) = ids.dims2()?;
        tr.begin_forward(Phase::Prefill, 0, ids)?;
        if pads.iter().any(|&p| p > 0) {
            // Each row's own tokens: it is compared with the same request run alone.
            tr.set_rows(pads.iter().map(|&p| (p as u32, seq as u32)).collect());
        }
        let heads = |t: &Tensor| t.reshape((b, seq, HEADS, HIDDEN / HEADS))?.transpose(1, 2)?.contiguous();
        let mut x: Node = tr.probe("embed_tokens", self.embed.forward(ids)?, &[], Tok::Seq(1))?;
        for (i, l) in self.layers.iter().enumerate() {
            let p = |name: &str| format!("layers.{i}.{name}");
            let h = tr.probe(&p("input_layernorm"), rms_norm(&x.t, &l.attn_norm, k)?, &[(&x, Reads::Same)], Tok::Seq(1))?;
            let q = tr.probe(&p("self_attn.q_proj"), l.q.forward(&h.t, k)?, &[(&h, Reads::Same)], Tok::Seq(1))?;
            let kk = tr.probe(&p("self_attn.k_proj"), l.k.forward(&h.t, k)?, &[(&h, Reads::Same)], Tok::Seq(1))?;
            let v = tr.probe(&p("self_attn.v_proj"), l.v.forward(&h.t, k)?, &[(&h, Reads::Same)], Tok::Seq(1))?;
            let a = attention(&heads(&q.t)?, &heads(&kk.t)?, &heads(&v.t)?, pads, k)?.transpose(1, 2)?.reshape((b, seq, HIDDEN))?;
            // Attention reads every earlier position of q, k and v.
            let a = tr.probe(&p("self_attn.attn"), a, &[(&q, Reads::Prefix), (&kk, Reads::Prefix), (&v, Reads::Prefix)], Tok::Seq(1))?;
            let o = tr.probe(&p("self_attn.o_proj"), (&x.t + l.o.forward(&a.t, k)?)?, &[(&x, Reads::Same), (&a, Reads::Same)], Tok::Seq(1))?;
            let h = tr.probe(&p("post_attention_layernorm"), rms_norm(&o.t, &l.mlp_norm, k)?, &[(&o, Reads::Same)], Tok::Seq(1))?;
            let up = tr.probe(&p("mlp.up_proj"), l.up.forward(&h.t, k)?.gelu()?, &[(&h, Reads::Same)], Tok::Seq(1))?;
            x = tr.probe(&p("mlp.down_proj"), (&o.t + l.down.forward(&up.t, k)?)?, &[(&o, Reads::Same), (&up, Reads::Same)], Tok::Seq(1))?;
        }
        let n = tr.probe("norm", rms_norm(&x.t, &self.norm, k)?, &[(&x, Reads::Same)], Tok::Seq(1))?;
        let logits = tr.probe("lm_head", self.head.forward(&n.t, k)?, &[(&n, Reads::Same)], Tok::Seq(1))?;
        tr.end_forward()?;
        Ok(logits.t)
    }
}

/// Runs `requests` (each a name and its token ids) as one left-padded batch into memory; the
/// trace's header names each row's request, which is how bisect pairs a row with its lone run.
fn record(model: &Model, requests: &[(&str, &[u32])], k: Kernels, name: &str) -> candle_trace::Result<candle_trace::format::Trace> {
    let seq = requests.iter().map(|r| r.1.len()).max().unwrap_or(0);
    let pads: Vec<usize> = requests.iter().map(|r| seq - r.1.len()).collect();
    // Padding token 0, left of each shorter request.
    let ids: Vec<u32> = requests.iter().zip(&pads).flat_map(|(r, &p)| std::iter::repeat_n(0, p).chain(r.1.iter().copied())).collect();
    let ids = Tensor::from_vec(ids, (requests.len(), seq), &Device::Cpu)?;
    let sink = MemorySink::default();
    let mut tr = Tracer::new(Box::new(sink.clone()));
    model.forward(&mut tr, &ids, &pads, k)?;
    tr.finish(&Footer { forward_passes: 1, stop: "done".into(), ..Footer::default() })?;
    let mut header = Header::default();
    header.run.batch = requests.len() as u32;
    header.run.texts = requests.iter().map(|r| r.0.to_string()).collect();
    Ok(sink.trace(name, &header))
}

/// The request alone against the same request left-padded in a batch, on `kernels`.
fn alone_vs_batched(model: &Model, kernels: Kernels) -> candle_trace::Result<Report> {
    // Token ids 1..VOCAB from a seed; 40 and 48 tokens: candle's softmax sums a row of 32 keys
    // or more in lanes, whose grouping moves with the padding in front.
    let ids = |seed: u32, n: u32| (0..n).map(|i| 1 + (i * 37 + seed * 11) % (VOCAB as u32 - 1)).collect::<Vec<u32>>();
    let (request, longer, another) = (ids(1, 40), ids(2, 48), ids(3, 48));
    let a = record(model, &[("the request", &request)], kernels, "alone.trace")?;
    let b = record(model, &[("a longer one", &longer), ("the request", &request), ("another", &another)], kernels, "batched.trace")?;
    bisect(&a, &b)
}

/// Prints both comparisons; returns them (candle's kernels, the invariant ones).
fn run() -> candle_trace::Result<(Report, Report)> {
    let model = Model::new(&Device::Cpu)?;
    let candle = alone_vs_batched(&model, Kernels::Candle)?;
    let invariant = alone_vs_batched(&model, Kernels::Invariant)?;
    for (k, r) in [(Kernels::Candle, &candle), (Kernels::Invariant, &invariant)] {
        print!("{k:?} kernels: the request alone vs left-padded in a batch of 3: {}", r.verdict);
        match &r.first_divergence {
            Some(d) => println!(", first at {} position {} (its inputs matched bit for bit), max |a-b| >= {:.3e}", d.path.text(), d.position, d.max_abs_diff),
            None => println!(", every recorded value of the request bit for bit"),
        }
    }
    Ok((candle, invariant))
}

fn main() -> candle_trace::Result<()> {
    run().map(|_| ())
}

#[test]
fn the_invariant_kernels_keep_the_padded_request_and_candles_do_not() {
    let (candle, invariant) = run().expect("run");
    assert_eq!(invariant.verdict.to_string(), "identical");
    // The default kernels would have failed it: the masked softmax sums the padding's keys
    // (layer 1 at position 18 on an AVX2 machine; where depends on the CPU's lanes).
    let d = candle.first_divergence.expect("candle's kernels differ in a padded batch");
    assert!(d.path.as_str().ends_with(".self_attn.attn"), "root {} at {}", d.path.text(), d.position);
    assert_eq!(candle.verdict.to_string(), "diverged");
}
