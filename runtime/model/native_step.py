"""The decode step on the native CPU kernels: per layer one C call before attention
(RMSNorm, the stacked q/k/v GEMV, RoPE), the attention of each row on its own cache, and
one C call after it (o_proj, residual, RMSNorm, gate+up, SwiGLU, down, residual); then the
final norm and lm_head.

Two routes, one result. When every cache is a row of the one-call step
(native_rows.py `row`: a native-backend cache whose every layer's route is the fused native
kernel, evicting ones included; Gemma's sliding layers a ring_attention.c call), the
whole step over all layers and rows is ONE C call (kernels/native/decode_step.py,
decode_layer.c `kvrun_decode_step`): no Python between layers, and the caches count the
token and flush after it (native_rows.py `stepped`). Otherwise (a cache with a layer routed
to torch, known when the cache is built) the per-layer route: `LayerPlan.pre`, the cache's
`attend` per row (the arena's native attend_append, or a ring's native step),
`LayerPlan.post`. The two make the same kernel calls in the same order with the same
arguments, so their logits and cache bytes are bit-identical
(tests/model/test_native_rows.py); which one runs follows from the caches' routes, never
from a layer's state.

Prefill chunks of 2 to CHUNK_MAX_ROWS tokens of one sequence (`chunk`) take the per-layer
route with the chunk's positions as its rows, MAX_ROWS a pass over the weights, and one
`attend` over the whole chunk per layer (the cache sees the eager forward's steps). There
the eager forward ran torch's weight-only op, which rounds its inputs to bf16 (max KL up
to 0.0018 against the fp32 product of the stored weights on the default model, where these
GEMVs give <= 2e-6: tools/chunk_speed.py --fidelity), or dequantized every layer for each
chunk above 32 rows.

Why: the eager step ran ~1,300 torch ops (casts to and from bf16 around every int4 op,
copies, norms, RoPE, SwiGLU, residual adds) whose dispatch cost more than the weights they
read; the per-layer route still crossed into C 2 + B times a layer. Here the activations
stay fp32 in preallocated buffers and the weights are read in their stored bytes
(kernels/native/decode_layer.c). The eager forward stays the oracle
(tests/model/test_decode_layer.py) and serves everything this step does not cover.

Covered: the Llama/Qwen2/Qwen3/Qwen3-MoE/Granite/SmolLM3 and Gemma 2/3 `Transformer` (Qwen3-MoE's
sparse MLP is the C layer's `moe`: the router, top-k and softmax in C, then only the
experts each row chose, kernels/native/moe.py; Gemma's extra
norms, QK-norm (Qwen3's too), GeGLU, local RoPE tables (SmolLM3's NoPE identity tables in
the same slot), embedding scale and query scale (Granite's attention_multiplier) are the C
layer's optional fields; OLMo 2's missing pre-norms and q/k norms over the whole
projection too) with int4 or int8
linear layers (the weights `kvrun convert --weights int4|int8` writes, the default model's
int4), an int8 lm_head, CPU tensors, the native library built, up to MAX_ROWS rows of one
new token each, and a cache that takes K/V after RoPE (`attend`; a layer whose cache wants
a cache built for another backend keeps the eager forward). The rows are a batch axis:
`__call__` runs one row; `rows` runs row b on its own cache `caches[b]` at that cache's
position (batched decoding, runtime/engine/batch.py): the norms and GEMVs read every
weight once for all rows, RoPE takes each row's position, and attention runs per row on
its own cache through the same kernel call a lone sequence makes, so each row's logits
are bit-identical to that sequence's own step (the C code computes every row
independently). Every C call opens its own OpenMP region from the calling thread (none
nested), on torch.get_num_threads() threads.
"""
from __future__ import annotations

import torch

from kvrun.kernels import dispatch, native
from kvrun.kernels.native.decode_layer import MAX_ROWS, LayerPlan, Scratch, weight_desc
from kvrun.kernels.native.decode_step import DecodeStep, splits_max
from kvrun.kernels.native.moe import MoePlan, MoeScratch
from .. import threads
from . import native_rows
from .layers import final_logits
from .moe import SparseMoeBlock
from .qlinear import Int4Linear, Int8Linear

# Prefill chunks up to this many tokens take the native route (`chunk`), MAX_ROWS rows a
# pass over the weights; longer chunks the eager forward, whose dense GEMM over layers
# dequantized once a chunk catches up with more rows (where, by chunk size:
# docs/measurements.md, tools/chunk_speed.py). 64 keeps a margin for CPUs whose GEMM is
# relatively faster.
CHUNK_MAX_ROWS = 2 * MAX_ROWS
NATIVE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "granite", "olmo2",
                        "smollm3")


def _stored(lin) -> dict:
    """A linear layer's weight in the form weight_desc takes."""
    if isinstance(lin, Int4Linear):
        return {"kind": "int4", "qweight": lin.qweight, "scales": lin.scales, "mins": lin.mins,
                "group": lin.group, "bias": lin.bias}
    return {"kind": "int8", "qweight": lin.qweight, "scales": lin.scales, "bias": lin.bias}


def _stacked(lins) -> dict:
    """q, k, v stacked along the output rows: one GEMV reads them in one pass."""
    ws = [_stored(x) for x in lins]
    out = {"kind": ws[0]["kind"], "group": ws[0].get("group")}
    for key in ("qweight", "scales", "mins"):
        if key in ws[0]:
            out[key] = torch.cat([w[key] for w in ws])
    biases = [w["bias"] for w in ws]
    if any(b is not None for b in biases):
        out["bias"] = torch.cat([b.detach().float() if b is not None else
                                 torch.zeros(w["qweight"].shape[0]) for b, w in zip(biases, ws)])
    return out


def _mlp_linears(mlp) -> list:
    """The MLP's projections: gate, up, down, or every expert's (Qwen3-MoE; not the router,
    which the step reads as fp32)."""
    mlps = mlp.experts if isinstance(mlp, SparseMoeBlock) else [mlp]
    return [x for m in mlps for x in (m.gate_proj, m.up_proj, m.down_proj)]


def _moe_plan(mlp: SparseMoeBlock, scratch: MoeScratch, gemv: str) -> MoePlan:
    experts = [{"gate": _stored(x.gate_proj), "up": _stored(x.up_proj), "down": _stored(x.down_proj)}
               for x in mlp.experts]
    return MoePlan(mlp.gate.weight, experts, mlp.top_k, mlp.norm_topk_prob, scratch,
                   integer=gemv == "int")


def supported(model) -> bool:
    """Whether this step can run `model` (see the module docstring)."""
    if model.cfg.architecture not in NATIVE_ARCHITECTURES:
        return False
    if native.load() is None:
        return False
    cfg = model.cfg
    lins = [m for layer in model.model.layers for m in
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
             layer.self_attn.o_proj, *_mlp_linears(layer.mlp))]
    kinds = {type(m) for m in lins}
    return (len(kinds) == 1 and kinds <= {Int4Linear, Int8Linear}
            and isinstance(model.lm_head, Int8Linear)
            and model.lm_head.qweight.device.type == "cpu"
            and len({getattr(m, "group", 0) for m in lins[:3]}) == 1
            and cfg.hidden_size % 32 == 0 and cfg.intermediate_size % 32 == 0
            and cfg.moe_intermediate_size % 32 == 0
            and cfg.head_dim % 2 == 0 and model.lm_head.bias is None)


class NativeDecodeStep:
    """Decode steps of `model` through the native layer kernels; build with `supported`."""

    def __init__(self, model, gemv: str | None = None):
        """gemv: "int" or "fp32", how the GEMVs multiply (kernels/native/decode_layer.py);
        None reads KVRUN_GEMV (kernels/dispatch.py gemv_path; the model's backend passes
        its own, read once with it)."""
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.gemv = gemv or dispatch.gemv_path()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = (H * D, (H + Hkv) * D)            # q | k | v columns of scratch.qkv
        self.scratch = Scratch(cfg.hidden_size, H, Hkv, D,
                               max(cfg.intermediate_size, cfg.moe_intermediate_size), cfg.vocab_size)
        dims = dict(hidden=cfg.hidden_size, H=H, Hkv=Hkv, D=D, inter=cfg.intermediate_size)
        moe = MoeScratch(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts) if cfg.num_experts else None
        self.plans = []
        gemma = cfg.architecture in ("gemma2", "gemma3")
        for i, layer in enumerate(model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            w = {"qkv": _stacked([a.q_proj, a.k_proj, a.v_proj]), "o": _stored(a.o_proj)}
            # norms as the multipliers the C norm takes (Gemma's 1 + w: norm.multiplier())
            extra = {"q_scale": a.q_scale or 1.0}
            if cfg.is_moe(i):                # Qwen3-MoE: the experts in place of gate / up / down
                extra["moe"] = _moe_plan(mlp, moe, self.gemv)
            else:
                w.update(gate=_stored(mlp.gate_proj), up=_stored(mlp.up_proj), down=_stored(mlp.down_proj))
            if cfg.qk_norm:                  # Qwen3, Gemma 3: per head; OLMo 2: the projection
                extra.update(q_norm=a.q_norm.multiplier(), k_norm=a.k_norm.multiplier(),
                             qk_norm_proj=cfg.qk_norm == "proj")
            if gemma:                   # runtime/model/gemma3.py's sandwich norms and GeGLU
                norms = (layer.input_layernorm.multiplier(), layer.pre_feedforward_layernorm.multiplier())
                extra.update(attn_out_norm=layer.post_attention_layernorm.multiplier(),
                             mlp_out_norm=layer.post_feedforward_layernorm.multiplier(), act="gelu_tanh")
            elif cfg.architecture == "olmo2":   # olmo2.py: post-norms only
                norms = (None, None)
                extra.update(attn_out_norm=layer.post_attention_layernorm.multiplier(),
                             mlp_out_norm=layer.post_feedforward_layernorm.multiplier())
            else:
                norms = (layer.input_layernorm.multiplier(), layer.post_attention_layernorm.multiplier())
            inter = cfg.moe_intermediate_size if cfg.is_moe(i) else cfg.intermediate_size
            self.plans.append(LayerPlan({**dims, "inter": inter}, cfg.rms_norm_eps, *norms, w,
                                        self.scratch, extra, gemv=self.gemv))
        # the layers on the second RoPE tables: Gemma's sliding ones, SmolLM3's NoPE ones
        self.local = [layer.local_rope for layer in model.model.layers]
        self.keep: list = []
        self.head = weight_desc(_stored(model.lm_head), self.keep, integer=self.gemv == "int")
        self.norm = model.model.norm.multiplier().contiguous()
        self.attn = torch.zeros(MAX_ROWS, H * D)          # _layers(): each row's attention output
        # the one-call step; None keeps every step on the per-layer route (the reference
        # tools/step_speed.py times it against)
        self.one_call: DecodeStep | None = DecodeStep(self.plans, self.local, self.norm, self.head,
                                                      splits_max())

    def applies(self, ids: torch.Tensor, cache) -> bool:
        """One token of one sequence (B rows of B sequences: `rows`)."""
        return ids.shape == (1, 1) and ids.device.type == "cpu" and cache.backend == "native"

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """ids (1, 1) -> float32 logits (1, 1, V); appends the token to `cache`."""
        logits = self._run(ids, cache.positions(1), [cache])             # positions (1,)
        cache.commit(1)
        return logits

    @torch.inference_mode()
    def rows(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        """ids (B, 1), row b the next token of the sequence in caches[b] (B <= MAX_ROWS, each
        cache one sequence) -> float32 logits (B, 1, V); appends each token to its cache."""
        B = ids.shape[0]
        assert len(caches) == B <= MAX_ROWS, (len(caches), B)
        threads.tick()                                                   # as forward() does
        positions = torch.cat([c.positions(1) for c in caches])         # (B,)
        logits = self._run(ids, positions, caches)
        for c in caches:
            c.commit(1)
        return logits

    def applies_chunk(self, ids: torch.Tensor, cache) -> bool:
        """A prefill chunk of 2 to CHUNK_MAX_ROWS tokens of one sequence (`chunk`)."""
        T = ids.shape[1]
        return (ids.shape[0] == 1 and 2 <= T <= CHUNK_MAX_ROWS and ids.device.type == "cpu"
                and cache.backend == "native")

    @torch.inference_mode()
    def chunk(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """ids (1, T), 2 <= T <= CHUNK_MAX_ROWS, the next tokens of the sequence in `cache`
        -> float32 logits (1, T, V), or (1, 1, V) for the last position with `last_only`;
        appends the tokens to `cache`. The T positions are GEMV rows of the per-layer route,
        MAX_ROWS at a time (pre and post read each weight once a block, where the eager
        forward dequantizes every layer for a dense GEMM, or rounds its inputs to bf16 for
        torch's weight-only op), and attention is one `attend` over the whole chunk, causal,
        as in the eager forward: the cache sees the same steps."""
        T = ids.shape[1]
        nth = torch.get_num_threads()
        s = self.scratch
        H, Hkv, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q_end, k_end = self.split
        x, tables = self._inputs(ids.view(T, 1), cache.positions(T), cache.max_ctx)  # (T, hidden), rows' RoPE
        blocks = [(b0, min(T, b0 + MAX_ROWS)) for b0 in range(0, T, MAX_ROWS)]
        qkv, out = torch.empty(T, s.qkv.shape[1]), torch.empty(T, H * D)
        q = qkv[:, :q_end].view(T, H, D).transpose(0, 1)[None]          # (1, H, T, D)
        k = qkv[:, q_end:k_end].view(T, Hkv, D).transpose(0, 1)[None]   # (1, Hkv, T, D)
        v = qkv[:, k_end:].view(T, Hkv, D).transpose(0, 1)[None]
        for i, plan in enumerate(self.plans):
            for b0, b1 in blocks:
                n = b1 - b0
                s.x[:n] = x[b0:b1]
                for dst, src in tables:
                    dst[:n] = src[b0:b1]
                plan.pre(n, nth, self.local[i])
                qkv[b0:b1] = s.qkv[:n]
            out.view(T, H, D).copy_(cache.attend(i, q, k, v)[0].transpose(0, 1))
            for b0, b1 in blocks:
                n = b1 - b0
                s.x[:n] = x[b0:b1]
                plan.post(n, out[b0:b1], nth)
                x[b0:b1] = s.x[:n]
        cache.commit(T)
        if last_only:                                    # the last row's logits only
            blocks = [(T - 1, T)]
        logits = []
        for b0, b1 in blocks:
            s.x[:b1 - b0] = x[b0:b1]
            logits.append(self.plans[-1].logits(b1 - b0, self.norm, self.head, nth).clone())
        return self._capped(torch.cat(logits)[None])

    def _inputs(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> tuple[torch.Tensor, list]:
        """Rows for ids (B, 1) at `positions` (B,) in caches of `ctx` tokens (one size, or B:
        Rope.tables): their embeddings (B, hidden) float32 and [(scratch table, the rows'
        table)] RoPE pairs; both also written to the scratch rows when B <= MAX_ROWS."""
        B = ids.shape[0]
        s = self.scratch
        cos, sin = self.model.rope.tables(positions, torch.float32, ctx)    # (B, D)
        tables = [(s.cos, cos), (s.sin, sin)]
        if self.model.rope_local is not None:             # sliding layers' base, or NoPE's identity
            cl, sl = self.model.rope_local.tables(positions, torch.float32)
            tables += [(s.cos_local, cl), (s.sin_local, sl)]
        x = self.model.model.embed_tokens(ids)[:, 0].to(torch.float32, copy=True)   # (B, hidden)
        if self.model.embed_scale is not None:            # Gemma: sqrt(hidden); Granite's multiplier
            x *= torch.tensor(self.model.embed_scale, dtype=torch.float32)
        if B <= MAX_ROWS:
            s.x[:B] = x
            for dst, src in tables:
                dst[:B] = src
        return x, tables

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        return final_logits(logits, self.cfg.logits_scaling, self.cfg.final_logit_softcapping)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, caches: list) -> torch.Tensor:
        """The layers over B rows at `positions` (B,), row b on caches[b]: one native call
        when every cache is a row of it (native_rows.row), else per layer. Returns float32
        logits (B, 1, V)."""
        B = ids.shape[0]
        nth = torch.get_num_threads()
        self._inputs(ids, positions, [c.max_ctx for c in caches])
        rows = [native_rows.row(c, self.cfg.num_heads) for c in caches] if self.one_call else [None]
        if all(r is not None for r in rows):
            logits = self.one_call(rows, nth).clone()[:, None]
            for c in caches:
                native_rows.stepped(c)
        else:
            logits = self._layers(B, caches, nth)
        return self._capped(logits)

    def _layers(self, B: int, caches: list, nth: int) -> torch.Tensor:
        """The per-layer route: pre, each row's `attend` on its cache, post; then the logits
        (B, 1, V)."""
        H, Hkv, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q_end, k_end = self.split
        qkv = self.scratch.qkv[:B]
        q = qkv[:, :q_end].view(B, 1, H, D).transpose(1, 2)              # (B, H, 1, D)
        k = qkv[:, q_end:k_end].view(B, 1, Hkv, D).transpose(1, 2)       # (B, Hkv, 1, D)
        v = qkv[:, k_end:].view(B, 1, Hkv, D).transpose(1, 2)
        out = self.attn[:B]                                              # (B, H D)
        for i, plan in enumerate(self.plans):
            plan.pre(B, nth, self.local[i])
            for b, c in enumerate(caches):
                out[b] = c.attend(i, q[b:b + 1], k[b:b + 1], v[b:b + 1]).reshape(H * D)
            plan.post(B, out, nth)
        return self.plans[-1].logits(B, self.norm, self.head, nth).clone()[:, None]  # (B, 1, V)
