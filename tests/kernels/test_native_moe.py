"""The C descriptor of a sparse MoE MLP (kvrun.kernels.native.moe): every expert's three
weights described in order, the router held as contiguous fp32, each layer's own routing
outputs and the shared scratch pointed to (the MLP's routing and output are tested through
a model: tests/model/test_moe.py)."""
import pytest
import torch

from kvrun.kernels import native
from kvrun.kernels.native.decode_layer import MAX_ROWS
from kvrun.kernels.native.moe import MoePlan, MoeScratch

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")


def _int8(N, K, g):
    return {"kind": "int8", "qweight": torch.randint(-128, 128, (N, K), generator=g).to(torch.int8),
            "scales": torch.rand(N, generator=g) * 0.01}


@pytest.mark.parametrize("integer", [True, False])
def test_plan_describes_every_expert(integer):
    g = torch.Generator().manual_seed(0)
    hidden, inter, E = 64, 96, 3
    experts = [{"gate": _int8(inter, hidden, g), "up": _int8(inter, hidden, g),
                "down": _int8(hidden, inter, g)} for _ in range(E)]
    router = torch.randn(hidden, E, generator=g).bfloat16().T              # strided, bf16
    scratch = MoeScratch(hidden, inter, E)
    plan = MoePlan(router, experts, 2, True, scratch, integer=integer)
    M = plan.desc
    assert (M.E, M.top_k, M.norm_topk, M.inter) == (E, 2, 1, inter)
    assert plan.router.is_contiguous() and torch.equal(plan.router, router.float())
    assert M.router == plan.router.data_ptr()
    assert plan.chosen.shape == (MAX_ROWS, 2) and M.chosen == plan.chosen.data_ptr()
    assert M.probs == scratch.probs.data_ptr() and scratch.probs.shape == (MAX_ROWS, E)
    for name, (N, K) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        descs = getattr(M, name)
        for e in range(E):
            d = descs[e]
            assert (d.N, d.K) == (N, K)
            assert d.q == experts[e][name]["qweight"].data_ptr()
            assert bool(d.rp) == integer                 # the integer path's repacked copy

