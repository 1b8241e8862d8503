"""Ctrl-C while a module is being imported is held until the import ends.

A KeyboardInterrupt raised in the middle of an import leaves the module half-initialised:
a C extension such as numpy's cannot be loaded again in the process ("cannot load module
more than once per process"), and a library that imports an optional dependency under
`except ImportError` may swallow the interrupt with it (the command then ran on as if no
Ctrl-C came). `install()` replaces Python's default SIGINT handler by one that raises
KeyboardInterrupt as the default does, except while the main thread is inside an import:
then a watcher thread waits for the import to end and re-delivers the interrupt
(`_thread.interrupt_main`), so it arrives where the command's handlers turn it into
"interrupted" and exit status 130. Stdlib only: it is installed before the CLI is imported.
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading
import time

_BOOTSTRAP = ("<frozen importlib._bootstrap", "<frozen importlib._bootstrap_external")
_POLL = 0.02                    # seconds between the watcher's looks at the main thread
_pending = threading.Event()


def importing(frame) -> bool:
    """Whether the stack ending at `frame` is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_BOOTSTRAP):
            return True
        frame = frame.f_back
    return False


def _handler(signum, frame):
    if _pending.is_set():                       # the watcher re-delivers it, or a second one
        _pending.clear()
        raise KeyboardInterrupt
    if not importing(frame):
        raise KeyboardInterrupt
    _pending.set()
    threading.Thread(target=_redeliver, args=(threading.main_thread().ident,),
                     name="kvrun-interrupt", daemon=True).start()


def _redeliver(main_id: int) -> None:
    while _pending.is_set() and importing(sys._current_frames().get(main_id)):
        time.sleep(_POLL)
    if _pending.is_set():
        _thread.interrupt_main()


def install() -> None:
    """Take over SIGINT from Python's default handler (a handler someone set stays)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)
