"""One content fingerprint for expert tensors, bit-exact on CPU and GPU (fp_version 2).

A tensor's raw bytes (C order) are cut into chunks of ``CHUNK_BYTES``. A chunk's
16 *lanes* are exact integer dot products of its bytes (read as int8) with fixed
int8 keys: one int8 x int8 -> int32 matrix product over all chunks, the only
pass over the data (``torch._int_mm`` on CPU, one fused Triton kernel on the
GPU, ``torch._int_mm`` there when Triton is absent). No lane can overflow, so
every path gives the same bits. The host then folds each chunk's lanes and
length into a 16-byte chunk digest (a keyed linear map mod 2^64, vectorized
over all chunks), and a tensor's ordered chunk digests plus its byte length
into its 16-byte digest (one BLAKE2b per tensor). docs/fingerprint.md has the
collision argument.

dtype and shape are never folded in: callers record them beside the digest.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

FP_VERSION = 2
CHUNK_BYTES = 1 << 16
LANES = 16
KEY_LIMIT = 64  # keys are the nonzero integers in [-64, 64]: see _lane_keys
_FOLD_INPUTS = 4 * LANES + 4  # a chunk digest reads its lane bytes and its length
_BLOCK_CHUNKS = 256  # chunks per exact float64 product (the fallback): 128 MiB of temporaries
METHODS = ("torch", "triton", "numpy")


def _splitmix64(seed: int, count: int) -> np.ndarray:
    """Deterministic 64-bit words; a fixed recipe, not a library RNG stream."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = np.uint64(seed) + golden * np.arange(1, count + 1, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _lane_keys() -> np.ndarray:
    """int8 [CHUNK_BYTES, LANES]: each key uniform over the 128 nonzero integers in
    [-64, 64]. Nonzero: a single changed byte changes every lane. At most 64 in
    magnitude: a pair of byte products never exceeds int16, so no int8 GEMM
    kernel (VNNI or the older saturating pair sums) can round or saturate."""
    seven_bits = _splitmix64(0x6D6F6574726163F2, CHUNK_BYTES * LANES // 8).astype("<u8").view(np.uint8) & 0x7F
    v = seven_bits.astype(np.int16)
    return np.where(v < KEY_LIMIT, v - KEY_LIMIT, v - KEY_LIMIT + 1).astype(np.int8).reshape(CHUNK_BYTES, LANES)


LANE_KEYS = _lane_keys()
FOLD_KEYS = _splitmix64(0x6D6F6574726163F3, 2 * _FOLD_INPUTS).reshape(_FOLD_INPUTS, 2)


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
    return raw_bytes(t).reshape(t.shape[0], -1)


# ---------------------------------------------------------------- lanes


_KEYS: dict[torch.device, torch.Tensor] = {}
_EXACT_INT_MM: dict[torch.device, bool] = {}
_LOCK = threading.Lock()


def _device_keys(device: torch.device) -> torch.Tensor:
    keys = _KEYS.get(device)
    if keys is None:
        keys = _KEYS[device] = torch.from_numpy(LANE_KEYS).to(device)
    return keys


def _exact_mm(a: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int8 [m, k] x int8 [k, LANES] -> int32, exact: every product and partial sum
    is an integer below 2^30, so float64 (53-bit mantissa) never rounds."""
    out = torch.empty((a.shape[0], keys.shape[1]), dtype=torch.int32, device=a.device)
    kf = keys.to(torch.float64)
    for s in range(0, a.shape[0], _BLOCK_CHUNKS):
        out[s : s + _BLOCK_CHUNKS] = (a[s : s + _BLOCK_CHUNKS].to(torch.float64) @ kf).to(torch.int32)
    return out


def _int_mm(a: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """torch._int_mm within its shape rules (CUDA: more than 16 rows, k and n
    multiples of 8; zero rows and zero bytes add nothing to a lane)."""
    if a.device.type != "cuda":
        return torch._int_mm(a, keys)
    m, k = a.shape
    pad_m, pad_k = max(0, 17 - m), -k % 8
    if pad_m or pad_k:
        a = torch.nn.functional.pad(a, (0, pad_k, 0, pad_m))
        keys = torch.nn.functional.pad(keys, (0, 0, 0, pad_k))
    return torch._int_mm(a, keys)[:m]


def _int_mm_is_exact(device: torch.device) -> bool:
    """Once per device: does torch._int_mm give the exact lanes of the extremes
    (every byte -128 or 127, full chunks)? Otherwise the float64 product is used."""
    with _LOCK:
        known = _EXACT_INT_MM.get(device)
        if known is not None:
            return known
        probe = torch.full((17, CHUNK_BYTES), -128, dtype=torch.int8)
        probe[1::2] = 127
        probe[2, ::3] = 0
        keys = _device_keys(device)
        try:
            got = _int_mm(probe.to(device), keys).cpu()
            ok = bool(torch.equal(got, _exact_mm(probe, _device_keys(torch.device("cpu")))))
        except (RuntimeError, NotImplementedError):
            ok = False
        _EXACT_INT_MM[device] = ok
        return ok


def _mm(a: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return _int_mm(a, keys) if _int_mm_is_exact(a.device) else _exact_mm(a, keys)


def _torch_row_lanes(rows: torch.Tensor) -> torch.Tensor:
    """rows uint8 [R, N] on any device -> int32 [R, n_chunks, LANES] on that device."""
    r, n = rows.shape
    keys = _device_keys(rows.device)
    n_full, tail = divmod(n, CHUNK_BYTES)
    out = torch.empty((r, n_full + (1 if tail else 0), LANES), dtype=torch.int32, device=rows.device)
    s8 = rows.view(torch.int8) if rows.stride(-1) == 1 else rows.contiguous().view(torch.int8)
    if n_full and r:
        if tail == 0 and s8.is_contiguous():  # one matrix of whole chunks: one product
            out.view(-1, LANES)[:] = _mm(s8.view(-1, CHUNK_BYTES), keys)
        else:
            for i in range(r):
                out[i, :n_full] = _mm(s8[i, : n_full * CHUNK_BYTES].view(n_full, CHUNK_BYTES), keys)
    if tail and r:
        out[:, n_full] = _mm(s8[:, n_full * CHUNK_BYTES :], keys[:tail])
    return out


def _numpy_row_lanes(rows: np.ndarray) -> np.ndarray:
    """The definition written plainly (int64 products, no GEMM kernel): the
    independent reference the fast paths are checked against."""
    r, n = rows.shape
    n_chunks = n_chunks_for(n)
    padded = np.zeros((r, n_chunks * CHUNK_BYTES), dtype=np.int8)
    padded[:, :n] = rows.view(np.int8)
    chunks = padded.reshape(r * n_chunks, CHUNK_BYTES).astype(np.int64)
    return (chunks @ LANE_KEYS.astype(np.int64)).astype(np.int32).reshape(r, n_chunks, LANES)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_method(device: torch.device) -> str:
    """Triton on CUDA when it is installed; torch everywhere else."""
    forced = os.environ.get("MOETRACE_FP_METHOD")
    if forced:
        return forced
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def row_lanes(rows: torch.Tensor, method: str | None = None) -> np.ndarray | torch.Tensor:
    """Chunk lanes of each row of a uint8 [R, N] tensor: int32 [R, n_chunks, LANES].

    method: "torch" (any device), "triton" (CUDA; CPU under TRITON_INTERPRET=1)
    or "numpy" (the slow reference, CPU). Torch and Triton return a tensor on
    the rows' device (a caller can defer the D2H copy), numpy an array.
    """
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError("row_lanes expects a uint8 tensor of shape [rows, bytes]")
    rows = rows.detach()
    method = method or default_method(rows.device)
    if method == "torch":
        return _torch_row_lanes(rows)
    if method == "triton":
        from moetrace.fingerprint_triton import row_lanes as triton_row_lanes

        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return triton_row_lanes(rows, _device_keys(rows.device), CHUNK_BYTES)
    if method == "numpy":
        return _numpy_row_lanes(rows.cpu().numpy())
    raise ValueError(f"unknown fingerprint method {method!r}: expected one of {', '.join(METHODS)}")


# ---------------------------------------------------------------- folding


def chunk_digests(lanes: np.ndarray, nbytes: int) -> np.ndarray:
    """int32 lanes [R, n, LANES] of rows of `nbytes` bytes -> uint8 [R, n, 16].

    Per chunk: the 64 lane bytes (little-endian) and the chunk's true length
    (4 bytes LE) as 68 integers 0..255, times two columns of fixed 64-bit keys,
    mod 2^64. Vectorized over every chunk of every row."""
    r, n, _ = lanes.shape
    inputs = np.empty((r, n, _FOLD_INPUTS), dtype=np.uint8)
    inputs[..., : 4 * LANES] = np.ascontiguousarray(lanes, dtype="<i4").view(np.uint8).reshape(r, n, 4 * LANES)
    lengths = np.full(n, CHUNK_BYTES, dtype="<u4")
    if n and nbytes % CHUNK_BYTES:
        lengths[-1] = nbytes % CHUNK_BYTES
    inputs[..., 4 * LANES :] = lengths.view(np.uint8).reshape(n, 4)
    words = np.dot(inputs.reshape(-1, _FOLD_INPUTS).astype(np.uint64), FOLD_KEYS)  # wraps mod 2^64
    return words.astype("<u8").view(np.uint8).reshape(r, n, 16)


# ---------------------------------------------------------------- the fold on the device (the guard)
#
# A chunk's two 64-bit words are sums over its 68 fold inputs (64 lane bytes, 4 length
# bytes) of input * key mod 2^64. Split every key into 32-bit halves and each half-sum
# stays below 68 * 255 * 2^32 < 2^48: exact in float64 (one small GEMM) and in int64;
# a word's 32-bit halves follow with one carry. The lane bytes' part is computed on
# the device; the length bytes' part is a constant per chunk length, added there for
# the digests or taken off the expected words on the host for the guard's compare.

_FOLD_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_MASK32 = 0xFFFFFFFF
_U64_MASK32 = np.uint64(_MASK32)


def _key_halves() -> np.ndarray:
    """int64 [68, 2, 2]: [input, half (low, high), word] of FOLD_KEYS."""
    k = FOLD_KEYS.astype(np.uint64)
    return np.stack([k & _U64_MASK32, k >> np.uint64(32)], axis=1).astype(np.int64)


def _length_words(nbytes: int, n: int) -> np.ndarray:
    """uint64 [n, 2]: the length bytes' part of each chunk's two words (mod 2^64)."""
    lengths = np.full(n, CHUNK_BYTES, dtype="<u4")
    if n and nbytes % CHUNK_BYTES:
        lengths[-1] = nbytes % CHUNK_BYTES
    with np.errstate(over="ignore"):
        return np.dot(lengths.view(np.uint8).reshape(n, 4).astype(np.uint64), FOLD_KEYS[4 * LANES :])


def _fold_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per device: the lane keys' halves (float64 [64, 4] = [input, (half, word)]) and
    the byte shifts; nothing is copied to the device per call."""
    found = _FOLD_DEVICE.get(device)
    if found is None:
        keys = _key_halves()[: 4 * LANES].reshape(4 * LANES, 4).astype(np.float64)
        found = _FOLD_DEVICE[device] = (torch.from_numpy(keys).to(device),
                                        torch.tensor([0, 8, 16, 24], dtype=torch.int64).to(device))
    return found


def device_lane_words(lanes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lane bytes' part of every chunk's two words, where the lanes are (no host
    copy, no sync): int32 lanes [R, n, LANES] -> (low, high) 32-bit halves, int64
    [R, n, 2] each. Lanes are read in the device's byte order: little-endian on every
    CUDA and x86 device, as the host fold writes them."""
    r, n, width = lanes.shape
    if width != LANES:
        raise ValueError(f"lanes [{r}, {n}, {width}]: expected {LANES} lanes per chunk")
    keys, _ = _fold_constants(lanes.device)
    lane_bytes = lanes.contiguous().view(torch.uint8).view(r * n, 4 * LANES)
    sums = (lane_bytes.to(torch.float64) @ keys).to(torch.int64).view(r, n, 2, 2)
    low, high = sums[:, :, 0], sums[:, :, 1]
    return low & _MASK32, ((low >> 32) + high) & _MASK32


def expected_lane_words(chunks: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """What device_lane_words must give for rows whose chunk digests are `chunks`
    (uint8 [R, n, 16]): each word less its length part, mod 2^64, as (low, high) halves."""
    r, n, _ = chunks.shape
    with np.errstate(over="ignore"):
        words = np.ascontiguousarray(chunks).view("<u8").reshape(r, n, 2) - _length_words(nbytes, n)
    return (words & _U64_MASK32).astype(np.int64), (words >> np.uint64(32)).astype(np.int64)


def device_chunk_digests(lanes: torch.Tensor, nbytes: int) -> torch.Tensor:
    """chunk_digests() computed where the lanes are: uint8 [R, n, 16] on their device."""
    r, n, width = lanes.shape
    if width != LANES or n != n_chunks_for(nbytes):
        raise ValueError(f"lanes [{r}, {n}, {width}] do not fit {nbytes}-byte rows")
    _, shifts = _fold_constants(lanes.device)
    low, high = device_lane_words(lanes)
    length = torch.from_numpy(_length_words(nbytes, n).view(np.int64)).to(lanes.device)
    add_low, add_high = length & _MASK32, (length >> 32) & _MASK32  # halves of the unsigned words
    low = low + add_low
    high = (high + add_high + (low >> 32)) & _MASK32
    halves = torch.stack([low & _MASK32, high], dim=-1).view(r, n, 4)  # word 0 (low, high), word 1: LE order
    return ((halves.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).view(r, n, 16)


def _lanes_to_numpy(lanes: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(lanes, torch.Tensor):
        return lanes.cpu().numpy()
    return lanes


def finalize(lanes: np.ndarray | torch.Tensor, nbytes: int) -> list[Fingerprint]:
    """Fold lanes [R, n, LANES] of rows of `nbytes` bytes into one Fingerprint per row."""
    lanes = _lanes_to_numpy(lanes)
    r, n, width = lanes.shape
    if width != LANES or n != n_chunks_for(nbytes):
        raise ValueError(f"lanes [{r}, {n}, {width}] do not fit {nbytes}-byte rows: expected [{r}, {n_chunks_for(nbytes)}, {LANES}]")
    chunks = chunk_digests(lanes, nbytes)
    result = []
    for i in range(r):
        row = chunks[i].tobytes()
        result.append(Fingerprint(tensor_digest(row, nbytes), row, int(nbytes)))
    return result


def tensor_digest(chunk_digests: bytes, nbytes: int) -> bytes:
    """A tensor's 16-byte digest from its concatenated chunk digests and byte length."""
    total = int(nbytes).to_bytes(8, "little")
    return hashlib.blake2b(total + bytes(chunk_digests), digest_size=16, person=b"moetrace.tensor2").digest()


def chunk_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte digest of one chunk (at most CHUNK_BYTES, not empty): what a tensor's
    chunk_digests hold for a chunk with these bytes."""
    return fingerprint_bytes(data).chunk(0)


# ---------------------------------------------------------------- public API


def fingerprint_rows(t: torch.Tensor, method: str | None = None) -> list[Fingerprint]:
    """One Fingerprint per index of dim 0 (e.g. per expert of a [E, ...] parameter)."""
    rows = row_bytes(t)
    return finalize(row_lanes(rows, method), rows.shape[1])


def fingerprint(t: torch.Tensor, method: str | None = None) -> Fingerprint:
    """The fingerprint of one tensor's raw bytes (dtype and shape are not folded in)."""
    rows = raw_bytes(t).reshape(1, -1)
    return finalize(row_lanes(rows, method), rows.shape[1])[0]


def fingerprint_many(tensors: Sequence[torch.Tensor] | Iterable[torch.Tensor], method: str | None = None) -> list[Fingerprint]:
    return [fingerprint(t, method) for t in tensors]


def fingerprint_bytes(data: bytes | bytearray | memoryview) -> Fingerprint:
    """Fingerprint of a host byte buffer (same digest as a uint8 tensor of those bytes)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return fingerprint(torch.from_numpy(arr.copy() if not arr.flags.writeable else arr))
