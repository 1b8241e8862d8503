"""The one-call decode step's per-cache plan (kvrun.kernels.native.decode_step): `row_plan`
builds a row for layers the native kernels cover and declines (None, the per-layer route
keeps the cache) for a tail of blocks that are not whole 32-token tiles or a layer it does
not cover; a row's lengths set the tokens the step attends (the step's bits: tests/model/
test_native_rows.py)."""
import pytest
import torch

from kvrun.kernels import make_codec, native
from kvrun.kernels.native.decode_attention import MAX_D
from kvrun.kernels.native.decode_step import layer_args, row_plan, splits_max

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")
H, Hkv = 4, 2


def _layer(method="kivi-4", D=64, wdt=torch.float16):
    """(k_tail, v_tail, k_win, v_win, rot_k, rot_v) of one arena layer."""
    kc, vc = make_codec(method, "k", 32), make_codec(method, "v", 32)
    win = [torch.zeros(Hkv, 32, D, dtype=wdt) for _ in range(2)]
    return (kc, kc.alloc(Hkv, D, 64)), (vc, vc.alloc(Hkv, D, 64)), *win, None, None


def test_a_row_of_covered_layers_and_its_lengths():
    plan = row_plan(H, 32, [_layer(), _layer("int8")])
    assert plan is not None and list(plan.ring) == [0, 0]
    assert plan.lengths([64, 32], [5, 7]) is plan
    assert list(plan.n_tail) == [64, 32] and list(plan.n_win) == [5, 7]
    assert plan.keys == 64 + 5 + 1                      # the most a layer attends, new token too
    assert plan.lengths([0, 0], [0, 0], slot=3, n=9).keys == 9
    assert (plan.row.ring_slot, plan.row.ring_n) == (3, 9)


def test_what_the_kernels_do_not_cover_is_declined():
    assert row_plan(H, 48, [_layer()]) is None                        # 48-token blocks
    assert row_plan(H, 32, [_layer(), _layer(D=MAX_D + 64)]) is None  # one layer too wide
    assert layer_args(H, *_layer(wdt=torch.float64)) is None         # no fp64 window
    assert layer_args(H, *_layer()) is not None


def test_splits_max_is_the_larger_kernels():
    lib = native.load()
    assert splits_max() >= lib.kvrun_ring_splits_max() > 0
