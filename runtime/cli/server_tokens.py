"""`kvrun serve`'s /tokenize and /detokenize, in llama-server's shape:

    POST /tokenize   {"content": "text", "add_special": false}  ->  {"tokens": [ids]}
    POST /detokenize {"tokens": [ids]}                          ->  {"content": "text"}

`content` is read as a completion's raw prompt is (special-token text becomes those
tokens); `add_special` adds the model's BOS when it has one. An id outside the vocabulary is
a 400 naming `tokens`; any other field is a 400 naming it. The HTTP limits (API key, JSON
content type, body size) are the other routes' (runtime/cli/server_http.py)."""
from __future__ import annotations

from ..engine.generate import check_ids
from ..errors import KvrunError
from .server_fields import ApiError, field, parse_body


def _only(body: dict, names: set[str]) -> None:
    for k in body:
        if k not in names:
            raise ApiError(400, f"unknown parameter '{k:.60}'", param=k[:60], code="unknown_parameter")


def tokenize(model, raw: bytes) -> dict:
    """The reply of POST /tokenize (module docstring); ApiError if the body is bad."""
    body = parse_body(raw)
    _only(body, {"content", "add_special"})
    text = field(body, "content", str)
    if text is None:
        raise ApiError(400, "'content' must be a string", param="content")
    bos = field(body, "add_special", bool, False)
    return {"tokens": model.tokenize(text, bos=bos)}


def detokenize(model, raw: bytes) -> dict:
    """The reply of POST /detokenize (module docstring); ApiError if the body is bad."""
    body = parse_body(raw)
    _only(body, {"tokens"})
    ids = field(body, "tokens", list)
    if ids is None:
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    try:
        check_ids(ids, model.cfg.vocab_size)
    except KvrunError as e:
        raise ApiError(400, str(e), param="tokens") from None
    return {"content": model.tokenizer.decode(ids)}
