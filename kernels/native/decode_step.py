"""The whole decode step of B rows in one native call (decode_layer.c `kvrun_decode_step`):
per layer the dense part before attention (`kvrun_layer_pre`), each row's attention on
its own cache — an arena layer's with the new K/V written into its window, a sliding ring
layer's (Gemma 3) with them written into its ring slot — the dense part after it
(`kvrun_layer_post`), then the final norm and lm_head (`kvrun_logits`).

Why: the per-layer route crosses from Python to C 2 + B times a layer (pre, each row's
attention, post) and rebinds the attention's arguments each time, which at depth 0 costs
a sizeable share of a small model's step (docs/measurements-archive.md, "The whole decode
step in one native call"). Here the per-row, per-layer arguments are built once per cache
(`RowPlan`, from decode_attention.py `step_args`, as its FusedStep builds them, and
ring_attention.py `step_args`) and a step sets only the lengths (and a ring's slot), a
slice assignment per row.

Same calls in the same order with the same arguments as the per-layer route, so the same
bits (tests/model/test_native_rows.py). The window count advance and the flushes stay with the
cache, after the call: a layer's flush touches only that layer, which this step has
finished with. A layer whose attention decode_attention.c or ring_attention.c does not
cover (every codec kernels/table.py lists for it, in the shapes it takes) makes `row_plan`
None, and the caller keeps the per-layer route for that cache.
"""
from __future__ import annotations

import ctypes
import operator

import torch

from . import load
from .decode_attention import MAX_D, TILE, _FP, _descriptors, _splits_max, bind_mass, step_args
from .decode_layer import MAX_ROWS, LayerDesc, WeightDesc
from .ring_attention import step_args as ring_step_args
from .structs import RowCache, StepDesc  # noqa: F401  (the C structs, mirrored in one place)

_p = ctypes.c_void_p
_i32 = ctypes.c_int32




def layer_args(H: int, k_tail, v_tail, k_win: torch.Tensor, v_win: torch.Tensor, rot_k, rot_v,
               attn: str = "int", softcap: float = 0.0):
    """(prebuilt arguments, tail descriptors) of one arena layer's one-token step, or None
    when decode_attention.c does not cover it: k_tail / v_tail (codec, storage), k_win /
    v_win (Hkv, cap, D) the layer's window, rot_k / rot_v (D, D) float32 or None, attn the
    kernel's q.K path ("int" or "fp32", decode_attention.py's), softcap its logits' soft-cap
    (0: off). The
    descriptors stay valid while the storage lives; at n_tail == 0 the kernel does not
    read them."""
    D = k_win.shape[2]
    if load() is None or D > MAX_D or k_win.dtype not in _FP or k_win.stride(2) != 1:
        return None
    desc = _descriptors(torch.empty(1, H, 1, D), k_tail, v_tail, TILE)   # a step's q shape
    if desc is None:
        return None
    a = step_args(H, k_win, v_win, rot_k, rot_v, attn, softcap)
    a.qdtype = a.ndtype = _FP[torch.float32]            # q and the new rows: the layer scratch
    a.qs[0], a.kns[0], a.vns[0] = D, D, D               # (H, D) / (Hkv, D) rows; Tq = Tn = 1
    a.kc, a.vc = ctypes.pointer(desc[0]), ctypes.pointer(desc[1])
    return a, desc


class RowPlan:
    """One cache's layers as a row of the one-call step: their prebuilt arguments and this
    step's lengths (`lengths`). Holds pointers into the cache's windows, rings and storage:
    its owner (the cache) keeps it, and those tensors, alive."""

    def __init__(self, layers: list, ring: list | None = None):
        """layers: per layer (arguments, what they point into) — `layer_args` of an arena
        layer, a RingArgs of ring_attention.py `step_args` where ring[l] is true."""
        L = len(layers)
        self.keep = layers
        self.args = (_p * L)(*[ctypes.addressof(a) for a, _ in layers])
        self.n_tail, self.n_win = (_i32 * L)(), (_i32 * L)()
        self.ring = (ctypes.c_uint8 * L)(*[1 if x else 0 for x in (ring or [0] * L)])
        self.keys = 1
        self.row = RowCache(self.args, self.n_tail, self.n_win, self.ring, 0, 0)

    def lengths(self, n_tail: list, n_win: list, slot: int = 0, n: int = 0) -> RowPlan:
        """Set this step's per-layer tail and window token counts (before the new token;
        0 for ring layers) and the ring layers' slot for the new token and filled-slot
        count n (with it)."""
        self.n_tail[:] = n_tail
        self.n_win[:] = n_win
        self.row.ring_slot, self.row.ring_n = slot, n
        self.keys = max(max(map(operator.add, n_tail, n_win)) + 1, n)   # the most a layer attends
        return self

    def mass(self, l: int, mass, lo: int = 0) -> None:
        """Layer l's attention mass for this step: the kernel adds the query heads'
        probabilities of every key from `lo` on into mass (H, keys) float32, as
        decode_attention's `mass` (an evicting arena's scores); None: none."""
        bind_mass(self.keep[l][0], mass, lo)


def splits_max() -> int:
    """The most token splits the arena kernels cut a tail into, or the ring kernel a ring
    (the partial outputs' scratch)."""
    return max(_splits_max(load()), load().kvrun_ring_splits_max())


def row_plan(H: int, group: int, layers: list, attn: str = "int",
             ring: tuple | None = None, softcap: float = 0.0) -> RowPlan | None:
    """dispatch.step_row on the native kernels: a RowPlan of `layers` (per layer the
    arguments of `layer_args`, or None for a sliding ring layer: the j-th None is ring layer
    j of `ring`, the arguments of ring_attention.py `step_args` after H), or None when a
    tail of `group`-token blocks may not be whole kernel tiles or some layer is not
    covered; attn and the arena layers' softcap as `layer_args`' (the ring's is in `ring`)."""
    arena = [x for x in layers if x is not None]
    if arena and group % TILE:
        return None
    rings = iter(())
    if len(arena) < len(layers):
        built = ring_step_args(H, *ring) if ring is not None else None
        if built is None:
            return None
        rings = iter([(a, built[1]) for a in built[0]])
    args = [layer_args(H, *x, attn=attn, softcap=softcap) if x is not None else next(rings)
            for x in layers]
    if any(a is None for a in args):
        return None
    return RowPlan(args, [x is None for x in layers])


class DecodeStep:
    """The one-call step over a model's layers: `plans` the decode_layer.py LayerPlans (their
    scratch shared), `local` which layers take the sliding RoPE tables, `norm` (hidden,)
    the final norm's weight, `head` lm_head's WeightDesc."""

    def __init__(self, plans: list, local: list, norm: torch.Tensor, head: WeightDesc, splits: int):
        L = len(plans)
        s = self.scratch = plans[0].scratch
        d = plans[0].desc
        self.H, self.D, self.head = d.H, d.D, head
        self.keep = [plans, norm]
        self.local = torch.tensor([1 if x else 0 for x in local], dtype=torch.uint8)
        self.attn = torch.zeros(MAX_ROWS, d.H * d.D)                    # (B, H D)
        # the rows' attention scratch, one block per row (they run at once): q (H, D), the
        # partial outputs (splits, H, D), the logits (H, keys) sized per step
        self.qs, self.part = torch.zeros(MAX_ROWS, d.H * d.D), torch.zeros(MAX_ROWS, d.H * splits * d.D)
        self.sc = torch.zeros(0)
        self.rows = (ctypes.POINTER(RowCache) * MAX_ROWS)()
        st = self.st = StepDesc()
        st.n_layers = L
        self.layers = (ctypes.POINTER(LayerDesc) * L)(*[ctypes.pointer(p.desc) for p in plans])
        st.layers, st.local = self.layers, self.local.data_ptr()
        st.cos, st.sin = s.cos.data_ptr(), s.sin.data_ptr()
        st.cos_local, st.sin_local = s.cos_local.data_ptr(), s.sin_local.data_ptr()
        st.rows, st.attn, st.qs, st.part = self.rows, self.attn.data_ptr(), self.qs.data_ptr(), self.part.data_ptr()
        st.qs_row, st.part_row = self.qs.shape[1], self.part.shape[1]
        st.norm, st.head, st.logits = norm.data_ptr(), ctypes.pointer(head), s.logits.data_ptr()
        self.lib = plans[0].lib                # the build the layer plans call

    def __call__(self, rows: list, nthreads: int) -> torch.Tensor:
        """rows: B RowPlans, lengths set. Reads scratch.x, cos / sin (B rows, set by the
        caller), runs every layer and returns the (B, V) float32 logits, a view of the
        scratch."""
        B = len(rows)
        assert 1 <= B <= MAX_ROWS, B
        need = self.H * max(r.keys for r in rows)       # floats per row
        row = self.st.sc_row if self.st.sc_row >= need else max(need, self.st.sc_row * 3 // 2)
        if row != self.st.sc_row or self.sc.numel() < B * row:     # grown, never shrunk
            self.sc = torch.zeros(max(B * row, self.sc.numel()))
            self.st.sc, self.st.sc_row = self.sc.data_ptr(), row
        for b, r in enumerate(rows):
            self.rows[b] = ctypes.pointer(r.row)
        self.st.nthreads = nthreads
        rc = self.lib.kvrun_decode_step(ctypes.byref(self.st), B)
        assert rc == 0, f"native decode step refused its arguments ({rc})"
        return self.scratch.logits[:B, :self.head.N]
