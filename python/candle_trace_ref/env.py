"""The reference run's model description and environment, for the exchange's header."""

import hashlib
import os
import platform
import sys

import torch


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_file(model_path, gguf_file):
    """The weights file a model folder or GGUF file stands for."""
    if gguf_file:
        return os.path.join(model_path, gguf_file)
    for name in ("model.safetensors", "pytorch_model.bin"):
        p = os.path.join(model_path, name)
        if os.path.exists(p):
            return p
    return None


def model_info(model_path, gguf_file, config, architecture):
    """``model`` of the exchange: file name, size and sha256 of the weights, the config."""
    f = weights_file(model_path, gguf_file)
    cfg = config.to_dict() if hasattr(config, "to_dict") else {}
    flat = {}

    def walk(prefix, d):
        for k, v in sorted(d.items()):
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif isinstance(v, (str, int, float, bool)) or v is None or isinstance(v, list):
                flat[f"{prefix}{k}"] = v

    walk("", cfg)
    return {
        "name": os.path.basename(f) if gguf_file else f"{architecture} ({os.path.basename(os.path.normpath(model_path))})",
        "size": os.path.getsize(f) if f else 0,
        "sha256": sha256_file(f) if f else "",
        "architecture": architecture,
        "n_layers": int(getattr(config, "num_hidden_layers", 0) or 0),
        "vocab_size": int(getattr(config, "vocab_size", 0) or 0),
        "config": flat,
    }


def cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env_info(device):
    """``env`` of the exchange: library versions, machine, threads, device."""
    import transformers

    libs = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import sentence_transformers

        libs["sentence-transformers"] = sentence_transformers.__version__
    except ImportError:
        pass
    return {
        "implementation": "transformers",
        "libraries": libs,
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "python_executable": os.path.basename(sys.executable),
    }
