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
from kvrun.kernels.rope import ROPE_TYPES

# granite and smollm3 run the Llama layer with their config quirks; olmo2 its own (olmo2.py)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "olmo2", "smollm3")
QK_NORMS = {"qwen3": "head", "gemma3": "head", "olmo2": "proj"}
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
    rope_scaling: dict | None = None        # {"type": "linear"|"llama3", "factor": ..., ...}
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
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise KvrunError(f"unsupported rope scaling type {kind!r} ({', '.join(ROPE_TYPES)})")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
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
        if self.logits_scaling == 0.0:
            raise KvrunError("config: logits_scaling must be a finite number > 0 (got 0)")
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        if self.weights not in ("float", "int8", "int4"):
            raise KvrunError(f"unknown weight format {self.weights!r} (float, int8, int4)")
        if self.weights == "int4" and self.weight_group == 0:
            self.weight_group = 32

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
        for name in ("head_dim", "sliding_window", "weight_group"):
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
        return {"format": "kvrun", "format_version": 1, **d}
