"""A model's configuration (runtime/model/config.py): fields derived in __post_init__, the
layer kinds, the round trip through config.json keeping known keys only, and bad settings
refused in one line."""
import json

import pytest

from kvrun.errors import KvrunError
from kvrun.model.config import ModelConfig
from tiny import tiny_config


def test_derived_fields():
    c = ModelConfig(architecture="qwen2", hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2)
    assert (c.head_dim, c.rotary_dim, c.query_pre_attn_scalar) == (16, 16, 16.0)
    assert c.attention_bias is True and c.q_scale == 1.0 and c.qk_norm == ""
    assert c.layer_types == ["full_attention"] * 2 and c.rope_local_theta == c.rope_theta
    g = tiny_config("gemma3", query_pre_attn_scalar=128.0)        # head dim 32
    assert g.qk_norm == "head" and g.q_scale == pytest.approx((32 / 128) ** 0.5)
    assert ModelConfig(weights="int4").weight_group == 32


def test_config_json_round_trip_keeps_known_keys(tmp_path):
    c = tiny_config("gemma3")
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**c.to_dict(), "a_key_from_elsewhere": 1}))
    again = ModelConfig.from_file(p)
    assert again == c and again.layer_windows == c.layer_windows
    assert "num_experts" not in tiny_config().to_dict() and "layer_types" not in tiny_config().to_dict()


@pytest.mark.parametrize("text,msg", [("{", "not valid JSON"), ('{"architecture": "llama"}', "not a kvrun config"),
                                      ('{"format": "kvrun", "num_heads": "x"}', "num_heads must be an integer")])
def test_a_bad_config_file_is_one_error(tmp_path, text, msg):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(KvrunError, match=msg):
        ModelConfig.from_file(p)


@pytest.mark.parametrize("kw,msg", [(dict(architecture="gpt2"), "unsupported architecture 'gpt2'"),
                                    (dict(num_kv_heads=3), "num_heads 4 is not a multiple of num_kv_heads 3"),
                                    (dict(rotary_dim=5), "rotary_dim 5 must be even"),
                                    (dict(nope_layers=[2]), "nope_layers must be layer indices below 2"),
                                    (dict(weights="int2"), "unknown weight format 'int2'")])
def test_bad_settings_are_refused(kw, msg):
    with pytest.raises(KvrunError, match=msg):
        tiny_config(**kw)


def test_layer_kinds_from_the_config():
    c = tiny_config("gemma3", num_layers=12, sliding_window=7)
    assert c.layer_windows == [7] * 5 + [0] + [7] * 5 + [0]
    assert tiny_config().layer_windows == [0, 0]
    with pytest.raises(KvrunError, match="layer_types must list 2 entries"):
        tiny_config(layer_types=["full_attention"])
    with pytest.raises(KvrunError, match="need sliding_window"):
        tiny_config(layer_types=["sliding_attention"] * 2)
