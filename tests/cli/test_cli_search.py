"""kvrun.cli.search: `kvrun search`'s --bits and --rings lists, and its refusals before the
model loads (the search itself: tests/eval/test_search.py)."""
import pytest
from click.testing import CliRunner

from kvrun.cli.search import _bits, search_cmd
from kvrun.errors import KvrunError


def test_bits_lists():
    assert _bits(None) is None
    assert _bits(" 2, 4,16") == [2, 4, 16]
    for bad in ("2,,4", "", "two", "4.5"):
        with pytest.raises(KvrunError, match=f"^--bits must be a comma list of integers like "
                                             f"2,4,8, got {bad!r}$"):
            _bits(bad)
    with pytest.raises(KvrunError, match="^--rings must be a comma list of integers like 4,8"):
        _bits("8,", "--rings", "4,8")


def test_refused_before_the_model_loads(tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("some text")
    base = ["--calib", str(calib), "--budget", "0.5", "-o", str(tmp_path / "p.json")]
    r = CliRunner().invoke(search_cmd, [*base, "--bits", "2,x"])
    assert isinstance(r.exception, KvrunError) and "--bits must be a comma list" in str(r.exception)
    r = CliRunner().invoke(search_cmd, [*base[:1], str(tmp_path / "missing.txt"), *base[2:]])
    assert isinstance(r.exception, KvrunError) and str(r.exception).endswith(": no such file")
