"""The project's shared vocabulary: tensor names and copy orders, sources, rank identity,
the versioned Parquet schemas of the index and the trace, report schema names, and the
one syntax for id ranges. The bottom layer: it imports nothing of moetrace but errors.

Glossary (one word per concept, in code, docs and schemas alike):

- expert: a routed MoE expert, by its global (logical) id in the checkpoint; a shared
  expert fused into the FusedMoE gets id ``num_experts + j``, as SGLang's loader names it.
- slot: a position in a rank's stacked ``[E_local, ...]`` FusedMoE parameter; the
  server's own map says which expert each slot holds (EPLB, KT's tables, fused shared
  slots). expert_copy: which physical copy of its expert a slot is (0 = the first in the
  layer's map; redundant EPLB copies count up).
- model: ``target``, or ``draft`` for a speculative-decoding draft model (Qwen3.5 MTP),
  which has its own layers numbered from 0.
- process: one server worker, named by (replica, pp_rank, tp_rank); its folder is
  ``rank=<rank_label>``. replica: a data-parallel copy of the whole TP group.
- tensor: a FusedMoE parameter name (``w13_weight``, ``w2_weight_scale_inv``, ...).
- shard: the part of an expert's tensor a TP/EP rank must hold.
- digest: the 16-byte content value of a tensor (``digest``), or of one chunk of it
  (``chunk_digests``); the fingerprint is the definition that makes them (``fp_version``).
- index: the expected digests of every shard, built from the checkpoint.
- trace: the digests captured from a live server, one Parquet folder per rank.
- capture: one event of a rank fingerprinting a layer's tensors (``capture_seq``).
- source: where a capture came from: ``staged`` (a KT full-layer load through host
  slots), ``loaded`` (a layer's tensors as the checkpoint loader left them, before the
  kernel's post-load processing: vLLM's load boundary) or ``resident`` (a FusedMoE
  forward).
- step: a forward-pass number, equal on every rank for the same pass.
- transport_position: an expert's position in a staged load's copy sequence (-1 when
  it was not staged through the host slots); copy_position: a tensor's position in its
  expert's copy order (``COPY_ORDERS``).
- verdict: what a captured tensor is, compared with the index (docs/analysis.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from moetrace.errors import MoetraceError

INDEX_SCHEMA_VERSION = 3  # 3: fingerprint v3 (XXH3-128 chunk digests)
TRACE_SCHEMA_VERSION = 4  # 4: source "loaded" (the load boundary)
READABLE_TRACE_SCHEMA_VERSIONS = (3, 4)  # 3: the same columns, sources staged and resident only
MANIFEST_SCHEMA_VERSION = 4  # 4: the ways things were found are *_found_by, never *source (docs/capture.md)
REPORT_SCHEMA, REPORT_SCHEMA_VERSION = "moetrace.analysis", 3  # 3: summaries' shared-expert stale detail
DIFF_SCHEMA, DIFF_SCHEMA_VERSION = "moetrace.diff", 2
CONFORM_SCHEMA, CONFORM_SCHEMA_VERSION = "moetrace.conform", 3  # 3: "marlin" (int4)

# ---------------------------------------------------------------- tensors

# The order the KT fork copies one expert's tensors in; also the tie-break order
# of "first divergence". Keyed by expert format (checkpoints.spec.FORMATS); compressed-tensors
# block FP8 holds its scales under the weight_scale names (checkpoints.shards.tensor_names).
COPY_ORDERS: dict[str, tuple[str, ...]] = {
    "fp8_block": ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"),
    "fp8_channel": ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    "fp8_tensor": ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    "bf16": ("w13_weight", "w2_weight"),
    # compressed-tensors W4A16 pack-quantized: int32 words of 8 int4 values, group scales
    "int4": ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"),
}
# Every FusedMoE parameter a capture can hold, in a stable order.
TENSOR_NAMES: tuple[str, ...] = tuple(dict.fromkeys(n for order in COPY_ORDERS.values() for n in order))


def copy_position(tensor: str) -> int:
    """Where a FusedMoE parameter comes in an expert's copy: w13_weight 0, its scale 1,
    w2_weight 2, its scale 3 (the FP8 orders; BF16 keeps these numbers, so positions
    compare across formats)."""
    for order in (COPY_ORDERS["fp8_block"], COPY_ORDERS["fp8_channel"], COPY_ORDERS["int4"]):
        if tensor in order:
            return order.index(tensor)
    raise KeyError(tensor)


def dtype_name(dtype) -> str:
    """torch.float8_e4m3fn -> "float8_e4m3fn": the dtype spelling of every schema."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- sources and ranks

# Code order matters to the analysis: a staged load and a load-boundary capture precede
# the layer's resident use. Codes are made when a trace is read (the Parquet holds names).
SOURCES: tuple[str, ...] = ("staged", "loaded", "resident")


MODELS: tuple[str, ...] = ("target", "draft")


@dataclass(frozen=True)
class RankIdentity:
    """Which process a row comes from and which shard of the experts it holds: SGLang's
    TP/EP coordinates, the pipeline stage, and the data-parallel replica (0 when the
    server has one). The shard depends on moe_tp_rank only (moe_tp = tp / ep / moe_dp)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    replica: int = 0


_LABEL = re.compile(r"^(?:replica(\d+)-)?(?:pp(\d+)-)?tp(\d+)$")


def rank_label(tp_rank: int, pp_rank: int = 0, pp_size: int = 1, replica: int | None = None) -> str:
    """A process's folder label: "3" with one stage and no replicas (the TP rank), else
    "pp1-tp3", "replica2-tp3" or "replica2-pp1-tp3"."""
    parts = ([f"replica{int(replica)}"] if replica is not None else []) + ([f"pp{int(pp_rank)}"] if pp_size > 1 else [])
    return "-".join(parts + [f"tp{int(tp_rank)}"]) if parts else str(int(tp_rank))


def parse_rank_label(label: str) -> tuple[int | None, int | None, int] | None:
    """rank_label() back to (replica or None, pp_rank or None, tp_rank); None if not a label."""
    if label.isdigit():
        return None, None, int(label)
    m = _LABEL.match(label)
    if not m or (m.group(1) is None and m.group(2) is None):
        return None
    return (None if m.group(1) is None else int(m.group(1)), None if m.group(2) is None else int(m.group(2)),
            int(m.group(3)))


def label_key(label: str) -> tuple[int, int, int]:
    """A rank label's sort key: (replica, pp_rank, tp_rank), absent parts 0."""
    parsed = parse_rank_label(str(label))
    if parsed is None:
        return (1 << 30, 0, 0)
    replica, pp, tp = parsed
    return (replica or 0, pp or 0, tp)


# ---------------------------------------------------------------- Parquet schemas

# Built on first use (``from moetrace.schema import TRACE_SCHEMA`` goes through the module's
# __getattr__): pyarrow and numpy take ~0.2 s to import, which `moetrace --help` and
# `hook-spec` never need.
_SCHEMAS: dict = {}


def _arrow_schemas() -> dict:
    import pyarrow as pa

    def int16(*names: str) -> list:
        return [pa.field(n, pa.int16(), nullable=False) for n in names]

    model_field = pa.field("model", pa.string(), nullable=False)  # one of MODELS
    tensor_fields = [
        pa.field("layer", pa.int32(), nullable=False),  # the model's own layer id
        pa.field("expert", pa.int32(), nullable=False),  # global (logical) expert id
        pa.field("tensor", pa.string(), nullable=False),  # FusedMoE param name, e.g. w2_weight_scale_inv
        pa.field("copy_position", pa.int8(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),  # dtype_name()
        # per-expert shape; the list's child named as Parquet names it, so that a table written and
        # the same table read back serialize alike (an index built and one copied from the cache)
        pa.field("shape", pa.list_(pa.field("element", pa.int64())), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("digest", pa.binary(16), nullable=False),
        pa.field("chunk_digests", pa.binary(), nullable=True),  # 16 bytes per fingerprint.CHUNK_BYTES chunk
    ]
    # One row per (model, moe_tp_rank, layer, expert, tensor), every expert of every layer: the
    # shard of an expert depends on moe_tp_rank only, and with EPLB any rank may hold any expert.
    index = pa.schema(
        [pa.field("schema_version", pa.int16(), nullable=False), pa.field("checkpoint_id", pa.string(), nullable=False),
         model_field]
        + int16("tp_size", "ep_size", "moe_dp_size", "moe_tp_size", "moe_tp_rank")
        + tensor_fields
    )
    trace = pa.schema(
        [pa.field("schema_version", pa.int16(), nullable=False), pa.field("run_id", pa.string(), nullable=False),
         model_field]
        + int16("tp_size", "tp_rank", "ep_size", "ep_rank", "moe_tp_size", "moe_tp_rank", "pp_size", "pp_rank",
                "replica")
        + [
            pa.field("step", pa.int64(), nullable=False),
            pa.field("source", pa.string(), nullable=False),  # one of SOURCES
            pa.field("capture_seq", pa.int64(), nullable=False),  # per-rank capture counter
            pa.field("transport_position", pa.int32(), nullable=False),
            pa.field("slot", pa.int32(), nullable=False),  # position in the rank's [E_local, ...] param
            pa.field("expert_copy", pa.int16(), nullable=False),  # physical copy of `expert` (0 = first)
            pa.field("slot_count", pa.int32(), nullable=False),  # slots of the capture event
        ]
        + tensor_fields
        + [
            pa.field("online", pa.string(), nullable=True),  # "match" | "mismatch" | null (not checked)
            pa.field("time_ns", pa.int64(), nullable=False),  # wall clock at capture
        ]
    )
    return {"INDEX_SCHEMA": index, "TRACE_SCHEMA": trace}


def __getattr__(name: str):
    if name in ("INDEX_SCHEMA", "TRACE_SCHEMA"):
        if not _SCHEMAS:
            _SCHEMAS.update(_arrow_schemas())
        return _SCHEMAS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- id ranges

# Without a known bound, ids at or above this are refused: no model has a million
# layers or experts, and a range is never expanded before it is checked.
MAX_ID = 1 << 20
_ID_OR_RANGE = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_ids(value, what: str, bound: int | None = None) -> frozenset[int] | None:
    """The one syntax for layer/expert lists in options, hook config and manifests.

    None, "", "all" -> None (every id). "0,2,5-7", [0, 2, "5-7"] or a lone int -> a
    frozenset. Ids must be >= 0 and below `bound` (the model's size; MAX_ID when
    unknown); a reversed range (5-3) is an error. Bounds are checked before a range
    is expanded, so a huge range is an error, never an allocation.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "all")):
        return None
    limit = MAX_ID if bound is None else int(bound)
    where = f"below {bound} (the model's size)" if bound is not None else f"below {MAX_ID}"
    items: Iterable = value.split(",") if isinstance(value, str) else value
    if isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    elif not isinstance(value, (str, list, tuple, set, frozenset, range)):
        raise MoetraceError(f"{what}: {value!r} is not a list of ids like 0,2,5-7")
    out: set[int] = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise MoetraceError(f"{what}: {item!r} is not an id or a range like 5-7")
        if isinstance(item, int):
            lo = hi = item
            text = str(item)
        else:
            text = item.strip()
            if not text:
                continue
            m = _ID_OR_RANGE.match(text)
            if not m:
                raise MoetraceError(f"{what}: {text!r} is not an id or a range like 5-7 (ids are >= 0)")
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else int(m.group(2))
        if lo < 0:
            raise MoetraceError(f"{what}: {text!r}: ids must be >= 0")
        if hi < lo:
            raise MoetraceError(f"{what}: {text!r}: range end is below its start (write {hi}-{lo})")
        if hi >= limit:
            raise MoetraceError(f"{what}: {text!r}: ids must be {where}")
        out.update(range(lo, hi + 1))
    return frozenset(out) if out else None


def format_ids(ids: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"; empty -> "none". Keeps 256-expert lists to one short line."""
    xs = sorted(set(int(x) for x in ids))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "none"
