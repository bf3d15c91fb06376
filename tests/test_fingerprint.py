"""fingerprint: the version-3 definition (XXH3-128 per 64 KiB chunk), every path held to
the `xxhash` package and to the plain reference, sensitivity, chunk localization."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from moetrace import fingerprint as F
from moetrace.fingerprint import reference as R

C = F.CHUNK_BYTES
# around every XXH3 path boundary: empty, 1-3, 4-8, 9-16, 17-128, 129-240, 241+, blocks, chunks
BOUNDARIES = [0, 1, 2, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, C - 1, C, C + 1]
SIZES = [0, 1, 7, 8, 100, C - 1, C, C + 1, 3 * C + 11]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _contents(n: int, seed: int) -> list[tuple[str, np.ndarray]]:
    return [("random", _bytes(n, seed).numpy()), ("zeros", np.zeros(n, np.uint8)), ("0xFF", np.full(n, 255, np.uint8))]


def _by_definition(data: bytes) -> tuple[bytes, bytes]:
    """docs/fingerprint.md's definition with the xxhash package, as a reader would write it."""
    chunks = b"".join(xxhash.xxh3_128(data[o : o + C]).digest() for o in range(0, len(data), C))
    return xxhash.xxh3_128(chunks + len(data).to_bytes(8, "little")).digest(), chunks


@pytest.mark.parametrize("n", BOUNDARIES)
def test_reference_is_xxh3_128(n):
    for kind, a in _contents(n, seed=n):
        assert R.xxh3_128(a.tobytes()) == xxhash.xxh3_128(a.tobytes()).digest(), (n, kind)


def test_reference_fingerprint_is_the_definition():
    for n in (0, 5, C + 300):
        data = _bytes(n, seed=n).numpy().tobytes()
        f = F.reference_fingerprint_bytes(data)
        assert (f.digest, f.chunk_digests, f.nbytes) == (*_by_definition(data), n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("method", ["xxhash", "torch"])
def test_paths_equal_the_definition(n, method):
    for kind, a in _contents(n, seed=n + 1):
        f = F.fingerprint(torch.from_numpy(a), method)
        assert (f.digest, f.chunk_digests, f.nbytes) == (*_by_definition(a.tobytes()), n), (kind, method)


@pytest.mark.parametrize("n", BOUNDARIES + [241 + 7, 3 * C + 241, 2 * C + 240])
def test_torch_fallback_equals_xxhash_at_every_boundary(n):
    """Rows of one length go through XXH3's paths as one batch: every row is checked."""
    for kind, a in _contents(n, seed=n + 2):
        rows = torch.from_numpy(np.stack([a, a[::-1].copy(), a ^ 0x5A]))
        got = F.row_chunk_digests(rows, "torch").numpy()
        want = np.stack([np.frombuffer(_by_definition(r.tobytes())[1], np.uint8).reshape(-1, 16) for r in rows.numpy()])
        assert got.shape == (3, F.n_chunks_for(n), 16) and np.array_equal(got, want), (n, kind)


def test_definition_helpers():
    data = _bytes(2 * C + 5, seed=12).numpy().tobytes()
    digest, chunks = _by_definition(data)
    assert F.chunk_digest(memoryview(data)[:C]) == chunks[:16] == xxhash.xxh3_128(data[:C]).digest()
    assert F.chunk_digest(data[2 * C :]) == chunks[32:]
    assert F.tensor_digest(chunks, len(data)) == digest
    with pytest.raises(ValueError, match="at most"):
        F.chunk_digest(data[: C + 1])
    with pytest.raises(ValueError, match="do not fit"):
        F.tensor_digest(chunks[:16], len(data))


def test_empty_tensor_has_no_chunks():
    f = F.fingerprint(torch.zeros(0, dtype=torch.float32))
    assert f.chunk_digests == b"" and f.n_chunks == 0 and f.nbytes == 0
    assert f.digest == xxhash.xxh3_128((0).to_bytes(8, "little")).digest()
    assert F.fingerprint_rows(torch.zeros(3, 0)) == [f] * 3


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.uint8, torch.int64]
)
def test_dtypes_rows_and_views(dtype):
    raw = _bytes(6 * 3000 * 8, seed=4)
    t = raw.view(dtype).reshape(6, -1)
    rows = F.fingerprint_rows(t)
    assert [r.digest for r in rows] == [F.fingerprint(t[i]).digest for i in range(6)]
    assert [r.digest for r in rows] == [_by_definition(t[i].view(torch.uint8).numpy().tobytes())[0] for i in range(6)]
    strided = t[:, 1:-1]  # rows that are not contiguous in memory
    assert F.fingerprint_rows(strided) == F.fingerprint_rows(strided.contiguous())
    assert F.fingerprint_rows(strided, "torch") == F.fingerprint_rows(strided.contiguous())
    assert F.fingerprint(t.t()) == F.fingerprint(t.t().contiguous())


def test_dtype_and_shape_are_not_folded_in():
    x = _bytes(4096, seed=5)
    assert F.fingerprint(x).digest == F.fingerprint(x.view(torch.float32).reshape(32, 32)).digest


@pytest.mark.parametrize("n", [9, C + 3])
def test_every_single_bit_flip_changes_its_chunk_only(n):
    x = _bytes(n, seed=6)
    base = F.fingerprint(x)
    flips = [(p, b) for p in range(n) for b in range(8)] if n < 64 else [(0, 7), (C - 1, 0), (C, 7), (n - 1, 3)]
    for pos, bit in flips:
        y = x.clone()
        y[pos] ^= 1 << bit
        f = F.fingerprint(y)
        changed = [f.chunk(i) != base.chunk(i) for i in range(base.n_chunks)]
        assert changed == [i == pos // C for i in range(base.n_chunks)] and f.digest != base.digest, (pos, bit)


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


def test_cpu_path_hashes_the_tensors_own_memory(monkeypatch):
    """Zero copy: every chunk reaches xxhash as a view of the tensor's own bytes."""
    t = _bytes(2 * C + 77, seed=13).reshape(1, -1)
    seen = []

    def spy(data):
        seen.append(isinstance(data, memoryview) and np.shares_memory(np.asarray(data), t.numpy()))
        return xxhash.xxh3_128_digest(data)

    monkeypatch.setattr(F, "_xxh3_128", spy)
    F.fingerprint_rows(t)
    assert seen[:3] == [True, True, True]  # then one tensor digest over the chunk digests


def test_many_and_bytes_entry_points():
    ts = [_bytes(n, seed=n) for n in (10, C + 1)]
    assert F.fingerprint_many(ts) == [F.fingerprint(t) for t in ts]
    assert F.fingerprint_bytes(ts[1].numpy().tobytes()) == F.fingerprint(ts[1])
    assert F.fingerprint_bytes(memoryview(ts[1].numpy())) == F.fingerprint(ts[1])


def test_version_and_a_known_answer():
    # Digests stored in indexes and traces depend on the definition: a change must bump
    # FP_VERSION (readers refuse other versions). The answer is computed from xxhash here.
    assert F.FP_VERSION == 3
    data = bytes(range(10))
    want = xxhash.xxh3_128(xxhash.xxh3_128(data).digest() + (10).to_bytes(8, "little")).hexdigest()
    assert F.fingerprint(torch.arange(10, dtype=torch.uint8)).hex() == want


def test_fingerprint_imports_without_torch():
    """The index cache and hook-spec read digests in processes that never import torch."""
    code = ("import sys; import moetrace.fingerprint as F; "
            "assert F.fingerprint_bytes(b'abc').nbytes == 3; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="uint8"):
        F.row_chunk_digests(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="unknown fingerprint method"):
        F.row_chunk_digests(torch.zeros(1, 4, dtype=torch.uint8), "blake")
    with pytest.raises(ValueError, match="do not fit"):
        F.finalize(np.zeros((1, 2, 16), dtype=np.uint8), 10)
