"""Model configuration: kvrun's own config.json schema.

`ModelConfig` is what `kvrun convert` writes and what the model is built from. Derived
fields are computed in `__post_init__`; `from_dict` keeps known keys only, so a config
written by a newer kvrun still loads.

Layer kinds (Gemma 2 and 3): `layer_types[i]` is "full_attention" or "sliding_attention"
(HF's names). A sliding layer attends to its last `sliding_window` tokens (the current one
included); Gemma 3's with RoPE base `rope_local_theta` and no rope scaling, Gemma 2's with
the global tables (gemma2.py); a full layer to every cached token with `rope_theta` /
`rope_scaling`. Llama-family configs have only full layers.
`layer_windows` gives what a KV cache needs: per layer the window, 0 for full attention.

Family quirks are fields, each HF's own setting (convert/hf.py reads them):
- `qk_norm`: RMSNorm of q and k before RoPE: "head" (per head over D: Qwen3, Gemma 3) or
  "proj" (over the whole H·D / Hkv·D projection: OLMo 2); "" none. Derived from the
  architecture.
- `nope_layers`: layers that apply no RoPE (SmolLM3's NoPE layers, every 4th).
- `embedding_multiplier`, `attention_multiplier` (the score scale, replacing D**-0.5; 0 keeps
  it), `logits_scaling` (logits divided by it): Granite's multipliers. Its
  residual_multiplier is folded into o_proj / down_proj at conversion (convert/hf.py).
- `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
  `mlp_only_layers`: Qwen3-MoE's sparse MLP (runtime/model/moe.py). Every layer not in
  `mlp_only_layers` routes each token to its top `num_experts_per_tok` of `num_experts`
  SwiGLU experts of `moe_intermediate_size`; the listed layers keep the dense MLP of
  `intermediate_size`. HF's `decoder_sparse_step` is folded into the list at conversion.
- `rotary_dim`: RoPE on that many channels of each head (Phi-4-mini's
  partial_rotary_factor · D); convert/ permutes q and k's rows so the rotated pairs are
  (i, i + D/2), i < rotary_dim/2, and the rest of the channels see frequency 0
  (kernels/rope.py). 0 → head_dim.
- `attn_logit_softcapping` (Gemma 2; None: off): attention scores, once scaled, become
  cap·tanh(s / cap) before the mask and softmax. The scores exist only inside the caches'
  attention kernels, so the cache carries it (runtime/kv/build.py), not the model.
`q_scale` is what q is multiplied by so that the caches' D**-0.5 scaling gives the
family's score scale.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvrunError
from kvrun.kernels.rope import ROPE_TYPES, rope_kind

# granite and smollm3 run the Llama layer with their config quirks; olmo2 its own (olmo2.py)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "granite", "olmo2", "smollm3")
QK_NORMS = {"qwen3": "head", "qwen3moe": "head", "gemma3": "head", "olmo2": "proj"}
CHAT_TEMPLATES = ("chatml", "llama3", "mistral", "gemma", "none")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma 3: every 6th layer is global (HF Gemma3TextConfig.sliding_window_pattern, llama.cpp
# set_swa_pattern(6)); Gemma 2: every 2nd (the even layers slide: HF Gemma2Config's
# layer_types, llama.cpp set_swa_pattern(2)); the GGUF does not store the pattern.
GEMMA3_GLOBAL_EVERY = 6
GLOBAL_EVERY = {"gemma2": 2, "gemma3": GEMMA3_GLOBAL_EVERY}


@dataclass
class ModelConfig:
    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0                       # 0 → hidden_size // num_heads
    max_position: int = 4096                # trained context length
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # {"type": "linear"|"llama3"|"longrope", ...}
    rotary_dim: int = 0                     # channels of a head RoPE rotates (0 → head_dim)
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Qwen2: q/k/v projections carry a bias
    layer_types: list[str] = field(default_factory=list)   # per layer; [] → all full_attention
    sliding_window: int = 0                 # tokens a sliding layer sees (0: no sliding layers)
    rope_local_theta: float = 0.0           # RoPE base of sliding layers (0 → rope_theta)
    query_pre_attn_scalar: float = 0.0      # scores scaled by this**-0.5 (0 → head_dim)
    final_logit_softcapping: float | None = None   # logits = cap·tanh(logits / cap)
    attn_logit_softcapping: float | None = None    # attention scores = cap·tanh(s / cap) (Gemma 2)
    qk_norm: str = ""                       # "head" | "proj" | "" (derived: QK_NORMS)
    nope_layers: list[int] = field(default_factory=list)   # layers without RoPE (SmolLM3)
    embedding_multiplier: float = 1.0       # Granite: embeddings times this
    attention_multiplier: float = 0.0       # Granite: score scale (0 → query_pre_attn_scalar**-0.5)
    logits_scaling: float = 1.0             # Granite: logits divided by this
    num_experts: int = 0                    # Qwen3-MoE: experts per sparse layer (0: dense model)
    num_experts_per_tok: int = 0            # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0          # each expert's SwiGLU width
    norm_topk_prob: bool = False            # the top-k probabilities renormalized to sum 1
    mlp_only_layers: list[int] = field(default_factory=list)   # dense layers of an MoE model
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos: bool = False                   # prepend BOS when tokenizing a raw prompt
    chat_template: str = "none"
    default_system: str | None = None       # system prompt the source template injects
    torch_dtype: str = "bf16"               # dtype of model.safetensors' float tensors
    weights: str = "float"                  # linear weights: float (torch_dtype) | int8 | int4
    weight_group: int = 0                   # int4: columns per (scale, min) group (qlinear.py)
    source: dict = field(default_factory=dict)   # conversion record (path, sha256, format)

    def __post_init__(self):
        self._check_numbers()
        if self.architecture not in ARCHITECTURES:
            raise KvrunError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        if self.chat_template not in CHAT_TEMPLATES:
            raise KvrunError(f"unknown chat template {self.chat_template!r}")
        if self.rope_scaling and rope_kind(self.rope_scaling) not in ROPE_TYPES:
            raise KvrunError(f"unsupported rope scaling type {rope_kind(self.rope_scaling)!r} "
                             f"({', '.join(ROPE_TYPES)})")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2 or (self.head_dim - self.rotary_dim) % 2:
            raise KvrunError(f"config: rotary_dim {self.rotary_dim} must be even, at most the head "
                             f"dim {self.head_dim} and leave an even number of channels")
        if rope_kind(self.rope_scaling) == "longrope":
            self._check_longrope()
        if self.num_heads % self.num_kv_heads:
            raise KvrunError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.architecture == "qwen2":
            self.attention_bias = True
        if not self.layer_types:
            every = GLOBAL_EVERY.get(self.architecture)
            self.layer_types = (
                ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(self.num_layers)] if every
                else ["full_attention"] * self.num_layers)
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise KvrunError(f"layer_types must list {self.num_layers} entries of "
                             f"{', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise KvrunError("sliding_attention layers need sliding_window >= 1")
        if self.rope_local_theta == 0.0:
            self.rope_local_theta = self.rope_theta
        if self.query_pre_attn_scalar == 0.0:
            self.query_pre_attn_scalar = float(self.head_dim)
        self.qk_norm = QK_NORMS.get(self.architecture, "")
        if not isinstance(self.nope_layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.nope_layers):
            raise KvrunError(f"config: nope_layers must be a list of layer indices (got {self.nope_layers!r:.60})")
        self.nope_layers = sorted(set(self.nope_layers))
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise KvrunError(f"nope_layers must be layer indices below {self.num_layers}")
        if self.nope_layers and "sliding_attention" in self.layer_types:
            # both would take the model's second RoPE table set (llama.py rope_local)
            raise KvrunError("a config cannot have both nope_layers and sliding_attention layers")
        self._check_experts()
        if self.logits_scaling == 0.0:
            raise KvrunError("config: logits_scaling must be a finite number > 0 (got 0)")
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        if self.weights not in ("float", "int8", "int4"):
            raise KvrunError(f"unknown weight format {self.weights!r} (float, int8, int4)")
        if self.weights == "int4" and self.weight_group == 0:
            self.weight_group = 32

    def _check_experts(self) -> None:
        """An MoE config has experts, a top-k among them and their width; others none."""
        if (self.architecture == "qwen3moe") != (self.num_experts > 0):
            raise KvrunError("config: num_experts must be >= 1 for qwen3moe and 0 otherwise "
                             f"(got {self.num_experts} for {self.architecture})")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise KvrunError(f"config: num_experts_per_tok must be 1..{self.num_experts} and "
                             "moe_intermediate_size >= 1")
        if not isinstance(self.mlp_only_layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers
                for i in self.mlp_only_layers):
            raise KvrunError(f"config: mlp_only_layers must list layer indices below {self.num_layers}")
        self.mlp_only_layers = sorted(set(self.mlp_only_layers))

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the sparse expert block (runtime/model/moe.py)."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    def _check_numbers(self) -> None:
        """Sizes are positive integers and float settings finite numbers, whoever wrote the
        config.json (a hand edit, a foreign converter): else a KvrunError here, not a
        ZeroDivisionError or a torch error while the model is built."""
        import math
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise KvrunError(f"config: {name} must be an integer >= 1 (got {x!r})")
        for name in ("head_dim", "sliding_window", "weight_group", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "rotary_dim"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise KvrunError(f"config: {name} must be an integer >= 0 (got {x!r})")
        for name in ("rms_norm_eps", "rope_theta", "rope_local_theta", "query_pre_attn_scalar",
                     "embedding_multiplier", "attention_multiplier", "logits_scaling"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise KvrunError(f"config: {name} must be a finite number >= 0 (got {x!r})")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):     # None: off
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))
                                  or not math.isfinite(x) or x <= 0):
                raise KvrunError(f"config: {name} must be null or a finite number > 0 (got {x!r})")

    def _check_longrope(self) -> None:
        r, n = self.rope_scaling, self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            f = r.get(key)
            if not isinstance(f, list) or len(f) != n or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f):
                raise KvrunError(f"config: longrope {key} must be a list of {n} positive numbers "
                                 f"(one per rotated frequency)")
        for key, kind in (("original_max_position_embeddings", int), ("attention_factor", (int, float))):
            x = r.get(key)
            if isinstance(x, bool) or not isinstance(x, kind) or x <= 0:
                raise KvrunError(f"config: longrope {key} must be a number > 0 (got {x!r})")

    def rope_args(self) -> dict:
        """The full-attention layers' RoPE as kernels/rope.py's `inv_frequencies` and `Rope`
        take it: the model's tables and a cache's context shift are made from the same."""
        return dict(head_dim=self.head_dim, theta=self.rope_theta, scaling=self.rope_scaling,
                    rotary_dim=self.rotary_dim)

    @property
    def layer_windows(self) -> list[int]:
        """Per layer the attention window in tokens: sliding_window for sliding layers, 0
        (everything cached) for full ones. Caches size and mask their layers by this."""
        return [self.sliding_window if t == "sliding_attention" else 0 for t in self.layer_types]

    @property
    def q_scale(self) -> float:
        """What q is multiplied by before the caches' D**-0.5 scaling: 1.0 unless the family
        scales scores otherwise (Gemma's query_pre_attn_scalar**-0.5, Granite's
        attention_multiplier)."""
        import math
        if self.attention_multiplier:
            return self.attention_multiplier * math.sqrt(self.head_dim)
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise KvrunError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KvrunError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != "kvrun":
            raise KvrunError(f"{path}: not a kvrun config (run `kvrun convert` first)")
        try:
            return cls.from_dict(d)
        except TypeError as e:
            raise KvrunError(f"{path}: bad config ({e})") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if "sliding_attention" not in self.layer_types:
            del d["layer_types"]     # all full: derived again from num_layers, as before
        if not self.num_experts:     # a dense model's config.json as before the MoE fields
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "mlp_only_layers"):
                del d[k]
        return {"format": "kvrun", "format_version": 1, **d}
