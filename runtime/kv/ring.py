"""KV caches for models whose layers differ in what they attend to (Gemma 3: every 6th layer
attends to everything, the others to their last 512 tokens).

`SlidingWindowKV` holds the sliding-window layers: a ring of W = min(window, max_ctx) slots
per layer, in the window dtype. A token at position p lives in slot p mod W. A query at
position p sees the keys p − window + 1 .. p (its own included: HF's and llama.cpp's
convention), so the ring never holds more than the layer can read, whatever -c: its bytes
are 2 · layers · Hkv · W · D · itemsize.
- One token (decode): it is written into its slot — overwriting position p − W, which no
  later query can see — and attends over every filled slot. Slot order does not matter
  for one query, so this is one call over a contiguous (Hkv, min(p + 1, W), D) block.
- A chunk of T tokens at positions s .. s+T−1 attends over the ring's positions
  max(0, s − window + 1) .. s − 1, gathered oldest first, followed by its own rows, with
  the causal sliding-window mask; then its last min(T, W) rows are written.
Compression: a ring has no full-precision window and no tail — its tokens are overwritten
in place, one at a time — so it is quantized per token: `bits` 16 keeps the window dtype;
8 and 4 store each token's K and V as asymmetric min/scale codes over groups of
`group` channels (the KV config's V group, `v_group`, 32 unless set, e.g. "kivi-4@64";
fp16 scale and min per group from kernels/quant.py's asym_params, the quantizer of every
codec; 4-bit codes two to a byte), the per-token scheme KIVI uses for V. Per-token 4-bit K loses more than KIVI's per-channel K would, but
a ring cannot hold KIVI's G-token channel groups, and Gemma's QK-norm keeps K free of the
outlier channels that make per-token K quantization fail. `ring_bits(kv)` picks the
width from the KV method (build_cache: 16 when nothing is compressed, 8 when every method
keeps >= 8 bits, else 4), unless the config sets it (`ring`: "+ring8", a profile's "kv"
block, `kvrun search` choosing it under the byte budget). As in the arena, the step's own
new rows are attended in full precision and quantized when they are written. A one-token
step is one op where the backend has it (kernels/dispatch.py `ring_step`: the native
kernel, every width, rotates q and the new rows, reads the rows or codes in place and
writes the new slot as `_RingStore.write` does; Triton: quantized rings); `_attend` is its
torch oracle and serves everything else (chunks, the torch backend). On the native backend
a `LayeredKVCache`'s rings are also a row of the model's one-call decode step
(runtime/model/native_rows.py): the same kernel code per ring layer, inside one C call per
step. Which kernel a ring's one-token step runs is resolved when it is built (`bind`,
kernels/backend.py `RingRoute`).
A ring's attention soft-caps its logits where the model does (`softcap`, Gemma 2: build.py
passes the model's attn_logit_softcapping; 0: off), on every route: the kernels' and the
torch step's dense_attention.
A quantized ring stores K Hadamard-rotated (kernels/hadamard.py, fixed ±1 signs), and V
too with `rotate_v` (build_cache sets it for a V rotation in the config, "+rot" or "+rot-v":
the switch the arena uses for the global layers): rows are kept as x @ R (a
hadamard.Hadamard, applied by its butterfly in one fixed order of fp32 operations on every
backend, so the kernels store the torch step's codes bit for bit on every CPU), and attention runs
in the rotated space (hadamard.rotate_step, as the arena's layers) — q is rotated with K
once per call, the output un-rotated once if V is rotated, never the ring —
which is exact in full precision (q·k = qR·kR, P·V = (P·VR)·Rᵀ). The rotation spreads a
channel's large values over all D channels, so each channel group's min/max range fits the
bulk of its values; K is where it matters (per-token K groups lose the most: the KLD
figures, with their commands, are in docs/measurements-archive.md, "Gemma 3 270M"). K costs two
butterflies per layer and call (q, k); V's adds two more (v, the output). The arena's K
rotation is not tied to it: KIVI quantizes K per channel, which rotation mixes.

`LayeredKVCache` puts the two kinds behind the one cache interface the model and engine
use (runtime/kv/contract.py): sliding layers go to the ring, full-attention layers to `inner`
(the KVArena, built for the full layers only, which it indexes
0 .. n_full − 1 in model order: a per-layer profile for such a model lists its full layers).
Limits, each refused with one clear line where it is asked for:
- context shift: the ring would have to drop and re-rotate the middle of a window that
  other layers keep whole; llama.cpp refuses it for sliding-window models too;
- truncation (prefix reuse, a Ctrl-C between layers) keeps n tokens only while the ring
  still holds every key position n's query needs, i.e. n >= seq_len − 1 or nothing has
  wrapped yet; otherwise it keeps 0 (the next prompt is prefilled again).
"""
from __future__ import annotations

import torch

from kvrun.kernels import dense_attention
from kvrun.kernels.codecs import method_family
from kvrun.kernels.backend import Backend, choose
from kvrun.kernels.dispatch import ring_step
from kvrun.kernels.hadamard import Hadamard, rotate, rotate_step, unrotate
from kvrun.kernels.quant import asym_params, quantize_asym
from ..errors import KvrunError
from .cache import OnBackend
from .contract import KVCache
from .snapshot import Snapshot, nest, part, ring_restore, ring_snapshot


QGROUP = 32                     # default channels per scale/min group of a quantized ring
RING_SIGNS_SEED = 0             # the quantized ring's rotation signs (part of its format)


def ring_bits(kv) -> int:
    """The ring's width for a KV config: its `ring` setting when given (--kv …+ring8, a
    profile's "kv"), else 16 (the window dtype) when no layer is compressed, 8 when every
    method keeps >= 8 bits (int8, tada-8, profiles mixing fp16), else 4."""
    if kv.ring is not None:
        return kv.ring
    if kv.uncompressed:
        return 16
    return 8 if min(method_family(m)[1] for m in kv.methods()) >= 8 else 4


def ring_layout(n_layers, Hkv, W, D, bits, dtype, group) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each storage tensor of one role (K or V) of a ring: rows of the
    window dtype, or per-token codes with an fp16 scale and min per `group` channels. The
    allocation (_RingStore) and the byte count before it (build.ring_bytes) both read this."""
    if bits == 16:
        return [((n_layers, Hkv, W, D), dtype)]
    meta = ((n_layers, Hkv, W, D // group), torch.float16)
    return [((n_layers, Hkv, W, D * bits // 8), torch.uint8), meta, meta]


class _RingStore:
    """One role's (K or V) storage for every sliding layer: rows of the window dtype, or
    per-token codes with fp16 scale and min per `group` channels."""

    def __init__(self, n_layers, Hkv, W, D, bits, dtype, device, group: int = QGROUP):
        self.bits, self.dtype, self.group = bits, dtype, group
        if bits != 16 and (group < 1 or D % group):
            raise KvrunError(f"a {bits}-bit ring needs a channel group dividing the head dim {D}, got {group}")
        self.parts = [torch.zeros(shape, dtype=dt, device=device)
                      for shape, dt in ring_layout(n_layers, Hkv, W, D, bits, dtype, group)]
        if bits == 16:
            self.x, = self.parts
        else:
            self.codes, self.scale, self.min = self.parts

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)

    def write(self, layer: int, slots, rows: torch.Tensor) -> None:
        """rows (Hkv, n, D) into `slots` (an int or n indices) of `layer`."""
        if self.bits == 16:
            self.x[layer][:, slots] = (rows[:, 0] if isinstance(slots, int) else rows).to(self.dtype)
            return
        Hkv, n, D = rows.shape
        g = rows.float().reshape(Hkv, n, D // self.group, self.group)
        sc, mn = asym_params(g, -1, self.bits)             # fp16, as the reader sees them
        c = quantize_asym(g, sc, mn, self.bits).reshape(Hkv, n, D)
        sc, mn = sc[..., 0], mn[..., 0]
        if self.bits == 4:                                  # channel pairs (2i, 2i+1) per byte
            c = c[..., 0::2] | (c[..., 1::2] << 4)
        if isinstance(slots, int):
            c, sc, mn = c[:, 0], sc[:, 0], mn[:, 0]
        self.codes[layer][:, slots] = c
        self.scale[layer][:, slots] = sc
        self.min[layer][:, slots] = mn

    def read(self, layer: int, slots) -> torch.Tensor:
        """Slots `slots` (a slice or indices) of `layer` as (Hkv, n, D) rows."""
        if self.bits == 16:
            return self.x[layer][:, slots]
        c = self.codes[layer][:, slots]
        if self.bits == 4:
            c = torch.stack([c & 15, c >> 4], -1).flatten(-2)
        Hkv, n, D = c.shape
        g = c.reshape(Hkv, n, D // self.group, self.group).float()
        x = g * self.scale[layer][:, slots].float()[..., None] + self.min[layer][:, slots].float()[..., None]
        return x.reshape(Hkv, n, D).to(self.dtype)


class SlidingWindowKV(OnBackend):
    """Ring K/V of the sliding-window layers (module docstring)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int,
                 max_ctx: int, dtype: torch.dtype = torch.float16, device="cpu", bits: int = 16,
                 group: int = QGROUP, rotate_v: bool = False, backend: Backend | None = None,
                 softcap: float = 0.0, n_heads: int | None = None):
        if window < 1:
            raise KvrunError(f"sliding window must be >= 1 token (got {window})")
        if bits not in (16, 8, 4):
            raise KvrunError(f"ring width must be 16, 8 or 4 bits (got {bits})")
        self.window, self.W, self.bits = window, min(window, max_ctx), bits
        self.k = _RingStore(n_layers, n_kv_heads, self.W, head_dim, bits, dtype, device, group)
        self.v = _RingStore(n_layers, n_kv_heads, self.W, head_dim, bits, dtype, device, group)
        self.n_layers, self.dtype, self.head_dim = n_layers, dtype, head_dim
        self.n_heads = n_heads or n_kv_heads     # the model's query heads (the kernels' limit)
        self.softcap = float(softcap or 0.0)
        self.seq_len = 0
        self.torn = False           # a chunk overwrote ring slots before its commit
        self.bind(backend or choose(device))
        # K always, V with rotate_v, stored as x @ R (module docstring); fp16 rings never
        # (a Hadamard: the butterfly, the same bits in C and torch on every CPU)
        self.rot_k = None if bits == 16 else \
            Hadamard.for_head_dim(head_dim, RING_SIGNS_SEED, device)
        self.rot_v = self.rot_k if rotate_v else None

    def bind(self, backend: Backend) -> None:
        """Run on `backend` from now on: the one-token step's kernel (`ring_route`,
        kernels/backend.RingRoute) is resolved here."""
        self.kernels = backend
        self.ring_route = backend.ring_route(self.bits, self.n_heads, self.k.parts[0].shape[1],
                                             self.head_dim, self.k.group, self.dtype)

    def store(self, layer: int, slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V rows (Hkv, n, D) of the model's space into `slots` of `layer`
        (rows computed outside attention: LayeredKVCache.ingest)."""
        self.k.write(layer, slots, k if self.rot_k is None else rotate(k, self.rot_k))
        self.v.write(layer, slots, v if self.rot_v is None else rotate(v, self.rot_v))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D); k, v (1, Hkv, T, D) after RoPE. Returns (1, H, T, D)."""
        rv = self.rot_v                         # rot_k or None; rot_k is None for an fp16 ring
        if k.shape[2] == 1 and self.ring_route.step != "torch":
            # one token: the backend's fused step (rotations + attend + slot write), same
            # storage as _attend's
            s, W = self.seq_len, self.W
            return ring_step(q, k, v, self.k.parts, self.v.parts, self.bits, self.k.group,
                             self.dtype, layer, s % W, min(s + 1, W), self.rot_k, rv,
                             backend=self.ring_route.step, softcap=self.softcap)
        q, k, v = rotate_step(q, k, v, self.rot_k, rv)
        o = self._attend(layer, q, k, v)
        return o if rv is None else unrotate(o, rv)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """attend() in the ring's storage space."""
        s, T, W = self.seq_len, k.shape[2], self.W
        kn, vn = k[0].to(self.dtype), v[0].to(self.dtype)                 # (Hkv, T, D) rounded
        if T == 1:
            n = min(s + 1, W)
            if self.bits == 16:
                self.k.write(layer, s % W, kn)
                self.v.write(layer, s % W, vn)
                K, V = self.k.read(layer, slice(0, n)), self.v.read(layer, slice(0, n))
            else:                   # the new row attends in full precision, then is quantized
                K, V = self.k.read(layer, slice(0, n)).clone(), self.v.read(layer, slice(0, n)).clone()
                K[:, s % W], V[:, s % W] = kn[:, 0], vn[:, 0]
                self.k.write(layer, s % W, kn)
                self.v.write(layer, s % W, vn)
            # in q's dtype (fp32 for the models kvrun runs): fp16 SDPA's internal rounding
            # is the CPU library's (MKL / oneDNN paths differ between CPU kinds), and a
            # ring of <= W rows is cheap to convert
            return dense_attention(q, K[None].to(q.dtype), V[None].to(q.dtype), n - 1,
                                   softcap=self.softcap)
        lo = max(0, s - self.window + 1)                 # the oldest key the chunk can see
        idx = torch.arange(lo, s, device=q.device) % W
        K = torch.cat([self.k.read(layer, idx), kn], 1)[None]             # (1, Hkv, s-lo+T, D)
        V = torch.cat([self.v.read(layer, idx), vn], 1)[None]
        o = dense_attention(q, K, V, s - lo, window=self.window, softcap=self.softcap)
        m = min(T, W)
        slots = torch.arange(s + T - m, s + T, device=q.device) % W
        self.k.write(layer, slots, kn[:, T - m:])
        self.v.write(layer, slots, vn[:, T - m:])
        self.torn = True
        return o

    def commit(self, T: int) -> None:
        self.seq_len += T
        self.torn = False

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's last min(seq_len, W) K and V rows, oldest first, float32, un-rotated."""
        idx = torch.arange(max(0, self.seq_len - self.W), self.seq_len) % self.W
        k, v = self.k.read(layer, idx).float(), self.v.read(layer, idx).float()
        return (k if self.rot_k is None else unrotate(k, self.rot_k),
                v if self.rot_v is None else unrotate(v, self.rot_v))

    def keeps(self, n: int) -> bool:
        """Whether truncating to n tokens leaves every key position n's query needs."""
        if n == 0:
            return True
        if n == self.seq_len:
            return not self.torn        # a torn chunk overwrote keys of the committed state
        return max(0, n - self.window + 1) >= max(0, self.seq_len - self.W) and not self.torn

    def truncate(self, n: int) -> int:
        n = n if self.keeps(n) else 0
        self.seq_len, self.torn = n, False
        return n

    def reset(self) -> None:
        self.seq_len, self.torn = 0, False

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()


class LayeredKVCache(KVCache):
    """Sliding-window layers in a ring, full-attention layers in `inner` (module docstring)."""

    def __init__(self, windows: list[int], inner, ring: SlidingWindowKV):
        self.windows = list(windows)
        self.inner, self.ring = inner, ring
        # model layers of each kind, and model layer -> (is sliding, index in its cache)
        self.full = [i for i, w in enumerate(self.windows) if not w]
        self.slide = [i for i, w in enumerate(self.windows) if w]
        self.route = {i: (False, j) for j, i in enumerate(self.full)}
        self.route.update({i: (True, j) for j, i in enumerate(self.slide)})
        self.max_ctx, self.n_layers = inner.max_ctx, len(self.windows)
        self.kv = inner.kv

    # -- the cache interface -------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.inner.backend

    @backend.setter
    def backend(self, name: str) -> None:
        self.inner.backend = self.ring.backend = name

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def n_tail(self) -> list[int]:
        return self.inner.n_tail

    def positions(self, T: int) -> torch.Tensor:
        return self.inner.positions(T)

    def attend(self, layer: int, q, k, v):
        sliding, j = self.route[layer]
        return (self.ring if sliding else self.inner).attend(j, q, k, v)

    def attend_new(self, layer: int, q, new):
        sliding, j = self.route[layer]
        return self.ring.attend(j, q, *new.rows()) if sliding else self.inner.attend_new(j, q, new)

    @property
    def attn(self) -> str:
        """The native attention's product path of the full layers (KVArena.attn)."""
        return self.inner.attn

    @attn.setter
    def attn(self, path: str) -> None:
        self.inner.attn = path

    def commit(self, T: int) -> None:
        self.inner.commit(T)
        self.ring.commit(T)

    def truncate(self, n: int) -> int:
        """Keep the first n tokens where both kinds can (fewer: see the module docstring)."""
        while True:
            kept = self.inner.truncate(n)
            if self.ring.keeps(kept):
                self.ring.truncate(kept)
                return kept
            n = 0

    def reset(self) -> None:
        self.inner.reset()
        self.ring.reset()

    def end_prompt(self) -> None:
        self.inner.end_prompt()

    def resume_point(self, n: int, chunk: int) -> int:
        m = self.inner.resume_point(n, chunk)
        return m if m == self.seq_len or self.ring.keeps(m) else 0

    def canonical_tail(self, s: int) -> int:
        return self.inner.canonical_tail(s)

    def n_compressed(self) -> int:
        return self.inner.n_compressed()

    def ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (L, Hkv, n, D), all model layers: full layers' rows go to `inner`, the
        sliding layers keep their last W rows."""
        s, n, r = self.seq_len, k.shape[2], self.ring
        self.inner.ingest(k[self.full], v[self.full])
        m = min(n, r.W)
        slots = torch.arange(s + n - m, s + n) % r.W
        for j, i in enumerate(self.slide):
            r.store(j, slots, k[i, :, n - m:].to(r.dtype), v[i, :, n - m:].to(r.dtype))
        r.commit(n)

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        sliding, j = self.route[layer]
        return (self.ring if sliding else self.inner).rows(j)

    def nbytes(self) -> dict[str, int]:
        return {**self.inner.nbytes(), "ring": self.ring.nbytes()}

    def label(self) -> str:
        return self.inner.label()

    def snapshot(self) -> Snapshot:
        return nest({"kind": "layered", "seq_len": self.seq_len}, {"arena": self.inner.snapshot(),
                                          "ring": ring_snapshot(self.ring)})

    def restore(self, snap: Snapshot) -> None:
        if snap.meta.get("kind") != "layered":
            raise KvrunError(f"the saved cache is a {snap.meta.get('kind')!r} cache, this one has "
                             f"sliding-window rings")
        ring = part(snap, "ring")
        if not snap.meta.get("seq_len") == ring.meta.get("seq_len") == part(snap, "arena").meta.get("seq_len"):
            raise KvrunError("the saved rings and arena hold different token counts")
        write_ring = ring_restore(self.ring, ring)      # checked before anything is written
        self.inner.restore(part(snap, "arena"))
        write_ring()

    def report(self) -> list[str]:
        r, full = self.ring, len(self.full)
        width = "fp16" if r.bits == 16 else f"{r.bits}-bit per token"
        return [f"  ring: {r.n_layers} sliding-window layers of {r.n_layers + full}, {r.W} tokens "
                f"each, {width}; the method applies to the {full} full-attention layers",
                *self.inner.report()]
