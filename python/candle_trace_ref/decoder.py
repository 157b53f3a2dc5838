"""Greedy generation with a causal LM, recording every forward pass into an :class:`Exchange`."""

import inspect

import numpy as np
import torch
from transformers import DynamicCache

from .state import STATE


def top5(logits):
    """Up to 5 (token id, logit) pairs, highest logit first, ties broken by lowest id (as the
    trace's ``Choice.top``)."""
    v = logits.detach().to(torch.float32).cpu().numpy()
    order = np.lexsort((np.arange(v.shape[0]), -v))[:5]
    return [(int(i), float(v[i])) for i in order]


def eos_ids(model):
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


@torch.no_grad()
def generate(model, tokenizer, ids, max_tokens, exchange, prefill_ops=True, full_cache=True):
    """Feeds ``ids`` (a list of ints) as one prefill pass, then decodes greedily (argmax, ties to
    the lowest id) up to ``max_tokens`` tokens or an end-of-sequence token, with the KV cache.
    Without ``prefill_ops`` the prefill records its input ids, KV cache and token, no other op
    output. Without
    ``full_cache`` the model keeps its own cache (a rolling window on sliding layers).
    Returns the generated ids."""
    STATE.exchange = exchange
    eos = eos_ids(model)
    x = torch.tensor([ids], dtype=torch.long)
    # A cache of every position on every layer (no config: no rolling window layers), so a
    # sliding layer's keys are those of the whole sequence, masked by the window as the model
    # defines it, and records line up with candle-trace's, position by position.
    past, pos, out = (DynamicCache() if full_cache else None), 0, []
    # transformers 5.x renames `past_key_values` to `cache`; take whichever this version has.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    try:
        for step in range(max(max_tokens, 1)):
            exchange.begin_forward("prefill" if step == 0 else "decode", pos, x)
            exchange.op("input_ids", "input", x, "seq:1")
            recording = getattr(exchange, "recording", True)
            if step == 0 and not prefill_ops:
                # The KV cache's records stay: a rolling cache's later records hold only the
                # latest positions, and the import restores the others from these.
                exchange.recording = "cache"
            try:
                res = model(input_ids=x, use_cache=True, logits_to_keep=1, **{cache_arg: past})
            finally:
                exchange.recording = recording
            past = getattr(res, cache_arg)
            pos += x.shape[1]
            if max_tokens == 0:
                break
            last = res.logits[0, -1]
            tok = int(np.lexsort((np.arange(last.shape[0]), -last.to(torch.float32).cpu().numpy()))[0])
            text = tokenizer.decode(out + [tok])[len(tokenizer.decode(out)) :] if tokenizer is not None else ""
            exchange.token(step, len(out), pos, tok, text, top5(last))
            out.append(tok)
            if tok in eos:
                break
            x = torch.tensor([[tok]], dtype=torch.long)
    finally:
        STATE.exchange = None
    return out
