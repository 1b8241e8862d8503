"""The backend chosen once per model or cache (kvrun.kernels.backend): its name and native
paths from the environment, and the route each arena layer and ring takes on it, known
before the first token."""
import pytest
import torch

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
    ("kivi-4", "kivi-2", 320, 32, LayerRoute("torch", False, False, ("torch", "torch"))),    # D > 256
    ("tada-4", "tada-4", 64, 48, LayerRoute("torch", False, False, ("native", "native"))),   # G % 32
])
def test_native_layer_routes(k, v, D, G, want):
    r = Backend("native").layer_route(*_codecs(k, v), D, G, False, False)
    assert r == want
    if r.fused:
        assert r.describe().startswith("fused native step, flush K ")


def test_ring_routes():
    """A ring's one-token step takes its backend's kernel where the kernel takes the shape
    (heads per KV head, head dim, group, bits, dtype), decided when the ring is built."""
    F16 = torch.float16
    assert Backend("triton").ring_route(8, 4, 1, 64, 32, F16) == RingRoute("triton")
    assert Backend("triton").ring_route(16, 4, 1, 64, 32, F16) == RingRoute("torch")   # 16-bit: no kernel
    assert Backend("torch").ring_route(4, 4, 1, 64, 32, F16).describe() == "ring step torch"


@needs_native
@pytest.mark.parametrize("bits,H,D,group,want", [
    (16, 4, 64, 32, "native"), (4, 8, 256, 32, "native"),
    (4, 17, 64, 32, "torch"),                   # 17 query heads a KV head: past the kernel's 16
    (8, 4, 512, 32, "torch"),                   # head dim past 256
    (4, 4, 64, 48, "torch"),                    # a group that does not divide the head dim
])
def test_native_ring_routes(bits, H, D, group, want):
    assert Backend("native").ring_route(bits, H, 1, D, group, torch.float16).step == want


@needs_native
@pytest.mark.parametrize("k,v,D,G,attention,pack", [
    ("gear-l", "int8", 64, 32, "native", ("torch", "native")),   # GEAR: read natively, packed in torch
    ("cb-4", "cb-2", 64, 32, "native", ("native", "native")),
    ("cb-4", "int8", 80, 32, "torch", ("torch", "native")),      # a codebook role needs D % 32 == 0
    ("kivi-4", "kivi-4", 288, 32, "torch", ("torch", "torch")),  # D > 256: neither kernel takes it
])
def test_native_routes_follow_the_kernels_shape_limits(k, v, D, G, attention, pack):
    """The route says what the kernels will take, so a routed call is never declined."""
    r = Backend("native").layer_route(*_codecs(k, v), D, G, False, False)
    assert (r.attention, r.pack) == (attention, pack)


@needs_native
def test_a_gear_rank_past_the_kernel_is_routed_to_torch():
    k = make_codec("gear-l", "k", 32, rank=16)                  # the C kernel reads rank <= 8
    v = make_codec("int8", "v", 32)
    assert Backend("native").layer_route(k, v, 64, 32, False, False).attention == "torch"
    assert Backend("native").layer_route(make_codec("gear-l", "k", 32, rank=8), v, 64, 32,
                                         False, False).attention == "native"
