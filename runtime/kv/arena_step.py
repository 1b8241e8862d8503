"""The arena as a row of the one-call native decode step (model/native_step.py,
kernels/native/decode_step.py): KVArena.native_row / native_stepped.

The step runs, per layer, exactly what `KVArena.attend` runs for one token on the native
backend without eviction — the prebuilt one-token kernel call (FusedStep's arguments)
that writes the new K/V into window slot n_win — and
leaves the rest of `attend` to `stepped`: the window count and the flush. Moving a
layer's flush after the other layers' steps changes nothing, since it touches that layer
only. Decided once per step, never per layer: an evicting arena, another backend, a group
that is not whole kernel tiles, a layer no kernel covers, or a full window keeps `attend`.
"""
from __future__ import annotations

import weakref

from kvrun.kernels.dispatch import step_row
from kvrun.kernels.fused_compress import flush_count

# cache -> ((H, attention path), RowPlan or None); outside the cache so a copy (deepcopy,
# snapshot) never carries pointers into another cache's tensors
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_plan(cache, H: int, build, attn: str):
    """The cache's RowPlan (or None) from `build(cache, H)`, built again only when H or the
    cache's attention path `attn` (KVArena.attn) changed (layered_step.py's rows use it too)."""
    key = (H, attn)
    hit = _PLANS.get(cache)
    if hit is None or hit[0] != key:
        hit = _PLANS[cache] = (key, build(cache, H))
    return hit[1]


def native_row(arena, H: int):
    """The arena's RowPlan with this step's lengths, or None (the module docstring)."""
    plan = cached_plan(arena, H, _build, arena.attn)
    if plan is None or window_full(arena):
        return None
    return plan.lengths(arena.n_tail, arena.n_win)


def _build(arena, H: int):
    if arena.ev is not None:
        return None
    return step_row(H, arena.G, layer_inputs(arena), backend=arena.backend, attn=arena.attn,
                    softcap=arena.softcap)


def layer_inputs(arena) -> list:
    """Per layer what dispatch.step_row takes of an arena layer."""
    return [((arena.k_codecs[l], arena.k_store[l]), (arena.v_codecs[l], arena.v_store[l]),
             arena.win_k[l], arena.win_v[l], arena.rot_k[l], arena.rot_v[l]) for l in range(arena.L)]


def window_full(arena) -> bool:
    """Whether some layer's window has no slot for the step's token (`attend` appends
    first, then: a restored full window)."""
    return max(arena.n_win) >= arena.win_k.shape[2]


def stepped(arena) -> None:
    """Count the token each layer's window took in the step and flush, as `attend` does."""
    nw, R, G = arena.n_win, arena.R, arena.G
    for l in range(arena.L):
        nw[l] += 1
        if flush_count(nw[l], 0, R, G):
            arena.flush(l)
