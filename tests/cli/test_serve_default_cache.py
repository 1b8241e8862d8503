"""A default `kvrun serve` (no --cache-ram) keeps prompts: the same long system prompt sent
twice, the second request is a prefix-cache hit on /metrics with the same greedy reply;
--help states the default's rule and value (runtime/engine/prefix_budget.py)."""
from __future__ import annotations

import signal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")

from serving import kvrun_serve  # noqa: E402
from test_serve_features import scrape  # noqa: E402

HIT = ("kvrun_prefix_cache_requests_total", (("hit", "true"),))


def _ask(port, system):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300,
                      max_retries=0)
    r = c.chat.completions.create(model="x", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Summarize."}])
    return r.choices[0].message.content


def test_default_serve_reuses_a_repeated_system_prompt(wikitext):
    system = wikitext[5000:8500]                   # ~900 tokens: past the first 512 boundary
    p, port = kvrun_serve("-c", "1536", "--alias", "x")
    try:
        first = _ask(port, system)
        assert scrape(port)[HIT] == 0
        assert _ask(port, system) == first
        m = scrape(port)
        assert m[HIT] == 1 and m[("kvrun_prefix_cache_hits_total", ())] >= 512
        assert m[("kvrun_prefix_cache_entries", ())] >= 1
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0
    assert "prefix cache" in p.stderr.read()       # the startup line says its size


def test_help_states_the_default_and_zero_turns_it_off():
    from click.testing import CliRunner

    from kvrun.cli.main import main
    from kvrun.engine.prefix_budget import SERVE_CAP_MB, machine_memory_mb, serve_default_mb
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    assert f"at most {SERVE_CAP_MB} MiB: {serve_default_mb():g} MiB here" in text
    assert "0: off" in text
    assert 0 < serve_default_mb() <= min(SERVE_CAP_MB, machine_memory_mb())
