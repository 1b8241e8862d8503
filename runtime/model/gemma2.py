"""Gemma 2's decoder layer (Gemma Team, "Gemma 2: Improving Open Language Models at a
Practical Size", 2024), as HF's `modeling_gemma2` computes it.

Gemma 3's layer (gemma3.py) is Gemma 2's plus what Gemma 3 added, so this is that layer
without those: the same (1 + w) RMSNorms, sandwich norms, GeGLU MLP, sqrt(hidden) embedding
scale and query_pre_attn_scalar (Attention's q_scale); no q/k norms (config.py's QK_NORMS
names none for gemma2); one RoPE table for every layer (no local base: the sliding layers
take the global tables, with whatever rope scaling the config has). Sliding-window layers
alternate with global ones, the even layers sliding (config.py GLOBAL_EVERY), in the
cache's rings (runtime/kv/ring.py) as Gemma 3's are.

Its own quirk, attention logit soft-capping (scores s, after the query scaling, become
attn_logit_softcapping·tanh(s / attn_logit_softcapping) before the mask and softmax: HF's
eager_attention_forward), is not in this file: the scores exist only inside the caches'
attention kernels, so the cache carries the cap (runtime/kv/build.py, from the config) and
each backend's kernel applies it where it forms the logits. The final logits' soft-cap
(final_logit_softcapping) is the Transformer's, as for Gemma 3 (layers.py `final_logits`).
"""
from __future__ import annotations

from .config import ModelConfig
from .gemma3 import Gemma3DecoderLayer


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.local_rope = False             # sliding or not, the model's one RoPE table
