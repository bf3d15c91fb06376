"""One content fingerprint for expert tensors, the same bits on CPU and GPU (fp_version 3).

The definition (docs/fingerprint.md states it exactly):
- a tensor's raw bytes in C order are cut into 64 KiB chunks (the last may be shorter);
- chunk digest = XXH3-128 of the chunk, seed 0, default secret, as
  ``xxhash.xxh3_128(chunk).digest()`` returns it (16 bytes, canonical big-endian);
- tensor digest = XXH3-128 of (every chunk digest concatenated in order + the tensor's
  byte length as 8 bytes little-endian). An empty tensor has no chunks.
dtype and shape are never folded in: callers record them beside the digest.

Paths to the chunk digests, all held to the plain reference (``reference.py``) and to
``xxhash`` in tests: ``xxhash`` over zero-copy views of host bytes (CPU, here), one fused
Triton kernel (CUDA: ``triton_path.py``) and plain torch (CUDA without Triton:
``torch_path.py``). torch is imported only by the functions taking tensors: the index
cache and hook-spec read digests without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

FP_VERSION = 3
CHUNK_BYTES = 1 << 16
DIGEST_BYTES = 16
METHODS = ("xxhash", "torch", "triton", "reference")

__all__ = [
    "CHUNK_BYTES", "DIGEST_BYTES", "FP_VERSION", "METHODS", "Fingerprint", "chunk_digest", "default_method",
    "finalize", "fingerprint", "fingerprint_bytes", "fingerprint_many", "fingerprint_rows", "host_chunk_digests",
    "n_chunks_for", "raw_bytes", "reference_fingerprint_bytes", "row_bytes", "row_chunk_digests", "tensor_digest",
    "triton_available",
]

_xxh3_128 = xxhash.xxh3_128_digest


@dataclass(frozen=True)
class Fingerprint:
    """128-bit digest of a tensor's bytes plus its per-chunk digests."""

    digest: bytes  # 16 bytes
    chunk_digests: bytes  # 16 bytes per chunk, in order
    nbytes: int

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_digests) // DIGEST_BYTES

    def chunk(self, i: int) -> bytes:
        return self.chunk_digests[DIGEST_BYTES * i : DIGEST_BYTES * (i + 1)]

    def hex(self) -> str:
        return self.digest.hex()


def n_chunks_for(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def chunk_digest(data) -> bytes:
    """The 16-byte digest of one chunk's bytes (any bytes-like of at most CHUNK_BYTES)."""
    if memoryview(data).nbytes > CHUNK_BYTES:
        raise ValueError(f"a chunk holds at most {CHUNK_BYTES} bytes, got {memoryview(data).nbytes}")
    return _xxh3_128(data)


def tensor_digest(chunk_digests: bytes, nbytes: int) -> bytes:
    """The 16-byte tensor digest from its concatenated chunk digests and its byte length."""
    if len(chunk_digests) != DIGEST_BYTES * n_chunks_for(nbytes):
        raise ValueError(f"{len(chunk_digests)} bytes of chunk digests do not fit a {nbytes}-byte tensor: "
                         f"expected {DIGEST_BYTES * n_chunks_for(nbytes)}")
    return _xxh3_128(bytes(chunk_digests) + int(nbytes).to_bytes(8, "little"))


def reference_fingerprint_bytes(data) -> Fingerprint:
    """The definition written plainly (pure Python XXH3-128): what every path must equal. Slow."""
    from moetrace.fingerprint.reference import xxh3_128

    view = memoryview(data).cast("B")
    chunks = b"".join(xxh3_128(view[o : o + CHUNK_BYTES]) for o in range(0, len(view), CHUNK_BYTES))
    return Fingerprint(xxh3_128(chunks + len(view).to_bytes(8, "little")), chunks, len(view))


# ---------------------------------------------------------------- host bytes (the CPU path)


def host_chunk_digests(view: memoryview, start: int, stop: int) -> bytes:
    """Concatenated chunk digests of view[start:stop] (chunks counted from `start`), one
    xxhash call per chunk over a zero-copy slice. xxhash releases the GIL only above
    64 KiB, so a chunk's call holds it: one thread hashes (docs/fingerprint.md, "Threads")."""
    f = _xxh3_128
    return b"".join([f(view[o : min(o + CHUNK_BYTES, stop)]) for o in range(start, stop, CHUNK_BYTES)])


def fingerprint_bytes(data) -> Fingerprint:
    """Fingerprint of a host byte buffer (same digest as a uint8 tensor of those bytes)."""
    view = memoryview(data).cast("B")
    chunks = host_chunk_digests(view, 0, len(view))
    return Fingerprint(tensor_digest(chunks, len(view)), chunks, len(view))


def _rows_chunk_digests_host(flat: memoryview, n_rows: int, row_len: int) -> np.ndarray:
    """uint8 [R, n, 16] from a flat view of R rows of row_len bytes each."""
    n = n_chunks_for(row_len)
    out = np.empty((n_rows, n, DIGEST_BYTES), dtype=np.uint8)
    for r in range(n_rows):
        digests = host_chunk_digests(flat, r * row_len, (r + 1) * row_len)
        out[r] = np.frombuffer(digests, dtype=np.uint8).reshape(n, DIGEST_BYTES)
    return out


# ---------------------------------------------------------------- tensors


def raw_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """The tensor's logical contents as a flat uint8 tensor (C order), on its device."""
    import torch

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def row_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """[R, ...] -> uint8 [R, bytes_per_row]: one row per leading index (e.g. expert)."""
    if t.dim() == 0:
        return raw_bytes(t).reshape(1, -1)
    return raw_bytes(t).reshape(t.shape[0], -1)


def _host_view(rows: "torch.Tensor") -> memoryview:
    """A zero-copy view of a CPU uint8 [R, N] tensor's bytes (copied only if not contiguous)."""
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return memoryview(rows.numpy()).cast("B") if rows.numel() else memoryview(b"")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_method(device) -> str:
    """xxhash on the CPU; the Triton kernel on CUDA when Triton is installed, else plain torch."""
    forced = os.environ.get("MOETRACE_FP_METHOD")
    if forced:
        return forced
    if device.type == "cpu":
        return "xxhash"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def row_chunk_digests(rows: "torch.Tensor", method: str | None = None) -> "torch.Tensor":
    """Chunk digests of each row of a uint8 [R, N] tensor: uint8 [R, n_chunks, 16] on the
    rows' device (no sync: a caller can defer the device-to-host copy).

    method: "xxhash" (host bytes; a device tensor is copied to the host first),
    "torch" (any device), "triton" (CUDA; CPU under TRITON_INTERPRET=1) or
    "reference" (pure Python, slow)."""
    import torch

    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError("row_chunk_digests expects a uint8 tensor of shape [rows, bytes]")
    rows = rows.detach()
    method = method or default_method(rows.device)
    r, n = rows.shape
    if method == "xxhash":
        host = rows if rows.device.type == "cpu" else rows.cpu()
        out = torch.from_numpy(_rows_chunk_digests_host(_host_view(host), r, n))
        return out if rows.device.type == "cpu" else out.to(rows.device)
    if method == "torch":
        from moetrace.fingerprint.torch_path import row_chunk_digests as torch_rows

        return torch_rows(rows, CHUNK_BYTES)
    if method == "triton":
        from moetrace.fingerprint.triton_path import row_chunk_digests as triton_rows

        return triton_rows(rows if rows.stride(-1) == 1 else rows.contiguous(), CHUNK_BYTES)
    if method == "reference":
        view = _host_view(rows.cpu())
        chunks = [reference_fingerprint_bytes(view[i * n : (i + 1) * n]).chunk_digests for i in range(r)]
        out = np.frombuffer(b"".join(chunks), dtype=np.uint8).reshape(r, n_chunks_for(n), DIGEST_BYTES)
        return torch.from_numpy(out.copy()).to(rows.device)
    raise ValueError(f"unknown fingerprint method {method!r}: expected one of {', '.join(METHODS)}")


def finalize(chunks, nbytes: int) -> list[Fingerprint]:
    """Chunk digests uint8 [R, n, 16] (array or tensor; host or device) of rows of
    `nbytes` bytes -> one Fingerprint per row (one XXH3-128 per row on the host)."""
    if not isinstance(chunks, np.ndarray):
        chunks = chunks.cpu().numpy()
    r, n, width = chunks.shape
    if width != DIGEST_BYTES or n != n_chunks_for(nbytes):
        raise ValueError(f"chunk digests [{r}, {n}, {width}] do not fit {nbytes}-byte rows: "
                         f"expected [{r}, {n_chunks_for(nbytes)}, {DIGEST_BYTES}]")
    chunks = np.ascontiguousarray(chunks, dtype=np.uint8)
    out = []
    for i in range(r):
        row = chunks[i].tobytes()
        out.append(Fingerprint(tensor_digest(row, nbytes), row, int(nbytes)))
    return out


# ---------------------------------------------------------------- public API


def fingerprint_rows(t: "torch.Tensor", method: str | None = None) -> list[Fingerprint]:
    """One Fingerprint per index of dim 0 (e.g. per expert of a [E, ...] parameter)."""
    rows = row_bytes(t)
    return finalize(row_chunk_digests(rows, method), rows.shape[1])


def fingerprint(t: "torch.Tensor", method: str | None = None) -> Fingerprint:
    """The fingerprint of one tensor's raw bytes (dtype and shape are not folded in)."""
    rows = raw_bytes(t).reshape(1, -1)
    if (method or default_method(rows.device)) == "xxhash" and rows.device.type == "cpu":
        return fingerprint_bytes(_host_view(rows))  # no [1, n, 16] round trip
    return finalize(row_chunk_digests(rows, method), rows.shape[1])[0]


def fingerprint_many(tensors: Sequence["torch.Tensor"] | Iterable["torch.Tensor"],
                     method: str | None = None) -> list[Fingerprint]:
    """Fingerprints of many tensors in one call, in order."""
    return [fingerprint(t, method) for t in tensors]
