"""Planned shards (checkpoints.shard_plan) read and hashed where they lie.

A checkpoint's files are mapped read-only (``FileBytes``; where a file cannot be mapped,
its pieces are read with pread into one reused buffer). ``ChunkHasher`` streams a shard's
bytes into 64 KiB chunks: the whole chunks of a contiguous piece (gate and up rows, a
whole tensor) are hashed straight from the mapping, no copy; a column cut (w2, its block
scale) is gathered a group of rows at a time into a buffer small enough to stay in cache
(``GATHER_BYTES``) and its chunks hashed at once; a chunk that spans two pieces is gathered
too. Only where the bytes come from differs from the fingerprint's definition
(moetrace.fingerprint): the chunk digests are the same calls over the same bytes.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from moetrace import fingerprint as fpdef
from moetrace.checkpoints.shard_plan import Piece, ShardPlan
from moetrace.errors import MoetraceError

C = fpdef.CHUNK_BYTES
GATHER_BYTES = 256 << 10  # a group of gathered rows: hashed while it is still in L2


class FileBytes:
    """Read-only views of a checkpoint's files, opened on first use; close() unmaps them
    (their pages stay in the page cache, out of this process's resident set)."""

    def __init__(self):
        self._arrays: dict[Path, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []
        self._fds: dict[Path, int] = {}  # files read with pread (no mapping)
        self._buffer = np.empty(0, dtype=np.uint8)

    def region(self, path: Path, offset: int, length: int) -> np.ndarray:
        """uint8 view of bytes [offset, offset + length) of `path`. A mapped file's view
        stays valid until close(); a pread one until the next call."""
        if length <= 0:
            return np.empty(0, dtype=np.uint8)
        arr = self._arrays.get(path)
        if arr is None and path not in self._fds:
            arr = self._open(path)
        if arr is not None:
            if offset + length > len(arr):
                raise MoetraceError(f"{path}: file ends before the tensor's data (truncated?)")
            return arr[offset:offset + length]
        if len(self._buffer) < length:
            self._buffer = np.empty(length, dtype=np.uint8)
        view, done = memoryview(self._buffer)[:length], 0
        while done < length:
            n = os.preadv(self._fds[path], [view[done:]], offset + done)
            if n <= 0:
                raise MoetraceError(f"{path}: file ends before the tensor's data (truncated?)")
            done += n
        return self._buffer[:length]

    def _open(self, path: Path) -> np.ndarray | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise MoetraceError(f"{path}: cannot read ({err.strerror or err})") from None
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # not mappable (some FUSE and network file systems; empty files)
            self._fds[path] = fd
            return None
        os.close(fd)
        self._maps.append(m)
        arr = self._arrays[path] = np.frombuffer(m, dtype=np.uint8)
        return arr

    def close(self) -> None:
        self._arrays.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held: unmapped when it goes
                pass
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    __del__ = close


def _rows_view(files: FileBytes, p: Piece, r0: int, r1: int) -> np.ndarray:
    """Runs r0..r1 of a piece as a strided uint8 [r1 - r0, width] view of the file."""
    src = files.region(p.file, p.offset + r0 * p.stride, (r1 - r0 - 1) * p.stride + p.width)
    if r1 <= r0:
        return np.empty((0, p.width), dtype=np.uint8)
    return np.ndarray((r1 - r0, p.width), dtype=np.uint8, buffer=src, strides=(p.stride, 1))


def _fill_rows(dst: np.ndarray, src: np.ndarray, p: Piece) -> None:
    """dst uint8 [g, row_out] <- the runs src [g, width], cast to float32 when the piece
    says so, then the zeros. Both casts are exact: bf16 is float32's high half, and
    every float16 is a float32."""
    if p.cast is None:
        dst[:, :p.width] = src
        width = p.width
    else:
        width = p.row_out - p.pad
        out = dst[:, :width].view("<u4" if p.cast == "BF16" else "<f4")
        if p.cast == "BF16":
            out[...] = src.view("<u2")
            out <<= 16
        else:
            out[...] = src.view("<f2")
    if p.pad:
        dst[:, width:] = 0


class ChunkHasher:
    """Chunk digests of planned shards; one per process (its gather buffer is reused).
    `seconds` (this thread's CPU seconds, page faults included: a machine's other load does
    not count) and `nbytes` say where the time went: contiguous pieces hashed in place,
    column cuts gathered and hashed (and zeros)."""

    def __init__(self, gather_bytes: int = GATHER_BYTES):
        self._buf = np.empty(gather_bytes + C, dtype=np.uint8)
        self._view = memoryview(self._buf)
        self.seconds = {"in_place": 0.0, "column_cuts": 0.0}
        self.nbytes = {"in_place": 0, "column_cuts": 0}

    def digests(self, plan: ShardPlan, files: FileBytes) -> bytes:
        """The shard's chunk digests, concatenated (16 bytes per 64 KiB chunk)."""
        out: list[bytes] = []
        fill = 0  # bytes of the chunk being gathered, at the buffer's start
        for p in plan.pieces:
            t0 = time.thread_time()
            if p.file is not None and p.cast is None and (p.rows == 1 or (p.width == p.stride and not p.pad)):
                fill = self._in_place(files.region(p.file, p.offset, p.rows * p.width), fill, out)
                if p.pad:
                    fill = self._zeros(p.pad, fill, out)
                kind = "in_place"
            elif p.file is None:
                fill, kind = self._zeros(p.nbytes, fill, out), "column_cuts"
            else:
                fill, kind = self._gather(_rows_view(files, p, 0, p.rows), p, fill, out), "column_cuts"
            self.seconds[kind] += time.thread_time() - t0
            self.nbytes[kind] += p.nbytes
        if fill:
            out.append(fpdef.host_chunk_digests(self._view, 0, fill))
        return b"".join(out)

    def _in_place(self, span: np.ndarray, fill: int, out: list[bytes]) -> int:
        n, pos = len(span), 0
        if fill:  # complete the chunk begun by the previous piece
            pos = min(C - fill, n)
            self._buf[fill:fill + pos] = span[:pos]
            fill = self._flush(fill + pos, out)
            if fill:
                return fill
        whole = (n - pos) // C * C
        if whole:
            out.append(fpdef.host_chunk_digests(span.data, pos, pos + whole))
        rest = n - pos - whole
        self._buf[:rest] = span[n - rest:]
        return rest

    def _zeros(self, n: int, fill: int, out: list[bytes]) -> int:
        while n:
            take = min(len(self._buf) - fill, n)
            self._buf[fill:fill + take] = 0
            fill, n = self._flush(fill + take, out), n - take
        return fill

    def _gather(self, src: np.ndarray, p: Piece, fill: int, out: list[bytes]) -> int:
        row_out = p.row_out
        if len(self._buf) < row_out + C:  # a run wider than the buffer: grow it (scales, rarely)
            self._buf = np.concatenate([self._buf[:fill], np.empty(row_out + C - fill, dtype=np.uint8)])
            self._view = memoryview(self._buf)
        r = 0
        while r < p.rows:
            g = min(p.rows - r, (len(self._buf) - fill) // row_out)
            _fill_rows(self._buf[fill:fill + g * row_out].reshape(g, row_out), src[r:r + g], p)
            fill, r = self._flush(fill + g * row_out, out), r + g
        return fill

    def _flush(self, fill: int, out: list[bytes]) -> int:
        """Hash the buffer's whole chunks; move the rest (< 64 KiB) to its start."""
        whole = fill // C * C
        if whole:
            out.append(fpdef.host_chunk_digests(self._view, 0, whole))
            self._buf[:fill - whole] = self._buf[whole:fill]
        return fill - whole


def shard_bytes(plan: ShardPlan, files: FileBytes, start: int = 0, stop: int | None = None) -> bytes:
    """The shard's bytes [start, stop) (default: all), as the rank holds them."""
    stop = plan.nbytes if stop is None else min(stop, plan.nbytes)
    parts, pos = [], 0
    for p in plan.pieces:
        a, b = max(start, pos), min(stop, pos + p.nbytes)
        if a < b:
            r0, r1 = (a - pos) // p.row_out, -(-(b - pos) // p.row_out)
            rows = np.zeros((r1 - r0, p.row_out), dtype=np.uint8)
            if p.file is not None:
                _fill_rows(rows, _rows_view(files, p, r0, r1), p)
            lo = a - pos - r0 * p.row_out
            parts.append(rows.reshape(-1)[lo:lo + b - a].tobytes())
        pos += p.nbytes
    return b"".join(parts)
