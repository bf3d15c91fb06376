"""fingerprint: the version-2 definition, exactness across paths, sensitivity, chunk localization."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from moetrace import fingerprint as F

C = F.CHUNK_BYTES
SIZES = [0, 1, 7, 8, 100, C - 1, C, C + 1, 2 * C + 11]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _reference_digest(data: bytes) -> tuple[bytes, bytes]:
    """Steps 2-4 of docs/fingerprint.md with Python integers (no numpy products)."""
    keys = F.LANE_KEYS[: min(len(data), C)].astype(int).tolist()
    fold = [[int(k) for k in row] for row in F.FOLD_KEYS]
    chunks = b""
    for s in range(0, len(data), C):
        chunk = data[s : s + C]
        lanes = [0] * F.LANES
        for i, b in enumerate(chunk):
            v = b - 256 if b >= 128 else b
            if v:
                for j in range(F.LANES):
                    lanes[j] += keys[i][j] * v
        u = b"".join(x.to_bytes(4, "little", signed=True) for x in lanes) + len(chunk).to_bytes(4, "little")
        words = [sum(ui * fold[i][t] for i, ui in enumerate(u)) % (1 << 64) for t in range(2)]
        chunks += b"".join(w.to_bytes(8, "little") for w in words)
    digest = hashlib.blake2b(len(data).to_bytes(8, "little") + chunks, digest_size=16, person=b"moetrace.tensor2").digest()
    return digest, chunks


@pytest.mark.parametrize("n", [1, 5, 129, 300])
def test_digest_matches_the_definition(n):
    x = _bytes(n, seed=n)
    want = _reference_digest(x.numpy().tobytes())
    for method in ("numpy", "torch"):
        f = F.fingerprint(x, method)
        assert (f.digest, f.chunk_digests) == want, method


def test_keys_are_as_documented():
    k = F.LANE_KEYS
    assert k.shape == (C, F.LANES) and k.dtype == np.int8
    assert not (k == 0).any() and k.min() == -F.KEY_LIMIT and k.max() == F.KEY_LIMIT
    assert len(np.unique(k)) == 2 * F.KEY_LIMIT  # all 128 values occur
    counts = np.unique(k, return_counts=True)[1]
    assert counts.min() > 0.9 * k.size / 128  # close to uniform
    assert F.FOLD_KEYS.shape == (4 * F.LANES + 4, 2) and len(np.unique(F.FOLD_KEYS)) == F.FOLD_KEYS.size


@pytest.mark.parametrize("n", SIZES)
def test_torch_path_equals_the_reference(n):
    x = _bytes(n, seed=n + 1).reshape(1, -1)
    ref = F.row_lanes(x, "numpy")
    assert ref.shape == (1, F.n_chunks_for(n), F.LANES) and ref.dtype == np.int32
    assert np.array_equal(F.row_lanes(x, "torch").numpy(), ref)


def test_torch_threads_do_not_change_the_lanes():
    """The suite runs torch single-threaded (tests/conftest.py); servers do not: the torch
    path gives the same lanes with several threads, on rows big enough to be split."""
    x = _bytes(8 * (8 * C + 5), seed=11).reshape(8, -1)
    ref = F.row_lanes(x, "numpy")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            assert np.array_equal(F.row_lanes(x, "torch").numpy(), ref), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_extreme_bytes_give_the_largest_lanes_exactly():
    for value in (-128, 127):
        x = torch.full((2, C), value, dtype=torch.int8).view(torch.uint8)
        want = (value * F.LANE_KEYS.astype(np.int64).sum(axis=0)).astype(np.int32)
        assert np.array_equal(F.row_lanes(x, "torch").numpy()[:, 0], np.stack([want, want]))
    assert F._int_mm_is_exact(torch.device("cpu"))


def test_float64_fallback_equals_int_mm(monkeypatch):
    x = _bytes(3 * (2 * C + 5), seed=3).reshape(3, -1)
    want = F.row_lanes(x, "torch").numpy()
    monkeypatch.setitem(F._EXACT_INT_MM, torch.device("cpu"), False)
    assert np.array_equal(F.row_lanes(x, "torch").numpy(), want)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.uint8, torch.int64]
)
def test_dtypes_rows_and_views(dtype):
    raw = _bytes(6 * 3000 * 8, seed=4)
    t = raw.view(dtype).reshape(6, -1)
    rows = F.fingerprint_rows(t)
    assert [r.digest for r in rows] == [F.fingerprint(t[i]).digest for i in range(6)]
    strided = t[:, 1:-1]  # rows that are not contiguous in memory
    assert F.fingerprint_rows(strided) == F.fingerprint_rows(strided.contiguous())
    assert F.fingerprint(t.t()) == F.fingerprint(t.t().contiguous())


def test_dtype_and_shape_are_not_folded_in():
    x = _bytes(4096, seed=5)
    assert F.fingerprint(x).digest == F.fingerprint(x.view(torch.float32).reshape(32, 32)).digest


@pytest.mark.parametrize("n", [9, C + 3])
def test_every_single_bit_flip_changes_every_lane(n):
    x = _bytes(n, seed=6)
    base = F.row_lanes(x.reshape(1, -1), "torch").numpy()
    flips = [(p, b) for p in range(n) for b in range(8)] if n < 64 else [(0, 7), (C - 1, 0), (C, 7), (n - 1, 3)]
    digest = F.fingerprint(x)
    for pos, bit in flips:
        y = x.clone()
        y[pos] ^= 1 << bit
        lanes = F.row_lanes(y.reshape(1, -1), "torch").numpy()
        chunk = pos // C
        assert (lanes[0, chunk] != base[0, chunk]).all(), (pos, bit)
        assert F.fingerprint(y) != digest


def test_top_bit_pairs_and_cancelling_pairs_are_seen():
    x = _bytes(4 * C, seed=7)
    base = F.fingerprint(x)
    for i, j in ((7, 15), (7, 8 * 1000 + 7), (C - 1, C + 7), (0, 1)):
        y = x.clone()
        y[i] ^= 0x80
        y[j] ^= 0x80
        assert F.fingerprint(y) != base, (i, j)
    # the difference (+1 at p, -1 at q) cancels only where the keys are equal
    y = x.clone()
    p, q = 3, 4
    y[p], y[q] = (int(x[p]) + 1) % 256, (int(x[q]) - 1) % 256
    assert F.fingerprint(y) != base


def test_swapped_chunks_and_lengths_differ():
    x = _bytes(3 * C, seed=8)
    swapped = torch.cat([x[C : 2 * C], x[:C], x[2 * C :]])
    a, b = F.fingerprint(x), F.fingerprint(swapped)
    assert a.digest != b.digest and a.chunk(0) == b.chunk(1) and a.chunk(1) == b.chunk(0)
    assert F.fingerprint(x[:100]) != F.fingerprint(torch.cat([x[:100], torch.zeros(1, dtype=torch.uint8)]))
    assert F.fingerprint(torch.zeros(C, dtype=torch.uint8)) != F.fingerprint(torch.zeros(C - 1, dtype=torch.uint8))


def test_torn_copy_is_localized_to_chunks():
    a, b = _bytes(4 * C, seed=9), _bytes(4 * C, seed=10)
    torn = torch.cat([a[: 2 * C], b[2 * C :]])
    fa, fb, ft = F.fingerprint(a), F.fingerprint(b), F.fingerprint(torn)
    assert [ft.chunk(i) == fa.chunk(i) for i in range(4)] == [True, True, False, False]
    assert [ft.chunk(i) == fb.chunk(i) for i in range(4)] == [False, False, True, True]


def test_unrelated_contents_do_not_collide():
    digests = {F.fingerprint(_bytes(1000, seed=s)).digest for s in range(200)}
    assert len(digests) == 200


def test_many_and_bytes_entry_points():
    ts = [_bytes(n, seed=n) for n in (10, C + 1)]
    assert F.fingerprint_many(ts) == [F.fingerprint(t) for t in ts]
    assert F.fingerprint_bytes(ts[1].numpy().tobytes()) == F.fingerprint(ts[1])


def test_known_answers_are_stable():
    # Digests stored in indexes and traces depend on these exact values: a change
    # must bump FP_VERSION (readers refuse other versions) and these values together.
    assert F.FP_VERSION == 2
    assert F.fingerprint(torch.arange(10, dtype=torch.uint8)).hex() == "385c7e18783140d8ea6e81ff2d682420"


def test_row_lanes_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        F.row_lanes(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="unknown fingerprint method"):
        F.row_lanes(torch.zeros(1, 4, dtype=torch.uint8), "blake")
    with pytest.raises(ValueError, match="do not fit"):
        F.finalize(np.zeros((1, 2, F.LANES), dtype=np.int32), 10)
