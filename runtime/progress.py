"""Progress display on stderr that reads well in both places it ends up.

On a terminal a long job redraws one status line in place (`\r`, erased to the end of the
line); in a log file or a CI capture, where `\r` leaves a wall of overwritten text, it
prints a plain line every ~10 % instead. Durations are printed as an ETA needs them.
"""
from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    """12 s, 4 min 05 s, 2 h 07 min: what an ETA needs, no more."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):        # no isatty, or a closed stream
        return False


class CountProgress:
    """`progress(done, total, name)` callback for jobs counted in items (tensors …).

    tty: one line redrawn in place, at most every 0.1 s, with the item's name; the final
    update ends the line. Otherwise: a line at each new tenth of the work, and the last.
    """

    def __init__(self, label: str, unit: str, stream=None, tty: bool | None = None):
        self.label, self.unit = label, unit
        self.stream = sys.stderr if stream is None else stream
        self.tty = _isatty(self.stream) if tty is None else tty
        self.t0 = time.perf_counter()
        self._shown_tenth = -1
        self._last_draw = 0.0

    def __call__(self, done: int, total: int, name: str = "") -> None:
        total = max(total, 1)
        pct = 100 * done // total
        elapsed = time.perf_counter() - self.t0
        head = f"{self.label} {done}/{total} {self.unit} ({pct}%), {format_duration(elapsed)}"
        if self.tty:
            now = time.perf_counter()
            if done < total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            # \x1b[K erases what a longer previous name left on the line
            self.stream.write(f"\r{head}{'  ' + name if name and done < total else ''}\x1b[K"
                              + ("\n" if done >= total else ""))
            self.stream.flush()
            return
        tenth = 10 * done // total
        if tenth != self._shown_tenth:
            self._shown_tenth = tenth
            print(head, file=self.stream, flush=True)
