"""Chat templates rendered in Python (no Jinja at run time): ChatML, Llama-3, Mistral-instruct,
Gemma (`<start_of_turn>user\n…<end_of_turn>\n`, the assistant role named "model", a system
prompt folded into the first user turn; content trimmed, as Gemma 3's Jinja template does).

The template name comes from the source model's metadata at conversion time. Besides the
full rendering, a template knows how to *continue* a conversation whose earlier turns are
already in the KV cache: close the assistant reply (its stop token was sampled, not fed),
then render only the new messages. That keeps multi-turn chat append-only, so turn N+1
prefills only its own tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import KvrunError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    bos: str = ""                 # text of the BOS token when the template writes it
    default_system: str | None = None

    # -- one message --
    def message(self, role: str, content: str, first: bool) -> str:
        if self.name == "chatml":
            return f"<|im_start|>{role}\n{content}<|im_end|>\n"
        if self.name == "llama3":
            return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
        if self.name == "mistral":
            if role == "user":
                return f"[INST] {content.strip()} [/INST]"
            if role == "assistant":
                return f" {content.strip()}</s>"
            return ""                               # system is folded into the first user turn
        if self.name == "gemma":
            if role == "system":
                return ""                           # folded into the first user turn (render)
            return f"<start_of_turn>{'model' if role == 'assistant' else role}\n{content.strip()}<end_of_turn>\n"
        return f"{role.capitalize()}: {content}\n"

    def generation_prompt(self) -> str:
        return {"chatml": "<|im_start|>assistant\n",
                "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                "mistral": "", "gemma": "<start_of_turn>model\n"}.get(self.name, "Assistant:")

    def close_reply(self) -> str:
        """Text that ends an assistant reply whose stop token was sampled but not fed."""
        return {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>",
                "mistral": "</s>", "gemma": "<end_of_turn>\n"}.get(self.name, "\n")

    # -- conversations --
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The whole conversation, as the source model's Jinja template renders it."""
        messages = _checked(messages)
        out = [self.bos]
        if self.name == "chatml" and messages and messages[0]["role"] != "system" \
                and self.default_system:
            out.append(self.message("system", self.default_system, True))
        if self.name == "mistral" and messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
            if messages and messages[0]["role"] == "user":
                messages = [{"role": "user", "content": system + "\n\n" + messages[0]["content"]}] \
                    + messages[1:]
        if self.name == "gemma" and messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
            if messages and messages[0]["role"] == "user":     # "<system>\n\n<user trimmed>"
                out.append(f"<start_of_turn>user\n{system}\n\n{messages[0]['content'].strip()}"
                           "<end_of_turn>\n")
                messages = messages[1:]
        for i, m in enumerate(messages):
            out.append(self.message(m["role"], m["content"], i == 0))
        if add_generation_prompt:
            out.append(self.generation_prompt())
        return "".join(out)

    def continue_after_reply(self, messages: list[dict]) -> str:
        """Text appended after a generated reply: close it, add `messages`, prompt again."""
        messages = _checked(messages)
        body = "".join(self.message(m["role"], m["content"], False) for m in messages)
        return self.close_reply() + body + self.generation_prompt()


def _checked(messages: list[dict]) -> list[dict]:
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise KvrunError(f"bad chat message {m!r}: need {{'role': one of {ROLES}, 'content': str}}")
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
