"""The native flushes (kvrun.kernels.native.pack: pack.c, codebook_pack.c) write exactly the
storage the codecs' torch pack writes, bit for bit; GEAR (outliers, low-rank) and fp tails
are not theirs, and a head dim past the kernel's MAX_D is left to torch."""
import pytest
import torch

from kvrun.kernels import make_codec, native
from kvrun.kernels.native.decode_attention import MAX_D
from kvrun.kernels.native.pack import store, supports

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason=f"native kernels unavailable: {native.error()}")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("G,g,D", [(32, 32, 64), (64, 64, 128), (128, 32, 32)])
def test_kivi_pack_bit_identical(bits, G, g, D):
    """The C flush writes exactly what KiviCodec.pack writes (codes, fp16 scales and zeros),
    including a second flush into a half-filled byte block, constant rows (the 1e-6 scale
    floor) and large values (scale nudged up one fp16 ulp)."""
    from kvrun.kernels.codecs.kivi import KiviCodec
    from kvrun.kernels.native.pack import store
    torch.manual_seed(bits * 1000 + G + D)
    for role in ("k",) if bits == 3 else ("k", "v"):   # 3 bits: keys only
        c = KiviCodec(role, G, bits, g)                 # (8 bits: profiles' kivi layers)
        a, b = c.alloc(3, D, 8 * G), c.alloc(3, D, 8 * G)
        for s0, scale in ((0, 1.0), (G, 300.0), (2 * G, 0.0), (5 * G, 1e-3)):
            x = torch.randn(3, G, D) * scale + (7.0 if scale == 0 else 0.0)
            c.pack(a, x, s0)
            assert store(c, b, x, s0)
            for k in a:
                assert torch.equal(a[k], b[k]), (role, s0, k)


@pytest.mark.parametrize("D", [32, 64, 128, 96])
def test_int8_pack_bit_identical(D):
    from kvrun.kernels import make_codec
    from kvrun.kernels.native.pack import store
    torch.manual_seed(D)
    for role in ("k", "v"):
        c = make_codec("int8", role, 32)
        a, b = c.alloc(3, D, 256), c.alloc(3, D, 256)
        for s0, scale in ((0, 1.0), (32, 300.0), (64, 0.0), (160, 1e-3)):
            x = torch.randn(3, 32, D) * scale
            c.pack(a, x, s0)
            assert store(c, b, x, s0)
            for k in a:
                assert torch.equal(a[k], b[k]), (role, s0, k)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("mu", ["fp16", "int8"])
@pytest.mark.parametrize("G,D,Hkv", [(32, 64, 3), (64, 128, 2), (32, 32, 8)])
def test_tada_pack_bit_identical(bits, mu, G, D, Hkv):
    from kvrun.kernels import make_codec
    from kvrun.kernels.native.pack import store
    torch.manual_seed(bits + G + D + Hkv)
    for role in ("k", "v"):
        c = make_codec(f"tada-{bits}", role, G, tada_mu=mu)
        a, b = c.alloc(Hkv, D, 8 * G), c.alloc(Hkv, D, 8 * G)
        for s0, scale in ((0, 1.0), (G, 300.0), (2 * G, 0.0), (5 * G, 1e-3)):
            x = torch.randn(Hkv, G, D) * scale
            c.pack(a, x, s0)
            assert store(c, b, x, s0)
            for k in a:
                assert torch.equal(a[k], b[k]), (role, s0, k)



def test_supports_the_kinds_the_c_pack_writes():
    got = {m: supports(make_codec(m, "k", 32)) for m in ("kivi-4", "int8", "tada-2", "cb-4",
                                                        "gear", "gear-l", "fp16")}
    assert got == {"kivi-4": True, "int8": True, "tada-2": True, "cb-4": True,
                   "gear": False, "gear-l": False, "fp16": False}


def test_a_head_dim_past_max_d_is_declined():
    c = make_codec("kivi-4", "v", 32)
    D = MAX_D + 64
    st = c.alloc(1, D, 32)
    assert store(c, st, torch.randn(1, 32, D), 0) is False
    assert not any(t.any() for t in st.values())                    # nothing written
