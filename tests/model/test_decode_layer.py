"""The native decode step (runtime/model/native_step.py, kernels/native/decode_layer.c) against
the eager forward: on the fp32 GEMV path (KVRUN_GEMV=fp32) over the same weights dequantized
to fp32, on the integer path over linears that compute the integer GEMV's torch twin
(gemv_reference.py gemv_int_reference); int4 at every group, int8, q/k/v bias (Qwen2), the
fp32 arena and the compressed one, B rows at once, and the builds without AVX-512."""
import copy
import ctypes

import pytest
import torch
from torch.testing import assert_close

import kvrun
from kvrun.convert import convert_hf
from kvrun.kernels import native
from kvrun.model import qlinear
from kvrun.kv.config import parse_kv
from kvrun.model.llama import Transformer
from kvrun.model.native_step import _stored
from kvrun.kernels.native.gemv_reference import gemv_int_reference
from tiny import quantized_copy, write_tiny_hf

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")

# fp32 throughout on both sides: only the order of the sums differs
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dl")
    hf = write_tiny_hf(root / "hf", C=128, I=96)          # head dim 32: the packed codecs
    hf_bias = write_tiny_hf(root / "hfb", C=128, I=96, bias=True)
    out = {}
    for name, src, weights, group in [("int4-32", hf, "int4", 32), ("int4-64", hf, "int4", 64),
                                      ("int8", hf, "int8", 32), ("qwen2-int4", hf_bias, "int4", 32)]:
        convert_hf(src, root / name, dtype="fp32", weights=weights, group=group)
        out[name] = root / name
    return out


def _eager(monkeypatch):
    """The oracle: the eager forward with every quantized layer dequantized to fp32 (the
    attention backend stays the same on both sides)."""
    monkeypatch.setattr(Transformer, "native_step", lambda self, ids, cache: None)
    for cls in (qlinear.Int4Linear, qlinear.Int8Linear):
        monkeypatch.setattr(cls, "uses_fused_op", lambda self, rows: False)


@pytest.fixture
def int_gemv(monkeypatch):
    """The native step's GEMVs on the integer path (KVRUN_GEMV=int, the default)."""
    monkeypatch.setenv("KVRUN_GEMV", "int")


@pytest.fixture
def fp32_gemv(monkeypatch):
    """The native step's GEMVs on the fp32 path, the one equal to the dequantized eager
    forward to rounding (read when the step is built: each test loads its own model)."""
    monkeypatch.setenv("KVRUN_GEMV", "fp32")


def _int_linear(self, x):
    """A quantized linear as the integer path computes it (gemv_int_reference)."""
    y, _ = gemv_int_reference(_stored(self), x.reshape(-1, x.shape[-1]).float())
    return y.float().view(*x.shape[:-1], -1).to(x.dtype)


def _eager_int(monkeypatch):
    """The oracle of the integer path: the eager forward with every quantized linear
    computing the integer GEMV's torch twin."""
    monkeypatch.setattr(Transformer, "native_step", lambda self, ids, cache: None)
    for cls in (qlinear.Int4Linear, qlinear.Int8Linear):
        monkeypatch.setattr(cls, "forward", _int_linear)


def _step(m, cache, tok, monkeypatch, native_step, oracle=_eager):
    with monkeypatch.context() as mp:
        if not native_step:
            oracle(mp)
        return m.transformer(tok, cache)[:, -1]                         # (B, V)


def _compare(m, cache, prompt, steps, monkeypatch, tol=TOL, oracle=_eager):
    """Prefill eagerly, then `steps` greedy steps, each run twice from the same cache state
    (a deep copy): natively, then by `oracle`. Comparing step by step keeps the two from
    drifting apart: their K/V are stored in fp16, and a value that the two fp32 paths put
    on either side of an fp16 rounding boundary would otherwise make every later step of
    one path differ from the other's by far more than one step's summation-order error."""
    with monkeypatch.context() as mp:
        _eager(mp)
        logits = m.transformer(torch.as_tensor(prompt).view(1, -1), cache)[:, -1]
    ran = []
    from kvrun.model.native_step import NativeDecodeStep
    run = NativeDecodeStep._run
    monkeypatch.setattr(NativeDecodeStep, "_run", lambda self, *a: (ran.append(1), run(self, *a))[1])
    for _ in range(steps):
        tok = logits.argmax(-1)[:, None]                                # (1, 1)
        twin = copy.deepcopy(cache)
        got = _step(m, cache, tok, monkeypatch, True)
        logits = _step(m, twin, tok, monkeypatch, False, oracle)
        assert_close(got, logits, **tol)
        cache = twin                                                    # go on from the oracle
    assert len(ran) == steps                                            # the native step ran


@pytest.mark.usefixtures("fp32_gemv")
@pytest.mark.parametrize("name", ["int4-32", "int4-64", "int8", "qwen2-int4"])
@pytest.mark.parametrize("kv", ["fp32", "fp16", "kivi-4"])
def test_native_step_equals_the_dequantized_eager_step(models, monkeypatch, name, kv):
    """fp32 cache: the two steps differ by summation order only (TOL). fp16 caches round
    K/V (and the dense cache's SDPA q and output) to fp16 in both steps, and an input that
    the two paths put on either side of a rounding boundary changes by one fp16 ulp,
    2^-11 relative, and KIVI's 4-bit codes of a flushed block can move by one level: such
    flips moved these logits (|l| < 10) by up to 6e-3 (measured); a wrong weight row or
    position moves them by O(1)."""
    m = kvrun.load(models[name], ctx=256)
    cache = kvrun.kv.make_cache(m.cfg, 256, parse_kv(kv, residual=32, group=32))
    tol = TOL if kv == "fp32" else dict(atol=2e-2, rtol=0)
    _compare(m, cache, m.tokenize("the native step reads the stored bytes" * 2), 40, monkeypatch,
             tol=tol)


# The integer path against its oracle differs by the fp32 summation order, and by what that
# does to the int16 input codes: an input element the two sides compute an ulp apart lies
# near a code boundary for ~0.4 % of elements (32767 levels over 2^23 ulps), and they round
# it to neighbouring codes, 2^-15 of the block's max apart. Many such flips per step move
# these logits (|l| < 10) by up to 2.4e-3 (measured over every step of the tests below); a
# wrong weight, input, layout or block moves every step's logits by O(1).
INT_TOL = dict(atol=1e-2, rtol=0)


@pytest.mark.parametrize("name", ["int4-32", "int4-64", "int8", "qwen2-int4"])
@pytest.mark.usefixtures("int_gemv")
def test_integer_step_equals_the_eager_step_on_quantized_inputs(models, monkeypatch, name):
    """The integer GEMV path (KVRUN_GEMV=int) against the eager forward whose quantized
    linears compute gemv_int_reference: the same int16 input codes, exact block sums."""
    m = kvrun.load(models[name], ctx=256)
    cache = kvrun.kv.make_cache(m.cfg, 256, parse_kv("fp32"))
    _compare(m, cache, m.tokenize("the native step reads the stored bytes" * 2), 40, monkeypatch,
             oracle=_eager_int, tol=INT_TOL)


@pytest.mark.usefixtures("fp32_gemv")
def test_rows_are_a_batch_axis(models, monkeypatch):
    """B rows, each the next token of its own sequence on its own cache, in one call (the
    batched decode, engine/batch.py): each row's logits equal its sequence's eager step."""
    m = kvrun.load(models["int4-32"], ctx=64)
    cfg, B = m.cfg, 3
    prompts = torch.randint(3, 200, (B, 10), generator=torch.Generator().manual_seed(0))
    caches = [kvrun.kv.make_cache(cfg, 64, "fp32") for _ in range(B)]
    with monkeypatch.context() as mp:
        _eager(mp)
        logits = torch.stack([m.transformer(p[None], c)[0, -1] for p, c in zip(prompts, caches)])
    for _ in range(6):
        tok = logits.argmax(-1)[:, None]                                # (B, 1)
        twins = copy.deepcopy(caches)
        step = m.transformer.native_step(tok[:1], caches[0])
        assert step is not None
        got = step.rows(tok, caches)[:, 0]
        with monkeypatch.context() as mp:
            _eager(mp)
            logits = torch.stack([m.transformer(t[None], c)[0, -1] for t, c in zip(tok, twins)])
        assert_close(got, logits, **TOL)
        caches = twins                                                  # go on from the oracle


@pytest.fixture(params=["avx2", "c"])
def portable(request, monkeypatch):
    """The kernels built without AVX-512 ("avx2": its AVX2 micro-kernels, the plain C loops
    where the compiler vectorizes them) or without AVX2 too ("c": gemv_int.c's plain C)."""
    import kvrun.kernels.native.decode_layer as dl
    flags = ("-DKVRUN_NO_AVX512",) + (("-DKVRUN_NO_AVX2",) if request.param == "c" else ())
    lib = ctypes.CDLL(str(native._build(flags)))
    monkeypatch.setattr(dl, "load", lambda: lib)


@pytest.mark.usefixtures("fp32_gemv")
@pytest.mark.parametrize("name", ["int4-64", "int8"])
def test_portable_build_equals_the_eager_step(models, monkeypatch, portable, name):
    m = kvrun.load(models[name], ctx=128, kv="fp32")
    _compare(m, m.engine.cache, m.tokenize("portable loops"), 8, monkeypatch)


@pytest.mark.parametrize("name", ["int4-32", "int4-64", "int8"])
@pytest.mark.usefixtures("int_gemv")
def test_portable_build_integer_step(models, monkeypatch, portable, name):
    m = kvrun.load(models[name], ctx=128, kv="fp32")
    _compare(m, m.engine.cache, m.tokenize("portable loops of the integer path"), 20, monkeypatch,
             oracle=_eager_int, tol=INT_TOL)


def test_backend_torch_keeps_the_eager_step(models, monkeypatch):
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    m = kvrun.load(models["int4-32"], ctx=64)
    m.engine.prefill([5, 6, 7])
    m.engine.decode_step(8)
    assert getattr(m.transformer, "_step", None) is None


@pytest.mark.parametrize("gemv", ["fp32", "int"])
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("kv", ["fp32", "kivi-4"])
def test_gemma3_native_step_equals_the_eager_step(tmp_path, monkeypatch, weights, kv, gemv):
    """A tiny Gemma 3 (five sliding layers of window 16 with their own RoPE base, one global
    layer; QK-norm, sandwich norms, GeGLU, scaled embedding, tied int8 lm_head): the
    native step equals the eager step past the window, on the ring + dense or arena cache;
    fp32 GEMVs against the dequantized linears, integer ones against gemv_int_reference."""
    from tiny import make_tiny_model_dir
    monkeypatch.setenv("KVRUN_GEMV", gemv)
    src = make_tiny_model_dir(tmp_path / "g", architecture="gemma3", hidden_size=128,
                              num_heads=4, intermediate_size=96)
    m = kvrun.load(quantized_copy(src, tmp_path / weights, weights), ctx=256)
    from kvrun.model.native_step import supported
    assert supported(m.transformer)
    cache = kvrun.kv.make_cache(m.cfg, 256, parse_kv(kv, residual=32, group=32))
    tol = TOL if kv == "fp32" else dict(atol=2e-2, rtol=0)
    oracle = _eager if gemv == "fp32" else _eager_int
    if gemv == "int" and kv == "fp32":
        tol = INT_TOL
    _compare(m, cache, m.tokenize("sliding windows of sixteen tokens"), 40, monkeypatch, tol=tol,
             oracle=oracle)
