"""Shape facts every cache module shares (runtime/kv/layout.py): which layers attend to
everything (and so get the KV method), and how many tokens a compressed tail holds."""
import pytest

from kvrun.kv.layout import arena_layers, layer_windows, tail_capacity
from tiny import tiny_config


@pytest.mark.parametrize("max_ctx,R,G,want", [(100, 32, 32, 64), (96, 32, 32, 64), (95, 32, 32, 32),
                                              (40, 64, 32, 0), (300, 128, 64, 128)])
def test_tail_capacity_is_whole_groups_past_the_window(max_ctx, R, G, want):
    assert tail_capacity(max_ctx, R, G) == want


def test_a_model_without_windows_has_every_layer_in_the_arena():
    cfg = tiny_config(num_layers=3)
    assert layer_windows(cfg) == [0, 0, 0] and arena_layers(cfg) == 3


def test_gemma3_keeps_only_its_global_layers_in_the_arena():
    cfg = tiny_config("gemma3")                          # five sliding layers of 16, the sixth global
    assert layer_windows(cfg) == [16] * 5 + [0] and arena_layers(cfg) == 1
