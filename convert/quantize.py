"""Weight-only quantization for `kvrun convert --weights int8|int4` (layout: runtime/model/qlinear.py).

What is quantized: every linear layer (`*_proj.weight`), the token embedding and an untied
lm_head. Norms and biases stay float. The embedding (and so a tied lm_head) and an untied
lm_head are int8 rows in both formats, as llama.cpp keeps token_embd in Q8_0.

- int8: symmetric round-to-nearest, one fp32 scale per output channel (absmax / 127).
  Per channel rather than per group because `aten._weight_int8pack_mm` takes exactly one
  scale per output channel; `--group` does not apply.
- int4: asymmetric round-to-nearest per group of G input columns, fp16 scale and min
  (w = code · scale + min, codes 0..15): llama.cpp's Q4_1 with a choice of G. Codes are
  chosen against the fp16-rounded scale and min, so they are optimal for what is stored.

From a GGUF, blocks are repacked without re-quantizing wherever the format allows
(`INT4_REPACKED`):
- Q4_1 (d, m fp16, 32 codes) and Q4_0 (d fp16, w = (q − 8)·d, i.e. min = −8d, exact in fp16)
  into int4 with G = 32 — codes and fp16 scales copied bit for bit, so the stored model
  dequantizes (in fp32) to exactly `gguf.quants.dequantize`'s values.
- Q4_K: each sub-block of 32 is an int4 group; its codes are copied, its scale d·sc and min
  −dmin·m (exact in fp32) rounded once to fp16: every weight within 2⁻¹¹·(15·|scale| +
  |min|) of gguf's value, about 1 % of the group's step at most (docs/measurements.md, "A
  GGUF at its own bits", against rounding to 4 bits again).
Precision at run time: prefill dequantizes those values; the fused decode op reads scale
and zero = min + 8·scale rounded to bf16 (8-bit mantissa), a relative error ≤ 2⁻⁹ of each
(its size on SmolLM2's weights: docs/measurements.md, "Figures behind the code"); the
native step's GEMVs read the fp16 scale and min as stored. Everything else (Q5_0/Q5_1/Q5_K/Q6_K/Q8_0, Q4_x into
int8 or into int4 with G ≠ 32, float sources) is dequantized to fp32 and quantized again:
kvrun has no 5-, 6- or group-wise 8-bit format, so those types lose a second rounding
(int8 per channel costs little, 4 bits much: Gemma's numbers in docs/measurements.md), and
`default_weights` sends files made mostly of them to int8.
"""
from __future__ import annotations

import numpy as np
import torch

from kvrun.errors import KvrunError
from kvrun.model.qlinear import dequantize_int4, dequantize_int8, int4_group, pack_int4, unpack_int4


def check_weight_format(weights: str, group: int) -> None:
    """KvrunError unless `weights` is float | int8 | int4 and `group` a supported int4 group."""
    from kvrun.model.qlinear import INT4_GROUPS, WEIGHT_FORMATS
    if weights not in WEIGHT_FORMATS:
        raise KvrunError(f"unknown weight format {weights!r} ({', '.join(WEIGHT_FORMATS)})")
    if weights == "int4" and group not in INT4_GROUPS:
        raise KvrunError(f"int4 group must be one of {', '.join(map(str, INT4_GROUPS))} "
                         f"(got {group})")


def float_dtype(weights: str) -> str:
    """The float tensors' dtype when none is asked for: fp32 beside int8/int4 weights (norms
    and biases are tiny: kept exact), bf16 for float weights."""
    return "bf16" if weights == "float" else "fp32"


def is_quantized(name: str) -> bool:
    """Whether a float tensor of this HF name is stored quantized in int8/int4 models."""
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


def target_format(name: str, weights: str) -> str:
    """'int8' | 'int4' for a quantized tensor: embedding and lm_head stay int8 rows."""
    return "int8" if name in ("model.embed_tokens.weight", "lm_head.weight") else weights


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w (N, K) float → {qweight (N, K) int8, scales (N,) fp32}; symmetric per row.

    Plain absmax/127: searching a clipped scale per row did not lower the error on
    SmolLM2's embedding or layers (measured), so outliers are kept exact."""
    w = w.float()
    scales = w.abs().amax(1) / 127                                               # (N,)
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scales}


def quantize_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """w (N, K) float → {qweight (N, K/2) uint8, scales, mins (N, K/G) fp16}; min-max RTN."""
    N, K = w.shape
    g = w.float().view(N, K // group, group)                                     # (N, K/G, G)
    lo, hi = g.amin(-1), g.amax(-1)
    scales, mins = ((hi - lo) / 15).half(), lo.half()
    if not (torch.isfinite(scales).all() and torch.isfinite(mins).all()):
        raise KvrunError("weights exceed the fp16 range of int4 scales; use --weights int8")
    s = scales.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    codes = torch.round((g - mins.float()[..., None]) * inv[..., None]).clamp_(0, 15)
    return {"qweight": pack_int4(codes.view(N, K), group), "scales": scales, "mins": mins}


def quantize(name: str, w: torch.Tensor, weights: str, group: int) -> dict[str, torch.Tensor]:
    """One float tensor → its stored parts, keyed by full name (`X.qweight`, `X.scales` …)."""
    base = name[:-len(".weight")]
    if target_format(name, weights) == "int8":
        parts = quantize_int8(w)
    else:
        parts = quantize_int4(w, int4_group(w.shape[1], group))
    return {f"{base}.{k}": v for k, v in parts.items()}


# GGUF types whose blocks map onto int4 groups of 32 without a second rounding of the codes
INT4_REPACKED = ("Q4_0", "Q4_1", "Q4_K")
_Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_Q4_K_BLOCK_BYTES = 144                 # d, dmin fp16, 12 bytes of 6-bit scales/mins, 128 of codes


def repack_gguf_q4(data: np.ndarray, qtype_name: str, shape: tuple[int, int],
                   scale: float = 1.0) -> dict[str, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q4_K blocks (rows, bytes per row) uint8 → int4 G=32 parts of the
    weights times `scale`.

    Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes of codes (byte j: code j low nibble,
    code j+16 high), w = d·q + m. Q4_0 block (18 bytes): d fp16, codes, w = d·(q − 8).
    Both are copied bit for bit; with a `scale` (Granite's residual_scale) the codes are, and
    scale and min are multiplied in fp32 and rounded once to fp16 (Q4_K's bound below).
    Q4_K: `repack_gguf_q4_k`.
    """
    if qtype_name == "Q4_K":
        return repack_gguf_q4_k(data, shape, scale)
    N, K = shape
    size = _Q4_BLOCK_BYTES[qtype_name]
    blocks = np.ascontiguousarray(data).reshape(N, K // 32, size)                # (N, K/32, B)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                         # (N, K/32)
    if qtype_name == "Q4_1":
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]   # exact
    if scale != 1.0:
        d, m = ((x.astype(np.float32) * np.float32(scale)).astype(np.float16) for x in (d, m))
    return {"qweight": torch.from_numpy(qs.reshape(N, K // 2).copy()),
            "scales": torch.from_numpy(d.copy()), "mins": torch.from_numpy(m.copy())}


def repack_gguf_q4_k(data: np.ndarray, shape: tuple[int, int],
                     scale: float = 1.0) -> dict[str, torch.Tensor]:
    """GGUF Q4_K super-blocks (rows, bytes per row) uint8 → int4 G=32 parts (of the weights
    times `scale`, multiplied into scale and min in fp32 before their one rounding).

    A super-block of 256 columns is 8 sub-blocks of 32, sub-block j being exactly
    w = q·(d·sc_j) − dmin·m_j with q in 0..15 (sc_j, m_j 6-bit, d, dmin fp16): one int4 group
    with scale d·sc_j and min −dmin·m_j. The codes are copied; scale and min, exact in fp32
    (an 11-bit times a 6-bit integer), are rounded once to the int4 format's fp16, so each
    weight is within 2⁻¹¹·(15·|scale| + |min|) of gguf's value (half an fp16 ulp of each,
    subnormals aside), a small fraction of the group's step `scale`.
    """
    import gguf
    N, K = shape
    blocks = np.ascontiguousarray(data).reshape(-1, _Q4_K_BLOCK_BYTES)          # (N K/256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)               # (nb, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])                    # (nb, 8) each
    f = np.float32(scale)
    scales = (d * sc.astype(np.float32) * f).astype(np.float16)
    mins = (-dmin * mn.astype(np.float32) * f).astype(np.float16)
    if not (np.isfinite(scales).all() and np.isfinite(mins).all()):
        raise KvrunError("Q4_K scales exceed the fp16 range of int4 scales; use --weights int8")
    # 4 runs of 32 bytes: low nibbles are sub-block 2i's 32 codes, high nibbles 2i+1's
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = torch.from_numpy((qs & 15).reshape(N, K))
    return {"qweight": pack_int4(codes, 32), "scales": torch.from_numpy(scales.reshape(N, K // 32)),
            "mins": torch.from_numpy(mins.reshape(N, K // 32))}


# Bits of a weight's code in each GGUF type the converter reads (float types: their width)
GGUF_CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6,
                  "Q8_0": 8, "F16": 16, "BF16": 16, "F32": 32}


def default_weights(linear_types: dict[str, int]) -> str:
    """The weight format a GGUF converts to when none is asked for, from its linear layers'
    tensor types (type name → number of weights; the embedding and lm_head are int8 rows in
    either quantized format, so they do not count).

    int4 when at least half of those weights have 4-bit codes (Q4_0, Q4_1, Q4_K: repacked,
    `INT4_REPACKED`), else int8 when at least half are quantized types of ≤ 8 bits, else
    float. A file mostly of 5- or 6-bit types (Q5_0, Q5_K, Q6_K) is int8: rounding them to
    4 bits again costs far more than int8's per-channel rounding (Gemma 3 270M Q4_K_M, whose
    640-column projections are Q5_0: docs/measurements.md).
    """
    total = sum(linear_types.values())
    if total == 0:
        return "float"
    # a type kvrun does not read counts as float here; the conversion refuses it by name
    bits = {t: GGUF_CODE_BITS.get(t, 32) for t in linear_types}

    def share(max_bits: int) -> float:
        return sum(n for t, n in linear_types.items() if bits[t] <= max_bits) / total
    if share(4) >= 0.5:
        return "int4"
    return "int8" if share(8) >= 0.5 else "float"


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stored parts (keys qweight/scales[/mins], any prefix) → fp32 (N, K)."""
    p = {k.rsplit(".", 1)[-1]: v for k, v in parts.items()}
    if "mins" in p:
        return dequantize_int4(p["qweight"], p["scales"], p["mins"])
    return dequantize_int8(p["qweight"], p["scales"])


def op_dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the fused CPU decode op multiplies with: bf16 scales (and bf16 zero for int4)."""
    p = {k.rsplit(".", 1)[-1]: v for k, v in parts.items()}
    bf = lambda t: t.float().to(torch.bfloat16).float()          # noqa: E731
    if "mins" not in p:
        return p["qweight"].float() * bf(p["scales"])[:, None]
    s = p["scales"].float()
    N, n_groups = s.shape
    codes = unpack_int4(p["qweight"], 2 * p["qweight"].shape[1] // n_groups, torch.float32)
    codes = codes.view(N, n_groups, -1) - 8
    return (codes * bf(s)[..., None] + bf(p["mins"].float() + 8 * s)[..., None]).view(N, -1)


def rel_error(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """‖approx − ref‖ / ‖ref‖ (relative RMS error)."""
    den = ref.float().norm().item()
    return (approx.float() - ref.float()).norm().item() / den if den > 0 else 0.0


def describe(name: str, how: str, ref: torch.Tensor, parts: dict[str, torch.Tensor]) -> str:
    """One `-v` line: tensor, format, stored and decode-op relative errors vs the source."""
    return (f"{name:<44} {how:<26} err {rel_error(ref, dequantize(parts)):.2e} stored, "
            f"{rel_error(ref, op_dequantize(parts)):.2e} in the bf16 decode op")
