"""kvrun.engine.chat_session: a chat's turns prefill only their new tokens and leave the cache
as a fresh forward would (tiny model)."""
import torch

from kvrun.engine.chat_session import ChatSession


def test_chat_turns_prefill_only_new_tokens(tiny):
    s = ChatSession(tiny, system="be brief")
    list(s.reply("first question", 6, temp=0))
    turn1_ids, cached_after_turn1 = list(s.ids), len(tiny.engine.cached)
    new = tiny.tokenize(tiny.template.continue_after_reply(
        [{"role": "user", "content": "second"}]), bos=False)
    evs2 = list(s.reply("second", 6, temp=0))
    # only the reply's last sampled token (never fed) and the new turn are prefilled
    assert evs2[-1].timings.prompt_tokens == len(turn1_ids) - cached_after_turn1 + len(new)
    assert len(new) < len(turn1_ids)
    assert s.ids[:len(turn1_ids)] == turn1_ids
    # the multi-turn cache gives the same next-token logits as a fresh full forward
    fed = list(tiny.engine.cached)
    got = tiny.engine.decode_step(5)
    torch.testing.assert_close(got, tiny.logits(fed + [5])[-1], atol=1e-4, rtol=1e-4)
