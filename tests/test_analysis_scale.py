"""analysis internals and the benchmark data path at small scale."""

from __future__ import annotations

import numpy as np
import torch
from synthetic_trace import write_bench

from moetrace.analysis.report import analyze
from moetrace.analysis.trace import digest_columns, pair_to_hex
from moetrace.analysis.verdicts import constant_candidates, constant_fingerprint, fp_join
from moetrace.fingerprint import fingerprint


def test_fp_join_finds_all_pairs():
    rng = np.random.default_rng(0)
    t = rng.integers(-(2**62), 2**62, size=(50, 2))
    t[7] = t[3]  # duplicate fingerprint in the table
    q = np.concatenate([t[[3, 10, 49]], rng.integers(-(2**62), 2**62, size=(4, 2))])
    q[5, 0] = t[20, 0]  # same first half, different second half: no match
    qi, ti = fp_join(q[:, 0], q[:, 1], t[:, 0], t[:, 1])
    assert sorted(zip(qi.tolist(), ti.tolist())) == [(0, 3), (0, 7), (1, 10), (2, 49)]


def test_digest_columns_round_trip():
    import pyarrow as pa

    fps = [bytes(range(i, i + 16)) for i in range(5)]
    arr = pa.array(fps, pa.binary(16)).slice(1)
    hi, lo = digest_columns(arr)
    assert [pair_to_hex(h, l) for h, l in zip(hi, lo)] == [f.hex() for f in fps[1:]]


def test_constant_fingerprints_equal_real_tensors():
    for dtype, v in ((torch.float32, 1.0), (torch.bfloat16, -1.0), (torch.float8_e4m3fn, 448.0)):
        t = torch.full((300, 7), v, dtype=torch.float32).to(dtype)
        nbytes = t.numel() * t.element_size()
        name = str(dtype).replace("torch.", "")
        cands = dict(constant_candidates(name, nbytes))
        pat = next(p for d, p in cands.items() if d.startswith(f"the constant {v:g}"))
        assert constant_fingerprint(pat, nbytes).digest == fingerprint(t).digest
    z = torch.zeros(3 * 65536 + 5, dtype=torch.uint8)
    assert constant_fingerprint(b"\0", z.numel()).digest == fingerprint(z).digest


def test_bench_trace_small(tmp_path):
    """The benchmark generator (random fingerprints, parts, all chunk digests) at 4 layers x 16 experts."""
    meta = write_bench(str(tmp_path), rows=3 * 2 * 4 * 16 * 4, layers=4, experts=16, rows_per_part=100)
    assert meta["rows"] == 3 * 512 and meta["steps"] == 3
    rep = analyze([meta["trace"]], index=meta["index"])
    doc = rep.doc
    assert doc["totals"]["by_verdict"]["stale"] == 13
    assert doc["totals"]["by_verdict"]["torn"] == 1 and doc["totals"]["by_verdict"]["zeros"] == 1
    assert doc["totals"]["by_verdict"]["unknown"] == 1
    assert doc["first_divergence"][0]["sentence"] == "step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)"
    assert doc["summaries"][0]["sentence"] == "rank 1, layer 0, step 1: 13/16 w2_weight_scale_inv are E+2"
    (torn,) = [r for r in doc["divergent_rows"] if r["verdict"] == "torn"]
    assert [(g["first_chunk"], g["last_chunk"], g.get("k")) for g in torn["chunks"]] == [(0, 23, 0), (24, 47, 2)]
    assert rep.exit_code == 1
