"""Hadamard-rotated caches: rotated attention equals attention over the same dequantized
values un-rotated; shift still re-ropes right (the transform itself: test_hadamard.py)."""
import pytest
import torch
from torch.testing import assert_close

from kvrun.kernels import dense_attention
from kvrun.errors import KvrunError
from kvrun.kv import build_cache, kv_bytes_at, parse_kv
from kvrun.kernels.rope import Rope, apply_rope
from tiny import tiny_config


def _cfg(H, Hkv, D=64):
    return tiny_config(num_layers=2, num_heads=H, num_kv_heads=Hkv, hidden_size=H * D,
                            max_position=1024)


@pytest.mark.parametrize("H,Hkv", [(2, 2), (6, 2), (8, 1)])            # GQA 1, 3, 8
@pytest.mark.parametrize("n_prev", [0, 20, 150, 300])                  # window empty/partial/full
@pytest.mark.parametrize("spec", ["fp16+rot", "kivi-2+rot", "tada-4+rot", "int8+rot-k",
                                  "kivi-4/tada-2+rot-v"])
def test_rotated_attention_equals_unrotated_over_dequantized(H, Hkv, n_prev, spec):
    cfg = _cfg(H, Hkv)
    D = cfg.head_dim
    if Hkv == 1 and "tada" in spec:             # TaDA's mean over one KV head is the key
        with pytest.raises(KvrunError, match="more than one KV head"):
            build_cache(cfg, 512, parse_kv(spec, residual=64, group=32, rotate_seed=1))
        return
    a = build_cache(cfg, 512, parse_kv(spec, residual=64, group=32, rotate_seed=1))
    g = torch.Generator().manual_seed(n_prev)
    if n_prev:
        a.positions(n_prev)
        for l in range(2):
            a.attend(l, torch.randn(1, H, n_prev, D, generator=g),
                     torch.randn(1, Hkv, n_prev, D, generator=g), torch.randn(1, Hkv, n_prev, D, generator=g))
        a.commit(n_prev)
    T = 3
    q = torch.randn(1, H, T, D, generator=g)
    k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    l = 1
    nt, w = a.n_tail[l], a.n_win[l]
    rk, rv = a.rot_k[l], a.rot_v[l]
    unk = (lambda x: x @ rk.T) if rk is not None else (lambda x: x)
    unv = (lambda x: x @ rv.T) if rv is not None else (lambda x: x)
    rot_new = lambda x, r: (x @ r).half().float() if r is not None else x.half().float()
    tail = lambda c, st: c.dequant(st, 0, nt) if nt else torch.zeros(Hkv, 0, D)
    K = torch.cat([unk(tail(a.k_codecs[l], a.k_store[l]))[None],
                   unk(a.win_k[l, None, :, :w].float()), unk(rot_new(k, rk))], 2)
    V = torch.cat([unv(tail(a.v_codecs[l], a.v_store[l]))[None],
                   unv(a.win_v[l, None, :, :w].float()), unv(rot_new(v, rv))], 2)
    a.positions(T)
    a.attend(0, q, k, v)
    out = a.attend(l, q, k, v)
    # packed codes are multiplied in bf16 by the CPU read path (kernels/nibble.py); the fp16
    # tail and the window are exact up to fp32 rounding
    tol = 5e-5 if spec.startswith("fp16") or nt == 0 else 2e-2
    assert_close(out, dense_attention(q, K, V, n_prev), atol=tol, rtol=tol)


def test_rotation_reduces_quantization_error_on_outlier_channels():
    """The point of rotating: a channel outlier no longer sets every token's range."""
    cfg = _cfg(2, 2)
    x = torch.randn(1, 2, 256, 64)
    x[..., 5] *= 30                                                   # a K outlier channel
    errs = {}
    for spec in ("kivi-2/int8", "kivi-2/int8+rot-k", "tada-2", "tada-2+rot"):
        a = build_cache(cfg, 512, parse_kv(spec, residual=0, group=32))
        a.positions(256)
        for l in range(2):
            a.attend(l, torch.randn(1, 2, 256, 64), x, x)
        a.commit(256)
        deq = a.k_codecs[0].dequant(a.k_store[0], 0, 256)
        if a.rot_k[0] is not None:
            deq = deq @ a.rot_k[0].T
        errs[spec] = (deq - x[0]).pow(2).mean().item()
    assert errs["tada-2+rot"] < 0.5 * errs["tada-2"]
    assert errs["kivi-2/int8+rot-k"] < 1.5 * errs["kivi-2/int8"]      # per-channel K already isolates it


def test_rotation_costs_no_bytes():
    cfg = _cfg(6, 2)
    for spec in ("kivi-4", "tada-2", "gear-l"):
        assert kv_bytes_at(cfg, parse_kv(spec + "+rot"), 4096) == kv_bytes_at(cfg, parse_kv(spec), 4096)


def test_context_shift_with_rotation_matches_reference():
    cfg = _cfg(6, 2)
    L, H, Hkv, D, ctx, G = 2, 6, 2, 64, 160, 32
    a = build_cache(cfg, ctx, parse_kv("fp16+rot", residual=32, group=G, ctx_policy="shift", n_keep=4))
    rope = Rope(D, cfg.rope_theta, None, 512)
    torch.manual_seed(0)
    kraw, vals = torch.randn(L, 1, Hkv, ctx, D), torch.randn(L, 1, Hkv, ctx, D)
    cos, sin = rope.tables(a.positions(ctx), torch.float32)
    for l in range(L):
        a.attend(l, torch.randn(1, H, ctx, D), apply_rope(kraw[l], cos, sin), vals[l])
    a.commit(ctx)
    newpos = a.positions(1)
    nd = (ctx - G) // 2
    kept = list(range(G)) + list(range(G + nd, ctx))
    q, kn, vn = torch.randn(1, H, 1, D), torch.randn(1, Hkv, 1, D), torch.randn(1, Hkv, 1, D)
    c1, s1 = rope.tables(newpos, torch.float32)
    ck, sk = rope.tables(torch.arange(len(kept)), torch.float32)
    for l in range(L):
        out = a.attend(l, apply_rope(q, c1, s1), apply_rope(kn, c1, s1), vn)
        K = torch.cat([apply_rope(kraw[l][:, :, kept], ck, sk), apply_rope(kn, c1, s1)], 2)
        V = torch.cat([vals[l][:, :, kept], vn], 2)
        assert_close(out, dense_attention(apply_rope(q, c1, s1), K, V, len(kept)), atol=1e-2, rtol=1e-2)
