"""Tokenizers rebuilt from a GGUF's `tokenizer.ggml.*` metadata (kvrun.convert.gguf_tokenizer),
on hand-made vocabularies small enough to know every id: byte-level BPE (the pre-tokenizer's
splits, the merges, control and user-defined tokens matched whole) and SentencePiece BPE
(merges ranked by score, the "▁" prefix); metadata that does not describe a tokenizer is a
one-line KvrunError. The real SmolLM2 vocabulary against transformers: tests/model/
test_tokenizer.py."""
import pytest

from kvrun.convert.gguf_tokenizer import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, tokenizer_from_gguf
from kvrun.errors import KvrunError


def _gpt2(**kw):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            # "Ġ" is the byte-level alphabet's space
            "tokenizer.ggml.tokens": ["<|im_start|>", "a", "b", "Ġ", "ab", "Ġab", "<user>"],
            "tokenizer.ggml.token_type": [CONTROL] + [NORMAL] * 5 + [USER_DEFINED],
            "tokenizer.ggml.merges": ["a b", "Ġ ab"]}
    return {**meta, **kw}


def test_byte_level_bpe():
    tk = tokenizer_from_gguf(_gpt2())
    assert tk.encode("ab ab").ids == [4, 5]                  # "ab" | " ab", each merged whole
    assert tk.encode("ba").ids == [2, 1]                     # no merge "b a"
    assert tk.encode("<|im_start|>ab<user>b").ids == [0, 4, 6, 2]
    assert tk.decode([4, 5]) == "ab ab"
    assert tk.decode([0, 4], skip_special_tokens=True) == "ab"   # control: special


def test_sentencepiece_bpe():
    tk = tokenizer_from_gguf({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "▁", "a", "b", "▁a", "▁ab"],
        "tokenizer.ggml.scores": [0.0, 0.0, -1.0, -2.0, -2.0, -0.5, -0.1],
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL] + [NORMAL] * 5})
    assert tk.encode("ab").ids == [6]                        # ▁ a b → ▁a b → ▁ab
    assert tk.encode("a b").ids == [5, 2, 4]                 # ▁a ▁ b
    assert tk.decode([6]) == "ab"                            # the prefix space stripped


@pytest.mark.parametrize("meta,message", [
    ({"tokenizer.ggml.model": "gpt2"}, "no tokenizer vocabulary"),
    (_gpt2(**{"tokenizer.ggml.token_type": [NORMAL]}), "7 tokens but 1 token types"),
    (_gpt2(**{"tokenizer.ggml.merges": []}), "has no merges"),
    (_gpt2(**{"tokenizer.ggml.pre": "nonesuch"}), "unsupported GGUF pre-tokenizer 'nonesuch'"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
      "tokenizer.ggml.scores": [0.0]}, "one score per token"),
])
def test_bad_metadata_is_refused(meta, message):
    with pytest.raises(KvrunError, match=message):
        tokenizer_from_gguf(meta)
