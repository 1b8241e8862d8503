"""The kernel table: which codecs each backend's kernel serves, per op.

A codec declares what it is — `kind` ("fp", "int8", "kivi", "tada", "gear") and `bits`
(kernels/codecs/) — and this table is the one place that says, from those two facts, which
backend has a kernel for it. kernels/dispatch.py asks `covers(op, backend, codec)` before
calling a kernel; a kernel may still decline a request for a reason of shape (batch,
head dim, tile alignment, storage strides) by returning None, and the op then runs on
torch, which covers every codec (it is the oracle).

| op | native (CPU) | triton (CUDA) |
|---|---|---|
| `decode_attention` | fp, int8, KIVI, TaDA, GEAR | fp, int8, KIVI, TaDA, GEAR |
| `pack` (window → tail) | int8, KIVI, TaDA | KIVI 2/4-bit |
| `fused_write` (RoPE / V projection fused into the window write) | — | int8, KIVI, TaDA |

`ring_step` (Gemma's quantized sliding rings) is not codec-shaped — a ring stores 4- or
8-bit per-token codes (kv/ring.py) — and its kernels check the ring's bits themselves.
"""
from __future__ import annotations

ANY = (2, 4, 8, 16, 32)     # every width of a kind (int8: 8; fp: 16 or 32)
Q = (2, 4, 8)               # the widths of the quantizing codecs

COVERAGE: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {
    "decode_attention": {
        "native": {"fp": ANY, "int8": ANY, "kivi": Q, "tada": Q, "gear": Q},
        "triton": {"fp": ANY, "int8": ANY, "kivi": Q, "tada": Q, "gear": Q},
    },
    "pack": {
        "native": {"int8": ANY, "kivi": Q, "tada": Q},
        "triton": {"kivi": (2, 4)},
    },
    "fused_write": {        # the torch implementation is the Triton kernels' oracle: same set
        "triton": {"int8": ANY, "kivi": Q, "tada": Q},
        "torch": {"int8": ANY, "kivi": Q, "tada": Q},
    },
}


def covers(op: str, backend: str, codec) -> bool:
    """Whether `backend` has a kernel for `op` on this codec (torch: every codec, except
    where the table lists torch itself)."""
    table = COVERAGE[op]
    if backend not in table:
        return backend == "torch"
    return codec.bits in table[backend].get(codec.kind, ())
