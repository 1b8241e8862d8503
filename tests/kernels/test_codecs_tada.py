"""TaDA (kvrun.kernels.codecs.tada): the per-(head, token) deviations stay within half a step,
the stored means are the heads' mean, and re-packing a reconstruction with its own means
gives back the same codes (token eviction's compaction does not drift)."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels.codecs.tada import TadaCodec
from test_codecs import D, G, Hkv, _packed


@pytest.mark.parametrize("method", ["tada-2", "tada-4", "tada-8"])
@pytest.mark.parametrize("mu", ["fp16", "int8"])
def test_tada_error_within_bound(method, mu):
    c, st, x, _ = _packed(method, "k", tada_mu=mu)
    xh = c.dequant(st, 32, 128)
    s = st["scale"][:, 32:128, None].float()                          # per (head, token)
    assert ((x - xh).abs() <= s / 2 * 1.001 + 2e-3).all()



def test_fp16_means_are_the_heads_mean():
    torch.manual_seed(0)
    c = TadaCodec("k", G, 4)
    st = c.alloc(Hkv, D, 96)
    x = torch.randn(Hkv, 64, D)
    c.pack(st, x, 32)
    assert torch.equal(c.means(st, 32, 96), x.mean(0).half().float())


@pytest.mark.parametrize("mu", ["fp16", "int8"])
def test_repacking_with_the_stored_means_keeps_the_codes(mu):
    torch.manual_seed(1)
    c = TadaCodec("v", G, 2, mu)
    a, b = c.alloc(Hkv, D, 64), c.alloc(Hkv, D, 64)
    rec = c.pack(a, torch.randn(Hkv, 64, D) * 3, 0)
    rec2 = c.pack(b, rec, 0, mu=c.means(a, 0, 64))
    assert torch.equal(a["codes"], b["codes"])
    assert_close(rec2, rec, atol=1e-4, rtol=0)
