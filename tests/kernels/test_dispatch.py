"""The one place that decides which kernel runs (kvrun.kernels.dispatch): KVRUN_BACKEND picks
native C / torch / Triton (the Triton kernels under Triton's CPU interpreter here), a codec the
Triton kernel does not read falls back to torch, eviction's attention mass and the flushes
follow the backend, and KVRUN_GEMV / KVRUN_ATTN pick the native multiply paths, every bad
value a one-line BackendError."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402
from torch.testing import assert_close                                    # noqa: E402

pytest.importorskip("triton")

from kvrun.kernels import dispatch, make_codec, native                   # noqa: E402
from kvrun.kernels import triton as tri                                  # noqa: E402
from kvrun.kernels.codecs.base import FpCodec                             # noqa: E402
from kvrun.kernels.decode_attention import decode_attention as torch_attention  # noqa: E402
from kvrun.kernels.dispatch import BackendError, attn_path, backend_for  # noqa: E402
from kvrun.kernels.dispatch import decode_attention as dispatch_attention  # noqa: E402
from test_triton_decode_attention import F32, G, PACKED_TOL, _setup      # noqa: E402


class _OddCodec(FpCodec):
    """A codec kind the Triton kernel does not know (stands for a future codec: a new
    storage format declares its own kind, kernels/table.py)."""
    kind = "odd"


def test_dispatch_backends(monkeypatch):
    args = _setup("tada-2", "int8", 3, 64, 96, 5, 1, F32)
    monkeypatch.delenv("KVRUN_BACKEND", raising=False)
    from kvrun.kernels.native.decode_attention import decode_attention as native_attention
    default = "native" if native.load() is not None else "torch"
    assert backend_for(args[0]) == default                       # CPU tensors → native C / torch
    by_default = dispatch_attention(*args, block=64)
    if default == "native":
        assert torch.equal(by_default, native_attention(*args, attn=attn_path()))
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    by_torch = dispatch_attention(*args, block=64)
    assert torch.equal(by_torch, torch_attention(*args, block=64))
    monkeypatch.setenv("KVRUN_BACKEND", "triton")
    assert backend_for(args[0]) == "triton"
    assert torch.equal(dispatch_attention(*args, block=64), tri.decode_attention(*args))
    assert not torch.equal(dispatch_attention(*args, block=64), by_torch)  # fp32 vs bf16 products
    monkeypatch.setenv("KVRUN_BACKEND", "cuda")
    with pytest.raises(BackendError, match="KVRUN_BACKEND"):
        backend_for(args[0])
    monkeypatch.setenv("KVRUN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        backend_for(args[0])


def test_dispatch_falls_back_for_unknown_codecs(monkeypatch):
    q, kt, vt, n, kw, vw, kn, vn = _setup("fp16", "fp16", 3, 64, 64, 5, 1, F32)
    odd = _OddCodec("k", G)
    assert not tri.supports(odd)
    with pytest.raises(ValueError, match="does not read"):
        tri.decode_attention(q, (odd, kt[1]), vt, n, kw, vw, kn, vn)
    monkeypatch.setenv("KVRUN_BACKEND", "triton")
    out = dispatch_attention(q, (odd, kt[1]), vt, n, kw, vw, kn, vn, block=64)
    assert torch.equal(out, torch_attention(q, (odd, kt[1]), vt, n, kw, vw, kn, vn, block=64))


def test_dispatch_serves_attention_mass_on_triton(monkeypatch):
    """Eviction's attention-mass output runs on the Triton kernel under KVRUN_BACKEND=triton
    (no torch fallback) and agrees with the torch path's."""
    q, kt, vt, n, kw, vw, kn, vn = _setup("kivi-4", "tada-4", 3, 64, 64, 5, 2, F32)
    monkeypatch.setenv("KVRUN_BACKEND", "triton")
    called = []
    real = tri.decode_attention
    monkeypatch.setattr(tri, "decode_attention", lambda *a, **k: called.append(k) or real(*a, **k))
    m1, m2 = (torch.zeros(q.shape[1], n + kw.shape[2] + 2) for _ in range(2))
    out = dispatch_attention(q, kt, vt, n, kw, vw, kn, vn, block=64, mass=m1, mass_from=1)
    ref = torch_attention(q, kt, vt, n, kw, vw, kn, vn, block=64, mass=m2, mass_from=1)
    assert called and called[0]["mass"] is m1 and called[0]["mass_from"] == 1
    assert_close(out, ref, **PACKED_TOL)
    assert_close(m1, m2, atol=1e-3, rtol=0)      # the torch path's bf16 packed products
    assert m1.sum() > 0


def test_dispatch_pack(monkeypatch):
    """kernels.dispatch.pack: kivi_pack under KVRUN_BACKEND=triton, codec.pack otherwise and
    for every other codec; the storage is the same either way."""
    from kvrun.kernels.dispatch import pack
    used = []
    real = tri.kivi_pack
    monkeypatch.setattr(tri, "kivi_pack", lambda *a: used.append(a[0].method) or real(*a))
    x = (torch.randn(2, 64, 64) * 2).half().float()
    for method in ("kivi-4", "tada-2"):
        c = make_codec(method, "k", G)
        stores = {}
        for backend in ("torch", "triton"):
            monkeypatch.setenv("KVRUN_BACKEND", backend)
            stores[backend] = c.alloc(2, 64, 128)
            pack(c, stores[backend], x, 32)
        for name in stores["torch"]:
            assert torch.equal(stores["torch"][name], stores["triton"][name]), (method, name)
        assert stores["torch"]["codes"].any()
    assert used == ["kivi-4"]                                   # once: kivi under triton



def test_gemv_path_reads_the_environment(monkeypatch):
    monkeypatch.delenv("KVRUN_GEMV", raising=False)
    assert dispatch.gemv_path() == "int"
    monkeypatch.setenv("KVRUN_GEMV", "FP32")
    assert dispatch.gemv_path() == "fp32"
    monkeypatch.setenv("KVRUN_GEMV", "int4")
    with pytest.raises(dispatch.BackendError, match="KVRUN_GEMV='int4': expected one of fp32, int"):
        dispatch.gemv_path()



def test_attn_path_reads_the_environment(monkeypatch):
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    assert attn_path() == "fp32"
    monkeypatch.setenv("KVRUN_ATTN", "int")
    assert attn_path() == "int"
    monkeypatch.setenv("KVRUN_ATTN", "bf16")
    with pytest.raises(BackendError, match="KVRUN_ATTN='bf16': expected one of"):
        attn_path()


@pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")
def test_a_routed_call_the_kernel_declines_raises():
    """Given a route's backend, an op runs that backend's kernel or raises KernelRouteError
    (the route promised a shape the kernel does not take); without one it falls back to
    torch as before. The C attention reads head dims up to 256; GEAR has no C pack."""
    from kvrun.kernels.dispatch import KernelRouteError, pack
    args = _setup("int8", "int8", 2, 288, 64, 5, 1, F32)
    with pytest.raises(KernelRouteError, match=r"native decode_attention kernel declined .* q \(1, 4, 1, 288\)"):
        dispatch_attention(*args, backend="native")
    assert torch.equal(dispatch_attention(*args), torch_attention(*args))
    c = make_codec("gear-l", "k", G)
    x = torch.randn(2, G, 64)
    with pytest.raises(KernelRouteError, match="native pack declined a flush .* gear-l"):
        pack(c, c.alloc(2, 64, G), x, 0, backend="native")
    st, ref = c.alloc(2, 64, G), c.alloc(2, 64, G)
    pack(c, st, x, 0)
    c.store(ref, x, 0)
    assert all(torch.equal(st[n], ref[n]) for n in ref) and ref["codes"].any()
