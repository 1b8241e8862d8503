"""A tiny random-weight model directory for fast tests (no download, no conversion)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvrun.runtime.config import ModelConfig
from kvrun.runtime.model import Transformer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer() -> Tokenizer:
    """Specials 0..2, then the 256 byte-level symbols (ids 3..258), no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def make_tiny_model_dir(path: Path, architecture: str = "llama", seed: int = 0, **cfg_kw) -> Path:
    torch.manual_seed(seed)
    tok = byte_level_tokenizer()
    cfg = ModelConfig.tiny(architecture, vocab_size=tok.get_vocab_size(), bos_token_id=1,
                           eos_token_ids=[2], chat_template="chatml",
                           default_system="You are tiny.", **cfg_kw)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.15))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    tok.save(str(path / "tokenizer.json"))
    return path


@contextmanager
def interrupted_forward(m, at_call: int = 2):
    """Within the block, the model's attention call number `at_call` raises KeyboardInterrupt
    (Ctrl-C between two layers of a forward); the cache's own methods are restored after.
    Calls are counted over `attend` and `write_attend` (the arena's write-then-attend step,
    which the model uses instead on the torch and Triton backends)."""
    calls = {"n": 0}
    names = [n for n in ("attend", "write_attend") if hasattr(m.cache, n)]

    def flaky(real):
        def call(*args):
            calls["n"] += 1
            if calls["n"] == at_call:
                raise KeyboardInterrupt
            return real(*args)
        return call
    for name in names:
        setattr(m.cache, name, flaky(getattr(m.cache, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(m.cache, name)              # the class's methods again
