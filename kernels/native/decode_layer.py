"""The dense part of a decoder layer on the native CPU kernel (decode_layer.c): RMSNorm,
the stacked q/k/v GEMV and RoPE before attention; o_proj, residual, RMSNorm, SwiGLU MLP
and residual after it; the final norm and lm_head. Weights are int4 (kvrun's stored
Q4_1-order nibbles) or int8 (per-row scale); activations fp32; B <= MAX_ROWS rows.

The GEMVs run on one of two paths, fixed per `LayerPlan` (`gemv=`; the model's native step
takes `kvrun.kernels.dispatch.gemv_path()`, i.e. `KVRUN_GEMV=int|fp32`, default int):
- "int" (gemv_quant.c, gemv_int.c): each GEMV input row quantized once to int8 blocks of
  QB = 4 columns (one fp32 scale each, and for int4 weights the block sums that fold the min
  term), int32 dot products (AVX512-VNNI, AVX2, or plain C), the scales applied per block in
  fp32: llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 with finer input blocks (its 32 gave ~8x the
  KL divergence). Reads every weight byte once per call, and per weight row the
  quantized input rows (2-3 bytes per column) from cache. `gemv_int_reference` below is its
  torch twin (the same codes, exact integer sums).
- "fp32" (gemv_fp32.c): codes decoded to fp32 and multiplied with the fp32 input, equal to
  the dequantized fp32 GEMV to rounding: the reference the model-level tests compare with
  the eager forward.

`LayerPlan` holds one layer's C descriptor and keeps every tensor it points to alive; the
caller owns the scratch buffers (one set shared by all layers). The torch reference is the
model's own eager forward over the same weights dequantized (tests/test_decode_layer.py).
`gemv` runs one GEMV alone (tests/test_int_gemv.py, tools/gemv_speed.py).
"""
from __future__ import annotations

import ctypes

import torch

from . import load

W_INT4, W_INT8 = 0, 1
MAX_ROWS = 32                    # gemv.h MAXB
GEMV_PATHS = {"int": 1, "fp32": 0}      # decode_layer.c Layer.gemv_int
QB = 4                           # gemv.h QB: columns per activation block
TINY = 1e-30                     # gemv_int.c TINY: a block below it quantizes to zeros

_p = ctypes.c_void_p


class WeightDesc(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
                ("G", ctypes.c_int32), ("q", _p), ("s", _p), ("m", _p), ("scale", _p), ("bias", _p)]


class LayerDesc(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("hidden", "H", "Hkv", "D", "inter", "nthreads")] + [
        ("eps", ctypes.c_float), ("norm1", _p), ("norm2", _p)] + [
        (n, WeightDesc) for n in ("qkv", "o", "gate", "up", "down")] + [
        (n, _p) for n in ("x", "xn", "xsum", "qkv_out", "tmp", "h")] + [
        (n, _p) for n in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")] + [
        ("act", ctypes.c_int32), ("q_scale", ctypes.c_float),
        ("xq", _p), ("ldq", ctypes.c_int64), ("gemv_int", ctypes.c_int32)]


ACTS = {"silu": 0, "gelu_tanh": 1}          # decode_layer.c ACT_*


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qrow_bytes(K: int) -> int:
    """Bytes of one quantized input row of K columns (gemv.h gi_row_bytes)."""
    return 4 * (-(-K // 64) * 64)


def weight_desc(w: dict, keep: list) -> WeightDesc:
    """A C descriptor for one weight in stored form: {"kind": "int4", "qweight", "scales",
    "mins", "group", "bias"} or {"kind": "int8", "qweight", "scales", "bias"}; the tensors
    are made contiguous and appended to `keep` (they must outlive the descriptor)."""
    d = WeightDesc()
    q = w["qweight"].contiguous()
    d.N = q.shape[0]
    bias = w.get("bias")
    bias = None if bias is None else bias.detach().float().contiguous()
    if w["kind"] == "int4":
        s, m = w["scales"].to(torch.float16).contiguous(), w["mins"].to(torch.float16).contiguous()
        d.kind, d.K, d.G = W_INT4, 2 * q.shape[1], w["group"]
        assert d.G % 32 == 0 and d.K % d.G == 0, (d.K, d.G)
        d.q, d.s, d.m = _ptr(q), _ptr(s), _ptr(m)
        keep += [q, s, m]
    else:
        sc = w["scales"].float().contiguous()
        d.kind, d.K, d.G = W_INT8, q.shape[1], 0
        assert q.dtype == torch.int8 and sc.shape == (d.N,)
        d.q, d.scale = _ptr(q), _ptr(sc)
        keep += [q, sc]
    d.bias = _ptr(bias)
    if bias is not None:
        keep.append(bias)
    return d


class Scratch:
    """Buffers every layer shares: (MAX_ROWS, ...) float32, and the quantized GEMV input
    xq (MAX_ROWS, qrow_bytes(widest input)) uint8."""

    def __init__(self, hidden: int, H: int, Hkv: int, D: int, inter: int, vocab: int):
        wide = max(hidden, inter)
        widest = max(wide, H * D)                       # hidden, inter or the attention output
        assert hidden % 32 == 0 and inter % 32 == 0, (hidden, inter)
        z = lambda n: torch.zeros(MAX_ROWS, n)                              # noqa: E731
        self.x, self.xn, self.xsum = z(hidden), z(wide), z(-(-widest // 32))
        self.xq = torch.zeros(MAX_ROWS, qrow_bytes(widest), dtype=torch.uint8)
        self.qkv, self.tmp, self.h = z((H + 2 * Hkv) * D), z(hidden), z(inter)
        self.cos, self.sin = z(D), z(D)
        self.cos_local, self.sin_local = z(D), z(D)    # sliding-window layers' RoPE (Gemma 3)
        self.logits = z(vocab)


class LayerPlan:
    def __init__(self, dims: dict, eps: float, norm1: torch.Tensor, norm2: torch.Tensor,
                 weights: dict, scratch: Scratch, extra: dict | None = None, gemv: str = "int"):
        """dims: hidden, H, Hkv, D, inter; weights: qkv, o, gate, up, down (weight_desc form).
        extra (Gemma 3; decode_layer.c's optional fields): "q_norm", "k_norm" (D,),
        "attn_out_norm", "mlp_out_norm" (hidden,) norm weights as multiplied (1 + w for
        Gemma), "act" ("silu" or "gelu_tanh"), "q_scale". gemv: "int" or "fp32" (the
        module docstring), for every GEMV of this layer and of `logits`."""
        self.keep: list = []
        L = self.desc = LayerDesc()
        for k, v in dims.items():
            setattr(L, k, v)
        L.eps = eps
        n1, n2 = norm1.detach().float().contiguous(), norm2.detach().float().contiguous()
        self.keep += [n1, n2, scratch]
        L.norm1, L.norm2 = _ptr(n1), _ptr(n2)
        extra = extra or {}
        for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
            t = extra.get(name)
            if t is not None:
                t = t.detach().float().contiguous()
                self.keep.append(t)
                setattr(L, name, _ptr(t))
        L.act = ACTS[extra.get("act", "silu")]
        L.q_scale = float(extra.get("q_scale", 1.0))
        for name in ("qkv", "o", "gate", "up", "down"):
            setattr(L, name, weight_desc(weights[name], self.keep))
        for name, t in (("x", scratch.x), ("xn", scratch.xn), ("xsum", scratch.xsum),
                        ("qkv_out", scratch.qkv), ("tmp", scratch.tmp), ("h", scratch.h),
                        ("xq", scratch.xq)):
            setattr(L, name, _ptr(t))
        L.ldq = scratch.xq.stride(0)
        L.gemv_int = GEMV_PATHS[gemv]
        self.scratch = scratch
        self._lib = load()
        assert self._lib is not None, "the native kernels did not build"

    def pre(self, B: int, nthreads: int, local: bool = False) -> None:
        """scratch.x (B, hidden) -> scratch.qkv (B, (H + 2 Hkv) D), q and k roped with
        scratch.cos / scratch.sin (B, D), or cos_local / sin_local for a `local` layer."""
        self.desc.nthreads = nthreads
        s = self.scratch
        cos, sin = (s.cos_local, s.sin_local) if local else (s.cos, s.sin)
        rc = self._lib.kvrun_layer_pre(ctypes.byref(self.desc), B, _p(_ptr(cos)), _p(_ptr(sin)))
        assert rc == 0, rc

    def post(self, B: int, attn: torch.Tensor, nthreads: int) -> None:
        """attn (B, H D) float32 rows (row stride attn.stride(0)) -> scratch.x updated."""
        assert attn.dtype == torch.float32 and attn.stride(1) == 1, (attn.dtype, attn.stride())
        self.desc.nthreads = nthreads
        rc = self._lib.kvrun_layer_post(ctypes.byref(self.desc), B, _p(_ptr(attn)),
                                        ctypes.c_int64(attn.stride(0)))
        assert rc == 0, rc

    def logits(self, B: int, norm: torch.Tensor, head: WeightDesc, nthreads: int) -> torch.Tensor:
        """(B, V) float32 = lm_head(RMSNorm(scratch.x)), a view of the scratch buffer."""
        self.desc.nthreads = nthreads
        rc = self._lib.kvrun_logits(ctypes.byref(self.desc), B, _p(_ptr(norm)), ctypes.byref(head),
                                    _p(_ptr(self.scratch.logits)))
        assert rc == 0, rc
        return self.scratch.logits[:B, :head.N]


def gemv(w: dict, x: torch.Tensor, path: str = "int", nthreads: int = 1, lib=None) -> torch.Tensor:
    """x (B, K) -> (B, N) float32 = x W^T (+ bias): one GEMV through decode_layer.c on
    `path` ("int" or "fp32"), w in weight_desc form, 1 <= B <= MAX_ROWS; `lib` another build
    of the native library (default: load())."""
    keep: list = []
    d = weight_desc(w, keep)
    B, K = x.shape
    assert K == d.K, f"x has {K} columns, the weight {d.K}"
    assert 1 <= B <= MAX_ROWS, f"{B} rows: the kernel takes 1 to {MAX_ROWS}"
    x = x.float().contiguous()
    y = torch.empty(B, d.N)
    xq = torch.empty(B, qrow_bytes(K), dtype=torch.uint8)
    xs = torch.empty(B, max(K // 32, 1))
    rc = (lib or load()).kvrun_gemv(ctypes.byref(d), B, _p(_ptr(x)), ctypes.c_int64(K), _p(_ptr(y)),
                                    _p(_ptr(xq)), ctypes.c_int64(xq.stride(0)), _p(_ptr(xs)),
                                    GEMV_PATHS[path], nthreads)
    assert rc == 0, rc
    return y


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's input quantization (gemv_int.c gi_quantize), in torch: x (B, K) ->
    codes (B, K) int64 in [-127, 127] and scales d (B, ceil(K / QB)) float32. Per block of QB
    columns d = max|x| / 127 and q = round(x * (127 / max|x|)), ties to even as rintf; a
    block whose max|x| is below TINY gets d = 0 and zero codes."""
    B, K = x.shape
    nb = -(-K // QB)
    xb = torch.nn.functional.pad(x.float(), (0, nb * QB - K)).view(B, nb, QB)
    amax = xb.abs().amax(-1)                                           # (B, nb)
    live = amax >= TINY
    inv = torch.where(live, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).view(B, nb * QB)[:, :K]
    return q.long(), torch.where(live, amax / 127.0, torch.zeros_like(amax))


def gemv_int_reference(w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's value in float64: (y, mag), y (B, N) = x W^T on x quantized by
    quantize_input, exact int block sums, then per block s_g d_j (c . q)_j (+ sum_g m_g xs_g
    with xs_g the groups' d_j sum(q)_j) for int4, scale_n sum_j d_j (w . q)_j for int8, plus
    the bias; mag (B, N) the sum of the terms' magnitudes, what fp32 rounding scales with."""
    q, d = quantize_input(x)
    B, K = q.shape
    nb = d.shape[1]
    pad = nb * QB - K
    qb = torch.nn.functional.pad(q, (0, pad)).view(B, nb, QB).double()             # (B, nb, QB)
    if w["kind"] == "int4":
        G, qw = w["group"], w["qweight"]
        N = qw.shape[0]
        v = qw.view(N, K // G, G // 2)
        codes = torch.cat([v & 15, v >> 4], -1).view(N, nb, QB).double()           # (N, nb, QB)
        s = w["scales"].double().repeat_interleave(G // QB, 1)                      # (N, nb)
        isum = torch.einsum("njk,bjk->bnj", codes, qb)                             # (B, N, nb)
        terms = isum * s[None] * d.double()[:, None]
        xs = (d.double() * qb.sum(-1)).view(B, K // G, G // QB).sum(-1)             # (B, K/G)
        mins = w["mins"].double()[None] * xs[:, None]                               # (B, N, K/G)
        y, mag = terms.sum(-1) + mins.sum(-1), terms.abs().sum(-1) + mins.abs().sum(-1)
    else:
        wq = torch.nn.functional.pad(w["qweight"].long(), (0, pad))
        N = wq.shape[0]
        isum = torch.einsum("njk,bjk->bnj", wq.view(N, nb, QB).double(), qb)
        terms = isum * d.double()[:, None] * w["scales"].double()[None, :, None]
        y, mag = terms.sum(-1), terms.abs().sum(-1)
    if w.get("bias") is not None:
        y = y + w["bias"].double()
    return y, mag
