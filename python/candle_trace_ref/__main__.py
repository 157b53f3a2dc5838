"""``candle-trace-ref``: record a transformers reference run as an exchange for ``trace import``.

    candle-trace-ref record --model models/smollm2-hf --prompt "The capital of France is" \
        --max-tokens 8 --out ref/
    trace import ref/ -o ref.trace
    trace bisect ref.trace candle.trace --tolerance auto

Exit 0 written, 2 bad input (a one-line error naming the problem).
"""

import argparse
import os
import statistics
import sys
import time


def _fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _args(argv):
    p = argparse.ArgumentParser(prog="candle-trace-ref", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("record", "bench"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="Hugging Face folder, or a GGUF file (dequantized by transformers)")
        s.add_argument("--prompt", help="prompt text, tokenized by the model's tokenizer (transformers')")
        s.add_argument("--ids", help="token ids to feed, comma-separated (e.g. the ids a candle trace shows)")
        s.add_argument("--text", action="append", default=[], help="encoders: a sentence to embed; repeat for a batch")
        s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
        s.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32", help="dtype the reference computes in (default f32)")
        s.add_argument("--threads", type=int, help="torch CPU threads")
        s.add_argument("--cache", choices=["full", "rolling"], default="full", help="decoders: keep every position of every layer in the KV cache (default; records line up with candle-trace's), or the model's own cache (transformers' rolling window on sliding layers)")
        s.add_argument("--ops", choices=["all", "decode"], default="all", help="whose op outputs to record: every pass's (default), or the decode steps' only (a long prompt's prefill holds most of an exchange; the prefill then records its ids, KV cache and token)")
        if name == "record":
            s.add_argument("--out", required=True, help="exchange folder to write (exchange.json, values.safetensors)")
        else:
            s.add_argument("--repeats", type=int, default=5, help="runs of each kind, interleaved (default 5)")
    return p.parse_args(argv)


def _dtype(name):
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


def _locate(model):
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    if os.path.isdir(model):
        return model, None
    _fail(f"{model}: not a model folder or a .gguf file")


def _load_decoder(a, attn):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = _locate(a.model)
    kw = {"gguf_file": gguf} if gguf else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(a.dtype), attn_implementation=attn, **kw)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    return model, tok, folder, gguf


def _ids(a, tok):
    if a.ids:
        try:
            return [int(x) for x in a.ids.replace(" ", "").split(",") if x]
        except ValueError:
            _fail(f"--ids {a.ids}: expected comma-separated token ids")
    if a.prompt is None:
        _fail("give --prompt or --ids (or --text for an encoder folder)")
    return tok(a.prompt)["input_ids"]


def _is_encoder(model):
    return os.path.isdir(model) and os.path.exists(os.path.join(model, "modules.json"))


def record(a):
    from . import attention, hooks
    from .env import env_info, model_info
    from .exchange import Exchange

    attention.register()
    ex = Exchange()
    if _is_encoder(a.model):
        from sentence_transformers import SentenceTransformer

        from . import encoder

        if not a.text:
            _fail(f"{a.model}: an encoder folder needs --text")
        st = SentenceTransformer(a.model, device="cpu", model_kwargs={"attn_implementation": "candle_trace", "dtype": _dtype(a.dtype)})
        bert = st[0].auto_model
        hooks.install_encoder(bert)
        encoder.install_pooling(st)
        encoder.embed(st, a.text, ex)
        model = model_info(a.model, None, bert.config, bert.config.model_type)
        run = {"dtype": a.dtype, "texts": a.text, "pooling": encoder.pooling_name(st), "prompt": "", "prompt_tokens": [], "max_tokens": 0}
        not_covered = []
    else:
        from . import decoder

        m, tok, folder, gguf = _load_decoder(a, "candle_trace")
        ids = _ids(a, tok)
        vocab = m.get_input_embeddings().num_embeddings
        if not ids or any(i < 0 or i >= vocab for i in ids):
            _fail(f"{a.model}: token ids must be 0 to {vocab - 1} (the embedding's rows), at least one")
        hooks.install_decoder(m)
        decoder.generate(m, tok, ids, a.max_tokens, ex, prefill_ops=a.ops == "all", full_cache=a.cache == "full")
        model = model_info(folder, gguf, m.config, m.config.model_type)
        run = {"dtype": a.dtype, "prompt": a.prompt or "", "prompt_tokens": ids, "max_tokens": a.max_tokens, "texts": [], "pooling": ""}
        scaled = hasattr(m.get_input_embeddings(), "embed_scale")
        not_covered = ["embed_tokens before the embedding scale (transformers' Gemma 3 scales inside its embedding module)"] if scaled else []
    ex.write(a.out, model, run, env_info("cpu"), not_covered)
    n = sum(len(f["ops"]) for f in ex.forwards)
    print(f"wrote {a.out}: {len(ex.forwards)} forward passes, {n} op outputs, {len(ex.tokens)} tokens", file=sys.stderr)
    if ex.tokens:
        print("".join(t["text"] for t in ex.tokens))


def bench(a):
    """Greedy generation with the recorder (hooks, recording attention, values copied out) vs
    without (eager attention, no hooks), interleaved; prints the median ratio."""
    from . import attention, decoder, hooks
    from .exchange import Exchange

    attention.register()
    plain, tok, _, _ = _load_decoder(a, "eager")
    traced, _, _, _ = _load_decoder(a, "candle_trace")
    hooks.install_decoder(traced)
    ids = _ids(a, tok)
    times = {"plain": [], "traced": []}
    for _ in range(a.repeats):
        for kind, m in (("plain", plain), ("traced", traced)):
            t0 = time.perf_counter()
            decoder.generate(m, tok, ids, a.max_tokens, Exchange() if kind == "traced" else _Null())
            times[kind].append(time.perf_counter() - t0)
    p, t = statistics.median(times["plain"]), statistics.median(times["traced"])
    print(f"generation of {a.max_tokens} tokens, median of {a.repeats}: traced/untraced {t / p:.3f}x")


class _Null:
    """An exchange that keeps nothing (the untraced baseline)."""

    def begin_forward(self, *a):
        pass

    def op(self, *a):
        pass

    def token(self, *a):
        pass


def main(argv=None):
    a = _args(sys.argv[1:] if argv is None else argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if not os.path.exists(a.model):
        _fail(f"{a.model}: no such file or folder")
    {"record": record, "bench": bench}[a.cmd](a)


if __name__ == "__main__":
    main()
