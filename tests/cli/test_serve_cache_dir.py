"""`kvrun serve --cache-dir` across a restart, through the official `openai` client: a
server answers a request with a long shared prefix (cold), stops; a new server on the same
directory answers the same request from the files the first one wrote (/metrics shows the
disk hit) with the cold reply, and a request with the same prefix and another question
starts from them too."""
from __future__ import annotations

import signal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.register_assert_rewrite("hostile_serving")

from serving import kvrun_serve  # noqa: E402
from test_serve_features import scrape  # noqa: E402

N_GEN = 10


def _serve(cache_dir):
    return kvrun_serve("-c", "1024", "-b", "64", "--kv", "auto", "--cache-ram", "64",
                       "--cache-dir", str(cache_dir), "--cache-disk-mb", "64", "--alias", "x")


def _stop(p):
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == 0
    err = p.stderr.read()
    assert "Traceback" not in err, err
    return err


def _ask(port, question, system):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300,
                      max_retries=0)
    r = c.chat.completions.create(model="x", max_tokens=N_GEN, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    return r.choices[0].message.content


def test_a_restarted_server_starts_from_the_files(tmp_path, wikitext):
    system = wikitext[5000:7500]                    # ~600 tokens: 9 chunk boundaries
    d = tmp_path / "pc"
    p, port = _serve(d)
    try:
        cold = _ask(port, "What is this about?", system)
        cold2 = _ask(port, "Name one place.", system)
        m = scrape(port)
        assert m[("kvrun_prefix_cache_disk_hits_total", ())] == 0
        assert m[("kvrun_prefix_cache_disk_files", ())] == len(list(d.glob("*.kvpc"))) > 0
    finally:
        _stop(p) if p.poll() is None else None
    p, port = _serve(d)
    try:
        before = scrape(port)
        assert before[("kvrun_prefix_cache_entries", ())] == 0       # RAM starts empty
        assert _ask(port, "What is this about?", system) == cold
        after = scrape(port)
        assert after[("kvrun_prefix_cache_disk_hits_total", ())] == 1
        assert after[("kvrun_prefix_cache_requests_total", (("hit", "true"),))] == 1
        assert after[("kvrun_prefix_cache_hits_total", ())] >= 512
        assert _ask(port, "Name one place.", system) == cold2           # from RAM now
        assert scrape(port)[("kvrun_prefix_cache_requests_total", (("hit", "true"),))] == 2
    finally:
        if p.poll() is None:
            err = _stop(p)
            assert f"cache dir {d.resolve()}" in err
