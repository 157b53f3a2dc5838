"""What the hooks and the attention function record into (one reference run at a time)."""


class _State:
    def __init__(self):
        self.exchange = None
        # id(attention module) -> candle-trace module path of its attention (`layers.3.self_attn`).
        self.attention_paths = {}


STATE = _State()
