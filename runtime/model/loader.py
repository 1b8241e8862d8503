"""Load a kvrun model directory (config.json + model.safetensors + tokenizer.json)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import ModelConfig
from ..errors import KvrunError
from .llama import Transformer
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
    """`path` if it is a kvrun model directory whose three files this process can open;
    otherwise a KvrunError that says what it is instead (a GGUF, an HF checkpoint, …)."""
    path = Path(path).expanduser()
    try:
        return _check_model_dir(path)
    except PermissionError as e:                # a directory without r/x permission
        raise KvrunError(f"{e.filename or path}: permission denied") from None


def _check_model_dir(path: Path) -> Path:
    if not path.exists():
        raise KvrunError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".gguf":
            raise KvrunError(f"{path} is a GGUF file: convert it first with "
                             f"`kvrun convert {path} -o DIR`")
        raise KvrunError(f"{path}: expected a kvrun model directory")
    if not path.is_dir():
        raise KvrunError(f"{path}: expected a kvrun model directory")
    os.listdir(path)                            # PermissionError now, not a wrong "missing"
    if not (path / "config.json").exists():
        raise KvrunError(f"{path}: no config.json (not a model directory)")
    for name in ("model.safetensors", "tokenizer.json"):
        if not (path / name).exists():
            if name == "model.safetensors" and any(path.glob("*.safetensors")):
                raise KvrunError(f"{path} looks like an HF checkpoint: convert it first with "
                                 f"`kvrun convert {path} -o DIR`")
            raise KvrunError(f"{path}: missing {name}")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        f = path / name
        if not f.is_file():
            raise KvrunError(f"{f}: not a regular file")
        with open(f, "rb"):                     # unreadable: PermissionError, said above
            pass
    return path


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_file(path / "config.json")


def weights_error(f: Path, e: Exception) -> KvrunError:
    """The one-line error for a model.safetensors that cannot be read: an OS error as
    such (permissions, I/O), anything else (safetensors' header checks) as damage."""
    if isinstance(e, OSError) and e.errno is not None:
        return KvrunError(f"{f}: cannot read weights ({e.strerror})")
    return KvrunError(f"{f}: cannot read weights ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                      f"the file is truncated or corrupt")


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    f = path / "model.safetensors"
    try:
        with open(f, "rb"):                     # an OS error first, with its own words
            pass
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise weights_error(f, e) from None


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
