"""Per-layer KV precision profiles (DESIGN §6, TaDA's layer-wise precision search).

A profile is JSON:

    {"format": "kvrun-kv-profile", "version": 1,
     "layers": [{"k": "tada-4", "v": "tada-2"}, ...],      # one entry per layer, in order
     ...free metadata (model, budget, score)...}

`--kv-profile FILE` loads it into KVConfig.layers; the layer count is checked against the
model when the cache is built.
"""
from __future__ import annotations

import json
from pathlib import Path

from ...kernels.codecs import METHODS
from ..errors import KvrunError

FORMAT = "kvrun-kv-profile"


def load_profile(path) -> list[tuple[str, str]]:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise KvrunError(f"{path}: no such KV profile") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvrunError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise KvrunError(f"{path}: not a kvrun KV profile (format must be {FORMAT!r})")
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        raise KvrunError(f"{path}: 'layers' must be a non-empty list")
    out = []
    for i, e in enumerate(layers):
        if not isinstance(e, dict) or "k" not in e or "v" not in e:
            raise KvrunError(f"{path}: layer {i} must be an object with 'k' and 'v'")
        for key in ("k", "v"):
            if e[key] not in METHODS:
                raise KvrunError(f"{path}: layer {i} {key}: unknown KV method {e[key]!r} "
                                 f"(valid: {', '.join(METHODS)})")
        out.append((e["k"], e["v"]))
    return out


def save_profile(path, layers, **meta) -> None:
    """Write a profile atomically; `meta` (model, budget, score …) is stored alongside."""
    for i, (k, v) in enumerate(layers):
        if k not in METHODS or v not in METHODS:
            raise KvrunError(f"layer {i}: unknown KV method in ({k!r}, {v!r})")
    d = {"format": FORMAT, "version": 1, **meta,
         "layers": [{"k": k, "v": v} for k, v in layers]}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    tmp.replace(path)
