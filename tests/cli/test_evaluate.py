"""kvrun.cli.evaluate: the evaluation commands' list and count flags (ppl, needle and bench
take comma lists of methods and token counts), refused in one line before a model loads."""
import pytest

from kvrun.cli import evaluate
from kvrun.cli.evaluate import check_bench_size, comma_list, count_list, depth_flag, one_count
from kvrun.errors import KvrunError


def test_comma_lists():
    assert comma_list(" fp16, kivi-4 ,tada-4", "--kv") == ["fp16", "kivi-4", "tada-4"]
    with pytest.raises(KvrunError, match="^--kv: empty list$"):
        comma_list(" , ", "--kv")
    with pytest.raises(KvrunError, match=r"^--kv: empty item in 'fp16,,kivi-4'$"):
        comma_list("fp16,,kivi-4", "--kv")


def test_counts():
    assert count_list("512, 4k,32k", "-p") == [512, 4096, 32768]
    assert one_count("2k", "--ctx") == 2048
    with pytest.raises(KvrunError, match=r"^--ctx takes one value \(got '1k,2k'\)$"):
        one_count("1k,2k", "--ctx")
    with pytest.raises(KvrunError, match="^-d: empty item"):
        count_list("1k,", "-d")


def test_depth_is_d_or_its_old_name():
    assert depth_flag("0,4k", None) == "0,4k" and depth_flag(None, "1k") == "1024"
    assert depth_flag(None, None) is None
    with pytest.raises(KvrunError, match="-d and --ctx are one setting"):
        depth_flag("0", "1k")


def test_bench_size_fits_the_limit_and_the_machine(monkeypatch):
    from kvrun import machine
    monkeypatch.setattr(machine, "memory_bytes", lambda: 1 << 30)
    check_bench_size(evaluate.MAX_BENCH_TOKENS, 1 << 10, "-p")          # 1 GiB: fits
    with pytest.raises(KvrunError, match=r"^-p 1048577 tokens is beyond"):
        check_bench_size(evaluate.MAX_BENCH_TOKENS + 1, 1, "-p")
    with pytest.raises(KvrunError, match=r"^-d 4096: its K/V need 2\.0 GiB, more than this "
                                         r"machine's 1\.0 GiB$"):
        check_bench_size(4096, 1 << 19, "-d")
