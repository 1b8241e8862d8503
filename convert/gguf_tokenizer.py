"""Rebuild a `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

A GGUF carries no tokenizer.json, only llama.cpp's description of one (`tokenizer.ggml.*`):
the token strings, their types, merges (BPE) or scores (SentencePiece), and a named
pre-tokenizer. Two families are rebuilt here so that kvrun tokenizes like llama.cpp does:

- `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen2). Text is split by the regexes llama.cpp
  uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp, `llm_tokenizer_bpe`), applied one
  after another, each splitting the pieces of the previous one; then bytes are mapped to
  the GPT-2 alphabet and the merges applied.
- `llama`: SentencePiece BPE (Llama 2, TinyLlama, Mistral). llama.cpp merges the adjacent
  pair whose merged piece has the highest score; an ordinary BPE whose merge ranks follow
  that score reproduces it. Spaces become "▁", a "▁" is prepended to the text when
  `add_space_prefix` says so, and characters outside the vocabulary fall back to <0xXX>
  byte tokens.

Control and user-defined tokens (types 3 and 4, e.g. <|im_start|>) become added tokens, so
they are matched whole in text and never split.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvrun.errors import KvrunError

# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells the case-insensitive contractions out, `(?i:...)` being unportable.
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre → (regexes applied in order, ignore_merges). The grouping follows
# llama.cpp's name → LLAMA_VOCAB_PRE_TYPE_* mapping.
_PRE = {
    "default": (["[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False),
    **{name: ([_LLAMA3], True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                             "pixtral")},
    **{name: ([_LLAMA3], False) for name in ("dbrx", "smaug-bpe")},
    **{name: ([r"\p{N}", _GPT2], False) for name in ("smollm", "starcoder", "refact",
                                                      "command-r", "codeshell", "exaone")},
    **{name: ([_GPT2], False) for name in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2")},
    **{name: ([_QWEN2], False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """Build the tokenizer described by a GGUF's `tokenizer.ggml.*` metadata (a plain dict)."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise KvrunError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        return _byte_level_bpe(meta)
    if kind == "llama":
        return _sentencepiece_bpe(meta)
    raise KvrunError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")


def _token_types(meta: dict, n: int) -> list[int]:
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    if len(types) != n:
        raise KvrunError(f"GGUF tokenizer has {n} tokens but {len(types)} token types")
    return types


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control/unknown tokens as special, user-defined ones as plain added tokens.

    Both are matched whole in input text (llama.cpp does the same with parse_special);
    `special` only decides whether decode(skip_special_tokens=True) drops them.
    """
    out = []
    for tok, t in zip(tokens, types):
        if t in (CONTROL, UNKNOWN):
            out.append(AddedToken(tok, special=True, normalized=False))
        elif t == USER_DEFINED:
            out.append(AddedToken(tok, special=False, normalized=False))
    return out


def _register(tk: Tokenizer, added: list[AddedToken]) -> Tokenizer:
    special = [a for a in added if a.special]
    plain = [a for a in added if not a.special]
    if special:
        tk.add_special_tokens(special)
    if plain:
        tk.add_tokens(plain)
    return tk


def _byte_level_bpe(meta: dict) -> Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    pre = meta.get("tokenizer.ggml.pre") or "default"   # llama.cpp's fallback, too
    if pre not in _PRE:
        raise KvrunError(f"unsupported GGUF pre-tokenizer {pre!r} "
                         f"(supported: {', '.join(sorted(_PRE))})")
    regexes, ignore_merges = _PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if not merges:
        raise KvrunError("GGUF byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return _register(tk, _added_tokens(tokens, types))


def sentencepiece_merges(tokens: list[str], scores: list[float],
                         types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    Every normal token that splits into two vocabulary pieces yields a merge; merges are
    ranked by the merged token's score (highest first), ties by longer left, then longer
    right piece, then by the pieces' ids, so the order is deterministic.
    """
    ids = {tok: i for i, tok in enumerate(tokens)}
    found = []
    for tok, score, t in zip(tokens, scores, types):
        if t != NORMAL or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                found.append((-score, -len(left), -len(right), ids[left], ids[right], left, right))
    found.sort(key=lambda f: f[:5])
    return [(f[5], f[6]) for f in found]


def _sentencepiece_bpe(meta: dict) -> Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise KvrunError("GGUF SentencePiece tokenizer needs one score per token "
                         "(tokenizer.ggml.scores)")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))   # llama.cpp default
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores, types)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id],
                              fuse_unk=True, byte_fallback=True))
    # split=False: SentencePiece sees the whole text as one piece, spaces included.
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return _register(tk, _added_tokens(tokens, types))
