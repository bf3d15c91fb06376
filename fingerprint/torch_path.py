"""XXH3-128 chunk digests in plain torch, vectorized over chunks (any device).

The path for CUDA without Triton (and a second independent path the tests hold
to ``xxhash`` on CPU tensors). torch has no uint64 arithmetic on every device,
so 64-bit words live in int64: addition, multiplication and xor wrap mod 2^64
with the same bits; right shifts are made logical with a mask; a 64 x 64 -> 128
bit product is built from 32-bit halves. Chunks of one length go together:
a row's full chunks in batches, its last (shorter) chunk as one batch of rows.
"""

from __future__ import annotations

import sys

import torch

from moetrace.fingerprint import reference as ref
from moetrace.fingerprint.reference import s64 as _s64

_BATCH = 64  # full chunks per step: 4 MiB of bytes, ~8x that in int64 temporaries


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _lo32(x: torch.Tensor) -> torch.Tensor:
    return x & ref.M32


def _mul128(a: torch.Tensor, b: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 64-bit halves of the 128-bit product of two unsigned words."""
    a0, a1 = _lo32(a), _lsr(a, 32)
    if isinstance(b, int):
        b0, b1 = b & ref.M32, b >> 32
    else:
        b0, b1 = _lo32(b), _lsr(b, 32)
    ll, lh, hl, hh = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = _lsr(ll, 32) + _lo32(lh) + _lo32(hl)
    return (mid << 32) | _lo32(ll), hh + _lsr(lh, 32) + _lsr(hl, 32) + _lsr(mid, 32)


def _fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    low, high = _mul128(a, b)
    return low ^ high


def _avalanche(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 37)
    x = x * _s64(ref.PRIME_MX1)
    return x ^ _lsr(x, 32)


def _avalanche_xxh64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 33)
    x = x * _s64(ref.PRIME64_2)
    x = x ^ _lsr(x, 29)
    x = x * _s64(ref.PRIME64_3)
    return x ^ _lsr(x, 32)


def _bswap64(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for k in range(8):
        out = out | ((_lsr(x, 8 * k) & 0xFF) << (8 * (7 - k)))
    return out


def _word(b: torch.Tensor, off: int, width: int = 8) -> torch.Tensor:
    """Little-endian unsigned word of `width` bytes at byte `off` of every row of uint8 [M, L]."""
    w = b[:, off : off + width].to(torch.int64)
    out = w[:, 0].clone()
    for k in range(1, width):
        out |= w[:, k] << (8 * k)
    return out


def _secret(off: int, width: int = 8) -> int:
    return _s64(int.from_bytes(ref.SECRET[off : off + width], "little"))


def _0to16(b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = b.shape[0]
    if n == 0:
        low, high = ref._0to16(b"", 0)
        full = lambda v: torch.full((m,), _s64(v), dtype=torch.int64, device=b.device)  # noqa: E731
        return full(low), full(high)
    if n <= 3:
        c = b.to(torch.int64)
        combined = c[:, n - 1] | (n << 8) | (c[:, 0] << 16) | (c[:, n >> 1] << 24)
        swapped = (((combined & 0xFF) << 24) | (((combined >> 8) & 0xFF) << 16) | (((combined >> 16) & 0xFF) << 8)
                   | (combined >> 24))
        rot = ((swapped << 13) | (swapped >> 19)) & ref.M32
        low = (_secret(0, 4) ^ _secret(4, 4)) ^ combined
        high = (_secret(8, 4) ^ _secret(12, 4)) ^ rot
        return _avalanche_xxh64(low), _avalanche_xxh64(high)
    if n <= 8:
        combined = _word(b, 0, 4) | (_word(b, n - 4, 4) << 32)
        value = (_secret(16) ^ _secret(24)) ^ combined
        low, high = _mul128(value, (ref.PRIME64_1 + (n << 2)) & ref.M64)
        high = high + (low << 1)
        low = low ^ _lsr(high, 3)
        low = low ^ _lsr(low, 35)
        low = low * _s64(ref.PRIME_MX2)
        low = low ^ _lsr(low, 28)
        return low, _avalanche(high)
    first, last = _word(b, 0), _word(b, n - 8)
    val1 = (_secret(32) ^ _secret(40)) ^ first ^ last
    val2 = (_secret(48) ^ _secret(56)) ^ last
    low, high = _mul128(val1, ref.PRIME64_1)
    low = low + ((n - 1) << 54)
    high = high + (_lsr(val2, 32) << 32) + _lo32(val2) * ref.PRIME32_2
    low = low ^ _bswap64(high)
    low2, high2 = _mul128(low, ref.PRIME64_2)
    high = high2 + high * _s64(ref.PRIME64_2)
    return _avalanche(low2), _avalanche(high)


def _mix32(acc0, acc1, b, off1, off2, s_off):
    d1a, d1b, d2a, d2b = _word(b, off1), _word(b, off1 + 8), _word(b, off2), _word(b, off2 + 8)
    acc0 = acc0 + _fold(d1a ^ _secret(s_off), d1b ^ _secret(s_off + 8))
    acc1 = acc1 + _fold(d2a ^ _secret(s_off + 16), d2b ^ _secret(s_off + 24))
    return acc0 ^ (d2a + d2b), acc1 ^ (d1a + d1b)


def _17to240(b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    acc0 = torch.full((b.shape[0],), _s64((n * ref.PRIME64_1) & ref.M64), dtype=torch.int64, device=b.device)
    acc1 = torch.zeros_like(acc0)
    if n <= 128:
        for i in reversed(range(((n - 1) >> 5) + 1)):
            acc0, acc1 = _mix32(acc0, acc1, b, 16 * i, n - 16 * i - 16, 32 * i)
    else:
        for i in range(4):
            acc0, acc1 = _mix32(acc0, acc1, b, 32 * i, 32 * i + 16, 32 * i)
        acc0, acc1 = _avalanche(acc0), _avalanche(acc1)
        for i in range(4, n >> 5):
            acc0, acc1 = _mix32(acc0, acc1, b, 32 * i, 32 * i + 16, 32 * (i - 4) + 3)
        acc0, acc1 = _mix32(acc0, acc1, b, n - 16, n - 32, 103)
    low = acc0 + acc1
    high = acc0 * _s64(ref.PRIME64_1) + acc1 * _s64(ref.PRIME64_4) + _s64((n * ref.PRIME64_2) & ref.M64)
    return _avalanche(low), -_avalanche(high)


_LARGE_CONSTANTS: dict[torch.device, torch.Tensor] = {}


def _large_constants(device: torch.device) -> torch.Tensor:
    """int64 [19, 8], once per device (a host-to-device copy per call would wait for the
    stream): rows 0..15 the secret words of stripe s of a block, row 16 those of the last
    stripe, row 17 the scramble's, row 18 the initial accumulators."""
    found = _LARGE_CONSTANTS.get(device)
    if found is None:
        n = len(ref.SECRET)
        rows = [[_secret(8 * s + 8 * i) for i in range(8)] for s in range(ref.STRIPES_PER_BLOCK)]
        rows.append([_secret(n - 71 + 8 * i) for i in range(8)])
        rows.append([_secret(n - 64 + 8 * i) for i in range(8)])
        rows.append([_s64(a) for a in ref.INIT_ACC])
        found = _LARGE_CONSTANTS[device] = torch.tensor(rows, dtype=torch.int64, device=device)
    return found


def _stripe_sums(words: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """words int64 [M, S, 8], keys [S, 8] -> (sum of products, sum of lane-swapped words) over S: [M, 8] each."""
    v = words ^ keys
    prod = (_lo32(v) * _lsr(v, 32)).sum(dim=1)
    data = words.sum(dim=1)
    return prod, data.view(-1, 4, 2).flip(-1).reshape(-1, 8)


def _words_at(b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """int64 [M, count] little-endian words from byte `start` of each row (start a multiple of 8)."""
    part = b[:, start : start + 8 * count]
    flat = (part if part.is_contiguous() else part.contiguous()).reshape(-1)
    try:
        return flat.view(torch.int64).view(-1, count)
    except RuntimeError:  # bytes starting off an 8-byte boundary
        return flat.clone().view(torch.int64).view(-1, count)


def _large(b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # words are viewed in the device's byte order: little-endian on CUDA and x86/ARM hosts
    if sys.byteorder != "little":
        raise RuntimeError("the torch XXH3 path reads words in little-endian byte order")
    m, dev = b.shape[0], b.device
    consts = _large_constants(dev)
    keys, scramble = consts[: ref.STRIPES_PER_BLOCK + 1], consts[ref.STRIPES_PER_BLOCK + 1]
    n_blocks = (n - 1) // ref.BLOCK
    tail_stripes = (n - n_blocks * ref.BLOCK - 1) // ref.STRIPE
    acc = consts[ref.STRIPES_PER_BLOCK + 2].repeat(m, 1)
    if n_blocks:
        words = _words_at(b, 0, n_blocks * ref.BLOCK // 8).view(m, n_blocks, ref.STRIPES_PER_BLOCK, 8)
        v = words ^ keys[: ref.STRIPES_PER_BLOCK]
        prods = (_lo32(v) * _lsr(v, 32)).sum(dim=2)  # [M, blocks, 8]: order within a block does not matter
        datas = words.sum(dim=2).view(m, n_blocks, 4, 2).flip(-1).reshape(m, n_blocks, 8)
        step = prods + datas
        for k in range(n_blocks):  # only the scrambles are sequential
            acc = acc + step[:, k]
            acc = ((acc ^ _lsr(acc, 47)) ^ scramble) * ref.PRIME32_1
    start = n_blocks * ref.BLOCK
    if tail_stripes:
        words = _words_at(b, start, tail_stripes * 8).view(m, tail_stripes, 8)
        prod, data = _stripe_sums(words, keys[:tail_stripes])
        acc = acc + prod + data
    last = torch.stack([_word(b, n - ref.STRIPE + 8 * i) for i in range(8)], dim=1).view(m, 1, 8)
    prod, data = _stripe_sums(last, keys[ref.STRIPES_PER_BLOCK :])
    acc = acc + prod + data
    return (_merge(acc, (n * ref.PRIME64_1) & ref.M64, 11),
            _merge(acc, ~(n * ref.PRIME64_2) & ref.M64, len(ref.SECRET) - 75))


def _merge(acc: torch.Tensor, init: int, s_off: int) -> torch.Tensor:
    r = torch.full((acc.shape[0],), _s64(init), dtype=torch.int64, device=acc.device)
    for i in range(4):
        r = r + _fold(acc[:, 2 * i] ^ _secret(s_off + 16 * i), acc[:, 2 * i + 1] ^ _secret(s_off + 16 * i + 8))
    return _avalanche(r)


def _canonical(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(low, high) int64 [M] -> uint8 [M, 16]: high64 then low64, big-endian."""
    shifts = torch.arange(56, -8, -8, device=low.device)
    words = torch.stack([high, low], dim=1).unsqueeze(-1)
    return ((words >> shifts) & 0xFF).to(torch.uint8).reshape(-1, 16)


def xxh3_128_rows(b: torch.Tensor) -> torch.Tensor:
    """XXH3-128 of every row of uint8 [M, L] (all rows of one length): uint8 [M, 16] on their device."""
    if b.dtype != torch.uint8 or b.dim() != 2:
        raise ValueError("xxh3_128_rows expects a uint8 tensor of shape [rows, bytes]")
    n = b.shape[1]
    if n <= 16:
        low, high = _0to16(b, n)
    elif n <= 240:
        low, high = _17to240(b, n)
    else:
        low, high = _large(b, n)
    return _canonical(low, high)


def row_chunk_digests(rows: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """uint8 [R, N] -> uint8 [R, n_chunks, 16]: the chunk digests of every row, on their device."""
    r, n = rows.shape
    n_full, tail = divmod(n, chunk_bytes)
    out = torch.empty((r, n_full + (1 if tail else 0), 16), dtype=torch.uint8, device=rows.device)
    if r == 0:
        return out
    if n_full:
        full = rows[:, : n_full * chunk_bytes]
        for i in range(r):
            row = full[i] if full[i].is_contiguous() else full[i].contiguous()
            chunks = row.view(n_full, chunk_bytes)
            for s in range(0, n_full, _BATCH):
                out[i, s : min(s + _BATCH, n_full)] = xxh3_128_rows(chunks[s : s + _BATCH])
    if tail:
        out[:, n_full] = xxh3_128_rows(rows[:, n_full * chunk_bytes :])
    return out
