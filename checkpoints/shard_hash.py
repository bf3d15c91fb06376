"""Planned shards (checkpoints.shard_plan) read and hashed.

``ChunkHasher`` streams a shard's bytes into 64 KiB chunks. A contiguous piece (gate and
up rows, a whole tensor) has its whole chunks hashed straight from a read-only mapping of
the file where the kernel maps its page cache in 2 MiB entries, and is otherwise read a
block at a time (``READ_BYTES``) with pread into one reused buffer and hashed there
(``FileBytes.mapping_pays`` probes which, once per file: a 4 KiB page mapped costs a
page-table entry set up, walked and torn down, more than pread's copy of it). A column
cut (w2, its block scale) is read once for every rank: rows copied into a staging buffer
with pread (``STAGE_BYTES`` at a time, ``ChunkHasher.digests_of``), each rank's cut
gathered from there a group of rows at a time into a buffer small enough to stay in cache
(``GATHER_BYTES``) and its chunks hashed at once; a chunk that spans two pieces is
gathered too. Pieces cast to float32 (BF16 and FP16 scales: a few rows) are read through
a mapping (``FileBytes.region``). Only where the bytes come from differs from the
fingerprint's definition (moetrace.fingerprint): the chunk digests are the same calls
over the same bytes.
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
STAGE_BYTES = 512 << 10  # rows read once for every rank's column cut of them
READ_BYTES = 1 << 20  # a contiguous piece is read this much at a time (whole chunks: hashed where they land)


# Whether a file's page cache maps in 2 MiB entries (mapping_pays), per (path, size, mtime):
# the answer of this process's first probe of it (it changes only what is fastest).
_PAYS: dict[tuple, bool] = {}
PROBES = 4  # points of a file touched through a mapping to ask how its page cache maps
SMAPS = "/proc/self/smaps_rollup"


class FileBytes:
    """A checkpoint's files, opened on first use. ``read_into`` copies bytes into a buffer
    of the caller's with pread; ``region`` gives a read-only mapped view (a file that
    cannot be mapped: pread into one reused buffer); ``mapping_pays`` says which of the two
    hashes a file's contiguous pieces faster. close() unmaps and closes (the pages stay in
    the page cache)."""

    def __init__(self):
        self._arrays: dict[Path, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []
        self._fds: dict[Path, int] = {}
        self._unmappable: set[Path] = set()
        self._pays: dict[Path, bool] = {}  # mapping_pays' answers, without a stat per piece
        self._buffer = np.empty(0, dtype=np.uint8)

    def read_into(self, path: Path, offset: int, out: np.ndarray) -> np.ndarray:
        """Bytes [offset, offset + len(out)) of `path` copied into the uint8 array `out`; returns it."""
        fd, view, done, length = self._fd(path), memoryview(out), 0, len(out)
        while done < length:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as err:
                raise MoetraceError(f"{path}: cannot read ({err.strerror or err})") from None
            if n <= 0:
                raise MoetraceError(f"{path}: file ends before the tensor's data (truncated?)")
            done += n
        return out

    def mapping_pays(self, path: Path) -> bool:
        """Whether to hash this file's pieces through a mapping rather than read them. Where
        the kernel holds its page cache in 2 MiB folios (large-folio file systems, recent
        kernels) a mapping takes one page-table entry per 2 MiB and beats pread's copy
        (1.2 GB hashed in 0.063 s against 0.088 s, measured: docs/benchmarks.md); where it
        holds 4 KiB pages, each costs an entry set up, walked and torn down, and pread wins
        (0.130 against 0.169 s). Asked once per file and process: PROBES points of it are
        touched through a mapping and the process's FilePmdMapped must grow by 2 MiB for
        at least half of them. Without /proc (or a mapping): read."""
        if path in self._pays:
            return self._pays[path]
        try:
            st = os.fstat(self._fd(path))
        except MoetraceError:
            return False
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in _PAYS:
            _PAYS[key] = self._probe(path, st.st_size)
        self._pays[path] = _PAYS[key]
        return _PAYS[key]

    def _probe(self, path: Path, size: int) -> bool:
        huge = 2 << 20
        if size < huge:
            return False
        points = sorted({(size * k // (PROBES + 1)) // huge * huge for k in range(1, PROBES + 1)})
        before = _pmd_mapped_kib()
        if before is None or path in self._unmappable:
            return False
        arr = self._arrays.get(path)
        if arr is None and (arr := self._map(path)) is None:
            return False
        for p in points:  # one byte each: its fault maps the folio around it
            arr[p]
        after = _pmd_mapped_kib()
        return after is not None and (after - before) * 1024 >= huge * -(-len(points) // 2)

    def region(self, path: Path, offset: int, length: int) -> np.ndarray:
        """uint8 view of bytes [offset, offset + length) of `path`. A mapped file's view
        stays valid until close(); a pread one until the next call."""
        if length <= 0:
            return np.empty(0, dtype=np.uint8)
        arr = self._arrays.get(path)
        if arr is None and path not in self._unmappable:
            arr = self._map(path)
        if arr is not None:
            if offset + length > len(arr):
                raise MoetraceError(f"{path}: file ends before the tensor's data (truncated?)")
            return arr[offset:offset + length]
        if len(self._buffer) < length:
            self._buffer = np.empty(length, dtype=np.uint8)
        return self.read_into(path, offset, self._buffer[:length])

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise MoetraceError(f"{path}: cannot read ({err.strerror or err})") from None
        return fd

    def _map(self, path: Path) -> np.ndarray | None:
        fd = self._fd(path)
        try:
            m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # not mappable (some FUSE and network file systems; empty files)
            self._unmappable.add(path)
            return None
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


def _pmd_mapped_kib() -> int | None:
    """File pages this process maps in 2 MiB entries, KiB (None: the kernel does not say)."""
    try:
        with open(SMAPS) as fh:
            for line in fh:
                if line.startswith("FilePmdMapped:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


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


class _Stream:
    """One shard's digests being made: its gather buffer (the chunk begun so far at its
    start, `fill` bytes) and the digests of its whole chunks."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.view, self.fill, self.out = buf, memoryview(buf), 0, []

    def in_place(self, span: np.ndarray) -> None:
        n, pos = len(span), 0
        if self.fill:  # complete the chunk begun by the previous piece
            pos = min(C - self.fill, n)
            self.buf[self.fill:self.fill + pos] = span[:pos]
            self.flush(self.fill + pos)
            if self.fill:
                return
        whole = (n - pos) // C * C
        if whole:
            self.out.append(fpdef.host_chunk_digests(span.data, pos, pos + whole))
        rest = n - pos - whole
        self.buf[:rest] = span[n - rest:]
        self.fill = rest

    def zeros(self, n: int) -> None:
        while n:
            take = min(len(self.buf) - self.fill, n)
            self.buf[self.fill:self.fill + take] = 0
            self.flush(self.fill + take)
            n -= take

    def gather(self, src: np.ndarray, p: Piece) -> None:
        """Append the runs src [g, width] of piece p (cast and padded) a buffer's worth at a time."""
        row_out, rows = p.row_out, len(src)
        if len(self.buf) < row_out + C:  # a run wider than the buffer: grow it (scales, rarely)
            self.buf = np.concatenate([self.buf[:self.fill], np.empty(row_out + C - self.fill, dtype=np.uint8)])
            self.view = memoryview(self.buf)
        r = 0
        while r < rows:
            g = min(rows - r, (len(self.buf) - self.fill) // row_out)
            _fill_rows(self.buf[self.fill:self.fill + g * row_out].reshape(g, row_out), src[r:r + g], p)
            self.flush(self.fill + g * row_out)
            r += g

    def flush(self, fill: int) -> None:
        """Hash the buffer's whole chunks; move the rest (< 64 KiB) to its start."""
        whole = fill // C * C
        if whole:
            self.out.append(fpdef.host_chunk_digests(self.view, 0, whole))
            self.buf[:fill - whole] = self.buf[whole:fill]
        self.fill = fill - whole

    def digests(self) -> bytes:
        if self.fill:
            self.out.append(fpdef.host_chunk_digests(self.view, 0, self.fill))
            self.fill = 0
        return b"".join(self.out)


class ChunkHasher:
    """Chunk digests of planned shards; one per process (its buffers are reused).
    `seconds` (this thread's CPU seconds, the reads included: a machine's other load does
    not count) and `nbytes` say where the time went: contiguous pieces hashed in place,
    column cuts gathered and hashed (and zeros)."""

    def __init__(self, gather_bytes: int = GATHER_BYTES, stage_bytes: int = STAGE_BYTES, read_bytes: int = READ_BYTES):
        self._gather_bytes = gather_bytes
        self._bufs: list[np.ndarray] = []
        self._stage = np.empty(stage_bytes, dtype=np.uint8)
        self._read = np.empty(read_bytes, dtype=np.uint8)
        self.seconds = {"in_place": 0.0, "column_cuts": 0.0}
        self.nbytes = {"in_place": 0, "column_cuts": 0}

    def digests(self, plan: ShardPlan, files: FileBytes) -> bytes:
        """The shard's chunk digests, concatenated (16 bytes per 64 KiB chunk)."""
        return self.digests_of([plan], files)[0]

    def digests_of(self, plans: list[ShardPlan], files: FileBytes) -> list[bytes]:
        """Chunk digests of several shards of one tensor (one per rank). Where their pieces
        are column cuts of the same rows (w2 and its block scale at TP >= 2), the rows are
        read once for all of them: copied a group at a time into a staging buffer (one
        contiguous copy streams from memory at several times the speed of a strided
        gather) and each shard's cut gathered from there."""
        while len(self._bufs) < len(plans):
            self._bufs.append(np.empty(self._gather_bytes + C, dtype=np.uint8))
        streams = [_Stream(buf) for buf in self._bufs[:len(plans)]]
        if len(plans) > 1 and len({len(p.pieces) for p in plans}) == 1:
            steps = [list(zip(streams, pieces)) for pieces in zip(*(p.pieces for p in plans))]
        else:
            steps = [[(s, p)] for s, plan in zip(streams, plans) for p in plan.pieces]
        for pairs in steps:  # one piece of each shard at a time
            t0 = time.thread_time()
            if len(pairs) > 1 and _same_rows([p for _, p in pairs]):
                self._gather_staged(pairs, files)
                kind = "column_cuts"
            else:
                kind = "in_place"
                for s, p in pairs:
                    kind = self._piece(s, p, files)
            self.seconds[kind] += time.thread_time() - t0
            self.nbytes[kind] += sum(p.nbytes for _, p in pairs)
        for i, s in enumerate(streams):
            self._bufs[i] = s.buf  # grown for a wide run: kept
        return [s.digests() for s in streams]

    def _piece(self, s: _Stream, p: Piece, files: FileBytes) -> str:
        if p.file is not None and p.cast is None and (p.rows == 1 or (p.width == p.stride and not p.pad)):
            end = p.offset + p.rows * p.width
            if files.mapping_pays(p.file):
                s.in_place(files.region(p.file, p.offset, end - p.offset))
            else:  # a read's worth at a time: its whole chunks hashed where they landed
                for pos in range(p.offset, end, len(self._read)):
                    s.in_place(files.read_into(p.file, pos, self._read[:min(len(self._read), end - pos)]))
            if p.pad:
                s.zeros(p.pad)
            return "in_place"
        if p.file is None:
            s.zeros(p.nbytes)
        else:
            s.gather(_rows_view(files, p, 0, p.rows), p)
        return "column_cuts"

    def _gather_staged(self, pairs: list[tuple[_Stream, Piece]], files: FileBytes) -> None:
        first = pairs[0][1]
        lo = min(p.offset for _, p in pairs)
        span = max(p.offset + p.width for _, p in pairs) - lo
        g = max(1, len(self._stage) // first.stride)
        if len(self._stage) < (g - 1) * first.stride + span:  # a row wider than the stage: grow it
            self._stage = np.empty((g - 1) * first.stride + span, dtype=np.uint8)
        for r0 in range(0, first.rows, g):
            n = min(g, first.rows - r0)
            stage = files.read_into(first.file, lo + r0 * first.stride, self._stage[:(n - 1) * first.stride + span])
            for s, p in pairs:
                s.gather(np.ndarray((n, p.width), dtype=np.uint8, buffer=stage, offset=p.offset - lo,
                                    strides=(p.stride, 1)), p)


def _same_rows(pieces: list[Piece]) -> bool:
    """Whether the pieces are column cuts of the same rows of one file (so one read of each
    row serves them all)."""
    p0 = pieces[0]
    if p0.file is None or p0.contiguous or p0.rows < 2:
        return False
    lo, hi = min(p.offset for p in pieces), max(p.offset + p.width for p in pieces)
    return hi - lo <= p0.stride and all(
        p.file == p0.file and p.stride == p0.stride and p.rows == p0.rows and not p.contiguous for p in pieces)


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
