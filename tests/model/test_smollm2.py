"""The real SmolLM2-135M-Instruct (pulled by CI) against transformers loading the same GGUF."""
import pytest
import torch

import kvrun
from hf_oracle import greedy_pair



@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return kvrun.load(smollm2_dir, dtype="fp32", kv="fp32", ctx=1024)


@pytest.fixture(scope="module")
def text_ids(smol, wikitext):
    ids = smol.tokenize(wikitext[:20000])
    assert len(ids) >= 600
    return ids


def test_logits_match_transformers(smol, hf_gguf_model, text_ids):
    ids = text_ids[:256]
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    out = smol.logits(ids)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # measured: max |Δlogit| ≈ 7e-5 (fp32 on both sides, same dequantized weights)
    assert (out - ref).abs().max().item() <= 1e-3


def test_greedy_continuation_matches_transformers(smol, hf_gguf_model):
    mine, ref = greedy_pair(smol, hf_gguf_model, smol.tokenize("The capital of France is"), 64)
    assert mine == ref
    assert smol.detokenize(mine).startswith(" Paris")


def test_chunked_prefill_and_decode_equal_full_forward(smol, text_ids):
    ids = text_ids[:300]
    full = smol.logits(ids)
    for chunk in (64, 77):
        smol.engine.prefill_chunk = chunk
        smol.reset()
        last = smol.engine.prefill(ids[:250])
        torch.testing.assert_close(last, full[249], atol=2e-4, rtol=1e-4)
        steps = torch.stack([smol.engine.decode_step(ids[i]) for i in range(250, 300)])
        torch.testing.assert_close(steps, full[250:300], atol=2e-4, rtol=1e-4)
    smol.engine.prefill_chunk = 512


def test_default_dtype_decode_agrees(smollm2_dir, text_ids):
    """`--dtype auto` (fp16 decode weights, fp16 cache) keeps the greedy path on long text."""
    m = kvrun.load(smollm2_dir, ctx=1024)
    ref = kvrun.load(smollm2_dir, dtype="fp32", kv="fp32", ctx=1024)
    a = [ev.token_id for ev in m.stream(text_ids[:200], 24, temp=0)]
    b = [ev.token_id for ev in ref.stream(text_ids[:200], 24, temp=0)]
    assert a[:16] == b[:16]
