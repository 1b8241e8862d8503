"""The dense part of a decoder layer on the native CPU kernel (decode_layer.c): RMSNorm,
the stacked q/k/v GEMV and RoPE before attention; o_proj, residual, RMSNorm, SwiGLU MLP
and residual after it; the final norm and lm_head. Weights are int4 (kvrun's stored
Q4_1-order nibbles) or int8 (per-row scale); activations fp32; B <= MAX_ROWS rows.

The GEMVs run on one of two paths, fixed per `LayerPlan` (`gemv=`; the model's native step
takes `kvrun.kernels.dispatch.gemv_path()`, i.e. `KVRUN_GEMV=int|fp32`, default int):
- "int" (gemv_quant.c, gemv_int.c): each GEMV input row quantized once to int16 blocks of
  QB = 32 columns (one fp32 scale each, and for int4 weights the group sums that fold the min
  term); the weights repacked once, here at load (`weight_desc`), 16 rows interleaved so a
  register holds 16 outputs; int32 dot products (AVX512-VNNI vpdpwssd, AVX2 vpmaddwd, or
  plain C, the same bits on each), the scales applied per block in fp32. Reads the repacked
  weight once per call, and per block of 16 rows the quantized input rows from L1.
  gemv_reference.py `gemv_int_reference` is its torch twin (the same codes, exact integer
  sums).
- "fp32" (gemv_fp32.c): codes decoded to fp32 and multiplied with the fp32 input, equal to
  the dequantized fp32 GEMV to rounding: the reference the model-level tests compare with
  the eager forward.

`LayerPlan` holds one layer's C descriptor and keeps every tensor it points to alive; the
caller owns the scratch buffers (one set shared by all layers). The torch reference is the
model's own eager forward over the same weights dequantized (tests/model/test_decode_layer.py).
`gemv` runs one GEMV alone (tests/kernels/test_native_decode_layer_gemv.py, tools/gemv_speed.py).
"""
from __future__ import annotations

import ctypes

import torch

from . import load
from .gemv_reference import QB
from .structs import LayerDesc, WeightDesc  # noqa: F401  (the C structs, mirrored in one place)

W_INT4, W_INT8 = 0, 1
MAX_ROWS = 32                    # gemv.h MAXB
GEMV_PATHS = {"int": 1, "fp32": 0}      # decode_layer.c Layer.gemv_int

_p = ctypes.c_void_p




ACTS = {"silu": 0, "gelu_tanh": 1}          # decode_layer.c ACT_*


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qrow_bytes(K: int) -> int:
    """Bytes of one quantized input row of K columns (gemv.h gi_row_bytes): int16 codes, and
    per QB-column block its scale and (int4) group sum."""
    Kp = -(-K // QB) * QB
    return 2 * Kp + 8 * (Kp // QB)


def repack(d: WeightDesc, keep: list, lib=None) -> None:
    """Point d.rp at the integer path's copy of d's weight, repacked 16 rows to a block
    (gemv_quant.c kvrun_gemv_repack; the same layout on every build), appended to `keep`."""
    lib = lib or load()
    lib.kvrun_gemv_repack_bytes.restype = ctypes.c_int64
    buf = torch.empty(lib.kvrun_gemv_repack_bytes(ctypes.byref(d)), dtype=torch.uint8)
    lib.kvrun_gemv_repack(ctypes.byref(d), _p(_ptr(buf)))
    d.rp = _ptr(buf)
    keep.append(buf)


def weight_desc(w: dict, keep: list, integer: bool = True, lib=None) -> WeightDesc:
    """A C descriptor for one weight in stored form: {"kind": "int4", "qweight", "scales",
    "mins", "group", "bias"} or {"kind": "int8", "qweight", "scales", "bias"}; the tensors
    are made contiguous and appended to `keep` (they must outlive the descriptor). integer:
    also the integer path's repacked copy (`repack`: as many bytes again as the stored
    weight); without it only the fp32 path can run the descriptor."""
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
    if integer:
        repack(d, keep, lib)
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
    def __init__(self, dims: dict, eps: float, norm1: torch.Tensor | None, norm2: torch.Tensor | None,
                 weights: dict, scratch: Scratch, extra: dict | None = None, gemv: str = "int"):
        """dims: hidden, H, Hkv, D, inter; weights: qkv, o, gate, up, down (weight_desc form).
        extra (Gemma 3, Qwen3, OLMo 2; decode_layer.c's optional fields): "q_norm", "k_norm"
        (D,), "attn_out_norm", "mlp_out_norm" (hidden,) norm weights as multiplied (1 + w for
        Gemma), "act" ("silu" or "gelu_tanh"), "q_scale", "qk_norm_proj" (q_norm / k_norm
        are (H D,) / (Hkv D,), over the whole projection), "moe" (a kernels/native/moe.py
        MoePlan: the sparse MLP in place of gate / up / down, which `weights` then lacks,
        and dims' inter is the experts' width). norm1 / norm2 None: the block
        input goes in unnormalized (OLMo 2). gemv: "int" or "fp32" (the
        module docstring), for every GEMV of this layer and of `logits`."""
        self.keep: list = []
        L = self.desc = LayerDesc()
        for k, v in dims.items():
            setattr(L, k, v)
        L.eps = eps
        n1, n2 = (None if n is None else n.detach().float().contiguous() for n in (norm1, norm2))
        self.keep += [n1, n2, scratch]
        L.norm1, L.norm2 = _ptr(n1), _ptr(n2)          # None: no block-input norm (OLMo 2)
        extra = extra or {}
        for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
            t = extra.get(name)
            if t is not None:
                t = t.detach().float().contiguous()
                self.keep.append(t)
                setattr(L, name, _ptr(t))
        L.act = ACTS[extra.get("act", "silu")]
        L.qk_norm_proj = int(bool(extra.get("qk_norm_proj", False)))
        L.q_scale = float(extra.get("q_scale", 1.0))
        for name in ("qkv", "o", "gate", "up", "down"):
            if name in weights:               # an MoE layer has no gate / up / down
                setattr(L, name, weight_desc(weights[name], self.keep, integer=gemv == "int"))
        self.moe = extra.get("moe")           # a moe.MoePlan: Qwen3-MoE's sparse MLP
        if self.moe is not None:
            L.moe = ctypes.pointer(self.moe.desc)
        for name, t in (("x", scratch.x), ("xn", scratch.xn), ("xsum", scratch.xsum),
                        ("qkv_out", scratch.qkv), ("tmp", scratch.tmp), ("h", scratch.h),
                        ("xq", scratch.xq)):
            setattr(L, name, _ptr(t))
        L.ldq = scratch.xq.stride(0)
        L.gemv_int = GEMV_PATHS[gemv]
        self.scratch = scratch
        self.lib = load()
        assert self.lib is not None, "the native kernels did not build"

    def pre(self, B: int, nthreads: int, local: bool = False) -> None:
        """scratch.x (B, hidden) -> scratch.qkv (B, (H + 2 Hkv) D), q and k roped with
        scratch.cos / scratch.sin (B, D), or cos_local / sin_local for a `local` layer."""
        self.desc.nthreads = nthreads
        s = self.scratch
        cos, sin = (s.cos_local, s.sin_local) if local else (s.cos, s.sin)
        rc = self.lib.kvrun_layer_pre(ctypes.byref(self.desc), B, _p(_ptr(cos)), _p(_ptr(sin)))
        assert rc == 0, rc

    def post(self, B: int, attn: torch.Tensor, nthreads: int) -> None:
        """attn (B, H D) float32 rows (row stride attn.stride(0)) -> scratch.x updated."""
        assert attn.dtype == torch.float32 and attn.stride(1) == 1, (attn.dtype, attn.stride())
        self.desc.nthreads = nthreads
        rc = self.lib.kvrun_layer_post(ctypes.byref(self.desc), B, _p(_ptr(attn)),
                                        ctypes.c_int64(attn.stride(0)))
        assert rc == 0, rc

    def logits(self, B: int, norm: torch.Tensor, head: WeightDesc, nthreads: int) -> torch.Tensor:
        """(B, V) float32 = lm_head(RMSNorm(scratch.x)), a view of the scratch buffer."""
        self.desc.nthreads = nthreads
        rc = self.lib.kvrun_logits(ctypes.byref(self.desc), B, _p(_ptr(norm)), ctypes.byref(head),
                                    _p(_ptr(self.scratch.logits)))
        assert rc == 0, rc
        return self.scratch.logits[:B, :head.N]


def gemv(w: dict, x: torch.Tensor, path: str = "int", nthreads: int = 1, lib=None) -> torch.Tensor:
    """x (B, K) -> (B, N) float32 = x W^T (+ bias): one GEMV through decode_layer.c on
    `path` ("int" or "fp32"), w in weight_desc form, 1 <= B <= MAX_ROWS; `lib` another build
    of the native library (default: load())."""
    keep: list = []
    d = weight_desc(w, keep, integer=path == "int", lib=lib)
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
