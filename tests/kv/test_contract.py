"""Every cache make_cache builds declares the contract (kv/contract.py `KVCache`): the model,
the engine and the reports ask it directly, never with getattr probes."""
import pytest
import torch

from kvrun.kv import make_cache, parse_kv
from kvrun.kv.arena import KVArena
from kvrun.kv.contract import KVCache
from kvrun.kv.ring import LayeredKVCache
from tiny import tiny_config

SPECS = ["fp16", "fp32", "kivi-4", "int8", "kivi-4/kivi-2+rot"]
CASES = ([(a, s) for a in ("llama", "gemma3") for s in SPECS]
         + [("llama", "tada-4")])             # TaDA needs > 1 KV head: not the tiny Gemma


@pytest.mark.parametrize("arch, spec", CASES)
def test_every_cache_is_a_kvcache(arch, spec):
    cfg = tiny_config(arch)
    c = make_cache(cfg, 128, parse_kv(spec, residual=32, group=32, v_group=16))
    assert isinstance(c, KVCache)
    inner = c.inner if arch == "gemma3" else c
    assert isinstance(c, LayeredKVCache) == (arch == "gemma3") and isinstance(inner, KVArena)
    assert c.kv is inner.kv and c.label() == c.kv.label()
    assert c.label().split("@")[0].split("+")[0] == spec.split("+")[0]
    assert c.n_layers == cfg.num_layers
    assert inner.lossless == (spec in ("fp16", "fp32")) and c.n_compressed() == 0
    assert max(c.n_tail) == 0 and c.seq_len == 0 and c.max_ctx == 128 and c.can_shift is False
    # the fused-write route: Triton's only (torch is the oracle, native fuses the whole
    # step), for any codec of an unrotated layer, for as many tokens as the window has free
    # slots; a sliding (ring) layer never takes it
    fused = "+rot" not in spec
    for backend in ("native", "torch", "triton"):
        inner.backend = backend
        j = c.route[cfg.num_layers - 1][1] if arch == "gemma3" else 0       # a full layer
        full = cfg.num_layers - 1 if arch == "gemma3" else 0
        assert c.route[full] == (False, j) if arch == "gemma3" else full == j == 0
        assert inner.writes_fused(j, 1) == (backend == "triton" and fused), backend
        assert inner.routes[j].fused == (backend == "native")
        assert inner.writes_fused(j, inner.win_k.shape[2] + 1) is False     # over the free slots
        if arch == "gemma3":
            assert c.route[0][0] is True                     # layer 0 slides: its ring attends
    assert c.bytes_per_token() == sum(c.nbytes().values()) / 128
    lines = c.report()
    assert any("ring:" in ln for ln in lines) == (arch == "gemma3")


def test_evicting_cache_reports_its_policy():
    cfg = tiny_config()
    c = make_cache(cfg, 256, parse_kv("kivi-4", residual=32, group=32, v_group=16, evict="snapkv", budget=128))
    assert isinstance(c, KVArena) and c.label().startswith("kivi-4")
    assert any("eviction: snapkv" in ln for ln in c.report())


def test_a_cache_missing_part_of_the_contract_cannot_be_made():
    class Half(KVCache):
        def positions(self, T):
            return torch.arange(T)
    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize("spec", ["fp16", "fp32"])
def test_all_rows_gives_back_what_ingest_took(spec):
    """rows / all_rows invert ingest: every token of a full-attention layer, a sliding
    layer's last window (earlier positions zero), in the model's space and the asked dtype."""
    cfg = tiny_config("gemma3")
    c = make_cache(cfg, 128, parse_kv(spec, residual=32, group=32))
    g = torch.Generator().manual_seed(0)
    n = 70
    k, v = (torch.randn(cfg.num_layers, 1, n, cfg.head_dim, generator=g).half().float() for _ in range(2))
    c.ingest(k, v)
    gk, gv = c.all_rows(torch.float16)
    assert gk.dtype == torch.float16 and gk.shape == k.shape
    for layer, w in enumerate(cfg.layer_windows):
        held = min(w, n) if w else n
        assert torch.equal(gk[layer, :, n - held:].float(), k[layer, :, n - held:])
        assert torch.equal(gv[layer, :, n - held:].float(), v[layer, :, n - held:])
        assert not gk[layer, :, :n - held].any()


@pytest.mark.parametrize("policy", ["error", "shift"])
def test_context_shift_is_part_of_the_contract(policy):
    """shift_keep / shift_plan / shift are declared by KVCache (the engine calls them): a
    cache that cannot shift says so in one line; one that can keeps --keep rounded to a
    tail block, drops half of the rest, and counts the dropped tokens."""
    cfg = tiny_config()
    c = make_cache(cfg, 128, parse_kv("fp16", residual=32, group=32, ctx_policy=policy, n_keep=4))
    assert c.can_shift == (policy == "shift")
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(cfg.num_layers, cfg.num_kv_heads, 100, cfg.head_dim, generator=g).half()
            for _ in range(2))
    c.ingest(k, v)
    if policy == "error":
        assert KVCache.shift_keep(c) == 0
        with pytest.raises(NotImplementedError, match="cannot shift"):
            KVCache.shift(c)
        return
    a, nd = c.shift_plan()
    assert (a, nd) == (32, (100 - 32) // 2) and c.shift_keep() == 32
    assert c.shift() == nd and c.seq_len == 100 - nd


def test_a_context_shorter_than_the_window_takes_the_fused_write_on_triton_too():
    """The window write ops write rows into free slots and never pack, so they take any
    window: a cache whose context is shorter than R + G (its window is max_ctx slots) takes
    the fused write on Triton like a full one; torch (the oracle) never takes it."""
    cfg = tiny_config()
    short = make_cache(cfg, 40, parse_kv("kivi-4", residual=32, group=32, v_group=16))
    full = make_cache(cfg, 128, parse_kv("kivi-4", residual=32, group=32, v_group=16))
    assert short.win_k.shape[2] == 40 and full.win_k.shape[2] == 64
    for backend, want in (("triton", True), ("torch", False)):
        for c in (short, full):
            c.backend = backend
        assert short.writes_fused(0, 1) is want and full.writes_fused(0, 1) is want, backend


def test_a_layer_without_a_kernel_is_known_when_the_cache_is_built():
    """Routes are resolved at construction (kernels/backend.py): a native cache whose group
    is not whole 32-token tiles attends on torch, and says so in its report before any step;
    a torch cache and a covered native one say nothing."""
    from kvrun.kernels import native
    from kvrun.kernels.backend import named
    if native.load() is None:
        pytest.skip("the native kernels did not build")
    cfg = tiny_config()
    odd = make_cache(cfg, 128, parse_kv("fp16", residual=32, group=16), backend=named("native"))
    assert [r.attention for r in odd.routes] == ["torch"] * cfg.num_layers
    assert not any(r.fused for r in odd.routes)
    line, = odd.report()
    assert line.startswith(f"  kernels: {cfg.num_layers} of {cfg.num_layers} layers attend on torch")
    assert "group 16" in line
    good = make_cache(cfg, 128, parse_kv("kivi-4", residual=32, group=32, v_group=16),
                      backend=named("native"))
    assert all(r.fused and r.pack == ("native", "native") for r in good.routes) and good.report() == []
    ref = make_cache(cfg, 128, parse_kv("fp16", residual=32, group=16), backend=named("torch"))
    assert ref.report() == [] and ref.backend == "torch"
