"""Synthetic indexes and traces with known corruptions, for tests and the benchmark.

Two generators:

- ``SynthModel``: small deterministic expert tensors per (layer, expert, tensor,
  rank), fingerprinted for real, so corrupted rows (another expert's bytes,
  zeros, a torn mix of two tensors) have true fingerprints and chunk
  fingerprints. Used by the tests.
- ``write_bench``: a Qwen3.5-122B-shaped TP2 index with random fingerprints
  and a trace of any number of rows, written part by part (bounded memory).
  Used by ``bench/bench_analyze.py``.

Trace layout written: ``OUT/<run_id>/rank=<r>/part-NNNNN.parquet``,
``OUT/<run_id>/rank=<r>/_manifest.json`` and ``OUT/<run_id>/_run.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moetrace.tracer.fingerprint import CHUNK_BYTES, Fingerprint, fingerprint, n_chunks_for
from moetrace.tracer.schema import (
    COPY_ORDER_FP8_BLOCK,
    INDEX_SCHEMA,
    INDEX_SCHEMA_VERSION,
    MANIFEST_SCHEMA_VERSION,
    TRACE_SCHEMA,
    TRACE_SCHEMA_VERSION,
    copy_order,
)

# ---------------------------------------------------------------- small model, real fingerprints


@dataclass
class SynthModel:
    """FP8-block MoE expert shards per TP rank, deterministic from (layer, expert, tensor, rank)."""

    tp_size: int = 2
    num_layers: int = 2
    num_experts: int = 8
    hidden: int = 512
    intermediate: int = 512
    checkpoint_id: str = "synthetic-fp8-block"
    _cache: dict = field(default_factory=dict, repr=False)
    _fps: dict = field(default_factory=dict, repr=False)

    @property
    def i_tp(self) -> int:
        return self.intermediate // self.tp_size

    def shape(self, tensor: str) -> tuple[int, ...]:
        h, i = self.hidden, self.i_tp
        return {
            "w13_weight": (2 * i, h),
            "w13_weight_scale_inv": (2 * -(-i // 128), -(-h // 128)),
            "w2_weight": (h, i),
            "w2_weight_scale_inv": (-(-h // 128), -(-i // 128)),
        }[tensor]

    @staticmethod
    def dtype(tensor: str) -> torch.dtype:
        return torch.float32 if tensor.endswith("scale_inv") else torch.float8_e4m3fn

    def tensor(self, layer: int, expert: int, tensor: str, rank: int) -> torch.Tensor:
        key = (layer, expert, tensor, rank)
        t = self._cache.get(key)
        if t is None:
            seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1
            g = torch.Generator().manual_seed(seed)
            shape = self.shape(tensor)
            if self.dtype(tensor) == torch.float32:
                t = torch.rand(shape, generator=g, dtype=torch.float32) * 0.01 + 1e-4
            else:
                t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
            self._cache[key] = t
        return t

    def fp(self, layer: int, expert: int, tensor: str, rank: int) -> Fingerprint:
        key = (layer, expert, tensor, rank)
        f = self._fps.get(key)
        if f is None:
            f = self._fps[key] = fingerprint(self.tensor(*key))
        return f

    @property
    def layer_ids(self) -> list[int]:
        return getattr(self, "moe_layers", None) or list(range(self.num_layers))

    def keys(self):
        for r in range(self.tp_size):
            for l in self.layer_ids:
                for e in range(self.num_experts):
                    for t in COPY_ORDER_FP8_BLOCK:
                        yield l, e, t, r

    def index_table(self, tp_size: int | None = None, checkpoint_id: str | None = None) -> pa.Table:
        rows = []
        for l, e, t, r in self.keys():
            f = self.fp(l, e, t, r)
            rows.append(_tensor_row(l, e, e, t, self.dtype(t), self.shape(t), f, chunks=True))
        cols = _columns(rows)
        n = len(rows)
        tp = tp_size or self.tp_size
        ranks = [r for (_, _, _, r) in self.keys()]
        cols.update(
            schema_version=[INDEX_SCHEMA_VERSION] * n, checkpoint_id=[checkpoint_id or self.checkpoint_id] * n,
            tp_size=[tp] * n, tp_rank=ranks, ep_size=[1] * n, ep_rank=[0] * n, moe_tp_size=[tp] * n, moe_tp_rank=ranks,
        )
        return pa.Table.from_pydict(cols, schema=INDEX_SCHEMA)

    def write_index(self, path: str, **kw) -> str:
        pq.write_table(self.index_table(**kw), path)
        return path

    # -- corrupted contents ------------------------------------------------

    def torn(self, layer, expert, tensor, rank, other_expert, split_chunk: int | None = None) -> torch.Tensor:
        """Chunks [0, split) from (expert), the rest from (other_expert), same layer/rank/tensor."""
        a = self.tensor(layer, expert, tensor, rank).reshape(-1).view(torch.uint8).clone()
        b = self.tensor(layer, other_expert, tensor, rank).reshape(-1).view(torch.uint8)
        n = n_chunks_for(a.numel())
        split = n // 2 if split_chunk is None else split_chunk
        a[split * CHUNK_BYTES :] = b[split * CHUNK_BYTES :]
        return a.view(self.dtype(tensor)).reshape(self.shape(tensor))


class CheckpointModel(SynthModel):
    """The same interface backed by a real checkpoint: tensors from
    ``checkpoints.shards.expected_layer``, index from ``tracer.index.build_index``."""

    def __init__(self, checkpoint_path: str, tp_size: int = 2):
        from moetrace.checkpoints.reader import open_checkpoint

        self.path = str(checkpoint_path)
        self.ckpt = open_checkpoint(self.path)
        spec = self.ckpt.spec
        super().__init__(tp_size=tp_size, num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                         hidden=spec.hidden_size, intermediate=spec.intermediate_size,
                         checkpoint_id=self.ckpt.identity)
        self.moe_layers = list(spec.moe_layers)
        self._layers: dict = {}
        self._index: pa.Table | None = None

    def _layer(self, layer: int, rank: int) -> dict:
        from moetrace.checkpoints.shards import Parallel, expected_layer

        key = (layer, rank)
        if key not in self._layers:
            self._layers[key] = expected_layer(self.ckpt, layer, rank, Parallel(self.tp_size))
        return self._layers[key]

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self._layer(self.moe_layers[0], 0)[tensor].shape[1:])

    def dtype(self, tensor: str) -> torch.dtype:
        return self._layer(self.moe_layers[0], 0)[tensor].dtype

    def tensor(self, layer: int, expert: int, tensor: str, rank: int) -> torch.Tensor:
        return self._layer(layer, rank)[tensor][expert]

    def index_table(self, tp_size: int | None = None, checkpoint_id: str | None = None) -> pa.Table:
        if tp_size is None and checkpoint_id is None:
            if self._index is None:
                from moetrace.tracer.index import build_index

                self._index = build_index(self.path, self.tp_size)
            return self._index
        return super().index_table(tp_size, checkpoint_id)


# A corruption maps (expert, tensor) of one load to what the rank holds instead:
#   ("expert", e2)            that layer/rank/tensor of expert e2
#   ("rank", r2)              that expert's shard for rank r2
#   ("layer", l2)             that expert/tensor of layer l2
#   ("tensor", t2)            that expert's tensor t2 (fingerprint only)
#   ("zeros",)                all zeros
#   ("fill", value)           torch.full of the tensor's dtype
#   ("bytes", b)              the byte b repeated
#   ("torn", e2[, split])     chunks from the expected tensor, then from expert e2
#   ("random",)               random bytes
#   None                      not captured (missing)
Corruption = tuple | None


def load_rows(model: SynthModel, run_id: str, step: int, rank: int, layer: int, source: str = "staged",
              load_seq: int = 0, corrupt: dict | None = None, chunk_fps: str = "mismatch",
              experts: list[int] | None = None, extra: list[dict] | None = None) -> list[dict]:
    """Trace rows of one load (all experts x 4 tensors in copy order), with corruptions applied.

    chunk_fps: "all" records chunk fingerprints on every row, "mismatch" only on
    corrupted rows (what online verification does), "none" never.
    """
    corrupt = corrupt or {}
    rows = []
    experts = list(range(model.num_experts)) if experts is None else experts
    for order, e in enumerate(experts):
        for t in COPY_ORDER_FP8_BLOCK:
            spec = corrupt.get((e, t), "clean")
            if spec is None:
                continue
            if spec == "clean":
                f = model.fp(layer, e, t, rank)
            else:
                f = _corrupted_fp(model, layer, e, t, rank, spec)
            keep = chunk_fps == "all" or (chunk_fps == "mismatch" and spec != "clean")
            row = _tensor_row(layer, e, e, t, model.dtype(t), model.shape(t), f, chunks=keep)
            row.update(
                schema_version=TRACE_SCHEMA_VERSION, run_id=run_id, tp_size=model.tp_size, tp_rank=rank, ep_size=1,
                ep_rank=0, moe_tp_size=model.tp_size, moe_tp_rank=rank, step=step, source=source, load_seq=load_seq,
                transport_order=order, online=None, time_ns=time.time_ns(),
            )
            rows.append(row)
    for x in extra or []:
        rows.append(x)
    return rows


def _corrupted_fp(model: SynthModel, layer, e, t, rank, spec) -> Fingerprint:
    kind = spec[0]
    if kind == "expert":
        return model.fp(layer, spec[1], t, rank)
    if kind == "rank":
        return model.fp(layer, e, t, spec[1])
    if kind == "layer":
        return model.fp(spec[1], e, t, rank)
    if kind == "tensor":
        return model.fp(layer, e, spec[1], rank)
    if kind == "zeros":
        return fingerprint(torch.zeros(model.shape(t), dtype=model.dtype(t)))
    if kind == "fill":
        return fingerprint(torch.full(model.shape(t), float(spec[1]), dtype=torch.float32).to(model.dtype(t)))
    if kind == "bytes":
        n = int(np.prod(model.shape(t))) * model.dtype(t).itemsize
        return fingerprint(torch.full((n,), spec[1], dtype=torch.uint8))
    if kind == "torn":
        return fingerprint(model.torn(layer, e, t, rank, spec[1], spec[2] if len(spec) > 2 else None))
    if kind == "random":
        g = torch.Generator().manual_seed(hash((layer, e, t, rank)) & 0xFFFF)
        n = int(np.prod(model.shape(t))) * model.dtype(t).itemsize
        return fingerprint(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    raise ValueError(f"unknown corruption {spec!r}")


def _tensor_row(layer, expert, local, tensor, dtype, shape, f: Fingerprint, chunks: bool) -> dict:
    return dict(
        layer=layer, expert=expert, local_expert=local, tensor=tensor, copy_order=copy_order(tensor),
        dtype=str(dtype).replace("torch.", ""), shape=list(shape), nbytes=f.nbytes, fp=f.digest,
        chunk_fps=f.chunk_digests if chunks else None,
    )


def _columns(rows: list[dict]) -> dict[str, list]:
    keys = rows[0].keys() if rows else []
    return {k: [r[k] for r in rows] for k in keys}


def rows_table(rows: list[dict], schema: pa.Schema = TRACE_SCHEMA) -> pa.Table:
    cols = _columns(rows)
    return pa.Table.from_pydict({f.name: cols.get(f.name, [None] * len(rows)) for f in schema}, schema=schema)


def write_rank(out: str, run_id: str, rank: int, rows: list[dict], tp_size: int, checkpoint_id: str,
               parts: int = 1, manifest: dict | None = None, write_manifest: bool = True, ep_size: int = 1) -> str:
    """Write one rank's rows as `parts` Parquet parts plus its manifest; returns the rank folder."""
    d = os.path.join(out, run_id, f"rank={rank}")
    os.makedirs(d, exist_ok=True)
    t = rows_table(rows)
    n = t.num_rows
    per = max(1, -(-n // max(parts, 1)))
    names = []
    for i, s in enumerate(range(0, max(n, 1), per)):
        if n == 0:
            break
        name = f"part-{i:05d}.parquet"
        pq.write_table(t.slice(s, per), os.path.join(d, name))
        names.append(name)
    if write_manifest:
        m = {
            "schema_version": MANIFEST_SCHEMA_VERSION, "run_id": run_id, "tp_size": tp_size, "tp_rank": rank,
            "ep_size": ep_size, "ep_rank": 0, "checkpoint_id": checkpoint_id, "started_at": "2026-11-05T00:00:00Z",
            "finished_at": "2026-11-05T00:01:00Z", "finished": True, "rows_written": n, "rows_dropped": 0,
            "hook_errors": 0, "parts": names,
        }
        m.update(manifest or {})
        with open(os.path.join(d, "_manifest.json"), "w") as f:
            json.dump(m, f, indent=1)
    return d


def write_run_json(out: str, run_id: str, tp_size: int, checkpoint_id: str, ranks: list[int] | None = None,
                   ep_size: int = 1) -> None:
    os.makedirs(os.path.join(out, run_id), exist_ok=True)
    with open(os.path.join(out, run_id, "_run.json"), "w") as f:
        json.dump({"run_id": run_id, "checkpoint_id": checkpoint_id, "tp_size": tp_size, "ep_size": ep_size,
                   "ranks": ranks if ranks is not None else list(range(tp_size))}, f)


def write_scenario(model: SynthModel, out: str, run_id: str, steps: list[int],
                   corrupt: Callable[[int, int, int], dict] | dict | None = None, layers: list[int] | None = None,
                   ranks: list[int] | None = None, chunk_fps: str = "mismatch", parts: int = 1,
                   manifest: dict | Callable[[int], dict] | None = None, source: str = "staged") -> str:
    """A whole run: every (step, rank, layer) load, corrupt(step, rank, layer) -> corruption dict."""
    layers = model.layer_ids if layers is None else layers
    ranks = list(range(model.tp_size)) if ranks is None else ranks
    write_run_json(out, run_id, model.tp_size, model.checkpoint_id)
    for r in ranks:
        rows, seq = [], 0
        for s in steps:
            for l in layers:
                c = corrupt(s, r, l) if callable(corrupt) else (corrupt or {}).get((s, r, l))
                rows += load_rows(model, run_id, s, r, l, source=source, load_seq=seq, corrupt=c, chunk_fps=chunk_fps)
                seq += 1
        m = manifest(r) if callable(manifest) else manifest
        write_rank(out, run_id, r, rows, model.tp_size, model.checkpoint_id, parts=parts, manifest=m)
    return os.path.join(out, run_id)


# ---------------------------------------------------------------- benchmark-sized data, random fingerprints

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
    """Index with random fingerprints and chunk fingerprints; returns arrays for the trace writer."""
    rng = np.random.default_rng(seed)
    tensors = list(COPY_ORDER_FP8_BLOCK)
    R, L, E, T = np.meshgrid(np.arange(tp), np.arange(layers), np.arange(experts), np.arange(len(tensors)), indexing="ij")
    R, L, E, T = (x.reshape(-1) for x in (R, L, E, T))
    n = len(R)
    nbytes = np.array([int(np.prod(BENCH_SHAPES[t][0])) * BENCH_SHAPES[t][2] for t in tensors], np.int64)[T]
    nchunks = -(-nbytes // CHUNK_BYTES)
    fps = _rand16(rng, n)
    chunk_words = _rand16(rng, int(nchunks.sum()))
    offsets = np.r_[0, np.cumsum(nchunks * 16)].astype(np.int32)
    chunk_arr = pa.BinaryArray.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(chunk_words.tobytes())])
    shapes = [list(BENCH_SHAPES[t][0]) for t in tensors]
    tnames = pa.array(tensors)
    cols = {
        "schema_version": pa.array(np.full(n, INDEX_SCHEMA_VERSION, np.int16)),
        "checkpoint_id": pa.array([checkpoint_id] * n),
        "tp_size": pa.array(np.full(n, tp, np.int16)), "tp_rank": pa.array(R.astype(np.int16)),
        "ep_size": pa.array(np.ones(n, np.int16)), "ep_rank": pa.array(np.zeros(n, np.int16)),
        "moe_tp_size": pa.array(np.full(n, tp, np.int16)), "moe_tp_rank": pa.array(R.astype(np.int16)),
        "layer": pa.array(L.astype(np.int32)), "expert": pa.array(E.astype(np.int32)),
        "local_expert": pa.array(E.astype(np.int32)), "tensor": tnames.take(pa.array(T)),
        "copy_order": pa.array(T.astype(np.int8)),
        "dtype": pa.array([BENCH_SHAPES[t][1] for t in tensors]).take(pa.array(T)),
        "shape": pa.array(shapes, pa.list_(pa.int64())).take(pa.array(T)),
        "nbytes": pa.array(nbytes), "fp": _fixed16(fps), "chunk_fps": chunk_arr,
    }
    pq.write_table(pa.table(cols, schema=INDEX_SCHEMA), path)
    return {"R": R, "L": L, "E": E, "T": T, "nbytes": nbytes, "fps": fps, "chunk_words": chunk_words,
            "chunk_off": offsets // 16, "nchunks": nchunks, "tensors": tensors, "tp": tp, "layers": layers,
            "experts": experts, "checkpoint_id": checkpoint_id}


def _fixed16(words: np.ndarray) -> pa.Array:
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(words), [None, pa.py_buffer(np.ascontiguousarray(words).tobytes())])


def write_bench(out: str, rows: int, run_id: str = "bench", seed: int = 0, rows_per_part: int = 250_000,
                layers: int = 48, experts: int = 256, tp: int = 2, chunk_fps: str = "all") -> dict:
    """Index at OUT/index.parquet and a trace of about `rows` rows under OUT/trace/<run_id>.

    chunk_fps: "all" (the tracer's default: every row carries its chunk
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
    write_run_json(trace_dir, run_id, tp, ix["checkpoint_id"])
    # transport order = expert position (the staged loop walks experts in order)
    for r in range(tp):
        base = np.flatnonzero(ix["R"] == r)  # index rows of this rank, sorted (layer, expert, tensor)
        rank_rows = min(steps * per_rank_step, max(0, rows - written))
        rank_dir = os.path.join(trace_dir, run_id, f"rank={r}")
        os.makedirs(rank_dir, exist_ok=True)
        part, done, names = 0, 0, []
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
            tbl = _bench_table(ix, j, fps, chunk, step, r, run_id, done, chunk_fps == "all")
            name = f"part-{part:05d}.parquet"
            pq.write_table(tbl, os.path.join(rank_dir, name), row_group_size=65536)
            names.append(name)
            part += 1
            done += m
        written += rank_rows
        with open(os.path.join(rank_dir, "_manifest.json"), "w") as f:
            json.dump({"schema_version": MANIFEST_SCHEMA_VERSION, "run_id": run_id, "tp_size": tp, "tp_rank": r,
                       "ep_size": 1, "ep_rank": 0, "checkpoint_id": ix["checkpoint_id"], "started_at": "", "finished_at": "",
                       "finished": True, "rows_written": int(rank_rows), "rows_dropped": 0, "hook_errors": 0,
                       "parts": names}, f)
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
                pa.large_binary(), len(ix["nchunks"]), [None, pa.py_buffer(off), pa.py_buffer(ix["chunk_words"].tobytes())])
        chunk_col = ix["chunk_arr"].take(pa.array(j)).cast(pa.binary())
        if mask.any():
            chunk_col = pc.replace_with_mask(chunk_col, pa.array(mask), pa.array([c for c in chunk if c is not None], pa.binary()))
    else:
        chunk_col = pa.array(chunk, pa.binary())
    tensors = ix["tensors"]
    T = ix["T"][j]
    shapes = pa.array([list(BENCH_SHAPES[t][0]) for t in tensors], pa.list_(pa.int64()))
    per_load = ix["experts"] * len(tensors)
    cols = {
        "schema_version": pa.array(np.full(m, TRACE_SCHEMA_VERSION, np.int16)),
        "run_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)), pa.array([run_id])).cast(pa.string()),
        "tp_size": pa.array(np.full(m, ix["tp"], np.int16)), "tp_rank": pa.array(np.full(m, rank, np.int16)),
        "ep_size": pa.array(np.ones(m, np.int16)), "ep_rank": pa.array(np.zeros(m, np.int16)),
        "moe_tp_size": pa.array(np.full(m, ix["tp"], np.int16)), "moe_tp_rank": pa.array(np.full(m, rank, np.int16)),
        "step": pa.array(step.astype(np.int64)),
        "source": pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)), pa.array(["staged"])).cast(pa.string()),
        "load_seq": pa.array(((seq0 + np.arange(m)) // per_load).astype(np.int64)),
        "transport_order": pa.array(ix["E"][j].astype(np.int32)),
        "layer": pa.array(ix["L"][j].astype(np.int32)), "expert": pa.array(ix["E"][j].astype(np.int32)),
        "local_expert": pa.array(ix["E"][j].astype(np.int32)),
        "tensor": pa.array(tensors).take(pa.array(T)),
        "copy_order": pa.array(T.astype(np.int8)),
        "dtype": pa.array([BENCH_SHAPES[t][1] for t in tensors]).take(pa.array(T)),
        "shape": shapes.take(pa.array(T)),
        "nbytes": pa.array(ix["nbytes"][j]), "fp": _fixed16(fps),
        "chunk_fps": chunk_col,
        "online": pa.nulls(m, pa.string()),
        "time_ns": pa.array(1_700_000_000_000_000_000 + np.arange(m, dtype=np.int64)),
    }
    return pa.table(cols, schema=TRACE_SCHEMA)
