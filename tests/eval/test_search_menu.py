"""What `kvrun search` chooses from (runtime/eval/search_menu.py): a slot's codec menu per
family and bit width, and the widths of a model's sliding-window rings."""
import pytest

from kvrun.errors import KvrunError
from kvrun.eval.search_menu import DEFAULT_RINGS, candidate_methods, default_bits, ring_choices
from kvrun.kv.config import parse_kv
from tiny import tiny_config


def test_codec_menus():
    assert default_bits("all") == [2, 3, 4, 8] and default_bits("kivi") == [2, 3, 4, 8]
    assert candidate_methods("all") == ["kivi-2", "cb-2", "kivi-3", "cb-3", "kivi-4", "cb-4", "int8"]
    assert candidate_methods("cb", [4, 3, 16]) == ["cb-3", "cb-4", "fp16"]
    assert candidate_methods("all", [3]) == ["kivi-3", "cb-3"]
    assert candidate_methods("kivi", None) == ["kivi-2", "kivi-3", "kivi-4", "int8"]


@pytest.mark.parametrize("family,bits,msg", [
    ("nope", None, r"unknown --family 'nope' \(kivi, tada, any, cb, all\)"),
    ("tada", [3], r"--bits must be a non-empty list from \[2, 4, 8, 16\] for --family tada, got \[3\]"),
    ("kivi", [], r"got \[\]"),
])
def test_a_family_or_bits_off_the_menu_is_refused(family, bits, msg):
    with pytest.raises(KvrunError, match=msg):
        candidate_methods(family, bits)


def test_ring_choices_on_a_model_with_rings():
    cfg, base = tiny_config("gemma3"), parse_kv("fp16")
    assert ring_choices(cfg, base) == DEFAULT_RINGS == (4, 8)
    assert ring_choices(cfg, base, rings=(8, 4, 8)) == (4, 8)
    assert ring_choices(cfg, parse_kv("fp16+ring8")) == (8,)
    with pytest.raises(KvrunError, match="ring width must be one of 4, 8, 16 bits, got 5"):
        ring_choices(cfg, base, rings=(5,))


def test_ring_choices_on_a_model_without_rings():
    assert ring_choices(tiny_config(), parse_kv("fp16")) == ()
    with pytest.raises(KvrunError, match="this model has no sliding-window layers"):
        ring_choices(tiny_config(), parse_kv("fp16"), rings=(4,))
