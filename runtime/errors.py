"""The one exception type for user-facing errors.

Anything the user can cause (a wrong path, a truncated file, an absurd flag, a prompt
longer than the context) raises `KvrunError` with a one-line message; the CLI prints
`error: <message>` and exits non-zero. Internal invariants use `assert`.
"""


class KvrunError(Exception):
    """A user-facing error with a one-line message."""
