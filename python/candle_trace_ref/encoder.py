"""Sentence embeddings with sentence-transformers, recording the BERT ops and the pooling."""

import torch

from .state import STATE


@torch.no_grad()
def embed(st, texts, exchange):
    """Embeds ``texts`` as one batch (padded as sentence-transformers pads); records every op,
    the pooled embeddings (``pooler.mean``, ``pooler.normalize`` when the pipeline normalizes)
    and the final vectors. Returns them as lists."""
    STATE.exchange = exchange
    try:
        features = st.preprocess(texts) if hasattr(st, "preprocess") else st.tokenize(texts)
        exchange.begin_forward("prefill", 0, features["input_ids"])
        for name in ("input_ids", "token_type_ids", "attention_mask"):
            if name in features:
                exchange.op(name, "input", features[name], "seq:1")
        out = st(features)["sentence_embedding"]
    finally:
        STATE.exchange = None
    vectors = out.to(torch.float32).tolist()
    exchange.embeddings = vectors
    return vectors


def install_pooling(st):
    """Hooks sentence-transformers' Pooling and Normalize modules."""
    handles = []
    for module in st:
        kind = type(module).__name__
        if kind == "Pooling":
            path, op = "pooler.mean", "mean_pool"
        elif kind == "Normalize":
            path, op = "pooler.normalize", "normalize"
        else:
            continue

        def hook(_m, _i, y, path=path, op=op):
            if STATE.exchange is not None:
                STATE.exchange.op(path, op, y["sentence_embedding"], "whole")

        handles.append(module.register_forward_hook(hook))
    return handles


def pooling_name(st):
    """The pooling as the trace header names it (``mean+normalize``, ``cls``, ...)."""
    mode, norm = "", False
    for module in st:
        kind = type(module).__name__
        if kind == "Pooling":
            cfg = module.get_config_dict() if hasattr(module, "get_config_dict") else {}
            mode = cfg.get("pooling_mode") or ("mean" if cfg.get("pooling_mode_mean_tokens") else "cls" if cfg.get("pooling_mode_cls_token") else "mean")
        elif kind == "Normalize":
            norm = True
    return mode + ("+normalize" if norm else "")
