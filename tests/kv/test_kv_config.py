"""The KV configuration (runtime/kv/config.py): the --kv spec and its settings, the refusals
of bad ones in one line, labels, and the flat settings a profile stores."""
import pytest

from kvrun.errors import KvrunError
from kvrun.kv.build import build_cache
from kvrun.kv.config import parse_kv
from test_arena import CFG


@pytest.mark.parametrize("kw,match", [
    (dict(spec="kivi-5"), "valid: fp16"),
    (dict(spec="kivi-3"), "kivi-3 stores keys only"),
    (dict(spec="kivi-2", residual=100), "multiple of the group"),
    (dict(spec="gear-l", rank=32), "rank"),
    (dict(spec="gear", sparsity=60), "sparsity"),
    (dict(spec="tada-4", group=24), "multiple of 32"),
    (dict(spec="int8", group=48), "multiple of 32"),
    (dict(spec="kivi-2", group=16), "multiple of 32"),
    (dict(spec="tada-4", ctx_policy="evict"), "context policy"),
])
def test_config_errors(kw, match):
    with pytest.raises(KvrunError, match=match):
        parse_kv(**kw)


def test_v_group_must_divide_head_dim():
    with pytest.raises(KvrunError, match="does not divide"):
        build_cache(CFG, 100, parse_kv("kivi-2", v_group=48))


def test_group_suffix_sets_both_groups_and_labels():
    kv = parse_kv("kivi-4@64+rot")
    assert (kv.group, kv.v_group, kv.rotation.which) == (64, 64, "kv")
    assert kv.label() == "kivi-4@64+rot"
    assert parse_kv("kivi-2").label() == "kivi-2"
    assert parse_kv("kivi-2", group=64).label() == "kivi-2@64/32"
    for bad in ("kivi-4@", "kivi-4@x", "kivi-4@0"):
        with pytest.raises(KvrunError, match="after '@'"):
            parse_kv(bad)


def test_config_parts_and_flat_settings_round_trip():
    """KVConfig is its format plus three parts (context, rotation, eviction), made from flat
    setting names and written back as the same names (a profile's "kv" object)."""
    from kvrun.kv.config import SETTINGS, ContextPolicy, Eviction, KVConfig, Rotation
    kv = parse_kv("kivi-4+rot-k", residual=64, evict="h2o", budget=512, sinks=8,
                  evict_slack=32, rotate_seed=3)
    assert kv.context == ContextPolicy("error", 4)
    assert kv.rotation == Rotation("k", 3, None)
    assert kv.eviction == Eviction("h2o", 512, sinks=8, slack=32)
    assert kv.evict_tail() == (512 - 64 - 32) // 32 * 32
    flat = kv.settings()
    assert set(flat) == set(SETTINGS) and flat["evict_slack"] == 32 and flat["rotate"] == "k"
    assert KVConfig.from_settings(**flat) == kv
    again = kv.replace(evict="none", budget=None, ctx_policy="shift", n_keep=2)
    assert not again.eviction.on and again.context == ContextPolicy("shift", 2)
    assert again.rotation == kv.rotation and again.residual == 64     # the rest kept
    with pytest.raises(KvrunError, match="unknown KV setting 'window'"):
        KVConfig.from_settings(window=64)
