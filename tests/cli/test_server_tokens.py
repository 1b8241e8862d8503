"""kvrun.cli.server_tokens: /tokenize and /detokenize's replies and their 400s, on the tiny
model (byte-level: "a" is token 3 + 97)."""
import json

import pytest

from kvrun.cli.server_fields import ApiError
from kvrun.cli.server_tokens import detokenize, tokenize


def _body(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_round_trip(tiny):
    ids = tokenize(tiny, _body(content="héllo <|im_end|>"))["tokens"]
    assert ids == tiny.tokenize("héllo <|im_end|>", bos=False)
    assert tokenize(tiny, _body(content="hi", add_special=True))["tokens"] == \
        tiny.tokenize("hi", bos=True)
    assert detokenize(tiny, _body(tokens=ids)) == {"content": "héllo <|im_end|>"}
    assert tokenize(tiny, _body(content="")) == {"tokens": []}


@pytest.mark.parametrize("fn, body, param", [
    (tokenize, _body(), "content"), (tokenize, _body(content=5), "content"),
    (tokenize, _body(content="x", with_pieces=True), "with_pieces"),
    (tokenize, _body(content="x", add_special="yes"), "add_special"),
    (detokenize, _body(), "tokens"), (detokenize, _body(tokens="1 2"), "tokens"),
    (detokenize, _body(tokens=[1, 259]), "tokens"), (detokenize, _body(tokens=[-1]), "tokens"),
    (detokenize, _body(tokens=[1.5]), "tokens"),
])
def test_bad_bodies_are_a_400_naming_the_field(tiny, fn, body, param):
    with pytest.raises(ApiError) as e:
        fn(tiny, body)
    assert (e.value.status, e.value.param) == (400, param)
