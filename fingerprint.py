"""One content fingerprint for expert tensors, bit-exact on CPU and CUDA.

A tensor's raw bytes (C order) are cut into fixed chunks of ``CHUNK_BYTES``.
Each chunk, zero-padded to ``CHUNK_BYTES``, gets four 64-bit *lanes*: integer
dot products mod 2^64 of its 64-bit words with fixed odd keys, two lanes over
the aligned words and two over the words that start 4 bytes in (so a bit that
sits at the top of an aligned word sits in the middle of an offset one: a
plain mod-2^64 sum cannot see two flips of a word's top bit). Lanes are pure
integer arithmetic with defined wrap-around, so numpy (matmul), torch on CPU
and torch on CUDA give the same bits. The host then folds each chunk's lanes
and length into a 16-byte BLAKE2b chunk digest, and the ordered chunk digests
plus the byte length into the 16-byte tensor digest. docs/fingerprint.md has
the collision argument.

dtype and shape are never folded in: callers record them beside the digest.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

FP_VERSION = 1
CHUNK_BYTES = 1 << 16
_WORDS = CHUNK_BYTES // 8
_OFFSET_WORDS = _WORDS - 1  # words over bytes [4, CHUNK_BYTES - 4)
_BLOCK_CHUNKS = 16  # chunks per numpy matmul block: keeps the offset copy in cache
_TORCH_BLOCK_CHUNKS = 512  # bounds torch temporaries to ~32 MiB per lane op


def _splitmix64(seed: int, count: int) -> np.ndarray:
    """Deterministic 64-bit keys; a fixed recipe, not a library RNG stream."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = np.uint64(seed) + golden * np.arange(1, count + 1, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x | np.uint64(1)  # odd keys are units mod 2^64: one changed word always shows


KEYS_ALIGNED = np.stack(
    [_splitmix64(0x6D6F6574726163E1, _WORDS), _splitmix64(0x6D6F6574726163E2, _WORDS)], axis=1
)
KEYS_OFFSET = np.stack(
    [
        _splitmix64(0x6D6F6574726163E3, _OFFSET_WORDS),
        _splitmix64(0x6D6F6574726163E4, _OFFSET_WORDS),
    ],
    axis=1,
)


@dataclass(frozen=True)
class Fingerprint:
    """128-bit digest of a tensor's bytes plus its per-chunk digests."""

    digest: bytes  # 16 bytes
    chunk_digests: bytes  # 16 bytes per chunk, in order
    nbytes: int

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_digests) // 16

    def chunk(self, i: int) -> bytes:
        return self.chunk_digests[16 * i : 16 * (i + 1)]

    def hex(self) -> str:
        return self.digest.hex()


def n_chunks_for(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


# ---------------------------------------------------------------- raw bytes


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical contents as a flat uint8 tensor (C order), on its device."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, ...] -> uint8 [R, bytes_per_row]: one row per leading index (e.g. expert)."""
    if t.dim() == 0:
        return raw_bytes(t).reshape(1, -1)
    rows = t.shape[0]
    return raw_bytes(t).reshape(rows, -1)


# ---------------------------------------------------------------- numpy lanes


def _np_full_lanes(chunks: np.ndarray, out: np.ndarray) -> None:
    """chunks uint8 [M, CHUNK_BYTES] (rows contiguous) -> out uint64 [M, 4]."""
    buf = np.empty((_BLOCK_CHUNKS, CHUNK_BYTES - 8), dtype=np.uint8)
    for s in range(0, chunks.shape[0], _BLOCK_CHUNKS):
        blk = chunks[s : s + _BLOCK_CHUNKS]
        b = blk.shape[0]
        # np.dot, not matmul: its integer loop releases the GIL at any size,
        # so blocks small enough to stay in cache still run on all cores.
        out[s : s + b, 0:2] = np.dot(blk.view(np.uint64), KEYS_ALIGNED)
        np.copyto(buf[:b], blk[:, 4 : CHUNK_BYTES - 4])
        out[s : s + b, 2:4] = np.dot(buf[:b].view(np.uint64), KEYS_OFFSET)


def _tail_geometry(tail: int) -> tuple[int, int, int]:
    """For a partial chunk of `tail` bytes: aligned words, offset words, padded width."""
    n_aligned = -(-tail // 8)
    n_offset = min(_OFFSET_WORDS, max(0, -(-(tail - 4) // 8)))
    width = max(8 * n_aligned, 4 + 8 * n_offset)
    return n_aligned, n_offset, width


def _np_tail_lanes(tails: np.ndarray) -> np.ndarray:
    """tails uint8 [R, tail] (the last partial chunk of each row) -> uint64 [R, 4]."""
    r, tail = tails.shape
    n_aligned, n_offset, width = _tail_geometry(tail)
    padded = np.zeros((r, width + 8), dtype=np.uint8)
    padded[:, :tail] = tails
    out = np.zeros((r, 4), dtype=np.uint64)
    out[:, 0:2] = np.dot(np.ascontiguousarray(padded[:, : 8 * n_aligned]).view(np.uint64), KEYS_ALIGNED[:n_aligned])
    if n_offset:
        off = np.ascontiguousarray(padded[:, 4 : 4 + 8 * n_offset]).view(np.uint64)
        out[:, 2:4] = np.dot(off, KEYS_OFFSET[:n_offset])
    return out


def _np_row_lanes(rows: np.ndarray, pool: ThreadPoolExecutor | None) -> np.ndarray:
    """rows uint8 [R, N] -> uint64 [R, n_chunks, 4]."""
    r, n = rows.shape
    n_full, tail = divmod(n, CHUNK_BYTES)
    out = np.zeros((r, n_full + (1 if tail else 0), 4), dtype=np.uint64)
    if n_full:
        if rows.flags.c_contiguous and tail == 0:
            groups = [(rows.reshape(r * n_full, CHUNK_BYTES), out.reshape(r * n_full, 4))]
        else:
            groups = [
                (rows[i, : n_full * CHUNK_BYTES].reshape(n_full, CHUNK_BYTES), out[i, :n_full])
                for i in range(r)
            ]
        jobs = []
        for src, dst in groups:
            if pool is None:
                _np_full_lanes(src, dst)
                continue
            step = max(_BLOCK_CHUNKS, -(-src.shape[0] // _workers()))
            for s in range(0, src.shape[0], step):
                jobs.append(pool.submit(_np_full_lanes, src[s : s + step], dst[s : s + step]))
        for j in jobs:
            j.result()
    if tail:
        out[:, n_full] = _np_tail_lanes(rows[:, n_full * CHUNK_BYTES :])
    return out


# ---------------------------------------------------------------- torch lanes

_TORCH_KEYS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _torch_keys(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _TORCH_KEYS.get(device)
    if keys is None:
        ka = torch.from_numpy(KEYS_ALIGNED.view(np.int64).T.copy()).to(device)
        kb = torch.from_numpy(KEYS_OFFSET.view(np.int64).T.copy()).to(device)
        keys = _TORCH_KEYS[device] = (ka, kb)
    return keys


def _words(x: torch.Tensor) -> torch.Tensor:
    """uint8 [M, 8k] -> int64 [M, k], copying only when the layout forbids a view."""
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.storage_offset() % 8 or x.shape[0] > 1 and x.stride(0) != x.shape[1]:
        x = torch.empty(x.shape, dtype=torch.uint8, device=x.device).copy_(x)
    return x.view(torch.int64)


def _torch_dot(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """words int64 [M, W], keys int64 [2, >=W] -> int64 [M, 2]; wraps mod 2^64."""
    w = words.shape[1]
    return torch.stack([(words * keys[j, :w]).sum(dim=1) for j in range(keys.shape[0])], dim=1)


def _torch_row_lanes(rows: torch.Tensor) -> torch.Tensor:
    """rows uint8 [R, N] on any device -> int64 [R, n_chunks, 4] on that device."""
    r, n = rows.shape
    ka, kb = _torch_keys(rows.device)
    n_full, tail = divmod(n, CHUNK_BYTES)
    out = torch.zeros((r, n_full + (1 if tail else 0), 4), dtype=torch.int64, device=rows.device)
    if n_full:
        # Rows with a tail (or strided rows) are not one run of whole chunks:
        # take them a few rows at a time, so a copy is at most one block
        # (never a contiguous copy of the whole parameter on the GPU).
        step = r if tail == 0 and rows.is_contiguous() else max(1, _TORCH_BLOCK_CHUNKS // n_full)
        for i in range(0, r, step):
            full = rows[i : i + step, : n_full * CHUNK_BYTES].reshape(-1, CHUNK_BYTES)
            lanes = torch.empty((full.shape[0], 4), dtype=torch.int64, device=rows.device)
            for s in range(0, full.shape[0], _TORCH_BLOCK_CHUNKS):
                blk = full[s : s + _TORCH_BLOCK_CHUNKS]
                lanes[s : s + blk.shape[0], 0:2] = _torch_dot(_words(blk), ka)
                lanes[s : s + blk.shape[0], 2:4] = _torch_dot(_words(blk[:, 4 : CHUNK_BYTES - 4]), kb)
            out[i : i + step, :n_full] = lanes.view(-1, n_full, 4)
    if tail:
        n_aligned, n_offset, width = _tail_geometry(tail)
        padded = torch.zeros((r, width + 8), dtype=torch.uint8, device=rows.device)
        padded[:, :tail] = rows[:, n_full * CHUNK_BYTES :]
        out[:, n_full, 0:2] = _torch_dot(_words(padded[:, : 8 * n_aligned]), ka)
        if n_offset:
            out[:, n_full, 2:4] = _torch_dot(_words(padded[:, 4 : 4 + 8 * n_offset]), kb)
    return out


# ---------------------------------------------------------------- public API

_POOL: ThreadPoolExecutor | None = None


def _workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="moetrace-fp")
    return _POOL


def row_lanes(rows: torch.Tensor, method: str | None = None, threads: bool = False) -> np.ndarray | torch.Tensor:
    """Chunk lanes of each row of a uint8 [R, N] tensor.

    method: "numpy" (CPU tensors only) or "torch" (any device); default numpy on
    CPU, torch elsewhere. Returns uint64 numpy [R, n, 4] for numpy, int64 torch
    on the tensor's device for torch (so a caller can defer the D2H copy).
    """
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError("row_lanes expects a uint8 tensor of shape [rows, bytes]")
    method = method or ("numpy" if rows.device.type == "cpu" else "torch")
    if method == "numpy":
        arr = rows.detach().cpu().numpy()
        return _np_row_lanes(arr, _pool() if threads and _workers() > 1 else None)
    if method == "torch":
        return _torch_row_lanes(rows.detach())
    raise ValueError(f"unknown fingerprint method {method!r}: expected 'numpy' or 'torch'")


def _lanes_to_numpy(lanes: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(lanes, torch.Tensor):
        return lanes.cpu().numpy().view(np.uint64)
    return lanes


def finalize(lanes: np.ndarray | torch.Tensor, nbytes: int) -> list[Fingerprint]:
    """Fold lanes [R, n, 4] of rows of `nbytes` bytes into one Fingerprint per row."""
    lanes = np.ascontiguousarray(_lanes_to_numpy(lanes).astype("<u8", copy=False))
    r, n, _ = lanes.shape
    if n != n_chunks_for(nbytes):
        raise ValueError(f"lanes hold {n} chunks, {nbytes} bytes need {n_chunks_for(nbytes)}")
    lengths = [CHUNK_BYTES] * n
    if n and nbytes % CHUNK_BYTES:
        lengths[-1] = nbytes % CHUNK_BYTES
    tails = [int(x).to_bytes(8, "little") for x in lengths]
    raw = lanes.view(np.uint8).reshape(r, n, 32)
    total = int(nbytes).to_bytes(8, "little")
    result = []
    for i in range(r):
        row = raw[i]
        chunks = b"".join(
            hashlib.blake2b(row[j].tobytes() + tails[j], digest_size=16, person=b"moetrace.chunk1").digest()
            for j in range(n)
        )
        digest = hashlib.blake2b(total + chunks, digest_size=16, person=b"moetrace.tensor1").digest()
        result.append(Fingerprint(digest, chunks, int(nbytes)))
    return result


def fingerprint_rows(t: torch.Tensor, method: str | None = None, threads: bool = True) -> list[Fingerprint]:
    """One Fingerprint per index of dim 0 (e.g. per expert of a [E, ...] parameter)."""
    rows = row_bytes(t)
    return finalize(row_lanes(rows, method, threads), rows.shape[1])


def fingerprint(t: torch.Tensor, method: str | None = None, threads: bool = True) -> Fingerprint:
    """The fingerprint of one tensor's raw bytes (dtype and shape are not folded in)."""
    rows = raw_bytes(t).reshape(1, -1)
    return finalize(row_lanes(rows, method, threads), rows.shape[1])[0]


def fingerprint_many(tensors: Sequence[torch.Tensor] | Iterable[torch.Tensor], method: str | None = None) -> list[Fingerprint]:
    """Fingerprints of many tensors, spread over a thread pool (numpy releases the GIL)."""
    tensors = list(tensors)
    if len(tensors) <= 1 or _workers() == 1:
        return [fingerprint(t, method, threads=True) for t in tensors]
    return list(_pool().map(lambda t: fingerprint(t, method, threads=False), tensors))


def fingerprint_bytes(data: bytes | bytearray | memoryview) -> Fingerprint:
    """Fingerprint of a host byte buffer (same digest as a uint8 tensor of those bytes)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return fingerprint(torch.from_numpy(arr.copy()) if not arr.flags.writeable else torch.from_numpy(arr))
