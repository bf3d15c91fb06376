"""Online verification: compare captured digests with the index in-process.

The index (local path or URL) is read once through the one index reader, for this
rank only, into a dict (layer, expert, tensor) -> 16-byte digest.
"""

from __future__ import annotations

from typing import Sequence

from moetrace.checkpoints.index import read_index

MATCH = "match"
MISMATCH = "mismatch"


class OnlineIndex:
    """Expected digests of one rank: ``expected(layer, expert, tensor)``."""

    def __init__(self, index: str, tp_rank: int):
        table = read_index(index, columns=["checkpoint_id", "layer", "expert", "tensor", "digest"], tp_rank=tp_rank)
        ids = table.column("checkpoint_id").unique().to_pylist()
        self.checkpoint_id: str | None = ids[0] if len(ids) == 1 else None
        self.path = index
        self.tp_rank = tp_rank
        self._digest: dict[tuple[int, int, str], bytes] = {
            (l, e, t): d
            for l, e, t, d in zip(
                table.column("layer").to_pylist(),
                table.column("expert").to_pylist(),
                table.column("tensor").to_pylist(),
                table.column("digest").to_pylist(),
            )
        }

    def __len__(self) -> int:
        return len(self._digest)

    def expected(self, layer: int, expert: int, tensor: str) -> bytes | None:
        return self._digest.get((layer, expert, tensor))

    def verdicts(self, layer: int, experts: Sequence[int], tensor: str, digests: Sequence[bytes]) -> list[str | None]:
        """'match' | 'mismatch' | None (not in the index) per row."""
        out: list[str | None] = []
        for e, d in zip(experts, digests):
            want = self._digest.get((layer, e, tensor))
            out.append(None if want is None else (MATCH if want == d else MISMATCH))
        return out
