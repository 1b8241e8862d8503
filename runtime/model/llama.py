"""kvrun's transformer for the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Phi-3
with its fused projections split at conversion), Qwen2/Qwen3 (Qwen3-MoE: its sparse MLP
from moe.py), Granite and SmolLM3; Gemma 2, Gemma 3 and OLMo 2 bring their own decoder layer
(gemma2.py, gemma3.py, olmo2.py) to the same `Transformer`.

Family quirks are config fields (config.py): q/k norms and the query scale live in
attention.py; SmolLM3's NoPE layers take the second RoPE table set (`rope_local`, here the
identity: layers.NoRope), which Gemma 3's sliding layers take with their local base;
Granite's embedding multiplier and logits scaling are applied here.

Module names follow HF (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm` …) so converted weights load with `strict=True`. Attention reads and
writes K/V only through the cache object (`cache.attend_new`, runtime/kv/contract.py): the
step's K before RoPE and V's projection operands, which a cache with a fused window write
(the arena on the torch and Triton backends) runs inside its write; the model does not
know which cache it is.

The decode step has one owner: `bind(backend)` (kvrun.load calls it once, with the backend
the model's cache is built on: kernels/backend.py) builds it, and `forward` is the one
place a step's driver is chosen — the native decode step (native_step.py: one C call for a
token, the per-layer route for a chunk of up to CHUNK_MAX_ROWS tokens) where the backend is
native and the model's weights are ones its kernels read, else the eager forward, which is
also the torch backend's oracle. `decode_rows` is the same for B sequences at once.

Linear layers come from `make_linear`: dense `Linear`, or the weight-only quantized
`Int8Linear` / `Int4Linear` when the config's `weights` says so (qlinear.py). Quantized
models keep the token embedding as int8 rows; a tied lm_head then runs through the int8
GEMV on the embedding's own buffers (llama.cpp keeps token_embd in Q8_0 for the same
reason: the output projection is the most quantization-sensitive matrix).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import threads
from .config import ModelConfig
from .attention import Attention
from .layers import MLP, Linear, NoRope, RMSNorm, final_logits
from .moe import SparseMoeBlock
from .qlinear import QUANT_MODULES, Int8Embedding, Int8Linear, make_linear
from kvrun.kernels.native.decode_layer import MAX_ROWS     # the native step's rows a call
from kvrun.kernels.rope import Rope


class DecoderLayer(nn.Module):
    sliding = False                     # full attention (Gemma 3 has sliding layers: gemma3.py)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.local_rope = layer_idx in cfg.nope_layers   # the identity tables (module docstring)
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = (SparseMoeBlock(cfg) if cfg.is_moe(layer_idx) else       # Qwen3-MoE: moe.py
                    MLP(cfg.hidden_size, cfg.intermediate_size,
                        lambda i, o: make_linear(cfg.weights, cfg.weight_group, i, o)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def _blocks(cfg: ModelConfig):
    """(decoder layer class, norm class) of an architecture."""
    if cfg.architecture == "gemma3":
        from .gemma3 import Gemma3DecoderLayer, OffsetRMSNorm
        return Gemma3DecoderLayer, OffsetRMSNorm
    if cfg.architecture == "gemma2":
        from .gemma2 import Gemma2DecoderLayer
        from .gemma3 import OffsetRMSNorm
        return Gemma2DecoderLayer, OffsetRMSNorm
    if cfg.architecture == "olmo2":
        from .olmo2 import Olmo2DecoderLayer
        return Olmo2DecoderLayer, RMSNorm
    return DecoderLayer, RMSNorm


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        layer_cls, norm_cls = _blocks(cfg)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if cfg.weights == "float"
                             else Int8Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        # the output projection stays int8 in int4 models (see the module docstring)
        self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size) if cfg.weights == "float"
                        else Int8Linear(cfg.hidden_size, cfg.vocab_size))
        self.tie_weights()
        with torch.device("cpu"):       # tables stay real even when built on the meta device
            self.rope = Rope(**cfg.rope_args(), max_pos=cfg.max_position)
            # the second table set, for the layers whose `local_rope` is set: Gemma 3's sliding
            # layers (their own base, no scaling; HF: rope_local_base_freq), or the identity
            # for SmolLM3's NoPE layers (the config has not both); none when no layer takes
            # it (Gemma 2's sliding layers take the global tables)
            local = any(layer.local_rope for layer in self.model.layers)
            self.rope_local = (None if not local else
                               Rope(cfg.head_dim, cfg.rope_local_theta, None, cfg.max_position)
                               if "sliding_attention" in cfg.layer_types else NoRope(cfg.head_dim))
        # Gemma scales embeddings by sqrt(hidden), Granite by its embedding_multiplier; rounded
        # to the compute dtype as HF's Gemma does (the same value in fp32)
        self.embed_scale = (cfg.hidden_size ** 0.5 if cfg.architecture in ("gemma2", "gemma3") else
                            cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0 else None)

    def tie_weights(self) -> None:
        """Make a tied lm_head share the embedding's tensors (again after `to_empty`)."""
        if not self.cfg.tie_word_embeddings:
            return
        emb = self.model.embed_tokens
        if isinstance(self.lm_head, Linear):
            self.lm_head.weight = emb.weight
        else:
            self.lm_head.qweight, self.lm_head.scales = emb.qweight, emb.scales

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype        # norms are float in every weight format

    def set_gemv_dtype(self, dtype: torch.dtype | None) -> None:
        """Prepare the decode path: a second copy of every dense linear weight in `dtype`
        for few-row inputs; quantized layers build their fused op's packed weights."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.set_gemv_dtype(dtype)
            elif isinstance(m, QUANT_MODULES):
                m.prepare()
        if "_kernels" in self.__dict__:          # the native step points at the old buffers
            self.bind(self._kernels)

    def bind(self, backend) -> None:
        """Build the decode step for `backend` (kernels/backend.Backend), once: on native,
        the native decode step when `native_step.supported` says its kernels read this
        model's weights (`step_route` says which it is, before the first token)."""
        from .native_step import NativeDecodeStep, supported
        self._kernels = backend
        self._step = None
        if backend.name == "native" and supported(self):
            self._step = NativeDecodeStep(self, gemv=backend.gemv)

    def step_route(self) -> str:
        """How a decode token runs on the bound backend, in words."""
        if self._bound()._step is not None:
            return "native decode step (one C call a token)"
        why = ("the torch oracle" if self.kernels.name == "torch" else
               f"{self.kernels.name} attention" if self.kernels.name != "native" else
               "float or mixed weights, which the native step does not read")
        return f"eager forward ({why})"

    @property
    def kernels(self):
        """The bound backend (kernels/backend.Backend): its caches are built on it."""
        return self._bound()._kernels

    def _bound(self):
        """Bound to the default backend on first use when nothing bound it (a Transformer
        built directly, as tests do)."""
        if "_kernels" not in self.__dict__:
            from kvrun.kernels.backend import choose
            self.bind(choose(self.model.norm.weight.device))     # norms are float in every format
        return self

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """ids: (B, T) new tokens appended after the cache's contents.

        Returns float32 logits (B, T, V), or (B, 1, V) for the last position only.
        """
        B, T = ids.shape
        threads.tick()                              # fewer threads while cores are taken
        step = self.native_step(ids, cache)
        if step is not None:                        # decode on the native layer kernels
            return step(ids, cache) if T == 1 else step.chunk(ids, cache, last_only)
        return self.eager(ids, cache, last_only)

    def eager(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """The forward layer by layer in torch, attention through `cache.attend_new`: the
        torch backend's step and the oracle of every other (forward's arguments)."""
        B, T = ids.shape
        positions = cache.positions(T)                                  # (T,)
        cos, sin = self.rope.tables(positions, self.dtype, cache.max_ctx)   # (T, D)
        local = (cos, sin) if self.rope_local is None else self.rope_local.tables(positions, self.dtype)
        h = self.model.embed_tokens(ids).to(self.dtype)                 # (B, T, hidden)
        if self.embed_scale is not None:
            # HF keeps sqrt(hidden) as an fp32 buffer and casts it to the weights' dtype
            h = h * torch.tensor(self.embed_scale, dtype=torch.float32).to(self.dtype)
        for layer in self.model.layers:
            h = layer(h, *(local if layer.local_rope else (cos, sin)), cache)
        cache.commit(T)
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(self.model.norm(h)).float()
        return final_logits(logits, self.cfg.logits_scaling, self.cfg.final_logit_softcapping)

    def native_step(self, ids: torch.Tensor, cache):
        """The native decode step (native_step.py, built by `bind`) when it covers a
        one-token step of `ids` (1, 1) on `cache`, or a prefill chunk (1, T) of 2 to
        CHUNK_MAX_ROWS tokens, on a cache built for the native backend; else None (the
        eager forward). Calling it runs the step; its `chunk(ids, cache)` runs a chunk, its
        `rows(ids, caches)` B one-token rows, each on its own cache."""
        step = self._bound()._step
        if step is None or not (step.applies(ids, cache) or step.applies_chunk(ids, cache)):
            return None
        return step

    @torch.inference_mode()
    def decode_rows(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        """One decode step of B sequences: ids (B, 1), row b the next token of the sequence
        in caches[b] (each cache one sequence). Returns float32 logits (B, V). The rows the
        native step covers run together, MAX_ROWS at a time (each weight read once a group;
        every row's logits the bits of its own step); the others one by one through
        `forward`, what a lone sequence runs."""
        B = ids.shape[0]
        out = torch.empty(B, self.cfg.vocab_size)
        step = self._bound()._step
        native = [b for b in range(B) if step is not None and step.applies(ids[b:b + 1], caches[b])]
        for s in range(0, len(native), MAX_ROWS):                       # groups of MAX_ROWS rows
            rows = native[s:s + MAX_ROWS]
            out[rows] = step.rows(ids[rows], [caches[b] for b in rows])[:, 0]
        for b in sorted(set(range(B)) - set(native)):                  # the eager forward, alone
            out[b] = self(ids[b:b + 1], caches[b], last_only=True)[0, -1]
        return out

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Strict load; a tied lm_head is the only key allowed to be absent."""
        # quantized codes keep their integer dtype; their fp16 scales widen exactly
        state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if self.cfg.tie_word_embeddings:
            missing = [k for k in missing if not k.startswith("lm_head.")]
        if missing or unexpected:
            from ..errors import KvrunError
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} tensors (e.g. {unexpected[0]})")
            raise KvrunError("weights do not match the config: " + "; ".join(parts))
