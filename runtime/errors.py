"""The one exception type for user-facing errors.

Anything the user can cause (a wrong path, a truncated file, an absurd flag, a prompt
longer than the context) raises `KvrunError` with a one-line message; the CLI prints
`error: <message>` and exits non-zero. Internal invariants use `assert`.
"""


class KvrunError(Exception):
    """A user-facing error with a one-line message."""


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
