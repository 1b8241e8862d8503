"""Register-level dequantization (kvrun.kernels.triton.dequant `dequant_tile`), under Triton's
CPU interpreter: a tile of every packed format, K and V orientation, read back to the values
the codec's own `dequant` defines (the attention kernel's tests check it only through
attention outputs)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402
from torch.testing import assert_close                                    # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl                                              # noqa: E402

from kvrun.kernels import make_codec                                     # noqa: E402
from kvrun.kernels.triton.decode_attention import _codec_args            # noqa: E402
from kvrun.kernels.triton.dequant import dequant_tile                    # noqa: E402

pytestmark = pytest.mark.interpret
Hkv, D, N = 2, 64, 64


@triton.jit
def _tile_kernel(X, SC, ZP, MU, MUS, LA, LB, OI, OV, s_h, s_p, s_b, sc_h, G, VG, la_h, lb_h, o_h,
                 OUT, n, D, KIND: tl.constexpr, BITS: tl.constexpr, CHAN: tl.constexpr,
                 MU8: tl.constexpr, RANK: tl.constexpr, K2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    t = tl.arange(0, BLOCK_N)[:, None]                         # (N, 1) tail tokens
    d = tl.arange(0, BLOCK_D)[None, :]                         # (1, BD) channels
    tmask = t < n
    mask = tmask & (d < D)
    x = dequant_tile(X, SC, ZP, MU, MUS, LA, LB, OI, OV, s_h, s_p, s_b, sc_h, G, VG, la_h, lb_h,
                     o_h, h, t, d, tmask, mask, D, KIND, BITS, CHAN, MU8, RANK, K2)
    tl.store(OUT + h * n * D + t * D + d, x, mask=mask)       # (Hkv, n, D)


@pytest.mark.parametrize("method,role", [("fp16", "k"), ("int8", "k"), ("int8", "v"),
                                         ("kivi-2", "k"), ("kivi-3", "k"), ("kivi-4", "v"),
                                         ("tada-4", "k"), ("tada-2", "v"), ("gear", "k"),
                                         ("gear-l-2", "v")])
def test_tile_equals_the_codecs_dequant(method, role):
    torch.manual_seed(0)
    c = make_codec(method, role, 32, tada_mu="int8")
    st = c.alloc(Hkv, D, N)
    c.pack(st, torch.randn(Hkv, N, D) * 2, 0)
    tensors, ints, (kind, bits, mu8, rank, k2) = _codec_args(c, st, D)
    out = torch.zeros(Hkv, N, D)
    _tile_kernel[(Hkv,)](*tensors, *ints, out, N, D, KIND=kind, BITS=bits, CHAN=role == "v",
                         MU8=mu8, RANK=rank, K2=k2, BLOCK_N=N, BLOCK_D=D)
    assert_close(out, c.dequant(st, 0, N), atol=1e-5, rtol=1e-5)
