"""Constrained decoding: output that must match a JSON schema, as a token mask applied before
sampling (runtime/engine/sampling.py), through llguidance (the optional extra `kvrun[server]`;
docs/serve.md says why this library).

Three objects, so that no state is shared between sequences:

    grammars = Grammars(tokenizer, vocab_size, stop_ids)   # one per model: the token trie
    g = grammars.json_schema({"type": "object"})           # compiled and checked; immutable
    state = g.start()                                      # one per sequence
    allowed = state.allowed()          # (V,) bool: the tokens that keep the output valid
    state.accept(token)                # after sampling one of them

A stop token (EOS) is allowed exactly when the output so far is a complete value, and once
the value cannot grow it is the only token allowed: a sequence that ends on a stop token
(greedy or sampled) parses. A sequence cut by max_tokens or a stop string may not.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import torch

from ..errors import KvrunError

try:
    import llguidance
except ImportError:                                 # the optional extra
    llguidance = None

INSTALL = "pip install 'kvrun[server]' (or llguidance)"

# Whitespace between JSON tokens, llama.cpp's rule: none, one space, or one or two newlines
# and an indent of at most 20. Unbounded whitespace (the library's default) lets a small
# model emit newlines until max_tokens (gemma-3-270m does, on {"type": "object"}). A
# schema's own "x-guidance" options take precedence (the library applies them after these).
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})?"}


class Grammars:
    """Compiles grammars for one tokenizer. The library's tokenizer (a token trie over the
    vocabulary, built from the tokenizer.json the model's `tokenizers` object holds) is built
    once, at the first compile: a few hundred ms for a 49k-token vocabulary, seconds for
    262k. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        if llguidance is None:
            raise KvrunError(f"structured output needs the llguidance library: {INSTALL}")
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.LLTokenizer(self.tokenizer.to_json(),
                                                      n_vocab=self.vocab_size,
                                                      eos_token=self.stop_ids)
                except Exception as e:          # noqa: BLE001 - the library's own error types
                    raise KvrunError(f"llguidance cannot read this model's tokenizer: "
                                     f"{_one_line(str(e))}") from None
            return self._ll

    def json_schema(self, schema: dict | str) -> "Grammar":
        """The grammar of JSON values that validate against `schema` (a JSON Schema, as a
        dict or its JSON text; {"type": "object"}: any JSON object). KvrunError saying why
        when the schema is not valid JSON, uses a keyword the library does not implement
        (`not`, unknown formats ...) or can match nothing (a `$ref` cycle)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise KvrunError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise KvrunError(f"a JSON schema is an object, got {type(schema).__name__}")
        tok = self._lltokenizer()
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            matcher = llguidance.LLMatcher(tok, text, log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise KvrunError(f"invalid JSON schema: {_one_line(str(e))}") from None
        if matcher.is_error():
            raise KvrunError(f"invalid JSON schema: {_one_line(matcher.get_error())}")
        # the library compiles some schemas no value can match (a $ref cycle with nothing
        # else in it) and fails at the first token: that is the schema's error, found here
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise KvrunError(f"invalid JSON schema: no JSON value matches it (a $ref cycle "
                             f"that never reaches a value?): {_one_line(probe.get_error())}")
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """A compiled grammar: immutable, shared by every sequence that uses it; `start()` gives
    each sequence its own state."""

    def __init__(self, matcher, vocab_size: int):
        self._initial = matcher                 # never advanced: only copied
        self.vocab_size = vocab_size

    def start(self) -> "GrammarState":
        return GrammarState(self._initial.deep_copy(), self.vocab_size)


class GrammarState:
    """One sequence's position in a grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens that may come next. KvrunError when none may (the
        library's resource limits were hit, or the state is broken)."""
        words = self.matcher.compute_bitmask()          # bit j of int32 word w: token 32 w + j
        if self.matcher.is_error():
            raise KvrunError(f"structured output failed: {_one_line(self.matcher.get_error())}")
        # the words as little-endian bytes: bit i of byte b is token 8 b + i. numpy unpacks
        # them in one pass on this thread; torch bit shifts over V elements may start a
        # parallel region, whose threads wait on a busy machine
        le = np.frombuffer(words, np.uint32).astype("<u4", copy=False).view(np.uint8)
        bits = np.unpackbits(le, bitorder="little")[:self.vocab_size]
        if not bits.any():
            raise KvrunError("structured output failed: the grammar allows no next token")
        return torch.from_numpy(bits.view(np.bool_))                            # (V,)

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one `allowed()` said may come)."""
        if not self.matcher.consume_token(token):
            raise KvrunError(f"structured output failed: token {token} rejected "
                             f"({_one_line(self.matcher.get_error())})")


def _one_line(msg: str) -> str:
    """The library's message on one line, without the parser state it may append."""
    return " ".join(msg.split("<state>")[0].split())[:300]
