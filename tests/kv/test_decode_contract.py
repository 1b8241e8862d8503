"""One decode-step contract on every backend (runtime/kv/arena.py's module docstring): the
new tokens are rounded into the window, attention reads tail + window (the new tokens in
full precision), and only then are whole G-blocks flushed into the tail.

The same arena steps — one token at a time through a flush, then a 3-token chunk through
the next flush — run on torch, native and Triton (interpreter), each through the route the
model takes on that backend (`attend_new`: the fused window write where the layer's route
has one, else `attend`). Checked:
- after every step the cache bytes (tail storage, window, counts) are equal bit for bit
  on all backends, flush steps included;
- every step's output equals dense attention over the explicitly dequantized state the
  step started from plus its new rows (so a flushed block is attended in full precision
  at its flush step), within the backend's arithmetic tolerance.
A rotated V keeps the attend route everywhere; its rotation is a matrix product whose
summation order differs between C and torch, so there only the token counts must agree
(values may differ by an fp16 ulp and then a code at a rounding boundary); the output
check holds as for every codec.

TRITON_INTERPRET must be set before kvrun.kernels.triton is imported (test_write_attend.py).
"""
import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest                                                             # noqa: E402
import torch                                                              # noqa: E402
from torch.testing import assert_close                                    # noqa: E402

from attention_cases import dequantized_reference                         # noqa: E402
from kvrun.kernels import native                                           # noqa: E402
from kvrun.kernels.hadamard import rotate, unrotate                                 # noqa: E402
from kvrun.kv import build_cache, parse_kv                        # noqa: E402
from kvrun.kv.cache import NewKV                                  # noqa: E402
from kvrun.kernels.rope import Rope, apply_rope                           # noqa: E402
from tiny import tiny_config

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NATIVE = native.load() is not None
CFG = tiny_config(num_layers=1, num_heads=6, num_kv_heads=2, hidden_size=384,
                       max_position=1024)                                 # D = 64, GQA 3
H, Hkv, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
R = G = 32
N0 = 32 + R + G - 3                  # tail 32, window R + G - 3: the 3rd single token flushes
STEPS = [1, 1, 1, 1, 3] + [1] * 26 + [3]   # ... and the last chunk flushes again
# torch multiplies packed codes in bf16 (test_decode_attention.py's tolerance); native and
# Triton dequantize and accumulate in fp32 (native: its fp32 path, KVRUN_ATTN=fp32; the
# integer q.K over KIVI keys is checked against its own twin in test_int_attention.py)
TOL = {"torch": dict(atol=5e-2, rtol=0), "native": dict(atol=2e-4, rtol=1e-3),
       "triton": dict(atol=2e-5, rtol=1e-4)}


def _backends(method):
    out = ["torch"]
    if HAS_NATIVE:
        out.append("native")
    if HAS_TRITON and method in ("kivi-4", "tada-4/kivi-2"):     # ~3 s a run in numpy
        out.append("triton")
    return out


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    k0, v0 = (torch.randn(1, Hkv, N0, D, generator=g) for _ in range(2))
    steps = [(torch.randn(1, H, T, D, generator=g),                       # q after RoPE
              torch.randn(1, T, Hkv, D, generator=g).transpose(1, 2),     # K before RoPE
              torch.randn(1, Hkv, T, D, generator=g)) for T in STEPS]     # V rows
    return k0, v0, steps


def _snapshot(c):
    st = [{n: t.clone() for n, t in s.items()} for s in (c.k_store[0], c.v_store[0])]
    w = c.n_win[0]
    return (c.n_tail[0], w), st, c.win_k[0, :, :w].clone(), c.win_v[0, :, :w].clone()


def _run(backend, kv, monkeypatch):
    """Per step: (q, output, state before, state after, new K after RoPE, new V)."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    c = build_cache(CFG, 256, kv)
    k0, v0, steps = _inputs()
    c.ingest(k0, v0)
    rope = Rope(D, CFG.rope_theta, None, 512)
    out = []
    for q, k, v in steps:
        T = q.shape[2]
        before = _snapshot(c)
        pos = c.positions(T)
        cos, sin = rope.tables(pos, torch.float32)
        o = c.attend_new(0, q, NewKV(k, cos, sin, v=v))
        c.commit(T)
        out.append((q, o, before, _snapshot(c), apply_rope(k, cos, sin), v))
    return c, out


def _assert_same_state(a, b, exact=True):
    (na, sa, ka, va), (nb, sb, kb, vb) = a, b
    assert na == nb
    if exact:
        for x, y in zip(sa, sb):
            for name in x:
                assert torch.equal(x[name], y[name]), name
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("method,kw", [("kivi-4", {}), ("tada-4/kivi-2", {}), ("int8", {}),
                                       ("kivi-2", {}), ("gear", {}), ("kivi-4", {"rotate": "v"}),
                                       ("cb-3/cb-4", {})])
def test_every_backend_attends_then_flushes(monkeypatch, method, kw):
    kv = parse_kv(method, residual=R, group=G, **kw)
    runs = {be: _run(be, kv, monkeypatch) for be in _backends(method)}
    ref = runs["torch"][1]
    flushes = [i for i, st in enumerate(ref) if st[3][0][0] > st[2][0][0]]
    assert len(flushes) == 2 and STEPS[flushes[1]] == 3                  # both kinds of step
    for be, (c, steps) in runs.items():
        kt, vt = (c.k_codecs[0], c.k_store[0]), (c.v_codecs[0], c.v_store[0])
        rk, rv = c.rot_k[0], c.rot_v[0]             # cb: both, implied by the codecs
        for i, ((q, o, before, after, kn, vn), ref_step) in enumerate(zip(steps, ref)):
            _assert_same_state(after, ref_step[3], exact=rk is None and rv is None)
            # the reference reads the tail below the step's start (those bytes never change)
            (nt, _), _, kw0, vw0 = before
            vx = vn.to(c.wdtype) if rv is None else rotate(vn.float(), rv).to(c.wdtype)
            kx = kn.to(c.wdtype) if rk is None else rotate(kn.float(), rk).to(c.wdtype)
            qx = q if rk is None else rotate(q, rk)
            exp = dequantized_reference(qx, kt, vt, nt, kw0[None], vw0[None], kx, vx)
            exp = exp if rv is None else unrotate(exp, rv)
            assert_close(o.float(), exp, **TOL[be], msg=f"{be} step {i} (flush: {i in flushes})")


def test_flush_step_output_is_not_the_packed_blocks(monkeypatch):
    """The check above can fail: at a flush step, attention over the packed block differs
    from the contract's output by far more than any tolerance."""
    kv = parse_kv("kivi-2", residual=R, group=G)
    c, steps = _run("torch", kv, monkeypatch)
    i = next(i for i, st in enumerate(steps) if st[3][0][0] > st[2][0][0])
    q, o, before, after, kn, vn = steps[i]
    (nt, w), _, kw1, vw1 = after
    kt, vt = (c.k_codecs[0], c.k_store[0]), (c.v_codecs[0], c.v_store[0])
    T = kn.shape[2]
    packed = dequantized_reference(q, kt, vt, nt, kw1[None, :, :w - T],
                                   vw1[None, :, :w - T], kn.to(c.wdtype), vn.to(c.wdtype))
    assert (o.float() - packed).abs().max() > 0.1


def test_the_backend_resolves_the_fused_write_route_only_on_triton(monkeypatch):
    kv = parse_kv("kivi-4", residual=R, group=G)
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    c = build_cache(CFG, 256, kv)
    assert not c.writes_fused(0, 1) and c.routes[0].attention == "torch" and not c.routes[0].fused
    if HAS_TRITON:
        monkeypatch.setenv("KVRUN_BACKEND", "triton")
        t = build_cache(CFG, 256, kv)
        assert t.writes_fused(0, 1) and t.routes[0].pack == ("triton", "triton")
        assert c.backend == "torch" and not c.writes_fused(0, 1)  # chosen once, at construction
    if HAS_NATIVE:
        monkeypatch.setenv("KVRUN_BACKEND", "native")
        n = build_cache(CFG, 256, kv)
        assert n.backend == "native" and not n.writes_fused(0, 1)
        assert n.routes[0].fused and n.routes[0].pack == ("native", "native")


# -- every cache kind at the model's level: dense, and Gemma's rings beside an arena ---------

GEMMA = tiny_config("gemma3", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128,
                    max_position=1024)       # six layers: five sliding (window 16), one global
# Gemma 2: sliding and global layers alternate; attention logits soft-capped (at 3: the
# random scores here reach it)
GEMMA2 = tiny_config("gemma2", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                     hidden_size=128, sliding_window=16, attn_logit_softcapping=3.0,
                     max_position=1024)


def _state(c):
    """Every byte a cache holds (dense tensors, ring codes, arena tail + window, counts)."""
    inner = getattr(c, "inner", c)
    parts = [c.seq_len]
    if getattr(c, "ring", None) is not None:
        parts += [t.clone() for s in (c.ring.k, c.ring.v) for t in s.parts]
    if hasattr(inner, "k_store"):
        parts += [list(inner.n_tail), list(inner.n_win), inner.win_k.clone(), inner.win_v.clone()]
        parts += [t.clone() for st in inner.k_store + inner.v_store for t in st.values()]
    else:
        parts += [inner.k[:, :, :, :c.seq_len].clone(), inner.v[:, :, :, :c.seq_len].clone()]
    return parts


def _run_layers(backend, cfg, kv, monkeypatch):
    """The steps of `STEPS` through every layer of a cache built for `cfg`: per step the
    outputs of every layer and the cache's bytes after it."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    L, H, Hkv, Dh = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = build_cache(cfg, 256, kv)
    g = torch.Generator().manual_seed(1)
    c.ingest(*(torch.randn(L, Hkv, N0, Dh, generator=g) for _ in range(2)))
    rope = Rope(Dh, cfg.rope_theta, None, 512)
    out = []
    for T in STEPS:
        cos, sin = rope.tables(c.positions(T), torch.float32)
        outs = []
        for layer in range(L):
            q = torch.randn(1, H, T, Dh, generator=g)
            k, v = (torch.randn(1, Hkv, T, Dh, generator=g) for _ in range(2))
            outs.append(c.attend_new(layer, q, NewKV(k, cos, sin, v=v)))
        c.commit(T)
        out.append((outs, _state(c)))
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("arch,method", [("llama", "fp16"), ("llama", "fp32"),
                                         ("gemma3", "fp16"), ("gemma3", "kivi-4"),
                                         ("gemma3", "int8"), ("gemma2", "int8")])
def test_every_cache_kind_takes_the_same_steps_on_every_backend(monkeypatch, arch, method):
    """fp16 and fp32 arenas, and Gemma's 16-bit or quantized rings beside an arena (Gemma 2's
    with its soft-capped logits, natively; tests/kernels/test_softcap.py has them on Triton too):
    the same bytes after every step on every backend (the rings' one-token steps run the
    native ring kernel on the native backend, every width), outputs within the backend's
    tolerance of torch's (fp32 accumulation everywhere but torch's fp16 ring SDPA; torch
    multiplies packed tail codes in bf16)."""
    cfg = {"gemma3": GEMMA, "gemma2": GEMMA2}.get(arch, CFG)
    kv = parse_kv(method, residual=R, group=G)
    backends = ["torch"] + (["native"] if HAS_NATIVE else []) + \
               (["triton"] if HAS_TRITON and method == "kivi-4" else [])
    runs = {be: _run_layers(be, cfg, kv, monkeypatch) for be in backends}
    ref = runs["torch"]
    windows = cfg.layer_windows
    for be, steps in runs.items():
        for i, ((outs, state), (ref_outs, ref_state)) in enumerate(zip(steps, ref)):
            assert len(state) == len(ref_state)
            for j, (x, y) in enumerate(zip(state, ref_state)):
                assert _same(x, y), f"{be} step {i}: cache part {j} differs from torch"
            for layer, (o, r) in enumerate(zip(outs, ref_outs)):
                # a ring's rows are fp16 (the window dtype) and the torch step runs SDPA in
                # fp16 (q and the output rounded), the native kernel in fp32: its outputs
                # agree to an fp16 ulp; dense layers to fp32 summation order; an arena layer
                # as TOL says
                tol = (dict(atol=2e-3, rtol=0) if windows[layer] else
                       dict(atol=2e-4, rtol=1e-3) if kv.uncompressed else TOL["torch"])
                assert_close(o.float(), r.float(), **tol, msg=lambda m: f"{be} step {i} layer {layer}: {m}")


# -- evicting layers: compactions give the same bytes on every backend -------------------------

# the ingest fills the tail's 3 blocks and 62 window slots; the window reaches R + G = 64
# and the full tail compacts at steps 1 (a token), 15 (a token) and 27 (a 3-token chunk);
# the Triton interpreter takes ~0.2 s a step
EV_N0, EV_BUDGET = 158, R + G + 96
EV_STEPS = [1] * 6 + [3] * 9 + [1] * 3 + [3] * 10


def _evict_inputs(seed=2):
    """Random K / V rows, and queries that put ±8 on one channel per query head: a score
    is then one product (no summation order, nothing for torch's bf16 score ops to round),
    so the backends' attention masses differ in the softmax's last bits only and the
    policy keeps the same tokens on all of them. (With random queries torch's bf16 scores
    of int8 keys reorder near-equal scores, and the kept sets differ.)"""
    g = torch.Generator().manual_seed(seed)
    k0, v0 = (torch.randn(1, Hkv, EV_N0, D, generator=g) for _ in range(2))
    steps = []
    for T in EV_STEPS:
        d = torch.randint(0, D, (1, H, T, 1), generator=g)
        sign = torch.randint(0, 2, (1, H, T, 1), generator=g).float() * 16 - 8
        q = torch.zeros(1, H, T, D).scatter_(3, d, sign)
        steps.append((q, *(torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))))
    return k0, v0, steps


def _run_evicting(backend, kv, monkeypatch):
    """Per step: (q, output, state before, state after, new K, new V); K rows as given."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    c = build_cache(CFG, 512, kv)
    k0, v0, steps = _evict_inputs()
    c.ingest(k0, v0)
    out = []
    for q, k, v in steps:
        T = q.shape[2]
        before = _snapshot(c) + (c.ev.pos_tail[0][:, :c.n_tail[0]].clone(), c.ev.n_drop[0])
        c.positions(T)
        assert not c.writes_fused(0, T)
        o = c.attend(0, q, k, v)
        c.commit(T)
        out.append((q, o, before, _snapshot(c) + (c.ev.pos_tail[0][:, :c.n_tail[0]].clone(),
                                                  c.ev.n_drop[0]), k, v))
    return c, out


# the interpreter evaluates the masked rows of the Triton kernel's log-sum-exp store too
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")
@pytest.mark.parametrize("method,policy", [("kivi-4", "snapkv"), ("int8", "h2o")])
def test_evicting_layers_compact_the_same_bytes_on_every_backend(monkeypatch, method, policy):
    """With eviction the flush of a full tail is a compaction (the policy's selection from
    the attention mass, dirty blocks re-packed through dispatch.pack on the cache's
    backend): after every step the tail, the window, the counts and the kept positions are
    equal on every backend, and every output is attention over the state the step started
    from plus its new rows (the reference reads that state's own tail bytes)."""
    kv = parse_kv(method, residual=R, group=G, evict=policy, budget=EV_BUDGET)
    backends = ["torch"] + (["native"] if HAS_NATIVE else []) + (["triton"] if HAS_TRITON else [])
    runs = {be: _run_evicting(be, kv, monkeypatch) for be in backends}
    ref = runs["torch"][1]
    compactions = [i for i, st in enumerate(ref) if st[3][-1] > st[2][-1]]
    assert compactions == [1, 15, 27] and EV_STEPS[27] == 3
    for be, (c, steps) in runs.items():
        assert c.ev.n_compactions == runs["torch"][0].ev.n_compactions
        for i, ((q, o, before, after, kn, vn), ref_step) in enumerate(zip(steps, ref)):
            (na, sa, ka, va, pa, da), (nb, sb, kb, vb, pb, db) = after, ref_step[3]
            _assert_same_state((na, sa, ka, va), (nb, sb, kb, vb))
            assert torch.equal(pa, pb) and da == db, f"{be} step {i}: kept positions differ"
            (nt, _), st0, kw0, vw0 = before[:4]
            kt, vt = (c.k_codecs[0], st0[0]), (c.v_codecs[0], st0[1])
            exp = dequantized_reference(q, kt, vt, nt, kw0[None], vw0[None], kn.to(c.wdtype),
                                        vn.to(c.wdtype))
            assert_close(o.float(), exp, **TOL[be],
                         msg=f"{be} step {i} (compaction: {i in compactions})")


# -- the interface between the arena and its eviction policy --------------------------------

def test_eviction_writes_the_arena_only_through_its_methods():
    """ArenaEviction never assigns an arena field (win_k, n_win, n_tail, k_store, seq_len …,
    nor an element of one): it calls the arena's methods and returns counts."""
    import ast
    import inspect
    from kvrun.kv import arena_evict

    def base(t):            # what a target's chain of attributes / subscripts starts from
        while isinstance(t, (ast.Subscript, ast.Attribute)):
            if ast.unparse(t.value) == "self.a":
                return "arena"
            t = t.value
        return t.id if isinstance(t, ast.Name) else None

    tree = ast.parse(inspect.getsource(arena_evict))
    writes = [(node.lineno, ast.unparse(t)) for node in ast.walk(tree)
              if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
              for t in (t.elts if isinstance(t, ast.Tuple) else [t])
              if isinstance(t, (ast.Attribute, ast.Subscript)) and base(t) in ("a", "arena")]
    assert writes == []


@pytest.mark.parametrize("method", ["kivi-4", "int8"])
def test_compactions_pack_through_the_native_kernel(monkeypatch, method):
    """On the native backend eviction's flushes and compactions' re-packs go through the C
    kernel (dispatch.pack → native/pack.c), never through the codecs' torch pack."""
    from kvrun.kernels.codecs.base import Codec
    from kvrun.kernels.native import pack as native_pack
    if not HAS_NATIVE:
        pytest.skip("the native kernels did not build")
    monkeypatch.setenv("KVRUN_BACKEND", "native")
    calls = []
    real = native_pack.store
    monkeypatch.setattr(native_pack, "store", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr(Codec, "pack", lambda *a, **k: pytest.fail("torch pack"))
    cfg = tiny_config(num_layers=1, num_heads=4, num_kv_heads=2, hidden_size=256)
    c = build_cache(cfg, 1024, parse_kv(method, residual=32, group=32, evict="h2o", budget=160))
    assert c.backend == "native"
    g = torch.Generator().manual_seed(0)
    c.ingest(*(torch.randn(1, 2, 200, 64, generator=g) for _ in range(2)))
    for _ in range(40):
        c.positions(1)
        c.attend(0, torch.randn(1, 4, 1, 64, generator=g),
                 *(torch.randn(1, 2, 1, 64, generator=g) for _ in range(2)))
        c.commit(1)
    assert c.ev.n_compactions >= 2 and c.ev.n_repacked > 0 and calls
