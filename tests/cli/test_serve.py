"""kvrun.cli.serve: `kvrun serve`'s values checked before the model loads (each one line
naming its flag), --ray-only flags refused without --ray, and a busy port refused before the
load. The server itself: test_server.py and the test_serve_*.py files."""
import socket

import pytest
from click.testing import CliRunner

pytest.importorskip("uvicorn")
from kvrun.cli.serve import _listen, serve_cmd  # noqa: E402
from kvrun.errors import KvrunError  # noqa: E402


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "--port must be in 1..65535 (got 0)"),
    (["--parallel", "0"], "--parallel must be >= 1 (got 0)"),
    (["--cache-ram", "-1"], "--cache-ram must be a finite number >= 0 MiB (got -1)"),
    (["--cache-disk-mb", "inf"], "--cache-disk-mb must be a finite number >= 0 MiB (got inf)"),
    (["--queue", "-1"], "--queue must be >= 0 (got -1)"),
    (["--max-body-mb", "2000"], "--max-body-mb must be in (0, 1024] (got 2000)"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be in [0, 3600] s (got -1)"),
    (["--api-key", " "], "--api-key must be printable and not empty"),
    (["--replicas", "3"], "--replicas needs --ray"),
])
def test_bad_values_are_refused_before_the_load(args, message):
    r = CliRunner().invoke(serve_cmd, args)
    assert isinstance(r.exception, KvrunError) and str(r.exception) == message


def test_a_busy_port_is_one_line():
    first = _listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        assert first.family == socket.AF_INET
        with pytest.raises(KvrunError, match=f"^cannot listen on 127.0.0.1:{port}: "):
            _listen("127.0.0.1", port)
    finally:
        first.close()
