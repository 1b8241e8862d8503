"""The replies of `kvrun serve` (runtime/cli/server.py) in OpenAI's shapes: a choice, a stream
chunk's choice, usage, and token log-probabilities in the chat format
(`logprobs.content = [{token, logprob, bytes, top_logprobs}]`) and the legacy completions
format (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's text is its own bytes (`Tokenizer.token_bytes`) read as UTF-8, with U+FFFD for a
partial character; `bytes` holds the exact bytes. Log-probabilities are the model's own
(runtime/engine/sampling.py `TokenLogprob`)."""
from __future__ import annotations

from ..engine.sampling import TokenLogprob


def finish_reason(r: str | None) -> str | None:
    """kvrun's finish reasons in OpenAI's words (a full context is "length")."""
    return {"context": "length", "cancelled": "stop"}.get(r, r)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token(tok, token_id: int) -> dict:
    b = tok.token_bytes(token_id)
    return {"token": b.decode("utf-8", "replace"), "bytes": list(b)}


def chat_logprobs(tok, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat's `logprobs` object of these tokens."""
    out = []
    for e in entries:
        t = _token(tok, e.token_id)
        out.append({"token": t["token"], "logprob": e.logprob, "bytes": t["bytes"],
                    "top_logprobs": [{"token": a["token"], "logprob": v, "bytes": a["bytes"]}
                                     for a, v in ((_token(tok, i), v) for i, v in e.top)]})
    return {"content": out}


class LegacyLogprobs:
    """The completions endpoint's `logprobs` object of one choice, built piece by piece:
    `text_offset` counts characters from the start of the choice's text (with `echo`, the
    prompt's; its first token has null `token_logprobs` and `top_logprobs`)."""

    def __init__(self, tok):
        self.tok, self.offset = tok, 0

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s = _token(self.tok, e.token_id)["token"]
            d["tokens"].append(s)
            d["token_logprobs"].append(e.logprob)
            d["top_logprobs"].append(None if e.top is None else
                                     {_token(self.tok, i)["token"]: v for i, v in e.top})
            d["text_offset"].append(self.offset)
            self.offset += len(s)
        return d


def choice(chat: bool, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """One choice of a whole reply."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chunk_choice(chat: bool, index: int, piece: str | None, reason: str | None,
                 logprobs: dict | None, first: bool = False) -> dict:
    """One choice of a stream chunk: `first` is chat's opening delta (the role)."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else \
                ({} if piece is None else {"content": piece})
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason(reason)}
    return {"index": index, "text": piece or "", "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}
