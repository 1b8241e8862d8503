"""Atomic writer for a kvrun model directory (config.json, model.safetensors, tokenizer.json).

Both converters end here. Everything is written into a temp dir beside the destination
(`.NAME.tmp-PID-XXXX`, same parent so the final `rename` stays on one filesystem and is
atomic), then renamed into place. A failure, Ctrl-C, SIGTERM or SIGHUP at any point removes
the temp dir, so a destination either holds a complete model or does not exist; the temp
dir of a conversion killed outright (kill -9, a power cut) is removed by the next
conversion to the same destination, once its PID no longer runs. An existing
destination is replaced (`overwrite`) only if it is a kvrun model directory
(`foreign_entries`), never the current or home directory: a mistyped `-o` costs an error
line, not a user's files. Before anything is written,
every tensor is checked against the shapes the config implies (`expected_shapes`), so a
model dir that `Transformer.load_weights` would reject is never produced.

Quantized models (`cfg.weights` int8 | int4) store each linear `X.weight` as `X.qweight` +
`X.scales` (+ `X.mins` for int4) and the embedding as int8 rows (runtime/model/qlinear.py has
the layout); norms and biases stay in `cfg.torch_dtype`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from kvrun.model.config import ModelConfig
from kvrun.errors import KvrunError, raise_on_signals
from kvrun.files import check_can_create_in, pid_running

from .quantize import is_quantized

Progress = Callable[[int, int, str], None]   # converters call it per tensor: (done, total, name)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' → torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KvrunError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})") from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `Transformer(cfg)` loads, by HF name → shape (lm_head absent when tied)."""
    return {k: shape for k, (shape, _) in expected_tensors(cfg).items()}


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name → (shape, dtype) of every stored tensor, in the config's weight format."""
    shapes = _float_shapes(cfg)
    if cfg.weights == "float":
        dt = torch_dtype(cfg.torch_dtype)
        return {k: (v, dt) for k, v in shapes.items()}
    from kvrun.model.qlinear import int4_group
    out = {}
    for name, shape in shapes.items():
        if len(shape) != 2 or not is_quantized(name):     # norms, biases, an MoE router
            out[name] = (shape, torch_dtype(cfg.torch_dtype))
            continue
        base, (N, K) = name[:-len(".weight")], shape
        # the embedding and lm_head are int8 rows in both formats (qlinear.Int8Embedding)
        if cfg.weights == "int8" or base in ("model.embed_tokens", "lm_head"):
            out[base + ".qweight"] = ((N, K), torch.int8)
            out[base + ".scales"] = ((N,), torch.float32)
            continue
        g = int4_group(K, cfg.weight_group)
        if not g:
            raise KvrunError(f"{name} has {K} columns, not a multiple of 32: it cannot be "
                             "stored as int4 (use --weights int8)")
        out[base + ".qweight"] = ((N, K // 2), torch.uint8)
        out[base + ".scales"] = ((N, K // g), torch.float16)
        out[base + ".mins"] = ((N, K // g), torch.float16)
    return out


def _float_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every float tensor `Transformer(cfg)` loads, name → shape (lm_head absent when tied):
    read off the model itself, built on the meta device, so each family's layer (its norms,
    biases, q/k norms) is described once, where it is defined."""
    import dataclasses

    from kvrun.model.llama import Transformer
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, weights="float", weight_group=0))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def validate_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Raise KvrunError unless `tensors` has exactly the names and shapes the config implies."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in tensors]
    if missing:
        raise KvrunError(f"checkpoint is missing {len(missing)} tensors the config needs "
                         f"(e.g. {missing[0]})")
    extra = [k for k in tensors if k not in want]
    if extra:
        raise KvrunError(f"checkpoint has {len(extra)} tensors kvrun does not use "
                         f"(e.g. {extra[0]}); unsupported model variant")
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise KvrunError(f"tensor {name} has shape {got}, the config implies {shape}")


MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def check_destination(dest: str | Path, overwrite: bool) -> Path:
    """The absolute destination path, or a KvrunError before any work if it cannot or must
    not be written.

    Never replaced, even with `overwrite`: an empty path, a symbolic link, the current
    directory, the home directory or any of their parents (an unset `$OUT` or `-o .` is a
    typo, not a wish), and a non-empty directory that is not a kvrun model directory
    (`foreign_entries`). The nearest existing ancestor must be a directory this process can
    create entries in (probed, so a read-only mount fails here and not after the conversion).
    """
    if not str(dest).strip():
        raise KvrunError("the output path is empty")
    dest = Path(os.path.abspath(os.path.expanduser(dest)))     # '..' and a trailing '/' folded
    if dest.is_symlink():
        raise KvrunError(f"{dest} is a symbolic link; name the directory itself")
    real = dest.resolve()
    for keep, what in ((Path.cwd().resolve(), "the current directory"),
                       (_home(), "the home directory")):
        if real == keep or real in keep.parents:
            raise KvrunError(f"{dest} is {what} or one of its parents; name a new directory")
    if dest.exists() and not dest.is_dir():
        raise KvrunError(f"{dest} exists and is not a directory")
    if dest.is_dir():
        try:
            names = sorted(os.listdir(dest))
        except OSError as e:
            raise KvrunError(f"{dest}: cannot list it ({e.strerror})") from None
        if names and not overwrite:
            raise DestinationNotEmpty(dest)
        why = foreign_entries(dest, names) if names else None
        if why:
            raise KvrunError(f"{dest} is not a kvrun model directory ({why}); refusing to "
                             f"replace it")
    _check_writable(dest.parent)
    return dest


class DestinationNotEmpty(KvrunError):
    """The output directory exists and holds files; `hint` names how to replace it in the
    caller's words (the library's `overwrite=True`; the CLI says `--force`)."""

    def __init__(self, dest: Path, hint: str = "overwrite=True replaces it"):
        super().__init__(f"{dest} already exists and is not empty ({hint})")
        self.dest = dest


def _home() -> Path:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError):            # no $HOME and no passwd entry
        return Path("/")


def foreign_entries(path: Path, names: list[str]) -> str | None:
    """Why the directory `path` (holding `names`) is not one this writer produced, or None.

    Its signature: nothing but MODEL_FILES, each a regular file (not a link), and a
    config.json that kvrun wrote (`"format": "kvrun"`). Only such a directory may be
    replaced: anything else may be a user's data.
    """
    extra = [n for n in names if n not in MODEL_FILES]
    if extra:
        return f"it holds {extra[0]!r}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
    for n in names:
        if not (path / n).is_file() or (path / n).is_symlink():
            return f"{n} is not a regular file"
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no config.json"
    except (OSError, ValueError):
        return "its config.json is unreadable or not JSON"
    if not isinstance(cfg, dict) or cfg.get("format") != "kvrun":
        return "its config.json was not written by kvrun"
    return None


def _check_writable(parent: Path) -> None:
    """Raise KvrunError unless entries can be created under `parent` (or the nearest of its
    ancestors that exists, where `atomic_dir` will create the rest)."""
    a = parent
    while not a.exists() and a != a.parent:
        a = a.parent
    if not a.is_dir():
        raise KvrunError(f"{a} is not a directory")
    check_can_create_in(a)


@contextmanager
def atomic_dir(dest: str | Path, overwrite: bool = False):
    """Yield a temp dir beside `dest`; on normal exit it becomes `dest`, on error, Ctrl-C,
    SIGTERM or SIGHUP it vanishes (`raise_on_signals`)."""
    dest = check_destination(dest, overwrite)
    with raise_on_signals():
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            sweep_stale(dest)
            tmp = _sibling(dest, "tmp")
            tmp.mkdir()                         # not mkdtemp: its 0700 mode would stick to dest
        except OSError as e:
            raise KvrunError(f"cannot create {dest}: {e.strerror}") from None
        try:
            yield tmp
            _replace(tmp, dest, overwrite)
        except BaseException:                   # KeyboardInterrupt too: leave nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _sibling(dest: Path, kind: str) -> Path:
    """An unused hidden name in dest's directory, e.g. `.smollm2.tmp-4242-3f9a0c1b` (the
    writer's PID: `sweep_stale` can tell a killed writer's from a running one's)."""
    while True:
        p = dest.parent / f".{dest.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        if not p.exists():
            return p


def sweep_stale(dest: Path) -> None:
    """Remove the temp dirs a killed conversion to `dest` left (a PID that no longer runs);
    a killed replacement's `.old-` dir only while `dest` exists (else it is the previous
    model's one copy, left for its owner). Symlinks and other names are never touched."""
    pat = re.compile(rf"^\.{re.escape(dest.name)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return
    for e in entries:
        m = pat.match(e.name)
        if m is None or pid_running(int(m[2])) or not e.is_dir(follow_symlinks=False):
            continue
        if m[1] == "tmp" or dest.is_dir():
            shutil.rmtree(e.path, ignore_errors=True)


def _replace(tmp: Path, dest: Path, overwrite: bool) -> None:
    check_destination(dest, overwrite)          # someone may have created it meanwhile
    try:
        if not dest.exists():
            os.rename(tmp, dest)
            return
        if not any(dest.iterdir()):             # an empty dir is replaced without ceremony
            dest.rmdir()
            os.rename(tmp, dest)
            return
        # Two renames: between them `dest` is briefly absent, but never half-written.
        old = _sibling(dest, "old")
        os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except BaseException:
            os.rename(old, dest)
            raise
    except OSError as e:                        # e.g. dest is a mount point (EBUSY)
        raise KvrunError(f"cannot replace {dest}: {e.strerror}") from None
    shutil.rmtree(old, ignore_errors=True)


def write_model_dir(dest: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                    tokenizer_json: str, overwrite: bool = False) -> Path:
    """Validate and atomically write config.json, model.safetensors and tokenizer.json.

    `tensors` must already be in the config's dtype; `tokenizer_json` is the serialized
    `tokenizers.Tokenizer` (`Tokenizer.to_str()` or the text of an HF tokenizer.json).
    """
    validate_tensors(cfg, tensors)
    want = expected_tensors(cfg)
    bad = [k for k, t in tensors.items() if t.dtype != want[k][1]]
    assert not bad, f"{bad[0]} is {tensors[bad[0]].dtype}, the format needs {want[bad[0]][1]}"
    with atomic_dir(dest, overwrite) as tmp:
        try:
            (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n",
                                             encoding="utf-8")
            (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
            save_file({k: t.contiguous() for k, t in tensors.items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:     # a full disk, a quota: say so, in one line
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            raise KvrunError(f"cannot write {dest}: {why or type(e).__name__}") from None
        # safetensors creates its file 0600; give it the umask-derived mode config.json got
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
    return Path(os.path.abspath(os.path.expanduser(dest)))
