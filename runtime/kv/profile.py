"""Per-layer KV precision profiles (written by `kvrun search`; TaDA §3.3 / Appendix B).

A profile is JSON written by `kvrun search` (or by hand):

    {"format": "kvrun-kv-profile", "version": 1,
     "model": {"name": "SmolLM2-135M-Instruct.Q4_1", "sha256": "b179…",   # source weights
               "architecture": "llama", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
     "ctx": 2048, "budget": 0.30, "bytes": 11010048, "bytes_ratio": 0.2987, "kld": 0.021,
     "calibration": {"sha256": "…", "tokens": 1152, "windows": 2, …},
     "kv": {"residual": 128, "group": 32, "v_group": 32, "tada_mu": "fp16", …},
     "layers": [{"k": "kivi-4", "v": "kivi-2"}, ...]}     # one entry per layer, in order

Only "format" and "layers" are required (hand-written profiles stay short). "kv" holds the
KVConfig settings the bytes were computed with (window, groups, TaDA's μ storage, any
rotation flag the KVConfig has, and "ring": the width of a model's sliding-window rings,
absent or null in older profiles, which leaves it to ring.ring_bits); loading a profile
applies them unless the caller sets them explicitly. A layer entry may carry "rotate" (that
layer's rotation) and "k_map" (a key transform, key_map.py, applied where K is rotated). "model" is checked against the model the cache is built for: the
geometry always, the source hash for `--kv auto` (a shipped profile describes one model's
sensitivities). `--kv auto` on a model no profile was shipped for is the generic default
(`generic_settings`): uniform rotated kivi-4, which every backend and head dim serves;
`kvrun search` tunes a profile for it.
"""
from __future__ import annotations

import functools
import hashlib
import math
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvrun.kernels.codecs import KEY_ONLY, METHODS
from ..errors import KvrunError
from ..files import atomic_output, read_regular
from .key_map import check_key_map

FORMAT = "kvrun-kv-profile"
VERSION = 1
SHIPPED_DEFAULT = "smollm2-135m-0.30.json"      # `--kv auto` for the embedded model
# `--kv auto` where no profile was searched on the model: uniform kivi-4, K and V
# Hadamard-rotated (rotation halves kivi-4's KLD on SmolLM2, docs/measurements.md)
GENERIC_METHOD = "kivi-4"
# KVConfig fields that describe a cache, not a run: these travel with a profile
NOT_KV_SETTINGS = ("k_method", "v_method", "layers", "layer_rotate", "layer_key_map", "ctx_policy",
                   "n_keep", "block", "profile_info")


@dataclass
class Profile:
    layers: list[tuple[str, str]]                   # (k_method, v_method) per layer
    model: dict = field(default_factory=dict)       # see model_record()
    kv: dict = field(default_factory=dict)          # KVConfig settings (residual, group …)
    meta: dict = field(default_factory=dict)        # ctx, budget, bytes_ratio, kld, calibration …
    path: str | None = None
    rotate: list[str] | None = None                 # per-layer rotation ("rotate" in entries)
    key_maps: list | None = None                    # per-layer key transform ("k_map", key_map.py)

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else "profile"

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, **self.meta,
                "kv": self.kv, "layers": [{"k": k, "v": v, **({"rotate": self.rotate[i]} if self.rotate else {}),
                                           **({"k_map": self.key_maps[i]} if self.key_maps and self.key_maps[i] else {})}
                                          for i, (k, v) in enumerate(self.layers)]}


def model_record(cfg) -> dict:
    """What a profile records about the model it was searched on. num_layers counts the
    layers a profile lists: the full-attention ones (sliding-window layers keep a ring)."""
    from .layout import arena_layers
    src = cfg.source or {}
    name = src.get("name") or (Path(src["path"]).stem if src.get("path") else "")
    return {"name": name, "sha256": src.get("sha256", ""), "architecture": cfg.architecture,
            "num_layers": arena_layers(cfg), "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}


def kv_settings(kv) -> dict:
    """The cache-shaping settings of a KVConfig (everything but methods and run policy)."""
    return {name: x for name, x in kv.settings().items() if name not in NOT_KV_SETTINGS}


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_method(m: str) -> str:
    if m not in METHODS:
        raise KvrunError(f"unknown KV method {m!r} (valid: {', '.join(METHODS)})")
    return m


def _check_method(where: str, m, role: str = "k") -> str:
    if not isinstance(m, str):
        raise KvrunError(f"{where}: KV method must be a string, got {m!r}")
    if role == "v" and m in KEY_ONLY:
        raise KvrunError(f"{where}: {m} stores keys only")
    try:
        return check_method(m)
    except KvrunError as e:
        raise KvrunError(f"{where}: {e}") from None


def parse_profile(d, where: str = "profile") -> Profile:
    """Validate a decoded profile; every problem is a one-line KvrunError naming `where`."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise KvrunError(f"{where}: not a kvrun KV profile (format must be {FORMAT!r})")
    if d.get("version", VERSION) != VERSION:
        raise KvrunError(f"{where}: profile version {d.get('version')!r} is not supported "
                         f"(this kvrun reads version {VERSION})")
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        raise KvrunError(f"{where}: 'layers' must be a non-empty list")
    out = []
    for i, e in enumerate(layers):
        if not isinstance(e, dict) or "k" not in e or "v" not in e:
            raise KvrunError(f"{where}: layer {i} must be an object with 'k' and 'v'")
        out.append((_check_method(f"{where}: layer {i} k", e["k"]),
                    _check_method(f"{where}: layer {i} v", e["v"], "v")))
    rots = [e.get("rotate") for e in layers]
    if any(r is not None for r in rots):
        if any(r not in ("none", "k", "v", "kv") for r in rots):
            i = next(i for i, r in enumerate(rots) if r not in ("none", "k", "v", "kv"))
            raise KvrunError(f"{where}: layer {i} rotate must be one of none, k, v, kv "
                             f"(got {rots[i]!r}; give it on every layer or on none)")
    else:
        rots = None
    maps = [check_key_map(f"{where}: layer {i} k_map", e["k_map"]) if e.get("k_map") is not None else None
            for i, e in enumerate(layers)]
    model = d.get("model", {})
    if isinstance(model, str):                      # a bare name (hand-written profiles)
        model = {"name": model}
    if not isinstance(model, dict):
        raise KvrunError(f"{where}: 'model' must be an object")
    if "num_layers" in model and model["num_layers"] != len(out):
        raise KvrunError(f"{where}: 'model' says {model['num_layers']} layers but 'layers' "
                         f"has {len(out)} entries")
    kv = d.get("kv", {})
    if not isinstance(kv, dict):
        raise KvrunError(f"{where}: 'kv' must be an object")
    meta = {k: x for k, x in d.items() if k not in ("format", "version", "layers", "model", "kv")}
    return Profile(out, model, kv, meta, rotate=rots, key_maps=maps if any(maps) else None)


def resolve_profile(spec) -> Path:
    """A profile file path, or the name of a shipped profile (`smollm2-135m-0.25`, with or
    without `.json`), so `--kv profile:NAME` works from any directory. An existing file
    wins over a shipped name; anything else is a one-line error listing the shipped names."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    name = str(spec).strip()
    for p in shipped_profiles():
        if name in (p.name, p.stem):
            return p
    names = ", ".join(p.stem for p in shipped_profiles()) or "none in this installation"
    raise KvrunError(f"KV profile {str(spec)!r}: no such file, and no shipped profile of that "
                     f"name (shipped: {names})")


MAX_PROFILE_BYTES = 1 << 20     # a profile is a list of per-layer methods: a few KiB


def read_profile(path) -> Profile:
    """A profile file: a regular file of at most MAX_PROFILE_BYTES (a FIFO would block the
    open for ever, /dev/zero fill memory), JSON in the kvrun-kv-profile format."""
    path = resolve_profile(path)
    raw = read_regular(path, MAX_PROFILE_BYTES, "KV profile")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvrunError(f"{path}: not valid JSON ({e})") from None
    p = parse_profile(d, str(path))
    p.path = str(path)
    return p


def load_profile(path) -> list[tuple[str, str]]:
    """The per-layer (k_method, v_method) list of a profile file."""
    return read_profile(path).layers


def save_profile(path, layers, model: dict | str | None = None, kv: dict | None = None,
                 rotate: list[str] | None = None, key_maps: list | None = None, **meta) -> None:
    """Write a profile atomically; `meta` (ctx, budget, kld …) is stored alongside.
    The result is validated exactly as it will be read back."""
    model = {"name": model} if isinstance(model, str) else (model or {})
    p = Profile([tuple(x) for x in layers], model, kv or {}, meta, rotate=rotate, key_maps=key_maps)
    parse_profile(json.loads(json.dumps(p.to_json())), str(path))
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(p.to_json(), indent=1) + "\n")


def check_profile_model(profile: dict, cfg, auto: bool = False, where: str = "KV profile") -> None:
    """Refuse a profile searched for another model. `profile` is Profile.model.
    Geometry must match; with auto=True (is a shipped profile this model's?) the source
    hash must too."""
    rec = model_record(cfg)
    name = profile.get("name") or "another model"
    for key, what in (("num_layers", "layers"), ("num_kv_heads", "KV heads"), ("head_dim", "head dim")):
        if key in profile and profile[key] != rec[key]:
            raise KvrunError(f"{where} was searched for {name} ({profile[key]} {what}); "
                             f"this model has {_model_has(cfg, rec, key, what)}")
    if auto and profile.get("sha256") and profile["sha256"] != rec["sha256"]:
        raise KvrunError(f"{where} was searched for {name} (sha256 {profile['sha256'][:12]}…), "
                         f"not for this model ({rec['name'] or 'unnamed'}, "
                         f"sha256 {rec['sha256'][:12] or 'unknown'}…)")


def _model_has(cfg, rec: dict, key: str, what: str) -> str:
    """The model's side of a mismatch. A profile's layer count is of the layers it lists,
    the full-attention ones (model_record): a model with sliding-window layers says both."""
    if key == "num_layers" and rec[key] != cfg.num_layers:
        return (f"{cfg.num_layers} layers, {rec[key]} of them full-attention (the layers a "
                f"profile lists; the sliding-window ones keep a ring)")
    return f"{rec[key]} {what}"


def shipped_profiles() -> list[Path]:
    """Profiles that ship inside the package (runtime/kv/profiles/*.json)."""
    from importlib.resources import files
    d = files("kvrun.kv") / "profiles"
    if not d.is_dir():
        return []
    return sorted(Path(str(p)) for p in d.iterdir() if p.name.endswith(".json"))


@functools.lru_cache(maxsize=1)
def _shipped_models() -> tuple:
    """(path, model record, budget) of every readable shipped profile, read once: the
    package's files do not change while it runs, and check_kv asks on every cache."""
    out = []
    for p in shipped_profiles():
        try:
            prof = read_profile(p)
        except KvrunError:
            continue
        out.append((p, prof.model, prof.meta.get("budget", 0.0)))
    return tuple(out)


def shipped_for(cfg) -> Path | None:
    """The shipped profile `--kv auto` means on this model, or None: SHIPPED_DEFAULT when it
    was searched on this model, else the largest-budget one searched on it."""
    fits = []
    for p, model, budget in _shipped_models():
        try:
            check_profile_model(model, cfg, auto=True)
        except KvrunError:
            continue
        if p.name == SHIPPED_DEFAULT:
            return p
        fits.append((budget, p))
    return max(fits)[1] if fits else None


def generic_settings(head_dim: int) -> dict:
    """The KV settings of `--kv auto` on a model without a shipped profile: GENERIC_METHOD
    for K and V, rotated where the head dim has a Hadamard rotation (even), V's channel
    groups of 32, or of the largest power of two dividing the head dim below that (80: 16),
    so KIVI's groups tile every head: 64, 96, 128, 256 and the odd sizes in between."""
    return {"k_method": GENERIC_METHOD, "v_method": GENERIC_METHOD, "group": 32,
            "v_group": math.gcd(32, head_dim), "rotate": "kv" if head_dim % 2 == 0 else "none"}


def shipped_default() -> Path:
    for p in shipped_profiles():
        if p.name == SHIPPED_DEFAULT:
            return p
    raise KvrunError(f"--kv auto: the shipped profile {SHIPPED_DEFAULT} is missing from this "
                     f"installation (reinstall kvrun)")
