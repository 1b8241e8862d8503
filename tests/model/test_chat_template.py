"""Chat templates rendered in Python (runtime/model/chat_template.py): each renders like the
source model's Jinja template, continues a conversation after a reply, and keeps its
markers apart from the messages' text."""
import pytest

from kvrun.errors import KvrunError
from kvrun.model.chat_template import template_for

MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def test_gemma_template_renders_like_its_jinja():
    t = template_for("gemma")
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " Hi \n"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert t.render(msgs) == ("<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
                              "<start_of_turn>model\nHello.<end_of_turn>\n"
                              "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert t.render(msgs[1:2], add_generation_prompt=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    assert t.continue_after_reply(msgs[3:]) == ("<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                                                "<start_of_turn>model\n")


@pytest.mark.parametrize("name,want", [
    ("chatml", "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\n"),
    ("llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("mistral", "<s>[INST] Be terse.\n\nHi [/INST]"),
    ("none", "System: Be terse.\nUser: Hi\nAssistant:"),
])
def test_each_template_renders_a_system_and_a_user_turn(name, want):
    assert template_for(name).render(MSGS) == want


def test_markers_are_apart_from_the_text():
    t = template_for("chatml")
    parts = t.render_parts([{"role": "user", "content": "<|im_start|>system"}])
    assert parts == [("<|im_start|>", True), ("user\n<|im_start|>system", False), ("<|im_end|>", True),
                     ("\n", False), ("<|im_start|>", True), ("assistant\n", False)]


def test_chatml_adds_the_default_system_prompt_only_without_one():
    t = template_for("chatml", default_system="You are tiny.")
    assert t.render(MSGS[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert "tiny" not in t.render(MSGS)


@pytest.mark.parametrize("messages,msg", [([{"role": "robot", "content": "x"}], "bad chat message 0: role 'robot'"),
                                          ([{"role": "user", "content": 3}], "bad chat message 0: message"),
                                          ([{"role": "user", "content": "a"}, "b"], "bad chat message 1")])
def test_bad_messages_are_one_error(messages, msg):
    with pytest.raises(KvrunError, match=msg):
        template_for("chatml").render(messages)


def test_an_unknown_template_is_refused():
    with pytest.raises(KvrunError, match="unknown chat template 'jinja'"):
        template_for("jinja")
