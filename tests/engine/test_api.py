"""kvrun.engine.api: `load`'s argument checks (one line each, before any file is read) and a
loaded Model's text round trip, generation counts and batch error naming (tiny model)."""
import pytest

from kvrun.engine.api import Model, check_count, load
from kvrun.errors import KvrunError


@pytest.mark.parametrize("kw, match", [
    (dict(ctx=0), r"context size must be an integer >= 1 \(got 0\)"),
    (dict(ctx=2.5), r"context size must be an integer >= 1 \(got 2.5\)"),
    (dict(prefill_chunk=True), r"prefill chunk must be an integer >= 1 \(got True\)"),
    (dict(threads=0), r"threads must be an integer >= 1"),
    (dict(threads=1 << 20), r"threads must be at most \d+ \(got 1048576\)"),
    (dict(path=3), "a model is a directory path or a pullable name, got int"),
    (dict(kv=4), "kv is a --kv spec string or a KVConfig, got int"),
    (dict(cache_ram_mb=float("inf")), r"cache_ram_mb must be a finite number >= 0 \(got inf\)"),
])
def test_load_refuses_bad_arguments_in_one_line(tmp_path, kw, match):
    with pytest.raises(KvrunError, match=match):
        load(**{"path": tmp_path / "never-read", **kw})


def test_check_count():
    check_count("n", 1)
    for bad in (0, -2, 1.0, "3", float("nan"), None):
        with pytest.raises(KvrunError, match=f"n must be an integer >= 1 \\(got {bad!r}\\)"):
            check_count("n", bad)


def test_a_loaded_model(tiny):
    assert isinstance(tiny, Model) and tiny.ctx == 256
    ids = tiny.tokenize("héllo world", bos=False)
    assert tiny.detokenize(ids) == "héllo world"
    out = tiny.generate_batch(["ab", "cde"], 3, temp=0)
    assert out == [tiny.generate("ab", 3, temp=0), tiny.generate("cde", 3, temp=0)]
    with pytest.raises(KvrunError, match="^prompt 1: "):     # which prompt of the batch
        tiny.generate_batch(["ok", [10 ** 6]], 2)
