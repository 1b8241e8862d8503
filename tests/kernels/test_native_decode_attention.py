"""The native CPU decode_attention (kernels/native/) equals attention over the explicitly
dequantized tail + window + new tokens — in fp32, so to 2e-5, tighter than the torch path's
bf16 products — for every codec and bit width, K and V codecs that differ, GQA ratios 1, 3
and 8, head dims 32/64/128, empty / partial / full windows, chunked prefill queries, and its
attention-mass output equals the torch path's. These run the kernel's fp32 path (KVRUN_ATTN=fp32);
the integer q.K over KIVI keys is checked against its own torch twin in test_int_attention.py."""
import pytest
import torch
from torch.testing import assert_close

from attention_cases import attention_case, dequantized_reference
from kvrun.kernels import native
from kvrun.kernels.decode_attention import decode_attention as torch_attention
from kvrun.kernels.native.decode_attention import decode_attention as native_attention

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason=f"native kernels unavailable: {native.error()}")

METHODS = ("fp16", "bf16", "fp32", "int8", "kivi-2", "kivi-4", "tada-2", "tada-4", "tada-8",
           "gear-l", "gear-l-2", "gear", "gear-2")
# (Hkv, Gq, D, n_tail, W, T): decode steps, a prefill chunk on a tail, a tail only, no tail
GEOMS = [(2, 3, 64, 160, 35, 1), (1, 8, 64, 96, 33, 7), (3, 1, 128, 64, 0, 1),
         (2, 3, 32, 64, 3, 2), (2, 3, 64, 0, 30, 1), (1, 3, 64, 480, 32, 70)]


def _check(k_method, v_method, geom, dtype=torch.float32, **kw):
    Hkv, Gq, D, n_tail, W, T = geom
    args = attention_case(k_method, v_method, Hkv, Gq, D, n_tail, W, T, dtype=dtype, **kw)
    q, kt, vt, kwin, vwin, kn, vn = args
    out = native_attention(q, kt, vt, n_tail, kwin, vwin, kn, vn, attn="fp32")
    assert out is not None and out.shape == q.shape and out.dtype == q.dtype
    ref = dequantized_reference(q, kt, vt, n_tail, kwin, vwin, kn, vn)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
def test_matches_dequantized_reference(method, geom):
    _check(method, method, geom)


@pytest.mark.parametrize("kv", [("kivi-4", "kivi-2"), ("tada-4", "fp16"), ("int8", "gear"),
                                ("tada-2", "tada-8"), ("fp16", "kivi-4"), ("gear-l-2", "tada-4")])
@pytest.mark.parametrize("mu", ["fp16", "int8"])
def test_mixed_codecs_and_int8_means(kv, mu):
    _check(*kv, (3, 3, 64, 224, 40, 3), tada_mu=mu)


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("v", ["kivi-2", "cb-3"])
def test_three_bit_keys(geom, v):
    """kivi-3 keys (2-bit planes + 1-bit planes, kernels/chanpack.py) beside a V codec."""
    _check("kivi-3", v, geom)


@pytest.mark.parametrize("G", [64, 128])
def test_three_bit_keys_in_larger_groups(G):
    _check("kivi-3", "kivi-4", (2, 3, 64, 4 * G, 5, 1), G=G)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    _check("kivi-4", "tada-4", (2, 3, 64, 128, 9, 2), dtype=dtype)


@pytest.mark.parametrize("G", [64, 128])
def test_groups_larger_than_a_tile(G):
    for m in ("kivi-2", "gear", "tada-4"):
        _check(m, m, (2, 3, 64, 2 * G, 5, 1), G=G)


def test_mass_matches_torch_path():
    Hkv, Gq, D, n_tail, W, T = 2, 3, 64, 128, 17, 6
    q, kt, vt, kw, vw, kn, vn = attention_case("kivi-4", "kivi-4", Hkv, Gq, D, n_tail, W, T)
    N = n_tail + W + T
    m_t, m_n = torch.full((Hkv * Gq, N), 0.5), torch.full((Hkv * Gq, N), 0.5)
    torch_attention(q, kt, vt, n_tail, kw, vw, kn, vn, mass=m_t, mass_from=2)
    native_attention(q, kt, vt, n_tail, kw, vw, kn, vn, mass=m_n, mass_from=2, attn="fp32")
    assert_close(m_n, m_t, atol=1e-3, rtol=0)        # torch path: bf16 products
    assert_close(m_n.sum(1), torch.full((Hkv * Gq,), 0.5 * N + (T - 2)), atol=1e-4, rtol=0)


def test_unsupported_tail_falls_back():
    """A tail that is not a whole number of 32-token tiles is left to the torch path."""
    q, kt, vt, kw, vw, kn, vn = attention_case("fp16", "fp16", 2, 3, 64, 16, 4, 1, G=16)
    assert native_attention(q, kt, vt, 16, kw, vw, kn, vn) is None


@pytest.mark.parametrize("rot", ["none", "k", "kv"])
@pytest.mark.parametrize("wdt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_fused_append_equals_the_steps(rot, wdt, T):
    """attend_append = rotate new K/V (and q), round to the window dtype, write the window
    slots, attend, un-rotate the output — each step done separately in torch."""
    from kvrun.kernels.hadamard import random_signs, rotate, rotation_matrix, unrotate
    from kvrun.kernels.native.decode_attention import attend_append
    Hkv, Gq, D, n_tail, W = 2, 3, 64, 96, 7
    q, kt, vt, _, _, kn, vn = attention_case("kivi-4", "tada-4", Hkv, Gq, D, n_tail, W, T)
    win_k, win_v = torch.randn(Hkv, W + T + 4, D).to(wdt), torch.randn(Hkv, W + T + 4, D).to(wdt)
    r = rotation_matrix(D, random_signs(D, 1))
    rk = r if rot != "none" else None
    rv = r if rot == "kv" else None
    ref_k, ref_v = win_k.clone(), win_v.clone()
    qr = rotate(q, rk) if rk is not None else q
    k2 = (rotate(kn.float(), rk) if rk is not None else kn).to(wdt)
    v2 = (rotate(vn.float(), rv) if rv is not None else vn).to(wdt)
    ref_k[:, W:W + T], ref_v[:, W:W + T] = k2[0], v2[0]
    ref = native_attention(qr, kt, vt, n_tail, ref_k[None, :, :W], ref_v[None, :, :W], k2, v2)
    ref = unrotate(ref, rv) if rv is not None else ref
    out = attend_append(q, kt, vt, n_tail, win_k[None, :, :W], win_v[None, :, :W], kn, vn,
                        win_k[:, W:W + T], win_v[:, W:W + T], rk, rv)
    assert torch.equal(win_k, ref_k) and torch.equal(win_v, ref_v)
    assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path):
    """No gcc (or a failed build): load() is None with a reason, dispatch runs torch, and
    forcing the native backend is a one-line error."""
    from kvrun.kernels import dispatch
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_err", None)
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    monkeypatch.delenv("KVRUN_BACKEND", raising=False)
    assert native.load() is None and native.error()
    q = torch.zeros(1, 3, 1, 64)
    assert dispatch.backend_for(q) == "torch"
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    with pytest.raises(dispatch.BackendError, match="did not build"):
        dispatch.backend_for(q)
    assert not list(tmp_path.glob("native/*.so"))          # nothing half-written


@pytest.fixture(params=[("-DKVRUN_NO_AVX512",), ("-DKVRUN_NO_AVX512", "-DKVRUN_NO_AVX2")],
                ids=["avx2", "plain-c"])
def portable(request, monkeypatch):
    """The kernel built without its AVX-512 paths: what machines without AVX-512 run (AVX2:
    int8 / KIVI / TaDA codes decoded in 8-lane registers, the other layouts through the
    (D, 32) tile and its AVX2 micro-kernels), or with neither, plain C (every layout through
    the tile), checked here on every codec too."""
    import ctypes
    import kvrun.kernels.native.decode_attention as nd
    lib = ctypes.CDLL(str(native._build(request.param)))
    lib.kvrun_decode_attention.restype = ctypes.c_int
    monkeypatch.setattr(nd, "load", lambda: lib)
    monkeypatch.setattr(native, "_lib", lib)


@pytest.mark.parametrize("method", METHODS + ("kivi-3/kivi-4", "int8/kivi-b8"))
def test_portable_path_matches_dequantized_reference(portable, monkeypatch, method):
    k, v = method.split("/") if "/" in method else (method, method)
    if v == "kivi-b8":
        _kivi_bits(monkeypatch, 8)
        v = "kivi-b"
    for geom in (GEOMS[0], GEOMS[1], GEOMS[2]):
        _check(k, v, geom)


def _kivi_bits(monkeypatch, bits):
    """attention_case's "kivi-b" for any width, 8 bits included (profiles' kivi layers,
    no method name of their own): KiviCodec with the case's V channel group"""
    import attention_cases
    from kvrun.kernels.codecs.kivi import KiviCodec
    make = attention_cases.make_codec
    monkeypatch.setattr(attention_cases, "make_codec", lambda m, role, G, v_group=32, **kw:
                        KiviCodec(role, G, bits, v_group) if m == "kivi-b" else make(m, role, G, v_group=v_group, **kw))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("g", [16, 32, 64, 128])
@pytest.mark.parametrize("geom", [(1, 4, 256, 288, 17, 1), (2, 3, 128, 96, 5, 3), (2, 5, 64, 160, 7, 1)],
                         ids=lambda g: "-".join(map(str, g)))
def test_kivi_widths_and_value_groups(monkeypatch, bits, g, geom):
    """KIVI V at every width (8 bits: two nibble planes) and channel group (the register paths
    fold the scales per group of a 16-channel quarter), beside int8 and KIVI keys, head dims
    64 to 256, GQA rows 3 to 5."""
    if g > geom[2]:
        pytest.skip("group wider than the head")
    _kivi_bits(monkeypatch, bits)
    for k in ("kivi-b", "int8"):
        _check(k, "kivi-b", geom, v_group=g)


@pytest.mark.parametrize("method", ["fp16", "int8", "kivi-4", "tada-4/kivi-2", "kivi-2+rot", "gear-l"])
def test_fused_step_is_the_general_native_step(monkeypatch, method):
    """A one-token arena step through FusedStep (its C arguments built once per layer) gives
    the bits the general attend_append route gives: the output and the window and tail
    bytes after every step, flushes included."""
    import copy

    from kvrun.kernels.native.decode_attention import FusedStep
    from kvrun.kv import arena as arena_mod, build_cache, parse_kv
    from tiny import tiny_config
    cfg = tiny_config(num_layers=2, num_heads=6, num_kv_heads=2, hidden_size=384, max_position=1024)
    g = torch.Generator().manual_seed(3)
    a = build_cache(cfg, 512, parse_kv(method, residual=32, group=32))
    shape = (cfg.num_layers, 2, 150, 64)
    a.ingest(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
    b = copy.deepcopy(a)
    ran = []                                                # FusedStep calls that attended
    real = FusedStep.__call__

    def counted(self, *x):
        o = real(self, *x)
        ran.append(o is not None)
        return o
    monkeypatch.setattr(FusedStep, "__call__", counted)
    for _ in range(40):                                     # through a flush of 32 tokens
        q = torch.randn(1, 6, 1, 64, generator=g)
        k, v = torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
        for cache, fused in ((a, True), (b, False)):
            cache.positions(1)
            with monkeypatch.context() as mp:
                if not fused:
                    # a prebuilt step that declines every call: the arena builds them per call
                    mp.setattr(arena_mod, "fused_step", lambda *x, **kw: (lambda *a: None))
                outs = [cache.attend(l, q, k, v) for l in range(cfg.num_layers)]
            cache.commit(1)
            if fused:
                want = outs
            else:
                for x, y in zip(want, outs):
                    assert torch.equal(x, y)
        assert torch.equal(a.win_k, b.win_k) and torch.equal(a.win_v, b.win_v)
        assert a.n_tail == b.n_tail and a.n_win == b.n_win
        for l in range(cfg.num_layers):
            for sa, sb in ((a.k_store[l], b.k_store[l]), (a.v_store[l], b.v_store[l])):
                assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert sum(ran) == 40 * cfg.num_layers
