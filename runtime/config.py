"""Model configuration: kvrun's own config.json schema.

`ModelConfig` is what `kvrun convert` writes and what the model is built from. Derived
fields are computed in `__post_init__`; `from_dict` keeps known keys only, so a config
written by a newer kvrun still loads.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KvrunError

ARCHITECTURES = ("llama", "qwen2")
CHAT_TEMPLATES = ("chatml", "llama3", "mistral", "none")


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
        if self.architecture not in ARCHITECTURES:
            raise KvrunError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        if self.chat_template not in CHAT_TEMPLATES:
            raise KvrunError(f"unknown chat template {self.chat_template!r}")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise KvrunError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.architecture == "qwen2":
            self.attention_bias = True
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        if self.weights not in ("float", "int8", "int4"):
            raise KvrunError(f"unknown weight format {self.weights!r} (float, int8, int4)")
        if self.weights == "int4" and self.weight_group == 0:
            self.weight_group = 32

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        return {"format": "kvrun", "format_version": 1, **dataclasses.asdict(self)}

    @classmethod
    def tiny(cls, architecture: str = "llama", **kw) -> "ModelConfig":
        """A small random-weight configuration for tests (GQA 4:2, two layers)."""
        base = dict(architecture=architecture, vocab_size=256, hidden_size=64,
                    intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    max_position=512, rope_theta=10000.0, bos_token_id=1,
                    eos_token_ids=[2], torch_dtype="fp32")
        base.update(kw)
        return cls(**base)
