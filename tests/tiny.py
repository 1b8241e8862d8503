"""A tiny random-weight model directory for fast tests (no download, no conversion)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvrun.model.config import ModelConfig
from kvrun.model.llama import Transformer


def tiny_config(architecture: str = "llama", **kw) -> ModelConfig:
    """A small random-weight configuration (GQA 4:2, two layers; gemma3: six layers, the
    last global, GQA 4:1)."""
    base = dict(architecture=architecture, vocab_size=256, hidden_size=64,
                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                max_position=512, rope_theta=10000.0, bos_token_id=1,
                eos_token_ids=[2], torch_dtype="fp32")
    if architecture == "gemma3":        # one KV head of D 32, a window of 16, global layer 6
        base.update(num_layers=6, num_kv_heads=1, head_dim=32, sliding_window=16,
                    rope_theta=1e6, rope_local_theta=10000.0, tie_word_embeddings=True,
                    rms_norm_eps=1e-6, chat_template="gemma")
    base.update(kw)
    return ModelConfig(**base)

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
    cfg = tiny_config(architecture, vocab_size=tok.get_vocab_size(), bos_token_id=1,
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


def write_tiny_hf(d: Path, C: int = 64, I: int = 96, n_layers: int = 2, bias: bool = False) -> Path:
    """An HF-layout llama (qwen2 with `bias`) folder of random weights: 4 heads of 16, 2 KV
    heads, ffn I; what `kvrun convert` quantizes in tests (int4 rows of C and I columns)."""
    d.mkdir(parents=True, exist_ok=True)
    tok = byte_level_tokenizer()
    V = tok.get_vocab_size()
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.15           # noqa: E731
    state = {"model.embed_tokens.weight": r(V, C) * 3, "model.norm.weight": 1 + r(C) * 0.5}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": r(C, C), p + "self_attn.k_proj.weight": r(C // 2, C),
                      p + "self_attn.v_proj.weight": r(C // 2, C), p + "self_attn.o_proj.weight": r(C, C),
                      p + "mlp.gate_proj.weight": r(I, C), p + "mlp.up_proj.weight": r(I, C),
                      p + "mlp.down_proj.weight": r(C, I),
                      p + "input_layernorm.weight": 1 + r(C) * 0.5,
                      p + "post_attention_layernorm.weight": 1 + r(C) * 0.5})
        if bias:
            state.update({p + f"self_attn.{n}_proj.bias": r(C if n == "q" else C // 2)
                          for n in "qkv"})
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"], "hidden_size": C,
        "intermediate_size": I, "num_hidden_layers": n_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": V, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}))
    tok.save(str(d / "tokenizer.json"))
    return d


@contextmanager
def interrupted_forward(m, at_call: int = 2):
    """Within the block, the model's attention call number `at_call` raises KeyboardInterrupt
    (Ctrl-C between two layers of a forward); the cache's own methods are restored after.
    Calls are counted over `attend_new` (the model's entry, whichever route it takes) and
    `attend` (the native chunk step's)."""
    calls = {"n": 0}
    names = [n for n in ("attend", "attend_new") if hasattr(m.cache, n)]

    def flaky(real):
        def call(*args):
            if calls.get("inside"):             # attend_new's own attend: one call, not two
                return real(*args)
            calls["n"] += 1
            if calls["n"] == at_call:
                raise KeyboardInterrupt
            calls["inside"] = True
            try:
                return real(*args)
            finally:
                calls["inside"] = False
        return call
    for name in names:
        setattr(m.cache, name, flaky(getattr(m.cache, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(m.cache, name)              # the class's methods again


def quantized_copy(src, dest, weights: str, group: int = 32):
    """A kvrun model dir with its linear weights (and embedding) stored as `weights`, the
    way `kvrun convert --weights` stores them (convert.quantize)."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from kvrun.convert.quantize import quantize
    from kvrun.convert.writer import expected_tensors, write_model_dir
    from kvrun.model.loader import load_config
    cfg = replace(load_config(src), weights=weights, weight_group=group)
    want = expected_tensors(cfg)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and name[:-len(".weight")] + ".qweight" in want:
            out.update(quantize(name, w, weights, group))
        else:
            out[name] = w.float()
    return write_model_dir(dest, cfg, out, (src / "tokenizer.json").read_text())


# the native decode step's test geometries: odd sizes, several layers; Gemma's 7 layers put
# the 6th global (rings before and after it), GQA 3:1 over 2 KV heads, a window of 23 (odd:
# the filled-slot count takes odd and even values)
NATIVE_LLAMA = dict(hidden_size=128, num_layers=3, intermediate_size=96)
NATIVE_GEMMA = dict(architecture="gemma3", hidden_size=128, num_layers=7, num_heads=6,
                    num_kv_heads=2, sliding_window=23, intermediate_size=96)


def load_quantized_tiny(root: Path, weights: str = "int4", ctx: int = 256, **cfg_kw):
    """The tiny model of `cfg_kw` (make_tiny_model_dir's keywords) with `weights` linear
    layers (quantized_copy), loaded: the native decode step's models."""
    import kvrun
    src = make_tiny_model_dir(root / "m", **cfg_kw)
    return kvrun.load(quantized_copy(src, root / "q", weights), ctx=ctx)
