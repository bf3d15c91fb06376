"""Progress on stderr for the steps of a job that take seconds: one live line per
step (its label and the seconds so far), a bar where the total is known.

Only on a terminal: with --json, or when stderr is a pipe or a file, nothing is
written (``Progress.off()``). A live line is transient: it is erased when its step
ends, so what stays on the screen is the command's own output.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

TICK_S = 0.5  # how often a live line is redrawn
CLEAR = "\r\x1b[K"  # back to the start of the line, erase it
BAR_WIDTH = 20


class Progress:
    """``enabled=None``: on when ``stream`` (default stderr) is a terminal."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._lock = threading.Lock()
        self._stack: list[Live] = []

    @classmethod
    def off(cls) -> "Progress":
        return cls(enabled=False)

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator["Live"]:
        """A live line ``label ... 3 s`` while the block runs."""
        with self._live(Live(label)) as live:
            yield live

    @contextlib.contextmanager
    def bar(self, label: str, total: int) -> Iterator["Live"]:
        """A live bar ``label [#####     ] 2/4 12 s``; ``live.advance()`` after each item."""
        with self._live(Live(label, total)) as live:
            yield live

    @contextlib.contextmanager
    def _live(self, live: "Live") -> Iterator["Live"]:
        if not self.enabled:
            yield live
            return
        # A step inside a step (the selftest's detector runs the demo's steps) shows on
        # the same line, after its parent's label; one thread redraws it.
        outer = not self._stack
        self._stack.append(live)
        stop = threading.Event()
        thread = None
        if outer:
            def tick():
                while not stop.wait(TICK_S):
                    self._draw(self._line())

            thread = threading.Thread(target=tick, name="moetrace-progress", daemon=True)
            thread.start()
        self._draw(self._line())
        try:
            yield live
        finally:
            self._stack.remove(live)
            if thread is not None:
                stop.set()
                thread.join()
            self._draw(self._line() if self._stack else None)

    def above(self, message: str, echo: Callable[[str], None]) -> None:
        """Print a line of the command's own (``echo``) above the live line: the live line
        is cleared first and drawn again after, so the two never share a row."""
        if not self.enabled or not self._stack:
            echo(message)
            return
        self._draw(None)
        echo(message)
        self._draw(self._line())

    def _line(self) -> str:
        stack = list(self._stack)
        return ": ".join([s.label for s in stack[:-1]] + [stack[-1].line()]) if stack else ""

    def _draw(self, text: str | None) -> None:
        with self._lock:
            if not self.enabled:
                return
            try:
                self.stream.write(CLEAR + (text or ""))
                self.stream.flush()
            except (OSError, ValueError):  # a closed terminal never stops the job
                self.enabled = False

class Live:
    """What a live line shows: the label, the count of a bar, the seconds so far."""

    def __init__(self, label: str, total: int | None = None):
        self.label, self.total, self.done = label, total, 0
        self.t0 = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n

    def relabel(self, label: str) -> None:
        self.label = label

    def line(self) -> str:
        seconds = f"{time.monotonic() - self.t0:.0f} s"
        if self.total is None:
            return f"{self.label} ... {seconds}"
        filled = BAR_WIDTH * min(self.done, self.total) // max(self.total, 1)
        return f"{self.label} [{'#' * filled}{' ' * (BAR_WIDTH - filled)}] {self.done}/{self.total} {seconds}"
