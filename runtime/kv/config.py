"""KV-cache configuration in its parts: the cache's format (codecs for K and V per layer,
window, groups), what a full context does (ContextPolicy), Hadamard rotation (Rotation) and
token eviction (Eviction). Flat setting names (SETTINGS) are how a config is given — parse_kv's
keywords, the CLI's KV flags, a profile's "kv" object — and KVConfig.from_settings assembles them.

    parse_kv("tada-4")                       K and V both tada-4
    parse_kv("kivi-4/kivi-2")                K kivi-4, V kivi-2 (same as k=..., v=...)
    parse_kv("fp16", k="kivi-4", v="kivi-2") --kv-k / --kv-v override the --kv method
    parse_kv("tada-4", profile="p.json")     per-layer methods from a profile
    parse_kv("profile:p.json")               the same as a spec (for method lists: kvrun ppl)
    parse_kv("profile:smollm2-135m-0.25")    a shipped profile by name (runtime/kv/profiles/)
    parse_kv("auto")                         the profile shipped for the model in use, else
                                             the generic default (rotated kivi-4)
    parse_kv("kivi-4+ring8")                 sliding-window rings at 8 bits (ring=8)

Defaults follow the papers: residual window R = 128 and group G = 32 (KIVI, TaDA's
LongBench setting); V channel group g = 32 (KIVI's group size, used for both axes in its
reference code); GEAR rank r = 4 and s = 2 % (GEAR's recommended setting); gear-l and gear
default to a 4-bit KIVI backbone ("gear-l-2"/"gear-2" for 2-bit). G is also the flush
granularity of every codec: tokens leave the window in whole blocks of G.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kvrun.kernels.codecs import KEY_ONLY, make_codec, method_family
from ..errors import KvrunError
from .evict import ANCHORS, POLICIES
from .profile import NOT_KV_SETTINGS, check_method, generic_settings, read_profile, shipped_for

CTX_POLICIES = ("error", "shift")
DENSE = {"fp16", "bf16", "fp32"}          # uncompressed methods
ROTATE = ("none", "k", "v", "kv")
RING_BITS = (4, 8, 16)                    # widths of a sliding-window ring (ring.py)


@dataclass
class ContextPolicy:
    """What a full context does: "error", or "shift" (llama.cpp's context shift: keep the
    first `n_keep` tokens, drop half of the rest; kv/arena.py)."""
    on_full: str = "error"
    n_keep: int = 4                 # sink tokens kept by a shift

    def __post_init__(self):
        if self.on_full not in CTX_POLICIES:
            raise KvrunError(f"unknown context policy {self.on_full!r} ({', '.join(CTX_POLICIES)})")
        if self.n_keep < 0:
            raise KvrunError(f"--keep must be >= 0, got {self.n_keep}")


def _per_layer(values: list | None, n_layers: int, what: str, default) -> list:
    """A profile's per-layer list (`default` for every layer when it has none), refused when
    its length is not the model's layer count."""
    if values is None:
        return [default] * n_layers
    if len(values) != n_layers:
        raise KvrunError(f"KV profile has {len(values)} {what} entries, the model has {n_layers} layers")
    return list(values)


@dataclass
class Rotation:
    """Hadamard rotation along the head dim before quantizing: "none", "k", "v" or "kv",
    with optional random ±1 signs (`seed`) and per-layer values from a profile."""
    which: str = "none"
    seed: int | None = None
    per_layer: list | None = None
    key_maps: list | None = None    # per layer None or {"mu", "sigma"} (key_map.py), from a profile

    def __post_init__(self):
        if self.which not in ROTATE:
            raise KvrunError(f"unknown rotation {self.which!r} (none, k, v, kv)")
        if self.per_layer is not None and any(r not in ROTATE for r in self.per_layer):
            raise KvrunError(f"unknown per-layer rotation in {self.per_layer!r} (none, k, v, kv)")

    def layers(self, n_layers: int) -> list[str]:
        return _per_layer(self.per_layer, n_layers, "rotation", self.which)

    def layer_key_maps(self, n_layers: int) -> list:
        """Per layer the key transform of a profile (runtime/kv/key_map.py) or None."""
        return _per_layer(self.key_maps, n_layers, "key-map", None)

    @property
    def off(self) -> bool:
        return self.which == "none" and self.per_layer is None


PROMPT_SCORES = ("exact", "codes")


@dataclass
class Eviction:
    """Token eviction (evict.py, arena_evict.py): a policy keeps at most `budget` tokens per
    layer, the window included (the mean over layers for pyramidkv)."""
    policy: str = "none"            # none | streaming | h2o | snapkv | pyramidkv | kvcrush | kvcrush-h2o
    budget: int | None = None
    sinks: int = 4                  # streaming: first tokens always kept
    snap_window: int = 32           # snapkv/pyramidkv/kvcrush: observation queries of a prefill chunk
    crush_fraction: float = 0.25    # kvcrush: share of the budget for representatives
    crush_anchor: str = "random"    # kvcrush: random | mean | alternate
    slack: int = 0                  # tail tokens freed beyond need per compaction (whole G blocks)
    prompt_scores: str = "exact"    # snapkv/pyramidkv/kvcrush: a prompt's chunks attend and are
                                    # scored over its exact rows, held while it is prefilled, or
                                    # over the codes

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise KvrunError(f"unknown eviction policy {self.policy!r} ({', '.join(POLICIES)})")
        if self.crush_anchor not in ANCHORS:
            raise KvrunError(f"unknown KVCrush anchor {self.crush_anchor!r} ({', '.join(ANCHORS)})")
        if not 0 < self.crush_fraction < 1:
            raise KvrunError(f"--crush-fraction must be in (0, 1), got {self.crush_fraction}")
        if self.prompt_scores not in PROMPT_SCORES:
            raise KvrunError(f"--evict-scores must be one of {', '.join(PROMPT_SCORES)}, "
                             f"got {self.prompt_scores!r}")
        if self.slack < 0:
            raise KvrunError(f"--evict-slack must be >= 0, got {self.slack}")
        if self.snap_window < 1 or self.sinks < 0:
            raise KvrunError(f"--snap-window must be >= 1 and --sinks >= 0 "
                             f"(got {self.snap_window}, {self.sinks})")
        if self.policy == "none" and self.budget is not None:
            raise KvrunError("--kv-budget needs an eviction policy (--evict)")
        if self.policy != "none" and self.budget is None:
            raise KvrunError(f"--evict {self.policy} needs --kv-budget N (tokens per layer)")

    @property
    def on(self) -> bool:
        return self.policy != "none"

    def tail(self, residual: int, group: int) -> int:
        """Tail tokens per layer (mean for pyramidkv): the budget minus the R + G window
        slots, in whole blocks of G, so tail + window never exceed the budget."""
        return max(0, self.budget - residual - group) // group * group

    def check_fits(self, residual: int, group: int, context: ContextPolicy) -> None:
        """Checks against the window and the context policy."""
        if not self.on:
            return
        if context.on_full != "error":
            raise KvrunError("--evict and --ctx-policy shift are alternatives: give one")
        G = group                     # smallest budget: R + G window slots + tail blocks
        streaming = self.policy == "streaming"
        need = residual + G + G * (self.sinks // G + 1 if streaming else 1)
        tail = self.tail(residual, group)
        if tail < group or (streaming and tail <= self.sinks):
            raise KvrunError(f"--kv-budget {self.budget} is too small: the window takes "
                             f"R + G = {residual + group} tokens, the evictable tail "
                             f"needs at least one block of G = {group}"
                             + (f" beyond the {self.sinks} sinks" if streaming else "")
                             + f" (use >= {need})")


# The flat setting names KVConfig is made from and written back as (parse_kv's keywords,
# the CLI's KV flags, a profile's "kv" object): name -> (part, attribute); part None is a
# field of KVConfig itself.
SETTINGS = {
    **{n: (None, n) for n in ("k_method", "v_method", "residual", "group", "v_group", "rank",
                              "sparsity", "tada_mu", "ring", "layers", "block", "profile_info")},
    "ctx_policy": ("context", "on_full"), "n_keep": ("context", "n_keep"),
    "rotate": ("rotation", "which"), "rotate_seed": ("rotation", "seed"),
    "layer_rotate": ("rotation", "per_layer"), "layer_key_map": ("rotation", "key_maps"),
    "evict": ("eviction", "policy"), "budget": ("eviction", "budget"),
    "sinks": ("eviction", "sinks"), "snap_window": ("eviction", "snap_window"),
    "crush_fraction": ("eviction", "crush_fraction"), "crush_anchor": ("eviction", "crush_anchor"),
    "evict_slack": ("eviction", "slack"), "evict_scores": ("eviction", "prompt_scores"),
}
_PARTS = {"context": ContextPolicy, "rotation": Rotation, "eviction": Eviction}


@dataclass
class KVConfig:
    """A KV cache's configuration in its parts: the format (methods per layer, window R,
    groups and the codecs' own settings, below), what a full context does (`context`),
    rotation (`rotation`), token eviction (`eviction`), and where per-layer methods came
    from (`profile_info`). Made from flat setting names by `from_settings` / parse_kv."""
    k_method: str = "fp16"
    v_method: str = "fp16"
    residual: int = 128             # R: newest tokens kept in full precision
    group: int = 32                 # G: KIVI's token group for K, and the flush block
    v_group: int = 32               # g: channels per (scale, zero) group of per-token V (KIVI)
    rank: int = 4                   # r: GEAR low-rank rank per head per block
    sparsity: float = 2.0           # s: GEAR outlier percent (top s/2 % + bottom s/2 %)
    tada_mu: str = "fp16"           # storage of TaDA's per-token mean: fp16 | int8
    ring: int | None = None         # sliding-window rings' bits (4/8/16); None: ring.ring_bits picks
    layers: list | None = None      # per-layer [(k_method, v_method), ...] from a profile
    block: int = 4096               # read-path block size in tokens (rounded to G)
    context: ContextPolicy = field(default_factory=ContextPolicy)
    rotation: Rotation = field(default_factory=Rotation)
    eviction: Eviction = field(default_factory=Eviction)
    # where `layers` came from: {"path", "model", "auto"} (model identity checks, messages);
    # {"auto", "generic"}: --kv auto on a model without a shipped profile (for_model)
    profile_info: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_settings(cls, **settings) -> "KVConfig":
        """A KVConfig from flat setting names (SETTINGS: residual=…, evict=…, rotate=…)."""
        own, parts = {}, {p: {} for p in _PARTS}
        for name, x in settings.items():
            if name not in SETTINGS:
                raise KvrunError(f"unknown KV setting {name!r}")
            part, attr = SETTINGS[name]
            (own if part is None else parts[part])[attr] = x
        return cls(**own, **{p: _PARTS[p](**kw) for p, kw in parts.items()})

    def settings(self) -> dict:
        """The flat setting names and values this config is made of (from_settings' inverse)."""
        return {name: getattr(self if part is None else getattr(self, part), attr)
                for name, (part, attr) in SETTINGS.items()}

    def __post_init__(self):
        check_method(self.k_method)
        check_method(self.v_method)
        if self.layers is not None:
            self.layers = [(check_method(k), check_method(v)) for k, v in self.layers]
        for v in [self.v_method] + [v for _, v in self.layers or []]:
            if v in KEY_ONLY:
                raise KvrunError(f"{v} stores keys only (per-channel codes); give the values a "
                                 f"method of their own, e.g. {v}/kivi-2 or {v}/cb-3")
        for name in ("residual", "group", "v_group", "rank", "block"):
            x, lo = getattr(self, name), 0 if name == "residual" else 1
            if not isinstance(x, int) or x < lo:
                raise KvrunError(f"KV {name} must be an integer >= {lo}, got {x!r}")
        if self.ring is not None and (type(self.ring) is not int or self.ring not in RING_BITS):
            raise KvrunError(f"KV ring width must be one of {', '.join(map(str, RING_BITS))} bits, "
                             f"got {self.ring!r}")
        if self.tada_mu not in ("fp16", "int8"):
            raise KvrunError(f"tada_mu must be fp16 or int8, got {self.tada_mu!r}")
        fams = {method_family(m)[0] for m in self.methods()}
        if not 0 < self.sparsity < 50:
            raise KvrunError(f"GEAR sparsity must be in (0, 50) percent, got {self.sparsity}")
        if fams - DENSE and self.group % 32:
            raise KvrunError(f"KV group {self.group} must be a multiple of 32 for quantized codecs "
                             f"(their codes are stored in tiles of 32 tokens)")
        if self.group > 256:
            raise KvrunError(f"KV group {self.group} is too large (at most 256)")
        if fams & {"kivi", "gear-l", "gear"} and self.residual % self.group:
            raise KvrunError(f"KV residual {self.residual} must be a multiple of the group "
                             f"{self.group} for KIVI/GEAR")
        if fams & {"gear-l", "gear"} and self.rank >= self.group:
            raise KvrunError(f"GEAR rank {self.rank} must be smaller than the group {self.group}")
        unit = math.lcm(self.group, 128)     # whole packed blocks of every layout (chanpack: 128)
        self.block = max(unit, self.block // unit * unit)
        self.eviction.check_fits(self.residual, self.group, self.context)

    def evict_tail(self) -> int:
        """Tail tokens per layer under eviction (Eviction.tail for this window)."""
        return self.eviction.tail(self.residual, self.group)

    def methods(self) -> set[str]:
        ms = {self.k_method, self.v_method}
        for k, v in self.layers or []:
            ms |= {k, v}
        return ms

    def layer_methods(self, n_layers: int) -> list[tuple[str, str]]:
        if self.layers is None:
            return [(self.k_method, self.v_method)] * n_layers
        if len(self.layers) != n_layers:
            src = (self.profile_info or {}).get("path")
            raise KvrunError(f"KV profile{f' {src}' if src else ''} has {len(self.layers)} layers, "
                             f"the model has {n_layers}")
        return list(self.layers)

    def for_model(self, cfg) -> "KVConfig":
        """`--kv auto` names the profile shipped for the model it runs on: the embedded
        model's unless another shipped profile was searched on this model (same name,
        hash and geometry); on a model no profile was shipped for, the generic default
        (profile.generic_settings; the settings given with auto win). Any other config is
        returned as is."""
        info = self.profile_info or {}
        if not info.get("auto") or info.get("generic"):
            return self
        path = shipped_for(cfg)
        if path is None:
            fields = info.get("fields", {})
            return KVConfig.from_settings(**{**generic_settings(cfg.head_dim), **fields,
                                             "profile_info": {"auto": True, "generic": True,
                                                              "fields": dict(fields)}})
        if str(path) == str(info.get("path")):
            return self
        out = parse_kv(f"profile:{path}", **info.get("fields", {}))
        out.profile_info["auto"] = True
        return out

    def check_profile(self, cfg) -> None:
        """Refuse a profile searched for another model (geometry; identity for --kv auto)."""
        if self.profile_info and self.profile_info.get("model"):
            from .profile import check_profile_model
            check_profile_model(self.profile_info["model"], cfg, self.profile_info.get("auto", False),
                                f"KV profile {self.profile_info.get('path', '')}".rstrip())

    def check_model(self, head_dim: int, n_layers: int, n_kv_heads: int = 0) -> None:
        """Checks that need the model's geometry (n_layers: the layers the arena holds)."""
        self.layer_methods(n_layers)
        D = head_dim
        tada = sorted(m for m in self.methods() if method_family(m)[0] == "tada")
        if n_kv_heads == 1 and tada:
            # TaDA stores the mean over KV heads plus each head's deviation from it; with
            # one KV head the mean is the key itself and the deviations are all zero, so it
            # would cost more than fp16 and compress nothing
            raise KvrunError(f"{tada[0]} needs more than one KV head (its mean over KV heads "
                             f"is the key itself with one); use kivi-4, int8 or gear")
        if any(r != "none" for r in self.rotation.layers(n_layers)) and D % 2:
            raise KvrunError(f"Hadamard rotation needs an even head dim, got {D}")
        fams = {method_family(m)[0] for m in self.methods()}
        if fams & {"kivi", "gear-l", "gear"} and D % self.v_group:
            raise KvrunError(f"V group {self.v_group} does not divide the head dim {D}")
        if "cb" in fams and D % 32:
            cb = sorted(m for m in self.methods() if method_family(m)[0] == "cb")
            raise KvrunError(f"{cb[0]} needs a head dim that is a multiple of 32 (its codes are "
                             f"packed in groups of 32 channels), got {D}")
        if fams & {"gear-l", "gear"} and self.rank >= D:
            raise KvrunError(f"GEAR rank {self.rank} must be smaller than the head dim {D}")
        if fams & {"gear"} and D > 256:
            raise KvrunError(f"GEAR outliers need head dim <= 256, got {D}")

    def k_rotated(self, n_layers: int) -> list[bool]:
        """Per layer whether its keys are stored rotated: the rotation setting, or a K codec
        that rotates its rows (cb-N); a profile's key transform applies there only."""
        return ["k" in r or make_codec(k, "k", self.group).needs_rotation
                for r, (k, _) in zip(self.rotation.layers(n_layers), self.layer_methods(n_layers))]

    @property
    def uncompressed(self) -> bool:
        """Every layer's K and V kept in a float dtype (fp16, bf16, fp32): no codes."""
        return self.methods() <= DENSE

    def label(self) -> str:
        info = self.profile_info or {}
        if info.get("generic"):                   # --kv auto without a shipped profile
            return f"auto (generic {self._method_label()})"
        if self.layers is not None:               # named as given: auto, profile:NAME
            base = ("auto" if info.get("auto") else
                    f"profile:{Path(info['path']).stem}" if info.get("path") else "profile")
            given = info.get("fields", {})          # a rotation or ring width set over the profile's
            return base + _suffixes(given.get("rotate", "none"), given.get("ring")) + self._evict_label()
        return self._method_label()

    def _method_label(self) -> str:
        """The label of uniform methods, as a --kv spec writes them (kivi-4@64+rot)."""
        base = self.k_method if self.k_method == self.v_method else f"{self.k_method}/{self.v_method}"
        if (self.group, self.v_group) != (32, 32):
            base += f"@{self.group}" if self.group == self.v_group else f"@{self.group}/{self.v_group}"
        return base + _suffixes(self.rotation.which, self.ring) + self._evict_label()

    def _evict_label(self) -> str:
        ev = self.eviction
        return f"+{ev.policy}@{ev.budget}" if ev.on else ""

    def replace(self, **settings) -> "KVConfig":
        """A copy with some flat settings changed (SETTINGS names)."""
        return KVConfig.from_settings(**{**self.settings(), **settings})


_ROT_SUFFIXES = {"rot": "kv", "rot-k": "k", "rot-v": "v", "rot-kv": "kv"}


def _suffixes(rotate: str, ring: int | None) -> str:
    """A label's +rot[-k|-v] and +ringN, as a --kv spec writes them."""
    return ("" if rotate == "none" else f"+rot{'' if rotate == 'kv' else '-' + rotate}") + \
        ("" if ring is None else f"+ring{ring}")


def _suffix(spec: str, suffix: str) -> tuple[str, object]:
    """A --kv suffix as (setting name, value): +rot[-k|-v] (rotation), +ringN (ring width)."""
    if suffix in _ROT_SUFFIXES:
        return "rotate", _ROT_SUFFIXES[suffix]
    if suffix.startswith("ring") and suffix[4:] in {str(b) for b in RING_BITS}:
        return "ring", int(suffix[4:])
    raise KvrunError(f"--kv {spec!r}: unknown suffix '+{suffix}' (use +rot, +rot-k, +rot-v or "
                     f"+ring4/+ring8/+ring16)")


def parse_kv(spec: str | None = "fp16", k: str | None = None, v: str | None = None,
             profile=None, **fields) -> KVConfig:
    """KVConfig from a --kv spec ("tada-4", or "K/V" like "kivi-4/kivi-2"), optional
    --kv-k / --kv-v overrides, an optional per-layer profile file, and any SETTINGS name.
    A "+rot" suffix turns the Hadamard rotation on for K and V ("+rot-k" / "+rot-v": one);
    "+ring4" / "+ring8" / "+ring16" sets the sliding-window rings' width (models with rings);
    an "@N" suffix sets both quantization groups to N ("kivi-4@64+rot": K scales per 64
    tokens, V scales per 64 channels), so methods with different groups can be compared
    side by side in one `kvrun ppl` / `kvrun bench` run.

    The specs "auto" (the shipped profile for the embedded model until `for_model` sees the
    model: its own shipped profile, or the generic default) and "profile:NAME" (a
    shipped profile's name or a file path) name a profile; its "kv" settings (window,
    groups …) apply unless given in `fields`."""
    spec = (spec or "fp16").strip()
    base, *suffixes = spec.split("+")
    named = set()
    for suffix in suffixes:
        name, setting = _suffix(spec, suffix)
        if name in named:
            raise KvrunError(f"--kv {spec!r}: more than one suffix sets the {name}")
        named.add(name)
        fields.setdefault(name, setting)
    spec = base
    if "@" in spec:
        spec, _, g = spec.partition("@")
        if not g.strip().isdigit() or int(g) < 1:
            raise KvrunError(f"--kv {spec}@{g}: the group after '@' must be a positive integer")
        fields.setdefault("group", int(g))
        fields.setdefault("v_group", int(g))
    auto = spec == "auto"
    if auto or spec.startswith("profile:"):
        if profile is not None:
            raise KvrunError(f"--kv {spec} and --kv-profile both name a profile: give one")
        if k or v:
            raise KvrunError(f"--kv-k/--kv-v cannot be combined with --kv {spec}")
        if auto:
            from .profile import shipped_default
            profile = shipped_default()
        else:
            profile = spec[len("profile:"):].strip()
            if not profile:
                raise KvrunError("--kv profile:NAME needs a shipped profile name or a file path")
        spec = "fp16"
    if "/" in spec:
        sk, _, sv = spec.partition("/")
    else:
        sk = sv = spec
    layers, info = None, None
    if profile is not None:
        p = read_profile(profile)
        known = set(SETTINGS) - set(NOT_KV_SETTINGS)
        unknown = sorted(set(p.kv) - known)
        if unknown:
            raise KvrunError(f"{p.path}: KV setting {unknown[0]!r} is not supported by this kvrun "
                             f"(known: {', '.join(sorted(known))})")
        layers = p.layers
        info = {"path": p.path, "model": p.model, "auto": auto,
                "fields": dict(fields)}             # as given: for_model re-reads with them
        fields = {**p.kv, **({"layer_rotate": p.rotate} if p.rotate else {}),
                  **({"layer_key_map": p.key_maps} if p.key_maps else {}), **fields}
    return KVConfig.from_settings(k_method=k or sk.strip(), v_method=v or sv.strip(), layers=layers,
                                  profile_info=info, **fields)
