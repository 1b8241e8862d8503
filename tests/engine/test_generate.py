"""kvrun.engine.generate: the Engine's greedy and seeded runs, its finish reasons, prompt
reuse, repair after an interrupt, its Timings and the ids it accepts (tiny model)."""
import pytest
import torch

import kvrun
from kvrun.engine.generate import Timings, check_ids
from tiny import interrupted_forward, make_tiny_model_dir


def test_greedy_is_argmax_of_full_forward(tiny):
    prompt = tiny.tokenize("abc def")
    out = [ev.token_id for ev in tiny.stream(prompt, 12, temp=0) if ev.token_id is not None]
    ids = list(prompt)
    for tok in out:                              # every greedy pick = argmax of a full forward
        assert tok == int(tiny.logits(ids)[-1].argmax())
        ids.append(tok)


def test_seed_reproducible_and_different_seeds_differ(tiny):
    a = tiny.generate("hello", 24, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    b = tiny.generate("hello", 24, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    c = tiny.generate("hello", 24, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8)
    assert a == b and a != c


def test_largest_seed_samples(tiny):
    """The top of the seed range is accepted and draws like any seed."""
    a = tiny.generate("hello", 4, temp=1.0, seed=(1 << 64) - 1)
    b = tiny.generate("hello", 4, temp=1.0, seed=(1 << 64) - 1)
    assert a == b


def test_stop_token_ends_generation(tiny):
    tiny.stop_ids = {int(tiny.logits(tiny.tokenize("xyz"))[-1].argmax())}
    evs = list(tiny.stream("xyz", 50, temp=0))
    assert evs[-1].finish_reason == "stop" and evs[-1].timings.gen_tokens == 1


def test_length_and_context_finish(tiny_dir):
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=40)
    evs = list(m.stream("ab", 5, temp=0))
    assert evs[-1].finish_reason == "length" and evs[-1].timings.gen_tokens == 5
    m.stop_ids = set()
    evs = list(m.stream("ab", 100, temp=0))
    assert evs[-1].finish_reason == "context" and len(m.engine.cached) == 40
    with pytest.raises(kvrun.KvrunError, match="prompt too long"):
        m.generate("x" * 80, 4)


def test_repeated_prompt_reuses_cache(tiny):
    tiny.generate("the same prompt", 4, temp=0)
    evs = list(tiny.stream("the same prompt", 4, temp=0))
    assert evs[-1].timings.prompt_tokens == 1   # only the last prompt token is re-fed


def test_chat_template_chatml_default_system(tiny):
    text = tiny.template.render([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tiny.tokenize(text, bos=False)
    assert ids.count(1) == 3 and ids.count(2) == 2   # specials are single tokens


def test_interrupted_forward_is_repaired(tmp_path):
    """Ctrl-C between layers of a compressed cache leaves it usable and consistent."""
    tiny_dir = make_tiny_model_dir(tmp_path / "d32", hidden_size=128)          # head dim 32
    m = kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv=kvrun.kv.parse_kv(
        "int8", residual=32, group=32))
    prompt = m.tokenize("a" * 100)
    m.engine.prefill(prompt)
    with interrupted_forward(m), pytest.raises(KeyboardInterrupt):   # in the second layer
        m.engine.decode_step(5)
    n = len(m.engine.cached)
    assert n == m.cache.seq_len and n <= len(prompt)
    got = m.engine.prefill(prompt[n:] + [5]) if n < len(prompt) else m.engine.decode_step(5)
    ref = kvrun.load(tiny_dir, dtype="fp32", ctx=256, kv=kvrun.kv.parse_kv(
        "int8", residual=32, group=32))
    ref.engine.prefill(prompt[:n])
    want = ref.engine.prefill(prompt[n:] + [5]) if n < len(prompt) else ref.engine.decode_step(5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decode_rate_counts_one_token_forwards(tiny):
    """The first token is sampled from the prompt's logits: -n 1 runs no decode step and
    has no decode rate (it printed a rate over one sample's microseconds), -n 5 runs 4."""
    one = list(tiny.stream("hello", 1, temp=0))[-1].timings
    assert one.gen_tokens == 1 and one.decode_tokens == 0 and one.gen_tok_s == 0.0
    five = list(tiny.stream("hello", 5, temp=0))[-1].timings
    assert five.gen_tokens == 5 and five.decode_tokens == 4
    assert five.gen_tok_s == pytest.approx(4 / five.decode_s) and five.decode_s <= five.gen_s


@pytest.mark.parametrize("bad", [-1, 259, 2.0, True, "5"])
def test_check_ids_refuses_what_is_not_a_token(bad):
    check_ids([0, 258], 259)
    with pytest.raises(kvrun.KvrunError, match=r"is not in the vocabulary \[0, 259\)"):
        check_ids([3, bad], 259)


def test_timings_rates():
    t = Timings(prompt_tokens=10, prompt_s=0.5, gen_tokens=5, gen_s=2.0, decode_tokens=4,
                decode_s=1.0)
    assert (t.prompt_tok_s, t.gen_tok_s) == (20.0, 4.0)
    assert (Timings().prompt_tok_s, Timings(gen_tokens=1, decode_s=0.1).gen_tok_s) == (0.0, 0.0)
