"""tracer.fingerprint: exactness across paths, sensitivity, chunk localization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import fingerprint as F

C = F.CHUNK_BYTES
SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 17, 100, C - 5, C - 4, C - 1, C, C + 1, C + 4, C + 12, 2 * C + 11, 3 * C]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _reference_lanes(data: bytes) -> list[tuple[int, int, int, int]]:
    """Lanes from the definition with Python integers: chunk zero-padded to C,
    aligned words and words starting 4 bytes in, dot with the keys mod 2^64."""
    mask = (1 << 64) - 1
    ka = [[int(k) for k in F.KEYS_ALIGNED[:, j]] for j in range(2)]
    kb = [[int(k) for k in F.KEYS_OFFSET[:, j]] for j in range(2)]
    out = []
    for s in range(0, len(data), C):
        chunk = data[s : s + C].ljust(C, b"\0")
        aligned = [int.from_bytes(chunk[8 * i : 8 * i + 8], "little") for i in range(C // 8)]
        offset = [int.from_bytes(chunk[4 + 8 * i : 12 + 8 * i], "little") for i in range(C // 8 - 1)]
        lanes = []
        for words, keys in ((aligned, ka), (offset, kb)):
            for k in keys:
                lanes.append(sum(w * kk for w, kk in zip(words, k) if w) & mask)
        out.append(tuple(lanes))
    return out


@pytest.mark.parametrize("n", [1, 5, 13, 100, C + 12])
def test_lanes_match_the_definition(n):
    x = _bytes(n, seed=n)
    expected = _reference_lanes(x.numpy().tobytes())
    for method in ("numpy", "torch"):
        lanes = F.row_lanes(x.reshape(1, -1), method)
        got = np.asarray(lanes.numpy() if isinstance(lanes, torch.Tensor) else lanes).view(np.uint64)[0]
        assert [tuple(int(v) for v in row) for row in got] == expected, method


@pytest.mark.parametrize("n", SIZES)
def test_numpy_and_torch_paths_agree(n):
    x = _bytes(n, seed=n + 1)
    a = F.fingerprint(x, "numpy", threads=False)
    b = F.fingerprint(x, "torch")
    c = F.fingerprint(x, "numpy", threads=True)
    assert a == b == c
    assert a.nbytes == n and a.n_chunks == F.n_chunks_for(n) and len(a.digest) == 16


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64]
)
def test_dtypes_rows_and_views(dtype):
    g = torch.Generator().manual_seed(7)
    t = (torch.randn(5, 130, 203, generator=g) * 4).to(dtype)
    rows_np = F.fingerprint_rows(t, "numpy")
    rows_t = F.fingerprint_rows(t, "torch")
    assert rows_np == rows_t
    assert rows_np[3] == F.fingerprint(t[3])
    # A non-contiguous view hashes its logical C-order contents.
    view = t.transpose(1, 2)
    assert F.fingerprint(view, "numpy") == F.fingerprint(view.contiguous(), "torch")
    assert F.fingerprint(view) != F.fingerprint(t) or t.shape[1] == t.shape[2]


@pytest.mark.parametrize("block", [1, 2, 3])
def test_torch_rows_with_tails_in_bounded_groups(block, monkeypatch):
    # Rows with a tail are not one run of whole chunks: the torch path takes a
    # few rows at a time (at most one block of chunks), never a copy of them all.
    monkeypatch.setattr(F, "_TORCH_BLOCK_CHUNKS", block)
    C = F.CHUNK_BYTES
    for n in (2 * C + 5, 3 * C, C + 4):
        rows = _bytes(7 * n + 8, seed=n)[8:].view(7, n)
        assert F.finalize(F.row_lanes(rows, "numpy"), n) == F.finalize(F.row_lanes(rows, "torch"), n)
        strided = _bytes(7 * (n + 8), seed=n + 1).view(7, n + 8)[:, 8:]
        want = F.finalize(F.row_lanes(strided.contiguous(), "numpy"), n)
        assert want == F.finalize(F.row_lanes(strided, "torch"), n)


def test_dtype_and_shape_are_not_folded_in():
    x = _bytes(4096, seed=3)
    assert F.fingerprint(x) == F.fingerprint(x.view(torch.float32)) == F.fingerprint(x.reshape(64, 64))


@pytest.mark.parametrize("n", [8, 24, C, 2 * C + 100])
def test_every_single_bit_flip_changes_the_digest(n):
    x = _bytes(n, seed=11)
    base = F.fingerprint(x)
    rng = np.random.default_rng(0)
    positions = set(range(min(n, 64))) | set(range(max(0, n - 64), n)) | set(rng.integers(0, n, 200).tolist())
    seen = {base.digest}
    for p in sorted(positions):
        for bit in range(8):
            y = x.clone()
            y[p] ^= 1 << bit
            d = F.fingerprint(y, threads=False).digest
            assert d not in seen, (p, bit)
            seen.add(d)


def test_two_top_bit_flips_are_seen():
    # The blind spot of a plain mod-2^64 word sum: flipping bit 63 of two words
    # adds 2^64. The offset lanes see those bits mid-word.
    x = torch.zeros(C, dtype=torch.uint8)
    base = F.fingerprint(x)
    for i, j in [(0, 1), (3, 17), (100, 8000), (8190, 8191)]:
        y = x.clone()
        y[8 * i + 7] ^= 0x80
        y[8 * j + 7] ^= 0x80
        assert F.fingerprint(y) != base, (i, j)
        # the same for bit 31 (top of the offset words)
        z = x.clone()
        z[8 * i + 3] ^= 0x80
        z[8 * j + 3] ^= 0x80
        assert F.fingerprint(z) != base, (i, j)


def test_swapped_chunks_and_lengths_differ():
    x = _bytes(3 * C, seed=5)
    swapped = torch.cat([x[C : 2 * C], x[:C], x[2 * C :]])
    fx, fs = F.fingerprint(x), F.fingerprint(swapped)
    assert fx != fs
    # chunk digests move with the chunk: a torn/permuted copy is localizable
    assert fx.chunk(0) == fs.chunk(1) and fx.chunk(1) == fs.chunk(0) and fx.chunk(2) == fs.chunk(2)
    # zero padding is not content: a trailing zero byte changes the digest
    y = _bytes(100, seed=9)
    assert F.fingerprint(y) != F.fingerprint(torch.cat([y, torch.zeros(1, dtype=torch.uint8)]))
    assert F.fingerprint(torch.zeros(0, dtype=torch.uint8)) != F.fingerprint(torch.zeros(1, dtype=torch.uint8))


def test_torn_copy_is_localized_to_chunks():
    a, b = _bytes(5 * C + 7, seed=1), _bytes(5 * C + 7, seed=2)
    torn = torch.cat([a[: 2 * C], b[2 * C :]])
    fa, fb, ft = F.fingerprint(a), F.fingerprint(b), F.fingerprint(torn)
    sources = ["a" if ft.chunk(i) == fa.chunk(i) else "b" if ft.chunk(i) == fb.chunk(i) else "?" for i in range(ft.n_chunks)]
    assert sources == ["a", "a", "b", "b", "b", "b"]


def test_unrelated_contents_do_not_collide():
    digests = {F.fingerprint(_bytes(257, seed=s)).digest for s in range(300)}
    assert len(digests) == 300


def test_many_equals_one_by_one_and_bytes_entry_point():
    ts = [_bytes(n, seed=n) for n in (10, C + 3, 2 * C)]
    assert F.fingerprint_many(ts) == [F.fingerprint(t) for t in ts]
    raw = ts[1].numpy().tobytes()
    assert F.fingerprint_bytes(raw) == F.fingerprint(ts[1])


def test_keys_are_fixed_odd_and_distinct():
    for keys in (F.KEYS_ALIGNED, F.KEYS_OFFSET):
        assert np.all(keys & np.uint64(1) == 1)
        assert len(np.unique(keys)) == keys.size



def test_known_answers_are_stable():
    # Pinned: a change of keys, chunking or folding orphans every stored index
    # and trace. Such a change must bump FP_VERSION and these values together.
    assert F.FP_VERSION == 1
    assert F.fingerprint_bytes(b"moetrace").hex() == "5670a9b909632b31bd7c43a3523d5f4d"
    assert F.fingerprint_bytes(bytes(range(256)) * 300).hex() == "f6a4cc78ed0ca818fb5c603a01bb5f07"


def test_row_lanes_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        F.row_lanes(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="method"):
        F.row_lanes(torch.zeros(1, 4, dtype=torch.uint8), "cuda-magic")
