"""A Gemma-style cache (ring.py `LayeredKVCache`: sliding-window rings beside an arena) as a
row of the one-call native decode step (model/native_step.py, kernels/native/decode_step.py):
LayeredKVCache.native_row / native_stepped.

Per model layer the row holds what the per-layer route's `attend` runs for one token on
the native backend: a global layer's prebuilt arena kernel call (arena_step.py), a sliding
layer's ring kernel call (kernels/native/ring_attention.c, the one `SlidingWindowKV.attend`
makes through dispatch.ring_step: q and the new rows rotated, the new rows written into
slot seq_len mod W, attention over the min(seq_len + 1, W) filled slots, the output
un-rotated). After the step the arena counts the token and flushes (arena_step.stepped);
the ring has nothing to do before `commit`, as after `attend` (its slot is written, its
`torn` flag untouched). Decided once per step: an evicting arena, another backend, a layer
no kernel covers, or a full arena window keeps the per-layer route.
"""
from __future__ import annotations

from kvrun.kernels.dispatch import step_row
from . import arena_step


def native_row(cache, H: int):
    """The cache's RowPlan with this step's lengths, or None (the module docstring)."""
    plan = arena_step.cached_plan(cache, H, _build, cache.inner.attn)
    arena, ring = cache.inner, cache.ring
    if plan is None or arena_step.window_full(arena):
        return None
    n_tail, n_win = [0] * cache.n_layers, [0] * cache.n_layers
    for j, i in enumerate(cache.full):
        n_tail[i], n_win[i] = arena.n_tail[j], arena.n_win[j]
    s = ring.seq_len
    return plan.lengths(n_tail, n_win, s % ring.W, min(s + 1, ring.W))


def _build(cache, H: int):
    arena, ring = cache.inner, cache.ring
    if arena.ev is not None or ring.backend != "native":
        return None
    layers: list = [None] * cache.n_layers                  # None: a ring layer, in order
    for i, x in zip(cache.full, arena_step.layer_inputs(arena)):
        layers[i] = x
    spec = (ring.k.parts, ring.v.parts, ring.head_dim, ring.bits, ring.k.group, ring.dtype,
            ring.rot_k, ring.rot_v, ring.softcap)
    return step_row(H, arena.G, layers, backend=arena.backend, ring=spec, attn=arena.attn,
                    softcap=arena.softcap)


def stepped(cache) -> None:
    """After the one-call step: the arena's windows count the token and flush."""
    arena_step.stepped(cache.inner)
