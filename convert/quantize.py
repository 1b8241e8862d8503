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

From a GGUF, blocks are repacked without re-quantizing wherever the format allows:
Q4_1 (d, m fp16, 32 codes) and Q4_0 (d fp16, w = (q − 8)·d, i.e. min = −8d, exact in fp16)
into int4 with G = 32 — codes and fp16 scales copied bit for bit, so the stored model
dequantizes (in fp32) to exactly `gguf.quants.dequantize`'s values. Precision at run time:
prefill dequantizes those exact values; the fused decode op reads scale and
zero = min + 8·scale rounded to bf16 (8-bit mantissa), a relative error ≤ 2⁻⁹ of each,
measured ~0.2 % of the weights' RMS on SmolLM2 (see `op_error`). Everything else (Q8_0 and
Q4_x into int8 or into int4 with G ≠ 32, K-quants, float sources) is dequantized to fp32
and quantized again; Q8_0 blocks (one scale per 32) cannot become per-channel int8 exactly.
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


def repack_gguf_q4(data: np.ndarray, qtype_name: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 blocks (rows, bytes per row) uint8 → int4 G=32 parts, bit for bit.

    Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes of codes (byte j: code j low nibble,
    code j+16 high), w = d·q + m. Q4_0 block (18 bytes): d fp16, codes, w = d·(q − 8).
    """
    N, K = shape
    size = {"Q4_0": 18, "Q4_1": 20}[qtype_name]
    blocks = np.ascontiguousarray(data).reshape(N, K // 32, size)                # (N, K/32, B)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                         # (N, K/32)
    if qtype_name == "Q4_1":
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]   # exact
    return {"qweight": torch.from_numpy(qs.reshape(N, K // 2).copy()),
            "scales": torch.from_numpy(d.copy()), "mins": torch.from_numpy(m.copy())}


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
