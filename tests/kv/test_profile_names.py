"""Shipped KV profiles by name (`--kv profile:smollm2-135m-0.25`) from any directory; a path
still works and wins over a name; anything else is one error line listing the names."""
import json

import pytest
from click.testing import CliRunner

from kvrun.cli.main import main
from kvrun.errors import KvrunError
from kvrun.kv import parse_kv, save_profile
from kvrun.kv.profile import resolve_profile, shipped_profiles
from tiny import make_tiny_model_dir

SHIPPED = "smollm2-135m-0.25"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no runtime/kv/profiles/ below it."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def test_shipped_names_are_the_package_data():
    assert {p.stem for p in shipped_profiles()} >= {"smollm2-135m-0.25", "smollm2-135m-0.30"}


@pytest.mark.parametrize("name", [SHIPPED, SHIPPED + ".json"])
def test_name_resolves_from_any_directory(elsewhere, name):
    want = next(p for p in shipped_profiles() if p.stem == SHIPPED)
    assert resolve_profile(name) == want
    for kv in (parse_kv(f"profile:{name}"), parse_kv("fp16", profile=name)):   # --kv, --kv-profile
        assert kv.profile_info["path"] == str(want) and len(kv.layers) == 30
        assert kv.layers == [(e["k"], e["v"]) for e in json.loads(want.read_text())["layers"]]
        assert kv.label() == f"profile:{SHIPPED}"


def test_a_file_wins_over_a_shipped_name(elsewhere):
    save_profile(elsewhere / SHIPPED, [("int8", "int8")] * 2)      # a local file of that name
    kv = parse_kv(f"profile:{SHIPPED}")
    assert kv.layers == [("int8", "int8")] * 2
    kv = parse_kv(f"profile:{elsewhere / SHIPPED}")                 # an absolute path too
    assert kv.layers == [("int8", "int8")] * 2


def test_unknown_name_lists_the_shipped_ones(elsewhere):
    with pytest.raises(KvrunError) as e:
        parse_kv("profile:smollm2-135m-0.99")
    msg = str(e.value)
    assert "\n" not in msg and "no such file" in msg
    assert all(p.stem in msg for p in shipped_profiles())


def test_cli_uses_names_from_elsewhere(elsewhere):
    d = make_tiny_model_dir(elsewhere / "tiny")
    run = lambda *a: CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "hi", "-n", "1", *a])  # noqa: E731
    # resolved: refused only because it was searched for SmolLM2's 30 layers
    for args in (["--kv", f"profile:{SHIPPED}"], ["--kv-profile", SHIPPED]):
        r = run(*args)
        assert r.exit_code == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: KV profile ")
        assert "30 layers); this model has 2 layers" in r.stderr
    r = run("--kv", "profile:nope")
    assert r.exit_code == 1 and r.stderr.strip() == (
        "error: KV profile 'nope': no such file, and no shipped profile of that name "
        f"(shipped: {', '.join(p.stem for p in shipped_profiles())})")


@pytest.mark.parametrize("make", ["fifo", "device", "huge"])
def test_a_profile_must_be_a_small_regular_file(tmp_path, make):
    """--kv profile:/dev/zero filled memory until the OS killed the process; a FIFO blocked
    the open for ever. Each is one error line, shared by the CLI, library and server."""
    import os
    from kvrun.errors import KvrunError
    from kvrun.kv.profile import read_profile
    if make == "fifo":
        path = tmp_path / "p.json"
        os.mkfifo(path)
    elif make == "device":
        path = "/dev/zero"
    else:
        path = tmp_path / "p.json"
        path.write_text(" " * (2 << 20) + "{}")
    with pytest.raises(KvrunError, match="regular file|larger than"):
        read_profile(path)
