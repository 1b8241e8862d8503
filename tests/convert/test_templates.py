"""The chat template family and default system prompt read from a checkpoint's Jinja template
(kvrun.convert.templates), HF's list form included, and the tokens that end a turn in each
family."""
import pytest

from kvrun.convert.templates import chat_stop_tokens, detect_chat_template
from test_convert import QWEN_TEMPLATE, SMOL_SYSTEM, SMOL_TEMPLATE


@pytest.mark.parametrize("template,family,system", [
    (SMOL_TEMPLATE, "chatml", SMOL_SYSTEM),
    (QWEN_TEMPLATE, "chatml", "You are a helpful assistant."),
    ("{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}", "chatml", None),
    ("{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}", "llama3", None),
    ("{{ '[INST] ' + m['content'] + ' [/INST]' }}", "mistral", None),
    ("{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}", "gemma", None),
    ("{{ m['content'] }}", "none", None),
    (None, "none", None),
])
def test_detect_chat_template(template, family, system):
    assert detect_chat_template(template) == (family, system)



def test_list_form_takes_the_default_entry():
    named = [{"name": "tool_use", "template": "{{ '[INST]' }}"},
             {"name": "default", "template": "{{ '<|start_header_id|>' }}"}]
    assert detect_chat_template(named) == ("llama3", None)
    assert detect_chat_template(named[:1]) == ("mistral", None)          # else the first
    assert detect_chat_template([]) == ("none", None)


def test_escaped_default_system_is_unescaped():
    t = "{{ '<|im_start|>system\\nBe brief.\\tBe kind.<|im_end|>\\n' }}"
    assert detect_chat_template(t) == ("chatml", "Be brief.\tBe kind.")


def test_stop_tokens_by_family():
    assert chat_stop_tokens("chatml") == ("<|im_end|>", "<|endoftext|>")
    assert chat_stop_tokens("gemma") == ("<end_of_turn>", "<eos>")
    assert chat_stop_tokens("mistral") == () and chat_stop_tokens("none") == ()
