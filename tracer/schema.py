"""Parquet schemas of the public files: the expected-fingerprint index and the trace.

Both are versioned public interfaces (docs/schemas.md). Bump the version on any
change a reader could notice; never reuse a column name with a new meaning.
"""

from __future__ import annotations

import pyarrow as pa

INDEX_SCHEMA_VERSION = 1
TRACE_SCHEMA_VERSION = 1
MANIFEST_SCHEMA_VERSION = 1

# Tensor copy order inside one expert's transport (the KT fork copies in this
# order); also the tie-break order for "first divergence".
COPY_ORDER_FP8_BLOCK = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
COPY_ORDER_FP8_CHANNEL = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
COPY_ORDER_BF16 = ("w13_weight", "w2_weight")
TENSOR_NAMES = tuple(dict.fromkeys(COPY_ORDER_FP8_BLOCK + COPY_ORDER_FP8_CHANNEL))


def copy_order(tensor: str) -> int:
    """Position of a FusedMoE parameter name in the transport copy order."""
    for order in (COPY_ORDER_FP8_BLOCK, COPY_ORDER_FP8_CHANNEL):
        if tensor in order:
            return order.index(tensor)
    raise KeyError(tensor)


_RANKS = [
    pa.field("tp_size", pa.int16(), nullable=False),
    pa.field("tp_rank", pa.int16(), nullable=False),
    pa.field("ep_size", pa.int16(), nullable=False),
    pa.field("ep_rank", pa.int16(), nullable=False),
    pa.field("moe_tp_size", pa.int16(), nullable=False),
    pa.field("moe_tp_rank", pa.int16(), nullable=False),
]

_TENSOR = [
    pa.field("layer", pa.int32(), nullable=False),
    pa.field("expert", pa.int32(), nullable=False),  # global (logical) expert id
    pa.field("local_expert", pa.int32(), nullable=False),  # slot in the rank's [E_local, ...] param
    pa.field("tensor", pa.string(), nullable=False),  # FusedMoE param name, e.g. w2_weight_scale_inv
    pa.field("copy_order", pa.int8(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),  # torch dtype name without "torch."
    pa.field("shape", pa.list_(pa.int64()), nullable=False),  # per-expert shape
    pa.field("nbytes", pa.int64(), nullable=False),
    pa.field("fp", pa.binary(16), nullable=False),  # tracer.fingerprint digest
    pa.field("chunk_fps", pa.binary(), nullable=True),  # 16 bytes per CHUNK_BYTES chunk
]

INDEX_SCHEMA = pa.schema(
    [pa.field("schema_version", pa.int16(), nullable=False), pa.field("checkpoint_id", pa.string(), nullable=False)]
    + _RANKS
    + _TENSOR
)

TRACE_SCHEMA = pa.schema(
    [pa.field("schema_version", pa.int16(), nullable=False), pa.field("run_id", pa.string(), nullable=False)]
    + _RANKS
    + [
        pa.field("step", pa.int64(), nullable=False),  # forward-pass number, equal across ranks
        pa.field("source", pa.string(), nullable=False),  # "resident" | "staged"
        pa.field("load_seq", pa.int64(), nullable=False),  # per-rank capture event counter
        pa.field("transport_order", pa.int32(), nullable=False),  # expert's position in the load
    ]
    + _TENSOR
    + [
        pa.field("online", pa.string(), nullable=True),  # "match" | "mismatch" | null (not checked)
        pa.field("time_ns", pa.int64(), nullable=False),  # wall clock at capture
    ]
)
