"""The fingerprint's lanes as one fused Triton kernel (GPU; CPU under TRITON_INTERPRET=1).

Each program takes BLOCK_M (row, chunk) pairs of a uint8 [R, N] tensor, reads
each byte once and accumulates its chunks' int8 x int8 -> int32 lanes with
tl.dot against the fixed key matrix. Exact integer arithmetic: the result is
bit-identical to fingerprint.py's CPU path (tests run it under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32  # (row, chunk) pairs per program
BLOCK_K = 256  # bytes per pair per step


@triton.jit
def _lanes_kernel(src, keys, out, n_pairs, n_chunks, row_bytes, row_stride,
                  CHUNK: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = pair < n_pairs
    row = (pair // n_chunks).to(tl.int64)
    start = (pair % n_chunks).to(tl.int64) * CHUNK
    length = tl.minimum(row_bytes - start, CHUNK)  # a row's last chunk may be short
    base = src + row * row_stride + start
    lane = tl.arange(0, LANES)
    acc = tl.zeros((BLOCK_M, LANES), dtype=tl.int32)
    k_end = tl.minimum(row_bytes, CHUNK)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(base[:, None] + k[None, :], mask=valid[:, None] & (k[None, :] < length[:, None]), other=0)
        b = tl.load(keys + k[:, None] * LANES + lane[None, :], mask=k[:, None] < k_end, other=0)
        acc = tl.dot(a, b, acc)
    tl.store(out + pair[:, None].to(tl.int64) * LANES + lane[None, :], acc, mask=valid[:, None])


def row_lanes(rows: torch.Tensor, keys: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """rows uint8 [R, N] (unit stride along N), keys int8 [chunk_bytes, LANES] on the
    same device -> int32 [R, n_chunks, LANES] on that device."""
    r, n = rows.shape
    lanes = keys.shape[1]
    n_chunks = -(-n // chunk_bytes)
    out = torch.empty((r, n_chunks, lanes), dtype=torch.int32, device=rows.device)
    n_pairs = r * n_chunks
    if n_pairs == 0:
        return out
    grid = (triton.cdiv(n_pairs, BLOCK_M),)
    _lanes_kernel[grid](rows.view(torch.int8), keys, out, n_pairs, n_chunks, n, rows.stride(0),
                        CHUNK=chunk_bytes, LANES=lanes, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return out
