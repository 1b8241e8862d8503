"""The kernel table (kvrun.kernels.table): `covers` answers from a codec's kind and bits alone,
torch covers every codec, and a backend the op's row does not list covers nothing."""
import pytest

from kvrun.kernels import make_codec
from kvrun.kernels.table import COVERAGE, covers


@pytest.mark.parametrize("op,method,want", [
    ("decode_attention", "kivi-3", {"native": True, "triton": True, "torch": True}),
    ("decode_attention", "cb-4", {"native": True, "triton": False, "torch": True}),
    ("decode_attention", "gear-l-2", {"native": True, "triton": True, "torch": True}),
    ("pack", "kivi-4", {"native": True, "triton": True, "torch": True}),
    ("pack", "kivi-3", {"native": True, "triton": False, "torch": True}),
    ("pack", "gear", {"native": False, "triton": False, "torch": True}),
    ("pack", "fp16", {"native": False, "triton": False, "torch": True}),
    ("pack", "tada-8", {"native": True, "triton": False, "torch": True}),
])
def test_covers(op, method, want):
    c = make_codec(method, "k", 32)
    assert {b: covers(op, b, c) for b in want} == want


def test_an_unlisted_backend_covers_nothing():
    c = make_codec("fp16", "k", 32)
    assert not covers("decode_attention", "cuda", c)
    assert set(COVERAGE) == {"decode_attention", "pack"}
