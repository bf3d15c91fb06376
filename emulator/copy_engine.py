"""The asynchronous copy path of one rank: the fork's ``copy_stream`` plus events.

On CUDA a worker thread issues ``dst.copy_(src, non_blocking=True)`` on a
dedicated copy stream (from pinned host slots) and records ``torch.cuda.Event``
objects there. On CPU the same worker thread performs the copies itself, in
order. Either way ``copy()`` and ``record()`` return at once, like
``copy_stream`` work issued from Python, and ``CopyEvent.synchronize()`` blocks
until every copy issued before the record has completed.

The slow-peer injection (``Hold``) may park one copy: it does not block the
copies behind it (as a lagging DMA would not stop the next ones being issued)
but every event recorded after it waits for it, so the stream's ordering
guarantee to waiters holds. Every wait is bounded: a timeout raises
``StagingTimeout`` naming the rank, what was awaited and what is still held.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


class StagingTimeout(RuntimeError):
    """A bounded wait of the staging transport expired (deadlock or stall)."""


@dataclass
class _Op:
    seq: int
    kind: str  # "copy" | "call" | "record"
    dst: torch.Tensor | None = None
    src: torch.Tensor | None = None
    fn: Callable[[], None] | None = None
    label: str = ""
    hold: object = None  # injection tag when this copy is held
    after: Callable[[], None] | None = None  # run once the copy completed (injection bookkeeping)
    event: "CopyEvent | None" = None
    parked_at: float = 0.0


@dataclass
class CopyEvent:
    """Completes when every copy issued before its record() has completed."""

    engine: "CopyEngine"
    seq: int
    what: str
    cuda_event: object = None
    recorded: threading.Event = field(default_factory=threading.Event)

    def query(self) -> bool:
        if not self.engine._done_through(self.seq):
            return False
        return self.cuda_event is None or self.cuda_event.query()

    def synchronize(self) -> None:
        self.engine._wait_through(self.seq, self.what)
        if self.cuda_event is not None:
            self.cuda_event.synchronize()


class CopyEngine:
    """One worker thread per rank standing in for ``copy_stream``."""

    POLL_S = 0.0005  # while a copy is parked

    def __init__(self, rank: int, device: torch.device, timeout_s: float, hold=None):
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self.hold = hold  # Hold or None
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.slow_stream = torch.cuda.Stream(device=device) if self.cuda and hold is not None else None
        self._q: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._incomplete: set[int] = set()
        self._next = 0
        self._parked: list[_Op] = []
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"copy-engine-r{rank}", daemon=True)
        self._thread.start()

    # -- issuing (main thread) ----------------------------------------------------
    def _issue(self, op_kind: str, **kw) -> _Op:
        self._raise_if_failed()
        with self._cv:
            op = _Op(seq=self._next, kind=op_kind, **kw)
            self._next += 1
            self._incomplete.add(op.seq)
        self._q.put(op)
        return op

    def copy(self, dst: torch.Tensor, src: torch.Tensor, label: str = "", hold=None, after=None) -> None:
        """Queue ``dst.copy_(src)``. ``hold``: the injection's tag, when this copy is the held one."""
        self._issue("copy", dst=dst, src=src, label=label, hold=hold, after=after)

    def call(self, fn: Callable[[], None], label: str = "") -> None:
        """Queue ``fn`` behind the copies issued so far (not behind parked ones)."""
        self._issue("call", fn=fn, label=label)

    def record(self, what: str) -> CopyEvent:
        if not self.cuda:
            with self._cv:
                ev = CopyEvent(self, self._next, what)
            ev.recorded.set()
            return ev
        # Recorded on the copy stream by the worker, in issue order; waiting
        # through the record op itself guarantees the event was recorded.
        ev = CopyEvent(self, -1, what, cuda_event=torch.cuda.Event())
        op = self._issue("record", event=ev, label=what)
        ev.seq = op.seq + 1
        return ev

    def synchronize(self, what: str = "all copies") -> None:
        """Wait for everything issued so far (the fork's torch.cuda.synchronize())."""
        self.record(what).synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout=5)

    # -- waiting --------------------------------------------------------------------
    def _done_through(self, seq: int) -> bool:
        with self._cv:
            return not self._incomplete or min(self._incomplete) >= seq

    def _wait_through(self, seq: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while self._incomplete and min(self._incomplete) < seq:
                if self._error is not None:
                    raise StagingTimeout(f"rank {self.rank}: copy engine failed while waiting for {what}: "
                                         f"{self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(
                        f"rank {self.rank}: {what} not complete after {self.timeout_s:g} s; "
                        f"{len(self._incomplete)} copies pending, held: {self._describe_parked() or 'none'}"
                    )
                self._cv.wait(min(left, 0.05))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StagingTimeout(f"rank {self.rank}: copy engine failed: {self._error}")

    def _describe_parked(self) -> str:
        return "; ".join(f"{op.label} ({self.hold.describe(op.hold)})" for op in list(self._parked))

    # -- worker -----------------------------------------------------------------------
    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            try:
                op = self._q.get(timeout=self.POLL_S if self._parked else 0.05)
            except queue.Empty:
                op = False
            if op is None:
                return
            try:
                if op is not False:
                    if op.kind == "copy" and op.hold is not None:
                        op.parked_at = time.monotonic()
                        self._parked.append(op)
                    else:
                        self._execute(op, self.stream)
                        self._complete(op)
                self._release_parked()
            except BaseException as err:  # surfaced to the waiting main thread
                with self._cv:
                    self._error = err
                    self._cv.notify_all()
                return

    def _release_parked(self) -> None:
        for op in list(self._parked):
            if self.hold.released(op.hold):
                self._parked.remove(op)
                self._execute(op, self.slow_stream)
                if self.cuda:  # completion is what the injection's bookkeeping needs
                    self.slow_stream.synchronize()
                self._complete(op)
            elif time.monotonic() - op.parked_at > self.timeout_s:
                raise StagingTimeout(
                    f"held copy {op.label} was never released within {self.timeout_s:g} s "
                    f"({self.hold.describe(op.hold)})"
                )

    def _execute(self, op: _Op, stream) -> None:
        if op.kind == "copy":
            if self.cuda:
                with torch.cuda.stream(stream):
                    op.dst.copy_(op.src, non_blocking=True)
                if op.after is not None:  # bookkeeping needs the copy done, not merely issued
                    stream.synchronize()
            else:
                op.dst.copy_(op.src)
            if op.after is not None:
                op.after()
        elif op.kind == "call":
            if self.cuda:
                self.stream.synchronize()
            op.fn()
        elif op.kind == "record":
            op.event.cuda_event.record(self.stream)
            op.event.recorded.set()
        op.dst = op.src = None  # drop references to the host slots

    def _complete(self, op: _Op) -> None:
        with self._cv:
            self._incomplete.discard(op.seq)
            self._cv.notify_all()
