"""Online verification: compare captured digests with the index in-process.

The index (local path or URL) is read once through the one index reader; the
expected digests of a shard (one moe_tp_rank) become a dict (model, layer, expert,
tensor) -> 16-byte digest the first time a capture of that shard asks.
"""

from __future__ import annotations

import threading
from typing import Sequence

import pyarrow.compute as pc

from moetrace.checkpoints.index import read_index

MATCH = "match"
MISMATCH = "mismatch"
_COLUMNS = ["checkpoint_id", "model", "moe_tp_rank", "layer", "expert", "tensor", "digest"]


class OnlineIndex:
    """Expected digests: ``expected(model, moe_tp_rank, layer, expert, tensor)``."""

    def __init__(self, index: str):
        self._table = read_index(index, columns=_COLUMNS)
        ids = self._table.column("checkpoint_id").unique().to_pylist()
        self.checkpoint_id: str | None = ids[0] if len(ids) == 1 else None
        self.path = index
        self._shards: dict[int, dict[tuple[str, int, int, str], bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._table.num_rows

    def _shard(self, moe_tp_rank: int) -> dict[tuple[str, int, int, str], bytes]:
        found = self._shards.get(moe_tp_rank)
        if found is None:
            with self._lock:
                t = self._table.filter(pc.equal(self._table.column("moe_tp_rank"), moe_tp_rank))
                found = self._shards[moe_tp_rank] = {
                    (m, l, e, n): d for m, l, e, n, d in zip(*(t.column(c).to_pylist() for c in
                                                               ("model", "layer", "expert", "tensor", "digest")))
                }
        return found

    def expected(self, model: str, moe_tp_rank: int, layer: int, expert: int, tensor: str) -> bytes | None:
        return self._shard(moe_tp_rank).get((model, layer, expert, tensor))

    def verdicts(self, model: str, moe_tp_rank: int, layer: int, experts: Sequence[int], tensor: str,
                 digests: Sequence[bytes]) -> list[str | None]:
        """'match' | 'mismatch' | None (not in the index) per row."""
        shard = self._shard(moe_tp_rank)
        out: list[str | None] = []
        for e, d in zip(experts, digests):
            want = shard.get((model, layer, e, tensor))
            out.append(None if want is None else (MATCH if want == d else MISMATCH))
        return out

    def batch_verdicts(self, b, digests: Sequence[bytes]) -> list[str | None]:
        """verdicts() of a tracer.batch.CaptureBatch."""
        return self.verdicts(b.model, b.ranks.moe_tp_rank, b.layer, b.experts, b.tensor, digests)
