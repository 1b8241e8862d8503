"""Chat templates rendered in Python (no Jinja at run time): ChatML, Llama-3, Mistral-instruct,
Gemma (`<start_of_turn>user\n…<end_of_turn>\n`, the assistant role named "model", a system
prompt folded into the first user turn; content trimmed, as Gemma 3's Jinja template does).

The template name comes from the source model's metadata at conversion time. Besides the
full rendering, a template knows how to *continue* a conversation whose earlier turns are
already in the KV cache: close the assistant reply (its stop token was sampled, not fed),
then render only the new messages. That keeps multi-turn chat append-only, so turn N+1
prefills only its own tokens.

A rendering keeps the template's markers apart from the messages' text: only the markers
become control tokens, so `<|im_start|>system` typed into a message stays text and cannot
open a turn (runtime/model/tokenizer.py `encode_parts`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvrunError

ROLES = ("system", "user", "assistant")

# A rendering is a list of parts: (text, True) is one of the template's own markers
# ("<|im_start|>"), which the tokenizer turns into its control token; (text, False) is text,
# tokenized as plain text however it reads, so a message cannot forge a marker
# (Tokenizer.encode_parts).
Part = tuple[str, bool]


def _c(marker: str) -> Part:
    return (marker, True)


def _t(text: str) -> Part:
    return (text, False)


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    bos: str = ""                 # text of the BOS token when the template writes it
    default_system: str | None = None

    # -- one message --
    def message_parts(self, role: str, content: str, first: bool) -> list[Part]:
        if self.name == "chatml":
            return [_c("<|im_start|>"), _t(f"{role}\n{content}"), _c("<|im_end|>"), _t("\n")]
        if self.name == "llama3":
            return [_c("<|start_header_id|>"), _t(role), _c("<|end_header_id|>"),
                    _t(f"\n\n{content.strip()}"), _c("<|eot_id|>")]
        if self.name == "mistral":
            if role == "user":
                return [_c("[INST]"), _t(f" {content.strip()} "), _c("[/INST]")]
            if role == "assistant":
                return [_t(f" {content.strip()}"), _c("</s>")]
            return []                               # system is folded into the first user turn
        if self.name == "gemma":
            if role == "system":
                return []                           # folded into the first user turn (render)
            return [_c("<start_of_turn>"), _t(f"{'model' if role == 'assistant' else role}\n"
                                              f"{content.strip()}"), _c("<end_of_turn>"), _t("\n")]
        return [_t(f"{role.capitalize()}: {content}\n")]

    def generation_parts(self) -> list[Part]:
        return {"chatml": [_c("<|im_start|>"), _t("assistant\n")],
                "llama3": [_c("<|start_header_id|>"), _t("assistant"), _c("<|end_header_id|>"),
                           _t("\n\n")],
                "mistral": [], "gemma": [_c("<start_of_turn>"), _t("model\n")]
                }.get(self.name, [_t("Assistant:")])

    def close_parts(self) -> list[Part]:
        """Parts that end an assistant reply whose stop token was sampled but not fed."""
        return {"chatml": [_c("<|im_end|>"), _t("\n")], "llama3": [_c("<|eot_id|>")],
                "mistral": [_c("</s>")], "gemma": [_c("<end_of_turn>"), _t("\n")]
                }.get(self.name, [_t("\n")])

    # -- conversations --
    def render_parts(self, messages: list[dict], add_generation_prompt: bool = True) -> list[Part]:
        """The whole conversation as the source model's Jinja template renders it, as parts
        (markers apart from text)."""
        messages = _checked(messages)
        out = [_c(self.bos)] if self.bos else []
        if self.name == "chatml" and messages and messages[0]["role"] != "system" \
                and self.default_system:
            out += self.message_parts("system", self.default_system, True)
        if self.name == "mistral" and messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
            if messages and messages[0]["role"] == "user":
                messages = [{"role": "user", "content": system + "\n\n" + messages[0]["content"]}] \
                    + messages[1:]
        if self.name == "gemma" and messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
            if messages and messages[0]["role"] == "user":     # "<system>\n\n<user trimmed>"
                out += [_c("<start_of_turn>"),
                        _t(f"user\n{system}\n\n{messages[0]['content'].strip()}"),
                        _c("<end_of_turn>"), _t("\n")]
                messages = messages[1:]
        for i, m in enumerate(messages):
            out += self.message_parts(m["role"], m["content"], i == 0)
        if add_generation_prompt:
            out += self.generation_parts()
        return out

    def continue_parts(self, messages: list[dict]) -> list[Part]:
        """Parts appended after a generated reply: close it, add `messages`, prompt again."""
        messages = _checked(messages)
        body = [p for m in messages for p in self.message_parts(m["role"], m["content"], False)]
        return self.close_parts() + body + self.generation_parts()

    # -- the same as one string (for display; tokenize the parts) --
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return _text(self.render_parts(messages, add_generation_prompt))

    def continue_after_reply(self, messages: list[dict]) -> str:
        return _text(self.continue_parts(messages))


def _text(parts: list[Part]) -> str:
    return "".join(t for t, _ in parts)


def _checked(messages: list[dict]) -> list[dict]:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            role = m.get("role") if isinstance(m, dict) else None
            what = f"role {role!r:.40}" if isinstance(role, str) and role not in ROLES else "message"
            raise KvrunError(f"bad chat message {i}: {what}; need {{'role': one of "
                             f"{', '.join(ROLES)}, 'content': a string}}")
    return list(messages)


def template_for(name: str, default_system: str | None = None, bos: str = "") -> ChatTemplate:
    if name not in ("chatml", "llama3", "mistral", "gemma", "none"):
        raise KvrunError(f"unknown chat template {name!r}")
    if name == "gemma":
        return ChatTemplate(name, bos or "<bos>", default_system)
    if name == "llama3":
        bos = bos or "<|begin_of_text|>"
    if name == "mistral":
        bos = bos or "<s>"
    return ChatTemplate(name, bos if name in ("llama3", "mistral") else "", default_system)
