"""Tokenizer wrapper over a `tokenizers` tokenizer.json, with streaming detokenization.

`StreamDecoder` turns token ids into text pieces as they are generated. Byte-level BPE
splits multi-byte UTF-8 characters across tokens, and SentencePiece tokenizers drop the
leading space of a lone token, so decoding token by token either prints broken
characters or eats spaces. The decoder re-decodes a short window of recent ids and emits
only the new suffix once it no longer ends in an incomplete character (U+FFFD).
"""
from __future__ import annotations

import threading
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from ..errors import KvrunError


class Tokenizer:
    def __init__(self, path: str | Path, bos_id: int | None = None, add_bos: bool = False):
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise KvrunError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self._added = {t.content: (i, t) for i, t in self.tok.get_added_tokens_decoder().items()}
        self._added_by_id = {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(self.tok.decoder, ByteLevelDecoder)
        # `encode_special_tokens` (special-token text read as text) is the tokenizer's state,
        # set per call: one encode at a time
        self._lock = threading.Lock()
        self._max_chars: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def max_token_chars(self) -> int:
        """Most characters one token stands for (its vocabulary entry's length: byte-level
        symbols are one byte each, so a token never covers more input characters)."""
        if self._max_chars is None:
            self._max_chars = max(map(len, self.tok.get_vocab(with_added_tokens=True)))
        return self._max_chars

    def max_text_chars(self, n_tokens: int) -> int:
        """More characters than this cannot tokenize into `n_tokens` tokens or fewer,
        whatever they are (4x max_token_chars: a normalizer may fold characters): text
        over it is too long for a context of `n_tokens` without tokenizing it."""
        return n_tokens * self.max_token_chars() * 4

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """Token ids for `text`; special tokens written in the text are recognized.
        `bos=None` follows the model's add_bos setting."""
        ids = self._encode(text, plain=False)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Token ids of a chat rendering (runtime/model/chat_template.py): a marker part is its
        added token's id; text parts are tokenized as plain text, so special-token text in a
        message stays text. A marker the vocabulary has no added token for is text too.
        Normal messages get the ids `encode` gives the rendered string: it also splits the
        text at the markers, and a marker's lstrip / rstrip eats the whitespace beside it."""
        ids: list[int] = []
        run, eat_left = "", False
        for text, marker in parts:
            hit = self._added.get(text) if marker else None
            if hit is None:
                run += text.lstrip() if eat_left and not run else text
                eat_left = eat_left and not run
                continue
            tid, tok = hit
            if tok.lstrip:
                run = run.rstrip()
            ids += self._encode(run, plain=True) if run else []
            ids.append(tid)
            run, eat_left = "", tok.rstrip
        return ids + (self._encode(run, plain=True) if run else [])

    def _encode(self, text: str, plain: bool) -> list[int]:
        with self._lock:
            self.tok.encode_special_tokens = plain
            return _ids(self.tok, text)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what a constrained-decoding library
        builds its view of the vocabulary from: runtime/engine/grammar.py)."""
        return self.tok.to_str()

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, alone (a byte-level token may hold part of a
        character, so this is not always valid UTF-8): an added token's text; a byte-level
        BPE symbol mapped back to its byte; a SentencePiece piece with "\u2581" as a space
        and "<0xHH>" as the byte HH."""
        hit = self._added_by_id.get(token_id)
        if hit is not None:
            return hit.encode()
        piece = self.tok.id_to_token(token_id) or ""
        if self._byte_level:
            if all(c in _UNBYTE for c in piece):
                return bytes(_UNBYTE[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def stream(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


LONG_TEXT = 1 << 14      # characters


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each
    byte -> that byte (printable Latin-1 bytes stand for themselves, the other 68 are
    shifted to U+0100..)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, shift = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + shift)] = b
            shift += 1
    return out


_UNBYTE = _byte_symbols()


def _ids(tok: HFTokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens added. A long text goes through
    `encode_batch`, which releases the GIL while it works (`encode` holds it: 4 s for 4 MB,
    during which no other Python thread runs, e.g. a server's event loop)."""
    if not text.isascii():
        # a lone surrogate ('\udce9' from a surrogateescape decode, or a JSON "\ud800")
        # is not text the Rust tokenizer accepts (TypeError): U+FFFD in its place, as a
        # non-UTF-8 byte is read elsewhere; a valid pair becomes its character
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if len(text) < LONG_TEXT:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the newly completed text ('' if none)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.t = tokenizer
        self.skip = skip_special
        self.ids: list[int] = []
        self.prefix = 0     # ids before this index are context only (already printed)
        self.read = 0       # ids before this index have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.t.decode(self.ids[self.prefix:], self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""                               # nothing new, or a partial character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still held back at the end of generation (a dangling partial byte)."""
        if self.read == len(self.ids):
            return ""
        before = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.t.decode(self.ids[self.prefix:], self.skip)
        self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""
