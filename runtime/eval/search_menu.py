"""What `kvrun search` (search.py) chooses from: the codec menu of a slot (a layer's K or V)
per family and bit width, and the widths of a model's sliding-window rings (kv/ring.py), one
more slot when the model has them."""
from __future__ import annotations

from ..errors import KvrunError
from ..kv.config import KVConfig
from ..kv.layout import layer_windows

# bits -> methods per codec family; 8-bit KIVI is the per-token int8 codec, 3-bit KIVI
# (kivi-3) has no value layout and the search offers it to K slots only. "all" is every
# codec that fits any model's geometry: TaDA is left out (it refuses one KV head, and its
# per-token mean costs more than KIVI's metadata on these models)
FAMILIES = {
    "kivi": {2: ["kivi-2"], 3: ["kivi-3"], 4: ["kivi-4"], 8: ["int8"], 16: ["fp16"]},
    "tada": {2: ["tada-2"], 4: ["tada-4"], 8: ["tada-8"], 16: ["fp16"]},
    "any": {2: ["kivi-2", "tada-2"], 4: ["kivi-4", "tada-4"], 8: ["int8", "tada-8"], 16: ["fp16"]},
    "cb": {2: ["cb-2"], 3: ["cb-3"], 4: ["cb-4"], 8: ["int8"], 16: ["fp16"]},
    "all": {2: ["kivi-2", "cb-2"], 3: ["kivi-3", "cb-3"], 4: ["kivi-4", "cb-4"], 8: ["int8"], 16: ["fp16"]},
}
ROLES = ("k", "v")
DEFAULT_RINGS = (4, 8)              # ring widths a search chooses from (16: fp16, on request)


def default_bits(family: str) -> list[int]:
    """Every bit-width the family has below 16 (fp16 is a choice only when asked for)."""
    _check_family(family)
    return sorted(b for b in FAMILIES[family] if b < 16)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise KvrunError(f"unknown --family {family!r} ({', '.join(FAMILIES)})")


def candidate_methods(family: str, bits: list[int] | None = None) -> list[str]:
    """The methods a slot may take: the family's at each of `bits` (default: default_bits)."""
    _check_family(family)
    bits = default_bits(family) if bits is None else list(bits)
    bad = [b for b in bits if b not in FAMILIES[family]]
    if bad or not bits:
        raise KvrunError(f"--bits must be a non-empty list from {sorted(FAMILIES[family])} "
                         f"for --family {family}, got {bits}")
    return [m for b in sorted(set(bits)) for m in FAMILIES[family][b]]


def ring_choices(cfg, base: KVConfig, rings=None) -> tuple[int, ...]:
    """The ring widths a search chooses from: () on a model without sliding-window layers
    (asking for some there is an error), else `rings`, the base config's width, or
    DEFAULT_RINGS."""
    if not any(layer_windows(cfg)):
        if rings:
            raise KvrunError("--rings: this model has no sliding-window layers (no rings to size)")
        return ()
    rings = tuple(rings or ((base.ring,) if base.ring else DEFAULT_RINGS))
    for w in rings:                        # the config's own check, one line
        base.replace(ring=w)
    return tuple(sorted(set(rings)))
