"""The one exception type for user-facing errors.

Anything the user can cause (a wrong path, a truncated file, an absurd flag, a prompt
longer than the context) raises `KvrunError` with a one-line message; the CLI prints
`error: <message>` and exits non-zero. Internal invariants use `assert`.

SIGTERM and SIGHUP kill a process without running `finally` blocks; where a half-written
file could be left behind, `raise_on_signals` turns them into `Terminated` (a SystemExit)
so the cleanup runs, as it does for Ctrl-C.
"""
import signal
import threading
from contextlib import contextmanager


class KvrunError(Exception):
    """A user-facing error with a one-line message."""


class PartialResults(KeyboardInterrupt):
    """Ctrl-C during a long evaluation (`kvrun ppl`, `kvrun needle`): still an interrupt,
    but it carries the records of the work finished so far (`done` of `total` units), so
    the CLI can print them instead of losing hours of measurements."""

    def __init__(self, records: list, done: int, total: int, unit: str = "windows"):
        super().__init__(f"interrupted after {done}/{total} {unit}")
        self.records, self.done, self.total, self.unit = records, done, total, unit


class Terminated(SystemExit):
    """SIGTERM or SIGHUP received inside `raise_on_signals`; exit status 128 + signal number,
    what a shell reports for a process the signal killed."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextmanager
def raise_on_signals():
    """Within the block, SIGTERM and SIGHUP raise `Terminated` in the main thread instead of
    killing the process, so `finally` / `except BaseException` cleanups run. Only signals
    whose action is the default are taken over (an application's own handler stays), and
    nothing changes off the main thread (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = {}

    def handler(signum, frame):
        for s in taken:                 # a second signal must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)
    for s in _SIGNALS:
        if signal.getsignal(s) == signal.SIG_DFL:
            taken[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in taken.items():
            signal.signal(s, old)


def read_text_file(path) -> str:
    """A UTF-8 text file's contents (a regular file or a pipe such as `<(zcat f.gz)`), or a
    KvrunError saying why it can't be read."""
    from pathlib import Path
    if not str(path).strip():
        raise KvrunError("the text file name is empty")
    p = Path(path)
    if p.is_dir():
        raise KvrunError(f"{path}: is a directory, not a text file")
    if p.exists() and not (p.is_file() or p.is_fifo()):     # /dev/zero would never end
        raise KvrunError(f"{path}: not a regular file or a pipe")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvrunError(f"{path}: not UTF-8 text") from None
    except FileNotFoundError:
        raise KvrunError(f"{path}: no such file") from None
    except OSError as e:
        raise KvrunError(f"{path}: cannot read it ({e.strerror})") from None


def as_utf8(text: str, what: str, warn=None) -> str:
    """`text` (from argv, stdin or a terminal, which Python decodes with `surrogateescape`)
    with bytes that are not UTF-8 replaced by U+FFFD, as llama.cpp's tokenizer does; `warn`
    (when given) receives one line saying so. The tokenizer cannot encode the stand-in
    surrogates Python keeps for such bytes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    raw = bytearray()
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:           # surrogateescape's stand-in for byte o - 0xDC00
            raw.append(o - 0xDC00)
        elif 0xD800 <= o <= 0xDFFF:         # a lone surrogate typed as such (e.g. JSON \ud800)
            raw += "\ufffd".encode("utf-8")
        else:
            raw += ch.encode("utf-8")
    fixed = raw.decode("utf-8", "replace")
    if warn:
        warn(f"warning: {what} is not valid UTF-8; invalid bytes replaced with U+FFFD")
    return fixed
