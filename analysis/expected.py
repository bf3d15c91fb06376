"""The expected side of the analysis: the index as numpy columns, sorted by key.

Read through the one index reader (checkpoints.index), which checks the schema and
fingerprint versions; tensor and dtype names become the trace's ``Vocab`` codes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moetrace.analysis.trace import Vocab, digest_columns, held_shapes
from moetrace.checkpoints.index import INDEX_META_KEY, read_index
from moetrace.checkpoints.layout import ServerLayout
from moetrace.errors import MoetraceError
from moetrace.schema import MODELS

INDEX_COLUMNS = ["model", "moe_tp_rank", "layer", "expert", "tensor", "copy_position", "dtype", "shape", "nbytes",
                 "digest", "chunk_digests"]


@dataclass
class IndexData:
    """Expected digests, sorted by (shard, model, layer, expert, tensor); shard = moe_tp_rank."""

    path: str
    checkpoint_id: str
    tp_size: int
    ep_size: int
    rank: np.ndarray  # the shard: moe_tp_rank
    model: np.ndarray  # TraceData.models codes
    layer: np.ndarray
    expert: np.ndarray
    tensor: np.ndarray
    copy_position: np.ndarray
    dtype: np.ndarray
    nbytes: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    chunk_digests: pa.Array | None  # in file order; chunk_digests_of() maps sorted positions
    order: np.ndarray | None = None  # sorted position -> file row
    moe_tp_size: int = 1
    moe_dp_size: int = 1
    num_experts: int = 0  # routed experts; ids from here on are fused shared experts
    shared_experts: int = 0
    draft: dict | None = None  # the index metadata's "draft": {"format", "layers"} or {"excluded": why}
    layout: ServerLayout = ServerLayout()  # the server layout the rows reproduce (metadata "layout")
    fmt: str | None = None  # checkpoint format (metadata "format")
    intermediate_size: int | None = None  # moe_intermediate_size (metadata; older indexes: from w2_weight)
    held: dict | None = None  # tensor -> (dtype, per-expert shape) of its first row
    shapes: set | None = None  # every (model code, tensor code, per-expert shape) the index holds
    checkpoint_path: str | None = None  # the checkpoint folder it was built from (metadata)

    @property
    def n(self) -> int:
        return len(self.layer)

    def chunk_digests_of(self, positions: np.ndarray) -> pa.Array:
        rows = positions if self.order is None else self.order[positions]
        return self.chunk_digests.take(pa.array(rows))


def read_expected(path: str, tensors: Vocab, dtypes: Vocab, layers: set[int] | None = None,
                  models: Vocab | None = None) -> IndexData:
    """The index at `path` (local or URL) as sorted numpy columns, coded with the
    trace's vocabularies; only `layers` (of the target model) when given."""
    t = read_index(path, columns=INDEX_COLUMNS)
    if t.num_rows == 0:
        raise MoetraceError(f"index {path} has no rows")
    meta = _meta(t)
    models = models if models is not None else Vocab(MODELS)
    rank = t.column("moe_tp_rank").to_numpy().astype(np.int64)
    model = models.codes_of(t.column("model"), np.int8).astype(np.int64)
    layer = t.column("layer").to_numpy().astype(np.int64)
    expert = t.column("expert").to_numpy().astype(np.int64)
    tensor = tensors.codes_of(t.column("tensor"), np.int16).astype(np.int64)
    keep = np.ones(len(layer), dtype=bool)
    if layers is not None:
        keep = np.isin(layer, np.array(sorted(layers), dtype=np.int64)) | (model != models.code("target"))
    order = np.lexsort((tensor, expert, layer, model, rank))
    order = order[keep[order]]
    hi, lo = digest_columns(t.column("digest"))
    chunk = t.column("chunk_digests").combine_chunks() if "chunk_digests" in t.column_names else None
    idx = IndexData(
        path=path, checkpoint_id=str(meta["checkpoint_id"]), tp_size=int(meta["tp_size"]),
        ep_size=int(meta.get("ep_size") or 1),
        rank=rank[order], model=model[order], layer=layer[order], expert=expert[order], tensor=tensor[order],
        copy_position=t.column("copy_position").to_numpy().astype(np.int64)[order],
        dtype=dtypes.codes_of(t.column("dtype"), np.int16)[order],
        nbytes=t.column("nbytes").to_numpy().astype(np.int64)[order],
        hi=hi[order], lo=lo[order],
        chunk_digests=chunk, order=order,
        moe_tp_size=int(meta.get("moe_tp_size") or 1), moe_dp_size=int(meta.get("moe_dp_size") or 1),
        num_experts=int(meta.get("num_experts") or 0), shared_experts=int(meta.get("shared_experts") or 0),
        draft=meta.get("draft"),
        layout=ServerLayout.from_json(meta.get("layout")), fmt=meta.get("format"), held=_held(t),
        shapes=held_shapes(t.column("shape"), model, tensor), checkpoint_path=meta.get("checkpoint_path"),
    )
    idx.intermediate_size = meta.get("intermediate_size") or _intermediate_of(idx)
    key = np.stack([idx.rank, idx.model, idx.layer, idx.expert, idx.tensor], axis=1)
    if len(key) > 1 and (np.diff(key, axis=0) == 0).all(axis=1).any():
        raise MoetraceError(f"index {path} has duplicate (model, moe_tp_rank, layer, expert, tensor) entries")
    return idx


def _held(t: pa.Table) -> dict[str, tuple[str, list[int]]]:
    """tensor -> (dtype, per-expert shape) of its first row (all rows of a tensor share them)."""
    out = {}
    for name in pc.unique(t.column("tensor")).to_pylist():
        i = pc.index(t.column("tensor"), name).as_py()
        out[name] = (t.column("dtype")[i].as_py(), list(t.column("shape")[i].as_py()))
    return out


def _intermediate_of(idx: IndexData) -> int | None:
    """moe_intermediate_size of an index without that key: w2_weight is [H, I/moe_tp] (unpadded)."""
    held = (idx.held or {}).get("w2_weight")
    if held is None or idx.layout.intermediate_padded:
        return None
    return held[1][-1] * idx.moe_tp_size


def _meta(t: pa.Table) -> dict:
    return json.loads((t.schema.metadata or {})[INDEX_META_KEY])
