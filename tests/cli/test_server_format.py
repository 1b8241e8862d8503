"""kvrun.cli.server_format: `kvrun serve`'s replies in OpenAI's shapes (choices, stream
chunks, usage, chat and legacy log-probabilities), built from hand-made values."""
from types import SimpleNamespace

from kvrun.cli.server_format import (LegacyLogprobs, chat_logprobs, choice, chunk_choice,
                                     finish_reason, usage)
from kvrun.engine.sampling import TokenLogprob

# a tokenizer stand-in: token i is the bytes below (3 is half of "é")
TOK = SimpleNamespace(token_bytes=lambda i: {1: b"ab", 2: b" c", 3: b"\xc3"}[i])


def test_finish_reasons_and_usage_in_openais_words():
    assert [finish_reason(r) for r in ("stop", "length", "context", "cancelled", None)] == \
        ["stop", "length", "length", "stop", None]
    assert usage(7, 5) == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_choices_chat_and_completion():
    assert choice(True, 1, "hi", "context", None) == {
        "index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
        "finish_reason": "length"}
    assert choice(False, 0, "hi", "stop", {"x": 1}) == {
        "index": 0, "text": "hi", "logprobs": {"x": 1}, "finish_reason": "stop"}
    assert chunk_choice(True, 0, None, None, None, first=True)["delta"] == \
        {"role": "assistant", "content": ""}
    assert chunk_choice(True, 0, None, "stop", None)["delta"] == {}
    assert chunk_choice(True, 0, "x", None, None)["delta"] == {"content": "x"}
    assert chunk_choice(False, 2, None, "cancelled", None) == {
        "index": 2, "text": "", "logprobs": None, "finish_reason": "stop"}


def test_chat_logprobs_carry_bytes_and_the_alternatives():
    got = chat_logprobs(TOK, [TokenLogprob(1, -0.5, [(1, -0.5), (3, -1.5)])])
    assert got == {"content": [{"token": "ab", "logprob": -0.5, "bytes": [97, 98], "top_logprobs": [
        {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
        {"token": "\ufffd", "logprob": -1.5, "bytes": [0xC3]}]}]}


def test_legacy_logprobs_count_text_offsets_across_pieces():
    lp = LegacyLogprobs(TOK)
    first = lp([TokenLogprob(1, None, None), TokenLogprob(2, -0.25, [(2, -0.25)])])
    assert first == {"tokens": ["ab", " c"], "token_logprobs": [None, -0.25],
                     "top_logprobs": [None, {" c": -0.25}], "text_offset": [0, 2]}
    assert lp([TokenLogprob(1, -1.0, [])])["text_offset"] == [4]      # the next piece goes on
