"""XXH3-128 chunk digests of every row of a uint8 [R, N] tensor in one Triton launch
(CUDA; CPU under TRITON_INTERPRET=1, which the tests use).

One program per (row, chunk). XXH3's long-input loop: within a 1 KiB block the 16
stripes' contributions to the 8 accumulators are independent wrapping uint64 sums,
computed in parallel ([16 stripes, 4 lane pairs]); only the block-to-block scrambles
are sequential. Accumulators are held as even and odd lanes (4 each), so the lane
swap of the data term is a swap of the two vectors. 64 x 64 -> 128-bit products are
built from 32-bit halves. Chunks of at most 240 bytes (a row's last chunk, rarely)
take XXH3's short paths in plain torch (torch_path.py) after the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrace.fingerprint import reference as ref
from moetrace.fingerprint.reference import s64 as _s64
from moetrace.fingerprint.torch_path import xxh3_128_rows

_CONSTS: dict[torch.device, torch.Tensor] = {}
# The constants tensor: uint64 bits as int64, at these offsets (the kernel names them).
# stripes 0, last stripe 128, scramble 136, merge low 144, merge high 152, initial accumulators 160, primes 168


def _constants(device: torch.device) -> torch.Tensor:
    """Secret words per stripe [16, 8]; the last stripe's, the scramble's and the two
    merges' [8] each; the initial accumulators [8]; PRIME64_1, PRIME64_2, PRIME_MX1."""
    found = _CONSTS.get(device)
    if found is None:
        n = len(ref.SECRET)
        word = lambda off: _s64(int.from_bytes(ref.SECRET[off : off + 8], "little"))  # noqa: E731
        vals = [word(8 * s + 8 * i) for s in range(ref.STRIPES_PER_BLOCK) for i in range(8)]
        for off in (n - 71, n - 64, 11, n - 75):
            vals += [word(off + 8 * i) for i in range(8)]
        vals += [_s64(v) for v in (*ref.INIT_ACC, ref.PRIME64_1, ref.PRIME64_2, ref.PRIME_MX1)]
        found = _CONSTS[device] = torch.tensor(vals, dtype=torch.int64, device=device)
    return found


@triton.jit
def _u64(src, byte_off, mask, WORDS: tl.constexpr):
    """Little-endian uint64 words at byte offsets `byte_off` (multiples of 8 when WORDS)."""
    if WORDS:
        w = tl.load(src + byte_off // 8, mask=mask, other=0).to(tl.uint64, bitcast=True)
    else:
        w = tl.zeros(byte_off.shape, dtype=tl.uint64)
        for k in tl.static_range(8):
            b = tl.load(src + byte_off + k, mask=mask, other=0).to(tl.uint64)
            w = w | (b << (8 * k))
    return w


@triton.jit
def _fold128(a, b):
    """Low xor high 64 bits of the 128-bit product of uint64 a and b."""
    m32 = 0xFFFFFFFF
    a0, a1 = a & m32, a >> 32
    b0, b1 = b & m32, b >> 32
    ll, lh, hl, hh = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (ll >> 32) + (lh & m32) + (hl & m32)
    low = (mid << 32) | (ll & m32)
    high = hh + (lh >> 32) + (hl >> 32) + (mid >> 32)
    return low ^ high


@triton.jit
def _avalanche(x, mx1):
    x = x ^ (x >> 37)
    x = x * mx1
    return x ^ (x >> 32)


@triton.jit
def _xxh3_128_chunks(src, out, consts, n_chunks, out_chunks, row_bytes, row_stride,
                     CHUNK: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // n_chunks).to(tl.int64)
    ci = (pid % n_chunks).to(tl.int64)
    start = ci * CHUNK
    n = tl.minimum(row_bytes - start, CHUNK)  # > 240: shorter chunks take the short paths elsewhere
    base = row * row_stride + start  # byte offset of the chunk
    m32 = 0xFFFFFFFF

    s = tl.arange(0, 16)[:, None]  # stripe within a block
    j = tl.arange(0, 4)[None, :]  # lane pair: lanes 2j (even) and 2j + 1 (odd)
    key_e = tl.load(consts + s * 8 + 2 * j).to(tl.uint64, bitcast=True)
    key_o = tl.load(consts + s * 8 + 2 * j + 1).to(tl.uint64, bitcast=True)
    jj = tl.arange(0, 4)
    scr_e = tl.load(consts + 136 + 2 * jj).to(tl.uint64, bitcast=True)
    scr_o = tl.load(consts + 136 + 2 * jj + 1).to(tl.uint64, bitcast=True)
    p64_1 = tl.load(consts + 168).to(tl.uint64, bitcast=True)
    p64_2 = tl.load(consts + 169).to(tl.uint64, bitcast=True)
    mx1 = tl.load(consts + 170).to(tl.uint64, bitcast=True)
    p32_1 = tl.full((4,), 0x9E3779B1, tl.uint64)
    acc_e = tl.load(consts + 160 + 2 * jj).to(tl.uint64, bitcast=True)
    acc_o = tl.load(consts + 160 + 2 * jj + 1).to(tl.uint64, bitcast=True)

    n_blocks = (n - 1) // 1024
    for b in range(0, n_blocks):
        off = base + b * 1024 + s * 64 + 16 * j
        we = _u64(src, off, s < 16, WORDS)
        wo = _u64(src, off + 8, s < 16, WORDS)
        ve, vo = we ^ key_e, wo ^ key_o
        acc_e += tl.sum((ve & m32) * (ve >> 32), axis=0) + tl.sum(wo, axis=0)
        acc_o += tl.sum((vo & m32) * (vo >> 32), axis=0) + tl.sum(we, axis=0)
        acc_e = ((acc_e ^ (acc_e >> 47)) ^ scr_e) * p32_1
        acc_o = ((acc_o ^ (acc_o >> 47)) ^ scr_o) * p32_1
    # the last block: its whole stripes but the last, then the last 64 bytes as a stripe
    tail = (n - n_blocks * 1024 - 1) // 64
    live = s < tail
    off = base + n_blocks * 1024 + s * 64 + 16 * j
    we = _u64(src, off, live, WORDS)
    wo = _u64(src, off + 8, live, WORDS)
    ve, vo = we ^ key_e, wo ^ key_o
    acc_e += tl.sum(tl.where(live, (ve & m32) * (ve >> 32), 0), axis=0) + tl.sum(wo, axis=0)
    acc_o += tl.sum(tl.where(live, (vo & m32) * (vo >> 32), 0), axis=0) + tl.sum(we, axis=0)
    off1 = base + n - 64 + 16 * jj
    we1 = _u64(src, off1, jj < 4, WORDS)
    wo1 = _u64(src, off1 + 8, jj < 4, WORDS)
    ve1 = we1 ^ tl.load(consts + 128 + 2 * jj).to(tl.uint64, bitcast=True)
    vo1 = wo1 ^ tl.load(consts + 128 + 2 * jj + 1).to(tl.uint64, bitcast=True)
    acc_e += (ve1 & m32) * (ve1 >> 32) + wo1
    acc_o += (vo1 & m32) * (vo1 >> 32) + we1

    length = n.to(tl.uint64)
    k_lo_e = tl.load(consts + 144 + 2 * jj).to(tl.uint64, bitcast=True)
    k_lo_o = tl.load(consts + 144 + 2 * jj + 1).to(tl.uint64, bitcast=True)
    k_hi_e = tl.load(consts + 152 + 2 * jj).to(tl.uint64, bitcast=True)
    k_hi_o = tl.load(consts + 152 + 2 * jj + 1).to(tl.uint64, bitcast=True)
    low = _avalanche(length * p64_1 + tl.sum(_fold128(acc_e ^ k_lo_e, acc_o ^ k_lo_o), axis=0), mx1)
    high = _avalanche(~(length * p64_2) + tl.sum(_fold128(acc_e ^ k_hi_e, acc_o ^ k_hi_o), axis=0), mx1)

    k = tl.arange(0, 16)
    word = tl.where(k < 8, high, low)
    byte = ((word >> (56 - 8 * (k % 8)).to(tl.uint64)) & 0xFF).to(tl.uint8)
    tl.store(out + (row * out_chunks + ci) * 16 + k, byte)


def row_chunk_digests(rows: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """rows uint8 [R, N] (unit stride along N) -> uint8 [R, n_chunks, 16] on their device."""
    r, n = rows.shape
    n_full, tail = divmod(n, chunk_bytes)
    n_chunks = n_full + (1 if tail else 0)
    out = torch.empty((r, n_chunks, 16), dtype=torch.uint8, device=rows.device)
    if r == 0 or n == 0:
        return out
    short_tail = 0 < (n if n < chunk_bytes else tail) <= 240
    in_kernel = n_chunks - (1 if short_tail else 0)
    if in_kernel:
        words = rows.is_contiguous() and n % 8 == 0 and rows.data_ptr() % 8 == 0  # whole words: one load each
        src = rows.view(torch.int64) if words else rows
        _xxh3_128_chunks[(r * in_kernel,)](src, out, _constants(rows.device), in_kernel, n_chunks, n,
                                           rows.stride(0), CHUNK=chunk_bytes, WORDS=words, num_warps=1)
    if short_tail:
        out[:, n_chunks - 1] = xxh3_128_rows(rows[:, (n_chunks - 1) * chunk_bytes :])
    return out
