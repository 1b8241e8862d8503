"""Sessions on disk: one sequence's KV cache as the arena stores it, with the token ids it
holds, so a conversation continues after a restart exactly where it stopped.

A session file (little-endian):

    magic   8 bytes   b"KVRUNSES"
    version u32       1
    hlen    u64       bytes of the header
    header  hlen      UTF-8 JSON: "model" (the weights' sha256, name, load dtype), "kv" (the
                      KV config's label and settings), "engine" (the token ids the cache
                      holds, how many of them a fresh prefill would hold alike, shift
                      counters), "cache" (the snapshot's counters, kv/snapshot.py),
                      "tensors" (name, dtype, shape, offset and length in the payload),
                      "extra" (the caller's: a chat's conversation ids)
    payload           the tensors' bytes, as the cache holds them (compressed codes, scales,
                      the window's rows, ring slots): the file is about the KV bytes held
    sha256  32 bytes  over everything before it

It is written whole or not at all (files.atomic_output), only over a regular file, mode 0600
(the header holds the prompts' token ids), while holding the session's lock (files.FileLock:
a second writer of the same file gets a KvrunError, not a lost turn). Reading opens only a
regular file, non-blocking, and refuses one larger than the loading model's whole cache
could save (`session_limit`) before reading it; then it checks, in order: the magic, the
version, the length, the checksum, the header's shape, then the model and the KV config
against the loaded ones, then every tensor against the cache's layout — each failure one
KvrunError line, the cache left as it was. The checksum catches a truncated or damaged
file, not a forged one: a file altered with its sha256 recomputed loads what it holds
(tensors of the right shapes and dtypes), so a session file is trusted input, like the
weights. Output after a restore equals the
uninterrupted generation's (tests/engine/test_session.py): the bytes are the cache's own, and the
engine's prefix-reuse state (`cached`, `canon`) comes back with them.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import KvrunError
from ..files import PRIVATE, FileLock, atomic_output, check_writable, file_sha256, read_regular
from ..kv.build import kv_bytes_at
from ..kv.snapshot import OtherSize, Snapshot
from .generate import check_ids

MAGIC = b"KVRUNSES"
VERSION = 1
_PRE = struct.Struct("<8sIQ")               # magic, version, header length
_DIGEST = 32
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
          "u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
          "i64": torch.int64}
_NAMES = {dt: n for n, dt in DTYPES.items()}
_SHA_MEMO: dict[tuple, str] = {}
EXTRA_LIMIT = 16 << 20          # bytes of a header beyond the cache's: ids, tensor table, extra


def weights_sha256(path: Path) -> str:
    """sha256 of a model directory's model.safetensors, hashed once per file version
    (path, size, mtime) in this process."""
    f = Path(path) / "model.safetensors"
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = file_sha256(f)
    return _SHA_MEMO[key]


def model_record(m) -> dict:
    """What a session says about the model that computed it: the weights (sha256) and the
    dtype the forward ran in — both change the K/V a prompt gives."""
    return {"sha256": weights_sha256(m.path), "name": Path(m.path).name,
            "dtype": getattr(m, "dtype", "auto")}


# settings added after the session format, left out at their default so that files saved
# before them still match the config that reads them back the same
LATER_SETTINGS = {"ring": None}


def kv_record(kv) -> dict:
    """The KV config as a session compares it: every setting but where a profile came from
    (LATER_SETTINGS only when set)."""
    settings = {k: v for k, v in kv.settings().items() if k != "profile_info"
                and not (k in LATER_SETTINGS and v == LATER_SETTINGS[k])}
    return json.loads(json.dumps({"label": kv.label(), "settings": settings}))


# -- engine state ------------------------------------------------------------------------------

def engine_state(engine) -> tuple[Snapshot, dict]:
    """The engine's sequence: the cache's snapshot and the ids it holds (with the state its
    prefix reuse reads)."""
    snap = engine.cache.snapshot()
    return snap, {"tokens": list(engine.cached), "canon": engine.canon,
                  "n_shifts": engine.n_shifts, "n_dropped": engine.n_dropped}


def restore_engine(engine, snap: Snapshot, state: dict, vocab_size: int) -> None:
    """Put a sequence back into `engine`; KvrunError, the engine unchanged, when the state is
    not one (ids outside the vocabulary, counts that disagree with the cache's)."""
    tokens, canon = state.get("tokens"), state.get("canon")
    counts = [state.get(k, 0) for k in ("n_shifts", "n_dropped")]
    if not isinstance(tokens, list) or type(canon) is not int or not 0 <= canon <= len(tokens) \
            or not all(type(c) is int and c >= 0 for c in counts):
        raise KvrunError("the saved sequence state is malformed")
    check_ids(tokens, vocab_size)
    if len(tokens) > engine.max_ctx:
        raise OtherSize(f"the saved sequence holds {len(tokens)} tokens; this context holds "
                         f"{engine.max_ctx} (raise -c/--ctx-size)")
    if snap.meta.get("seq_len") != len(tokens):
        raise KvrunError(f"the saved cache holds {snap.meta.get('seq_len')!r} tokens but names "
                         f"{len(tokens)} ids")
    engine.cache.restore(snap)
    assert engine.cache.seq_len == len(tokens), (engine.cache.seq_len, len(tokens))
    engine.cached, engine.canon = list(tokens), canon
    engine.n_shifts, engine.n_dropped = counts


# -- the file ----------------------------------------------------------------------------------

def save_session(m, path, extra: dict | None = None, lock: bool = True) -> int:
    """Write model `m`'s sequence to `path` atomically; returns the file's bytes. KvrunError
    when `extra` is not JSON-able, or another kvrun holds the session's lock (`lock`:
    write_session's)."""
    check_extra(extra)
    snap, state = engine_state(m.engine)
    return write_session(path, model_record(m), kv_record(m.cache.kv), state, snap, extra, lock)


def check_extra(extra) -> None:
    """`extra` is a JSON-able dict (None: {}) of at most EXTRA_LIMIT bytes, else KvrunError."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise KvrunError(f"a session's extra must be a dict, got {type(extra).__name__}")
    try:
        n = len(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise KvrunError(f"a session's extra must be JSON data: {e}") from None
    if n > EXTRA_LIMIT // 2:
        raise KvrunError(f"a session's extra holds {n} bytes of JSON, at most {EXTRA_LIMIT // 2}")


def write_session(path, model: dict, kv: dict, state: dict, snap: Snapshot,
                  extra: dict | None = None, lock: bool = True) -> int:
    """Write a sequence (engine_state's) saved by `model` (model_record) with KV config `kv`
    (kv_record) to `path` atomically, mode 0600; returns the file's bytes. lock: hold the
    session's lock while writing (KvrunError if another holds it; a caller already holding
    it, or the prefix cache's computed names, pass False)."""
    table, off = [], 0
    for name, t in snap.tensors.items():
        n = t.nbytes
        table.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape),
                      "offset": off, "nbytes": n})
        off += n
    header = json.dumps({"format": "kvrun-session", "model": model, "kv": kv, "engine": state,
                         "cache": snap.meta, "tensors": table, "extra": extra or {}}).encode()
    h = hashlib.sha256()
    if lock:
        check_writable(path)                # a refused path gets no lock file beside it
    held = FileLock(path, "session") if lock else None
    try:
        with atomic_output(path, mode=PRIVATE) as tmp, open(tmp, "wb") as f:
            def put(b):
                h.update(b)
                f.write(b)
            put(_PRE.pack(MAGIC, VERSION, len(header)))
            put(header)
            for t in snap.tensors.values():
                put(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            f.write(h.digest())
    finally:
        if held is not None:
            held.release()
    return os.path.getsize(path)


def session_limit(m) -> int:
    """The most bytes a session file `m` can load may hold: a cache of its KV config at the
    larger of its context and the model's trained one (a snapshot holds a filled part of a
    cache's tensors; a file from a longer -c is then refused by its header, saying so),
    and a header of EXTRA_LIMIT."""
    n = max(m.ctx, m.cfg.max_position)
    return sum(kv_bytes_at(m.cfg, m.cache.kv, n).values()) + EXTRA_LIMIT


def read_session(path, limit: int, follow: bool = True) -> tuple[dict, Snapshot]:
    """A session file's header and snapshot, checked as a file (a regular file of at most
    `limit` bytes, then magic, version, length, checksum, header shape); not yet against a
    model. follow=False: never through a symlink (the prefix cache's directory)."""
    data = read_regular(path, limit, "session file", follow)
    if len(data) < _PRE.size or data[:8] != MAGIC:
        raise KvrunError(f"{path}: not a kvrun session file")
    _, version, hlen = _PRE.unpack_from(data)
    if version != VERSION:
        raise KvrunError(f"{path}: session format version {version}; this kvrun reads {VERSION}")
    if len(data) < _PRE.size + hlen + _DIGEST:
        raise KvrunError(f"{path}: truncated session file ({len(data)} bytes)")
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise KvrunError(f"{path}: corrupt session file (checksum mismatch; truncated or altered)")
    try:
        header = json.loads(data[_PRE.size:_PRE.size + hlen])
        payload = memoryview(data)[_PRE.size + hlen:-_DIGEST]
        tensors = {}
        for e in header["tensors"]:
            dt, shape, o, n = DTYPES[e["dtype"]], [int(s) for s in e["shape"]], e["offset"], e["nbytes"]
            count = 1
            for s in shape:
                count *= s
            if min(shape, default=0) < 0 or count * dt.itemsize != n or not 0 <= o <= o + n <= len(payload):
                raise ValueError(e["name"])
            buf = bytearray(payload[o:o + n])
            tensors[e["name"]] = (torch.frombuffer(buf, dtype=dt).reshape(shape) if n
                                  else torch.empty(shape, dtype=dt))
        for key in ("model", "kv", "engine", "cache", "extra"):
            if not isinstance(header[key], dict):
                raise ValueError(key)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise KvrunError(f"{path}: malformed session header") from None
    return header, Snapshot(header["cache"], tensors)


def check_origin(path, header: dict, model: dict, kv: dict) -> None:
    """KvrunError unless the file's header names `model` (model_record) and `kv` (kv_record)."""
    want = header["model"]
    if want.get("sha256") != model["sha256"]:
        raise KvrunError(f"{path}: saved for model {want.get('name')!r} (weights sha256 "
                         f"{str(want.get('sha256'))[:12]}…), not for {model['name']!r} "
                         f"({model['sha256'][:12]}…)")
    if want.get("dtype") != model["dtype"]:
        raise KvrunError(f"{path}: saved with --dtype {want.get('dtype')}, this model runs "
                         f"--dtype {model['dtype']}")
    # the settings decide; the label only names them (and its spelling may change: a rotation
    # given over a profile joined it later)
    if header["kv"].get("settings") != kv["settings"]:
        raise KvrunError(f"{path}: saved with --kv {header['kv'].get('label')!r}, this cache is "
                         f"--kv {kv['label']!r} (its settings must match too)")


def load_session(m, path) -> dict:
    """Restore the session at `path` into model `m` (its conversation cache); returns the
    header's "extra". The model and KV config must be the ones it was saved with."""
    header, snap = read_session(path, session_limit(m))
    check_origin(path, header, model_record(m), kv_record(m.cache.kv))
    with m.engine.exclusive():
        restore_engine(m.engine, snap, header["engine"], m.cfg.vocab_size)
    return header["extra"]
