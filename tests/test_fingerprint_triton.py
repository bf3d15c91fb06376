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
    from moetrace.fingerprint import triton_path as fingerprint_triton

    if not type(fingerprint_triton._xxh3_128_chunks).__name__.startswith("Interpreted"):
        pytest.skip("the Triton kernel was compiled before TRITON_INTERPRET was set")
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def _want(rows: np.ndarray, chunk: int = C) -> np.ndarray:
    return np.stack([np.frombuffer(b"".join(xxhash.xxh3_128(r[o : o + chunk].tobytes()).digest()
                                            for o in range(0, len(r), chunk)), np.uint8).reshape(-1, 16) for r in rows])


def _rows(n: int, kind: str, rows: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)
    return torch.full((rows, n), 0 if kind == "zeros" else 255, dtype=torch.uint8)


# Row lengths around XXH3's paths (up to 240 bytes the row's chunk takes the torch path
# after the launch), a last block of 1 stripe and of 15, whole words (word loads) and odd
# lengths (byte loads).
LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 2 * 1024 + 1000]


def test_triton_kernel_equals_xxhash(interpreted):
    g = torch.Generator().manual_seed(7)
    cases = [(n, "random") for n in LENGTHS] + [(n, kind) for n in LENGTHS if n > 240 for kind in ("zeros", "0xFF")]
    for n, kind in cases:
        x = _rows(n, kind, 2, g)
        got = F.row_chunk_digests(x, "triton")
        assert got.dtype == torch.uint8 and got.shape == (2, F.n_chunks_for(n), 16)
        assert np.array_equal(got.numpy(), _want(x.numpy())), (n, kind)


def test_triton_chunks_of_a_row(interpreted):
    """Several chunks per row and a row's last chunk at every boundary, with 4 KiB chunks (the
    interpreter runs a 64 KiB chunk in seconds: the kernel takes the chunk size as a constant),
    then one real 64 KiB chunk and a short tail."""
    from moetrace.fingerprint.triton_path import row_chunk_digests

    g = torch.Generator().manual_seed(8)
    small = 4096
    cases = [(n, "random") for n in (small + 1, 2 * small + 240, 3 * small - 3)] + [(2 * small + 248, k) for k in ("zeros", "0xFF")]
    for n, kind in cases:
        x = _rows(n, kind, 1, g)
        assert np.array_equal(row_chunk_digests(x, small).numpy(), _want(x.numpy(), small)), (n, kind)
    x = _rows(C + 8, "random", 1, g)
    assert np.array_equal(F.row_chunk_digests(x, "triton").numpy(), _want(x.numpy()))


def test_triton_on_strided_rows(interpreted):
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 256, (3, 3000), dtype=torch.uint8, generator=g)
    view = big[:, 8:2048]  # row stride is not the row length
    assert F.fingerprint_rows(view, "triton") == F.fingerprint_rows(view.contiguous(), "xxhash")
