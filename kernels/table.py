"""The kernel table: which backend's kernel serves which codec, per op, and the routes a
decode step takes through them — the one place this is written down.

A codec declares what it is — `kind` ("fp", "int8", "kivi", "tada", "gear", "cb") and `bits`
(kernels/codecs/) — and `COVERAGE` says, from those two facts, which backend has a kernel
for it. kernels/backend.py resolves each cache layer's route when the cache is built, from
this table and the shape limits the kernels declare beside it (`covers_layer` in
native/decode_attention.py and native/pack.py, `covers` in the ring kernels: head dim, tile
alignment, GEAR rank, heads per KV head); what neither covers runs on torch, which covers
every codec (it is the oracle). A routed call a kernel declines is then a bug, raised by
kernels/dispatch.py (`KernelRouteError`), not a fallback. The backend itself is chosen once
per model or cache (kernels/backend.py `choose`).

| op | native (CPU) | triton (CUDA) | torch |
|---|---|---|---|
| `decode_attention` (tail + window + new rows) | fp, int8, KIVI (3-bit keys too), TaDA, GEAR (native/decode_attention.c; KIVI keys' q.K in int32: kdot_int.c, `KVRUN_ATTN`), cb 2/3/4-bit (its tile reads in native/codebook_attention.c, codebook_portable.c without AVX-512); each role read by its own kind, so any K codec pairs with any V codec | fp, int8, KIVI (3-bit keys too), TaDA, GEAR (triton/decode_attention.py) | every codec (kernels/decode_attention.py) |
| `attend_append` (rotate + round + window write + attention, one call) | what `decode_attention` covers | — | — |
| `fused_step` (`attend_append` for one token of one layer, its C arguments built once) | what `decode_attention` covers | — | — |
| `step_row` (every layer's one-token step of one cache, inside the one-call decode step) | what `decode_attention` covers; sliding rings of every width (native/ring_attention.c) | — | — |
| `pack` (a flush: window → tail; token eviction's re-packs) | int8, KIVI, TaDA (native/pack.c), cb (native/codebook_pack.c) | KIVI 2/4-bit (triton/kivi_pack.py) | `codec.store` |
| `pack_means` (`pack` with given per-token means: eviction's shared-slot TaDA re-pack) | — | — | `codec.pack(mu=)` |
| `fused_write` (K's RoPE / V's projection fused into the window write; never a pack) | — | every codec (triton/window_write.py) | the oracle only (kernels/window_write.py), not a route |
| `ring_step` (a sliding ring's one-token rotate + attend + slot write) | 4/8/16-bit rings (native/ring_attention.c) | 4/8-bit rings (triton/ring_attention.py) | kv/ring.py |

Routes, by cache (kv/), resolved per layer when the cache is built (kernels/backend.py
`Backend.layer_route` / `ring_route`, from this table and the layer's shape):
- arena (arena.py): Triton takes the fused write (`attend_new`) — `fused_write` into the
  window's free slots, `decode_attention`, then the arena's flush — for layers neither
  rotated nor evicting (route.fused_write), for steps of T <= min(R, 64) tokens that fit
  the window (`writes_fused`). On native, a layer whose codecs `decode_attention` covers
  with D <= 256 and G a multiple of 32 is `fused`: one token `fused_step` (inside the
  model's one-call native step, `step_row`, when every layer is, evicting ones too), else
  `attend_append`. Everything else (torch, the oracle, always) takes
  `decode_attention` over separate rows (on the route's backend: its kernel, or torch for
  a codec it has none for) and the arena's `append`. Every route ends in the one flush,
  `KVArena.flush` → `pack` on the route's packer.
- evicting arena (arena_evict.py, a policy the arena calls): `attend` as above, or a row
  of the one-call step, with the attention-mass output; flushes and the
  compactions' re-packs go through the arena's `pack_tail`, i.e. `pack` on the cache's
  backend (`pack_means` for TaDA slots re-packed with their stored means).
- ring (ring.py, Gemma's sliding layers): one-token steps take `ring_step` (on Triton
  4/8-bit rings only), and on native they are rows of the one-call step (`step_row`) beside
  the global layers' arena when every layer has a kernel; chunks take the torch step.
- the rest of a layer (norms, projections, MLP) runs natively for int4/int8 models on a
  native cache (model/native_step.py, native/decode_layer.c), on arena (and ring) rows in
  one call with every layer's attention (native/decode_step.py); else in torch.

The codebook codecs (cb) have no Triton kernel: on CUDA their layers run `decode_attention`
on torch. Their roles are always rotated (the codec's `needs_rotation`), so they never take
the fused write.

Every `decode_attention`, `attend_append`, `fused_step`, `step_row` and `ring_step` kernel
takes the cache's attention logit soft-cap (Gemma 2; 0 off): no route is declined for it.

`ring_step` is not codec-shaped — a ring stores 4- or 8-bit per-token codes or rows of the
window dtype — so its kernels check the ring's bits themselves instead of `COVERAGE`.
"""
from __future__ import annotations

ANY = (2, 4, 8, 16, 32)     # every width of a kind (int8: 8; fp: 16 or 32)
Q = (2, 4, 8)               # the widths of the quantizing codecs
KQ = (2, 3, 4, 8)           # KIVI's: 3 bits for keys only (chanpack's split planes)

COVERAGE: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {
    "decode_attention": {
        "native": {"fp": ANY, "int8": ANY, "kivi": KQ, "tada": Q, "gear": Q, "cb": (2, 3, 4)},
        "triton": {"fp": ANY, "int8": ANY, "kivi": KQ, "tada": Q, "gear": Q},
    },
    "pack": {
        "native": {"int8": ANY, "kivi": KQ, "tada": Q, "cb": (2, 3, 4)},
        "triton": {"kivi": (2, 4)},
    },
}


def covers(op: str, backend: str, codec) -> bool:
    """Whether `backend` has a kernel for `op` on this codec (torch: every codec, except
    where the table lists torch itself)."""
    table = COVERAGE[op]
    if backend not in table:
        return backend == "torch"
    return codec.bits in table[backend].get(codec.kind, ())
