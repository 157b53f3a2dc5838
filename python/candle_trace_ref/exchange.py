"""The exchange a reference run writes: ``exchange.json`` plus ``values.safetensors``.

Layout (version 1, read by ``trace import``; the Rust side is ``crates/run/src/import.rs``)::

    {"format": "candle-trace-exchange", "version": 1,
     "model": {...}, "run": {...}, "env": {...},
     "forwards": [{"phase": "prefill" | "decode", "index_pos": P, "ids": [[...], ...],
                   "ops": [{"path": "layers.0.self_attn.q_proj", "op": "linear",
                            "value": "000017", "tok": "seq:1"}, ...]}, ...],
     "tokens": [{"step": S, "index": I, "pos": P, "token": T, "text": "...",
                 "top": [[id, logit], ...]}, ...],
     "embeddings": [[...], ...],
     "not_covered": ["..."]}

``value`` names a tensor in ``values.safetensors`` (the op's output, on the CPU, in the dtype
the reference computed it in). ``tok`` says where the token axis is, as the Rust recorder's
``Tok``: ``seq:D`` (dim D holds the pass's positions), ``causal`` (attention scores
``[b, heads, q, kv]``, causal), ``keys`` (encoder scores, every key visible), ``cache``
(``[b, kv_heads, kv, head_dim]`` from position 0), ``last`` (``[b, ...]``, the pass's last
position), ``whole`` (no token axis).
"""

import json
import os

import torch
from safetensors.torch import save_file

from . import EXCHANGE_VERSION


class Exchange:
    """Collects a run's forward passes, op outputs and tokens; :meth:`write` saves them."""

    def __init__(self):
        self.forwards = []
        self.tokens = []
        self.embeddings = []
        self.values = {}
        self.recording = True

    def begin_forward(self, phase, index_pos, ids):
        """Starts a forward pass over ``ids`` (``[batch, seq]`` ints) at absolute ``index_pos``."""
        self.forwards.append({"phase": phase, "index_pos": int(index_pos), "ids": [[int(x) for x in row] for row in ids.tolist()], "ops": []})

    def op(self, path, op, t, tok):
        """Records one op output ``t`` at module path ``path``; ignored outside a forward pass, and
        while ``recording`` is false (or ``"cache"``, for all but the KV cache's records)."""
        if not self.recording or not self.forwards or (self.recording == "cache" and tok != "cache"):
            return
        key = f"{len(self.values):06d}"
        self.values[key] = t.detach().to("cpu").contiguous().clone()
        self.forwards[-1]["ops"].append({"path": path, "op": op, "value": key, "tok": tok})

    def token(self, step, index, pos, token, text, top):
        """Records generated token ``index`` chosen after forward pass ``step``."""
        self.tokens.append({"step": step, "index": index, "pos": pos, "token": int(token), "text": text, "top": [[int(i), float(v)] for i, v in top]})

    def write(self, out, model, run, env, not_covered):
        """Writes ``out/exchange.json`` and ``out/values.safetensors`` (each through a temporary
        file renamed into place, so a crash never leaves a half-written exchange)."""
        os.makedirs(out, exist_ok=True)
        doc = {
            "format": "candle-trace-exchange",
            "version": EXCHANGE_VERSION,
            "model": model,
            "run": run,
            "env": env,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "embeddings": self.embeddings,
            "not_covered": not_covered,
        }
        tmp = os.path.join(out, "values.safetensors.part")
        save_file(self.values, tmp)
        os.replace(tmp, os.path.join(out, "values.safetensors"))
        tmp = os.path.join(out, "exchange.json.part")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(out, "exchange.json"))
