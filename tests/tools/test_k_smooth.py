"""tools/k_smooth.py: a key transform q' . k' = q . k - q . mu changes no full-precision
result (softmax drops a constant per query), and does reach what a codec quantizes."""
from __future__ import annotations

import pytest

from kvrun.kv.arena import KVArena
from tiny import make_tiny_model_dir
from tool_module import load_tool


def _tables(out: str) -> dict:
    """mode -> {method: (ppl, kld)} from the tool's output"""
    tables, mode = {}, None
    for line in out.splitlines():
        if line.startswith("mode "):
            mode = line[5:].rstrip(":")
            tables[mode] = {}
        elif mode and line and not line.startswith(("method", "-")):
            f = line.split()
            tables[mode][f[0]] = (float(f[1]), float(f[3]))
    return tables


def test_key_transform_keeps_fp16_and_moves_the_codec(tmp_path, capsys):
    tool = load_tool("k_smooth")
    d = make_tiny_model_dir(tmp_path / "tiny", num_heads=4, num_kv_heads=2, head_dim=32)  # cb: D % 32 == 0
    text, calib = tmp_path / "text.txt", tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 20)
    calib.write_text("Pack my box with five dozen liquor jugs, said the sphinx. " * 20)
    before = KVArena.attend
    tool.main([str(text), "--calib", str(calib), "--calib-tokens", "256", "-m", str(d), "-c", "512",
               "--kv", "cb-4", "--mode", "none,mean,scale", "-t", "1"])
    assert KVArena.attend is before                       # the patch is undone
    t = _tables(capsys.readouterr().out)
    assert list(t) == ["none", "mean", "scale"]
    fp16 = [t[m]["fp16"][0] for m in t]
    assert max(fp16) / min(fp16) - 1 < 2e-3               # fp16 rounding of the shifted keys only
    kld = [t[m]["cb-4"][1] for m in t]
    assert all(k > 0 for k in kld) and len({round(k, 6) for k in kld}) == 3


def test_bad_mode_is_one_error_line(tmp_path, capsys):
    tool = load_tool("k_smooth")
    with pytest.raises(SystemExit) as e:
        tool.main([str(tmp_path / "x.txt"), "--calib", str(tmp_path / "x.txt"), "--mode", "median"])
    assert str(e.value).startswith("error: --mode takes none, mean, scale")
    with pytest.raises(SystemExit) as e:
        tool.main([str(tmp_path / "missing.txt"), "--calib", str(tmp_path / "missing.txt")])
    assert str(e.value).startswith("error: ") and "missing.txt" in str(e.value)


def test_attention_report_per_layer(tmp_path, capsys):
    """--attention: the three variants per layer; the exact sink has no sink error; an
    arena layer the model lacks is one error line."""
    tool = load_tool("k_smooth")
    d = make_tiny_model_dir(tmp_path / "tiny", num_heads=4, num_kv_heads=2, head_dim=32)
    f = tmp_path / "text.txt"
    f.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 20)
    args = [str(f), "--calib", str(f), "--calib-tokens", "256", "-m", str(d), "-c", "512", "-t", "1"]
    tool.main(args + ["--attention", "0,1", "--bits", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in lines] == ["layer 0", "layer 1"]
    for line in lines:
        parts = line.split(" | ")
        assert [p.split(":")[0] for p in parts[1:]] == ["none", "mean", "mean, exact sink"]
        assert "sink 0.000 " in parts[3] and float(parts[1].split("KL ")[1].split(",")[0]) > 0
    with pytest.raises(SystemExit) as e:
        tool.main(args + ["--attention", "5"])
    assert str(e.value) == "error: --attention: no arena layer 5 (0..1)"
    with pytest.raises(SystemExit) as e:
        tool.main(args + ["--attention", "0,x"])
    assert str(e.value) == "error: --attention takes arena layer numbers (got '0,x')"
