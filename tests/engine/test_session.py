"""Sessions on disk (runtime/engine/session.py): after a restore, greedy output equals the
uninterrupted generation's, token for token, on the default model for fp16, int8, kivi-4
and auto, and on Gemma 3's rings; the file holds the cache's own bytes (about the KV bytes
held, not -c's allocation); a file of another model, dtype or KV config, or one truncated,
corrupt or not a session, is one KvrunError and leaves the cache as it was."""
from __future__ import annotations

import json

import pytest
import torch

import kvrun
from kvrun.engine.chat_session import ChatSession
from kvrun.engine.generate import Timings
from kvrun.engine.sampling import SamplingParams
from kvrun.errors import KvrunError

GREEDY = SamplingParams(temp=0)
pytestmark = pytest.mark.usefixtures("one_thread_cap")       # conftest.py


def _run(m, ids, n, append=False):
    """Greedy ids; `append`: the prompt continues the cache as it stands (a chat's turn)."""
    t = Timings()
    return [tok for tok, _ in m.engine.tokens(ids, n, GREEDY, set(), t, append)], t


def _prompt(m, wikitext, n):
    return m.tokenize(wikitext[5000:20000])[:n]


def _state(m):
    snap = m.cache.snapshot()
    return list(m.engine.cached), m.engine.canon, {k: t.clone() for k, t in snap.tensors.items()}


def _same_state(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[2].keys() == b[2].keys()
    for k in a[2]:
        assert torch.equal(a[2][k], b[2][k]), k


def _roundtrip(load, wikitext, tmp_path, n_prompt, n_gen=24):
    """Generate, save, continue (the uninterrupted run); then a freshly loaded model restores
    the file and continues: the two continuations and their prefix reuse must agree."""
    m = load()
    p1 = _prompt(m, wikitext, n_prompt)
    first, _ = _run(m, p1, n_gen)
    saved = _state(m)
    size = m.save(tmp_path / "s.kvs")
    p2 = p1 + first + m.tokenize(" And then", bos=False)
    want, t_want = _run(m, p2, n_gen, append=True)
    m2 = load()
    m2.load_session(tmp_path / "s.kvs")
    _same_state(_state(m2), saved)
    got, t_got = _run(m2, p2, n_gen, append=True)
    assert got == want
    assert t_got.prompt_tokens == t_want.prompt_tokens < len(p2)     # the prefix was reused
    return m2, size, sum(t.nbytes for t in saved[2].values())


@pytest.mark.parametrize("kv,n_prompt", [("fp16", 301), ("int8", 333), ("kivi-4", 417), ("auto", 290)])
def test_restore_continues_as_the_uninterrupted_run(wikitext, tmp_path, kv, n_prompt):
    m, size, held = _roundtrip(lambda: kvrun.load(kv=kv, ctx=2048), wikitext, tmp_path, n_prompt)
    # the file is the held bytes plus a header (tokens, tensor table), not -c's allocation
    assert held < size < held + 64 * 1024
    assert size < sum(m.kv_bytes().values()) / 2


@pytest.fixture(scope="module")
def gemma_name():
    try:
        kvrun.load("gemma-3-270m", ctx=64)
    except KvrunError as e:
        pytest.skip(f"gemma-3-270m is not available here: {e}")
    return "gemma-3-270m"


@pytest.mark.parametrize("kv", ["fp16", "kivi-4"])
def test_gemma_rings_restore(gemma_name, wikitext, tmp_path, kv):
    # 600 prompt tokens: the 512-slot rings have wrapped when the session is saved
    m, _, _ = _roundtrip(lambda: kvrun.load(gemma_name, kv=kv, ctx=1024), wikitext, tmp_path, 600, 16)
    assert m.cache.ring.seq_len == m.cache.seq_len > m.cache.ring.W


def test_chat_session_continues_after_restore(tmp_path):
    turns = ["Name a prime number.", "And one larger than 100?", "Which is even?"]
    a = ChatSession(kvrun.load(kv="kivi-4", ctx=1024))
    replies = ["".join(e.text for e in a.reply(turns[0], 30, temp=0))]
    a.save(tmp_path / "c.kvs")
    replies += ["".join(e.text for e in a.reply(t, 30, temp=0)) for t in turns[1:]]
    b = ChatSession(kvrun.load(kv="kivi-4", ctx=1024))
    b.load(tmp_path / "c.kvs")
    assert ["".join(e.text for e in b.reply(t, 30, temp=0)) for t in turns[1:]] == replies[1:]


# -- hostile files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("sess")
    m = kvrun.load(kv="kivi-4", ctx=1024)
    _run(m, list(range(10, 300)), 8)
    m.save(d / "good.kvs")
    return m, d / "good.kvs"


def _refused(m, path, match):
    before = _state(m)
    with pytest.raises(KvrunError, match=match):
        m.load_session(path)
    _same_state(_state(m), before)                  # the cache is left as it was


def _patched_header(src, dst, edit):
    """A copy of a session file whose header JSON went through `edit`, re-checksummed."""
    import hashlib
    from kvrun.engine.session import _PRE, MAGIC, VERSION
    data = src.read_bytes()
    _, _, hlen = _PRE.unpack_from(data)
    header = json.loads(data[_PRE.size:_PRE.size + hlen])
    edit(header)
    h = json.dumps(header).encode()
    body = _PRE.pack(MAGIC, VERSION, len(h)) + h + data[_PRE.size + hlen:-32]
    dst.write_bytes(body + hashlib.sha256(body).digest())
    return dst


@pytest.mark.parametrize("cut", [0, 5, 20, 1000, -1])
def test_truncated(saved, tmp_path, cut):
    m, good = saved
    data = good.read_bytes()
    (tmp_path / "t.kvs").write_bytes(data[:cut] if cut >= 0 else data[:-1])
    _refused(m, tmp_path / "t.kvs", "not a kvrun session|truncated|corrupt")


@pytest.mark.parametrize("where", [30, 2000, -100, -1])
def test_corrupt_byte(saved, tmp_path, where):
    m, good = saved
    data = bytearray(good.read_bytes())
    data[where] ^= 0x40
    (tmp_path / "c.kvs").write_bytes(bytes(data))
    _refused(m, tmp_path / "c.kvs", "corrupt|malformed|truncated")


def test_not_a_session(saved, tmp_path):
    m, _ = saved
    (tmp_path / "x.json").write_text('{"format": "kvrun-kv-profile"}')
    _refused(m, tmp_path / "x.json", "not a kvrun session")
    _refused(m, tmp_path / "missing.kvs", "no such session file")
    _refused(m, tmp_path, "is a directory")


def test_other_kv_method_or_model(saved, tmp_path):
    _, good = saved
    with pytest.raises(KvrunError, match="saved with --kv 'kivi-4'.*'int8'"):
        kvrun.load(kv="int8", ctx=1024, session=good)
    with pytest.raises(KvrunError, match="saved with --dtype auto"):
        kvrun.load(kv="kivi-4", ctx=1024, dtype="fp32", session=good)
    m, _ = saved
    bad = _patched_header(good, tmp_path / "m.kvs", lambda h: h["model"].update(sha256="0" * 64))
    _refused(m, bad, "saved for model")


def test_ring_width_is_recorded_only_when_set(saved, tmp_path):
    """A file from before the ring setting (no "ring" in its settings) still loads into the
    same config; a ring width set is part of the record, so a file saved with it differs."""
    from kvrun.engine.session import kv_record
    from kvrun.kv import parse_kv
    assert "ring" not in kv_record(parse_kv("kivi-4"))["settings"]
    assert kv_record(parse_kv("kivi-4", ring=8))["settings"]["ring"] == 8
    m, good = saved
    old = _patched_header(good, tmp_path / "old.kvs", lambda h: h["kv"]["settings"].pop("ring", None))
    m.load_session(old)
    bad = _patched_header(good, tmp_path / "r8.kvs", lambda h: h["kv"]["settings"].update(ring=8))
    _refused(m, bad, "its settings must match")


def test_the_label_is_not_compared(saved, tmp_path):
    """A file whose label is spelled otherwise (a profile's label before a rotation given
    over it was shown) loads when its settings match."""
    m, good = saved
    m.load_session(_patched_header(good, tmp_path / "l.kvs", lambda h: h["kv"].update(label="x")))


def test_too_long_for_the_context(saved):
    _, good = saved
    with pytest.raises(KvrunError, match="raise -c"):
        kvrun.load(kv="kivi-4", ctx=256, session=good)


@pytest.mark.parametrize("edit", [
    lambda h: h["engine"].update(tokens=h["engine"]["tokens"][:-3]),          # ids ≠ cache
    lambda h: h["engine"].update(tokens=[10**9] * len(h["engine"]["tokens"])),  # not ids
    lambda h: h["cache"].update(n_tail=[64] * 30),                              # counts ≠ sum
    lambda h: h["tensors"][0].update(shape=[1, 2, 3]),                          # bytes ≠ shape
    lambda h: h["tensors"].pop(),                                               # a tensor missing
    lambda h: h.update(engine=[]),
])
def test_checksummed_but_inconsistent_headers(saved, tmp_path, edit):
    m, good = saved
    _refused(m, _patched_header(good, tmp_path / "h.kvs", edit), ".")


def test_evicting_cache_cannot_be_saved(tmp_path):
    from kvrun.kv.config import parse_kv
    m = kvrun.load(kv=parse_kv("kivi-4", evict="h2o", budget=256), ctx=512)
    _run(m, list(range(10, 100)), 4)
    with pytest.raises(KvrunError, match="eviction"):
        m.save(tmp_path / "e.kvs")
    assert not (tmp_path / "e.kvs").exists()


# -- kvrun chat --session --------------------------------------------------------------------------

def _chat(args, text):
    from click.testing import CliRunner
    from kvrun.cli.main import main
    return CliRunner().invoke(main, ["chat", "--temp", "0", "-n", "12", *args], input=text)


def test_chat_session_survives_a_restart(tiny_dir, tmp_path):
    f = str(tmp_path / "chat.kvs")
    base = ["-m", str(tiny_dir), "-c", "256", "--kv", "fp16"]
    one = _chat([*base, "--session", f], "hello there\n")
    two = _chat([*base, "--session", f], "and again\n")
    both = _chat(base, "hello there\nand again\n")
    assert one.exit_code == two.exit_code == both.exit_code == 0, one.stderr + two.stderr
    assert "tokens restored" in two.stderr and "tokens restored" not in one.stderr
    assert one.stdout + two.stdout == both.stdout
    # the restored turn prefilled only its own tokens, as the second turn of one process did
    assert two.stderr.split("new prompt tok")[0].split("[")[-1] == \
        both.stderr.split("new prompt tok")[1].split("[")[-1]


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p.write_bytes(b"KVRUNSES" + (1).to_bytes(4, "little") + (99).to_bytes(8, "little")),
     "truncated"),
    (lambda p: p.write_bytes(b"KVRUNSES" + b"\0" * 40), "format version 0"),
    (lambda p: p.write_text("hello"), "not a kvrun session"),
    (lambda p: p.mkdir(), "is a directory"),
])
def test_chat_session_bad_file_is_one_error_line(tiny_dir, tmp_path, make, fragment):
    f = tmp_path / "bad.kvs"
    make(f)
    r = _chat(["-m", str(tiny_dir), "-c", "256", "--session", str(f)], "hi\n")
    assert r.exit_code != 0 and "Traceback" not in r.output + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in r.stderr


def test_chat_session_other_kv_is_one_error_line(tiny_dir, tmp_path):
    f = str(tmp_path / "s.kvs")
    assert _chat(["-m", str(tiny_dir), "-c", "256", "--session", f], "hi\n").exit_code == 0
    r = _chat(["-m", str(tiny_dir), "-c", "256", "--kv", "int8", "--session", f], "hi\n")
    assert r.exit_code != 0 and "saved with --kv 'fp16'" in r.stderr.strip().splitlines()[-1]


# -- every codec's layout, on the tiny model --------------------------------------------------

@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    from tiny import make_tiny_model_dir
    return make_tiny_model_dir(tmp_path_factory.mktemp("sess32") / "tiny", hidden_size=128)


@pytest.mark.parametrize("method", ["kivi-2", "tada-4", "gear-l", "gear", "kivi-4+rot", "int8/kivi-2",
                                    "kivi-3/cb-3", "bf16", "fp32"])
@pytest.mark.parametrize("n_prompt", [45, 170])
def test_every_codec_round_trips(tiny32, tmp_path, method, n_prompt):
    from kvrun.kv.config import parse_kv
    kv = parse_kv(method, residual=32, group=32, tada_mu="int8" if method == "tada-4" else "fp16")
    load = lambda: kvrun.load(tiny32, dtype="fp32", ctx=512, kv=kv, prefill_chunk=48)  # noqa: E731
    ids = torch.randint(3, 259, (n_prompt,), generator=torch.Generator().manual_seed(n_prompt)).tolist()
    m = load()
    first, _ = _run(m, ids, 30)
    saved = _state(m)
    m.save(tmp_path / "t.kvs")
    want, _ = _run(m, ids + first + [7, 8, 9], 30, append=True)
    m2 = load()
    m2.load_session(tmp_path / "t.kvs")
    _same_state(_state(m2), saved)
    assert _run(m2, ids + first + [7, 8, 9], 30, append=True)[0] == want


# -- files that are not sessions, and two writers ------------------------------------------------

@pytest.fixture()
def tiny_m(tiny_dir):
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv="fp16")
    _run(m, list(range(10, 60)), 4)
    return m


def test_save_never_replaces_a_fifo_or_device(tiny_m, tmp_path):
    import os
    import stat
    fifo = tmp_path / "n"
    os.mkfifo(fifo)
    for p in (fifo, "/dev/full", "/dev/null"):
        if os.path.exists(p):
            with pytest.raises(KvrunError, match="not a regular file"):
                tiny_m.save(p)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["n"]          # no lock file beside a refused path
    assert not os.path.exists("/dev/.full.lock") and not os.path.exists("/dev/.null.lock")


def test_loading_a_fifo_or_dev_zero_fails_at_once(tiny_m, tmp_path):
    """A FIFO hung load_session, /dev/zero was read until MemoryError; a file larger than
    any session of this model is refused before it is read."""
    import os
    from refusals import refusals
    fifo = tmp_path / "f.kvs"
    os.mkfifo(fifo)
    big = tmp_path / "big.kvs"
    with open(big, "wb") as f:
        f.write(b"KVRUNSES")
        f.truncate(4 << 30)
    got = refusals(tiny_m.load_session, (fifo, "/dev/zero", big), 20)
    assert len(got) == 3 and "not a regular file" in got[0] and "larger" in got[2]


def test_session_file_is_private(tiny_m, tmp_path):
    tiny_m.save(tmp_path / "s.kvs")
    assert (tmp_path / "s.kvs").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("extra", [{"x": object()}, {"x": float("nan")}, ["not", "a", "dict"]])
def test_extra_that_is_not_json_is_one_error(tiny_m, tmp_path, extra):
    with pytest.raises(KvrunError, match="extra"):
        tiny_m.save(tmp_path / "s.kvs", extra=extra)
    assert list(tmp_path.iterdir()) == []


def test_second_writer_of_a_session_is_refused(tiny_m, tiny_dir, tmp_path):
    """Two chats on one file overwrote each other's turns; the second one is now refused,
    the library's save too, while the first holds the file."""
    f = tmp_path / "chat.kvs"
    first = ChatSession(tiny_m)
    first.attach(f)
    "".join(e.text for e in first.reply("hi", 4, temp=0))
    first.save(f)
    other = kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv="fp16")
    with pytest.raises(KvrunError, match="in use"):
        ChatSession(other).attach(f)
    with pytest.raises(KvrunError, match="in use"):
        other.save(f)
    cli = _chat(["-m", str(tiny_dir), "-c", "256", "--kv", "fp16", "--session", str(f)], "x\n")
    assert cli.exit_code == 1 and "in use" in cli.stderr and "Traceback" not in cli.stderr
    first.close()
    ChatSession(other).attach(f)                    # free again


def test_a_killed_chats_temp_file_is_swept_at_start(tiny_m, tmp_path):
    from test_files import _dead_pid
    f = tmp_path / "chat.kvs"
    stale = tmp_path / f".chat.kvs.{_dead_pid()}-x1y2z3.tmp"
    stale.write_bytes(b"half a session")
    ChatSession(tiny_m).attach(f)
    assert not stale.exists()
