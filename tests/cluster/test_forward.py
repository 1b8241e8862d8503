"""kvrun.cluster.forward: the routing key of a request (its text, the chain of block hashes
that names a shared prefix) without a Ray cluster."""
import json

from kvrun.cluster.forward import BLOCK_CHARS, blocks_of, routing_text


def test_blocks_name_shared_prefixes():
    a = "s" * (3 * BLOCK_CHARS) + "user one"
    b = "s" * (3 * BLOCK_CHARS) + "user two, longer" + "x" * BLOCK_CHARS
    ba, bb = blocks_of(a), blocks_of(b)
    assert len(ba) == 3 and len(bb) == 4
    assert ba == bb[:3]                             # the shared system prompt's blocks
    assert blocks_of("t" + a[1:])[0] != ba[0]       # one character differs: another chain
    assert blocks_of("short") == []


def test_routing_text_of_chat_and_completion():
    chat = json.dumps({"messages": [{"role": "system", "content": "S"},
                                    {"role": "user", "content": "U"}]}).encode()
    assert routing_text("/v1/chat/completions", chat) == "\0system\0S\0user\0U"
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2]}') == "[1, 2]"
    for bad in (b"", b"{", b"[1]", b'{"messages": 3}'):
        assert routing_text("/v1/chat/completions", bad) == ""
    assert routing_text("/health", chat) == ""
