"""Per-family conversion rules (kvrun.convert.hf_families): the config fields each family's
quirks become, its refusals, and the tensor fix-ups done once at conversion — Phi-3's fused
projections split, partial rotary's q/k rows reordered without changing any q·k, Granite's
residual multiplier folded, stacked experts split per expert."""
import pytest
import torch

from kvrun.convert.hf_families import (FAMILIES, MODEL_TYPES, permute_rotary, per_expert,
                                       rotary_order, split_fused)
from kvrun.errors import KvrunError


def test_every_model_type_names_a_family():
    assert set(MODEL_TYPES.values()) <= set(FAMILIES)
    assert FAMILIES[MODEL_TYPES["phi3"]].arch == "llama"


def test_layer_kinds_and_caps_from_the_config():
    g2 = FAMILIES["Gemma2ForCausalLM"].fields({"num_hidden_layers": 4, "attn_logit_softcapping": 50.0,
                                               "final_logit_softcapping": 0})
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2   # every 2nd global
    assert g2["attn_logit_softcapping"] == 50.0 and g2["final_logit_softcapping"] is None
    g3 = FAMILIES["Gemma3ForCausalLM"].fields({"num_hidden_layers": 7, "rope_local_base_freq": 1e4})
    assert [i for i, t in enumerate(g3["layer_types"]) if t == "full_attention"] == [5]
    assert FAMILIES["SmolLM3ForCausalLM"].fields({"num_hidden_layers": 8})["nope_layers"] == [3, 7]
    assert FAMILIES["Phi3ForCausalLM"].fields({"hidden_size": 384, "num_attention_heads": 4,
                                               "partial_rotary_factor": 0.75}) == {"rotary_dim": 72}


@pytest.mark.parametrize("arch,hf,message", [
    ("LlamaForCausalLM", {"attention_bias": True}, "llama checkpoints with attention/MLP biases"),
    ("Qwen2ForCausalLM", {"mlp_bias": True}, "Qwen2 checkpoints with MLP biases"),
    ("Gemma2ForCausalLM", {"num_hidden_layers": 2, "hidden_activation": "relu"},
     "hidden_activation 'relu' is not supported"),
    ("SmolLM3ForCausalLM", {"num_hidden_layers": 3, "no_rope_layers": [1, 0]},
     "no_rope_layers lists 2 layers, the model has 3"),
    ("Phi3ForCausalLM", {"hidden_size": 384, "num_attention_heads": 4, "partial_rotary_factor": 0.7},
     "rotates 67 of 96 channels"),
    ("Qwen3MoeForCausalLM", {"num_hidden_layers": 2, "shared_expert_intermediate_size": 8},
     "shared expert"),
])
def test_what_a_family_refuses(arch, hf, message):
    with pytest.raises(KvrunError, match=message):
        FAMILIES[arch].fields(hf)


def test_rotary_order_pairs_hfs_rotated_channels():
    # HF rotates (0, 2), (1, 3) and passes 4..7 through; kvrun pairs j with j + 4
    order = rotary_order(8, 4)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert [(order[j].item(), order[j + 4].item()) for j in range(2)] == [(0, 2), (1, 3)]


def test_permute_rotary_keeps_every_q_k_product():
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, C = 2, 1, 8, 5
    raw = {"m.self_attn.q_proj.weight": torch.randn(H * D, C, generator=g),
           "m.self_attn.k_proj.weight": torch.randn(Hkv * D, C, generator=g),
           "m.self_attn.k_proj.scales": torch.arange(Hkv * D).float()}       # a stored part
    x = torch.randn(3, C, generator=g)
    before = (x @ raw["m.self_attn.q_proj.weight"].T).view(3, H, D) @ \
        (x @ raw["m.self_attn.k_proj.weight"].T).view(3, D, 1)
    permute_rotary(raw, H, Hkv, D, 4)
    after = (x @ raw["m.self_attn.q_proj.weight"].T).view(3, H, D) @ \
        (x @ raw["m.self_attn.k_proj.weight"].T).view(3, D, 1)
    torch.testing.assert_close(after, before)
    assert raw["m.self_attn.k_proj.scales"].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(KvrunError, match="has 16 rows, the config implies 24"):
        permute_rotary(raw, 3, Hkv, D, 4)


def test_split_fused_by_rows():
    H, Hkv, D = 2, 1, 4
    qkv = torch.arange((H + 2 * Hkv) * D * 3).float().view(-1, 3)
    raw = {"l.self_attn.qkv_proj.weight": qkv, "l.mlp.gate_up_proj.scales": torch.arange(6.0)}
    split_fused(raw, H, Hkv, D)
    assert set(raw) == {"l.self_attn.q_proj.weight", "l.self_attn.k_proj.weight",
                        "l.self_attn.v_proj.weight", "l.mlp.gate_proj.scales", "l.mlp.up_proj.scales"}
    assert torch.equal(raw["l.self_attn.k_proj.weight"], qkv[8:12])
    assert raw["l.mlp.up_proj.scales"].tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(KvrunError, match="has 4 rows, the config implies 16"):
        split_fused({"l.self_attn.qkv_proj.weight": torch.zeros(4, 3)}, H, Hkv, D)


def test_granite_folds_the_residual_multiplier():
    raw = {"l.self_attn.o_proj.weight": torch.ones(2, 2), "l.mlp.down_proj.weight": torch.ones(2, 2),
           "l.mlp.up_proj.weight": torch.ones(2, 2)}
    FAMILIES["GraniteForCausalLM"].tensors({"residual_multiplier": 0.25}, raw)
    assert [raw[k][0, 0].item() for k in raw] == [0.25, 0.25, 1.0]


def test_experts_split_one_module_per_expert():
    stacked = torch.arange(2 * 3 * 4).float().view(2, 3, 4)
    out = per_expert("model.layers.0.mlp", "up_proj", stacked)
    assert list(out) == ["model.layers.0.mlp.experts.0.up_proj.weight",
                         "model.layers.0.mlp.experts.1.up_proj.weight"]
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], stacked[1])
