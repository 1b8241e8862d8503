"""The objective of `kvrun search` (runtime/eval/search_objective.py): mean KL divergence from
the fp16 cache's next-token distributions on calibration windows."""
import pytest

from kvrun.errors import KvrunError
from kvrun.eval.search_objective import Objective
from kvrun.kv.config import parse_kv

TEXT = "Seven wizards quietly judge boxing matches every Friday night. " * 3     # 189 byte tokens


@pytest.fixture(scope="module")
def objective(tiny_dir):
    import kvrun
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv="fp32")
    return Objective(m, TEXT, n_windows=2, prefix=64, n_score=16, chunk=8)


def test_the_fp16_cache_scores_zero_and_a_lossy_one_more(objective):
    assert objective.kld(parse_kv("fp16")) == 0.0                      # the reference itself
    k2 = objective.kld(parse_kv("kivi-2", residual=32, group=32, v_group=16))
    k4 = objective.kld(parse_kv("kivi-4", residual=32, group=32, v_group=16))
    assert 0.0 < k4 < k2
    assert objective.evaluations == 3 and objective.n_tokens == 2 * (64 + 16)


def test_windows_that_do_not_fit_the_text_are_refused(objective):
    with pytest.raises(KvrunError, match=r"calibration text has \d+ tokens: 3 windows of 64 \+ 16 "
                                         r"tokens need 240"):
        Objective(objective.model, TEXT, n_windows=3, prefix=64, n_score=16)
    with pytest.raises(KvrunError, match="must be >= 1"):
        Objective(objective.model, TEXT, n_windows=0)
