"""The one exception type for user-facing errors.

Anything the user can cause (a wrong path, a truncated file, an absurd flag, a prompt
longer than the context) raises `KvrunError` with a one-line message; the CLI prints
`error: <message>` and exits non-zero. Internal invariants use `assert`.
"""


class KvrunError(Exception):
    """A user-facing error with a one-line message."""


class PartialResults(KeyboardInterrupt):
    """Ctrl-C during a long evaluation (`kvrun ppl`, `kvrun needle`): still an interrupt,
    but it carries the records of the work finished so far (`done` of `total` units), so
    the CLI can print them instead of losing hours of measurements."""

    def __init__(self, records: list, done: int, total: int, unit: str = "windows"):
        super().__init__(f"interrupted after {done}/{total} {unit}")
        self.records, self.done, self.total, self.unit = records, done, total, unit


def read_text_file(path) -> str:
    """A UTF-8 text file's contents, or a KvrunError saying why it can't be read."""
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise KvrunError(f"{path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvrunError(f"{path}: not UTF-8 text") from None
