"""The codec base (kvrun.kernels.codecs.base): a slot's bytes are its shape times its dtype,
the fp codecs store rows as given, and symmetric int8 stays within half a step."""
import pytest
import torch

from kvrun.kernels.codecs.base import FpCodec, Int8Codec, Slot
from test_codecs import D, Hkv, _packed


def test_int8_error_within_bound():
    c, st, x, _ = _packed("int8", "v")
    xh = c.dequant(st, 32, 128)
    assert ((x - xh).abs() <= st["scale"][:, 32:128, None].float() / 2 * 1.001 + 1e-4).all()



def test_slot_bytes():
    assert Slot("x", "rows", (2, 5, 3), torch.float16, 1, 1).nbytes == 2 * 5 * 3 * 2
    assert Slot("c", "codes", (4, 7), torch.uint8, 1, 1).nbytes == 28


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 32), (torch.float16, 16),
                                        (torch.bfloat16, 16)])
def test_fp_codec_stores_rows_in_its_dtype(dtype, bits):
    torch.manual_seed(0)
    c = FpCodec("k", 32, dtype)
    assert c.bits == bits and c.kind == "fp"
    st = c.alloc(Hkv, D, 64)
    x = torch.randn(Hkv, 40, D)
    assert torch.equal(c.pack(st, x, 8), x.to(dtype).float())
    assert torch.equal(c.dequant(st, 8, 48), x.to(dtype).float())
    assert not st["x"][:, :8].any() and not st["x"][:, 48:].any()        # nothing else written
    q = torch.randn(Hkv, 3, D)
    assert torch.allclose(c.scores(st, q, 8, 48), q @ x.to(dtype).float().transpose(1, 2),
                          atol=1e-5, rtol=1e-5)


def test_int8_bytes_per_token():
    # per (head, token): D codes + one fp16 scale
    assert sum(Int8Codec("v", 32).bytes_per_token(Hkv, D).values()) == Hkv * (D + 2)
