"""Forward hooks that record module outputs under candle-trace's module paths.

A module's path is its transformers name with the wrapper prefix (``model.``,
``model.language_model.``) removed, as Hugging Face checkpoints name it
(``layers.3.self_attn.q_proj``). What each recorded path holds, by module:

- decoders: ``embed_tokens`` (Gemma 3 scales it inside the module: recorded as ``embed_scale``),
  ``layers.N.input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
  ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``,
  ``mlp.{gate,up,down}_proj``, ``mlp.act_fn`` as ``mlp.act``, ``norm``, ``lm_head`` (the last
  position only, as candle computes it); derived from module inputs and outputs:
  ``attn_residual`` (the input of the norm after the attention residual), ``mlp.mul`` (the input of
  ``down_proj``), ``mlp_residual`` (the decoder layer's output);
- encoders (BERT): ``embeddings.{word,token_type,position}_embeddings``, ``add_token_type`` (word
  plus token-type embeddings, recomputed), ``add_position`` (the input of ``embeddings.LayerNorm``),
  ``embeddings.LayerNorm``, ``encoder.layer.N.attention.self.{query,key,value}``,
  ``attention.output.dense``, ``attention.output.residual`` (the input of its ``LayerNorm``),
  ``attention.output.LayerNorm``, ``intermediate.dense``, ``intermediate.act``, ``output.dense``,
  ``output.residual``, ``output.LayerNorm``.

The attention ops inside ``self_attn`` come from :mod:`candle_trace_ref.attention`.
"""

import re

from .state import STATE

_PREFIX = re.compile(r"^(model\.language_model\.|model\.)")
_LAYER = re.compile(r"^layers\.\d+$")


def path_of(name):
    """The candle-trace module path of a transformers module name."""
    return _PREFIX.sub("", name)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _rec(path, op, tok, pick=_first):
    def hook(_module, _inputs, output):
        if STATE.exchange is not None:
            STATE.exchange.op(path, op, pick(output), tok)

    return hook


def _rec_input(path, op, tok, index=0):
    def hook(_module, inputs, kwargs=None):
        if STATE.exchange is not None:
            x = inputs[index] if len(inputs) > index else next(iter((kwargs or {}).values()))
            STATE.exchange.op(path, op, x, tok)

    return hook


def _decoder_rule(path, module, act):
    """(recorded path, op, tok, pick) for a decoder module's output, or None."""
    leaf = path.rsplit(".", 1)[-1]
    if path == "embed_tokens":
        return ("embed_scale", "scale") if hasattr(module, "embed_scale") else ("embed_tokens", "embedding"), "seq:1"
    if path == "norm" or leaf in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        return (path, "rms_norm"), "seq:1"
    if leaf in ("q_norm", "k_norm"):
        return (path, "rms_norm"), "seq:2"
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        return (path, "linear"), "seq:1"
    if leaf == "act_fn":
        return (path[: -len("act_fn")] + "act", act), "seq:1"
    return None


def install_decoder(model):
    """Hooks every recorded module of a causal LM; returns the hook handles."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    act = "gelu" if "gelu" in act_name else "silu"
    handles = []
    for name, module in model.named_modules():
        path = path_of(name)
        if name.endswith("self_attn"):
            STATE.attention_paths[id(module)] = path
        if path == "lm_head":
            handles.append(module.register_forward_hook(_rec("lm_head", "linear", "last", lambda y: y[:, -1, :])))
            continue
        if _LAYER.match(path):
            handles.append(module.register_forward_hook(_rec(f"{path}.mlp_residual", "add", "seq:1")))
            residual_norm = "pre_feedforward_layernorm" if hasattr(module, "pre_feedforward_layernorm") else "post_attention_layernorm"
            norm = getattr(module, residual_norm)
            handles.append(norm.register_forward_pre_hook(_rec_input(f"{path}.attn_residual", "add", "seq:1"), with_kwargs=True))
            continue
        if path.endswith("mlp.down_proj"):
            handles.append(module.register_forward_pre_hook(_rec_input(path[: -len("down_proj")] + "mul", "mul", "seq:1"), with_kwargs=True))
        rule = _decoder_rule(path, module, act)
        if rule is not None:
            (p, op), tok = rule
            handles.append(module.register_forward_hook(_rec(p, op, tok)))
    return handles


def install_encoder(bert):
    """Hooks every recorded module of a BERT model (sentence-transformers' ``auto_model``)."""
    handles = []
    words = {}
    for name, module in bert.named_modules():
        path = name
        leaf = path.rsplit(".", 1)[-1]
        if path.endswith("attention.self"):
            STATE.attention_paths[id(module)] = path
        if path == "embeddings.word_embeddings":

            def keep(_m, _i, y):
                words["y"] = y
                if STATE.exchange is not None:
                    STATE.exchange.op("embeddings.word_embeddings", "embedding", y, "seq:1")

            handles.append(module.register_forward_hook(keep))
        elif path == "embeddings.token_type_embeddings":

            def add(_m, _i, y):
                if STATE.exchange is not None:
                    STATE.exchange.op("embeddings.token_type_embeddings", "embedding", y, "seq:1")
                    STATE.exchange.op("embeddings.add_token_type", "add", words["y"] + y, "seq:1")

            handles.append(module.register_forward_hook(add))
        elif path == "embeddings.position_embeddings":
            handles.append(module.register_forward_hook(_rec(path, "embedding", "seq:1")))
        elif path == "embeddings.LayerNorm":
            handles.append(module.register_forward_pre_hook(_rec_input("embeddings.add_position", "add", "seq:1"), with_kwargs=True))
            handles.append(module.register_forward_hook(_rec(path, "layer_norm", "seq:1")))
        elif leaf in ("query", "key", "value") or path.endswith(("output.dense", "intermediate.dense")):
            handles.append(module.register_forward_hook(_rec(path, "linear", "seq:1")))
        elif path.endswith("intermediate.intermediate_act_fn"):
            handles.append(module.register_forward_hook(_rec(path[: -len("intermediate_act_fn")] + "act", "gelu", "seq:1")))
        elif path.endswith("output.LayerNorm"):
            base = path[: -len("LayerNorm")]
            handles.append(module.register_forward_pre_hook(_rec_input(base + "residual", "add", "seq:1"), with_kwargs=True))
            handles.append(module.register_forward_hook(_rec(path, "layer_norm", "seq:1")))
    return handles
