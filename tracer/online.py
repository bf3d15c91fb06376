"""Online verification: compare captured fingerprints with the index in-process.

The index (INDEX_SCHEMA Parquet, local path or URL) is read once, for this
rank only, into a dict (layer, expert, tensor) -> 16-byte fingerprint.
"""

from __future__ import annotations

from typing import Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from moetrace.errors import MoetraceError
from moetrace.tracer.storage import open_fs

MATCH = "match"
MISMATCH = "mismatch"


class OnlineIndex:
    """Expected fingerprints of one rank: ``expected(layer, expert, tensor)``."""

    def __init__(self, index: str, tp_rank: int):
        fs, path = open_fs(index)
        try:
            with fs.open_input_file(path) as f:
                table = pq.read_table(f, columns=["checkpoint_id", "tp_rank", "layer", "expert", "tensor", "fp"])
        except FileNotFoundError:
            raise MoetraceError(f"index {index}: no such file") from None
        except Exception as err:
            raise MoetraceError(f"index {index}: not a readable moetrace index ({err})") from None
        ids = table.column("checkpoint_id").unique().to_pylist()
        self.checkpoint_id: str | None = ids[0] if len(ids) == 1 else None
        self.tp_ranks = sorted(set(table.column("tp_rank").to_pylist()))
        mine = table.filter(pc.equal(table.column("tp_rank"), tp_rank))
        self.path = index
        self.tp_rank = tp_rank
        self._fp: dict[tuple[int, int, str], bytes] = {
            (l, e, t): f
            for l, e, t, f in zip(
                mine.column("layer").to_pylist(),
                mine.column("expert").to_pylist(),
                mine.column("tensor").to_pylist(),
                mine.column("fp").to_pylist(),
            )
        }

    def __len__(self) -> int:
        return len(self._fp)

    def expected(self, layer: int, expert: int, tensor: str) -> bytes | None:
        return self._fp.get((layer, expert, tensor))

    def verdicts(self, layer: int, experts: Sequence[int], tensor: str, digests: Sequence[bytes]) -> list[str | None]:
        """'match' | 'mismatch' | None (not in the index) per row."""
        out: list[str | None] = []
        for e, d in zip(experts, digests):
            want = self._fp.get((layer, e, tensor))
            out.append(None if want is None else (MATCH if want == d else MISMATCH))
        return out
