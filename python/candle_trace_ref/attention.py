"""A recording attention function for transformers' ``AttentionInterface``.

It computes what transformers' ``eager_attention_forward`` computes, op by op, and records each
op under candle-trace's names: ``rope_q`` and ``rope_k`` (queries and the pass's new keys after
rotary embedding, ``[b, heads, q, d]``), ``k_cache``/``v_cache`` (keys and values of every
position so far), ``scores`` (``q @ k^T``, ``[b, heads, q, kv]``), ``scale`` (times
``scaling``), the mask (``mask``/``sliding_mask`` for decoders, ``mask_add`` for encoders),
``softmax`` and ``attn_v`` (``[b, heads, q, d]``, before the heads are merged).

The mask is recorded as candle applies it: decoders fill masked scores with ``-inf`` (where
eager adds the dtype's minimum; softmax gives exactly 0 either way) when the pass holds more than
one query or the mask hides a key (a decode step past a sliding window); encoders add the extended mask (0 where a key is visible).
"""

import torch

from .state import STATE


def _repeat_kv(x, groups):
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Drop-in for ``eager_attention_forward`` (same arguments, same result) that records."""
    ex, names = STATE.exchange, STATE.attention_paths
    path = names.get(id(module))
    rec = (lambda *a: ex.op(*a)) if (ex is not None and path is not None) else (lambda *a: None)
    encoder = not getattr(module, "is_causal", True)
    tok = "keys" if encoder else "causal"
    q_len = query.shape[2]
    if not encoder:
        rec(f"{path}.rope_q", "rope", query, "seq:2")
        rec(f"{path}.rope_k", "rope", key[:, :, -q_len:, :], "seq:2")
        rec(f"{path}.k_cache", "cat", key, "cache")
        rec(f"{path}.v_cache", "cat", value, "cache")
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    w = torch.matmul(query, k.transpose(2, 3))
    rec(f"{path}.scores", "matmul", w, tok)
    w = w * scaling
    rec(f"{path}.scale", "scale", w, tok)
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if encoder:
        if attention_mask is not None:
            w = w + attention_mask
        rec(f"{path}.mask_add", "mask_add", w, tok)
    elif attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            w = w.masked_fill(~attention_mask, float("-inf"))
        else:
            w = torch.where(attention_mask < 0, torch.full_like(w, float("-inf")), w + attention_mask)
        # A decode step's mask is recorded where it hides a key (a sliding layer past its
        # window), as candle-trace's Gemma 3 applies one only there.
        hides = (~attention_mask).any() if attention_mask.dtype == torch.bool else (attention_mask < 0).any()
        if q_len > 1 or bool(hides):
            sliding = getattr(module, "is_sliding", False) or getattr(module, "sliding_window", None) is not None
            rec(f"{path}.{'sliding_mask' if sliding else 'mask'}", "where_cond", w, tok)
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    rec(f"{path}.softmax", "softmax", w, tok)
    out = torch.matmul(w, v)
    rec(f"{path}.attn_v", "matmul", out, "seq:2")
    return out.transpose(1, 2).contiguous(), w


def register():
    """Registers the function as attention implementation ``candle_trace`` (with eager's mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register("candle_trace", recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("candle_trace", eager_mask)
