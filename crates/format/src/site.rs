//! Sites: where in a model an op runs (module path and op), and the path helpers recording
//! and analysis share (layer of a path, its per-layer group). No tensor code.

/// The ops a trace can name. `as_str` is the name written in traces; [`Op::parse`] reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Token ids entering the model, `[batch, seq]` u32.
    Input,
    /// Embedding lookup, `[batch, seq, hidden]`.
    Embedding,
    /// candle_nn::ops::rms_norm (fused kernel on contiguous input).
    RmsNorm,
    /// Quantized matmul against GGUF weights (candle QMatMul), `x @ W^T`.
    QMatMul,
    /// Dense linear layer (candle_nn::Linear), `x @ W^T (+ b)`.
    Linear,
    /// Plain matmul of two activations (attention scores, probabilities @ V).
    Matmul,
    /// Multiplication by a constant (attention score scaling by 1/sqrt(head_dim)).
    Scale,
    /// Masked fill of the causal mask (`where_cond`).
    WhereCond,
    /// Softmax over the last dim.
    Softmax,
    /// Rotary position embedding.
    Rope,
    /// Concatenation (KV cache append).
    Cat,
    /// SiLU activation.
    Silu,
    /// Elementwise multiplication.
    Mul,
    /// Elementwise addition (residual connections).
    Add,
    /// Dtype conversion.
    ToDtype,
    /// Layer norm over the last dim (candle_nn LayerNorm).
    LayerNorm,
    /// GELU activation (erf form unless the config asks for the tanh approximation).
    Gelu,
    /// Addition of an additive attention mask (0 / large negative), broadcast over heads.
    MaskAdd,
    /// Masked mean over the sequence axis (sentence-embedding pooling).
    MeanPool,
    /// L2 normalisation over the last dim.
    Normalize,
    /// Fused attention (candle_nn's CPU flash attention: scores, causal mask, softmax and
    /// probabilities @ V in one kernel), `[b, heads, seq, head_dim]`.
    FlashAttn,
    /// An existing tensor recorded where user code computed it (`Tracer::probe`): the op
    /// that made it is the caller's own.
    Probe,
}

const ALL_OPS: [Op; 22] = [
    Op::Input,
    Op::Embedding,
    Op::RmsNorm,
    Op::QMatMul,
    Op::Linear,
    Op::Matmul,
    Op::Scale,
    Op::WhereCond,
    Op::Softmax,
    Op::Rope,
    Op::Cat,
    Op::Silu,
    Op::Mul,
    Op::Add,
    Op::ToDtype,
    Op::LayerNorm,
    Op::Gelu,
    Op::MaskAdd,
    Op::MeanPool,
    Op::Normalize,
    Op::FlashAttn,
    Op::Probe,
];

impl Op {
    /// The name written in traces.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Embedding => "embedding",
            Op::RmsNorm => "rms_norm",
            Op::QMatMul => "qmatmul",
            Op::Linear => "linear",
            Op::Matmul => "matmul",
            Op::Scale => "scale",
            Op::WhereCond => "where_cond",
            Op::Softmax => "softmax",
            Op::Rope => "rope",
            Op::Cat => "cat",
            Op::Silu => "silu",
            Op::Mul => "mul",
            Op::Add => "add",
            Op::ToDtype => "to_dtype",
            Op::LayerNorm => "layer_norm",
            Op::Gelu => "gelu",
            Op::MaskAdd => "mask_add",
            Op::MeanPool => "mean_pool",
            Op::Normalize => "normalize",
            Op::FlashAttn => "flash_attn",
            Op::Probe => "probe",
        }
    }
    /// Reads a name written by [`Op::as_str`]; `None` for an unknown name.
    pub fn parse(s: &str) -> Option<Op> {
        ALL_OPS.iter().copied().find(|op| op.as_str() == s)
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A place in a model where an op runs: module path in Hugging Face checkpoint style
/// (`layers.3.self_attn.q_proj`) and the op. Built once when the model is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// Module path, e.g. `layers.3.self_attn.q_proj`.
    pub path: String,
    /// The op run there.
    pub op: Op,
}

impl Site {
    /// The site of `op` at module path `path`.
    pub fn new(path: impl Into<String>, op: Op) -> Self {
        Site { path: path.into(), op }
    }
}

/// How much of a forward pass a trace records (`trace record --level`). Written in an optional
/// frame of kind [`crate::format::KIND_LEVEL`] right after the header (format 2.3) when not
/// [`Level::Ops`]; a trace without one recorded every op.
///
/// Only the ops a level keeps are recorded; an op it skips passes its recorded inputs on to the
/// ops that read it, so each record's inputs are its nearest recorded ancestors (a layer's output
/// reads the previous layer's at positions `0..=p`).
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Level {
    /// Every op (the default).
    #[default]
    Ops,
    /// Each layer's output (the residual stream after the layer: `layers.N.mlp_residual`,
    /// BERT's `encoder.layer.N.output.LayerNorm`), the model's outputs and its inputs.
    Layers,
    /// The model's outputs (`lm_head`, `logits`, an encoder's `pooler.*`) and inputs only.
    Logits,
}

impl Level {
    /// The level's name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ops => "ops",
            Level::Layers => "layers",
            Level::Logits => "logits",
        }
    }

    /// Reads a name written by [`Level::as_str`].
    pub fn parse(s: &str) -> Option<Level> {
        [Level::Ops, Level::Layers, Level::Logits].into_iter().find(|l| l.as_str() == s)
    }

    /// True when this level records the op `op` at module path `path`.
    pub fn keeps(self, path: &str, op: Op) -> bool {
        let output = || path == "lm_head" || path == "logits" || path.starts_with("pooler.");
        match self {
            Level::Ops => true,
            Level::Layers => op == Op::Input || output() || is_layer_output(path),
            Level::Logits => op == Op::Input || output(),
        }
    }
}

/// True for the module path of a layer's output: `layers.N.mlp_residual` (decoders) or
/// `encoder.layer.N.output.LayerNorm` (BERT).
pub fn is_layer_output(path: &str) -> bool {
    // Runs for every op under `--level`: the tail first (most paths end otherwise), then the
    // layer index between prefix and tail as `layer_of` reads it and `{n}` writes it back:
    // decimal digits, no leading zero, within u32, compared in place.
    let canonical = |n: &str| n.parse::<u32>().is_ok() && n.bytes().all(|b| b.is_ascii_digit()) && (n == "0" || !n.starts_with('0'));
    let index = match (path.strip_suffix(".mlp_residual"), path.strip_suffix(".output.LayerNorm")) {
        (Some(head), _) => head.strip_prefix("layers."),
        (_, Some(head)) => head.strip_prefix("encoder.layer."),
        _ => None,
    };
    index.is_some_and(canonical)
}

/// Layer index of a module path: `layers.{i}.…` (decoders) or `encoder.layer.{i}.…` (BERT).
pub fn layer_of(path: &str) -> Option<u32> {
    path.strip_prefix("layers.").or_else(|| path.strip_prefix("encoder.layer."))?.split('.').next()?.parse().ok()
}

/// The `--dump` pattern naming every op of the layer `path` belongs to (`layers.3.*`), for a
/// root that is a layer's output or whose operands sit elsewhere in the layer; `None` for a
/// top-level module (dump it by its own path).
pub fn layer_dump_pattern(path: &str) -> Option<String> {
    layer_of(path).map(|_| format!("{}.*", layer_group(path)))
}

/// The group a module path belongs to in per-layer tables: `layers.{i}` / `encoder.layer.{i}`,
/// or the path itself for top-level modules.
pub fn layer_group(path: &str) -> String {
    match layer_of(path) {
        Some(l) if path.starts_with("encoder.layer.") => format!("encoder.layer.{l}"),
        Some(l) => format!("layers.{l}"),
        None => path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place test names exactly the paths the formatted comparison it replaced named.
    #[test]
    fn layer_outputs_are_the_paths_their_index_writes_back() {
        let formatted = |path: &str| match layer_of(path) {
            Some(n) => path == format!("layers.{n}.mlp_residual") || path == format!("encoder.layer.{n}.output.LayerNorm"),
            None => false,
        };
        let mut paths = Vec::new();
        for n in ["0", "3", "12", "03", "00", "+3", "-1", "4294967295", "4294967296", "", "x", "٣"] {
            for tail in ["mlp_residual", "output.LayerNorm", "mlp_residual.x", "mlp", ""] {
                for prefix in ["layers.", "encoder.layer.", "model.layers.", "layers"] {
                    paths.push(format!("{prefix}{n}.{tail}"));
                    paths.push(format!("{prefix}{n}{tail}"));
                }
            }
        }
        let named: Vec<&String> = paths.iter().filter(|p| is_layer_output(p)).collect();
        for p in &paths {
            assert_eq!(is_layer_output(p), formatted(p), "{p}");
        }
        assert!(named.len() >= 6, "{named:?}");
        assert!(is_layer_output("layers.0.mlp_residual") && is_layer_output("encoder.layer.11.output.LayerNorm"));
        assert!(!is_layer_output("layers.03.mlp_residual") && !is_layer_output("layers.+3.mlp_residual"));
    }

    #[test]
    fn op_names_round_trip() {
        for op in ALL_OPS {
            assert_eq!(Op::parse(op.as_str()), Some(op));
            assert_eq!(op.to_string(), op.as_str());
        }
        assert_eq!(Op::parse("conv2d"), None);
    }

    #[test]
    fn levels_keep_layer_outputs_and_model_outputs() {
        for l in [Level::Ops, Level::Layers, Level::Logits] {
            assert_eq!(Level::parse(l.as_str()), Some(l));
        }
        let layers = Level::Layers;
        assert!(layers.keeps("layers.3.mlp_residual", Op::Add) && layers.keeps("encoder.layer.5.output.LayerNorm", Op::LayerNorm));
        assert!(!layers.keeps("layers.3.attn_residual", Op::Add) && !layers.keeps("encoder.layer.5.attention.output.LayerNorm", Op::LayerNorm));
        assert!(layers.keeps("lm_head", Op::Linear) && layers.keeps("input_ids", Op::Input) && layers.keeps("pooler.mean", Op::MeanPool));
        assert!(Level::Logits.keeps("lm_head", Op::QMatMul) && !Level::Logits.keeps("layers.0.mlp_residual", Op::Add));
        assert!(Level::Ops.keeps("layers.0.self_attn.softmax", Op::Softmax));
    }

    /// A layer's ops are dumped by the layer's pattern, a top-level module by its own path.
    #[test]
    fn dump_patterns_name_the_layer() {
        assert_eq!(layer_dump_pattern("layers.3.self_attn.q_proj").as_deref(), Some("layers.3.*"));
        assert_eq!(layer_dump_pattern("encoder.layer.5.intermediate.act").as_deref(), Some("encoder.layer.5.*"));
        assert_eq!(layer_dump_pattern("embed_tokens"), None);
    }
}
