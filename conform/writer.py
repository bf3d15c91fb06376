"""moetrace's writer: a stand-in for kt-kernel's ``write_weight_scale_to_buffer``.

In the fork, CPU experts live in kt-kernel on rank 0, and one native call
writes expert e's TP shard for EVERY rank into that rank's host slot, through
raw pointers (``submit_write_weight_scale_to_buffer(tp_size, expert_id, w13_ptrs,
w13_scale_ptrs, w2_ptrs, w2_scale_ptrs)``, one pointer per rank), asynchronously;
``sync_write_weight_scale_to_buffer()`` waits for it. Here one worker thread
(``NativeWriter``) does the ``memmove``s; ``KTWrapperStandIn`` is the per-layer
wrapper object with the fork's method names. kt-kernel keeps whole experts and
splits them per rank while writing; the stand-in keeps the per-rank shards
ready-made (the bytes written are the same) and writes them in kt-kernel's
order and granularity. conform uses it where kt-kernel's writer cannot run; the
emulator's own staging always does (with its injection's gate, emulator/writer.py).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from typing import Callable

import torch

from moetrace.schema import COPY_ORDERS


class WriterTimeout(RuntimeError):
    """The writer failed or did not finish in time."""


class NativeWriter:
    """A single background writer thread with submit/sync, shared by every layer's wrapper."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="native-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            raise WriterTimeout(f"rank 0: native writer failed: {self._error}")
        with self._cv:
            self._pending += 1
        self._q.put(job)

    def sync(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while self._pending:
                if self._error is not None:
                    raise WriterTimeout(f"rank 0: native writer failed: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WriterTimeout(f"rank 0: native write not finished after {self.timeout_s:g} s")
                self._cv.wait(min(left, 0.05))
            if self._error is not None:
                raise WriterTimeout(f"rank 0: native writer failed: {self._error}")

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as err:
                with self._cv:
                    self._error = err
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()


class KTWrapperStandIn:
    """Per-layer CPU-expert holder on rank 0 with kt-kernel's write API.

    One write follows what kt-kernel 0.7.2 does (observed by sampling its target
    buffers mid-write): weight rows in chunks, w13 then w2, every rank's chunk in
    turn, then each rank's scales. A copy that overlaps a write therefore sees a
    prefix of row chunks new and the scales old, as with the real writer.
    ``names``: the tensors in copy order (SharedFullContext.weight_names); BF16
    has no scales and gets zero scale pointers. ``index``/``control``/``gate``: the
    emulator's injection bookkeeping (emulator/writer.py), None in conform."""

    CHUNK_ROWS = 64

    def __init__(self, layer_idx: int, writer: NativeWriter, shards: list[dict[str, torch.Tensor]],
                 names=COPY_ORDERS["fp8_block"], index=None, control=None, gate=None):
        self.layer_idx = layer_idx
        self.writer = writer
        self.shards = shards  # per rank: name -> [E, ...] contiguous CPU tensor
        self.names = tuple(names)
        self.weights = tuple(n for n in self.names if "scale" not in n)  # INT4's: w13/w2_weight_packed
        self.scales = tuple(n for n in self.names if n not in self.weights)
        self.index = index
        self.control = control
        self.gate = gate

    def _pointers(self, tp_size: int, w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs) -> dict:
        given = dict(zip(self.weights, (w13_weight_ptrs, w2_weight_ptrs)))
        for n in self.scales:
            given[n] = w13_scale_ptrs if n.startswith("w13") else w2_scale_ptrs
        ptrs = {k: [int(p) for p in v] for k, v in given.items()}
        if any(len(v) != tp_size for v in ptrs.values()):
            raise ValueError(f"layer {self.layer_idx}: need {tp_size} pointers per tensor")
        return ptrs

    def _rows(self, dst: int, t: torch.Tensor, a: int, b: int) -> None:
        row = t[0].numel() * t.element_size()
        ctypes.memmove(dst + a * row, t.data_ptr() + a * row, (b - a) * row)

    def submit_write_weight_scale_to_buffer(self, tp_size: int, expert_id: int, w13_weight_ptrs, w13_scale_ptrs,
                                            w2_weight_ptrs, w2_scale_ptrs) -> None:
        ptrs = self._pointers(tp_size, w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs)

        def job() -> None:
            slots = []
            for rank in range(tp_size):
                slot = self.index.slot_of(self.names[0], rank, ptrs[self.names[0]][rank]) if self.index else None
                if self.gate is not None:
                    self.gate.wait_writable(rank, slot)
                slots.append(slot)
            for name in self.weights:
                rows = self.shards[0][name].shape[1]
                for a in range(0, rows, self.CHUNK_ROWS):
                    for rank in range(tp_size):
                        self._rows(ptrs[name][rank], self.shards[rank][name][expert_id], a,
                                   min(a + self.CHUNK_ROWS, rows))
            for rank in range(tp_size):
                for name in self.scales:
                    t = self.shards[rank][name][expert_id]
                    self._rows(ptrs[name][rank], t, 0, t.shape[0])
            if self.control is not None:
                for rank, slot in enumerate(slots):
                    self.control.gen[rank, slot] += 1  # single writer: plain increment is safe

        self.writer.submit(job)

    def sync_write_weight_scale_to_buffer(self) -> None:
        self.writer.sync()


def staged_shards(fmt: str, shards: list[dict]) -> list[dict]:
    """Every rank's shards as kt-kernel writes them into the host slots: the loaded layout,
    except INT4, which is staged in the checkpoint's [out, in] orientation (the fork
    transposes each expert after the copy)."""
    if fmt != "int4":
        return shards
    return [{k: v.transpose(-2, -1).contiguous() for k, v in s.items()} for s in shards]
