"""The backend: which kernels run a model's decode step and its caches' operations, chosen
once — by `kvrun.load` for a model and the cache it builds, or by a cache built on its own —
and passed down, never asked for again per call.

A `Backend` is three facts read from the environment once (`choose`): its name (native C on
CPU when the library builds, Triton on CUDA, torch — the oracle — otherwise, or what
`KVRUN_BACKEND` forces), the native attention's product path (`KVRUN_ATTN`) and the native
GEMVs' (`KVRUN_GEMV`). What a cache's layer can run on it is resolved when the cache is built,
from the kernel table (kernels/table.py) and the layer's codecs and shape, into a `LayerRoute`
per arena layer and a `RingRoute` per ring: which kernel serves its attention, its flush and
its fused window write. A codec or shape the backend has no kernel for is known then, before
the first token (`LayerRoute.describe` says it: `kvrun bench` prints it), not discovered by a
kernel declining a call.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dispatch
from .table import covers


@dataclass(frozen=True)
class Backend:
    """The kernels' backend of a model and its caches (module docstring)."""
    name: str                   # "native" | "triton" | "torch"
    attn: str = "fp32"          # the native attention's product path ("int" | "fp32")
    gemv: str = "int"           # the native decode step's GEMVs ("int" | "fp32")

    def __str__(self) -> str:
        return self.name

    def layer_route(self, k_codec, v_codec, D: int, G: int, rotated: bool, evicting: bool) -> "LayerRoute":
        """How an arena layer with these codecs runs on this backend (LayerRoute)."""
        both = (k_codec, v_codec)
        if self.name == "native":
            from .native.decode_attention import covers_layer
            attention = "native" if covers_layer(k_codec, v_codec, D, G) else "torch"
        elif self.name == "triton":
            attention = "triton" if all(_triton_reads(c) for c in both) else "torch"
        else:
            attention = "torch"
        # the fused window write (K's RoPE / V's projection in the write): Triton's; torch
        # is the oracle and takes the plain rows (its write is the Triton kernels' test twin)
        fused_write = self.name == "triton" and not rotated and not evicting
        return LayerRoute(attention=attention, fused=attention == "native",
                          fused_write=fused_write,
                          pack=tuple(self.packer(c, D, G) for c in both))

    def packer(self, codec, D: int, G: int) -> str:
        """The backend whose kernel flushes `codec` at head dim D in blocks of G tokens
        (dispatch.pack's `backend`): this one where the table's `pack` row covers it and
        its kernel takes the shape, else torch (the codec's own store)."""
        if self.name == "native":
            from .native import pack as native_pack
            return "native" if native_pack.covers_layer(codec, D, G) else "torch"
        if self.name == "triton":
            from .triton import kivi_pack_supports      # imported only on the Triton backend
            return "triton" if kivi_pack_supports(codec) else "torch"
        return "torch"

    def ring_route(self, bits: int, H: int, Hkv: int, D: int, group: int, dtype) -> "RingRoute":
        """How a sliding ring of `bits`-bit slots (channel groups of `group`, rows of `dtype`)
        runs its one-token steps on this backend for H query heads over Hkv KV heads of
        head dim D: the backend's kernel where it takes the shape, else the torch step."""
        if self.name == "native":
            from .native.ring_attention import covers as kernel_covers
        elif self.name == "triton":
            from .triton import ring_covers as kernel_covers    # imported only on Triton
        else:
            return RingRoute(step="torch")
        return RingRoute(step=self.name if kernel_covers(H, Hkv, D, bits, group, dtype) else "torch")


def _triton_reads(codec) -> bool:
    from .triton import supports                # imported only on the Triton backend
    return covers("decode_attention", "triton", codec) and supports(codec)


@dataclass(frozen=True)
class LayerRoute:
    """One arena layer's kernels on its cache's backend, resolved when the cache is built.

    attention: the backend whose decode_attention reads the layer (its own kernel, or torch
    for a codec it has none for); fused: the native one-call route (rotate + round + window
    write + attention in one kernel call: `FusedStep` for one token, `attend_append` for a
    chunk, a row of the one-call decode step); fused_write: the fused window write of
    K's RoPE and V's projection (Triton, `KVArena.attend_new`; any codec: a write never
    packs); pack: the backends whose kernels flush K and V."""
    attention: str
    fused: bool
    fused_write: bool
    pack: tuple[str, str]

    def describe(self) -> str:
        how = ("fused native step" if self.fused else f"{self.attention} attention"
               + (" + fused write" if self.fused_write else ""))
        return f"{how}, flush K {self.pack[0]} / V {self.pack[1]}"


@dataclass(frozen=True)
class RingRoute:
    """A sliding ring's one-token step: the backend whose kernel runs it ("torch": the
    ring's own torch step). Chunks always take the torch step."""
    step: str

    def describe(self) -> str:
        return f"ring step {self.step}"


def choose(device="cpu", name: str | None = None) -> Backend:
    """The backend for a model or cache on `device`: `name` when given, else what
    KVRUN_BACKEND forces, else native on CPU (triton on CUDA) where it runs, else torch;
    with the native paths KVRUN_ATTN / KVRUN_GEMV ask for. Read here, once."""
    if name is None:
        name = dispatch.select(device)
    elif name not in dispatch.BACKENDS:
        raise dispatch.BackendError(f"backend {name!r}: expected one of {', '.join(dispatch.BACKENDS)}")
    native = name == "native"
    return Backend(name, dispatch.attn_path() if native else "fp32",
                   dispatch.gemv_path() if native else "int")


def named(name: str) -> Backend:
    """The backend `name` with the environment's native paths (tests and tools that compare
    backends build each cache on one)."""
    return choose(name=name)
