"""kvrun's environment settings: every KVRUN_* variable is read here and nowhere else.

One table says what each one does; the rest of the package asks the function of the same
name, which reads the variable when called (a cache, a model's decode step or the native
library reads it once, when it is built or loaded — the docstring of each caller says when).
Values are normalized (stripped, lower case where they are words); checking them against
their choices is the caller's, which knows the choices and says what is wrong in one line.

| variable | default | what it sets |
|---|---|---|
| KVRUN_HOME | ~/.cache/kvrun | models, the native build, chat history, caches |
| KVRUN_BACKEND | chosen per device | triton / native / torch for every op of a cache (kernels/dispatch.py `select`) |
| KVRUN_GEMV | int | the native decode step's GEMVs: int (int16 inputs) or fp32 (the reference) |
| KVRUN_ATTN | the build's | the native attention's KIVI / int8 products: int or fp32 (the reference) |
| KVRUN_NATIVE | 1 | 0 disables the native kernels; portable / clock load those builds |
| KVRUN_NATIVE_LIB | (build) | a shared object to load instead of building one |
| KVRUN_DEBUG | (unset) | say why the native kernels did not load |
| KVRUN_THREADS_ADAPT | 1 | 0 keeps exactly -t threads on a busy machine (runtime/threads.py) |
| KVRUN_CHAT_HISTORY | $KVRUN_HOME/chat_history | chat's readline history file; empty: in memory |
"""
from __future__ import annotations

import os
from pathlib import Path


def _word(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def home() -> Path:
    """$KVRUN_HOME, else ~/.cache/kvrun (not yet made absolute: files.kvrun_home does)."""
    return Path(os.environ.get("KVRUN_HOME") or Path.home() / ".cache" / "kvrun")


def backend() -> str:
    """KVRUN_BACKEND ('' when unset: the device's choice)."""
    return _word("KVRUN_BACKEND")


def gemv() -> str:
    """KVRUN_GEMV ('' when unset: int)."""
    return _word("KVRUN_GEMV")


def attn() -> str:
    """KVRUN_ATTN ('' when unset: the build's default)."""
    return _word("KVRUN_ATTN")


def native() -> str:
    """KVRUN_NATIVE: '1' (the default build), '0', 'portable' or 'clock'."""
    return _word("KVRUN_NATIVE") or "1"


def native_lib() -> str | None:
    """KVRUN_NATIVE_LIB, a shared object's path, or None."""
    return os.environ.get("KVRUN_NATIVE_LIB") or None


def debug() -> bool:
    """Whether KVRUN_DEBUG is set (non-empty)."""
    return bool(os.environ.get("KVRUN_DEBUG"))


def threads_adapt() -> bool:
    """KVRUN_THREADS_ADAPT: False only for '0'."""
    return os.environ.get("KVRUN_THREADS_ADAPT", "1").strip() != "0"


def chat_history() -> str | None:
    """KVRUN_CHAT_HISTORY as given (None when unset; '' means keep history in memory)."""
    return os.environ.get("KVRUN_CHAT_HISTORY")
