"""kvrun search (TaDA's per-layer precision search) and profiles, on a tiny random model
(head dim 32: KIVI's 32-channel V groups fit). The memory-budget mode: tests/kv/test_budget.py;
the codec menus: test_search_menu.py."""
from __future__ import annotations

import pytest

import kvrun
from kvrun.errors import KvrunError
from kvrun.kv import build_cache, kv_bytes_at, load_profile, parse_kv, save_profile
from kvrun.kv.profile import model_record, read_profile, shipped_profiles
from kvrun.eval.search import save_result, search

from tiny import make_tiny_model_dir, tiny_config

CALIB = ("The quick brown fox jumps over the lazy dog near the river bank. "
         "Seven wizards quietly judge boxing matches every Friday night. ") * 12
KW = dict(ctx=512, trials=3, seed=3, bits=(2, 4, 8), family="kivi", windows=2, prefix=160, n_score=32)


@pytest.fixture(scope="module", autouse=True)
def fixed_threads():
    """The thread count the cap says, whatever else runs: a KLD summed over 1 or 2 threads
    differs in its last bits, and the reproducibility test compares two searches exactly."""
    from kvrun import threads
    adapt, threads.governor.adapt = threads.governor.adapt, False
    yield
    threads.governor.adapt = adapt


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", hidden_size=128, num_heads=4,
                            num_kv_heads=2)
    return kvrun.load(d, ctx=8)


@pytest.fixture(scope="module")
def searched(tiny_model):
    return search(tiny_model, CALIB, 0.62, **KW)


def fp16_bytes(cfg, n):
    return 2 * cfg.num_layers * cfg.num_kv_heads * n * cfg.head_dim * 2


def test_profile_respects_budget_by_arena_accounting(tiny_model, searched):
    cfg = tiny_model.cfg
    kv = parse_kv("fp16").replace(layers=searched.layers)
    cache = build_cache(cfg, KW["ctx"], kv)
    allocated = sum(cache.nbytes().values())
    assert allocated == searched.bytes == sum(kv_bytes_at(cfg, kv, KW["ctx"]).values())
    assert allocated <= 0.62 * fp16_bytes(cfg, KW["ctx"])
    # the search used the budget: not every slot sits at the cheapest method
    assert {m for pair in searched.layers for m in pair} != {"kivi-2"}
    # and the best profile is no worse than the uniform one it could afford
    assert searched.kld <= searched.uniform["kivi-2"]


def test_fixed_seed_is_reproducible(tiny_model, searched):
    again = search(tiny_model, CALIB, 0.62, **KW)
    assert again.layers == searched.layers
    assert again.kld == searched.kld


def test_budget_below_smallest_config_is_refused(tiny_model):
    with pytest.raises(KvrunError, match="smallest candidate"):
        search(tiny_model, CALIB, 0.2, **KW)


def test_profile_round_trip_and_load(tiny_model, searched, tmp_path):
    p = tmp_path / "p.json"
    base = parse_kv("fp16")
    save_result(p, searched, tiny_model, CALIB, budget=0.62, base=base,
                **{k: v for k, v in KW.items() if k != "bits"}, bits=KW["bits"])
    prof = read_profile(p)
    assert prof.layers == searched.layers == load_profile(p)
    assert prof.model == model_record(tiny_model.cfg)
    assert prof.meta["ctx"] == 512 and prof.meta["budget"] == 0.62
    assert prof.meta["kld"] == searched.kld
    assert prof.meta["bytes_ratio"] == pytest.approx(searched.ratio, abs=1e-6)
    assert len(prof.meta["calibration"]["sha256"]) == 64
    kv = parse_kv(f"profile:{p}")
    assert kv.layers == searched.layers and kv.residual == base.residual
    m = kvrun.load(tiny_model.path, ctx=64, kv=kv)              # the library path accepts it
    assert m.generate("The quick", max_tokens=4, temp=0)
    # a second budget reuses the sensitivity pass: same slots, no new sensitivity forwards
    r2 = search(tiny_model, CALIB, 0.7, reuse=prof, **KW)
    assert r2.sensitivity == searched.sensitivity
    assert r2.evaluations <= KW["trials"] + 1


@pytest.mark.parametrize("body, msg", [
    ("{not json", "not valid JSON"),
    ('{"format": "other", "layers": []}', "not a kvrun KV profile"),
    ('{"format": "kvrun-kv-profile", "layers": []}', "'layers' must be a non-empty list"),
    ('{"format": "kvrun-kv-profile", "layers": [{"k": "kivi-5", "v": "fp16"}]}',
     "layer 0 k: unknown KV method 'kivi-5'"),
    ('{"format": "kvrun-kv-profile", "layers": [{"k": "kivi-3", "v": "kivi-3"}]}',
     "layer 0 v: kivi-3 stores keys only"),
    ('{"format": "kvrun-kv-profile", "layers": [{"k": "kivi-2"}]}', "layer 0 must be an object with 'k' and 'v'"),
    ('{"format": "kvrun-kv-profile", "version": 7, "layers": [{"k": "kivi-2", "v": "fp16"}]}',
     "version 7 is not supported"),
    ('{"format": "kvrun-kv-profile", "kv": {"wibble": 1}, "layers": [{"k": "kivi-2", "v": "fp16"}]}',
     "KV setting 'wibble' is not supported"),
])
def test_malformed_profile_refused(tmp_path, body, msg):
    p = tmp_path / "bad.json"
    p.write_text(body)
    with pytest.raises(KvrunError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse_kv(f"profile:{p}")


def test_mismatched_profile_refused(tiny_model, tmp_path):
    cfg = tiny_model.cfg
    p = tmp_path / "three.json"
    save_profile(p, [("kivi-2", "kivi-2")] * 3)
    with pytest.raises(KvrunError, match="has 3 layers, the model has 2"):
        build_cache(cfg, 64, parse_kv("fp16", profile=p))
    rec = {**model_record(cfg), "head_dim": 64, "name": "Other"}
    save_profile(p, [("kivi-2", "kivi-2")] * 2, model=rec)
    with pytest.raises(KvrunError, match="searched for Other \\(64 head dim\\); this model has 32 head dim"):
        kvrun.load(tiny_model.path, ctx=64, kv=parse_kv(f"profile:{p}"))


@pytest.mark.parametrize("head_dim,label", [(96, "auto (generic kivi-4+rot)"),
                                            (80, "auto (generic kivi-4@32/16+rot)")])
def test_kv_auto_without_a_shipped_profile_is_the_generic_default(tmp_path, head_dim, label):
    """`--kv auto` on a model no profile was searched on is rotated kivi-4 (V groups of 16
    where 32 does not divide the head dim), labelled as the generic default: the same cache,
    bytes and greedy tokens as giving that config by hand."""
    d = make_tiny_model_dir(tmp_path / "m", head_dim=head_dim)
    assert parse_kv("auto").layers and len(parse_kv("auto").layers) == 30   # SmolLM2's, until a model
    m = kvrun.load(d, ctx=256, kv="auto", dtype="fp32")
    kv = m.engine.cache.kv
    assert kv.label() == label and kv.layers is None
    assert (kv.k_method, kv.v_method, kv.group, kv.v_group, kv.rotation.which) == \
        ("kivi-4", "kivi-4", 32, 32 if head_dim % 32 == 0 else 16, "kv")
    hand = kvrun.load(d, ctx=256, kv=parse_kv("kivi-4+rot", v_group=kv.v_group), dtype="fp32")
    total = sum(m.engine.cache.nbytes().values())
    assert total == sum(hand.engine.cache.nbytes().values()) == sum(kv_bytes_at(m.cfg, "auto", 256).values())
    at_32k = sum(kv_bytes_at(m.cfg, "auto", 32768).values())       # 0.357x (D 96), 0.422x (80)
    assert at_32k < 0.43 * sum(kv_bytes_at(m.cfg, "fp16", 32768).values())
    prompt = "The quick brown fox jumps over the lazy dog. " * 5      # past R + G: a tail flushes
    out = m.generate(prompt, max_tokens=24, temp=0)
    assert out == hand.generate(prompt, max_tokens=24, temp=0) and len(out) > 0
    assert min(m.engine.cache.n_tail) > 0
    from click.testing import CliRunner
    from kvrun.cli.main import main
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "Hi", "-n", "4", "-c", "256",
                                  "--kv", "auto", "--temp", "0"])
    assert r.exit_code == 0, r.stderr
    assert f"KV {label} " in r.stderr                            # the stats line says which auto
    # settings given with auto apply over the generic default; a profile is still refused twice
    assert parse_kv("auto", residual=64).for_model(m.cfg).residual == 64
    with pytest.raises(KvrunError, match="both name a profile"):
        parse_kv("auto", profile="x.json")


def test_shipped_profile_matches_the_default_model_geometry():
    from kvrun.kv.profile import shipped_default
    prof = read_profile(shipped_default())
    assert prof.model["num_layers"] == len(prof.layers) == 30
    assert (prof.model["num_kv_heads"], prof.model["head_dim"]) == (3, 64)
    assert prof.meta["bytes_ratio"] <= prof.meta["budget"] == 0.30


def test_search_command_writes_a_profile(tiny_model, tmp_path):
    from click.testing import CliRunner
    from kvrun.cli.search import search_cmd
    calib, out = tmp_path / "calib.txt", tmp_path / "p.json"
    calib.write_text(CALIB)
    args = ["-m", str(tiny_model.path), "--calib", str(calib), "--budget", "0.62", "-c", "512",
            "--trials", "1", "--calib-ctx", "160", "--calib-tokens", "32", "-o", str(out)]
    r = CliRunner().invoke(search_cmd, args)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out)
    prof = read_profile(out)
    assert prof.meta["budget"] == 0.62 and prof.meta["bytes_ratio"] <= 0.62
    r = CliRunner().invoke(search_cmd, args[:-2] + ["--bits", "5", "-o", str(out)])
    assert isinstance(r.exception, KvrunError) and "--bits must be" in str(r.exception)
    r = CliRunner().invoke(search_cmd, args[:-2] + ["--bits", "3", "-o", str(out)])   # kivi-3 only
    assert isinstance(r.exception, KvrunError) and "stores keys only" in str(r.exception)


def test_shipped_profiles_fit_their_budgets_by_the_arenas_accounting():
    from kvrun.kv.profile import shipped_profiles
    # the geometry of the models they were searched on (SmolLM2-135M, Gemma 3 270M)
    geometry = {"llama": dict(num_layers=30, num_heads=9, num_kv_heads=3, hidden_size=576),
                "gemma3": dict(num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                               hidden_size=640, sliding_window=512)}
    names = set()
    for path in shipped_profiles():
        prof = read_profile(path)
        cfg = tiny_config(prof.model["architecture"], **geometry[prof.model["architecture"]])
        ctx, budget = prof.meta["ctx"], prof.meta["budget"]
        fp16 = sum(kv_bytes_at(cfg, "fp16", ctx).values())    # Gemma: its rings included
        got = sum(kv_bytes_at(cfg, parse_kv(f"profile:{path}"), ctx).values())
        assert got == prof.meta["bytes"] and got <= budget * fp16, path.name
        names.add(path.name)
    assert {"smollm2-135m-0.30.json", "smollm2-135m-0.25.json", "smollm2-135m-0.20.json",
            "gemma-3-270m-0.30.json", "gemma-3-270m-0.25.json", "gemma-3-270m-0.20.json"} <= names


def test_sensitivity_progress_has_an_eta(tiny_model):
    lines = []
    search(tiny_model, CALIB, 0.62, **{**KW, "trials": 1}, progress=lines.append)
    sens = [x for x in lines if x.startswith("[search] sensitivity ") and "/" in x.split()[2]]
    assert len(sens) == 2 * tiny_model.cfg.num_layers
    assert all(", ETA " in x for x in sens) and sens[-1].endswith("ETA 0 s)")


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A tiny Gemma 3: five sliding layers of window 16 (rings), one full layer. The logit
    soft-cap keeps its next-token distributions spread (without it a random Gemma's are
    one-hot and every KLD is 0)."""
    d = make_tiny_model_dir(tmp_path_factory.mktemp("gemma") / "g", architecture="gemma3",
                            hidden_size=128, num_heads=4, final_logit_softcapping=3.0)
    return kvrun.load(d, ctx=8)


GKW = {**KW, "trials": 2}       # 160 context tokens: past the window R, the rings wrapped


def test_search_on_sliding_window_layers(tiny_gemma, tmp_path):
    """The profile lists the full layer only and the rings' width; its bytes (rings
    included) are the arena's, and it loads back with that width."""
    m, cfg = tiny_gemma, tiny_gemma.cfg
    r = search(m, CALIB, 0.7, **GKW)
    assert len(r.layers) == 1 and len(r.sensitivity) == 1
    assert r.ring in (4, 8) and set(r.ring_kld) == {4, 8}
    kv = parse_kv("fp16").replace(layers=r.layers, ring=r.ring)
    assert r.bytes == sum(build_cache(cfg, KW["ctx"], kv).nbytes().values())
    assert r.bytes <= 0.7 * sum(kv_bytes_at(cfg, "fp16", KW["ctx"]).values())
    out = tmp_path / "p.json"
    save_result(out, r, m, CALIB, budget=0.7, ctx=KW["ctx"], family="kivi", bits=(2, 4, 8),
                trials=2, seed=3, windows=2, prefix=160, n_score=32, base=parse_kv("fp16"))
    prof = read_profile(out)
    assert prof.kv["ring"] == r.ring and prof.meta["ring_kld"] == {str(w): x for w, x in r.ring_kld.items()}
    again = kvrun.load(tiny_gemma.path, ctx=64, kv=f"profile:{out}")
    assert again.cache.ring.bits == r.ring
    assert again.generate("The quick", 4, temp=0)


def test_ring_width_is_a_slot_under_the_budget(tiny_gemma):
    """8-bit rings lose less than 4-bit ones and cost more: a generous budget buys them, a
    budget just above the smallest cache cannot; one width given is the only choice."""
    from kvrun.kv.build import fp16_bytes as ideal_fp16
    cfg = tiny_gemma.cfg
    fp16 = ideal_fp16(cfg, KW["ctx"])                   # the budget's denominator
    rich = search(tiny_gemma, CALIB, 0.95, **GKW)
    assert rich.ring_kld[4] > rich.ring_kld[8] > 0 and rich.ring == 8
    smallest = parse_kv("fp16").replace(layers=[("kivi-2", "kivi-2")])
    least, ring8 = (sum(kv_bytes_at(cfg, smallest.replace(ring=w), KW["ctx"]).values()) / fp16
                    for w in (4, 8))
    poor = search(tiny_gemma, CALIB, (least + ring8) / 2, **GKW)
    assert poor.ring == 4 and poor.bytes <= (least + ring8) / 2 * fp16
    fixed = search(tiny_gemma, CALIB, 0.95, rings=(16,), **GKW)
    assert fixed.ring == 16 and fixed.ring_kld == {16: 0.0}
    assert search(tiny_gemma, CALIB, 0.95, base=parse_kv("fp16+ring8"), **GKW).ring == 8


def test_sensitivity_is_measured_with_fp16_rings(tiny_gemma):
    """s[slot] is the slot's own loss: the rings stay fp16 while it is measured (with 4-bit
    rings every slot would carry their loss too)."""
    from kvrun.eval.search import Search
    from kvrun.eval.search_objective import Objective
    obj = Objective(tiny_gemma, CALIB, 2, GKW["prefix"], 32, chunk=32)
    base = parse_kv("fp16")
    s = Search(obj, tiny_gemma.cfg, ["kivi-2", "kivi-4", "int8"], 0.9, KW["ctx"], 0, 3, base,
               None, (4, 8))
    s.t0 = 0.0
    s.sensitivity()
    alone = obj.kld(base.replace(layers=[("kivi-2", "fp16")], ring=16))
    with_rings = obj.kld(base.replace(layers=[("kivi-2", "fp16")], ring=4))
    assert s.s[0] == alone and abs(with_rings - alone) > 1e-4
    assert s.ring_kld[4] == obj.kld(base.replace(layers=[("fp16", "fp16")], ring=4))
    # the knapsack held at each width keeps it, and fits; a width that cannot fit is None
    for j in (0, 1):
        a = s.knapsack(ring=j)
        assert a[-1] == j and s.predicted_bytes(a) <= s.limit
    s.limit = s.b0 + s.costs[-1][1] - 1
    assert s.knapsack(ring=1) is None and s.knapsack(ring=0)[-1] == 0


def test_ring_reuse_and_refusals(tiny_gemma, tiny_model, tmp_path):
    import json
    r = search(tiny_gemma, CALIB, 0.7, **GKW)
    out = tmp_path / "p.json"
    save_result(out, r, tiny_gemma, CALIB, budget=0.7, ctx=KW["ctx"], family="kivi", bits=(2, 4, 8),
                trials=2, seed=3, windows=2, prefix=160, n_score=32, base=parse_kv("fp16"))
    r2 = search(tiny_gemma, CALIB, 0.8, reuse=read_profile(out), **GKW)
    assert r2.ring_kld == r.ring_kld and r2.evaluations <= GKW["trials"] + 2   # + a start per width
    d = json.loads(out.read_text())
    del d["ring_kld"]                   # searched before rings were a slot
    out.write_text(json.dumps(d))
    with pytest.raises(KvrunError, match="did not measure the rings at 4, 8 bits"):
        search(tiny_gemma, CALIB, 0.8, reuse=read_profile(out), **GKW)
    with pytest.raises(KvrunError, match="no sliding-window layers"):
        search(tiny_model, CALIB, 0.62, rings=(4, 8), **KW)
    with pytest.raises(KvrunError, match="ring width must be one of 4, 8, 16 bits, got 5"):
        search(tiny_gemma, CALIB, 0.7, rings=(5,), **GKW)


# -- the whole codec menu: KIVI, codebooks (cb-*, rotated by their role), int8, K and V apart --

@pytest.mark.parametrize("family, bits, msg", [
    ("nope", None, "unknown --family 'nope'"),
    ("kivi", [5], r"--bits must be a non-empty list from \[2, 3, 4, 8, 16\] for --family kivi"),
    ("all", [2, 5], r"from \[2, 3, 4, 8, 16\] for --family all, got \[2, 5\]"),
    ("cb", [], "--bits must be a non-empty list"),
])
def test_bad_family_or_bits_refused(tiny_model, family, bits, msg):
    with pytest.raises(KvrunError, match=msg):
        search(tiny_model, CALIB, 0.5, **{**KW, "family": family, "bits": bits})


@pytest.fixture(scope="module")
def searched_all(tiny_model):
    # 0.55× of fp16 at 512 tokens (window included) sits between uniform cb-4 (0.52×) and
    # kivi-4 (0.64×): the search must spend the bytes unevenly over slots and kinds
    return search(tiny_model, CALIB, 0.55, **{**KW, "family": "all", "bits": None, "trials": 4})


def test_all_family_search_mixes_kinds_under_budget(tiny_model, searched_all):
    from kvrun.eval.search_objective import Objective
    r, cfg = searched_all, tiny_model.cfg
    kind = lambda m: m.split("-")[0]
    assert {m for pair in r.layers for m in pair} <= {"kivi-2", "cb-2", "kivi-3", "cb-3", "kivi-4", "cb-4", "int8"}
    assert all(v != "kivi-3" for _, v in r.layers)                      # keys only
    assert any(kind(k) != kind(v) for k, v in r.layers), r.layers       # a mixed-kind layer
    kv = parse_kv("fp16").replace(layers=r.layers)
    cache = build_cache(cfg, KW["ctx"], kv)
    assert sum(cache.nbytes().values()) == r.bytes <= 0.55 * fp16_bytes(cfg, KW["ctx"])
    # a cb role is rotated whatever the base says (here: no rotation), and only that role
    for l, (k, v) in enumerate(r.layers):
        assert (cache.rot_k[l] is not None, cache.rot_v[l] is not None) == (kind(k) == "cb", kind(v) == "cb")
    # the KLD reported is the one of the cache that will run: re-scored from scratch
    obj = Objective(tiny_model, CALIB, KW["windows"], KW["prefix"], KW["n_score"], chunk=kv.group)
    assert obj.kld(kv) == pytest.approx(r.kld, rel=1e-5, abs=1e-9)
    # no worse than any uniform method the budget affords (cb-2, kivi-2, cb-3, cb-4)
    fits = [m for m in r.uniform if sum(kv_bytes_at(cfg, m, KW["ctx"]).values()) <= r.limit]
    assert sorted(fits) == ["cb-2", "cb-3", "cb-4", "kivi-2"]
    assert all(r.kld <= r.uniform[m] for m in fits)
    # ρ per role: each role measured with the other role fp16, for every method
    assert set(r.role_uniform) == {"k", "v"}
    assert all(u["int8"] <= u["cb-2"] for u in r.role_uniform.values())
    assert set(r.role_uniform["v"]) == set(r.uniform) == set(r.role_uniform["k"]) - {"kivi-3"}


def test_all_family_reuse_needs_per_role_klds(tiny_model, searched_all, searched, tmp_path):
    p = tmp_path / "all.json"
    save_result(p, searched_all, tiny_model, CALIB, budget=0.55, base=parse_kv("fp16"),
                **{**{k: v for k, v in KW.items() if k not in ("family", "bits")}},
                family="all", bits=None)
    prof = read_profile(p)
    assert prof.meta["search"]["bits"] == [2, 3, 4, 8]
    assert prof.meta["role_kld"] == searched_all.role_uniform
    r2 = search(tiny_model, CALIB, 0.6, reuse=prof, **{**KW, "family": "all", "bits": None, "trials": 2})
    assert r2.sensitivity == searched_all.sensitivity and r2.evaluations <= 3
    assert r2.bytes <= 0.6 * fp16_bytes(tiny_model.cfg, KW["ctx"])
    # a kivi-only profile did not measure the codebooks: its pass cannot serve the whole menu
    old = tmp_path / "kivi.json"
    save_result(old, searched, tiny_model, CALIB, budget=0.62, base=parse_kv("fp16"),
                **{k: v for k, v in KW.items()})
    with pytest.raises(KvrunError, match="did not measure all of kivi-2, cb-2"):
        search(tiny_model, CALIB, 0.6, reuse=read_profile(old), **{**KW, "family": "all", "bits": None})


def test_search_command_family_and_bits(tiny_model, tmp_path):
    from click.testing import CliRunner
    from kvrun.cli.search import search_cmd
    calib, out = tmp_path / "calib.txt", tmp_path / "p.json"
    calib.write_text(CALIB)
    args = ["-m", str(tiny_model.path), "--calib", str(calib), "--budget", "0.55", "-c", "512",
            "--trials", "1", "--calib-ctx", "160", "--calib-tokens", "32", "-o", str(out)]
    r = CliRunner().invoke(search_cmd, args + ["--family", "cb", "--bits", "3,4"])
    assert r.exit_code == 0, r.output
    prof = read_profile(out)
    assert {m for pair in prof.layers for m in pair} <= {"cb-3", "cb-4"}
    assert prof.meta["search"] == {**prof.meta["search"], "family": "cb", "bits": [3, 4]}
    r = CliRunner().invoke(search_cmd, args + ["--rings", "4,x"])
    assert isinstance(r.exception, KvrunError) and "--rings must be a comma list" in str(r.exception)
    r = CliRunner().invoke(search_cmd, args + ["--family", "bogus"])
    assert r.exit_code == 2 and "bogus" in r.output and not out.with_suffix(".tmp").exists()


def test_auto_names_the_030_profiles_whatever_else_ships():
    """`--kv auto` stays on the 0.30 profiles (their layers pair kinds the native kernels
    decode) when lower-budget profiles for the same models ship beside them."""
    from kvrun.kv.profile import shipped_for
    geometry = {"llama": dict(num_layers=30, num_heads=9, num_kv_heads=3, hidden_size=576),
                "gemma3": dict(num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                               hidden_size=640, sliding_window=512)}
    for name in ("smollm2-135m-0.30.json", "gemma-3-270m-0.30.json"):
        prof = read_profile(name[:-len(".json")])
        cfg = tiny_config(prof.model["architecture"], **geometry[prof.model["architecture"]])
        cfg.source = {"name": prof.model["name"], "sha256": prof.model["sha256"]}
        assert shipped_for(cfg).name == name
    assert {"smollm2-135m-0.20.json", "smollm2-135m-0.25-all.json",
            "gemma-3-270m-0.25.json"} <= {p.name for p in shipped_profiles()}
