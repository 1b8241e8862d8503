"""Load a kvrun model directory (config.json + model.safetensors + tokenizer.json)."""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .errors import KvrunError
from .model import Transformer
from .tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    """Compute dtype and the decode (GEMV) weight dtype for a `--dtype` value.

    `auto` = fp32 weights for prefill (fastest GEMM on CPUs without bf16 units) plus an
    fp16 copy for single-token decode (half the weight bytes per step). On CUDA the
    compute dtype is bf16 throughout.
    """
    if name == "auto":
        return torch.float32, torch.float16
    if name not in DTYPES:
        raise KvrunError(f"unknown dtype {name!r} (auto, fp32, fp16, bf16)")
    return DTYPES[name], None


def check_model_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise KvrunError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".gguf":
            raise KvrunError(f"{path} is a GGUF file: convert it first with "
                             f"`kvrun convert {path} -o DIR`")
        raise KvrunError(f"{path}: expected a kvrun model directory")
    if not (path / "config.json").exists():
        raise KvrunError(f"{path}: no config.json (not a model directory)")
    for name in ("model.safetensors", "tokenizer.json"):
        if not (path / name).exists():
            if name == "model.safetensors" and any(path.glob("*.safetensors")):
                raise KvrunError(f"{path} looks like an HF checkpoint: convert it first with "
                                 f"`kvrun convert {path} -o DIR`")
            raise KvrunError(f"{path}: missing {name}")
    return path


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_file(path / "config.json")


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    f = path / "model.safetensors"
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise KvrunError(f"{f}: cannot read weights ({str(e).splitlines()[0]}); "
                         f"the file is truncated or corrupt") from None


def load_transformer(path: Path, cfg: ModelConfig, dtype: torch.dtype,
                     gemv_dtype: torch.dtype | None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu").to(dtype)    # int8/uint8 quantized codes stay integer
    model.tie_weights()
    state = load_state(path)
    try:
        model.load_weights(state)
    except RuntimeError as e:   # shape mismatch inside load_state_dict
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln),
                     str(e).splitlines()[0])
        raise KvrunError(f"weights do not match the config: {first}") from None
    model.eval()
    # dense: the fp16 decode copy (--dtype auto); quantized: the fused ops' packed weights
    model.set_gemv_dtype(gemv_dtype)
    return model


def load_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer:
    return Tokenizer(path / "tokenizer.json", cfg.bos_token_id, cfg.add_bos)
