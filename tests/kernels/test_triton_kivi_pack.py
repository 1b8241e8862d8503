"""kivi_pack (kvrun.kernels.triton.kivi_pack), the Triton compress kernel, under Triton's CPU
interpreter: bit-identical to KiviCodec.pack (codes, fp16 scales and zeros) for K and V at
2 and 4 bits, flushes into half-filled blocks and exact .5 ties included; what it does not
pack is refused."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402

pytest.importorskip("triton")

from kvrun.kernels import make_codec                                     # noqa: E402
from kvrun.kernels.triton.kivi_pack import kivi_pack                     # noqa: E402

G = 32


def _pack_both(role, bits, D, G, s0, n, ties=False, v_group=32):
    from kvrun.kernels.triton.kivi_pack import kivi_pack
    torch.manual_seed(s0 + n + D + bits)
    c = make_codec(f"kivi-{bits}", role, G, v_group=v_group)
    ref, out = c.alloc(2, D, 512), c.alloc(2, D, 512)
    if s0:          # earlier tokens: a flush half-filling a storage block must keep them
        pre = torch.randn(2, s0, D).half().float()
        c.pack(ref, pre, 0)
        c.pack(out, pre, 0)
    if ties:        # values on a 0.25 grid with group range [0, 7.5]: exact .5 ties to round
        x = torch.randint(0, 31, (2, n, D)).float() * 0.25
        x[:, ::G], x[:, 1::G] = 0.0, 7.5                  # every K group (per channel)
        x[..., ::v_group], x[..., 1::v_group] = 0.0, 7.5  # every V group (per token)
    else:           # the arena packs fp16 window values
        x = (torch.randn(2, n, D) * 3).half().float()
    c.pack(ref, x, s0)
    kivi_pack(c, out, x, s0)
    return ref, out


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("D,G,s0,n,ties", [(64, 32, 0, 32, False), (64, 32, 32, 96, True),
                                           (96, 32, 96, 64, False), (128, 64, 64, 128, False)])
def test_kivi_pack_is_bit_identical(role, bits, D, G, s0, n, ties):
    ref, out = _pack_both(role, bits, D, G, s0, n, ties)
    for name in ref:
        assert torch.equal(out[name], ref[name]), name
    assert ref["codes"].any()


def test_kivi_pack_refuses_what_it_does_not_pack():
    from kvrun.kernels.triton.kivi_pack import kivi_pack
    c = make_codec("kivi-4", "k", G)
    with pytest.raises(ValueError, match="multiples of G"):
        kivi_pack(c, c.alloc(2, 64, 128), torch.zeros(2, 48, 64), 0)
    g = make_codec("gear", "k", G)
    with pytest.raises(ValueError, match="KIVI codec"):
        kivi_pack(g, g.alloc(2, 64, 128), torch.zeros(2, 32, 64), 0)



def test_supports_two_and_four_bit_kivi_with_whole_32_token_groups():
    from kvrun.kernels.triton.kivi_pack import supports
    got = {m: supports(make_codec(m, "k", G)) for m in ("kivi-2", "kivi-4", "kivi-3", "gear",
                                                       "int8", "tada-4")}
    assert got == {"kivi-2": True, "kivi-4": True, "kivi-3": False, "gear": False,
                   "int8": False, "tada-4": False}
    assert not supports(make_codec("kivi-4", "k", 16))


def test_a_head_dim_off_the_value_group_is_refused():
    c = make_codec("kivi-4", "v", G, v_group=64)
    with pytest.raises(ValueError, match="D=96 is not a multiple of the V group 64"):
        kivi_pack(c, c.alloc(1, 96, 64), torch.zeros(1, 32, 96), 0)
