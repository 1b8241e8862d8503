"""Shared by the ring kernel tests (tests/kernels/test_native_ring_attention.py, tests/kernels/test_triton_ring_attention.py): the
inputs they draw, a count of which steps the kernel served, and the step-by-step comparison
of a ring on a kernel's backend with an equal ring on torch, its oracle."""
from __future__ import annotations

import contextlib

import torch
from torch.testing import assert_close

import kvrun.kv.ring as ring_mod


def ring_data(n, H, Hkv, D, seed, dtype=torch.float32):
    """q (1, H, n, D), k and v (1, Hkv, n, D), drawn in that order."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))


def count_ring_steps(monkeypatch, backend: str) -> list[bool]:
    """Per one-token step on `backend` (ring.py's route to dispatch.ring_step): whether its
    kernel served it. The list fills as the test runs."""
    served = []
    real = ring_mod.ring_step

    def count(*a, **k):
        o = real(*a, **k)
        if k["backend"] == backend:
            served.append(o is not None)
        return o
    monkeypatch.setattr(ring_mod, "ring_step", count)
    return served


def corner_rows(bits: int, D: int = 64, n: int = 12):
    """q (1, 2, n, D) and unrotated k, v (1, 1, n, D) at the quantizer's corners: a constant
    group (scale floored at 1e-6, codes 0), an all-zero row, exact half-steps (round half
    to even), values near fp16's max, a range below fp16's subnormals (scale floored), and
    a group whose fp16 scale falls short of its max (nudged up one ulp: asym_params)."""
    rows = torch.randn(n, D, generator=torch.Generator().manual_seed(bits))
    rows[0, :32] = 3.0                                           # constant group
    rows[1] = 0.0                                                # zero row
    top = (1 << bits) - 1
    rows[2, :32] = torch.arange(32).float() % (top + 1) * 0.5    # halves of a scale-0.5 grid
    rows[2, 0], rows[2, 1] = 0.0, top * 1.0                      # scale exactly 1: x.5 ties
    rows[3, 32:] = torch.linspace(-60000, 60000, 32)             # near fp16's max
    rows[4, :32] = 1e-3 + torch.arange(32) * 1e-9                # scale below fp16: floored
    rows[5, :32] = torch.linspace(0, 15 * (1 + 2 ** -11), 32)     # 4 bits: fp16 scale 1.0 short
    q = torch.randn(1, 2, n, D, generator=torch.Generator().manual_seed(9))
    return q, rows[None, None].clone(), rows.flip(0)[None, None].clone()


def steps_agree(a, b, backend: str, layer: int, q, k, v, tol: dict | None = None,
                around=contextlib.nullcontext):
    """Token by token: ring a on `backend`, ring b on torch. After every step their storage
    is equal bit for bit; with `tol`, their outputs have one dtype and shape and agree
    within it (assert_close's atol/rtol). `around()` wraps a's step (e.g. numpy's warnings
    under Triton's interpreter)."""
    a.backend, b.backend = backend, "torch"
    for t in range(q.shape[2]):
        x = [z[:, :, t:t + 1] for z in (q, k, v)]
        with around():
            got = a.attend(layer, *x)
        want = b.attend(layer, *x)
        a.commit(1)
        b.commit(1)
        for role in ("k", "v"):
            for i, (pa, pb) in enumerate(zip(getattr(a, role).parts, getattr(b, role).parts)):
                assert torch.equal(pa, pb), f"step {t}: {role} part {i} differs"
        if tol is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert_close(got, want, **tol, msg=lambda m: f"step {t}: {m}")
