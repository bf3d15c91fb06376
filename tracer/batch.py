"""One capture batch (all captured experts of one tensor in one capture event) and
its trace rows (schema.TRACE_SCHEMA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from moetrace.fingerprint import Fingerprint
from moetrace.schema import TRACE_SCHEMA, TRACE_SCHEMA_VERSION, RankIdentity, copy_position


@dataclass(frozen=True)
class CaptureEvent:
    """What every tensor of one capture event shares (one staged load, one forward)."""

    ranks: RankIdentity
    step: int
    source: str  # "resident" | "staged"
    capture_seq: int
    layer: int
    experts: list[int]  # logical ids the server's map gives the slots, one per captured row
    slots: list[int]  # slot in the stacked param, per row
    positions: list[int]  # transport_position per row
    time_ns: int
    model: str = "target"  # schema.MODELS
    copies: list[int] | None = None  # expert_copy per row (None: all 0)
    slot_count: int | None = None  # slots of the capture event (None: the rows)

    @property
    def where(self) -> tuple[str, int]:
        """(model, layer): a draft's layer 0 is not the target's."""
        return self.model, self.layer


@dataclass
class CapturedTensor:
    """One parameter of a capture event, ready to fingerprint (or already known)."""

    name: str
    data: torch.Tensor  # [rows, ...]: the captured experts only (when fingerprinted)
    nbytes: int  # per row
    rows: torch.Tensor  # uint8 [rows, nbytes] view of data
    key: object | None  # tracer.unchanged.WeightsKey: the parameter provably unchanged while equal
    fps: list[Fingerprint] | None  # reused fingerprints (unchanged resident weights)


@dataclass
class CaptureBatch:
    """All captured experts of one parameter in one capture event."""

    ranks: RankIdentity
    step: int
    source: str  # "resident" | "staged"
    capture_seq: int
    layer: int
    tensor: str
    dtype: str
    shape: list[int]  # per-expert shape
    nbytes: int  # per expert
    experts: list[int]  # logical ids the server's map gives the slots, one per row
    slots: list[int]  # slot in the stacked param, per row
    positions: list[int]  # transport_position per row
    time_ns: int
    chunks: np.ndarray | torch.Tensor | None = None  # uint8 [rows, chunks, 16]: chunk digests on the host
    ready: object | None = None  # torch.cuda.Event to wait on before reading the chunk digests
    fps: list[Fingerprint] | None = None  # set when already folded (synchronous verification, unchanged weights)
    on_folded: Callable[[list[Fingerprint]], None] | None = None  # told the fingerprints once folded
    online: list[str | None] | None = None
    dumps: list[tuple[int, torch.Tensor, bytes | None, bytes]] = field(default_factory=list)
    # (expert, host copy of the tensor, expected digest, captured digest) of mismatches to dump
    model: str = "target"  # schema.MODELS
    copies: list[int] | None = None  # expert_copy per row (None: all 0)
    slot_count: int | None = None  # slots of the capture event (None: the rows)

    @property
    def n_rows(self) -> int:
        return len(self.experts)

    @property
    def host_bytes(self) -> int:
        if self.chunks is None:
            chunks = 0
        elif isinstance(self.chunks, np.ndarray):
            chunks = int(self.chunks.nbytes)
        else:
            chunks = self.chunks.numel() * self.chunks.element_size()
        return chunks + sum(int(t.numel() * t.element_size()) for _, t, _, _ in self.dumps) + 256 * self.n_rows


def batch_rows(b: CaptureBatch, fps: list[Fingerprint], run_id: str, verifier, chunk_digests: str,
               rows: "TraceRows") -> list:
    """What a capture batch becomes in the trace, from its fingerprints: its online
    verdicts (``verifier``: tracer.online, None when off) and the chunk digests its rows
    keep (``chunk_digests``: all, mismatch or none), added to ``rows``. Returns the online
    verdict of each."""
    digests = [f.digest for f in fps]
    online = b.online
    if online is None and verifier is not None:
        online = verifier.batch_verdicts(b, digests)
    if online is None:
        online = [None] * b.n_rows
    if chunk_digests == "all":
        chunks = [f.chunk_digests for f in fps]
    elif chunk_digests == "mismatch":
        chunks = [f.chunk_digests if v != "match" else None for f, v in zip(fps, online)]
    else:
        chunks = [None] * b.n_rows
    rows.add(b, run_id, digests, chunks, online)
    return online


class TraceRows:
    """Trace rows gathered column by column until a part is written (schema.TRACE_SCHEMA):
    one Arrow table per part, not a RecordBatch per capture batch, whose from_pydict costs
    ~0.4 ms a call at any size (the writer thread's main cost with small per-forward
    captures, e.g. vLLM's resident layers: bench/bench_vllm.py)."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in TRACE_SCHEMA.names}
        self.rows = 0

    def add(self, b: CaptureBatch, run_id: str, digests: list[bytes], chunks: list[bytes | None],
            online: list[str | None]) -> None:
        """The batch's rows, one per captured expert."""
        n = b.n_rows
        r = b.ranks
        same = {"schema_version": TRACE_SCHEMA_VERSION, "run_id": run_id, "model": b.model, "tp_size": r.tp_size,
                "tp_rank": r.tp_rank, "ep_size": r.ep_size, "ep_rank": r.ep_rank, "moe_tp_size": r.moe_tp_size,
                "moe_tp_rank": r.moe_tp_rank, "pp_size": r.pp_size, "pp_rank": r.pp_rank, "replica": r.replica,
                "step": b.step, "source": b.source, "capture_seq": b.capture_seq,
                "slot_count": b.slot_count if b.slot_count is not None else n, "layer": b.layer, "tensor": b.tensor,
                "copy_position": copy_position(b.tensor), "dtype": b.dtype, "shape": b.shape, "nbytes": b.nbytes,
                "time_ns": b.time_ns}
        per_row = {"transport_position": b.positions, "slot": b.slots,
                   "expert_copy": b.copies if b.copies is not None else [0] * n, "expert": b.experts,
                   "digest": digests, "chunk_digests": chunks, "online": online}
        for name, values in per_row.items():  # checked before any column grows: rows stay aligned
            if len(values) != n:
                raise ValueError(f"{name}: {len(values)} values for {n} rows")
        for name, value in same.items():
            self.cols[name].extend([value] * n)
        for name, values in per_row.items():
            self.cols[name].extend(values)
        self.rows += n

    def table(self) -> pa.Table:
        return pa.Table.from_pydict(self.cols, schema=TRACE_SCHEMA)
