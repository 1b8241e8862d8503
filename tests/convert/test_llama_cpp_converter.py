"""Each family's tiny checkpoint (test_families.py) through llama.cpp's OWN converter,
convert_hf_to_gguf.py as the llama-cpp-python source distribution ships it, then `kvrun
convert`: the logits over 64 tokens (a 40-token chunk, then single steps) equal
transformers' within fp32 rounding. test_families.py writes its GGUFs with gguf's writer in
llama.cpp's layout; this checks that layout against llama.cpp's own code.

The source distribution is fetched once with pip (PyPI, ~75 MB) into $KVRUN_HOME/peers and
only its converter and gguf-py are unpacked; where pip cannot reach PyPI the module is
skipped. Each checkpoint is written as llama.cpp represents the family: SmolLM3's NoPE on
every 4th of 4 layers, Qwen3-MoE with experts in every layer, Gemma 3's 5-of-6 sliding
layers with queries scaled by head_dim**-0.5 (test_families.GGUF_OVER). Its tokenizer is a
byte-level BPE trained to the checkpoint's vocabulary (llama.cpp's converter writes no merges
for a tokenizer without any, and trims Gemma's embedding to the tokenizer's size), plus a
SentencePiece model for Phi-3 and Gemma 2, whose converters read one; their pre-tokenizer's
hash is in no list of llama.cpp's, so the converter is told it is GPT-2's.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import kvrun
from kvrun.convert import convert_gguf
from kvrun.kv.build import build_cache
import test_families as F

SDIST = "llama-cpp-python==0.3.36"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
DRIVER = '''
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
'''


@pytest.fixture(scope="module")
def converter() -> Path:
    """llama.cpp's source tree (the converter's parts), unpacked once under $KVRUN_HOME. The
    pytest-xdist workers that need it take turns (a lock file beside it): the first fetches
    and unpacks it, the others then find it."""
    import fcntl
    from kvrun.files import kvrun_home
    peers = kvrun_home() / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    with open(peers / ".unpack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _unpacked(peers)


def _unpacked(peers: Path) -> Path:
    """The unpacked tree under `peers`, fetched and unpacked first if it is not there."""
    root = peers / SDIST.replace("==", "-")
    if not (root / "convert_hf_to_gguf.py").exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(peers), SDIST],
                           capture_output=True, text=True)
        found = sorted(peers.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode or not found:
            pytest.skip(f"pip could not fetch {SDIST}'s source: {r.stderr.strip()[-200:]}")
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        with tarfile.open(found[-1]) as tar:
            prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and any(m.name[len(prefix):].startswith(p) for p in PARTS)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(tmp, members=members, filter="data")
        os.replace(tmp, root)
    return root


def _tokenizers(d: Path, spm: bool) -> None:
    """A byte-level BPE of exactly the checkpoint's vocabulary (the module docstring), and for
    Phi-3 and Gemma 2 a SentencePiece BPE model with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    text = [" ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 7)))
                     for _ in range(12)) for _ in range(400)]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=F.VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1))
    assert tok.get_vocab_size() == F.VOCAB
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    if spm:
        import sentencepiece
        (d / "corpus.txt").write_text("\n".join(text * 5))
        sentencepiece.SentencePieceTrainer.train(
            input=str(d / "corpus.txt"), model_prefix=str(d / "tokenizer"), vocab_size=300,
            model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
            unk_id=0, pad_id=-1, minloglevel=2)


SPM = ("phi3", "phi4mini", "gemma2")         # families whose converter reads tokenizer.model
LLAMA_CPP = {"gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=64)}


@pytest.mark.parametrize("name", [n for n in F.FAMILIES if n in F.GGUF_FAMILIES or n in LLAMA_CPP
                                  or n == "mistral"])
def test_llama_cpp_converter_gguf_equals_transformers(converter, name, tmp_path, monkeypatch):
    if name in SPM:
        pytest.importorskip("sentencepiece")
    src, hf = F._checkpoint(tmp_path, name, **F.GGUF_OVER.get(name, {}), **LLAMA_CPP.get(name, {}))
    _tokenizers(src, spm=name in SPM)
    ids = torch.randint(3, F.VOCAB, (1, F.PROMPT + F.STEPS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    r = subprocess.run([sys.executable, "-c", DRIVER, str(converter), str(src), "--outtype", "f32",
                        "--outfile", str(tmp_path / "m.gguf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    convert_gguf(tmp_path / "m.gguf", tmp_path / "kv", dtype="fp32", weights="float")
    monkeypatch.setenv("KVRUN_ATTN", "fp32")
    m = kvrun.load(tmp_path / "kv", dtype="fp32", kv="fp32", ctx=F.CTX, cache_ram_mb=0)
    got = F._stepped(m.transformer, build_cache(m.cfg, F.CTX, "fp32"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name}: {s}")
