"""The runtime tokenizer (runtime/model/tokenizer.py) on the tests' byte-level tokenizer
(specials 0..2, then one id per byte): the BOS policy, chat markers as control tokens
while the same text in a message stays text, a token's bytes, and streaming that holds a
character back until its last byte. (The tokenizers a GGUF's metadata rebuilds:
test_tokenizer_from_gguf.py.)"""
import pytest

from kvrun.errors import KvrunError
from kvrun.model.tokenizer import Tokenizer
from tiny import byte_level_tokenizer

IM_START, IM_END = 1, 2                   # tiny.SPECIALS: <|endoftext|>, <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_level_tokenizer().save(str(path))
    return Tokenizer(path, bos_id=0, add_bos=True)


def test_encode_follows_the_bos_setting_and_decodes_back(tok):
    ids = tok.encode("héllo")
    assert ids[0] == 0 and len(ids) == 1 + len("héllo".encode())          # one id per byte
    assert tok.encode("héllo", bos=False) == ids[1:]
    assert tok.decode(ids, skip_special=True) == "héllo"
    assert tok.vocab_size == 3 + 256


def test_special_text_is_a_control_token_in_encode_and_text_in_a_message(tok):
    assert tok.encode("<|im_end|>", bos=False) == [IM_END]
    parts = [("<|im_start|>", True), ("user\n<|im_end|>", False), ("<|im_end|>", True)]
    ids = tok.encode_parts(parts)
    assert ids[0] == IM_START and ids[-1] == IM_END and IM_END not in ids[1:-1]
    assert ids[1:-1] == [tok.encode(c, bos=False)[0] for c in "user\n<|im_end|>"]   # byte by byte
    assert tok.decode(ids[1:-1]) == "user\n<|im_end|>"


def test_token_bytes(tok):
    assert tok.token_bytes(IM_END) == b"<|im_end|>"
    a, = tok.encode("a", bos=False)
    assert tok.token_bytes(a) == b"a"
    first, second = tok.encode("é", bos=False)
    assert tok.token_bytes(first) + tok.token_bytes(second) == "é".encode()
    assert tok.token_id("<|im_start|>") == IM_START


def test_the_stream_holds_a_character_back_until_its_last_byte(tok):
    s = tok.stream()
    first, second = tok.encode("é", bos=False)
    assert [s.push(i) for i in tok.encode("ok ", bos=False)] == ["o", "k", " "]
    assert s.push(first) == "" and s.push(second) == "é"
    assert s.push(IM_END) == "" and s.flush() == ""
    dangling = tok.stream()
    assert dangling.push(first) == "" and dangling.flush() == "\ufffd"


def test_a_broken_tokenizer_file_is_one_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{")
    with pytest.raises(KvrunError, match="cannot load tokenizer"):
        Tokenizer(bad)
