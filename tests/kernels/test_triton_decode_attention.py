"""The Triton decode_attention (kvrun.kernels.triton) under Triton's CPU interpreter, against
(a) dense fp32 attention over the codecs' explicit dequantization (`codec.dequant`, the
definition of the packed bytes) and (b) the torch decode_attention; plus an end-to-end
greedy decode of a tiny model on both backends. The backend dispatch is tested in
test_dispatch.py, the kivi_pack flush in test_triton_kivi_pack.py.

Tolerances: against (a), the kernel dequantizes and accumulates in fp32 (the interpreter's
tl.dot is exact fp32), so fp32 outputs agree to 2e-5 / 1e-4 relative and fp16 / bf16
outputs to one rounding of the output dtype. Against (b), the torch path multiplies packed
codes in bf16 (nibble.py: relative 2^-9 per product), so the packed codecs are compared at
bf16-attention tolerance (5e-2 absolute, as in test_decode_attention.py); the fp16 / bf16
tails are exact in both and compared like (a).

TRITON_INTERPRET must be set before kvrun.kernels.triton is imported (triton decides at
decoration time); shapes stay tiny because the interpreter runs every program in numpy.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("triton")

from attention_cases import attention_case, dequantized_reference        # noqa: E402
from kvrun.kernels import make_codec                                     # noqa: E402
from kvrun.kernels import triton as tri                                  # noqa: E402
from kvrun.kernels.codecs.base import FpCodec                             # noqa: E402
from kvrun.kernels.decode_attention import decode_attention as torch_attention  # noqa: E402
from tool_module import load_tool                                        # noqa: E402

G = 32
SPLIT = 64          # tokens per stage-1 program in the tests: tails of 96/160/224 end mid-split
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
EXACT_TOL = {F32: dict(atol=2e-5, rtol=1e-4), F16: dict(atol=1e-3, rtol=2e-3),
             BF16: dict(atol=1e-2, rtol=1.6e-2)}
PACKED_TOL = dict(atol=5e-2, rtol=0)

# (K method, V method, Gq, D, n_tail, W, T, dtype): every codec and bit width; GQA 1/3/8;
# D 64/128; window empty (0) / partial / full (R + G - 1 = 63 for R = G = 32); tails not a
# multiple of SPLIT; 1 and several queries; fp16 / bf16 / fp32 inputs
CASES = [
    ("fp16", "fp16", 3, 64, 96, 17, 1, F16),
    ("bf16", "bf16", 8, 128, 160, 0, 1, BF16),
    ("int8", "int8", 1, 64, 224, 63, 3, F32),
    ("kivi-2", "kivi-2", 3, 128, 96, 0, 1, BF16),
    ("kivi-4", "kivi-4", 8, 64, 160, 40, 1, F16),
    ("tada-2", "tada-2", 1, 128, 128, 63, 1, F16),
    ("tada-4", "tada-4", 3, 64, 224, 5, 4, BF16),
    ("tada-8", "tada-8", 8, 128, 96, 0, 2, F32),
    ("gear-l", "gear-l", 3, 64, 160, 20, 1, F16),
    ("gear-l-2", "gear-l-2", 1, 64, 96, 0, 1, BF16),
    ("gear-l-4", "gear-l-4", 8, 128, 64, 63, 1, F32),
    ("gear", "gear", 3, 128, 96, 33, 2, F16),
    ("gear-2", "gear-2", 8, 64, 160, 0, 1, F16),
    ("gear-4", "gear-4", 1, 64, 224, 10, 1, BF16),
    # K and V with different codecs
    ("kivi-4", "kivi-2", 3, 64, 160, 31, 1, F16),
    ("tada-2", "fp16", 8, 64, 96, 63, 1, BF16),
    ("int8", "gear", 1, 128, 224, 0, 3, F16),
    ("fp16", "tada-4", 3, 128, 96, 12, 1, F32),
    ("gear-l-2", "int8", 3, 64, 160, 2, 1, F16),
    ("tada-8", "kivi-4", 8, 128, 224, 50, 5, BF16),
    # 3-bit keys: a tail across two 256-token blocks of their 1-bit planes
    ("kivi-3", "kivi-2", 3, 64, 288, 31, 1, F16),
    ("kivi-3", "int8", 8, 128, 96, 12, 2, BF16),
    # a prefill chunk: R = Gq*T = 90 rows, two row blocks of 64
    ("kivi-4", "tada-2", 3, 64, 96, 10, 30, F16),
    # no tail: window only / new tokens only
    ("kivi-2", "kivi-2", 3, 64, 0, 30, 1, F16),
    ("fp16", "fp16", 8, 128, 0, 0, 6, BF16),
]


def _setup(k_method, v_method, Gq, D, n_tail, W, T, dtype, Hkv=2, **kw):
    """A case with storage larger than the tail (reads stop at n_tail), n_tail returned too."""
    q, kt, vt, kw_, vw, kn, vn = attention_case(k_method, v_method, Hkv, Gq, D, n_tail, W, T,
                                                dtype, G=G, spare=G, **kw)
    return q, kt, vt, n_tail, kw_, vw, kn, vn


def _dequantized_reference(*args):
    q = args[0]
    return dequantized_reference(*args).to(q.dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_matches_dequantized_and_torch(case):
    args = _setup(*case)
    q = args[0]
    out = tri.decode_attention(*args, split=SPLIT)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, _dequantized_reference(*args), **EXACT_TOL[q.dtype])
    ref = torch_attention(*args, block=64)
    packed = args[3] and not {case[0], case[1]} <= {"fp16", "bf16"}
    assert_close(out.float(), ref.float(), **(PACKED_TOL if packed else EXACT_TOL[q.dtype]))


@pytest.mark.parametrize("kv", [("tada-4", "tada-2"), ("tada-8", "kivi-2")])
def test_tada_int8_means(kv):
    args = _setup(*kv, 3, 64, 160, 9, 1, F16, tada_mu="int8")
    assert_close(tri.decode_attention(*args, split=SPLIT), _dequantized_reference(*args),
                 **EXACT_TOL[F16])


def test_fp32_tail():
    """An uncompressed fp32 tail (FpCodec of any dtype is read as is): exact against torch."""
    torch.manual_seed(1)
    kc, vc = FpCodec("k", G, torch.float32), FpCodec("v", G, torch.float32)
    ks, vs = kc.alloc(3, 64, 128), vc.alloc(3, 64, 128)
    kc.pack(ks, torch.randn(3, 96, 64), 0)
    vc.pack(vs, torch.randn(3, 96, 64), 0)
    q, kn, vn = torch.randn(1, 9, 2, 64), torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64)
    kw, vw = torch.randn(1, 3, 7, 64).half(), torch.randn(1, 3, 7, 64).half()
    args = (q, (kc, ks), (vc, vs), 96, kw, vw, kn, vn)
    assert_close(tri.decode_attention(*args, split=SPLIT), torch_attention(*args, block=64),
                 **EXACT_TOL[F32])


def test_split_size_does_not_change_the_result():
    args = _setup("kivi-2", "tada-4", 3, 64, 224, 7, 1, F32)
    a = tri.decode_attention(*args, split=32)          # 7 tail parts
    b = tri.decode_attention(*args, split=256)         # 1 tail part
    c = tri.decode_attention(*args)                    # the launcher's default split
    assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_new_tokens_are_causal():
    """Changing a later new token must not change an earlier query's output."""
    q, kt, vt, n, kw, vw, kn, vn = _setup("tada-4", "kivi-4", 3, 64, 64, 8, 6, F32)
    a = tri.decode_attention(q, kt, vt, n, kw, vw, kn, vn)
    kn2, vn2 = kn.clone(), vn.clone()
    kn2[:, :, 4:] += 5.0
    vn2[:, :, 4:] -= 3.0
    b = tri.decode_attention(q, kt, vt, n, kw, vw, kn2, vn2)
    assert_close(a[:, :, :4], b[:, :, :4], atol=1e-6, rtol=0)
    assert (a[:, :, 4:] - b[:, :, 4:]).abs().max() > 1e-2


def test_strided_inputs():
    """q as the model produces it (a transposed (1, T, H, D) view) and a window that is a
    slice of a larger ring, like the arena's."""
    q, kt, vt, n, kw, vw, kn, vn = _setup("int8", "kivi-2", 3, 64, 96, 9, 3, F16)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)                 # (1, H, T, D) strided
    ring_k, ring_v = (torch.randn(1, 2, 64, 64).half() for _ in range(2))
    ring_k[:, :, :9], ring_v[:, :, :9] = kw, vw
    out = tri.decode_attention(qs, kt, vt, n, ring_k[:, :, :9], ring_v[:, :, :9], kn, vn)
    assert torch.equal(out, tri.decode_attention(q, kt, vt, n, kw, vw, kn, vn))


def test_bad_shapes_are_refused():
    q, kt, vt, n, kw, vw, kn, vn = _setup("fp16", "fp16", 3, 64, 32, 4, 2, F32)
    with pytest.raises(ValueError, match="new K/V"):
        tri.decode_attention(q, kt, vt, n, kw, vw, kn[:, :, :1], vn)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tri.decode_attention(q[:, :5], kt, vt, n, kw, vw, kn, vn)


def _dense_mass(q, kt, vt, n_tail, kw, vw, kn, vn, mass_from):
    """Attention probabilities over the dequantized cache, summed over queries t >= mass_from."""
    (kc, ks), _ = kt, vt
    kd = kc.dequant(ks, 0, n_tail)[None] if n_tail else kn[:, :, :0].float()
    K = torch.cat([kd, kw.float(), kn.float()], 2)                      # (1, Hkv, N, D)
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    K = K.repeat_interleave(H // K.shape[1], 1)
    s = q.float() @ K.transpose(-1, -2) * D ** -0.5                     # (1, H, T, N)
    N = K.shape[2]
    hidden = torch.arange(N)[None, :] > (N - T + torch.arange(T))[:, None]
    p = s.masked_fill(hidden, float("-inf")).softmax(-1)
    return p[0, :, mass_from:].sum(1)                                   # (H, N)


@pytest.mark.parametrize("case,mass_from", [
    (("kivi-4", "tada-4", 1, 64, 96, 5, 1, F32), 0),
    (("int8", "kivi-2", 3, 128, 160, 33, 4, F16), 2),
    (("tada-2", "gear-l", 8, 64, 64, 0, 3, F32), 3),                   # no query counted
    (("fp16", "fp16", 3, 64, 0, 7, 3, BF16), 0),
])
def test_attention_mass(case, mass_from):
    """mass= (token eviction's accumulated attention): += the exact probabilities of the
    queries t >= mass_from, against dense attention over the dequantized cache, and the
    output unchanged by asking for it."""
    args = _setup(*case)
    q, n, W, T = args[0], args[3], case[5], case[6]
    init = torch.rand(q.shape[1], n + W + T)
    mass = init.clone()
    out = tri.decode_attention(*args, split=SPLIT, mass=mass, mass_from=mass_from)
    assert torch.equal(out, tri.decode_attention(*args, split=SPLIT))
    assert_close(mass - init, _dense_mass(*args, mass_from), atol=2e-5, rtol=1e-4)
    if mass_from < T:
        assert_close((mass - init).sum(1), torch.full((q.shape[1],), float(T - mass_from)),
                     atol=1e-4, rtol=0)


# -- end to end ------------------------------------------------------------------------------

def test_tiny_model_decodes_the_same_tokens_on_both_backends(tmp_path, monkeypatch):
    """Greedy decode of a tiny model (D 64, GQA 2:1, two layers, K tada-4 / V kivi-2, window
    32) on the Triton kernels vs the torch path: same tokens. The prefill attends, then
    flushes with kivi_pack (V); every decode step is the arena's fused-write step:
    write_k and write_v write the window (the dense v_proj's GEMM in the
    kernel), decode_attention reads it, and a flush step then packs (kivi_pack for V).
    The 78-token prompt puts 32 tokens in the compressed tail after prefill, and the decode
    flushes 32 more after attending them."""
    import kvrun
    from kvrun.kv.config import parse_kv
    from tiny import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2,
                               intermediate_size=256)
    calls = []
    real = tri.decode_attention

    def counting(*a, **k):
        calls.append(a[3])                                        # n_tail of each call
        return real(*a, **k)

    monkeypatch.setattr(tri, "decode_attention", counting)
    packs = []
    real_pack = tri.kivi_pack

    def counting_pack(codec, st, x, s0):
        packs.append(codec.role)
        return real_pack(codec, st, x, s0)

    monkeypatch.setattr(tri, "kivi_pack", counting_pack)
    from kvrun.kernels.triton import window_write as tww
    fused = []                                                    # the write ops called
    for name in ("write_k", "write_v"):
        real_op = getattr(tww, name)

        def counting_op(*a, _name=name, _real=real_op):
            fused.append(_name)
            return _real(*a)
        monkeypatch.setattr(tww, name, counting_op)
    prompt = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs."
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVRUN_BACKEND", backend)
        model = kvrun.load(path, dtype="fp32", ctx=256,
                           kv=parse_kv("tada-4/kivi-2", residual=32, group=32))
        ids = model.tokenize(prompt)
        assert len(ids) == 78
        tokens[backend] = [ev.token_id for ev in model.stream(ids, 24, temp=0)
                           if ev.token_id is not None]
    assert len(tokens["torch"]) == 24 and len(set(tokens["torch"])) > 3   # not a constant
    assert tokens["triton"] == tokens["torch"]
    assert calls and max(calls) == 64                             # the tail was read by Triton
    # kivi-2 V flushed by kivi_pack: the prefill's block and the decode's, in 2 layers
    assert packs == ["v"] * 4
    for name in ("write_k", "write_v"):                           # 23 decode steps x 2 layers
        assert fused.count(name) == 23 * 2, name


# -- bytes moved (the roofline of tools/roofline.py) -------------------------------------------

def test_bytes_per_step_counts_every_packed_byte_once():
    from kvrun.kernels.triton.decode_attention import bytes_per_step
    H, Hkv, D, n, W = 64, 8, 128, 32640, 128
    fp = make_codec("fp16", "k", G), make_codec("fp16", "v", G)
    b = bytes_per_step(*fp, H, Hkv, D, n, W)
    assert b["tail_k"] == b["tail_v"] == n * Hkv * D * 2                # (Hkv, S, D) fp16
    assert b["window"] == 2 * W * Hkv * D * 2
    n_parts = 33 + 1                        # tail: 264 / Hkv programs; window + new tokens: 1
    assert b["parts"] == 2 * n_parts * Hkv * (H // Hkv) * (D + 1) * 4
    kv = make_codec("kivi-4", "k", G), make_codec("kivi-2", "v", G)
    c = bytes_per_step(*kv, H, Hkv, D, n, W)
    # KIVI K: 4-bit codes + fp16 (scale, zero) per channel per 32 tokens
    assert c["tail_k"] == n * Hkv * D * (0.5 + 4 / G)
    # KIVI V: 2-bit codes in the nibble layout + fp16 (scale, zero) per 32 channels
    assert c["tail_v"] == n * Hkv * (D * 0.25 + 4 * D // 32)
    # TaDA: μ once per token (not per head)
    t = bytes_per_step(make_codec("tada-4", "k", G), make_codec("fp16", "v", G), H, Hkv, D, n, W)
    assert t["tail_k"] == n * (Hkv * (D * 0.5 + 4) + D * 2)


def test_roofline_tool_prints_a_row_per_method(capsys):
    tool = load_tool("roofline")
    tool.main(["--geometry", "llama-3.1-70b", "--ctx", "32k", "--kv", "fp16", "kivi-4/kivi-2",
               "tada-2"])
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == {"fp16", "kivi-4/kivi-2", "tada-2"}
    fp16_mib = float(rows["fp16"][5])
    assert abs(fp16_mib - (2 * 32768 * 8 * 128 * 2 + 2 * 34 * 8 * 8 * 129 * 4
                           + 2 * 128 * (2 * 64 + 2 * 8)) / 2**20) < 0.01
    assert abs(float(rows["fp16"][6]) - fp16_mib * 2**20 / 3.35e12 * 1e6) < 0.1   # µs at H100 bw
    assert float(rows["kivi-4/kivi-2"][5]) < float(rows["tada-2"][5]) < fp16_mib


# -- the GPU compile (no GPU needed) ---------------------------------------------------------

def test_kernels_compile_for_h100_without_register_spills():
    """The interpreter runs programs a GPU compile would reject and is blind to register
    pressure: compile the launches of three calls for sm_90 with triton's bundled ptxas
    (tools/sm90_check.py, in a process without TRITON_INTERPRET)."""
    import subprocess
    import sys
    from pathlib import Path
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("triton's CUDA toolchain (ptxas, cuobjdump) is not bundled here")
    tool = Path(__file__).resolve().parents[2] / "tools" / "sm90_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(tool), "--kv", "gear", "tada-8/kivi-2", "int8",
                        "--t", "2"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "regs" in ln and "kivi_pack" not in ln]
    assert len(lines) == 3 * 2 and all(ln.endswith(" 0 B stack") for ln in lines), r.stdout
    pack = [ln for ln in r.stdout.splitlines() if ln.startswith("kivi_pack")]
    assert len(pack) == 4 and all(ln.endswith(" 0 B stack, fma False") for ln in pack), r.stdout
