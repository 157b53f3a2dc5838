"""Reference recorder for candle-trace.

Runs a Hugging Face transformers model (decoders through ``AutoModelForCausalLM``, encoders
through sentence-transformers) greedily on given token ids and writes an *exchange*: a folder
holding ``exchange.json`` (what ran, in order, under candle-trace's module paths) and
``values.safetensors`` (every recorded op's output). ``trace import FOLDER -o ref.trace`` turns
the exchange into a trace with the Rust format code, so the trace format has one implementation.
See docs/reference.md.
"""

__version__ = "0.1.0"
EXCHANGE_VERSION = 1
