"""Memory-budget mode (`--kv-budget-mb M -c N`): pick the KV configuration with the most
bytes that fits M MiB for N tokens, by the arena's own accounting — among fp16, the shipped
profiles, the profiles `kvrun search` wrote to $KVRUN_HOME/profiles for this model, and a
few uniform codecs — or say clearly that nothing fits."""
from __future__ import annotations

import math

from ..errors import KvrunError
from ..files import kvrun_home
from .build import check_kv, kv_bytes_at
from .config import KVConfig, parse_kv
from .profile import check_profile_model, read_profile, shipped_profiles

# uniform configurations tried after the profiles, rotated (same bytes, lower KLD: docs/measurements.md)
UNIFORM_FALLBACKS = ("int8+rot", "kivi-4+rot", "kivi-4@64+rot", "kivi-4/kivi-2+rot", "kivi-2+rot",
                     "kivi-2@64+rot")


def fit_budget(cfg, ctx: int, budget_mb: float, profiles=(), **fields) -> tuple[KVConfig, str]:
    """The KV configuration with the most bytes that fits `budget_mb` MiB for `ctx` tokens,
    by the arena's accounting: fp16, the shipped profiles and those in $KVRUN_HOME/profiles
    searched for this model, any `profiles` paths given, and uniform int8 / KIVI. Returns
    (config, a one-line description); KvrunError when nothing fits. `fields` are KVConfig
    settings (residual, group …) applied to every candidate."""
    if budget_mb <= 0:
        raise KvrunError(f"--kv-budget-mb must be > 0, got {budget_mb}")
    if ctx < 1:
        raise KvrunError(f"-c must be >= 1, got {ctx}")
    limit = budget_mb * 2**20
    cands: list[tuple[str, KVConfig, float]] = [("fp16", parse_kv("fp16", **fields), 0.0)]
    paths = list(shipped_profiles()) + sorted((kvrun_home() / "profiles").glob("*.json"))
    for p in paths:
        try:
            prof = read_profile(p)
            check_profile_model(prof.model, cfg, auto=True)
            kv = parse_kv(f"profile:{p}", **fields)
        except KvrunError:
            continue                      # another model's profile, or unreadable: not a candidate
        cands.append((f"profile {p.name}", kv, prof.meta.get("kld", math.inf)))
    for p in profiles:                    # named explicitly: problems are errors
        kv = parse_kv(f"profile:{p}", **fields)
        kv.check_profile(cfg)
        cands.append((f"profile {p}", kv, read_profile(p).meta.get("kld", math.inf)))
    for spec in UNIFORM_FALLBACKS:
        try:
            kv = parse_kv(spec, **fields)
            check_kv(cfg, kv)
        except KvrunError:
            continue                      # e.g. a 64-channel V group on a 32-dim head
        cands.append((spec, kv, math.inf))
    sized = [(sum(kv_bytes_at(cfg, kv, ctx).values()), -kld, name, kv) for name, kv, kld in cands]
    fit = [c for c in sized if c[0] <= limit]
    if not fit:
        b, _, name, _ = min(sized, key=lambda c: c[0])
        raise KvrunError(f"--kv-budget-mb {budget_mb:g}: nothing fits {ctx} tokens; the smallest "
                         f"configuration ({name}) needs {b / 2**20:.2f} MiB (lower -c or raise the budget)")
    b, _, name, kv = max(fit, key=lambda c: (c[0], c[1]))
    return kv, f"{name}: {b / 2**20:.2f} MiB for {ctx} tokens (budget {budget_mb:g} MiB)"
