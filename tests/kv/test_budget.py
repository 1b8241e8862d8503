"""Memory-budget mode (runtime/kv/budget.py): the configuration with the most bytes that
fits, by the arena's accounting, among fp16, the profiles and uniform codecs; refusals in
one line."""
import pytest

from kvrun.errors import KvrunError
from kvrun.kv import build_cache, kv_bytes_at, parse_kv, save_profile
from kvrun.kv.budget import fit_budget
from kvrun.kv.profile import model_record
from test_search import tiny_model  # noqa: F401  (a fixture: head dim 32)


def test_fit_budget(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))        # no user profiles
    cfg, ctx = tiny_model.cfg, 1024
    mib = lambda spec: sum(kv_bytes_at(cfg, parse_kv(spec), ctx).values()) / 2**20
    kv, desc = fit_budget(cfg, ctx, mib("fp16"))
    assert kv.methods() == {"fp16"} and desc.startswith("fp16")
    kv, desc = fit_budget(cfg, ctx, mib("kivi-4") + 1e-6)
    assert (kv.k_method, kv.v_method, kv.layers, kv.rotation.which) == ("kivi-4", "kivi-4", None, "kv")
    # a searched profile between kivi-2 and kivi-4 in size is preferred to kivi-2
    p = tmp_path / "mid.json"
    save_profile(p, [("kivi-4", "kivi-2"), ("kivi-2", "kivi-2")], model=model_record(cfg))
    budget = sum(kv_bytes_at(cfg, parse_kv(f"profile:{p}"), ctx).values()) / 2**20
    kv, desc = fit_budget(cfg, ctx, budget, profiles=[p])
    assert kv.layers == [("kivi-4", "kivi-2"), ("kivi-2", "kivi-2")]
    assert sum(build_cache(cfg, ctx, kv).nbytes().values()) <= budget * 2**20
    with pytest.raises(KvrunError, match="nothing fits 1024 tokens; the smallest configuration \\(kivi-2\\+rot\\)"):
        fit_budget(cfg, ctx, mib("kivi-2") * 0.9)


@pytest.mark.parametrize("ctx,mb,msg", [(1024, 0, "--kv-budget-mb must be > 0, got 0"),
                                        (0, 1.0, "-c must be >= 1, got 0")])
def test_a_budget_or_context_out_of_range_is_refused(tiny_model, ctx, mb, msg):
    with pytest.raises(KvrunError, match=msg):
        fit_budget(tiny_model.cfg, ctx, mb)


def test_another_models_profile_is_skipped_unless_named(tiny_model, tmp_path, monkeypatch):
    """A profile in $KVRUN_HOME/profiles searched for another model is not a candidate; the
    same file named with --kv-profile is an error."""
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path))
    cfg = tiny_model.cfg
    other = tmp_path / "profiles" / "other.json"
    other.parent.mkdir()
    rec = {**model_record(cfg), "head_dim": 64, "name": "Other"}
    save_profile(other, [("fp16", "fp16")] * cfg.num_layers, model=rec)
    kv, desc = fit_budget(cfg, 64, 1024.0)
    assert kv.methods() == {"fp16"} and desc.startswith("fp16: ")
    with pytest.raises(KvrunError, match="Other"):
        fit_budget(cfg, 64, 1024.0, profiles=[other])
