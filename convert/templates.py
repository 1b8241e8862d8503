"""Recognise a chat template family from the Jinja text a checkpoint ships.

kvrun does not run Jinja: the runtime formats conversations itself for a few named
families (`ModelConfig.chat_template`: chatml, llama3, mistral, gemma, none). Conversion only has
to tell which family a template belongs to, from the marker tokens it writes, and pick up
the system prompt a template injects when the conversation has none (SmolLM2: "You are a
helpful AI assistant named SmolLM, trained by Hugging Face"; Qwen2: "You are a helpful
assistant."), so that kvrun's prompts are token-identical to the reference ones.
"""
from __future__ import annotations

import re

# A literal ChatML system turn inside a Jinja string: the text between the header and
# <|im_end|> must be plain (no quote or brace), so `'...system\n' + messages[0]['content']`
# does not match. The newline is either a real one or a `\n` escape in the Jinja literal.
_CHATML_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>")


def detect_chat_template(template: str | list | None) -> tuple[str, str | None]:
    """(family, default system prompt or None) for a Jinja chat template.

    `template` may also be HF's list form `[{"name": ..., "template": ...}]`; the entry named
    "default" (else the first) is used.
    """
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        return "none", None
    if "<|im_start|>" in template:
        m = _CHATML_DEFAULT_SYSTEM.search(template)
        return "chatml", _unescape(m.group(1)) if m else None
    if "<|start_header_id|>" in template:
        return "llama3", None
    if "[INST]" in template:
        return "mistral", None
    if "<start_of_turn>" in template:
        return "gemma", None
    return "none", None


def _unescape(s: str) -> str:
    """Undo the escapes a Jinja string literal may contain."""
    return s.replace("\\n", "\n").replace("\\t", "\t").replace("\\'", "'").replace('\\"', '"')


# Tokens that end an assistant turn, per family; the converters add their ids to
# eos_token_ids because a checkpoint's declared eos is often the end-of-document token.
_STOP_TOKENS = {"chatml": ("<|im_end|>", "<|endoftext|>"),
                "llama3": ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"),
                "gemma": ("<end_of_turn>", "<eos>")}


def chat_stop_tokens(family: str) -> tuple[str, ...]:
    """Token strings that end a turn in this template family (may be absent from a vocab)."""
    return _STOP_TOKENS.get(family, ())
