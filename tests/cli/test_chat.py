"""kvrun.cli.chat: the REPL's /commands, its history file, and its banner."""
from types import SimpleNamespace

import pytest

from kvrun.cli import chat
from kvrun.engine.generate import PromptTooLong
from kvrun.errors import KvrunError


@pytest.mark.parametrize("line, got", [
    ("/help", ("/help", None)), ("  /clear ", ("/reset", None)), ("/quit", ("/exit", None)),
    ("hello /kv", (None, "hello /kv")), ("//kv is a command", (None, "/kv is a command")),
    ("  //x", (None, "/x")),
])
def test_parse_command(line, got):
    assert chat.parse_command(line) == got


@pytest.mark.parametrize("line, match", [
    ("/hlep", r"unknown command '/hlep' \(/help lists them"), ("/kv now", "/kv takes no argument"),
])
def test_parse_command_refuses(line, match):
    with pytest.raises(KvrunError, match=match):
        chat.parse_command(line)


def test_help_lists_every_command_and_alias():
    lines = chat.help_text().splitlines()
    assert lines[0] == "commands:" and lines[-1].startswith("Ctrl-C stops a reply")
    assert any(line.split()[:2] == ["/reset,", "/clear"] for line in lines)
    assert len(lines) == 2 + len(chat.COMMANDS) + 2


def test_full_hint_says_what_would_make_room():
    def session(can_shift):
        return SimpleNamespace(m=SimpleNamespace(engine=SimpleNamespace(can_shift=can_shift)))
    fits_alone = PromptTooLong("too long", cached=200, new=50, ctx=256)
    assert chat.full_hint(session(True), fits_alone) == "; /reset starts a new conversation"
    assert chat.full_hint(session(False), fits_alone).endswith(chat.SHIFT_HINT)
    assert chat.full_hint(session(False), PromptTooLong("x", 0, 300, 256)) == ""


def test_chat_history_file(monkeypatch, tmp_path):
    """The history a terminal session leaves is read back by the next one."""
    readline = pytest.importorskip("readline")
    from kvrun.cli.chat import LineReader, history_path
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))
    monkeypatch.delenv("KVRUN_CHAT_HISTORY", raising=False)
    assert history_path() == tmp_path / "chat_history"
    monkeypatch.setenv("KVRUN_CHAT_HISTORY", "")
    assert history_path() is None                       # in memory only
    monkeypatch.setenv("KVRUN_CHAT_HISTORY", str(tmp_path / "sub" / "h"))
    try:
        readline.clear_history()
        r = LineReader(interactive=True)
        readline.add_history("what is a KV cache?")
        r.close()
        readline.clear_history()
        LineReader(interactive=True)
        assert readline.get_history_item(readline.get_current_history_length()) == \
            "what is a KV cache?"
    finally:
        readline.clear_history()
