"""Stop strings (runtime/engine/stops.py): the filter on hand-made events, then on the tiny model's
greedy continuations through the library API and a chat session."""
import pytest
import torch

import kvrun
from kvrun.engine.chat_session import ChatSession
from kvrun.engine.generate import StreamEvent, Timings
from kvrun.engine.stops import StopStrings, check_stops, unescape


class Source:
    """A stream of hand-made events that counts how many were taken and sees close()."""

    def __init__(self, pieces, reason="length"):
        self.pieces, self.reason, self.taken, self.closed = pieces, reason, 0, False
        self.gen = self._gen()

    def _gen(self):
        try:
            for i, p in enumerate(self.pieces):
                self.taken += 1
                yield StreamEvent(p, 100 + i, Timings())
            yield StreamEvent("", None, Timings(), self.reason)
        finally:
            self.closed = True

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.gen)

    def close(self):
        self.gen.close()


def run(pieces, stop, reason="length"):
    src = Source(pieces, reason)
    f = StopStrings(stop)
    evs = list(f.apply(src))
    return evs, f, src


def test_stop_split_across_pieces_is_cut_and_generation_closed():
    evs, f, src = run(["Hello", " Obs", "erv", "ation: x", " more", " text"], ["Observation:"])
    assert "".join(e.text for e in evs) == "Hello " == f.text
    assert evs[-1].finish_reason == "stop" and evs[-1].token_id is None
    assert f.matched == "Observation:"
    assert src.taken == 4 and src.closed          # nothing asked for after the match
    # every token event is passed on (a chat session records them), held text as ''
    assert [e.token_id for e in evs[:-1]] == [100, 101, 102, 103]
    assert [e.text for e in evs[:-1]] == ["Hello", " ", "", ""]


def test_false_start_is_released_when_it_cannot_be_a_stop():
    evs, f, src = run(["ab", "c", "ab"], ["abd"])
    assert [e.text for e in evs] == ["", "abc", "", "ab"]  # the trailing "ab" at the end
    assert evs[-1].finish_reason == "length" and f.matched is None and f.text == "abcab"


def test_earliest_of_several_stops_wins_and_stop_in_one_piece():
    evs, f, _ = run(["one two three"], ["three", "two"])
    assert f.text == "one " and f.matched == "two" and evs[-1].finish_reason == "stop"
    evs, f, _ = run(["x", "yz"], "yz")                  # a single string is one stop
    assert f.text == "x" and evs[-1].finish_reason == "stop"


def test_own_finish_reason_kept_without_a_match():
    evs, f, src = run(["a", "b"], ["zz"], reason="stop")   # an EOS token: "stop" too
    assert evs[-1].finish_reason == "stop" and f.matched is None and f.text == "ab"


@pytest.mark.parametrize("bad", ["", [""], ["ok", ""], [3]])
def test_bad_stop_strings(bad):
    with pytest.raises(kvrun.KvrunError):
        check_stops(bad)


def test_unescape():
    assert unescape(r"\n\nUser:") == "\n\nUser:"
    assert unescape(r"a\tb\\n\x41") == "a\tb\\nA"
    assert unescape(r"C:\path\x") == r"C:\path\x"      # unknown escapes stay as typed


# -- on the tiny model -----------------------------------------------------------------

def two_token_stop(events):
    """(stop, kept text, index of its second token) for the first two consecutive tokens
    whose texts are printable ASCII and whose joined text does not occur earlier: a stop
    string split across two tokens, found in the model's own greedy continuation."""
    texts = [e.text for e in events if e.token_id is not None]
    for i in range(len(texts) - 1):
        a, b = texts[i], texts[i + 1]
        if a and b and (a + b).isascii() and (a + b).isprintable():
            kept = "".join(texts[:i])
            if a + b not in kept + a + b[:-1]:
                return a + b, kept, i + 1
    pytest.skip("no two printable ASCII tokens in a row in this continuation")


def test_library_stop_string_cuts_greedy_continuation(tiny):
    full = list(tiny.stream("hello", 32, temp=0))
    stop, kept, j = two_token_stop(full)
    tiny.reset()
    evs = list(tiny.stream("hello", 32, temp=0, stop=[stop]))
    assert "".join(e.text for e in evs) == kept
    assert evs[-1].finish_reason == "stop"
    assert evs[-1].timings.gen_tokens == j + 1            # generation ended at the match
    assert stop not in "".join(e.text for e in evs)
    tiny.reset()
    assert tiny.generate("hello", 32, temp=0, stop=stop) == kept
    tiny.reset()
    # a prefix of the stop string that is never completed is printed in the end
    assert tiny.generate("hello", 32, temp=0, stop=[stop[0] + "\uffff"]) == \
        "".join(e.text for e in full)


def test_chat_stream_stop_and_empty_stop_is_an_error(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    full = list(tiny.chat_stream(msgs, 32, temp=0))
    stop, kept, _ = two_token_stop(full)
    tiny.reset()
    assert tiny.chat(msgs, 32, temp=0, stop=[stop]) == kept
    with pytest.raises(kvrun.KvrunError, match="empty stop string"):
        tiny.stream("hello", 4, stop=[""])               # refused before generating


def test_chat_session_keeps_the_reply_as_printed(tiny):
    s = ChatSession(tiny)
    full = list(s.reply("first question", 32, temp=0))
    stop, kept, _ = two_token_stop(full)
    s.reset()
    turn = s._turn_ids("first question")
    evs = list(s.reply("first question", 32, temp=0, stop=stop))
    assert "".join(e.text for e in evs) == kept and evs[-1].finish_reason == "stop"
    # the conversation holds the prompt and exactly the printed reply, not the stop string
    assert s.ids[:len(turn)] == turn
    assert tiny.tokenizer.decode(s.ids[len(turn):], skip_special=True) == kept
    after1 = list(s.ids)
    evs2 = list(s.reply("second", 6, temp=0))
    assert evs2[-1].finish_reason is not None and s.ids[:len(after1)] == after1
    # the cache went on from the kept reply: same next-token logits as a fresh forward
    fed = list(tiny.engine.cached)
    assert fed == s.ids[:len(fed)]
    got = tiny.engine.decode_step(5)
    torch.testing.assert_close(got, tiny.logits(fed + [5])[-1], atol=1e-4, rtol=1e-4)
