"""Benchmark-sized traces: a Qwen3.5-122B-shaped TP2 index with random digests and a
trace of any number of rows, written part by part (bounded memory), with real
manifests (tracer.manifest). Used by bench/bench_analyze.py and its small-scale test.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moetrace.checkpoints.index import INDEX_META_KEY, write_index
from moetrace.fingerprint import CHUNK_BYTES, FP_VERSION, fingerprint, tensor_digest
from moetrace.schema import COPY_ORDERS, INDEX_SCHEMA, INDEX_SCHEMA_VERSION, TRACE_SCHEMA, TRACE_SCHEMA_VERSION
from moetrace.tracer.manifest import (
    MANIFEST_NAME,
    RUN_MANIFEST_NAME,
    new_rank_manifest,
    new_run_manifest,
    rank_dir_name,
)

BENCH_SHAPES = {  # Qwen3.5-122B-A10B, TP2: hidden 3072, I_tp 512, fp8 block 128
    "w13_weight": ((1024, 3072), "float8_e4m3fn", 1),
    "w13_weight_scale_inv": ((8, 24), "float32", 4),
    "w2_weight": ((3072, 512), "float8_e4m3fn", 1),
    "w2_weight_scale_inv": ((24, 4), "float32", 4),
}


def _rand16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=(n, 2), dtype=np.int64, endpoint=True)


def bench_index(path: str, layers: int = 48, experts: int = 256, tp: int = 2, seed: int = 0,
                checkpoint_id: str = "bench-qwen35-122b") -> dict:
    """Index with random chunk digests (digests derived from them); returns arrays for the trace writer."""
    rng = np.random.default_rng(seed)
    tensors = list(COPY_ORDERS["fp8_block"])
    R, L, E, T = np.meshgrid(np.arange(tp), np.arange(layers), np.arange(experts), np.arange(len(tensors)),
                             indexing="ij")
    R, L, E, T = (x.reshape(-1) for x in (R, L, E, T))
    n = len(R)
    nbytes = np.array([int(np.prod(BENCH_SHAPES[t][0])) * BENCH_SHAPES[t][2] for t in tensors], np.int64)[T]
    nchunks = -(-nbytes // CHUNK_BYTES)
    chunk_words = _rand16(rng, int(nchunks.sum()))
    offsets = np.r_[0, np.cumsum(nchunks * 16)].astype(np.int32)
    # random chunk digests; each digest follows from them, as every index read checks
    blob = chunk_words.tobytes()
    fps = np.frombuffer(b"".join(tensor_digest(blob[offsets[i]:offsets[i + 1]], int(nbytes[i])) for i in range(n)),
                        "<i8").reshape(n, 2)
    chunk_arr = pa.BinaryArray.from_buffers(pa.binary(), n,
                                            [None, pa.py_buffer(offsets), pa.py_buffer(chunk_words.tobytes())])
    shapes = [list(BENCH_SHAPES[t][0]) for t in tensors]
    tnames = pa.array(tensors)
    cols = {
        "schema_version": pa.array(np.full(n, INDEX_SCHEMA_VERSION, np.int16)),
        "checkpoint_id": pa.array([checkpoint_id] * n), "model": pa.array(["target"] * n),
        "tp_size": pa.array(np.full(n, tp, np.int16)), "ep_size": pa.array(np.ones(n, np.int16)),
        "moe_dp_size": pa.array(np.ones(n, np.int16)),
        "moe_tp_size": pa.array(np.full(n, tp, np.int16)), "moe_tp_rank": pa.array(R.astype(np.int16)),
        "layer": pa.array(L.astype(np.int32)), "expert": pa.array(E.astype(np.int32)),
        "tensor": tnames.take(pa.array(T)),
        "copy_position": pa.array(T.astype(np.int8)),
        "dtype": pa.array([BENCH_SHAPES[t][1] for t in tensors]).take(pa.array(T)),
        "shape": pa.array(shapes, pa.list_(pa.int64())).take(pa.array(T)),
        "nbytes": pa.array(nbytes), "digest": _fixed16(fps), "chunk_digests": chunk_arr,
    }
    meta = {"checkpoint_id": checkpoint_id, "tp_size": tp, "ep_size": 1, "moe_tp_size": tp, "moe_dp_size": 1,
            "num_experts": experts, "layers": list(range(layers)),
            "fp_version": FP_VERSION, "chunk_bytes": CHUNK_BYTES, "schema_version": INDEX_SCHEMA_VERSION}
    table = pa.table(cols, schema=INDEX_SCHEMA).replace_schema_metadata({INDEX_META_KEY: json.dumps(meta).encode()})
    write_index(table, path)
    return {"R": R, "L": L, "E": E, "T": T, "nbytes": nbytes, "fps": fps, "chunk_words": chunk_words,
            "chunk_off": offsets // 16, "nchunks": nchunks, "tensors": tensors, "tp": tp, "layers": layers,
            "experts": experts, "checkpoint_id": checkpoint_id}


def _fixed16(words: np.ndarray) -> pa.Array:
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(words),
                                                [None, pa.py_buffer(np.ascontiguousarray(words).tobytes())])


def write_bench(out: str, rows: int, run_id: str = "bench", seed: int = 0, rows_per_part: int = 250_000,
                layers: int = 48, experts: int = 256, tp: int = 2, chunk_digests: str = "all") -> dict:
    """Index at OUT/index.parquet and a trace of about `rows` rows under OUT/trace/<run_id>.

    chunk_digests: "all" (the tracer's default: every row carries its chunk
    fingerprints) or "mismatch" (only the corrupted rows do).
    Corruptions, at the middle step:
    rank 1 layer 0: w2_weight_scale_inv of experts 0..E-4 hold E+2 (253/256 at 256 experts);
    rank 0 layer 1 expert 5 w13_weight torn (first half itself, second half E+2);
    rank 0 layer 2 expert 7 w2_weight zeros; rank 1 layer 3 expert 9 w13_weight unknown bytes.
    """
    os.makedirs(out, exist_ok=True)
    ix = bench_index(os.path.join(out, "index.parquet"), layers, experts, tp, seed)
    rng = np.random.default_rng(seed + 1)
    n_idx = len(ix["R"])
    per_rank_step = n_idx // tp
    steps = max(1, -(-rows // (per_rank_step * tp)))  # whole steps: a complete trace
    rows = steps * per_rank_step * tp
    bad_step = steps // 2
    tensors = ix["tensors"]
    w2s, w13 = tensors.index("w2_weight_scale_inv"), tensors.index("w13_weight")
    w2 = tensors.index("w2_weight")
    zero_fp = fingerprint(torch.zeros(int(ix["nbytes"][tensors.index("w2_weight")]), dtype=torch.uint8))
    written = 0
    trace_dir = os.path.join(out, "trace")
    os.makedirs(os.path.join(trace_dir, run_id), exist_ok=True)
    with open(os.path.join(trace_dir, run_id, RUN_MANIFEST_NAME), "w") as f:
        json.dump(new_run_manifest(run_id, trace_dir, tp_size=tp, expected_ranks=tp, checkpoint_id=ix["checkpoint_id"],
                                   finished=True, complete=True,
                                   ranks=[{"rank_label": str(r), "tp_rank": r, "pp_rank": 0, "replica": None,
                                           "present": True}
                                          for r in range(tp)]), f)
    # transport order = expert position (the staged loop walks experts in order)
    for r in range(tp):
        base = np.flatnonzero(ix["R"] == r)  # index rows of this rank, sorted (layer, expert, tensor)
        rank_rows = min(steps * per_rank_step, max(0, rows - written))
        rank_dir = os.path.join(trace_dir, run_id, rank_dir_name(r))
        os.makedirs(rank_dir, exist_ok=True)
        part, done, names, counts = 0, 0, [], []
        while done < rank_rows:
            m = min(rows_per_part, rank_rows - done)
            g = done + np.arange(m)
            step, j = g // per_rank_step, base[g % per_rank_step]
            fps = ix["fps"][j].copy()
            chunk = [None] * m
            if (step == bad_step).any():
                at = np.flatnonzero(step == bad_step)
                jj = j[at]
                L_, E_, T_ = ix["L"][jj], ix["E"][jj], ix["T"][jj]
                if r == (1 % tp):
                    s = at[(L_ == 0) & (T_ == w2s) & (E_ < experts - 3)]
                    fps[s] = ix["fps"][j[s] + 2 * len(tensors)]
                    for i in s:
                        chunk[i] = _chunks(ix, j[i] + 2 * len(tensors))
                    u = at[(L_ == 3 % layers) & (E_ == 9 % experts) & (T_ == w13)]
                    fps[u] = _rand16(rng, len(u))
                    for i in u:
                        chunk[i] = _rand16(rng, int(ix["nchunks"][j[i]])).tobytes()
                if r == 0:
                    t_ = at[(L_ == 1 % layers) & (E_ == 5 % experts) & (T_ == w13)]
                    for i in t_:
                        a, b = _chunks(ix, j[i]), _chunks(ix, j[i] + 2 * len(tensors))
                        h = len(a) // 32 * 16
                        chunk[i] = a[:h] + b[h:]
                        fps[i] = _rand16(rng, 1)[0]
                    z = at[(L_ == 2 % layers) & (E_ == 7 % experts) & (T_ == w2)]
                    for i in z:
                        fps[i] = np.frombuffer(zero_fp.digest, "<i8")
                        chunk[i] = zero_fp.chunk_digests
            tbl = _bench_table(ix, j, fps, chunk, step, r, run_id, done, chunk_digests == "all")
            name = f"part-{part:05d}.parquet"
            pq.write_table(tbl, os.path.join(rank_dir, name), row_group_size=65536)
            names.append(name)
            counts.append(m)
            part += 1
            done += m
        written += rank_rows
        m = new_rank_manifest(run_id, r, tp, {"out": trace_dir, "run_id": run_id}, ix["checkpoint_id"], "config")
        m.update(ep_size=1, ep_rank=0, moe_tp_size=tp, moe_tp_rank=r, finished=True, close_reason="close",
                 rows_written=int(rank_rows), rows_captured=int(rank_rows), steps_seen=int(steps),
                 captures=int(rank_rows) // experts,  # one batch per tensor of a layer load: one row per expert
                 online={"match": 0, "mismatch": 0, "unchecked": int(rank_rows)},
                 parts=[{"file": n, "rows": int(c), "written_at": m["started_at"]} for n, c in zip(names, counts)])
        with open(os.path.join(rank_dir, MANIFEST_NAME), "w") as f:
            json.dump(m, f)
    return {"index": os.path.join(out, "index.parquet"), "trace": os.path.join(trace_dir, run_id), "rows": written,
            "steps": steps, "bad_step": bad_step}


def _chunks(ix: dict, j: int) -> bytes:
    a = int(ix["chunk_off"][j])
    return ix["chunk_words"][a : a + int(ix["nchunks"][j])].tobytes()


def _bench_table(ix, j, fps, chunk, step, rank, run_id, seq0, all_chunks: bool) -> pa.Table:
    import pyarrow.compute as pc

    m = len(j)
    mask = np.array([c is not None for c in chunk], dtype=bool)
    if all_chunks:
        if "chunk_arr" not in ix:
            off = np.r_[0, np.cumsum(ix["nchunks"] * 16)].astype(np.int64)
            ix["chunk_arr"] = pa.LargeBinaryArray.from_buffers(
                pa.large_binary(), len(ix["nchunks"]),
                [None, pa.py_buffer(off), pa.py_buffer(ix["chunk_words"].tobytes())])
        chunk_col = ix["chunk_arr"].take(pa.array(j)).cast(pa.binary())
        if mask.any():
            chunk_col = pc.replace_with_mask(chunk_col, pa.array(mask),
                                             pa.array([c for c in chunk if c is not None], pa.binary()))
    else:
        chunk_col = pa.array(chunk, pa.binary())
    tensors = ix["tensors"]
    T = ix["T"][j]
    shapes = pa.array([list(BENCH_SHAPES[t][0]) for t in tensors], pa.list_(pa.int64()))
    per_load = ix["experts"] * len(tensors)
    cols = {
        "schema_version": pa.array(np.full(m, TRACE_SCHEMA_VERSION, np.int16)),
        "run_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)), pa.array([run_id])).cast(pa.string()),
        "model": pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)),
                                                pa.array(["target"])).cast(pa.string()),
        "tp_size": pa.array(np.full(m, ix["tp"], np.int16)), "tp_rank": pa.array(np.full(m, rank, np.int16)),
        "ep_size": pa.array(np.ones(m, np.int16)), "ep_rank": pa.array(np.zeros(m, np.int16)),
        "moe_tp_size": pa.array(np.full(m, ix["tp"], np.int16)), "moe_tp_rank": pa.array(np.full(m, rank, np.int16)),
        "pp_size": pa.array(np.ones(m, np.int16)), "pp_rank": pa.array(np.zeros(m, np.int16)),
        "replica": pa.array(np.zeros(m, np.int16)),
        "step": pa.array(step.astype(np.int64)),
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)),
                                                 pa.array(["staged"])).cast(pa.string()),
        "capture_seq": pa.array(((seq0 + np.arange(m)) // per_load).astype(np.int64)),
        "transport_position": pa.array(ix["E"][j].astype(np.int32)),
        "slot": pa.array(ix["E"][j].astype(np.int32)), "expert_copy": pa.array(np.zeros(m, np.int16)),
        "slot_count": pa.array(np.full(m, ix["experts"], np.int32)),
        "layer": pa.array(ix["L"][j].astype(np.int32)), "expert": pa.array(ix["E"][j].astype(np.int32)),
        "tensor": pa.array(tensors).take(pa.array(T)),
        "copy_position": pa.array(T.astype(np.int8)),
        "dtype": pa.array([BENCH_SHAPES[t][1] for t in tensors]).take(pa.array(T)),
        "shape": shapes.take(pa.array(T)),
        "nbytes": pa.array(ix["nbytes"][j]), "digest": _fixed16(fps),
        "chunk_digests": chunk_col,
        "online": pa.nulls(m, pa.string()),
        "time_ns": pa.array(1_700_000_000_000_000_000 + np.arange(m, dtype=np.int64)),
    }
    return pa.table(cols, schema=TRACE_SCHEMA)
