"""The prefix cache's disk tier (runtime/engine/prefix_disk.py): entries outlive the process
(a new Scheduler on the same directory, a simulated restart, starts from them and its greedy
output equals the cold request's); corrupt, truncated and foreign files are skipped, removed
and logged, never read as a cache; the byte bound holds; nothing outside the directory, nor
a symlink or an unrelated file inside it, is read, written or removed."""
from __future__ import annotations

import logging
import os

import pytest

from kvrun.engine.sampling import SamplingParams
from kvrun.engine.scheduler import Scheduler
from kvrun.errors import KvrunError
from conftest import PREFIX_CHUNK
from test_session import _patched_header

CHUNK = PREFIX_CHUNK
GREEDY = SamplingParams(temp=0)
pytestmark = pytest.mark.usefixtures("one_thread_cap")       # conftest.py


@pytest.fixture(scope="module")
def m(chunked_default):                                       # conftest.py
    return chunked_default


@pytest.fixture(scope="module")
def prompt(m, wikitext):
    return m.tokenize(wikitext[3000:9000])[:197] + m.tokenize(" Question:", bos=False)


def _run(sched, prompt, n=12):
    r = sched.submit(prompt, n, GREEDY)
    sched.run()
    assert r.finish_reason in ("stop", "length"), r.error
    return r.text, r.seq.start


def _files(d):
    return sorted(p for p in d.iterdir() if p.suffix == ".kvpc")


@pytest.mark.parametrize("kv", ["fp16", "kivi-4", "auto"])
def test_entries_survive_a_restart(m, prompt, tmp_path, kv):
    cold, start = _run(Scheduler(m, parallel=1, ctx=1024, kv=kv, cache_ram_mb=64,
                                 cache_dir=tmp_path), prompt)
    assert start == 0
    # one file per chunk boundary the prefill passed (64, 128, 192)
    assert len(_files(tmp_path)) == len(prompt) // CHUNK
    again = Scheduler(m, parallel=1, ctx=1024, kv=kv, cache_ram_mb=64, cache_dir=tmp_path)
    warm, start = _run(again, prompt)
    assert warm == cold and start == (len(prompt) - 1) // CHUNK * CHUNK
    st = again.prefix.stats()
    assert st["disk_hits"] == 1 and st["hits"] == 1 and st["entries"] >= 1
    _, start = _run(again, prompt)                  # now from RAM: no second file read
    assert start > 0 and again.prefix.stats()["disk_hits"] == 1
    # another KV config does not take these files
    other = Scheduler(m, parallel=1, ctx=1024, kv="int8" if kv != "int8" else "fp16",
                      cache_ram_mb=64, cache_dir=tmp_path)
    _, start = _run(other, prompt, 2)
    assert start == 0 and other.prefix.stats()["disk_hits"] == 0


def test_disk_only_without_ram(m, prompt, tmp_path):
    cold, _ = _run(Scheduler(m, parallel=1, ctx=1024, kv="kivi-4", cache_dir=tmp_path), prompt)
    s = Scheduler(m, parallel=1, ctx=1024, kv="kivi-4", cache_dir=tmp_path)
    warm, start = _run(s, prompt)
    assert warm == cold and start > 0 and s.prefix.stats()["entries"] == 0


def _foreign_model(f):
    _patched_header(f, f, lambda h: h["model"].update(sha256="0" * 64))


def _other_ids(f):
    _patched_header(f, f, lambda h: h["engine"].update(tokens=[5] * len(h["engine"]["tokens"])))


def _misshapen(f):
    """A header that passes every file check but names a tensor of the right bytes in the
    wrong shape: only restoring it finds out (it was counted as a hit on every request,
    never removed, and the shorter valid prefix never used)."""
    def edit(h):
        t = next(t for t in h["tensors"] if t["name"].endswith("win_k") and len(t["shape"]) == 3)
        a, b, c = t["shape"]
        t["shape"] = [a, b * c]
    _patched_header(f, f, edit)


def _flip(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-7])


def _foreign_kv(f):
    # the settings are what a file is matched on (a label only names them)
    _patched_header(f, f, lambda h: h["kv"]["settings"].update(k_method="int8", v_method="int8"))


@pytest.mark.parametrize("spoil", [_flip, _truncate, _foreign_model, _foreign_kv, _other_ids,
                                   _misshapen,
                                   lambda f: f.write_text("not a session")])
def test_bad_files_are_skipped_and_removed(m, prompt, tmp_path, caplog, spoil):
    kv = "kivi-4"
    cold, _ = _run(Scheduler(m, parallel=1, ctx=1024, kv=kv, cache_ram_mb=64,
                             cache_dir=tmp_path), prompt)
    files = sorted(_files(tmp_path), key=lambda p: p.stat().st_size)
    longest = files[-1]                             # the one a restart looks up first
    spoil(longest)
    spoiled = longest.read_bytes()
    s = Scheduler(m, parallel=1, ctx=1024, kv=kv, cache_ram_mb=64, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvrun.prefix_cache"):
        warm, start = _run(s, prompt)
    assert warm == cold
    # the spoiled file was removed (logged), the next boundary's file used instead; the
    # prefill past it wrote a good file again under the same name
    from kvrun.engine.session import read_session
    assert longest.read_bytes() != spoiled
    assert read_session(longest, 1 << 30)[0]["engine"]["tokens"] == prompt[:192]
    assert any("removing" in r.getMessage() and longest.name in r.getMessage()
               for r in caplog.records), caplog.text
    assert start == 128
    assert s.prefix.stats()["disk_hits"] == 1            # the spoiled one is no hit


def test_bound_holds_and_only_its_files_are_touched(m, wikitext, tmp_path):
    d = tmp_path / "cache"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    outside = tmp_path / "outside.kvpc"
    outside.write_text("not in the cache dir")
    link = d / ("a" * 64 + ".kvpc")
    link.symlink_to(outside)
    from test_files import _dead_pid
    stale = d / ("." + "b" * 64 + f".kvpc.{_dead_pid()}-x1y2.tmp")    # a killed write's
    stale.write_bytes(b"half")
    s = Scheduler(m, parallel=1, ctx=1024, kv="kivi-4", cache_ram_mb=64, cache_dir=d)
    assert not stale.exists()
    _run(s, m.tokenize(wikitext[3000:6000])[:130], 2)
    one = sum(p.stat().st_size for p in _files(d) if not p.is_symlink())
    assert one > 0
    budget_mb = 2.5 * one / (1 << 20)
    s = Scheduler(m, parallel=1, ctx=1024, kv="kivi-4", cache_ram_mb=64, cache_dir=d,
                  cache_disk_mb=budget_mb)
    for i in range(5):
        _run(s, m.tokenize(f"Topic {i}. " + wikitext[3000 + 500 * i:9000])[:200], 2)
        held = sum(p.stat().st_size for p in _files(d) if not p.is_symlink())
        assert 0 < held <= budget_mb * (1 << 20)
        assert s.prefix.stats()["disk_bytes"] == held
    assert len(_files(d)) < 1 + 2 + 5 * 3            # the least recently used went
    assert (d / "notes.txt").read_text() == "mine"
    assert link.is_symlink() and outside.read_text() == "not in the cache dir"
    assert sorted(os.listdir(tmp_path)) == ["cache", "outside.kvpc"]
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


def test_bad_cache_dir_or_bound(m, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(KvrunError, match="cache-dir .*: not a directory"):
        Scheduler(m, parallel=1, cache_dir=f)
    with pytest.raises(KvrunError, match="cache-disk-mb"):
        Scheduler(m, parallel=1, cache_dir=tmp_path, cache_disk_mb=-1)


def test_names_hash_model_kv_and_ids(m, tmp_path):
    from kvrun.engine.prefix_cache import kv_key
    from kvrun.kv.config import parse_kv
    s = Scheduler(m, parallel=1, cache_dir=tmp_path)
    disk = s.prefix.disk
    ids = list(range(10, 200))
    a = disk.paths(kv_key(parse_kv("fp16")), ids, [64, 128])
    b = disk.paths(kv_key(parse_kv("int8")), ids, [64, 128])
    c = disk.paths(kv_key(parse_kv("fp16")), ids[:127] + [7], [64, 128])
    assert a[64] != a[128] and a[64] != b[64] and a[64] == c[64] and a[128] != c[128]
    assert all(p.parent == disk.root for p in (*a.values(), *b.values()))


def test_the_cache_reads_no_file_through_a_symlink(m, tmp_path):
    """A symlink swapped in between the directory scan and the read is refused at open."""
    from kvrun.engine.session import read_session
    m.engine.prefill(m.tokenize("a session to link to"))
    real = tmp_path / "real.kvsession"
    m.save(real)
    assert read_session(real, 1 << 30, follow=False)[0]                       # a plain file reads
    link = tmp_path / ("0" * 64 + ".kvpc")
    link.symlink_to(real)
    with pytest.raises(KvrunError, match="symlink"):
        read_session(link, 1 << 30, follow=False)
    fifo = tmp_path / "fifo.kvpc"
    os.mkfifo(fifo)
    with pytest.raises(KvrunError, match="not a regular file"):       # never blocks on it
        read_session(fifo, 1 << 30, follow=False)


# -- what a hostile neighbour may put in the directory -------------------------------------------

def test_empty_cache_dir_is_an_error(m, tmp_path, monkeypatch):
    """`--cache-dir ''` wrote up to 1 GiB into the current directory, silently."""
    monkeypatch.chdir(tmp_path)
    for bad in ("", "  "):
        with pytest.raises(KvrunError, match="cache-dir is empty"):
            Scheduler(m, parallel=1, cache_dir=bad)
    assert os.listdir(tmp_path) == []


def test_files_are_private(m, prompt, tmp_path):
    """Entry headers hold the prompts' token ids: 0600 files in a 0700 directory (they were
    0644 in 0755, readable by any local user)."""
    d = tmp_path / "new" / "cache"
    _run(Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d), prompt, 2)
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert _files(d) and all(p.stat().st_mode & 0o777 == 0o600 for p in _files(d))


def test_a_fifo_under_an_entry_name_is_left_alone(m, prompt, tmp_path, caplog):
    d = tmp_path / "c"
    cold, _ = _run(Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d), prompt, 2)
    longest = max(_files(d), key=lambda p: p.stat().st_size)
    longest.unlink()
    os.mkfifo(longest)
    s = Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d)
    with caplog.at_level(logging.WARNING, logger="kvrun.prefix_cache"):
        warm, start = _run(s, prompt, 2)
    assert warm == cold and start == 128                # the next shorter file, not the FIFO
    import stat
    assert stat.S_ISFIFO(os.lstat(longest).st_mode)     # it was silently replaced
    assert "not a regular file" in caplog.text


def _cold_with_its_longest_file_grown(m, prompt, d, size: int):
    """(cold reply, path): a cold run that writes cache files into d, then its longest
    file grown to `size` bytes (sparse: a corrupt entry that big)."""
    cold, _ = _run(Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d), prompt, 2)
    longest = max(_files(d), key=lambda p: p.stat().st_size)
    with open(longest, "r+b") as f:
        f.truncate(size)
    return cold, longest


def test_an_oversized_file_is_removed_unread_and_outside_the_lock(m, prompt, tmp_path, caplog):
    """A 1 GiB corrupt entry was read whole, under the scheduler's lock that /health takes
    (7.8 s frozen, 2 GB RSS): now the size bound refuses it before any read, and no file is
    read while the lock is held."""
    import threading
    d = tmp_path / "c"
    cold, longest = _cold_with_its_longest_file_grown(m, prompt, d, 2 << 30)
    s = Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d, cache_disk_mb=4096)
    s.prefix.disk.budget = 64 << 20
    held = []
    real_get = s.prefix.disk.get

    def get(*a):
        t = threading.Thread(target=lambda: held.append(s._lock.acquire(timeout=5) and
                                                        (s._lock.release() or True)))
        t.start()
        t.join()
        return real_get(*a)
    s.prefix.disk.get = get
    with caplog.at_level(logging.WARNING, logger="kvrun.prefix_cache"):
        warm, start = _run(s, prompt, 2)
    assert warm == cold and start == 128
    assert held and all(held)                            # the lock was free during each read
    assert "larger" in caplog.text and longest.stat().st_size < 64 << 20  # removed, rewritten


def test_a_file_too_big_for_the_requests_cache_is_not_read(m, prompt, tmp_path):
    """A file that passes the budget but holds more than the receiving cache could take
    back is skipped unread (with a 1 GiB budget a 1 GiB corrupt entry added 2 GB of RSS to
    every request that looked it up), and the prefill's own write replaces it."""
    from kvrun.engine import prefix_disk
    d = tmp_path / "c"
    cold, longest = _cold_with_its_longest_file_grown(m, prompt, d, 512 << 20)
    s = Scheduler(m, parallel=1, ctx=1024, kv="fp16", cache_dir=d, cache_disk_mb=4096)
    reads = []
    real = prefix_disk.read_session
    prefix_disk.read_session = lambda p, *a, **k: reads.append(p) or real(p, *a, **k)
    try:
        warm, start = _run(s, prompt, 2)
    finally:
        prefix_disk.read_session = real
    assert warm == cold and start == 128
    assert longest not in reads
    assert longest.stat().st_size < 64 << 20             # the prefill's write replaced it
