"""HF checkpoint folder → kvrun model dir.

An HF folder is already close to kvrun's format: module names are kept as they are (the
runtime uses HF's), so conversion is reading the config into `ModelConfig`, casting the
weights, dropping what kvrun does not load (rotary `inv_freq` buffers, a tied `lm_head`),
and copying tokenizer.json. Chat template, BOS/EOS and the BOS policy come from
tokenizer_config.json / chat_template.jinja / generation_config.json when present.

What differs per family (its architecture, its config quirks, tensor fix-ups such as
Phi-3's fused projections) is in hf_families.py; this module is what they share.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from kvrun.kernels.rope import longrope_attention
from kvrun.model.config import ModelConfig
from kvrun.errors import KvrunError
from kvrun.files import file_sha256

from .hf_families import FAMILIES, MODEL_TYPES, Family
from .quantize import check_weight_format, describe, is_quantized, quantize, target_format
from .templates import chat_stop_tokens, detect_chat_template
from .writer import (Progress, check_destination, expected_tensors, torch_dtype,
                     validate_tensors, write_model_dir)

def _read_json(path: Path, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise KvrunError(f"{path}: no such file")
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvrunError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise KvrunError(f"{path}: expected a JSON object")
    return d


def _family(hf: dict) -> Family:
    if isinstance(hf.get("architectures"), str):        # a hand-written config: one name
        hf = {**hf, "architectures": [hf["architectures"]]}
    for a in hf.get("architectures") or []:
        if a in FAMILIES:
            return FAMILIES[a]
    if not hf.get("architectures") and hf.get("model_type") in MODEL_TYPES:
        return FAMILIES[MODEL_TYPES[hf["model_type"]]]
    name = (hf.get("architectures") or [hf.get("model_type")])[0]
    raise KvrunError(f"unsupported architecture {name!r} "
                     f"(supported: {', '.join(sorted(FAMILIES))})")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, kvrun rope_scaling) from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:                      # Gemma 3: per layer kind
        params = params["full_attention"] or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return theta, {"type": "llama3", "factor": float(scaling["factor"]),
                       "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                       "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
                       "original_max_position_embeddings":
                           int(scaling.get("original_max_position_embeddings", 8192))}
    if kind in ("longrope", "su"):                      # su: longrope's earlier name (Phi-3)
        return theta, _longrope(hf, scaling)
    raise KvrunError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, longrope)")


def _longrope(hf: dict, scaling: dict) -> dict:
    """kvrun's longrope settings, as transformers' `_compute_longrope_parameters` derives
    them: the original context from the scaling or the config, the attention factor given
    or sqrt(1 + ln(s) / ln(original)) for s = `factor`, else max_position_embeddings /
    original (1 when s <= 1)."""
    orig = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not orig:
        raise KvrunError("longrope scaling without original_max_position_embeddings")
    orig = int(orig)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else int(hf.get("max_position_embeddings", orig)) / orig
    att = scaling.get("attention_factor")
    att = float(att) if att is not None else longrope_attention(factor, orig)
    return {"type": "longrope", "short_factor": [float(x) for x in scaling["short_factor"]],
            "long_factor": [float(x) for x in scaling["long_factor"]],
            "original_max_position_embeddings": orig, "attention_factor": att}


def _token_id(tok, token: str | dict | None) -> int | None:
    if isinstance(token, dict):             # {"content": "<s>", ...}
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def _shards(src: Path) -> list[Path]:
    index = _read_json(src / "model.safetensors.index.json", required=False)
    if index is not None:
        files = sorted(set((index.get("weight_map") or {}).values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            raise KvrunError(f"{src}: shard {missing[0]} listed in the index is missing")
        return [src / f for f in files]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise KvrunError(f"{src}: no *.safetensors weights (pytorch .bin checkpoints are "
                         "not supported)")
    return files


def _load_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    out = {}
    for p in files:
        try:
            with safe_open(str(p), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise KvrunError(f"{p}: corrupt or truncated safetensors file ({msg})") from None
    return out


def config_from_hf(src: Path, hf: dict, tok, dtype: str) -> ModelConfig:
    """ModelConfig from an HF config.json plus the folder's tokenizer metadata."""
    fam = _family(hf)
    fields = fam.fields(hf)                   # the family's quirks; raises on refused ones
    theta, scaling = _rope(hf)
    tk_cfg = _read_json(src / "tokenizer_config.json", required=False) or {}
    template = tk_cfg.get("chat_template")
    if (src / "chat_template.jinja").is_file():         # newer HF folders keep it separately
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    family, default_system = detect_chat_template(template)
    gen = _read_json(src / "generation_config.json", required=False) or {}

    bos = hf.get("bos_token_id")
    if bos is None:
        bos = _token_id(tok, tk_cfg.get("bos_token"))
    eos = _ids(gen.get("eos_token_id")) + _ids(hf.get("eos_token_id"))
    eos += [_token_id(tok, t) for t in (tk_cfg.get("eos_token"), *chat_stop_tokens(family))]
    add_bos = tk_cfg.get("add_bos_token")
    if add_bos is None:      # no flag: does the tokenizer's post-processor prepend BOS itself?
        ids = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and len(ids) > 0 and ids[0] == bos
    n_heads = int(hf["num_attention_heads"])
    fields.setdefault("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)))
    return ModelConfig(
        architecture=fam.arch, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=n_heads, num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or 0),
        max_position=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
        add_bos=bool(add_bos), chat_template=family, default_system=default_system,
        torch_dtype=dtype, **fields)


def convert_hf(src_dir: str | Path, out_dir: str | Path, dtype: str = "bf16",
               progress: Progress | None = None, overwrite: bool = False,
               weights: str = "float", group: int = 32,
               log: Callable[[str], None] | None = None) -> ModelConfig:
    """Convert an HF checkpoint folder of a family in hf_families.FAMILIES into a kvrun
    model dir.

    `dtype` is the float tensors' dtype; `weights` float | int8 | int4 (with `group`
    columns per int4 scale) how linear weights are stored (convert/quantize.py). Returns
    the written config. `progress(done, total, name)` is called after each tensor; `log`
    receives one line per quantized tensor with its quantization error.
    """
    from tokenizers import Tokenizer
    src = Path(src_dir).expanduser().absolute()
    if not src.is_dir():
        raise KvrunError(f"{src}: no such directory")
    target = torch_dtype(dtype)
    check_weight_format(weights, group)
    check_destination(out_dir, overwrite)
    hf = _read_json(src / "config.json")
    if not (src / "tokenizer.json").is_file():
        raise KvrunError(f"{src}: tokenizer.json is missing (kvrun needs the fast-tokenizer file)")
    tokenizer_json = (src / "tokenizer.json").read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise KvrunError(f"{src / 'tokenizer.json'}: not a valid tokenizer ({e})") from None
    try:
        cfg = config_from_hf(src, hf, tok, dtype)
    except KeyError as e:
        raise KvrunError(f"{src / 'config.json'}: missing field {e}") from None
    except (TypeError, ValueError) as e:        # "vocab_size": "abc", a list for a number
        raise KvrunError(f"{src / 'config.json'}: bad value ({e})") from None

    files = _shards(src)
    raw = _load_tensors(files)
    tensors_fixup = _family(hf).tensors
    if tensors_fixup is not None:                # Phi-3's fused projections, Granite's multiplier
        tensors_fixup(hf, raw)
    drop = [k for k in raw if k.endswith("rotary_emb.inv_freq")]
    if cfg.tie_word_embeddings:
        drop.append("lm_head.weight")
    names = [k for k in raw if k not in drop]
    validate_tensors(cfg, {k: raw[k] for k in names})     # before the (slow) cast
    cfg.weights, cfg.weight_group = weights, (group if weights == "int4" else 0)
    expected_tensors(cfg)                  # int4 needs rows that split into groups: fail now
    tensors = {}
    for i, k in enumerate(names):
        w = raw.pop(k)                              # pop: free the source copy as we go
        if weights != "float" and is_quantized(k):
            parts = quantize(k, w, weights, group)
            if log:
                fmt = target_format(k, weights)
                log(describe(k, f"{fmt} <- {str(w.dtype).replace('torch.', '')}", w, parts))
            tensors.update(parts)
        else:
            tensors[k] = w.to(target)
        if progress:
            progress(i + 1, len(names), k)
    cfg.source = {"format": "hf", "path": str(src), "sha256": file_sha256(*files),
                  "sha256_of": "concatenated safetensors files in sorted order"}
    write_model_dir(out_dir, cfg, tensors, tokenizer_json, overwrite=overwrite)
    return cfg
