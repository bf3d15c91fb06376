"""The per-rank trace writer: captured batches -> Parquet parts + manifest.

The hot path (a forward hook) only enqueues a ``CaptureBatch`` (per-expert chunk
digests already on the host, or a CUDA event that says when they will be). A background
thread makes them fingerprints (``fingerprint.finalize``: one tensor digest per row), checks them
against the index when online verification is on, and writes

    OUT/<run_id>/rank=<label>/part-NNNNN.parquet   (TRACE_SCHEMA, one row per tensor)
    OUT/<run_id>/rank=<label>/_manifest.json        (rewritten after every part)
    OUT/<run_id>/rank=<label>/_dumps/*.safetensors (mismatching tensors, capped)

<label> is schema.rank_label: the TP rank, or e.g. "pp1-tp3" / "replica2-tp3" when
the server has pipeline stages or data-parallel replicas; the folder is claimed for
this process first (tracer.claim: a second process with the same label is refused).

Parts and manifests are written under a temporary dot-name and moved into
place. The queue is bounded in batches and bytes: when full, ``submit`` drops
the batch and counts its rows; it never blocks. Nothing here raises into the
caller after construction: failures are counted and recorded in the manifest.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

import pyarrow.parquet as pq
import torch

from moetrace import storage
from moetrace.errors import MoetraceError
from moetrace.fingerprint import finalize
from moetrace.schema import rank_label
from moetrace.tracer.batch import CaptureBatch, TraceRows, batch_rows
from moetrace.tracer.claim import claim_rank_dir
from moetrace.tracer.dumps import write_dump
from moetrace.tracer.manifest import MANIFEST_NAME, new_rank_manifest, rank_dir_name, utc_now
from moetrace.tracer.online import OnlineIndex
from moetrace.tracer.rank_record import RankRecord

log = logging.getLogger("moetrace.sink")

_TICK_S = 0.25  # writer wake-up period (control file, flush deadline)


class _Flush:
    def __init__(self):
        self.done = threading.Event()


class TraceSink(RankRecord):
    """Background Parquet writer of one rank. Thread-safe ``submit``/``close``; what the
    hooks count into its manifest goes through RankRecord."""

    def __init__(
        self,
        out: str,
        run_id: str,
        tp_rank: int,
        tp_size: int,
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        replica: int | None = None,
        rank_found_by: dict | None = None,
        config: dict | None = None,
        checkpoint_id: str | None = None,
        tp_rank_found_by: str = "config",
        rows_per_part: int = 65536,
        flush_interval_s: float = 5.0,
        queue_size: int = 1024,
        queue_max_bytes: int = 256 << 20,
        chunk_digests: str = "all",
        verifier: OnlineIndex | None = None,
        dump_max_count: int = 0,
        dump_max_bytes: int = 256 << 20,
        max_error_messages: int = 5,
        control_file: str | None = None,
        on_control: Callable[[], None] | None = None,
    ):
        self.fs, base = storage.open_fs(out)
        self.run_dir = storage.join(base, run_id)
        self.label = rank_label(tp_rank, pp_rank, pp_size, replica)
        self.rank_dir = storage.join(self.run_dir, rank_dir_name(tp_rank, pp_rank, pp_size, replica))
        for folder in (self.run_dir, self.rank_dir):  # a planted link would take the trace somewhere else
            if storage.is_link(self.fs, folder):
                raise MoetraceError(f"output {out}: {folder} is a symbolic link (to {os.readlink(folder)}); moetrace "
                                    "never writes a trace through a link: remove it or use a new run id")
        try:
            storage.make_dirs(self.fs, self.rank_dir)
        except Exception as err:
            raise MoetraceError(f"output {out}: cannot create {self.rank_dir} ({err})") from None
        RankRecord.__init__(self, new_rank_manifest(run_id, tp_rank, tp_size, config or {}, checkpoint_id,
                                                    tp_rank_found_by, pp_rank=pp_rank, pp_size=pp_size,
                                                    replica=replica, rank_found_by=rank_found_by),
                            max_error_messages)
        claim_rank_dir(self.fs, self.run_dir, self.rank_dir, self.label, run_id, self._m["started_at"],
                       self._m["run_nonce"])
        self.rows_per_part = int(rows_per_part)
        self.flush_interval_s = float(flush_interval_s)
        self.chunk_digests = chunk_digests
        self.verifier = verifier
        self.dump_max_count = int(dump_max_count)
        self.dump_max_bytes = int(dump_max_bytes)
        self.control_file = control_file
        self._on_control = on_control
        self._q: queue.Queue = queue.Queue(maxsize=int(queue_size))
        self._q_bytes = 0
        self._q_max_bytes = int(queue_max_bytes)
        self._rows = TraceRows()  # rows not yet in a part
        self._buffered_rows = 0
        self._next_part = 0
        self._dump_reserved = [0, 0]  # count, bytes promised to capture threads
        self._closing = threading.Event()
        self._closed = threading.Event()
        self._close_reason: str | None = None
        self._control_seen = False
        try:
            self._write_manifest()  # fails early when the output is unwritable
        except Exception as err:
            raise MoetraceError(f"output {out}: cannot write {self.rank_dir}/{MANIFEST_NAME} ({err})") from None
        self._thread = threading.Thread(target=self._run, name=f"moetrace-sink-{self.label}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def submit(self, batch: CaptureBatch) -> bool:
        """Enqueue without blocking; a full queue drops the batch (rows counted)."""
        n, nbytes = batch.n_rows, batch.host_bytes
        with self._lock:
            if self._closing.is_set():  # outside the trace window: not a loss inside it
                self._m["rows_after_close"] += n
                return False
            self._m["captures"] += 1
            self._m["rows_captured"] += n
            if self._q_bytes + nbytes > self._q_max_bytes and self._q_bytes > 0:
                self._drop_locked(n, "queue_full")
                return False
            try:
                self._q.put_nowait(batch)
            except queue.Full:
                self._drop_locked(n, "queue_full")
                return False
            self._q_bytes += nbytes
        return True

    def reserve_dump(self, nbytes: int) -> bool:
        """Capture side: may one more tensor of nbytes be dumped? (caps by count and bytes)"""
        with self._lock:
            count, used = self._dump_reserved
            if count >= self.dump_max_count or used + nbytes > self.dump_max_bytes:
                self._m["dumps"]["skipped"] += 1
                return False
            self._dump_reserved = [count + 1, used + nbytes]
            return True

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Write everything submitted so far as a part; True when done in time."""
        if self._closing.is_set() or not self._thread.is_alive():
            return self._closed.is_set()
        req = _Flush()
        try:
            self._q.put(req, timeout=timeout)
        except queue.Full:
            return False
        return req.done.wait(timeout)

    def close(self, reason: str = "close", timeout: float | None = 30.0, wait: bool = True) -> bool:
        """Drain, write the last part, mark the manifest finished. Idempotent."""
        with self._lock:
            if self._close_reason is None:
                self._close_reason = reason
            self._closing.set()
        try:
            self._q.put_nowait(None)  # wakes the writer now rather than at its next tick
        except queue.Full:
            pass
        if not wait:
            return self._closed.is_set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._closed.is_set() and not self._thread.is_alive():
            self._finish()  # the writer died: still say what we know
        return self._closed.is_set() and bool(self.manifest()["finished"])

    # ------------------------------------------------------------ writer side

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_interval_s
        while True:
            try:
                item = self._q.get(timeout=_TICK_S)
            except queue.Empty:
                item = None
            try:
                if isinstance(item, _Flush):
                    self._flush_part()
                    next_flush = time.monotonic() + self.flush_interval_s
                    item.done.set()
                elif item is not None:
                    with self._lock:
                        self._q_bytes -= item.host_bytes
                    self._consume(item)
                now = time.monotonic()
                if self._buffered_rows >= self.rows_per_part or (now >= next_flush and self._buffered_rows):
                    self._flush_part()
                    next_flush = now + self.flush_interval_s
                elif now >= next_flush:
                    if self._written_changes != self._changes:  # counters moved without rows
                        self._write_manifest_safely()
                    next_flush = now + self.flush_interval_s
                if self.control_file and not self._control_seen and os.path.exists(self.control_file):
                    self._control_seen = True
                    self.note(f"control file {self.control_file} appeared: closing")
                    with self._lock:
                        if self._close_reason is None:
                            self._close_reason = "control-file"
                    if self._on_control is not None:
                        self._on_control()
                    self._closing.set()
                if self._closing.is_set() and self._q.empty():
                    self._finish()
                    return
            except Exception as err:  # never let the writer die silently
                self.record_error("sink", f"writer: {type(err).__name__}: {err}")
                log.exception("moetrace: trace writer error")

    def _consume(self, b: CaptureBatch) -> None:
        try:
            fps = b.fps
            if fps is None:  # the hook left chunk digests: folded here, once their copy is done
                if b.ready is not None:
                    b.ready.synchronize()
                fps = finalize(b.chunks, b.nbytes)
                if b.on_folded is not None:  # the resident cache learns these weights' fingerprints
                    b.on_folded(fps)
            online = batch_rows(b, fps, self._m["run_id"], self.verifier, self.chunk_digests, self._rows)
            self._buffered_rows += b.n_rows
            with self._lock:
                for v in online:
                    key = "unchecked" if v is None else v
                    self._m["online"][key] += 1
            for expert, tensor, want, got in b.dumps:
                self._dump(b, expert, tensor, want, got)
        except Exception as err:
            self.drop(b.n_rows, "writer_error")
            self.record_error("sink", f"layer {b.layer} {b.tensor}: {type(err).__name__}: {err}")
        finally:
            b.chunks = None
            b.dumps = []

    def _dump(self, b: CaptureBatch, expert: int, tensor: torch.Tensor, want: bytes | None, got: bytes) -> None:
        try:
            rel, nbytes = write_dump(self.fs, self.rank_dir, self._m["run_id"], b, expert, tensor, want, got)
        except Exception as err:
            self.record_error("sink",
                              f"dump of layer {b.layer} expert {expert} {b.tensor}: {type(err).__name__}: {err}")
            return
        with self._lock:
            d = self._m["dumps"]
            d["count"] += 1
            d["bytes"] += nbytes
            d["files"].append(rel)

    def _flush_part(self) -> None:
        if not self._rows.rows:
            self._write_manifest_safely()
            return
        held, rows = self._rows, self._buffered_rows
        self._rows, self._buffered_rows = TraceRows(), 0
        name = f"part-{self._next_part:05d}.parquet"
        final = storage.join(self.rank_dir, name)
        tmp = storage.join(self.rank_dir, f".{name}.tmp")
        try:
            table = held.table()
            with self.fs.open_output_stream(tmp) as f:
                pq.write_table(table, f, compression="zstd")
            self.fs.move(tmp, final)
        except Exception as err:
            self.drop(rows, "write_failed")
            self.record_error("sink", f"writing {final}: {type(err).__name__}: {err}")
            try:
                self.fs.delete_file(tmp)
            except Exception:
                pass
        else:
            self._next_part += 1
            with self._lock:
                self._m["rows_written"] += rows
                self._m["parts"].append({"file": name, "rows": rows, "written_at": utc_now()})
        self._write_manifest_safely()

    def _finish(self) -> None:
        """Last part, then the manifest with finished: true (unless nothing could be written)."""
        if self._closed.is_set():
            return
        # Batches still queued (a close racing a submit) are written too.
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Flush):
                item.done.set()
            elif item is not None:
                with self._lock:
                    self._q_bytes -= item.host_bytes
                self._consume(item)
        self._flush_part()
        with self._lock:
            self._m["finished_at"] = utc_now()
            self._m["finished"] = True
            self._m["close_reason"] = self._close_reason or "close"
        try:
            self._write_manifest()
        except Exception as err:
            self.record_error("sink", f"final manifest: {type(err).__name__}: {err}")
        self._closed.set()

    def _write_manifest_safely(self) -> None:
        try:
            self._write_manifest()
        except Exception as err:
            self.record_error("sink", f"manifest: {type(err).__name__}: {err}")

    def _write_manifest(self) -> None:
        snap = self._snapshot()
        storage.write_json(self.fs, storage.join(self.rank_dir, MANIFEST_NAME), snap)
