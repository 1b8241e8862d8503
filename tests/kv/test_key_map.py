"""A key transform fitted once per model (kv/key_map.py, hadamard.KeyMap): exact in full
precision on every backend and route (prompt chunks, the one-call decode step, the context
shift, rows read back), closer attention for codebook keys whose tokens share a direction,
a profile entry that round-trips and refuses bad values, and a search that fits it."""
import json
import math

import pytest
import torch
from torch.testing import assert_close

import kvrun
from kvrun.errors import KvrunError
from kvrun.eval.search import fit_key_maps
from kvrun.kernels import native
from kvrun.kernels.codecs import make_codec
from kvrun.kernels.hadamard import KeyMap, q_matrix, random_signs, rotate_k, rotation_matrix, unrotate_k
from kvrun.kv import build_cache, parse_kv
from kvrun.kv.build import make_cache
from kvrun.kv.key_map import check_key_map, fit_key_map
from kvrun.kv.profile import read_profile, save_profile
from tiny import make_tiny_model_dir, tiny_config

BACKENDS = ["torch"] + (["native"] if native.load() is not None else [])


def _map(Hkv, D, seed=0, shift=3.0):
    """A key map with a large mean and uneven spreads (as fitted keys have)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(Hkv, D, generator=g) * shift
    sigma = torch.rand(D, generator=g) * 2 + 0.25
    return {"mu": mu.tolist(), "sigma": sigma.tolist()}


def test_key_map_algebra():
    """k' = ((k - mu) / sigma) R, q' = (q sigma) R: q'.k' = q.k - q.mu, and unrotate_k undoes k'."""
    Hkv, D = 2, 64
    m = _map(Hkv, D)
    mu, sigma = torch.tensor(m["mu"]), torch.tensor(m["sigma"])
    km = KeyMap(rotation_matrix(D, random_signs(D, 5)), mu, sigma)
    k, q = torch.randn(Hkv, 9, D), torch.randn(Hkv, 4, D)
    y = rotate_k(k, km)
    assert_close(unrotate_k(y, km), k, atol=1e-5, rtol=1e-5)
    s = (q @ q_matrix(km)) @ y.transpose(1, 2)
    assert_close(s, q @ k.transpose(1, 2) - (q * mu[:, None]).sum(-1, keepdim=True), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("km") / "tiny", hidden_size=128)   # D = 32
    return kvrun.load(str(d), ctx=512)


def _logits(m, kv, ids, n_prompt, chunk=None):
    """Logits of a prompt of n_prompt tokens (in chunks of `chunk`) and one decode step per
    later token."""
    cache = make_cache(m.cfg, 512, kv)
    out = []
    with torch.inference_mode():
        chunk = chunk or n_prompt
        for s in range(0, n_prompt, chunk):
            out.append(m.transformer(torch.tensor([ids[s:min(n_prompt, s + chunk)]]), cache,
                                     last_only=True).float().flatten())
        for t in ids[n_prompt:]:
            out.append(m.transformer(torch.tensor([[t]]), cache, last_only=True).float().flatten())
    return torch.stack(out), cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec,chunk", [("fp32+rot-k", None), ("fp32+rot-k", 48), ("fp32+rot", 48)])
def test_full_precision_cache_is_unchanged(model, monkeypatch, backend, spec, chunk):
    """With fp32 rows the transform changes no logit beyond rounding (as much as the rotation
    alone changes them against an unrotated cache, ~0.007 in this model): prompt chunks
    that flush through the tail, then one-token steps (natively the one-call step, whose
    query and key preparation applies the map inside its C call); and the rows read back
    are the keys as they were."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    ids = list(torch.randint(3, 250, (230,), generator=torch.Generator().manual_seed(1)).tolist())
    L, Hkv, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
    plain = parse_kv(spec, residual=64, group=32)
    mapped = parse_kv(spec, residual=64, group=32, layer_key_map=[_map(Hkv, D, l) for l in range(L)])
    a, ca = _logits(model, plain, ids, 200, chunk)
    b, cb = _logits(model, mapped, ids, 200, chunk)
    assert isinstance(cb.rot_k[0], KeyMap) and not isinstance(ca.rot_k[0], KeyMap)
    assert_close(b, a, atol=2e-2, rtol=0)
    # layer 0's keys come from the embeddings alone: read back to fp32 rounding; a later
    # layer's carry the rounding of the layers below
    assert_close(cb.rows(0)[0], ca.rows(0)[0], atol=1e-4, rtol=1e-4)
    for l in range(1, L):
        assert_close(cb.rows(l)[0], ca.rows(l)[0], atol=2e-2, rtol=0)
    assert not torch.allclose(cb.win_k[0].float(), ca.win_k[0].float(), atol=0.1)   # stored otherwise


def test_context_shift_keeps_the_keys(model):
    """A shift un-does and re-does the map around the re-RoPE: fp32 rows stay as the plain
    cache's after two shifts."""
    L, Hkv, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
    kw = dict(residual=64, group=32, ctx_policy="shift", n_keep=4)
    ids = list(torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(2)).tolist())
    outs = []
    for maps in (None, [_map(Hkv, D, l) for l in range(L)]):
        cache = build_cache(model.cfg, 160, parse_kv("fp32+rot-k", layer_key_map=maps, **kw))
        with torch.inference_mode():
            lg = [model.transformer(torch.tensor([ids[s:s + 20]]), cache, last_only=True)
                  for s in range(0, 300, 20)]
        assert cache.n_shifts >= 2
        outs.append((torch.stack(lg), [cache.rows(l)[0] for l in range(L)]))
    assert_close(outs[1][0], outs[0][0], atol=2e-2, rtol=0)
    assert_close(outs[1][1][0], outs[0][1][0], atol=1e-4, rtol=1e-4)      # layer 0, as above
    for x, y in zip(outs[1][1], outs[0][1]):
        assert_close(x, y, atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [3, 4])
def test_codebook_keys_with_a_shared_direction(monkeypatch, backend, bits):
    """Keys that share a large mean and spread unevenly over channels: cb keys through the
    fitted map attend far closer to the exact attention than without it (the map reaches
    the stored codes, on every backend)."""
    monkeypatch.setenv("KVRUN_BACKEND", backend)
    cfg = tiny_config(num_layers=1, num_heads=4, num_kv_heads=2, hidden_size=256)     # D = 64
    Hkv, D, n = 2, 64, 400
    g = torch.Generator().manual_seed(3)
    spread = torch.rand(D, generator=g) * 3 + 0.1
    mean = torch.randn(Hkv, 1, D, generator=g) * 4
    keys = lambda T: (torch.randn(1, Hkv, T, D, generator=g) * spread + mean)
    k0, v0 = keys(n), torch.randn(1, Hkv, n, D, generator=g)
    q, k1, v1 = torch.randn(1, 4, 1, D, generator=g) * 0.5, keys(1), torch.randn(1, Hkv, 1, D, generator=g)
    fitted = fit_key_map(k0[0])
    errs = []
    for spec, maps in (("fp32", None), (f"cb-{bits}", None), (f"cb-{bits}", [fitted])):
        c = build_cache(cfg, 512, parse_kv(spec, residual=32, group=32, layer_key_map=maps))
        c.ingest(k0[None, 0], v0[None, 0])
        c.positions(1)
        errs.append(c.attend(0, q, k1, v1))
    with_map, without = (float((o - errs[0]).norm() / errs[0].norm()) for o in (errs[2], errs[1]))
    assert with_map < 0.5 * without, (with_map, without)


def test_profile_round_trip_and_bad_entries(tmp_path):
    m = _map(2, 32)
    p = tmp_path / "p.json"
    save_profile(p, [("cb-4", "cb-4"), ("kivi-4", "kivi-4")], key_maps=[m, None])
    d = json.loads(p.read_text())
    assert "k_map" in d["layers"][0] and "k_map" not in d["layers"][1]
    assert read_profile(p).key_maps[0]["sigma"] == pytest.approx(m["sigma"])
    kv = parse_kv(f"profile:{p}")
    assert kv.rotation.layer_key_maps(2)[1] is None
    bad = [({"mu": m["mu"]}, "object with 'mu' and 'sigma'"),
           ({**m, "sigma": [-1.0] * 32}, "sigma must be positive"),
           ({**m, "sigma": [math.nan] * 32}, "finite numbers"),
           ({**m, "mu": [[0.0] * 31]}, "32 finite numbers"),
           ({**m, "mu": []}, "one list of 32 numbers per KV head")]
    for entry, msg in bad:
        with pytest.raises(KvrunError, match=msg):
            check_key_map("k_map", json.loads(json.dumps(entry)))
        d["layers"][0]["k_map"] = entry
        p.write_text(json.dumps(d))
        with pytest.raises(KvrunError, match=msg):
            read_profile(p)
    cfg = tiny_config(hidden_size=256)                                  # 2 KV heads of 64
    with pytest.raises(KvrunError, match="k_map is for 2 KV heads of 32 channels"):
        build_cache(cfg, 128, parse_kv("cb-4", layer_key_map=[m, m]))
    assert make_codec("cb-4", "k", 32).needs_rotation


def test_search_fits_and_keeps_maps_on_rotated_keys(model, tmp_path):
    """`kvrun search --key-map`: maps fitted per layer from the calibration text; the profile
    keeps them on the layers whose chosen K is rotated, and a --reuse across the flag is
    refused."""
    from kvrun.eval.search import save_result, search
    text = "".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 4 else "") for i in range(3000))
    maps = fit_key_maps(model, text, 400)
    L, Hkv, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
    assert len(maps) == L and len(maps[0]["mu"]) == Hkv and len(maps[0]["sigma"]) == D
    with pytest.raises(KvrunError, match="calibration text has 10 tokens"):
        fit_key_maps(model, "0123456789")
    base = parse_kv("fp16", residual=32, group=32, layer_key_map=maps)
    kw = dict(budget=0.6, ctx=512, trials=2, seed=0, bits=[4, 8], family="all", windows=1,
              prefix=64, n_score=32, base=base)
    res = search(model, text, **kw)
    out = tmp_path / "s.json"
    save_result(out, res, model, text, **kw)
    p = read_profile(out)
    rotated = parse_kv(f"profile:{out}").k_rotated(L)
    assert [m is not None for m in (p.key_maps or [None] * L)] == rotated
    assert p.meta["search"]["key_map"] is True
    with pytest.raises(KvrunError, match="key map"):
        search(model, text, reuse=p, **{**kw, "base": parse_kv("fp16", residual=32, group=32)})
