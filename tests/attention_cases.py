"""Random inputs for decode_attention tests: a packed K/V tail, a full-precision window and
new tokens, for any codec pair and geometry (shared by the torch, attention-mass and Triton
tests so they draw the same tensors in the same order)."""
from __future__ import annotations

import torch

from kvrun.kernels import dense_attention, make_codec


def attention_case(k_method, v_method, Hkv, Gq, D, n_tail, W, T, dtype=torch.float32, G=32,
                   spare=0, seed=0, **codec_kw):
    """(q, (k codec, k storage), (v codec, v storage), k_win, v_win, k_new, v_new).

    The tail holds n_tail packed tokens (K drawn with twice V's spread); the storage has
    `spare` more slots than the tail so reads must stop at n_tail. The window is in the
    arena's window dtype (bf16 for bf16 inputs, else fp16); q and new tokens in `dtype`."""
    torch.manual_seed(seed)
    kc, vc = make_codec(k_method, "k", G, **codec_kw), make_codec(v_method, "v", G, **codec_kw)
    S = max(n_tail, G) + spare
    ks, vs = kc.alloc(Hkv, D, S), vc.alloc(Hkv, D, S)
    if n_tail:
        kc.pack(ks, torch.randn(Hkv, n_tail, D) * 2, 0)
        vc.pack(vs, torch.randn(Hkv, n_tail, D), 0)
    wdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    kw, vw = (torch.randn(1, Hkv, W, D).to(wdt) for _ in range(2))
    kn, vn = (torch.randn(1, Hkv, T, D).to(dtype) for _ in range(2))
    q = torch.randn(1, Hkv * Gq, T, D).to(dtype)
    return q, (kc, ks), (vc, vs), kw, vw, kn, vn


def dequantized_reference(q, kt, vt, n_tail, kw, vw, kn, vn):
    """Dense causal attention in fp32 over the explicitly dequantized tail + window + new
    tokens: the oracle every decode_attention backend is checked against."""
    (kc, ks), (vc, vs) = kt, vt
    kd = kc.dequant(ks, 0, n_tail)[None] if n_tail else kn[:, :, :0].float()
    vd = vc.dequant(vs, 0, n_tail)[None] if n_tail else vn[:, :, :0].float()
    K = torch.cat([kd, kw.float(), kn.float()], 2)
    V = torch.cat([vd, vw.float(), vn.float()], 2)
    return dense_attention(q.float(), K, V, K.shape[2] - q.shape[2])
