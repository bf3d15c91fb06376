"""The one error type users see: a single line, a non-zero exit, no traceback."""

from __future__ import annotations


class MoetraceError(Exception):
    """Bad input or an impossible request. str(err) is the whole message: one line
    naming the file, tensor or option and what was expected."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code
