"""The index's rows through the tensors checkpoints.shards cuts (torch): on a GPU (the
shard bytes go through a pinned host buffer to the device and the fused kernel), and on the
CPU where a layout computes (post-load transforms: checkpoints.shard_plan has no plan).
Blocks of experts of one (model, layer), every moe_tp_rank, on worker threads (one per
core): one reads while the other hashes, and a column cut (w2) reads its rows once for all
ranks (ColumnCuts). The path every index was built by before checkpoints.index_cpu, and
the one its rows are held to in tests."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from moetrace import fingerprint as fpdef
from moetrace.checkpoints.reader import Checkpoint, as_slice
from moetrace.checkpoints.safetensors_file import host_copy
from moetrace.checkpoints.shard_cuts import Parallel
from moetrace.schema import copy_position, dtype_name

if TYPE_CHECKING:
    import torch

    from moetrace.checkpoints.index_build import IndexStats


def _add_rows(cols: dict[str, list], name: str, stacked: torch.Tensor, prints, first: int) -> None:
    per_shape = list(stacked.shape[1:])
    for expert, f in enumerate(prints, start=first):  # expected_experts stacks the experts in id order
        cols["expert"].append(expert)
        cols["tensor"].append(name)
        cols["copy_position"].append(copy_position(name))
        cols["dtype"].append(dtype_name(stacked.dtype))
        cols["shape"].append(per_shape)
        cols["nbytes"].append(f.nbytes)
        cols["digest"].append(f.digest)
        cols["chunk_digests"].append(f.chunk_digests)


class ColumnCuts:
    """A Checkpoint whose column reads (a rank's columns of whole rows: w2 at moe_tp_size > 1)
    keep the rows they read until clear(), so the cuts of every moe_tp_rank from one block of
    experts read the file once; every other read goes straight to the checkpoint. Same bytes
    as Checkpoint.read. One per thread."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._rows: dict[tuple[str, str], torch.Tensor] = {}

    def __getattr__(self, name: str):
        return getattr(self.ckpt, name)

    def read(self, name: str, rows=None, cols=None, into: torch.Tensor | None = None) -> torch.Tensor:
        if cols is None:
            return self.ckpt.read(name, rows, into=into)
        key = (name, repr(rows))
        whole = self._rows.get(key)
        if whole is None:
            whole = self._rows[key] = self.ckpt.read(name, rows)
        t = self.ckpt.info(name)
        return host_copy(whole[..., as_slice(cols, t.shape[-1], name, t.file)], into)

    def clear(self) -> None:
        self._rows.clear()


_BLOCK_BYTES = 64 << 20  # expert bytes read and fingerprinted at a time: reused, never faulted in again
_BUFFERS = threading.local()  # per worker thread: the last block, refilled by the next one


def _fingerprint_rows(stacked: "torch.Tensor", device: str) -> list:
    """One Fingerprint per expert row. On a GPU the bytes go through a pinned host buffer
    (one per worker thread, reused) to the device and its kernel; the digests come back
    with finalize's copy, which also ends the transfer before the buffer is refilled."""
    rows = fpdef.row_bytes(stacked)
    if device == "cpu":
        return fpdef.finalize(fpdef.row_chunk_digests(rows), rows.shape[1])
    import torch

    pinned = getattr(_BUFFERS, "pinned", None)
    if pinned is None or pinned.numel() < rows.numel():
        pinned = _BUFFERS.pinned = torch.empty(max(rows.numel(), _BLOCK_BYTES), dtype=torch.uint8, pin_memory=True)
    staged = pinned[: rows.numel()].view(rows.shape)
    staged.copy_(rows)
    return fpdef.finalize(fpdef.row_chunk_digests(staged.to(device, non_blocking=True)), rows.shape[1])


def _block_rows(ckpt: Checkpoint, model: str, par: Parallel, layer: int, experts: range, device: str,
                stats: IndexStats) -> dict[str, list]:
    """The rows of one block of experts of one (model, layer), every moe_tp_rank: a work
    unit small enough that both cores stay busy on one layer (one reads while the other
    hashes), and a column cut (w2) reads its rows once for all ranks (ColumnCuts)."""
    from moetrace.checkpoints.shards import expected_experts

    reads = getattr(_BUFFERS, "reads", None)
    if reads is None or reads.ckpt is not ckpt:
        reads = _BUFFERS.reads = ColumnCuts(ckpt)
    last = getattr(_BUFFERS, "last", {})
    cols: dict[str, list] = {k: [] for k in ("expert", "tensor", "copy_position", "dtype", "shape", "nbytes", "digest",
                                             "chunk_digests", "moe_tp_rank")}
    try:
        for r in range(par.moe_tp_size):
            t0 = time.perf_counter()
            shards = expected_experts(reads, layer, r, par, experts, last.get((r, len(experts))))
            t1 = time.perf_counter()
            n0 = len(cols["expert"])
            for name, stacked in shards.items():
                _add_rows(cols, name, stacked, _fingerprint_rows(stacked, device), experts.start)
            cols["moe_tp_rank"] += [r] * (len(cols["expert"]) - n0)
            stats.seconds_read += t1 - t0
            stats.seconds_fingerprint += time.perf_counter() - t1
            last[(r, len(experts))] = shards  # refilled by the next block of this size: no new pages
    finally:
        reads.clear()
    _BUFFERS.last = {k: v for k, v in last.items() if k[1] == len(experts)}
    n = len(cols["expert"])
    cols["model"], cols["layer"] = [model] * n, [layer] * n
    return cols


def _blocks_of(ckpt: Checkpoint, par: Parallel, layer: int) -> list[range]:
    """The layer's experts (routed, then the fused shared ones) in blocks of about
    _BLOCK_BYTES of shards over all ranks, sized by rank 0's shard of expert 0."""
    from moetrace.checkpoints.shards import expected_experts

    n_experts = ckpt.spec.num_experts + ckpt.spec.shared_experts
    one = expected_experts(ckpt, layer, 0, par, range(0, 1))
    per_expert = par.moe_tp_size * sum(v[0].numel() * v.element_size() for v in one.values()) or 1
    block = max(1, _BLOCK_BYTES // per_expert)
    return [range(e, min(e + block, n_experts)) for e in range(0, n_experts, block)]


def tensor_rows(layer_units, par: Parallel, device: str, progress, stats: IndexStats) -> list[dict[str, list]]:
    """The rows through checkpoints.shards' tensors, blocks of experts on worker threads."""
    units = [(model, c, layer, block) for model, c, layer in layer_units for block in _blocks_of(c, par, layer)]
    workers = max(1, min(len(units), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    parts: list[dict[str, list]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-index") as pool:
        futures = [pool.submit(_block_rows, c, model, par, layer, block, device, stats)
                   for model, c, layer, block in units]
        for (model, c, layer, block), fut in zip(units, futures):
            parts.append(fut.result())
            if progress and block.stop == c.spec.num_experts + c.spec.shared_experts:
                progress(par.moe_tp_size)  # a layer's last block: its (model, layer, moe_tp_rank) units
    return parts
