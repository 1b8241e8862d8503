"""Stop strings: end a generation when its text contains one of them (llama.cpp's
`--reverse-prompt` / the server's `stop`, mlx-lm's stop sequences).

The text is matched as it streams, so a stop string split across tokens ("Obs" + "erv" +
"ation:") is found too. A piece of text that could still be the start of a stop string is
held back until the next tokens show that it is not; on a match the text before the stop
string is emitted, the stop string itself never is, the underlying generator is closed (so
no further token is computed) and the stream ends with finish_reason "stop".
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from ..errors import KvrunError
from .generate import StreamEvent


def check_stops(stop: "str | Iterable[str] | None") -> list[str]:
    """The stop strings as a list (a single string is one stop string); an empty one is a
    user error, since it would match before the first token."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
    else:
        raise KvrunError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise KvrunError(f"stop strings must be str, got {type(s).__name__} {s!r}")
        if not s:
            raise KvrunError("empty stop string (a stop string needs at least one character)")
    return stops


class StopStrings:
    """Applies stop strings to a stream of StreamEvents. After the stream ends, `text` is all
    the text emitted and `matched` the stop string that ended it (None if none did)."""

    def __init__(self, stop: "str | Iterable[str] | None"):
        self.stops = check_stops(stop)
        self.text = ""
        self.matched: str | None = None
        self._pending = ""                  # push(): text received but not emitted yet

    def _held(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string:
        those characters may yet become a stop string and must not be emitted."""
        best = 0
        for s in self.stops:
            for j in range(min(len(s) - 1, len(pending)), best, -1):
                if pending.endswith(s[:j]):
                    best = j
                    break
        return best

    def _find(self, pending: str) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `pending`, if any."""
        hits = [(i, s) for s in self.stops if (i := pending.find(s)) >= 0]
        return min(hits, key=lambda h: h[0]) if hits else None

    def push(self, text: str, last: bool = False) -> tuple[str, bool]:
        """The push form of `apply`, for a caller that produces the text itself (a batch
        sequence, runtime/engine/batch.py): returns the text to emit now and whether a stop string
        matched (the generation then ends; the stop string and what follows are dropped).
        `last`: the generation ended on its own, nothing held back can become a stop now."""
        pending = self._pending + text
        hit = self._find(pending)
        if hit is not None:
            self.matched = hit[1]
            out, self._pending = pending[:hit[0]], ""
        else:
            n = len(pending) if last else len(pending) - self._held(pending)
            out, self._pending = pending[:n], pending[n:]
        self.text += out
        return out, hit is not None

    def apply(self, events: Iterator[StreamEvent]) -> Iterator[StreamEvent]:
        """`events` with stop strings applied. Every token event is passed on (its text may
        be held back, then it is ''); the last event carries the finish reason."""
        if not self.stops:
            for ev in events:
                self.text += ev.text
                yield ev
            return
        pending = ""                        # text received but not emitted yet
        try:
            for ev in events:
                pending += ev.text
                hit = self._find(pending)
                if hit is not None:
                    self.matched = hit[1]
                    self.text += pending[:hit[0]]
                    if ev.token_id is not None:
                        yield StreamEvent(pending[:hit[0]], ev.token_id, ev.timings, None)
                        yield StreamEvent("", None, ev.timings, "stop")
                    else:                   # the final event's flushed text held the stop
                        yield StreamEvent(pending[:hit[0]], None, ev.timings, "stop")
                    return
                if ev.finish_reason is not None:    # ended on its own: nothing is a stop now
                    out, pending = pending, ""
                else:
                    n = len(pending) - self._held(pending)
                    out, pending = pending[:n], pending[n:]
                self.text += out
                yield StreamEvent(out, ev.token_id, ev.timings, ev.finish_reason)
        finally:
            close = getattr(events, "close", None)
            if close is not None:           # stop generating: no token after the match
                close()


def with_stops(events: Iterator[StreamEvent], stop) -> Iterator[StreamEvent]:
    """`events` with the stop strings `stop` (None, a str or a list of str) applied."""
    stops = check_stops(stop)               # validated now, not at the first next()
    return StopStrings(stops).apply(events) if stops else events


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", "'": "'", '"': '"'}
_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)


def unescape(s: str) -> str:
    """Backslash escapes in a command-line stop string, as llama.cpp's --escape processes
    them (\\n \\r \\t \\\\ \\' \\" \\xHH): `--stop '\\n\\n'` is a blank line. Other
    backslashes are kept as typed."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if len(e) == 3:                     # xHH
            return chr(int(e[1:], 16))
        return _ESCAPES.get(e, m.group(0))
    return _ESCAPE_RE.sub(one, s)
