"""The compressed KV arena: a full-precision residual window + a compressed tail per layer
(docs/architecture.md), a KVCache (contract.py). Every --kv is one: fp16 (bf16, fp32) is an
arena whose tail holds rows as they are (`lossless`: any prefix can be kept).

Per layer (codecs may differ per layer and between K and V):
- window: the newest tokens, fp16 (bf16 if every method is bf16), R + G slots (fewer when
  -c is shorter). It is kept
  oldest-first and compacted after each flush (a copy of < R tokens every G steps) instead
  of wrapping around, so the read path always sees one contiguous slice.
- tail: the codec's packed storage for floor((max_ctx - R) / G) * G tokens — the most that
  can ever leave the window, since a flush always leaves >= R tokens in it.
The decode-step contract, the same on every backend and for every step (a decode token or a
prefill chunk): the T new tokens are rounded to the window dtype, the new queries attend
over [tail, window, new tokens] (the new ones in full precision, causally among
themselves), and only then are the oldest tokens flushed in whole blocks of G, so that the
window holds R .. R+G-1 tokens (all of them while fewer than R + G). A flushed token is
therefore attended in full precision at the step that flushes it, and compressed from the
next step on; a prefill chunk longer than the window goes straight into the tail after
its own attention. The model's step enters through `attend_new` (K before RoPE), which takes
the fused window write where the layer's route has one (Triton: `writes_fused`), else
`attend`; which kernels serve each layer was resolved when the cache was built
(`bind`: kernels/backend.py, from kernels/table.py). Both give the same cache bytes and, on
one backend, the same output bit for bit (tests/kv/test_write_attend.py;
tests/kv/test_decode_contract.py across backends).

Append and flush are written once, here. New rows reach the window either through `append`
(rows in hand: written into the free slots, or, for a chunk longer than the free slots,
packed together with the window's oldest blocks) or written into slots [n_win, n_win + T)
by a kernel — the native step's phase 0, the one-call step, the fused window write — which
then calls `wrote(l, T)`. Every path ends in `flush`, the one place whole blocks of G leave
the window (`_pack` → `dispatch.pack` on the layer's packer, or the eviction policy first).

Context full: policy "error" raises KvrunError; "shift" is llama.cpp's context shift: keep
the first n_keep tokens (rounded up to a whole tail block, untouched), drop half of the
rest, and re-rotate every later key by -n_discard. Kept tokens after the sinks are
dequantized, re-rotated (K) and re-packed through the normal append path: a one-off double
quantization, once every ~ctx/2 generated tokens.

Token eviction (`KVConfig.eviction`, evict.py) is the third policy: the tail is allocated for
the budget instead of max_ctx, and arena_evict.ArenaEviction is a policy the arena calls
around each step's attention (scores: the attention mass) and when blocks leave the
window (`flush`: pack them or compact the full tail; see that module). It writes the tail
only through `pack_tail` (dispatch.pack on the cache's backend, as every flush), reads it
through `tail_rows` / `tail_means`, and returns the counts the arena sets. Positions stay
absolute (`seq_len`), so n_tail + n_win + evicted == seq_len. While a prompt is prefilled an
observation-window policy may hold the tail's rows as they were packed; a prompt's chunk then
reads the tail through them (`attend_exact`, the same contract over a lossless tail).

Attention logit soft-capping (Gemma 2's attn_logit_softcapping) is the model's, passed in
as `softcap` (build.py, from the model config) and handed to every attention op below
(0: off): each backend's kernel caps the logits where it forms them.

Interrupted forwards (Ctrl-C between layers) leave layers at different lengths;
`truncate(seq_len)` makes them consistent again (keeping fewer tokens if a layer flushed).
"""
from __future__ import annotations

import torch

from kvrun.kernels.codecs.base import COMPONENTS
from kvrun.kernels.codecs import make_codec
from kvrun.kernels.backend import Backend, choose
from kvrun.kernels.dispatch import (attend_append, decode_attention, fused_fits, fused_step,
                                 pack, write_k, write_v)
from kvrun.kernels.hadamard import (Hadamard, KeyMap, rotate, rotate_k, rotate_step, unrotate,
                                    unrotate_k)
from ..errors import KvrunError
from .arena_evict import ArenaEviction, lossless_codec, tail_sizes
from .arena_shift import shift_layer
from .cache import KV_DTYPES, NewKV, OnBackend
from .config import KVConfig
from .contract import KVCache
from .key_map import key_map_tensors
from .snapshot import Snapshot, arena_restore, arena_snapshot

# the fused write's largest step: decode steps and short chunks of up to 64 new tokens;
# longer prefill chunks keep attend
WRITE_ATTEND_MAX_T = 64


def flush_count(w: int, T: int, R: int, G: int) -> int:
    """Tokens that leave a window of w tokens when T are appended (a multiple of G)."""
    total = w + T
    return 0 if total < R + G else (total - R) // G * G


def window_slots(kv: KVConfig, max_ctx: int) -> int:
    """Window slots per layer: R + G, or max_ctx when the context is shorter (it then never
    reaches a flush, which happens at R + G tokens)."""
    return min(kv.residual + kv.group, max_ctx)


def window_dtype(kv: KVConfig) -> torch.dtype:
    """fp16, or bf16 / fp32 when every layer uses that uncompressed method."""
    ms = kv.methods()
    return KV_DTYPES[next(iter(ms))] if ms in ({"bf16"}, {"fp32"}) else torch.float16


def codec_factory(kv: KVConfig):
    cache: dict = {}

    def get(method: str, role: str):
        key = (method, role)
        if key not in cache:        # shared across layers: one set of scratch buffers
            cache[key] = make_codec(method, role, kv.group, kv.v_group, kv.rank,
                                    kv.sparsity, kv.tada_mu)
        return cache[key]
    return get


class KVArena(OnBackend, KVCache):
    """Preallocated window + compressed tail for `max_ctx` tokens, all layers."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_ctx: int,
                 kv: KVConfig, inv_freq: torch.Tensor, device="cpu", n_heads: int | None = None,
                 backend: Backend | None = None, softcap: float = 0.0):
        kv.check_model(head_dim, n_layers)
        if kv.context.on_full == "shift" and kv.context.n_keep >= max_ctx:
            raise KvrunError(f"--keep {kv.context.n_keep} leaves nothing to shift in a context of "
                             f"{max_ctx} tokens: it must be smaller than -c/--ctx-size")
        self.L = self.n_layers = n_layers
        self.Hkv, self.D, self.max_ctx, self.kv = n_kv_heads, head_dim, max_ctx, kv
        self.softcap = float(softcap or 0.0)      # the logits' soft-cap (module docstring)
        self.R, self.G = kv.residual, kv.group
        self.S_l = tail_sizes(kv, n_layers, max_ctx)      # per-layer tail (eviction: budget)
        self.S = max(self.S_l, default=0)               # (no full-attention layer: 0)
        self.inv_freq = inv_freq.to(torch.float64)                       # (D/2,)
        self.layer_methods = kv.layer_methods(n_layers)
        get = codec_factory(kv)
        self.k_codecs = [get(k, "k") for k, _ in self.layer_methods]
        self.v_codecs = [get(v, "v") for _, v in self.layer_methods]
        self.k_store = [c.alloc(n_kv_heads, head_dim, S, device) for c, S in zip(self.k_codecs, self.S_l)]
        self.v_store = [c.alloc(n_kv_heads, head_dim, S, device) for c, S in zip(self.v_codecs, self.S_l)]
        self.wdtype = window_dtype(kv)
        # R + G slots; a context shorter than that never flushes and needs only max_ctx
        wshape = (n_layers, n_kv_heads, window_slots(kv, max_ctx), head_dim)  # (L, Hkv, R+G, D)
        self.win_k = torch.zeros(wshape, dtype=self.wdtype, device=device)
        self.win_v = torch.zeros(wshape, dtype=self.wdtype, device=device)
        # Hadamard rotation: K and/or V are stored as x @ R; the read
        # path rotates q once and un-rotates the attention output once, never the cache.
        # (D, D) orthogonal: the matrix form the arena's kernels take (a KeyMap folds into it)
        rmat = Hadamard.for_head_dim(head_dim, kv.rotation.seed, device).matrix
        # (a codec that assumes rotated rows, codebook.py's, rotates its role in any case)
        rots = kv.rotation.layers(n_layers)
        self.rot_k = [rmat if kr else None for kr in kv.k_rotated(n_layers)]
        # a key transform fitted once per model (a profile's "k_map", key_map.py), folded into
        # K's rotation (hadamard.KeyMap); a layer whose K is not rotated has no use for one
        for l, m in enumerate(kv.rotation.layer_key_maps(n_layers)):
            if m is not None and self.rot_k[l] is not None:
                self.rot_k[l] = KeyMap(self.rot_k[l], *key_map_tensors(m, n_kv_heads, head_dim, l))
        self.rot_v = [rmat if "v" in r or c.needs_rotation else None for r, c in zip(rots, self.v_codecs)]
        self.n_tail = [0] * n_layers          # flushed tokens per layer (multiple of G)
        self.n_win = [0] * n_layers           # window tokens per layer
        self.seq_len = 0
        self.n_shifts = 0
        self.ev = (ArenaEviction(self, n_heads or n_kv_heads) if kv.eviction.on else None)
        # every tail holds rows as the window does (fp16 / bf16 / fp32): nothing is lost to a
        # flush, so any prefix can be kept (truncate moves a cut block back to the window)
        self.lossless = self.ev is None and all(lossless_codec(c, self.wdtype)
                                                for c in self.k_codecs + self.v_codecs)
        self.bind(backend or choose(device))

    # -- the backend, chosen once (kernels/backend.py) ------------------------------------------
    def bind(self, backend: Backend) -> None:
        """Run on `backend` from now on: every layer's route (`routes`, a
        kernels/backend.LayerRoute: which kernel attends, flushes, writes the window) is
        resolved here, from the backend and the layer's codecs and shape, not per call."""
        self.kernels = backend
        self.routes = [backend.layer_route(kc, vc, self.D, self.G, rk is not None or rv is not None,
                                           self.ev is not None)
                       for kc, vc, rk, rv in zip(self.k_codecs, self.v_codecs, self.rot_k, self.rot_v)]

    @property
    def attn(self) -> str:
        """The native attention's product path (KVRUN_ATTN, read once with the backend)."""
        return self.kernels.attn

    @attn.setter
    def attn(self, path: str) -> None:
        self.bind(Backend(self.kernels.name, path, self.kernels.gemv))

    # -- the cache interface -----------------------------------------------------------------
    def positions(self, T: int) -> torch.Tensor:
        if self.seq_len + T > self.max_ctx:
            if self.kv.context.on_full != "shift" or T > self.max_ctx:
                raise KvrunError(f"context full: {self.seq_len} + {T} tokens > context size "
                                 f"{self.max_ctx} (raise -c/--ctx-size or use --ctx-policy shift)")
            while self.seq_len + T > self.max_ctx:
                self.shift()
        return torch.arange(self.seq_len, self.seq_len + T)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (1, H, T, D); k, v: (1, Hkv, T, D), K already rotated. Returns (1, H, T, D).
        The decode-step contract (module docstring): attend over tail + window + the new
        tokens in full precision, then flush."""
        assert q.shape[0] == 1, "the KV arena holds one sequence (batch 1)"
        nt, w = self.n_tail[layer], self.n_win[layer]
        assert nt + w + k.shape[2] <= self.max_ctx, "positions() must run before attend()"
        rk, rv = self.rot_k[layer], self.rot_v[layer]
        T = k.shape[2]
        if self.ev is not None and self.ev.exact(layer, T):   # a prompt's chunk over its exact rows
            q, k, v = rotate_step(q, k, v, rk, rv)
            k, v = k.to(self.wdtype), v.to(self.wdtype)
            o = self.ev.attend_exact(layer, q, k, v).to(q.dtype)
            self.append(layer, k[0], v[0])
            return o if rv is None else unrotate(o, rv)
        # eviction's scores: this step's attention mass is added into a buffer (None: unused)
        mass, mass_from = self.ev.mass_buffer(layer, T) if self.ev else (None, 0)
        kt, vt = (self.k_codecs[layer], self.k_store[layer]), (self.v_codecs[layer], self.v_store[layer])
        route = self.routes[layer]
        if route.fused and self._fused_fits(layer, q.shape[1], T):
            # the native kernel rotates, rounds, writes and attends
            o = self._attend_fused(layer, q, k, v, kt, vt, mass, mass_from)
            if self.ev:
                self.ev.observe(layer, mass, T)
            self.wrote(layer, T)
            return o
        q, k, v = rotate_step(q, k, v, rk, rv)    # q·k = (qR)·(kR), P·V = (P·(VR))·Rᵀ
        k, v = k.to(self.wdtype), v.to(self.wdtype)                     # (1, Hkv, T, D)
        o = decode_attention(q, kt, vt, nt, self.win_k[layer][None, :, :w], self.win_v[layer][None, :, :w],
                             k, v, block=self.kv.block, mass=mass, mass_from=mass_from,
                             backend=route.attention, attn=self.attn, softcap=self.softcap)
        if self.ev:
            self.ev.observe(layer, mass, T)
        self.append(layer, k[0], v[0])
        return o if rv is None else unrotate(o, rv)

    def _fused_fits(self, layer: int, H: int, T: int) -> bool:
        """Whether T new tokens fit the fused kernel call now: the window's free slots, and
        the kernel's query block over the keys they attend."""
        nt, w = self.n_tail[layer], self.n_win[layer]
        return w + T <= self.win_k.shape[2] and fused_fits(H, nt + w + T, T)

    def _attend_fused(self, layer, q, k, v, kt, vt, mass, mass_from):
        """`attend` as one native kernel call (route.fused), for a step that `_fused_fits`."""
        nt, w, T = self.n_tail[layer], self.n_win[layer], k.shape[2]
        rk, rv = self.rot_k[layer], self.rot_v[layer]
        if T == 1:                          # a decode step: the layer's prebuilt arguments
            step = fused_step(self.win_k, self.win_v, layer, q.shape[1], rk, rv,
                              attn=self.attn, softcap=self.softcap)
            o = step(q, kt, vt, nt, w, k, v, mass, mass_from)
            if o is not None:               # (None: q / k / v strides it does not take)
                return o
        return attend_append(q, kt, vt, nt, self.win_k[layer][None, :, :w], self.win_v[layer][None, :, :w],
                             k, v, self.win_k[layer][:, w:w + T], self.win_v[layer][:, w:w + T],
                             rk, rv, attn=self.attn, mass=mass, mass_from=mass_from,
                             softcap=self.softcap)

    def attend_new(self, layer: int, q: torch.Tensor, new: NewKV) -> torch.Tensor:
        """`attend` from the step's K before RoPE and V's operands (contract.py): the fused
        window write where the layer's route has it (route.fused_write: Triton) and the step
        fits it — 1 <= T <= min(R, 64) new tokens in the window's free slots — else `attend`
        over the rows. Both follow the one step contract, so this only picks the faster
        route."""
        if not self.writes_fused(layer, q.shape[2]):
            return self.attend(layer, q, *new.rows())
        return self._write_attend(layer, q, new)

    def writes_fused(self, layer: int, T: int) -> bool:
        """Whether `attend_new` takes the fused window write for a step of T tokens now."""
        return (self.routes[layer].fused_write and 0 < T <= min(self.R, WRITE_ATTEND_MAX_T)
                and self.n_win[layer] + T <= self.win_k.shape[2])

    def _write_attend(self, layer: int, q: torch.Tensor, new: NewKV) -> torch.Tensor:
        """The fused-write step: q (1, H, T, D) after RoPE; new K before RoPE and V as
        projection operands or rows. Writes the new tokens into the window's free slots (K's
        RoPE and the V projection fused into the write), attends over tail + window, then
        counts them (`wrote`, which flushes). Returns (1, H, T, D)."""
        assert q.shape[0] == 1, "the KV arena holds one sequence (batch 1)"
        nt, w, T = self.n_tail[layer], self.n_win[layer], q.shape[2]
        assert nt + w + T <= self.max_ctx, "positions() must run before attend_new()"
        kt = (self.k_codecs[layer], self.k_store[layer])
        vt = (self.v_codecs[layer], self.v_store[layer])
        wk, wv = self.win_k[layer], self.win_v[layer]                    # (Hkv, R+G, D)
        write_k(new.k[0], new.cos, new.sin, wk, w, backend=self.backend)
        v_src = (new.v[0], None, None) if new.v is not None else (new.v_x, new.v_weight, new.v_bias)
        write_v(*v_src, wv, w, backend=self.backend)
        n = w + T
        # the new tokens are the window's last T, apart for the causal mask between them
        o = decode_attention(q, kt, vt, nt, wk[None, :, :w], wv[None, :, :w],
                             wk[None, :, w:n], wv[None, :, w:n], block=self.kv.block,
                             backend=self.routes[layer].attention, attn=self.attn, softcap=self.softcap)
        self.wrote(layer, T)
        return o

    def ingest(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append already-computed K/V for every layer without attending: k, v: (L, Hkv, n, D),
        K rotated. Used to fill a cache to a depth (benchmarks) through the normal write path."""
        n = k.shape[2]
        self.positions(n)
        for l in range(self.L):
            rk, rv = self.rot_k[l], self.rot_v[l]
            for s in range(0, n, self.kv.block):
                e = min(n, s + self.kv.block)
                kb, vb = k[l, :, s:e], v[l, :, s:e]
                kb = kb if rk is None else rotate_k(kb, rk)
                vb = vb if rv is None else rotate(vb.float(), rv)
                if self.ev:
                    self.ev.observe(l, None, e - s)                 # not attended: no scores
                self.append(l, kb.to(self.wdtype), vb.to(self.wdtype))
        self.seq_len += n

    def commit(self, T: int) -> None:
        self.seq_len += T
        drop = self.ev.n_drop if self.ev else [0] * self.L               # evicted tokens
        assert all(nt + w + d == self.seq_len for nt, w, d in zip(self.n_tail, self.n_win, drop)), \
            "a layer was skipped: call truncate(seq_len) after an interrupted forward"

    def truncate(self, n: int) -> int:
        """Keep the first n tokens if possible; returns how many were kept (a multiple of G
        when a layer had already flushed past n). Also repairs layers left inconsistent."""
        assert 0 <= n <= self.seq_len, (n, self.seq_len)
        if self.ev:             # window tokens only: evicted history cannot come back
            wins = self.ev.truncate(n)
            if wins is None:
                self.reset()
                return 0
            self.n_win, self.seq_len = wins, n
            return n
        kept = n
        for nt in self.n_tail:
            if n < nt and not self.lossless:
                kept = min(kept, n // self.G * self.G)
        for l in range(self.L):
            nt = self.n_tail[l]
            if kept >= nt:
                self.n_win[l] = kept - nt
            else:               # lossless: the rows of the cut block go back to the window
                a = kept // self.G * self.G
                k, v = self.tail_rows(l, [(a, a + self.G)] if kept > a else [])
                self.n_tail[l], self.n_win[l] = a, kept - a
                self.win_k[l, :, :kept - a] = k[:, :kept - a]
                self.win_v[l, :, :kept - a] = v[:, :kept - a]
        self.seq_len = kept
        return kept

    # -- prefix reuse ------------------------------------------------------------------------------
    def canonical_tail(self, s: int) -> int:
        """Tokens a fresh prefill of s tokens holds compressed: flushes keep the window at
        R .. R+G-1 tokens, whatever the chunking (every chunk attends, then appends); none
        when the tail is lossless."""
        return 0 if self.lossless else max(0, s - self.R) // self.G * self.G

    def n_compressed(self) -> int:
        return 0 if self.lossless else max(self.n_tail)

    def resume_point(self, n: int, chunk: int) -> int:
        """The most tokens m <= n to keep so that prefilling the rest in chunks aligned to
        multiples of `chunk` gives what a fresh prefill of the whole prompt gives: the
        chunk holding position m must see the tail a fresh prefill shows it (the
        canonical tail at the chunk's start), and tokens [tail, m) in the full-precision
        window. Tokens already compressed cannot come back to full precision, so a longer
        match is cut back, often to 0 (a full prefill). Evicting arenas return 0: their
        policy's scores depend on the whole history. A lossless tail keeps all n."""
        if self.ev is not None:
            return 0
        if self.lossless:
            return min(n, self.seq_len)
        nt = max(self.n_tail)
        if nt != min(self.n_tail):
            return 0                                      # an interrupted forward
        m = min(n, self.seq_len)
        while m >= nt and m > 0:
            start = m // chunk * chunk                    # the aligned chunk holding m
            if self.canonical_tail(start) == nt:
                return m
            m = start - 1 if self.canonical_tail(start) > nt else -1
        return 0

    @property
    def can_shift(self) -> bool:
        """Whether a full context shifts (llama.cpp's context shift) instead of erroring."""
        return self.kv.context.on_full == "shift"

    def shift_keep(self) -> int:
        """The most tokens a shift keeps at the start: the sinks, rounded up to a tail block
        once they are in the tail (shift_plan); a block that would fill the context means
        they never reach the tail, and they stay as given."""
        a = -(-self.kv.context.n_keep // self.G) * self.G
        return a if a < self.max_ctx else self.kv.context.n_keep

    def reset(self) -> None:
        self.n_tail = [0] * self.L
        self.n_win = [0] * self.L
        self.seq_len = 0
        if self.ev:
            self.ev.reset()

    def end_prompt(self) -> None:
        if self.ev:
            self.ev.end_prompt()

    def nbytes(self) -> dict[str, int]:
        """Exact bytes of every allocated tensor, by component."""
        out = dict.fromkeys(COMPONENTS, 0)
        for codecs, stores in ((self.k_codecs, self.k_store), (self.v_codecs, self.v_store)):
            for c, st, S in zip(codecs, stores, self.S_l):
                for s in c.slots(self.Hkv, self.D, S):
                    out[s.component] += st[s.name].nbytes
        out["window"] += self.win_k.nbytes + self.win_v.nbytes
        return out

    def label(self) -> str:
        return self.kv.label()

    def snapshot(self) -> Snapshot:
        return arena_snapshot(self)

    def restore(self, snap: Snapshot) -> None:
        arena_restore(self, snap)

    def report(self) -> list[str]:
        out = self.route_report()
        if self.ev is None:
            return out
        kept = [nt + w for nt, w in zip(self.n_tail, self.n_win)]
        return out + [f"  eviction: {self.kv.eviction.policy}, budget {self.kv.eviction.budget} tokens/layer, "
                      f"holding {min(kept)}-{max(kept)} per layer, {sum(self.ev.n_drop)} evicted in all"]

    def route_report(self) -> list[str]:
        """A line naming the layers whose attention the backend has no kernel for (they run
        torch's, slower), resolved when the cache was built; none when every layer has one."""
        slow = [l for l, r in enumerate(self.routes) if r.attention == "torch"]
        if self.backend == "torch" or not slow:
            return []
        r = self.routes[slow[0]]
        return [f"  kernels: {len(slow)} of {self.L} layers attend on torch (no {self.backend} kernel "
                f"for {self.k_codecs[slow[0]].method}/{self.v_codecs[slow[0]].method} at head dim {self.D}, "
                f"group {self.G}); e.g. layer {slow[0]}: {r.describe()}"]

    # -- window → tail ---------------------------------------------------------------------------
    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v: (Hkv, T, D) (window dtype) to layer l, flushing whole blocks of G."""
        w, T = self.n_win[l], k.shape[1]
        if w + T <= self.win_k.shape[2]:
            self.win_k[l, :, w:w + T] = k
            self.win_v[l, :, w:w + T] = v
            return self.wrote(l, T)
        seq_k = torch.cat([self.win_k[l, :, :w], k], 1)                 # (Hkv, w+T, D), transient
        seq_v = torch.cat([self.win_v[l, :, :w], v], 1)
        self._pack(l, seq_k, seq_v, flush_count(w, T, self.R, self.G))

    def wrote(self, l: int, T: int) -> None:
        """T new rows were written into layer l's window slots [n_win, n_win + T) (by
        `append` or a kernel): count them and flush."""
        self.n_win[l] += T
        self.flush(l)

    def settled_window(self, n: int) -> bool:
        """Whether a window of n tokens is one the arena leaves after every operation: it
        fits the slots and a flush would not touch it (a restored snapshot must hold one)."""
        return n <= self.win_k.shape[2] and not flush_count(n, 0, self.R, self.G)

    def flush(self, l: int) -> None:
        """Pack the oldest whole G-blocks of layer l's window until it holds R .. R+G-1."""
        f = flush_count(self.n_win[l], 0, self.R, self.G)
        if f:
            w = self.n_win[l]
            self._pack(l, self.win_k[l, :, :w], self.win_v[l, :, :w], f)

    def _pack(self, l: int, seq_k: torch.Tensor, seq_v: torch.Tensor, f: int) -> None:
        """seq_k, seq_v (Hkv, n, D): layer l's window tokens followed by new ones. The first
        f go to the tail (whole blocks; with eviction the policy makes room first and says
        how many tail tokens remain), the rest to the window."""
        nt, n = self.n_tail[l], seq_k.shape[1]
        assert n - f <= self.win_k.shape[2], (f, n)
        if self.ev is not None and f:
            nt_after = self.ev.flush(l, seq_k[:, :f], seq_v[:, :f])
        else:
            assert nt + f <= self.S_l[l], (nt, f, self.S_l[l])
            self.pack_tail(l, seq_k[:, :f], seq_v[:, :f], nt)
            nt_after = nt + f
        # the kept tokens move to the front (a copy: seq may be the window itself)
        self.win_k[l, :, :n - f] = seq_k[:, f:].clone()
        self.win_v[l, :, :n - f] = seq_v[:, f:].clone()
        self.n_tail[l], self.n_win[l] = nt_after, n - f

    # -- the tail as the eviction policy sees it (arena_evict.ArenaEviction) ----------------------
    def pack_tail(self, l: int, k: torch.Tensor, v: torch.Tensor, s0: int, head: int | None = None,
                  means=(None, None)) -> None:
        """Pack k, v (Hkv, n, D), n a multiple of G, into layer l's tail slots [s0, s0+n)
        with dispatch.pack on the cache's backend (counts untouched). head: k, v (1, n, D)
        into that KV head's storage only; means: per-token means (n, D) for the K / V codec
        when it stores them (TaDA), else None."""
        kst, vst = self.k_store[l], self.v_store[l]
        if head is not None:
            kst = {name: t[head:head + 1] for name, t in kst.items()}
            vst = {name: t[head:head + 1] for name, t in vst.items()}
        for c0 in range(0, k.shape[1], self.kv.block):
            c1 = min(k.shape[1], c0 + self.kv.block)
            for c, st, x, m, be in ((self.k_codecs[l], kst, k, means[0], self.routes[l].pack[0]),
                                    (self.v_codecs[l], vst, v, means[1], self.routes[l].pack[1])):
                pack(c, st, x[:, c0:c1].float(), s0 + c0, be, mu=None if m is None else m[c0:c1])

    def tail_rows(self, l: int, runs, keys: bool = True,
                  values: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer l's tail tokens in the slot runs [(s0, s1), ...] (whole blocks), dequantized:
        K and V (Hkv, n, D) float32, the runs concatenated in order. keys / values False:
        that side is not decoded (None; the caller holds those rows)."""
        none = self.win_k.new_empty((self.Hkv, 0, self.D), dtype=torch.float32)
        return tuple(torch.cat([c.dequant(st, r0, r1) for r0, r1 in runs] + [none], 1) if want else None
                     for c, st, want in ((self.k_codecs[l], self.k_store[l], keys),
                                         (self.v_codecs[l], self.v_store[l], values)))

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        nt, w = self.n_tail[layer], self.n_win[layer]
        tail = self.tail_rows(layer, [(0, nt)] if nt else [])
        k, v = (torch.cat([t, win[layer][:, :w].float()], 1) for t, win in zip(tail, (self.win_k, self.win_v)))
        rk, rv = self.rot_k[layer], self.rot_v[layer]
        return k if rk is None else unrotate_k(k, rk), v if rv is None else unrotate(v, rv)

    def tail_means(self, l: int, runs) -> list:
        """The stored per-token means (n, D) float32 of the tail slot runs, for the K and V
        codecs that store them (TaDA); None for the others."""
        none = self.win_k.new_empty((0, self.D), dtype=torch.float32)
        return [torch.cat([c.means(st, r0, r1) for r0, r1 in runs] + [none])
                if c.kind == "tada" else None
                for c, st in ((self.k_codecs[l], self.k_store[l]),
                              (self.v_codecs[l], self.v_store[l]))]

    # -- context shift -----------------------------------------------------------------------------
    def shift_plan(self) -> tuple[int, int]:
        """(a, nd): keep tokens [0, a), drop [a, a + nd), keep the rest (re-rotated by -nd)."""
        nk, G, nt = self.kv.context.n_keep, self.G, self.n_tail[0]
        a = -(-nk // G) * G if nk <= nt else nk
        return a, (self.seq_len - a) // 2

    def shift(self) -> int:
        """llama.cpp context shift; returns the number of tokens discarded."""
        a, nd = self.shift_plan()
        if nd < 1:
            raise KvrunError(f"context full: cannot shift (keeping {a} tokens of "
                             f"{self.seq_len}, context {self.max_ctx})")
        ang = -nd * self.inv_freq                                        # (D/2,)
        emb = torch.cat([ang, ang])[None]                                # (1, D)
        cos, sin = emb.cos().float(), emb.sin().float()
        for l in range(self.L):
            shift_layer(self, l, a, nd, cos, sin)
        self.seq_len -= nd
        self.n_shifts += 1
        return nd
