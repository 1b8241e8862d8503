"""Prefill chunks of 2 to CHUNK_MAX_ROWS tokens on the native layer kernels
(runtime/model/native_step.py `chunk`): the T positions are the GEMV rows of the per-layer
route, MAX_ROWS at a time, attention one `attend` over the chunk as in the eager forward.

Checked against the eager forward with every linear layer dequantized to fp32 (the exact
product of the stored weights; the eager forward's own few-row route, torch's weight-only
op, rounds its inputs to bf16): the chunk's logits agree to the integer GEMVs' rounding
(KL and top-1), on the llama and Gemma 3 layers (rings filling and wrapping inside a
chunk), chunk after chunk; `last_only` gives the last row of the full result bit for bit;
what the chunk route does not take (one token, more rows than the kernels, a cache that
takes K before RoPE, the torch backend) stays on the other routes."""
import pytest
import torch

import kvrun.model.qlinear as qlinear
from kvrun.kernels import native
from kvrun.kernels.native.decode_layer import MAX_ROWS
from kvrun.kv import build_cache
from kvrun.kv.config import parse_kv
from kvrun.model.native_step import CHUNK_MAX_ROWS
from tiny import NATIVE_GEMMA, NATIVE_LLAMA, load_quantized_tiny

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")

CTX = 256


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_quantized_tiny(tmp_path_factory.mktemp("chunk"), "int4", CTX, **NATIVE_LLAMA)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Int8 weights, as Gemma 3 270M's; a window of 23, which chunks fill and wrap."""
    return load_quantized_tiny(tmp_path_factory.mktemp("chunk_gemma"), "int8", CTX, **NATIVE_GEMMA)


def _prefill(m, ids, sizes, kv, monkeypatch, native_chunk):
    """Logits (sum(sizes), V) of feeding ids in chunks of `sizes` to a fresh cache, through
    the native chunk route or the eager forward with fp32 dequantized weights; and how many
    chunks the native route ran."""
    tr = m.transformer
    cache = build_cache(m.cfg, CTX, parse_kv(kv, residual=32, group=32))
    step = tr.native_step(torch.tensor([ids[:2]]), cache)
    assert step is not None
    ran = []
    chunk = step.chunk
    monkeypatch.setattr(step, "chunk", lambda *a, **k: ran.append(1) or chunk(*a, **k))
    if not native_chunk:
        monkeypatch.setattr(step, "applies_chunk", lambda ids, cache: False)
        monkeypatch.setattr(qlinear, "QUANT_OP_MAX_ROWS", 0)
    out, s = [], 0
    for n in sizes:
        out.append(tr(torch.tensor([ids[s:s + n]]), cache)[0])
        s += n
    monkeypatch.undo()
    return torch.cat(out), len(ran)


def _agree(a, ref, kv):
    """KL < 1e-4 at every position for a 16-bit cache; a quantized one stores K/V that
    differ by the GEMVs' rounding, which flips a code at a rounding boundary now and then
    (1 to 4 bytes of 8192 in kivi-4's tail here), so KL < 1e-4 on average and < 5e-3 at
    every position. A top-1 token that differs is a near-tie in the reference (the random
    model's logits hold many)."""
    lp, lr = a.log_softmax(-1), ref.log_softmax(-1)
    kl = (lr.exp() * (lr - lp)).sum(-1)
    assert float(kl.mean()) < 1e-4, float(kl.mean())
    assert float(kl.max()) < (1e-4 if kv == "fp16" else 5e-3), float(kl.max())
    top, rtop = a.argmax(-1), ref.argmax(-1)
    rows = torch.nonzero(top != rtop)[:, 0]
    gap = ref[rows, rtop[rows]] - ref[rows, top[rows]]
    assert rows.numel() <= a.shape[0] // 20 and bool((gap < 0.02).all()), (rows, gap)


@pytest.mark.parametrize("kv", ["fp16", "kivi-4", "int8"])
@pytest.mark.parametrize("sizes", [[2], [7, 32, 1, 5], [MAX_ROWS + 1, 31, 3], [CHUNK_MAX_ROWS, 19]])
def test_llama_chunks_equal_the_fp32_forward(llama, kv, sizes, monkeypatch):
    ids = torch.randint(3, llama.cfg.vocab_size, (sum(sizes),), generator=torch.Generator().manual_seed(1)).tolist()
    got, ran = _prefill(llama, ids, sizes, kv, monkeypatch, True)
    ref, _ = _prefill(llama, ids, sizes, kv, monkeypatch, False)
    assert ran == sum(n > 1 for n in sizes)
    _agree(got, ref, kv)


@pytest.mark.parametrize("kv", ["fp16", "kivi-4", "int8+ring8"])
def test_gemma_chunks_fill_and_wrap_the_rings(gemma, kv, monkeypatch):
    sizes = [20, 9, 45, 1, 17]                       # the window of 23 wraps inside chunks
    ids = torch.randint(3, gemma.cfg.vocab_size, (sum(sizes),), generator=torch.Generator().manual_seed(2)).tolist()
    got, ran = _prefill(gemma, ids, sizes, kv, monkeypatch, True)
    ref, _ = _prefill(gemma, ids, sizes, kv, monkeypatch, False)
    assert ran == 4
    _agree(got, ref, kv)


@pytest.mark.parametrize("T", [20, MAX_ROWS + 7])
def test_last_only_is_the_last_row(llama, T):
    ids = list(range(10, 10 + T))
    outs = []
    for last in (False, True):
        cache = build_cache(llama.cfg, CTX, parse_kv("kivi-4"))
        outs.append(llama.transformer(torch.tensor([ids]), cache, last_only=last)[0])
    assert outs[0].shape[0] == T and outs[1].shape[0] == 1
    assert torch.equal(outs[1][0], outs[0][-1])


def test_routes_it_does_not_take(llama, monkeypatch):
    tr = llama.transformer
    cache = build_cache(llama.cfg, CTX, parse_kv("fp16"))
    assert tr.native_step(torch.tensor([[5] * 2]), cache) is not None
    assert tr.native_step(torch.tensor([[5] * CHUNK_MAX_ROWS]), cache) is not None
    assert tr.native_step(torch.tensor([[5] * (CHUNK_MAX_ROWS + 1)]), cache) is None
    assert tr.native_step(torch.tensor([[5] * 2] * 2), cache) is None          # two sequences
    cache.backend = "torch"                 # a cache of another backend: the eager forward
    assert tr.native_step(torch.tensor([[5] * 4]), cache) is None
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    assert tr.native_step(torch.tensor([[5] * 4]), build_cache(llama.cfg, CTX, parse_kv("fp16"))) is None
