"""A cache's state as bytes, and back: what a session file (runtime/engine/session.py) and
the prefix cache (runtime/engine/prefix_cache.py) hold.

A `Snapshot` is the cache exactly as it stands — the arena's packed tail as the codecs
stored it (codes, scales, means: the compressed bytes, never dequantized), the
full-precision window rows, a ring's slots, and the counters that say how much of each is
filled — copied out of the preallocated buffers. Only the filled part is copied: a tail
slot's token axis (`Slot.axis`) is cut at the extent its codec's layout needs for the
tokens held (the layout `slots(Hkv, D, n)` declares for n tokens), so a snapshot's bytes
grow with the tokens held, not with -c. Restoring writes the same bytes back into a cache
built for the same KV config (any -c that holds the tokens, and for a ring the same window
slots), so every later step reads what the original cache would have read: output after a
restore equals the uninterrupted one, bit for bit.

Not held: an evicting arena (`--evict`), whose policy state (per-slot scores, kept
positions) is not part of this format; `snapshot` refuses it with a KvrunError.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..errors import KvrunError


@dataclass
class Snapshot:
    """Counters (JSON-able; every kind has "kind" and "seq_len", the tokens held) and named
    tensors (copies, on CPU) of one cache's state."""
    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class OtherSize(KvrunError):
    """A snapshot that is sound for its KV config but that this cache, built for another
    context size, cannot take (a ring narrower than the window): a bigger cache would."""


def _take(snap: Snapshot, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `name`, which must have `shape` and `dtype` (a file's tensors are checked
    before any byte is written into the cache)."""
    t = snap.tensors.get(name)
    if t is None:
        raise KvrunError(f"the saved cache lacks {name}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise KvrunError(f"the saved cache's {name} is {tuple(t.shape)} {t.dtype}, this cache "
                         f"needs {tuple(shape)} {dtype}")
    return t


def _counts(meta: dict, key: str, n: int) -> list[int]:
    x = meta.get(key)
    if not isinstance(x, list) or len(x) != n or not all(type(i) is int and i >= 0 for i in x):
        raise KvrunError(f"the saved cache's {key} is not {n} counts")
    return x


def _filled(codec, Hkv: int, D: int, n: int):
    """Per storage slot of `codec`: (name, axis, extent) — the leading part of the token
    axis that holds tokens [0, n) (whole padding units of its layout)."""
    return [(s.name, s.axis, s.shape[s.axis]) for s in codec.slots(Hkv, D, n)]


# -- the arena -------------------------------------------------------------------------------

def arena_snapshot(a) -> Snapshot:
    """Copy a KVArena's held state (module docstring)."""
    if a.ev is not None:
        raise KvrunError("a cache with token eviction (--evict) cannot be saved: its policy "
                         "state is not part of a session")
    meta = {"kind": "arena", "seq_len": a.seq_len, "n_tail": list(a.n_tail),
            "n_win": list(a.n_win), "n_shifts": a.n_shifts, "rope": _rope_id(a)}
    out = {}
    for l in range(a.L):
        nt, w = a.n_tail[l], a.n_win[l]
        for role, codec, st in (("k", a.k_codecs[l], a.k_store[l]), ("v", a.v_codecs[l], a.v_store[l])):
            for name, axis, ext in _filled(codec, a.Hkv, a.D, nt):
                out[f"{l}.{role}.{name}"] = st[name].narrow(axis, 0, ext).cpu().clone()
        out[f"{l}.win_k"] = a.win_k[l, :, :w].cpu().clone()              # (Hkv, w, D)
        out[f"{l}.win_v"] = a.win_v[l, :, :w].cpu().clone()
    return Snapshot(meta, out)


def arena_restore(a, snap: Snapshot) -> None:
    """Write a snapshot back into a KVArena built for the same KV config (its state before is
    replaced); KvrunError, the cache unchanged, when it does not fit."""
    m = snap.meta
    if m.get("kind") != "arena":
        raise KvrunError(f"the saved cache is a {m.get('kind')!r} cache, this one an arena")
    n_tail, n_win = _counts(m, "n_tail", a.L), _counts(m, "n_win", a.L)
    seq, shifts = m.get("seq_len"), m.get("n_shifts", 0)
    if type(seq) is not int or type(shifts) is not int or not 0 <= seq <= a.max_ctx:
        raise KvrunError(f"the saved cache holds {seq!r} tokens; this context holds {a.max_ctx} "
                         f"(raise -c/--ctx-size)")
    if m.get("rope", _rope_id(a)) != _rope_id(a):   # files before it was recorded: as they were
        raise OtherSize(f"the saved cache's keys were rotated with another RoPE frequency set "
                        f"(longrope: a cache larger than the model's original context takes its "
                        f"long factors, one within it the short ones; this one holds {a.max_ctx})")
    for l in range(a.L):
        if (n_tail[l] % a.G or n_tail[l] > a.S_l[l] or not a.settled_window(n_win[l])
                or n_tail[l] + n_win[l] != seq):
            raise KvrunError(f"the saved cache's layer {l} ({n_tail[l]} compressed + {n_win[l]} "
                             f"window tokens of {seq}) does not fit this cache")
    plan = []                                   # every tensor checked before any is written
    for l in range(a.L):
        for role, codec, st in (("k", a.k_codecs[l], a.k_store[l]), ("v", a.v_codecs[l], a.v_store[l])):
            for name, axis, ext in _filled(codec, a.Hkv, a.D, n_tail[l]):
                dst = st[name].narrow(axis, 0, ext)
                plan.append((dst, _take(snap, f"{l}.{role}.{name}", dst.shape, dst.dtype)))
        for win, key in ((a.win_k, "win_k"), (a.win_v, "win_v")):
            dst = win[l, :, :n_win[l]]
            plan.append((dst, _take(snap, f"{l}.{key}", dst.shape, dst.dtype)))
    a.reset()
    for dst, src in plan:
        dst.copy_(src)
    a.n_tail, a.n_win, a.seq_len, a.n_shifts = list(n_tail), list(n_win), seq, shifts


def _rope_id(a) -> str:
    """The RoPE frequencies the arena's keys were rotated with, as a short digest: longrope
    models rotate with one of two sets, by the cache's size (kernels/rope.py long_factors)."""
    return hashlib.sha256(a.inv_freq.double().cpu().numpy().tobytes()).hexdigest()[:16]


# -- Gemma's rings beside an arena ----------------------------------------------------------

def ring_snapshot(r) -> Snapshot:
    """Copy a SlidingWindowKV's filled slots (slot p mod W holds position p)."""
    assert not r.torn, "a torn ring: truncate(seq_len) first"
    n = min(r.seq_len, r.W)
    out = {f"{role}.{i}": p[:, :, :n].cpu().clone()
           for role, store in (("k", r.k), ("v", r.v)) for i, p in enumerate(store.parts)}
    return Snapshot({"kind": "ring", "seq_len": r.seq_len, "W": r.W, "bits": r.bits}, out)


def ring_restore(r, snap: Snapshot):
    """Check a ring snapshot against SlidingWindowKV `r` (KvrunError when it does not fit,
    `r` unchanged); returns the function that writes it."""
    m = snap.meta
    if m.get("kind") != "ring" or m.get("W") != r.W or m.get("bits") != r.bits:
        sized = m.get("kind") == "ring" and m.get("bits") == r.bits and type(m.get("W")) is int
        raise (OtherSize if sized else KvrunError)(f"the saved rings hold {m.get('W')} slots of {m.get('bits')} bits; this "
                         f"cache's hold {r.W} of {r.bits} (a -c shorter than the sliding window "
                         f"shrinks them)")
    seq = m.get("seq_len")
    if type(seq) is not int or seq < 0:
        raise KvrunError(f"the saved rings' seq_len {seq!r} is not a count")
    n = min(seq, r.W)
    plan = []
    for role, store in (("k", r.k), ("v", r.v)):
        for i, p in enumerate(store.parts):
            dst = p[:, :, :n]
            plan.append((dst, _take(snap, f"{role}.{i}", dst.shape, dst.dtype)))

    def write():
        for dst, src in plan:
            dst.copy_(src)
        r.seq_len, r.torn = seq, False
    return write


def nest(meta: dict, parts: dict[str, Snapshot]) -> Snapshot:
    """One snapshot of several caches: each part's tensors under `name/`."""
    out = Snapshot({**meta, **{k: s.meta for k, s in parts.items()}})
    for k, s in parts.items():
        out.tensors.update({f"{k}/{n}": t for n, t in s.tensors.items()})
    return out


def part(snap: Snapshot, key: str) -> Snapshot:
    """The part `key` of a nested snapshot."""
    meta = snap.meta.get(key)
    if not isinstance(meta, dict):
        raise KvrunError(f"the saved cache has no {key} part")
    pre = key + "/"
    return Snapshot(meta, {n[len(pre):]: t for n, t in snap.tensors.items() if n.startswith(pre)})
