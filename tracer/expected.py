"""One rank's expected digests on its device, and the on-device comparison the guard runs.

Read once through the one index reader (the rows of this rank's moe_tp_rank: with EPLB
any slot may hold any logical expert), each (model, layer, tensor) becomes a table on
the rank's device of the index's chunk digests, uint8 [experts, chunks, 16]. A captured
tensor's chunk digests are computed where it is (``fingerprint.row_chunk_digests``) and
compared with its table there: equal chunk digests and byte length are exactly equal
tensor digests (a tensor digest is a hash of them). The result is one flag per captured
expert, still on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moetrace.checkpoints.index import index_metadata, read_index
from moetrace.errors import MoetraceError
from moetrace.fingerprint import DIGEST_BYTES, n_chunks_for

MATCH, MISMATCH, UNVERIFIED = 0, 1, 2  # flag codes, one per captured expert
VERDICTS = ("match", "mismatch", "unverified")  # the same, as words (metrics, manifest)
_COLUMNS = ["checkpoint_id", "model", "layer", "expert", "tensor", "nbytes", "digest", "chunk_digests"]


@dataclass
class Table:
    """The expected chunk digests of one (model, layer, tensor), on one device."""

    chunks: torch.Tensor  # uint8 [rows, chunks, 16]
    nbytes: int
    row_of: dict[int, int]  # expert id -> row
    digest_of: dict[int, bytes]  # expert id -> 16-byte digest (host, for dumps)
    _lookups: dict[tuple[int, ...], tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)

    def lookup(self, experts: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(row index on the device, or None when the experts are exactly the table's rows in
        order; known mask or None when all known). A rank's slots are often a prefix of
        the table's experts (EP rank 0, a sampling filter): that needs the index."""
        found = self._lookups.get(experts)
        if found is None:
            rows = [self.row_of.get(e, -1) for e in experts]
            known = [r >= 0 for r in rows]
            dev = self.chunks.device
            in_order = rows == list(range(self.chunks.shape[0]))
            index = None if in_order else torch.tensor([max(r, 0) for r in rows]).to(dev)
            mask = None if all(known) else torch.tensor(known).to(dev)
            if len(self._lookups) < 64:  # captures name a handful of expert lists per layer
                self._lookups[experts] = (index, mask)
            found = (index, mask)
        return found


@dataclass
class ExpectedDigests:
    """This rank's expected digests per (model, layer, tensor), on one device."""

    path: str
    tp_rank: int
    moe_tp_rank: int  # the shard of the experts the rows are (shards.rank_coords)
    device: torch.device
    checkpoint_id: str | None
    checkpoint_path: str | None
    tables: dict[tuple[str, int, str], Table]
    meta: dict = field(default_factory=dict)  # the index metadata (tracer.index_fit compares it with the server)

    @property
    def tensors(self) -> int:
        return sum(len(t.row_of) for t in self.tables.values())

    def expected_in(self, layers, experts, tensors, held: dict[int, int] | None = None) -> int:
        """Expected tensors of one pass of the target model inside the sampling filters
        (None: all). held: the slots a captured layer holds (an EP rank holds some of the
        logical experts the index lists), which bound that layer's count."""
        n = 0
        for (model, layer, name), t in self.tables.items():
            if model == "target" and (layers is None or layer in layers) and (tensors is None or name in tensors):
                rows = len(t.row_of) if experts is None else sum(1 for e in t.row_of if e in experts)
                n += min(rows, held[layer]) if held and layer in held else rows
        return n

    def on(self, device: torch.device) -> "ExpectedDigests":
        """The same tables on another device (a capture on an unexpected device; once)."""
        if device == self.device:
            return self
        tables = {k: Table(t.chunks.to(device), t.nbytes, t.row_of, t.digest_of)
                  for k, t in self.tables.items()}
        return ExpectedDigests(self.path, self.tp_rank, self.moe_tp_rank, device, self.checkpoint_id,
                           self.checkpoint_path, tables, self.meta)

    def compare(self, where: tuple[str, int], tensor: str, experts: tuple[int, ...], chunks: torch.Tensor,
                nbytes: int) -> torch.Tensor | None:
        """uint8 [R] flags on the chunk digests' device (no sync); None: nothing expected for
        ((model, layer), tensor) here, every row unverified."""
        table = self.tables.get((*where, tensor))
        if table is None:
            return None
        index, known = table.lookup(experts)
        r = chunks.shape[0]
        if nbytes != table.nbytes or chunks.shape[1] != table.chunks.shape[1]:
            flags = torch.full((r,), MISMATCH, dtype=torch.uint8, device=chunks.device)
        else:
            want = table.chunks if index is None else table.chunks.index_select(0, index)
            equal = (chunks == want).flatten(1).all(dim=1)
            flags = (~equal).to(torch.uint8)  # MATCH 0, MISMATCH 1
        if known is not None:
            flags = torch.where(known, flags, torch.full_like(flags, UNVERIFIED))
        return flags


def guard_device() -> torch.device:
    """The rank's device at hook set-up: its current CUDA device when the server has
    initialized CUDA (never initialized here), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_expected(path: str, tp_rank: int, device: torch.device) -> ExpectedDigests:
    """The rows of this rank's moe_tp_rank (tp_rank % the index's moe_tp_size, as SGLang
    places TP ranks) as device tables. MoetraceError (one line) when the index is
    unreadable, lacks chunk digests, or holds nothing for this rank."""
    meta = index_metadata(path)
    moe_tp_size = int(meta.get("moe_tp_size") or max(1, int(meta.get("tp_size") or 1) // int(meta.get("ep_size") or 1)))
    moe_tp_rank = int(tp_rank) % moe_tp_size
    table = read_index(path, columns=_COLUMNS, moe_tp_rank=moe_tp_rank)
    if "chunk_digests" not in table.column_names:
        raise MoetraceError(f"index {path}: has no chunk_digests column, which the guard compares on the device; "
                            "rebuild it with `moetrace index`")
    if table.num_rows == 0:
        raise MoetraceError(f"index {path}: has no rows for tp_rank {tp_rank} (moe_tp_rank {moe_tp_rank})")
    ids = table.column("checkpoint_id").unique().to_pylist()
    groups: dict[tuple[str, int, str], list[tuple[int, int, bytes, bytes]]] = {}
    for model, layer, expert, name, nbytes, digest, chunks in zip(*(table.column(c).to_pylist() for c in _COLUMNS[1:])):
        if chunks is None or len(chunks) != DIGEST_BYTES * n_chunks_for(nbytes):
            raise MoetraceError(f"index {path}: {'' if model == 'target' else model + ' '}layer {layer} expert "
                                f"{expert} {name} has no chunk digests of its {nbytes} bytes; rebuild it with "
                                "`moetrace index`")
        groups.setdefault((model, int(layer), name), []).append((int(expert), int(nbytes), digest, chunks))
    tables = {}
    for key, rows in groups.items():
        rows.sort()
        sizes = {n for _, n, _, _ in rows}
        if len(sizes) != 1:
            raise MoetraceError(f"index {path}: {key[0]} layer {key[1]} {key[2]} has experts of different byte "
                                f"lengths {sorted(sizes)}")
        nbytes = sizes.pop()
        chunks = np.frombuffer(b"".join(c for _, _, _, c in rows), dtype=np.uint8).reshape(len(rows), -1, DIGEST_BYTES)
        tables[key] = Table(torch.from_numpy(chunks.copy()).to(device), nbytes,
                            {e: i for i, (e, _, _, _) in enumerate(rows)}, {e: d for e, _, d, _ in rows})
    return ExpectedDigests(str(path), int(tp_rank), moe_tp_rank, device, ids[0] if len(ids) == 1 else None,
                       meta.get("checkpoint_path"), tables, meta)
