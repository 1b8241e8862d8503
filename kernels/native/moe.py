"""The C descriptor of a Qwen3-MoE layer's sparse MLP (args.h `Moe`, run by decode_layer.c
`moe_mlp` inside `kvrun_layer_post`): the fp32 router, every expert's three weights in
`weight_desc` form, and the scratch the routing and the gathered rows use.

`MoeScratch` (the gathered rows, their SwiGLU and down outputs, each row's weighted sum,
the router's probabilities) is shared by every MoE layer of a model; each `MoePlan` keeps
its own `chosen` / `weight` outputs, so after a step each layer tells which experts each
row took (tests/model/test_moe.py reads them).
"""
from __future__ import annotations

import ctypes

import torch

from .decode_layer import MAX_ROWS, weight_desc
from .structs import MoeDesc, WeightDesc


class MoeScratch:
    """(MAX_ROWS, ...) float32 buffers every MoE layer of a model shares."""

    def __init__(self, hidden: int, inter: int, n_experts: int):
        z = lambda n: torch.zeros(MAX_ROWS, n)                              # noqa: E731
        self.probs, self.xg, self.hg, self.yg, self.acc = z(n_experts), z(hidden), z(inter), z(hidden), z(hidden)


class MoePlan:
    """One layer's `Moe` descriptor (`desc`), holding every tensor it points to."""

    def __init__(self, router: torch.Tensor, experts: list[dict], top_k: int, norm_topk: bool,
                 scratch: MoeScratch, integer: bool = True):
        """router (E, hidden) float; experts: per expert {"gate", "up", "down"} in
        weight_desc form; integer: the GEMVs' integer path (weight_desc's)."""
        E = router.shape[0]
        assert len(experts) == E and 1 <= top_k <= E, (len(experts), E, top_k)
        self.keep: list = [scratch]
        self.router = router.detach().float().contiguous()                   # (E, hidden)
        self.chosen = torch.zeros(MAX_ROWS, top_k, dtype=torch.int32)        # out, per row
        self.weight = torch.zeros(MAX_ROWS, top_k)
        M = self.desc = MoeDesc()
        M.E, M.top_k, M.norm_topk = E, top_k, int(norm_topk)
        M.inter = experts[0]["gate"]["qweight"].shape[0]
        for name in ("gate", "up", "down"):
            arr = (WeightDesc * E)(*(weight_desc(x[name], self.keep, integer=integer) for x in experts))
            self.keep.append(arr)
            setattr(M, name, ctypes.cast(arr, ctypes.POINTER(WeightDesc)))
        M.router = self.router.data_ptr()
        for name, t in (("probs", scratch.probs), ("chosen", self.chosen), ("weight", self.weight),
                        ("xg", scratch.xg), ("hg", scratch.hg), ("yg", scratch.yg), ("acc", scratch.acc)):
            setattr(M, name, t.data_ptr())
