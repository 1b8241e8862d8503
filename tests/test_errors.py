"""kvrun.errors: the user-facing exception's helpers (text files, UTF-8 repair) and the
exit codes its signal and interrupt types carry."""
import signal

import pytest

from kvrun.errors import KvrunError, PartialResults, Terminated, as_utf8, read_text_file


def test_read_text_file_returns_utf8_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("héllo\n", encoding="utf-8")
    assert read_text_file(p) == "héllo\n"


def _latin1_file(d):
    (d / "latin1.txt").write_bytes(b"caf\xe9")
    return d / "latin1.txt"


@pytest.mark.parametrize("make, match", [
    (lambda d: "  ", "the text file name is empty"),
    (lambda d: d, "is a directory"),
    (lambda d: d / "missing.txt", "no such file"),
    (_latin1_file, "not UTF-8 text"),
])
def test_read_text_file_says_why_it_cannot(tmp_path, make, match):
    with pytest.raises(KvrunError, match=match):
        read_text_file(make(tmp_path))


def test_as_utf8_replaces_undecodable_bytes_and_warns_once():
    bad = b"caf\xe9 ok".decode("utf-8", "surrogateescape")     # what argv gives for Latin-1
    lines = []
    assert as_utf8(bad, "the prompt", warn=lines.append) == "caf\ufffd ok"
    assert lines == ["warning: the prompt is not valid UTF-8; invalid bytes replaced with U+FFFD"]
    assert as_utf8("\ud800x", "x") == "\ufffdx"                 # a lone surrogate from JSON
    assert as_utf8("fine ü", "x", warn=lines.append) == "fine ü" and len(lines) == 1


def test_terminated_and_partial_results_carry_what_the_cli_reports():
    t = Terminated(signal.SIGTERM)
    assert t.code == 128 + signal.SIGTERM and t.signum == signal.SIGTERM
    p = PartialResults([1, 2], done=2, total=5, unit="windows")
    assert str(p) == "interrupted after 2/5 windows" and p.records == [1, 2]
    assert isinstance(p, KeyboardInterrupt)
