"""The integer GEMV of the native decode layer (kernels/native/gemv_int.c over the weights
gemv_quant.c repacks 16 rows to a block) against its torch twin (gemv_reference.py
gemv_int_reference: the same int16 input codes, exact integer block sums): int4 at every
group and int8, odd sizes (N not a multiple of the 16-row block, int8 K not a multiple of the
32-column block, B not a multiple of the tile), on each build this CPU can run: AVX512-VNNI
(the default build where the CPU has it), AVX2 (-DKVRUN_NO_AVX512) and plain C
(-DKVRUN_NO_AVX512 -DKVRUN_NO_AVX2), which give the same bits."""
import ctypes
from pathlib import Path

import pytest
import torch

from kvrun.kernels import native
from kvrun.kernels.native.decode_layer import gemv
from kvrun.kernels.native.gemv_reference import QB, gemv_int_reference, quantize_input
from tool_module import load_tool

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")

BUILDS = {"default": (), "avx2": ("-DKVRUN_NO_AVX512",), "c": ("-DKVRUN_NO_AVX512", "-DKVRUN_NO_AVX2")}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _expected_isa(build: str) -> int | None:
    """gemv_int.c's path for `build` on this CPU (-march=native): 2 VNNI, 1 AVX2, 0 C;
    None where /proc/cpuinfo does not tell."""
    f = _cpu_flags()
    if not f:
        return None
    avx2 = 1 if {"avx2", "fma", "f16c"} <= f else 0
    if build == "c":
        return 0
    if build == "avx2":
        return avx2
    return 2 if {"avx512_vnni", "avx512bw", "avx512vl"} <= f else avx2


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    """One build of the native library; the test asserts it runs the path it is named for."""
    flags = BUILDS[request.param]
    lib = ctypes.CDLL(str(native._build(flags))) if flags else native.load()
    want = _expected_isa(request.param)
    if want is not None:
        assert lib.kvrun_gemv_isa() == want, (request.param, lib.kvrun_gemv_isa(), want)
    return lib


def _int4(N, K, G, g, bias=False):
    codes = torch.randint(0, 16, (N, K), generator=g)
    c = codes.view(N, K // G, 2, G // 2)
    q = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(N, K // 2).to(torch.uint8)
    s = (torch.rand(N, K // G, generator=g) * 0.02 + 1e-3).half()
    m = (-8 * s.float() + 0.01 * torch.randn(N, K // G, generator=g)).half()
    return {"kind": "int4", "qweight": q, "scales": s, "mins": m, "group": G,
            "bias": torch.randn(N, generator=g) if bias else None}


def _int8(N, K, g, bias=False):
    q = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)       # -128 too
    return {"kind": "int8", "qweight": q, "scales": torch.rand(N, generator=g) * 0.01 + 1e-4,
            "bias": torch.randn(N, generator=g) if bias else None}


def _input(B, K, g):
    """Gaussian rows with an outlier column and an all-zero block (scale 0)."""
    x = torch.randn(B, K, generator=g)
    x[:, 5] *= 40
    x[:, 32:min(64, K)] = 0
    return x


# (kind, N, K, G): N = 13, 17, 33, 70, 9 leave a partial 16-row block; int8 K = 40, 100, 167,
# 1000 a partial 32-column block; int4 K is a multiple of G
SHAPES = [("int4", 13, 96, 32), ("int4", 17, 160, 32), ("int4", 70, 576, 32), ("int4", 9, 192, 64),
          ("int4", 7, 192, 96),
          ("int4", 33, 384, 128), ("int4", 5, 2048, 32), ("int8", 13, 40, 0), ("int8", 70, 100, 0),
          ("int8", 33, 167, 0), ("int8", 6, 576, 0), ("int8", 3, 1000, 0), ("int8", 17, 2048, 0)]


def _weight(kind, N, K, G, g, bias):
    return _int4(N, K, G, g, bias) if kind == "int4" else _int8(N, K, g, bias)


@pytest.mark.parametrize("B", [1, 3, 5, 8, 9, 13, 32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_integer_gemv_equals_the_reference(lib, shape, B):
    """The int32 block sums are exact on both sides, so only the fp32 accumulation of the
    scaled block terms differs: per output K/32 fused steps, so the error is a few K/32
    ulps of the terms' magnitude sum (1e-5 of it allows ~80 ulps at K = 2048; one wrong
    code, scale, row or column is of the order of a whole term, >= 1e-3 of the sum)."""
    g = torch.Generator().manual_seed(B * 1000 + shape[2])
    w = _weight(*shape, g, bias=B % 2 == 1)
    x = _input(B, shape[2], g)
    y = gemv(w, x, "int", lib=lib)
    ref, mag = gemv_int_reference(w, x)
    assert ((y.double() - ref).abs() <= 1e-5 * mag + 1e-6).all(), ((y.double() - ref).abs() / mag).max()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_rows_and_threads_change_nothing(lib, shape):
    """Row b of a B-row call equals a one-row call bit for bit (every tile shape, the last
    partial tile: 13 rows are a whole 8-row tile and 5 with VNNI, 4 + 4 + 4 + 1 on AVX2),
    and two threads equal one."""
    g = torch.Generator().manual_seed(shape[2])
    w = _weight(*shape, g, bias=True)
    x = _input(13, shape[2], g)
    y = gemv(w, x, "int", lib=lib)
    single = torch.cat([gemv(w, x[b:b + 1], "int", lib=lib) for b in range(13)])
    assert torch.equal(y, single)
    assert torch.equal(gemv(w, x, "int", nthreads=2, lib=lib), y)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_every_build_gives_the_same_bits(lib, shape):
    """The builds compute the same int32 sums and the same fp32 operations in the same order
    per output, so AVX2 and plain C equal the default build bit for bit."""
    g = torch.Generator().manual_seed(shape[1] + shape[2])
    w = _weight(*shape, g, bias=True)
    x = _input(9, shape[2], g)
    assert torch.equal(gemv(w, x, "int", lib=lib), gemv(w, x, "int"))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] >= 576], ids=lambda s: "-".join(map(str, s)))
def test_integer_gemv_is_near_the_fp32_gemv(shape):
    """Against the fp32 path (the dequantized GEMV, tests/model/test_decode_layer.py): off only by
    the int16 rounding of the input, |x - x_q| <= d/2 = max|x| / 65534 per element of a
    block of 32: ~2e-5 of the output's norm for Gaussian rows (int8 codes per 4 columns gave
    ~3e-3). Guards the reference and the kernel against one shared misreading of the weight
    layout, and the input format's fidelity."""
    g = torch.Generator().manual_seed(7)
    w = _weight(*shape, g, bias=False)
    x = torch.randn(8, shape[2], generator=g)
    y, y32 = gemv(w, x, "int"), gemv(w, x, "fp32")
    assert (y - y32).norm() / y32.norm() < 1e-4


@pytest.mark.parametrize("kind, K, G", [("int8", 100, 0), ("int8", 167, 0), ("int4", 96, 32),
                                        ("int4", 192, 64), ("int4", 384, 128)])
def test_kernel_codes_are_quantize_inputs(lib, kind, K, G):
    """The C quantizer (gi_quantize) gives quantize_input's codes and scales, ties included,
    in the order each weight layout reads them: through an identity weight (s = 1, m = 0),
    y[n] = d_j q_n, one product, rounded once on both sides."""
    g = torch.Generator().manual_seed(K)
    x = torch.randint(-254, 255, (3, K), generator=g).float() / 2          # many halves
    x[:, ::QB] = 32767.0                                                # d = 1: ties stay ties
    x[1, 40:60] = 0
    x[2] *= torch.rand(K, generator=g) * 3                              # other scales
    eye = torch.eye(K)
    if kind == "int8":
        w = {"kind": "int8", "qweight": eye.to(torch.int8), "scales": torch.ones(K)}
    else:
        c = eye.view(K, K // G, 2, G // 2).to(torch.uint8)
        w = {"kind": "int4", "qweight": (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(K, K // 2),
             "scales": torch.ones(K, K // G).half(), "mins": torch.zeros(K, K // G).half(), "group": G}
    q, d = quantize_input(x)
    assert torch.equal(gemv(w, x, "int", lib=lib), q.float() * d.repeat_interleave(QB, 1)[:, :K])


def _fidelity_tool_and_model(tmp_path):
    """tools/gemv_fidelity.py as a module, and a tiny int4 model (64 tokens) to run it on."""
    import kvrun
    from kvrun.convert import convert_hf
    from tiny import write_tiny_hf
    fid = load_tool("gemv_fidelity")
    convert_hf(write_tiny_hf(tmp_path / "hf", C=128, I=96), tmp_path / "m", dtype="fp32",
               weights="int4", group=32)
    return fid, kvrun.load(tmp_path / "m", ctx=64)


def test_fidelity_tool_scores_both_paths_through_the_native_step(tmp_path, monkeypatch):
    """tools/gemv_fidelity.py compare(): every scored token runs through the native step of
    each path (both steps' layer calls counted), and the paths differ, slightly."""
    from kvrun.model.native_step import NativeDecodeStep
    fid, m = _fidelity_tool_and_model(tmp_path)
    paths = []                                       # each native step's GEMV path
    run = NativeDecodeStep._run
    monkeypatch.setattr(NativeDecodeStep, "_run", lambda self, *a: (paths.append(self.gemv),
                                                                    run(self, *a))[1])
    wins = [list(range(3, 67)), list(range(70, 134))]
    s = fid.compare(m, wins, "fp16")
    assert s["n"] == 2 * 31 and len(paths) == 2 * 31      # 31 steps of both windows, per path
    assert sorted(set(paths)) == ["fp32", "int"] and paths.count("int") == paths.count("fp32")
    assert 0 < s["kld"] / s["n"] < 0.01 and s["top1"] >= 0.9 * s["n"]      # measured 0.0014, 61/62


def test_fidelity_tool_shared_cache_keeps_only_the_fp32_paths_writes(tmp_path, monkeypatch):
    """compare(shared=True): before every step the int path gets a fresh copy of the fp32
    path's caches, so only the fp32 path's writes persist: both paths step at the same
    lengths, and no int step sees a cache an int step wrote before."""
    from kvrun.model.native_step import NativeDecodeStep
    fid, m = _fidelity_tool_and_model(tmp_path)
    lens = {"fp32": [], "int": []}                   # each step's cache lengths, per path
    run = NativeDecodeStep._run

    def counted(self, ids, pos, caches):
        lens[self.gemv].append([c.seq_len for c in caches])
        if self.gemv == "int":
            assert not any(getattr(c, "stepped_by_int", False) for c in caches)
        out = run(self, ids, pos, caches)
        for c in caches:
            c.stepped_by_int = self.gemv == "int"
        return out
    monkeypatch.setattr(NativeDecodeStep, "_run", counted)
    wins = [list(range(3, 67)), list(range(70, 134))]
    s = fid.compare(m, wins, "kivi-4", shared=True)
    assert s["n"] == 2 * 31 and 0 < s["kld"] / s["n"] < 0.01
    assert lens["int"] == lens["fp32"] == [[32 + t] * 2 for t in range(31)]


@pytest.mark.parametrize("bits,block", [(8, 32), (8, 5), (16, 32), (3, 4)])
def test_act_quant_tool_rounds_each_block_to_its_own_scale(bits, block):
    """tools/act_quant_fidelity.py rounded(): per block of `block` columns (a short last block
    its own), integers of at most 2^(bits-1) - 1 times amax / that; a zero block stays zero."""
    tool = load_tool("act_quant_fidelity")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, generator=g) * torch.logspace(-2, 2, 70)
    x[1, :block] = 0
    y = tool.rounded(x, bits, block)
    qmax = (1 << (bits - 1)) - 1
    for c0 in range(0, 70, block):
        xb, yb = x[:, c0:c0 + block], y[:, c0:c0 + block]
        d = xb.abs().amax(-1, keepdim=True) / qmax
        q = yb / torch.where(d > 0, d, 1.0)
        torch.testing.assert_close(q, q.round(), atol=1e-3, rtol=1e-6)  # integers of one scale
        assert q.round().abs().max() <= qmax
        assert ((yb - xb).abs() <= d / 2 * (1 + 1e-5) + 1e-12).all()   # to the nearest one
    assert (y[1, :block] == 0).all()


def test_act_quant_tool_rounds_only_the_hooked_modules(tmp_path):
    """compare(): 16-bit inputs move a tiny int4 model's predictions by almost nothing, 3-bit
    ones by far more; the hooks are gone afterwards (the exact run again gives the same bits)."""
    tool = load_tool("act_quant_fidelity")
    fid, m = _fidelity_tool_and_model(tmp_path)
    wins = [list(range(3, 133)), list(range(133, 3, -1))]          # 2 chunks of 65 each
    exact = [tool.window_logprobs(m, w, chunk=65) for w in wins]
    mods = tool.gemv_modules(m)
    assert {"q_proj", "down_proj"} <= set(mods)
    everything = [x for v in mods.values() for x in v]
    kl16, top16 = tool.compare(m, wins, exact, everything, 16, 32, chunk=65)
    kl3, top3 = tool.compare(m, wins, exact, everything, 3, 32, chunk=65)
    assert 0 <= kl16 < 1e-4 and top16 >= 0.98
    assert kl3 > 100 * max(kl16, 1e-9), (kl3, kl16)
    assert not any(x._forward_pre_hooks for x in everything)
    assert torch.equal(tool.window_logprobs(m, wins[0], chunk=65), exact[0])
