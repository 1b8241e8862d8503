"""A cache as a row of the one-call native decode step (model/native_step.py,
kernels/native/decode_step.py): `row(cache, H)` before the step, `stepped(cache)` after it.

The step drives a cache through its storage, not through `attend`: per model layer it runs
exactly what `attend` runs for one token on the native backend — an arena layer's prebuilt
one-token kernel call (FusedStep's arguments, writing the new K/V into window slot n_win), a
sliding ring layer's ring kernel call (kernels/native/ring_attention.c, the one
`SlidingWindowKV.attend` makes: q and the new rows rotated, the new rows written into slot
seq_len mod W, attention over the min(seq_len + 1, W) filled slots, the output un-rotated) —
and leaves the rest of `attend` to `stepped`: the windows count the token and flush (the
rings have nothing to do before `commit`). Moving a layer's flush after the other layers'
steps changes nothing, since it touches that layer only. An evicting arena's layers also
write their attention mass, as `attend` has them do: `row` hands each layer the buffer the
eviction policy gives for the step (`mass_buffer`), `stepped` gives it back (`observe`)
before the flush, which may then compact the tail.

Which caches are rows is decided by their kind and their resolved routes (kernels/backend.py):
an arena (KVArena) whose every layer is `fused`, or a LayeredKVCache of such an arena beside a
ring whose step is native, evicting or not. Decided once per cache and built once (the
plan is kept per cache), never per step: after `positions(1)` every window has a free slot
for the step's token (an arena flushes at R + G tokens, a full context shifts or is refused,
and a restored snapshot is refused a window a flush would have emptied: kv/snapshot.py), and
`row` checks that promise, since the kernel writes into the slot. Any other cache (the tests'
oracle) is never a row.
"""
from __future__ import annotations

import weakref

from kvrun.kernels.dispatch import step_row
from ..kv.arena import KVArena
from ..kv.ring import LayeredKVCache

# cache -> ((H, backend), RowPlan or None); outside the cache so a copy (deepcopy,
# snapshot) never carries pointers into another cache's tensors
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# an evicting arena -> its layers' mass buffers of the step under way (row → stepped)
_MASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row(cache, H: int):
    """The cache's RowPlan with this step's lengths set, for H query heads, or None when the
    cache is not a row of the one-call step (the module docstring). Call after `positions`."""
    if isinstance(cache, LayeredKVCache):
        return _layered_row(cache, H)
    if isinstance(cache, KVArena):
        plan = _plan(cache, H, _arena_plan, cache.kernels)
        if plan is None:
            return None
        _check_free_slot(cache)
        _masses(cache, plan, range(cache.L))
        return plan.lengths(cache.n_tail, cache.n_win)
    return None


def _masses(arena, plan, layers) -> None:
    """An evicting arena's step: each of its layers (the plan's layers `layers`, in order)
    adds its attention mass into the buffer the policy gives (None: a policy without
    scores), as `KVArena.attend` passes it to its kernel."""
    if arena.ev is None:
        return
    masses = _MASS[arena] = [arena.ev.mass_buffer(l, 1) for l in range(arena.L)]
    for i, (mass, lo) in zip(layers, masses):
        plan.mass(i, mass, lo)


def stepped(cache) -> None:
    """After a one-call step through `row`: the new token is in every layer's window (or
    ring slot); the arena counts it and flushes (`KVArena.wrote`), as after `attend`'s
    kernel call."""
    arena = cache.inner if isinstance(cache, LayeredKVCache) else cache
    masses = _MASS.pop(arena, None)
    for l in range(arena.L):
        if masses is not None:
            arena.ev.observe(l, masses[l][0], 1)
        arena.wrote(l, 1)


def _plan(cache, H: int, build, backend):
    """The cache's RowPlan (or None) from `build(cache, H)`, built again only when H or the
    cache's backend (its attention path: KVArena.attn) changed."""
    key = (H, backend)
    hit = _PLANS.get(cache)
    if hit is None or hit[0] != key:
        hit = _PLANS[cache] = (key, build(cache, H))
    return hit[1]


def _all_fused(arena) -> bool:
    """Whether every layer of the arena runs the fused native route."""
    return all(r.fused for r in arena.routes)


def _arena_plan(arena, H: int):
    if not _all_fused(arena):
        return None
    return step_row(H, arena.G, layer_inputs(arena), attn=arena.attn,
                    softcap=arena.softcap)


def layer_inputs(arena) -> list:
    """Per layer what dispatch.step_row takes of an arena layer."""
    return [((arena.k_codecs[l], arena.k_store[l]), (arena.v_codecs[l], arena.v_store[l]),
             arena.win_k[l], arena.win_v[l], arena.rot_k[l], arena.rot_v[l]) for l in range(arena.L)]


def _check_free_slot(arena) -> None:
    """The step writes its token into window slot n_win of every layer: refuse a window
    without one (a state no arena operation leaves; the module docstring) rather than write
    past it."""
    if max(arena.n_win) >= arena.win_k.shape[2]:
        raise RuntimeError(f"a full KV window ({max(arena.n_win)} of {arena.win_k.shape[2]} "
                           f"slots) before a step: positions() must run first")


def _layered_row(cache, H: int):
    plan = _plan(cache, H, _layered_plan, cache.inner.kernels)
    arena, ring = cache.inner, cache.ring
    if plan is None:
        return None
    _check_free_slot(arena)
    n_tail, n_win = [0] * cache.n_layers, [0] * cache.n_layers
    for j, i in enumerate(cache.full):
        n_tail[i], n_win[i] = arena.n_tail[j], arena.n_win[j]
    _masses(arena, plan, cache.full)
    s = ring.seq_len
    return plan.lengths(n_tail, n_win, s % ring.W, min(s + 1, ring.W))


def _layered_plan(cache, H: int):
    arena, ring = cache.inner, cache.ring
    if not _all_fused(arena) or ring.ring_route.step != "native":
        return None
    layers: list = [None] * cache.n_layers                  # None: a ring layer, in order
    for i, x in zip(cache.full, layer_inputs(arena)):
        layers[i] = x
    spec = (ring.k.parts, ring.v.parts, ring.head_dim, ring.bits, ring.k.group, ring.dtype,
            ring.rot_k, ring.rot_v, ring.softcap)
    return step_row(H, arena.G, layers, ring=spec, attn=arena.attn,
                    softcap=arena.softcap)
