"""kvrun.cli.server_log: one line per HTTP request when its reply is done, with the client,
route, status, time and the tokens of the scheduler requests it ran; quiet for a healthy
/health or /metrics."""
import io
import re
from types import SimpleNamespace

from kvrun.cli.server_log import RequestLog, log_tokens
from test_server_http import _asgi, _ok


def test_line_per_request_with_its_tokens():
    out = io.StringIO()
    log = RequestLog(out)

    async def endpoint(scope, receive, send):
        log_tokens(scope, [SimpleNamespace(prompt=[1] * 7, n_tokens=3),
                           SimpleNamespace(prompt=[1] * 7, n_tokens=4)])     # n = 2
        await _ok(scope, receive, send)
    _asgi(log.middleware(endpoint), path="/v1/chat/completions")
    _asgi(log.middleware(_ok), method="GET", path="/health")                 # quiet
    _asgi(log.middleware(_ok), method="GET", path="/metrics")
    assert re.fullmatch(r"kvrun serve: - POST /v1/chat/completions 200 \d+\.\d\d s, "
                        r"7 prompt \+ 7 completion tokens\n", out.getvalue()), out.getvalue()


def test_a_failing_or_unhealthy_request_is_still_logged():
    out = io.StringIO()
    log = RequestLog(out)
    log.line({"method": "GET", "path": "/health", "client": ("10.0.0.9", 5)}, 503, 0.5)
    log.line({"method": "POST", "path": "/x" * 300}, 499, 2.0)            # client gone
    first, second = out.getvalue().splitlines()
    assert first == "kvrun serve: 10.0.0.9 GET /health 503 0.50 s"
    assert second == f"kvrun serve: - POST {('/x' * 100)} 499 2.00 s"
