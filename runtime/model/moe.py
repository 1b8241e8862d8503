"""Qwen3-MoE's sparse MLP block: a router picks each token's top-k experts, each a SwiGLU
MLP, and their outputs are summed weighted by the router's probabilities (Shazeer et al.
2017, "Outrageously Large Neural Networks"; Qwen3 technical report).

The order of operations is transformers' Qwen3MoeSparseMoeBlock's, so the eager forward
matches it to fp32 rounding:
  router logits = x Wᵍᵀ (E,) in the compute dtype → softmax in fp32 → top-k probabilities
  (renormalized to sum 1 when `norm_topk_prob`) → cast to the compute dtype; then per
  expert in ascending index order, its chosen rows' SwiGLU output times their weight is
  added into a zero-initialized sum, which the decoder layer adds to the residual.

Module names follow HF's original checkpoint layout (`mlp.gate` the router,
`mlp.experts.N.gate_proj` …), which transformers 5 still writes, so each expert is a plain
`MLP` whose projections quantize like every other linear (`make_linear`). The router stays
float in every weight format: it is E rows (a fraction of a percent of the layer's bytes),
and an error there moves the discrete top-k choice, which costs more than any rounding of
an expert's weights (llama.cpp keeps ffn_gate_inp in F32 for the same reason).

The native decode step runs the same block in C (kernels/native/decode_layer.c
`moe_mlp`), reading only the chosen experts' weights.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import MLP, Linear
from .qlinear import make_linear


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) in the logits' dtype, expert ids (N, k)):
    softmax in fp32, the k largest, renormalized to sum 1 when `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), chosen


class SparseMoeBlock(nn.Module):
    """x (..., hidden) -> the weighted sum of each token's top-k experts' SwiGLU outputs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)        # the router: float (docstring)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size,
                lambda i, o: make_linear(cfg.weights, cfg.weight_group, i, o))
            for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])                                  # (N, hidden)
        weights, chosen = route(self.gate(x2), self.top_k, self.norm_topk_prob)  # (N, k) each
        out = torch.zeros_like(x2)
        for e in torch.unique(chosen).tolist():                          # ascending, as HF sums
            rows, slot = torch.where(chosen == e)
            y = self.experts[e](x2[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out.view(x.shape)
