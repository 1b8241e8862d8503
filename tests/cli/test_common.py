"""kvrun.cli.common: the group every `kvrun` command runs under turns each way a command can
fail into one `error:` line and an exit status; the --threads type; one_line."""
import errno

import click
import pytest

from kvrun.cli.common import KvrunGroup, ThreadCount, one_line
from kvrun.errors import KvrunError


def _group(exc):
    @click.group(cls=KvrunGroup)
    @click.option("--debug", is_flag=True)
    def g(debug):
        pass

    @g.command("go")
    @click.option("-n", type=int, default=1)
    def go(n):
        if exc is not None:
            raise exc
    return g


def _status(capsys, exc, args=("go",)) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        _group(exc).main(list(args), prog_name="kvrun")
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("exc, code, err", [
    (None, 0, ""),
    (KvrunError("bad\n  thing"), 1, "error: bad thing\n"),
    (KeyboardInterrupt(), 130, "\ninterrupted\n"),
    (OSError(errno.ENOENT, "No such file or directory", "/x/y"), 1,
     "error: /x/y: No such file or directory\n"),
    (RuntimeError("oops"), 1, "error: internal error (RuntimeError: oops); `kvrun --debug ...` "
                              "shows the traceback\n"),
])
def test_each_failure_is_one_line_and_a_status(capsys, exc, code, err):
    assert _status(capsys, exc) == (code, err)


def test_a_closed_pipe_is_quiet(capsys):
    assert _status(capsys, BrokenPipeError(errno.EPIPE, "Broken pipe")) == (141, "")


def test_usage_errors_name_the_help_to_read(capsys):
    code, err = _status(capsys, None, ["go", "-n", "x"])
    assert (code, err) == (1, "error: Invalid value for '-n': 'x' is not a valid integer. "
                              "(see 'kvrun go --help')\n")
    assert _status(capsys, None, ["nope"]) == (1, "error: No such command 'nope'. "
                                                  "(see 'kvrun --help')\n")


def test_debug_shows_the_error_itself():
    with pytest.raises(KvrunError, match="bad"):
        _group(KvrunError("bad")).main(["--debug", "go"])


def test_thread_count_and_one_line():
    from kvrun.threads import MAX_THREADS
    t = ThreadCount()
    assert t.convert("3", None, None) == 3
    for bad in ("0", str(MAX_THREADS + 1)):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)
    assert one_line("  a\n\tb  c ") == "a b c"
