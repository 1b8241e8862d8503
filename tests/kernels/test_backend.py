"""The backend chosen once per model or cache (kvrun.kernels.backend): its name and native
paths from the environment, and the route each arena layer and ring takes on it, known
before the first token."""
import pytest

from kvrun.kernels import make_codec, native
from kvrun.kernels.backend import Backend, LayerRoute, RingRoute, choose, named
from kvrun.kernels.dispatch import BackendError

needs_native = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build")


def _codecs(k, v):
    return make_codec(k, "k", 32), make_codec(v, "v", 32)


def test_choose_a_named_backend(monkeypatch):
    monkeypatch.setenv("KVRUN_GEMV", "fp32")               # only the native backend reads it
    assert choose(name="torch") == Backend("torch", "fp32", "int")
    monkeypatch.setenv("KVRUN_BACKEND", "torch")
    assert choose() == Backend("torch", "fp32", "int") and str(choose()) == "torch"
    with pytest.raises(BackendError, match="backend 'cuda': expected one of"):
        choose(name="cuda")


@needs_native
def test_the_native_backend_reads_its_paths(monkeypatch):
    monkeypatch.setenv("KVRUN_GEMV", "fp32")
    monkeypatch.setenv("KVRUN_ATTN", "int")
    assert named("native") == Backend("native", "int", "fp32")


def test_torch_routes_every_layer_to_torch():
    r = named("torch").layer_route(*_codecs("kivi-4", "kivi-2"), 64, 32, False, False)
    assert r == LayerRoute("torch", False, False, ("torch", "torch"))
    assert r.describe() == "torch attention, flush K torch / V torch"


@needs_native
@pytest.mark.parametrize("k,v,D,G,want", [
    ("kivi-4", "int8", 64, 32, LayerRoute("native", True, False, ("native", "native"))),
    ("gear", "fp16", 64, 32, LayerRoute("native", True, False, ("torch", "torch"))),
    ("kivi-4", "kivi-2", 320, 32, LayerRoute("torch", False, False, ("native", "native"))),  # D > 256
    ("tada-4", "tada-4", 64, 48, LayerRoute("torch", False, False, ("native", "native"))),   # G % 32
])
def test_native_layer_routes(k, v, D, G, want):
    r = Backend("native").layer_route(*_codecs(k, v), D, G, False, False)
    assert r == want
    if r.fused:
        assert r.describe().startswith("fused native step, flush K ")


def test_ring_routes():
    assert Backend("native").ring_route(16) == RingRoute("native")
    assert Backend("triton").ring_route(8) == RingRoute("triton")
    assert Backend("triton").ring_route(16) == RingRoute("torch")          # 16-bit: no kernel
    assert Backend("torch").ring_route(4).describe() == "ring step torch"
