"""Traces with known corruptions, written THROUGH the real TraceSink, so what the
analysis tests read is what a server writes (parts, manifests, schema).

``CheckpointModel`` wraps a synthetic checkpoint: the expected shard of every
(layer, expert, tensor, rank) comes from ``checkpoints.shards`` and the index from
the real ``build_index``. A corruption replaces what one load holds for one
(expert, tensor):

    ("expert", e2)           that layer/rank/tensor of expert e2
    ("rank", r2)             that expert's shard for rank r2
    ("layer", l2)            that expert/tensor of layer l2
    ("tensor", t2)           the digest of that expert's tensor t2 (digest only: sizes differ)
    ("zeros",)               all zeros
    ("fill", value)          torch.full of the tensor's dtype
    ("bytes", b)             the byte b repeated
    ("torn", e2[, split])    chunks [0, split) expected, the rest from expert e2
    ("random",)              random bytes
    None                     not captured (missing)
"""

from __future__ import annotations

import json
import os
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moetrace import storage
from moetrace.checkpoints.index import write_index
from moetrace.checkpoints.index_build import build_index
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer, tensor_names
from moetrace.fingerprint import CHUNK_BYTES, Fingerprint, fingerprint, n_chunks_for
from moetrace.schema import TRACE_SCHEMA, RankIdentity, dtype_name
from moetrace.tracer.batch import CaptureBatch
from moetrace.tracer.manifest import MANIFEST_NAME, RUN_MANIFEST_NAME, new_run_manifest, rank_dir_name
from moetrace.tracer.sink import TraceSink

Corruption = tuple | None
# A small MoE checkpoint for tests about input handling, not shards (conftest's small_model).
SMALL_MOE = dict(num_layers=2, num_experts=4, hidden=256, intermediate=512)


class CheckpointModel:
    """Expected shards and digests of a checkpoint at one TP size (EP 1)."""

    def __init__(self, checkpoint_path, tp_size: int = 2):
        self.path = str(checkpoint_path)
        self.ckpt = open_checkpoint(self.path)
        self.spec = self.ckpt.spec
        self.tp_size = tp_size
        self.num_experts = self.spec.num_experts
        self.layer_ids = list(self.spec.moe_layers)
        self.checkpoint_id = self.ckpt.identity
        self.tensors = tensor_names(self.spec)
        self._layers: dict = {}
        self._digests: dict = {}

    def _layer(self, layer: int, rank: int) -> dict[str, torch.Tensor]:
        key = (layer, rank)
        if key not in self._layers:
            self._layers[key] = expected_layer(self.ckpt, layer, rank, Parallel(self.tp_size))
        return self._layers[key]

    def tensor(self, layer: int, expert: int, tensor: str, rank: int) -> torch.Tensor:
        return self._layer(layer, rank)[tensor][expert]

    def fingerprint(self, layer: int, expert: int, tensor: str, rank: int) -> Fingerprint:
        key = (layer, expert, tensor, rank)
        if key not in self._digests:
            self._digests[key] = fingerprint(self.tensor(*key))
        return self._digests[key]

    def write_index(self, path: str, tp_size: int | None = None) -> str:
        write_index(build_index(self.path, tp_size or self.tp_size), path)
        return str(path)

    def content(self, layer: int, expert: int, tensor: str, rank: int, spec: Corruption | str) -> Fingerprint:
        """The fingerprint of what a corrupted load holds (spec: see the module docstring)."""
        if spec == "clean":
            return self.fingerprint(layer, expert, tensor, rank)
        want = self.tensor(layer, expert, tensor, rank)
        kind = spec[0]
        if kind == "expert":
            return self.fingerprint(layer, spec[1], tensor, rank)
        if kind == "rank":
            return self.fingerprint(layer, expert, tensor, spec[1])
        if kind == "layer":
            return self.fingerprint(spec[1], expert, tensor, rank)
        if kind == "tensor":
            return self.fingerprint(layer, expert, spec[1], rank)
        if kind == "zeros":
            return fingerprint(torch.zeros_like(want))
        if kind == "fill":
            return fingerprint(torch.full(want.shape, float(spec[1])).to(want.dtype))
        nbytes = want.numel() * want.element_size()
        if kind == "bytes":
            return fingerprint(torch.full((nbytes,), spec[1], dtype=torch.uint8))
        if kind == "random":
            g = torch.Generator().manual_seed(hash((layer, expert, tensor, rank)) & 0xFFFF)
            return fingerprint(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
        if kind == "torn":
            a = want.reshape(-1).view(torch.uint8).clone()
            b = self.tensor(layer, spec[1], tensor, rank).reshape(-1).view(torch.uint8)
            split = n_chunks_for(a.numel()) // 2 if len(spec) < 3 else spec[2]
            a[split * CHUNK_BYTES :] = b[split * CHUNK_BYTES :]
            return fingerprint(a)
        raise ValueError(f"unknown corruption {spec!r}")


def open_rank(model: CheckpointModel, out: str, run_id: str, rank: int, chunk_digests: str = "mismatch",
              config: dict | None = None, tp_size: int | None = None) -> TraceSink:
    """The real sink of one rank (the manifest records `config` as the hook config)."""
    return TraceSink(out, run_id, rank, tp_size or model.tp_size, config=config or {"out": out, "run_id": run_id},
                     checkpoint_id=model.checkpoint_id, chunk_digests=chunk_digests, rows_per_part=1 << 30,
                     flush_interval_s=3600)


def capture_load(sink: TraceSink, model: CheckpointModel, step: int, rank: int, layer: int, *,
                 source: str = "staged", capture_seq: int = 0, corrupt: dict | None = None,
                 experts: list[int] | None = None, tensors: tuple[str, ...] | None = None,
                 claimed: list[int] | None = None) -> None:
    """One capture event (one batch per tensor, as Tracer.capture queues it), corrupted as asked.
    ``claimed``: the expert ids the rows say they hold (default: ``experts``). Online verdicts
    are set as online verification would, so chunk_digests="mismatch" keeps chunk digests on
    the corrupted rows only."""
    corrupt = corrupt or {}
    experts = list(range(model.num_experts)) if experts is None else experts
    ranks = RankIdentity(model.tp_size, rank, 1, 0, model.tp_size, rank)
    ids = dict(zip(experts, claimed or experts))
    for t in tensors or model.tensors:
        rows = [(pos, e, corrupt.get((e, t), "clean")) for pos, e in enumerate(experts)]
        rows = [x for x in rows if x[2] is not None]
        if not rows:
            continue
        want = model.tensor(layer, rows[0][1], t, rank)
        fps = [model.content(layer, e, t, rank, spec) for _, e, spec in rows]
        online = ["match" if f.digest == model.fingerprint(layer, e, t, rank).digest else "mismatch"
                  for f, (_, e, _) in zip(fps, rows)]
        sink.submit(CaptureBatch(
            ranks=ranks, step=step, source=source, capture_seq=capture_seq, layer=layer, tensor=t,
            dtype=dtype_name(want.dtype), shape=list(want.shape), nbytes=want.numel() * want.element_size(),
            experts=[ids[e] for _, e, _ in rows], slots=[e for _, e, _ in rows], positions=[p for p, _, _ in rows],
            time_ns=0, fps=fps, online=online, slot_count=len(experts),
        ))


def patch_manifest(out: str, run_id: str, rank: int, fields: dict) -> None:
    """Edit a closed rank's manifest as a killed, failing or dropping rank leaves it."""
    path = os.path.join(out, run_id, rank_dir_name(rank), MANIFEST_NAME)
    with open(path) as f:
        m = json.load(f)
    m.update(fields)
    with open(path, "w") as f:
        json.dump(m, f)


def write_run_json(out: str, run_id: str, model: CheckpointModel, ranks: list[int] | None = None, **fields) -> None:
    """The _run.json `moetrace launch` leaves after a clean stop."""
    ranks = list(range(model.tp_size)) if ranks is None else ranks
    fs, base = storage.open_fs(out)
    storage.make_dirs(fs, storage.join(base, run_id))
    doc = new_run_manifest(run_id, out, tp_size=model.tp_size, expected_ranks=model.tp_size,
                           checkpoint_id=model.checkpoint_id, finished=True, complete=True,
                           ranks=[{"rank_label": str(r), "tp_rank": r, "pp_rank": 0, "replica": None, "present": True}
                                  for r in ranks], **fields)
    storage.write_json(fs, storage.join(base, run_id, RUN_MANIFEST_NAME), doc)


def write_scenario(model: CheckpointModel, out: str, run_id: str, steps: list[int],
                   corrupt: Callable[[int, int, int], dict] | dict | None = None, layers: list[int] | None = None,
                   ranks: list[int] | None = None, chunk_digests: str = "mismatch", parts: int = 1,
                   manifest: dict | Callable[[int], dict] | None = None, source: str = "staged",
                   extra: Callable[[TraceSink, int], object] | None = None) -> str:
    """A whole run: every (step, rank, layer) load, corrupt(step, rank, layer) -> corruption
    dict; `parts` parts per rank; `extra(sink, rank)` captures more before the sink closes;
    `manifest` fields patched into each closed rank's manifest."""
    layers = model.layer_ids if layers is None else layers
    ranks = list(range(model.tp_size)) if ranks is None else ranks
    write_run_json(out, run_id, model)
    loads = [(s, l) for s in steps for l in layers]
    per_part = max(1, -(-len(loads) // max(parts, 1)))
    for r in ranks:
        sink = open_rank(model, out, run_id, r, chunk_digests)
        for seq, (s, l) in enumerate(loads):
            c = corrupt(s, r, l) if callable(corrupt) else (corrupt or {}).get((s, r, l))
            capture_load(sink, model, s, r, l, source=source, capture_seq=seq, corrupt=c)
            if (seq + 1) % per_part == 0 and seq + 1 < len(loads):
                sink.flush()
        if extra is not None:
            extra(sink, r)
        assert sink.close(), f"rank {r} sink did not close cleanly: {sink.manifest()['errors']}"
        fields = manifest(r) if callable(manifest) else manifest
        if fields:
            patch_manifest(out, run_id, r, fields)
    return os.path.join(out, run_id)


def read_rows(out: str, run_id: str, rank: int | None = None) -> pa.Table:
    """All parts of a run (one rank or all) as one TRACE_SCHEMA table, for assertions."""
    fs, base = storage.open_fs(out)
    run_dir = storage.join(base, run_id)
    dirs = [storage.join(run_dir, rank_dir_name(rank))] if rank is not None else [
        i.path for i in storage.list_dir(fs, run_dir) if i.base_name.startswith("rank=")
    ]
    tables = []
    for d in sorted(dirs):
        for info in sorted(storage.list_dir(fs, d), key=lambda i: i.base_name):
            if info.base_name.startswith("part-") and info.base_name.endswith(".parquet"):
                with fs.open_input_file(info.path) as f:
                    tables.append(pq.read_table(f, schema=TRACE_SCHEMA))
    return pa.concat_tables(tables) if tables else TRACE_SCHEMA.empty_table()


def tamper_run(src, dst, rows: Callable[[str, pa.Table], pa.Table] | None = None,
               manifest: Callable[[str, dict], None] | None = None, copies: dict[str, str] | None = None) -> str:
    """Copy run folder `src` to `dst` and tamper with it as a hostile sweep would, keeping the
    side files consistent: per rank, ``rows(label, table)`` edits its rows (written back as
    one part), ``manifest(label, doc)`` its manifest; then the manifest's parts, rows_written,
    rows_captured and online counts are rewritten to match the rows. ``copies``: {rank label:
    another rank label}: that rank's folder replaced by a copy of the other's first."""
    import shutil

    shutil.copytree(src, dst)
    for label, other in (copies or {}).items():
        shutil.rmtree(os.path.join(dst, f"rank={label}"))
        shutil.copytree(os.path.join(src, f"rank={other}"), os.path.join(dst, f"rank={label}"))
    for name in sorted(os.listdir(dst)):
        if not name.startswith("rank="):
            continue
        label, folder = name[5:], os.path.join(dst, name)
        parts = sorted(p for p in os.listdir(folder) if p.startswith("part-") and p.endswith(".parquet"))
        table = pa.concat_tables([pq.read_table(os.path.join(folder, p)) for p in parts]) if parts else \
            TRACE_SCHEMA.empty_table()
        if rows is not None:
            table = rows(label, table)
        for p in parts:
            os.remove(os.path.join(folder, p))
        if table.num_rows:  # a rank that wrote nothing lists no part
            pq.write_table(table, os.path.join(folder, "part-00000.parquet"))
        with open(os.path.join(folder, MANIFEST_NAME)) as f:
            doc = json.load(f)
        if manifest is not None:
            manifest(label, doc)
        online = table.column("online").to_pylist()
        doc.update(parts=[{"file": "part-00000.parquet", "rows": table.num_rows, "written_at": doc["finished_at"]}]
                   if table.num_rows else [],
                   rows_written=table.num_rows, rows_captured=table.num_rows,
                   online={"match": online.count("match"), "mismatch": online.count("mismatch"),
                           "unchecked": online.count(None)})
        with open(os.path.join(folder, MANIFEST_NAME), "w") as f:
            json.dump(doc, f)
    return str(dst)


def set_column(table: pa.Table, name: str, values) -> pa.Table:
    """`table` with column `name` replaced by `values` (its type kept)."""
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
