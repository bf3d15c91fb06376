"""Online verification: compare captured digests with the index in-process.

The index (local path or URL) is read once through the one index reader; the
expected digests of a shard (one moe_tp_rank) become a dict (model, layer, expert,
tensor) -> 16-byte digest the first time a capture of that shard asks.

Each captured layer is first held to the index's layout (tracer.index_fit, from the
layout facts the hook recorded for it): a layer the index fits is verified as it is; a
layer whose w13 holds the other gate/up order is verified against that order, derived
from the index's chunk digests where each half is whole chunks (the tensor digest of
the swapped chunk digests: exact), its w13 tensors left unchecked where not; any other
layout leaves the whole layer unchecked. Never a mismatch for the index's own layout.
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

import pyarrow.compute as pc

from moetrace import fingerprint as fpdef
from moetrace.checkpoints.index import INDEX_META_KEY, read_index
from moetrace.tracer.index_fit import LayoutFit, layout_fit

MATCH = "match"
MISMATCH = "mismatch"
_COLUMNS = ["checkpoint_id", "model", "moe_tp_rank", "layer", "expert", "tensor", "digest"]
_KEY = ("model", "layer", "expert", "tensor")
FITS = LayoutFit()


def swapped_halves_digest(chunk_digests: bytes | None, nbytes: int) -> bytes | None:
    """The digest of a tensor whose two halves are swapped, from the chunk digests of the
    tensor as it is; None unless each half is whole chunks (then it is exact)."""
    if chunk_digests is None or nbytes % (2 * fpdef.CHUNK_BYTES):
        return None
    half = fpdef.DIGEST_BYTES * fpdef.n_chunks_for(nbytes) // 2
    return fpdef.tensor_digest(chunk_digests[half:] + chunk_digests[:half], nbytes)


class OnlineIndex:
    """Expected digests: ``expected(model, moe_tp_rank, layer, expert, tensor)``."""

    def __init__(self, index: str):
        self._table = read_index(index, columns=_COLUMNS)
        ids = self._table.column("checkpoint_id").unique().to_pylist()
        self.checkpoint_id: str | None = ids[0] if len(ids) == 1 else None
        raw = (self._table.schema.metadata or {}).get(INDEX_META_KEY)
        self.meta: dict = json.loads(raw) if raw else {}
        self.path = index
        self._shards: dict[int, dict[tuple[str, int, int, str], bytes]] = {}
        self._swapped: dict[int, dict[tuple[str, int, int, str], bytes | None]] = {}
        self._fits: dict[tuple[str, str, int], LayoutFit] = {}  # (source, model, layer) -> how it is verified
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._table.num_rows

    # ------------------------------------------------------------ the layout of a layer

    def fit_layer(self, source: str, model: str, layer: int, facts: dict | None) -> LayoutFit | None:
        """Hold a layer's layout facts to the index once (its first capture); returns the
        fit when it is new and not the plain one (for the caller to say so), else None."""
        key = (source, model, int(layer))
        if key in self._fits:
            return None
        fit = self._fits[key] = layout_fit(self.meta, facts, source)
        return None if fit == FITS else fit

    def _fit(self, source: str | None, model: str, layer: int) -> LayoutFit:
        return self._fits.get((source, model, int(layer)), FITS) if source is not None else FITS

    # ------------------------------------------------------------ expected digests

    def _shard(self, moe_tp_rank: int) -> dict[tuple[str, int, int, str], bytes]:
        found = self._shards.get(moe_tp_rank)
        if found is None:
            with self._lock:
                t = self._table.filter(pc.equal(self._table.column("moe_tp_rank"), moe_tp_rank))
                found = self._shards[moe_tp_rank] = dict(zip(zip(*(t.column(c).to_pylist() for c in _KEY)),
                                                             t.column("digest").to_pylist()))
        return found

    def _swapped_shard(self, moe_tp_rank: int) -> dict[tuple[str, int, int, str], bytes | None]:
        """The w13 digests of the other half order (None where not derivable), read once per shard."""
        found = self._swapped.get(moe_tp_rank)
        if found is None:
            with self._lock:
                t = read_index(self.path, columns=[*_KEY, "nbytes", "chunk_digests"], moe_tp_rank=moe_tp_rank)
                t = t.filter(pc.starts_with(t.column("tensor"), "w13"))
                chunks = (t.column("chunk_digests").to_pylist() if "chunk_digests" in t.column_names
                          else [None] * t.num_rows)
                found = self._swapped[moe_tp_rank] = {
                    key: swapped_halves_digest(c, n)
                    for key, c, n in zip(zip(*(t.column(c).to_pylist() for c in _KEY)), chunks,
                                         t.column("nbytes").to_pylist())}
        return found

    def _digests_of(self, source: str | None, model: str, moe_tp_rank: int, layer: int, tensor: str) -> dict | None:
        """(model, layer, expert, tensor) -> the digest a captured tensor must have in the layout
        the server holds; None when nothing of this layer's `tensor` can be verified."""
        fit = self._fit(source, model, layer)
        if fit.why is None:
            return self._shard(moe_tp_rank)
        if not fit.swap_w13:
            return None
        return self._swapped_shard(moe_tp_rank) if tensor.startswith("w13") else self._shard(moe_tp_rank)

    def expected(self, model: str, moe_tp_rank: int, layer: int, expert: int, tensor: str,
                 source: str | None = None) -> bytes | None:
        """The digest the captured tensor must have; None when the index cannot say."""
        digests = self._digests_of(source, model, moe_tp_rank, layer, tensor)
        return None if digests is None else digests.get((model, layer, expert, tensor))

    def verdicts(self, model: str, moe_tp_rank: int, layer: int, experts: Sequence[int], tensor: str,
                 digests: Sequence[bytes], source: str | None = None) -> list[str | None]:
        """'match' | 'mismatch' | None (not in the index, or not verifiable) per row."""
        want_of = self._digests_of(source, model, moe_tp_rank, layer, tensor)
        if want_of is None:
            return [None] * len(digests)
        out: list[str | None] = []
        for e, d in zip(experts, digests):
            want = want_of.get((model, layer, e, tensor))
            out.append(None if want is None else (MATCH if want == d else MISMATCH))
        return out

    def batch_verdicts(self, b, digests: Sequence[bytes]) -> list[str | None]:
        """verdicts() of a tracer.batch.CaptureBatch."""
        return self.verdicts(b.model, b.ranks.moe_tp_rank, b.layer, b.experts, b.tensor, digests, b.source)
