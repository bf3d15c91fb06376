"""The fused Triton kernel, run by Triton's interpreter on CPU: bit for bit xxhash."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

from moetrace import fingerprint as F

C = F.CHUNK_BYTES


@pytest.fixture(scope="module")
def interpreted():
    """TRITON_INTERPRET must be set before the kernel module is first imported:
    triton.jit reads it when it decorates the kernel."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    from moetrace import fingerprint_triton

    if not type(fingerprint_triton._xxh3_128_chunks).__name__.startswith("Interpreted"):
        pytest.skip("the Triton kernel was compiled before TRITON_INTERPRET was set")
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def _want(rows: np.ndarray) -> np.ndarray:
    return np.stack([np.frombuffer(b"".join(xxhash.xxh3_128(r[o : o + C].tobytes()).digest()
                                            for o in range(0, len(r), C)), np.uint8).reshape(-1, 16) for r in rows])


# Row lengths around XXH3's paths (short ones go to the torch path after the launch), a
# last block of 1 stripe and of 15, whole words and odd lengths (byte loads). The
# interpreter runs a 64 KiB chunk in about a second: lengths of several chunks are few.
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 2 * 1024 + 1000]
CHUNKS = [C - 1, C, 2 * C + 8]  # byte loads, word loads, two chunks and a short tail


def test_triton_kernel_equals_xxhash(interpreted):
    g = torch.Generator().manual_seed(7)
    cases = [(n, kind) for n in LENGTHS for kind in ("random", "zeros", "0xFF")] + [(n, "random") for n in CHUNKS]
    for n, kind in cases:
        rows = 2 if n < C else 1
        if kind == "random":
            x = torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)
        else:
            x = torch.full((rows, n), 0 if kind == "zeros" else 255, dtype=torch.uint8)
        got = F.row_chunk_digests(x, "triton")
        assert got.dtype == torch.uint8 and got.shape == (rows, F.n_chunks_for(n), 16)
        assert np.array_equal(got.numpy(), _want(x.numpy())), (n, kind)


def test_triton_on_strided_rows(interpreted):
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 256, (3, 3000), dtype=torch.uint8, generator=g)
    view = big[:, 8:2048]  # row stride is not the row length
    assert F.fingerprint_rows(view, "triton") == F.fingerprint_rows(view.contiguous(), "xxhash")
