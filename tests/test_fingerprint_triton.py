"""The fused Triton kernel, run by Triton's interpreter on CPU: bit for bit the CPU path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

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

    if not type(fingerprint_triton._lanes_kernel).__name__.startswith("Interpreted"):
        pytest.skip("the Triton kernel was compiled before TRITON_INTERPRET was set")
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 100), (33, 384), (2, C + 5)])
def test_triton_kernel_equals_the_reference(interpreted, monkeypatch, rows, n):
    from moetrace import fingerprint_triton

    if n > C:  # the interpreter runs one numpy step per block: wider blocks, same sums
        monkeypatch.setattr(fingerprint_triton, "BLOCK_K", 4096)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)
    got = F.row_lanes(x, "triton")
    assert got.dtype == torch.int32 and got.shape == (rows, F.n_chunks_for(n), F.LANES)
    assert np.array_equal(got.numpy(), F.row_lanes(x, "numpy"))


def test_triton_on_strided_rows_and_extremes(interpreted):
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 256, (3, 3000), dtype=torch.uint8, generator=g)
    view = big[:, 7:2040]  # row stride is not the row length
    big[1] = 128  # -128 as int8: the largest lanes
    want = F.fingerprint_rows(view, "torch")
    assert F.fingerprint_rows(view, "triton") == want
