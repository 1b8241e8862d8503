"""Making a cache and its bytes before it is made (runtime/kv/build.py): the accounting
equals what build_cache allocates, the fp16 denominator of every ratio, and the
refusals check_kv and make_cache say in one line."""
import pytest

from kvrun.errors import KvrunError
from kvrun.kv.arena import KVArena
from kvrun.kv.build import build_cache, fp16_bytes, kv_bytes_at, kv_ratio_at, make_cache
from kvrun.kv.config import parse_kv
from test_arena import CFG
from tiny import tiny_config


@pytest.mark.parametrize("spec", ["kivi-2", "tada-4", "gear", "int8/kivi-4", "fp16"])
def test_byte_accounting_equals_allocated_storage(spec):
    kv = parse_kv(spec, residual=64, group=32, tada_mu="int8")
    a = build_cache(CFG, 333, kv)
    nb = a.nbytes()
    if isinstance(a, KVArena):
        allocated = sum(t.nbytes for st in a.k_store + a.v_store for t in st.values())
        assert sum(nb.values()) == allocated + a.win_k.nbytes + a.win_v.nbytes
        assert nb["window"] == a.win_k.nbytes + a.win_v.nbytes
    else:
        assert sum(nb.values()) == a.k.nbytes + a.v.nbytes
    assert {k: v for k, v in nb.items() if v} == {k: v for k, v in kv_bytes_at(CFG, kv, 333).items() if v}


def test_fp16_bytes_counts_a_sliding_layer_up_to_its_window():
    """Tiny Gemma 3: five sliding layers of window 16 and one global, one KV head of D 32 (a
    token's K and V in fp16: 128 bytes per layer)."""
    cfg = tiny_config("gemma3")
    assert fp16_bytes(cfg, 10) == 128 * 10 * 6
    assert fp16_bytes(cfg, 100) == 128 * (16 * 5 + 100)
    assert fp16_bytes(tiny_config(), 100) == 2 * 2 * 16 * 2 * 100 * 2     # 2 layers, Hkv 2, D 16


@pytest.mark.parametrize("spec", ["fp16", "kivi-4", "int8"])
def test_the_ratio_is_the_bytes_over_fp16(spec):
    n = 300
    assert kv_ratio_at(CFG, spec, n) == sum(kv_bytes_at(CFG, spec, n).values()) / fp16_bytes(CFG, n)


def test_a_shift_is_refused_on_a_model_with_sliding_layers():
    with pytest.raises(KvrunError, match="not supported on a model with sliding-window layers"):
        build_cache(tiny_config("gemma3"), 64, parse_kv("fp16", ctx_policy="shift"))


def test_a_cache_larger_than_the_memory_is_one_error(monkeypatch):
    monkeypatch.setattr("kvrun.kv.build.memory_bytes", lambda: 2**20)
    with pytest.raises(KvrunError, match=r"context size 100000: the fp16 KV cache would take "
                                         r"0\.0 GiB, more than this machine's 0\.0 GiB"):
        make_cache(tiny_config(), 100000, "fp16")
    assert make_cache(tiny_config(), 64, "fp16").max_ctx == 64               # 16 KiB: it fits


def test_context_shift_is_refused_with_nope_layers():
    """A shift re-rotates cached keys by RoPE; SmolLM3's NoPE layers have none to undo."""
    from kvrun.kv.config import KVConfig
    from tiny import tiny_config
    cfg = tiny_config(nope_layers=[1])
    with pytest.raises(KvrunError, match="NoPE"):
        build_cache(cfg, 64, KVConfig.from_settings(k_method="fp16", v_method="fp16", ctx_policy="shift"))
    assert build_cache(tiny_config(), 64, KVConfig.from_settings(k_method="fp16", v_method="fp16",
                                                                 ctx_policy="shift")) is not None
