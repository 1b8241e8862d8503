"""kvrun.cli.server_metrics: `kvrun serve`'s /metrics over a stand-in scheduler: replies
counted by route and status, finished sequences' tokens and time to first token, the
scheduler's gauges and the prefix cache's counters read at each scrape."""
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvrun.cli.server_metrics import Metrics  # noqa: E402
from test_server_http import _asgi, _ok  # noqa: E402

PREFIX = {"prompt_tokens": 90, "hit_tokens": 60, "requests": 4, "hits": 3, "bytes": 2048,
          "entries": 2, "disk_hits": 1, "disk_bytes": 512, "disk_files": 1}


def _samples(m: Metrics) -> dict:
    body, ctype = m.exposition()
    assert ctype.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_counters_gauges_and_the_prefix_cache():
    stats = {"waiting": 2, "running": 1, "kv_used_bytes": 4096}
    sched = SimpleNamespace(stats=lambda: stats,
                            prefix=SimpleNamespace(stats=lambda: PREFIX))
    m = Metrics(sched, routes={"/v1/completions"})
    app = m.middleware(_ok)
    _asgi(app, path="/v1/completions")
    _asgi(app, path="/v1/completions")
    _asgi(app, method="GET", path="/secret/thing")
    m.done(SimpleNamespace(prompt=[0] * 5, n_tokens=3, ttft=0.2))
    m.done(SimpleNamespace(prompt=[0] * 2, n_tokens=0, ttft=None))     # never got a token
    stats["running"] = 0                                              # read at the scrape
    s = _samples(m)
    assert s[("kvrun_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    assert s[("kvrun_requests_total", (("endpoint", "other"), ("status", "200")))] == 1
    assert (s[("kvrun_prompt_tokens_total", ())], s[("kvrun_generation_tokens_total", ())]) == (7, 3)
    assert s[("kvrun_time_to_first_token_seconds_count", ())] == 1
    assert s[("kvrun_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert s[("kvrun_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert (s[("kvrun_requests_waiting", ())], s[("kvrun_requests_running", ())]) == (2, 0)
    assert s[("kvrun_prefix_cache_requests_total", (("hit", "false"),))] == 1
    assert s[("kvrun_prefix_cache_hits_total", ())] == 60
    assert s[("kvrun_prefix_cache_disk_files", ())] == 1


def test_without_a_prefix_cache_its_families_are_absent():
    sched = SimpleNamespace(stats=lambda: {"waiting": 0, "running": 0, "kv_used_bytes": 0},
                            prefix=None)
    assert not any(name.startswith("kvrun_prefix_cache") for name, _ in _samples(Metrics(sched, set())))
