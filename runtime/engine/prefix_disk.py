"""The prefix cache's disk tier (`kvrun serve --cache-dir DIR --cache-disk-mb MB`): every
entry of the RAM tier (runtime/engine/prefix_cache.py) also kept as a file in DIR, so a
restarted server with the same model and KV method starts from the prompts the last one saw.

A file is a session file (runtime/engine/session.py: the checksummed header naming the
weights' sha256, the dtype, the KV config and the token ids, then the compressed bytes as the
arena holds them), named `<sha256>.kvpc` by a hash of (weights sha256, dtype, KV config, token
ids): the name is computed, never taken from a request, and every path read, written or
removed is DIR/<64 hex digits>.kvpc (or, at start, the temporary .<that>.<pid>-*.tmp of a
write whose process no longer runs: one killed mid-write; a symlink, a FIFO or anything else
there is never followed, read or replaced; other files in DIR are left alone and not
counted). A directory the tier creates is 0700 and its files are 0600: a file's header
holds the prompt's token ids. `--cache-dir ''` is an error, not the current directory.

When: a file is written when its entry is inserted in RAM (write-through), not when LRU drops
it from RAM. A write at eviction would lose whatever is in RAM when the process dies (a crash,
SIGKILL, a shutdown timeout), or make every shutdown spill up to --cache-ram MiB before it
exits; written at insertion, a file exists as soon as its prefix was computed. The cost is one
atomic write (files.atomic_output) per new entry, in the scheduler's loop thread, of the
compressed bytes (a third of fp16's for `auto`).

Bound: the .kvpc files in DIR hold at most `budget` bytes: after each write the least
recently used (oldest mtime; a disk hit touches its file) are removed until they fit, and an
entry larger than the whole budget is not written. A file that fails its checks (larger than the budget,
not a session file, truncated, corrupt, another model's, dtype's or KV config's, ids other
than its name's, or tensors the cache cannot take back: prefix_cache.PrefixCache.resume) is
removed with one log line: under its name it can never be valid, and it holds budget. A
file is read with that size bound before any byte of it, outside the scheduler's lock. A
valid file whose prefix does not fit a request's context is kept (a longer -c would take it).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import struct
from pathlib import Path

from ..errors import KvrunError
from ..files import is_stale_temp
from ..kv.snapshot import Snapshot
from .session import EXTRA_LIMIT, check_origin, read_session, write_session

log = logging.getLogger("kvrun.prefix_cache")
NAME = re.compile(r"^[0-9a-f]{64}\.kvpc$")
TMP = re.compile(r"^\.[0-9a-f]{64}\.kvpc\.\d+-\w+\.tmp$")     # files.atomic_output's


class DiskTier:
    """Session files in `root` under `budget` bytes for model `model` (model_record)."""

    def __init__(self, root, budget: int, model: dict):
        if budget < 0:
            raise KvrunError(f"--cache-disk-mb must be >= 0 MiB (got {budget / (1 << 20):g})")
        if not str(root).strip():
            raise KvrunError("--cache-dir is empty: give a directory (it would be the current one)")
        p = Path(root).expanduser()
        if p.exists() and not p.is_dir():
            raise KvrunError(f"--cache-dir {root}: not a directory")
        try:
            p.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise KvrunError(f"--cache-dir {root}: {e.strerror or e}") from None
        if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
            raise KvrunError(f"--cache-dir {root}: not a writable directory")
        self.root, self.budget, self.model = p.resolve(), budget, model
        self.hits = 0                   # entries restored from a file
        self.used = self.files = 0
        self._prefix = hashlib.sha256(json.dumps(
            [model["sha256"], model["dtype"]]).encode())
        self.trim(stale=True)

    # -- names ------------------------------------------------------------------------------------
    def paths(self, key: str, ids, ns) -> dict[int, Path]:
        """{n: the file of the first n of `ids`} for each n in `ns`, KV config `key` (one
        pass of the hash over the ids)."""
        h = self._prefix.copy()
        h.update(b"\0" + key.encode() + b"\0")
        out, done = {}, 0
        for n in sorted(ns):
            h.update(struct.pack(f"<{n - done}q", *ids[done:n]))
            done = n
            out[n] = self.root / (h.copy().hexdigest() + ".kvpc")
        return out

    def _regular(self, p: Path):
        """`p`'s lstat when it is a regular file (not a symlink), else None."""
        try:
            st = os.lstat(p)
        except OSError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    # -- reading ----------------------------------------------------------------------------------
    def get(self, path: Path, key: str, ids: tuple, limit: int | None = None):
        """The (state, snapshot) the file `path` holds for `ids` under KV config `key`; None
        when there is no such file, it fails its checks (then it is removed, logged), or it
        holds more than `limit` bytes (the receiving cache could not take it back: kept,
        unread, for a bigger one)."""
        st = self._regular(path)
        if st is None:
            if path.is_symlink():
                log.warning("prefix cache: %s is a symlink; ignored", path.name)
            return None
        if limit is not None and st.st_size > limit and st.st_size <= self.budget:
            return None
        try:
            header, snap = read_session(path, self.budget, follow=False)
            check_origin(path.name, header, self.model, json.loads(key))
            state = header["engine"]
            if state.get("tokens") != list(ids) or state.get("canon") != len(ids) \
                    or snap.meta.get("seq_len") != len(ids):
                raise KvrunError(f"{path.name}: holds other token ids than its name says")
        except KvrunError as e:
            log.warning("prefix cache: skipping and removing %s", str(e).replace(str(self.root) + os.sep, ""))
            self._remove(path, st.st_size)
            return None
        try:
            os.utime(path)                      # most recently used
        except OSError:
            pass
        self.hits += 1
        return state, snap

    # -- writing ----------------------------------------------------------------------------------
    def put(self, path: Path, key: str, state: dict, snap: Snapshot) -> bool:
        """Write an entry's file (once: an existing one is only marked used, unless it is
        larger than this entry's file could be: then it is not this entry, and is
        replaced), then keep the bound; returns whether the file is there."""
        st = self._regular(path)
        if st is not None and st.st_size <= snap.nbytes() + EXTRA_LIMIT:
            try:
                os.utime(path)
                return True
            except OSError:
                return False
        if snap.nbytes() > self.budget:
            return False
        if st is None and os.path.lexists(path):    # a symlink, FIFO, device or directory
            log.warning("prefix cache: %s is not a regular file; not replaced", path.name)
            return False
        try:
            write_session(path, self.model, json.loads(key), state, snap, lock=False)
        except KvrunError as e:                     # a full disk: the RAM tier goes on
            log.warning("prefix cache: cannot write %s", e)
            return False
        self.trim(keep=path)
        return self._regular(path) is not None

    def trim(self, keep: Path | None = None, stale: bool = False) -> None:
        """Remove the least recently used files until they fit the budget (`keep`, just
        written, last); with `stale`, also the temporary files of writes a killed process
        left."""
        files = []
        try:
            with os.scandir(self.root) as it:
                for d in it:
                    if stale and TMP.match(d.name) and is_stale_temp(d.name) \
                            and d.is_file(follow_symlinks=False):
                        self._unlink(Path(d.path))
                    if NAME.match(d.name) and d.is_file(follow_symlinks=False):
                        try:
                            s = d.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        files.append((d.path == str(keep), s.st_mtime_ns, d.name, s.st_size))
        except OSError as e:
            log.warning("prefix cache: cannot list %s: %s", self.root, e.strerror or e)
            return
        files.sort()
        used = sum(f[3] for f in files)
        n = len(files)
        for _, _, name, size in files:
            if used <= self.budget:
                break
            if self._unlink(self.root / name):
                used -= size
                n -= 1
        self.used, self.files = used, n

    def _unlink(self, p: Path) -> bool:
        try:
            os.unlink(p)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            log.warning("prefix cache: cannot remove %s: %s", p.name, e.strerror or e)
            return False

    def _remove(self, p: Path, size: int) -> None:
        if self._unlink(p):
            self.used, self.files = max(0, self.used - size), max(0, self.files - 1)

    def remove(self, path: Path, why: str) -> None:
        """Remove the entry file `path` (one of `paths`' names, a regular file) that passed
        `get` but whose tensors its cache refused (`why`), with one log line."""
        self.hits -= 1                          # get counted it; it restored nothing
        st = self._regular(path)
        if st is not None and NAME.match(path.name):
            log.warning("prefix cache: removing %s: it cannot be restored (%s)", path.name, why)
            self._remove(path, st.st_size)

    def stats(self) -> dict:
        return {"disk_bytes": self.used, "disk_files": self.files, "disk_hits": self.hits,
                "disk_budget_bytes": self.budget}
