"""KIVI (kvrun.kernels.codecs.kivi): K per (token group, channel) and V per (token, channel
group) stay within half a quantization step, 3-bit keys split their planes, and the 8-bit
width (no method name: profiles' kivi layers) packs like the others."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.codecs import make_codec
from kvrun.kernels.codecs.kivi import KiviCodec
from test_codecs import D, G, Hkv, _packed


@pytest.mark.parametrize("method,role", [(m, r) for m in ("kivi-2", "kivi-4") for r in "kv"]
                         + [("kivi-3", "k")])
def test_kivi_error_within_bound(method, role):
    c, st, x, _ = _packed(method, role)
    xh = c.dequant(st, 32, 128)
    if role == "k":                                                   # per (group, channel)
        s = st["scale"][:, 1:4].float().repeat_interleave(G, 1)      # (Hkv, n, D)
    else:                                                             # per (token, channel group)
        s = st["scale"][:, 32:128].float().repeat_interleave(c.g, 2)
    assert ((x - xh).abs() <= s / 2 * 1.001 + 1e-3).all()


def test_three_bit_keys_use_every_code_and_split_their_planes():
    """kivi-3 keys: all 8 levels occur, the 2-bit planes hold code & 3 and the 1-bit planes
    code >> 2 (chanpack's order), and a value role is refused (no value layout)."""
    from kvrun.kernels import chanpack
    c, st, x, _ = _packed("kivi-3", "k")
    codes = c.dequant(st, 32, 128).sub(st["zero"][:, 1:4].float().repeat_interleave(G, 1))
    codes = torch.round(codes / st["scale"][:, 1:4].float().repeat_interleave(G, 1))
    assert set(codes.unique().tolist()) == set(range(8))
    assert torch.equal(chanpack.codes(st["codes"], 32, 128, 2), codes.remainder(4))
    assert torch.equal(chanpack.codes(st["hi"], 32, 128, 1), codes.div(4, rounding_mode="floor"))
    with pytest.raises(ValueError, match="key codec"):
        make_codec("kivi-3", "v", G)



@pytest.mark.parametrize("role", ["k", "v"])
def test_eight_bit_kivi_within_bound(role):
    torch.manual_seed(0)
    c = KiviCodec(role, G, 8, 32)
    st = c.alloc(Hkv, D, 64)
    x = torch.randn(Hkv, 64, D) * 2
    rec = c.pack(st, x, 0)
    assert_close(c.dequant(st, 0, 64), rec, atol=1e-3, rtol=1e-3)
    axis = 1 if role == "k" else 2                                # token groups / channel groups
    s = st["scale"].float().repeat_interleave(G if role == "k" else 32, axis)
    assert ((x - rec).abs() <= s / 2 * 1.001 + 1e-3).all()
    assert (x - rec).abs().max() < 4 * 2 / 255 * 4                 # far finer than 2 or 4 bits
