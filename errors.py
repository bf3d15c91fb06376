"""The one error type users see (a single line, a non-zero exit, no traceback) and the
exit codes every command makes (docs/analysis.md, "Exit codes")."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What a command's exit status says. 1 means "what was checked is wrong" and nothing
    else (audit, conform: a divergence; selftest, demo: a proof failed); anything moetrace
    could not tell, or any error, is 2."""

    PASS = 0
    DIVERGENT = 1
    INCOMPLETE = 2  # incomplete or unusable input, a refusal, any error (one line on stderr)
    REPORT_UNWRITTEN = 3  # the verdict was a pass but a report file could not be written
    INTERRUPTED = 130  # Ctrl-C

    @property
    def words(self) -> str:
        """The code in words, as `audit` ends: ``audit: exit 1 (divergence found)``."""
        return _WORDS[self]

    @property
    def label(self) -> str:
        """The verdict in one capitalized word, as conform's last line starts."""
        return _LABELS[self]


_WORDS = {ExitCode.PASS: "pass", ExitCode.DIVERGENT: "divergence found", ExitCode.INCOMPLETE: "incomplete",
          ExitCode.REPORT_UNWRITTEN: "pass, but a report was not written", ExitCode.INTERRUPTED: "interrupted"}
_LABELS = {ExitCode.PASS: "PASS", ExitCode.DIVERGENT: "DIVERGENT", ExitCode.INCOMPLETE: "INCOMPLETE",
           ExitCode.REPORT_UNWRITTEN: "PASS", ExitCode.INTERRUPTED: "INTERRUPTED"}


class MoetraceError(Exception):
    """Bad input or an impossible request. str(err) is the whole message: one line
    naming the file, tensor or option and what was expected."""

    exit_code = ExitCode.INCOMPLETE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code
