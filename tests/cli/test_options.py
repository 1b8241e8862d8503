"""kvrun.cli.options: what the commands share, checked before a model loads: -n, the sampling
flags, --stop's escapes, the token limit -1 means, and the trained-context warning."""
from types import SimpleNamespace

import pytest

from kvrun.cli.options import check_n, max_tokens, sampling_kwargs, stop_strings, warn_ctx
from kvrun.errors import KvrunError


def test_n_and_what_minus_one_means():
    for n in (-1, 0, 5):
        check_n(n)
    with pytest.raises(KvrunError, match=r"^-n must be >= 0, or -1 for until EOS \(got -2\)$"):
        check_n(-2)

    def model(can_shift):
        return SimpleNamespace(ctx=256, engine=SimpleNamespace(can_shift=can_shift))
    assert max_tokens(7, model(False)) == 7 and max_tokens(-1, model(False)) == 256
    assert max_tokens(-1, model(True)) > 1 << 40                # until EOS


def test_sampling_kwargs_take_their_flags_and_check_them():
    kw = {"seed": 1, "temp": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
          "repeat_penalty": 1.0, "repeat_last_n": 64, "model": "m"}
    got = sampling_kwargs(kw)
    assert kw == {"model": "m"} and got["temp"] == 0.0 and len(got) == 7
    with pytest.raises(KvrunError):
        sampling_kwargs({**got, "top_p": 0.0})


def test_stop_strings_process_escapes():
    assert stop_strings([r"\n\n", "END", r"a\tb"]) == ["\n\n", "END", "a\tb"]
    assert stop_strings([]) == []
    with pytest.raises(KvrunError):
        stop_strings([""])


def test_warn_ctx_once_past_the_trained_context(capsys):
    cfg = SimpleNamespace(max_position=512)
    warn_ctx(cfg, 512, "-c")
    assert capsys.readouterr().err == ""
    warn_ctx(cfg, 1024, "-c")
    assert capsys.readouterr().err == ("warning: -c 1024 exceeds the model's trained context "
                                       "(512 tokens): text past 512 tokens may degrade\n")
