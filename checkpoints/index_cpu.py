"""The index's rows on the CPU, without torch: every expected shard planned as byte ranges
of the files (checkpoints.shard_plan) and hashed where it lies (checkpoints.shard_hash).

A work unit is a block of experts of one (model, layer), every moe_tp_rank (about
``UNIT_BYTES`` of shards); each tensor of an expert is hashed for every rank at once, so
a column cut's rows are read once for all ranks (ChunkHasher.digests_of). The units run
in worker processes, one per core, forked from this one: the hashing holds the GIL
(xxhash releases it only above 64 KiB, a chunk is exactly 64 KiB), so threads would hash
one at a time (docs/fingerprint.md, "Threads"). A worker reads the files into a few
reused buffers (checkpoints.shard_hash) and closes them after each unit: its resident
set stays a few MiB whatever the checkpoint's size. Small builds (under
``PROCESS_BYTES``) run in this process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from moetrace import fingerprint as fpdef
from moetrace.checkpoints.reader import Checkpoint
from moetrace.checkpoints.shard_cuts import Parallel
from moetrace.checkpoints.shard_hash import ChunkHasher, FileBytes
from moetrace.checkpoints.shard_plan import plan_expert
from moetrace.errors import MoetraceError
from moetrace.schema import copy_position

UNIT_BYTES = 64 << 20  # shards per work unit, over every moe_tp_rank
PROCESS_BYTES = 256 << 20  # from this many bytes of shards on, worker processes


@dataclass(frozen=True)
class Unit:
    model: str
    layer: int
    experts: range


@dataclass
class _Job:
    """What the workers read: set before they are forked, so they inherit it."""

    models: dict[str, Checkpoint]
    par: Parallel


_JOB: _Job | None = None
_HASHER: ChunkHasher | None = None  # one per process: its gather buffer is reused


def plannable(ckpt: Checkpoint, par: Parallel, layers) -> bool:
    """Whether every layer's shards are plain bytes of the files (checkpoints.shard_plan)."""
    return all(plan_expert(ckpt, layer, 0, 0, par) is not None for layer in layers)


def units_of(model: str, ckpt: Checkpoint, par: Parallel, layer: int) -> tuple[list[Unit], int]:
    """The layer's experts (routed, then the fused shared ones) in blocks of about
    UNIT_BYTES over every moe_tp_rank, sized by expert 0's shards; and the layer's bytes."""
    n_experts = ckpt.spec.num_experts + ckpt.spec.shared_experts
    per_expert = sum(plan.nbytes for r in range(par.moe_tp_size)
                     for plan in plan_expert(ckpt, layer, 0, r, par).values()) or 1
    block = max(1, UNIT_BYTES // per_expert)
    return [Unit(model, layer, range(e, min(e + block, n_experts))) for e in range(0, n_experts, block)], \
        per_expert * n_experts


def unit_rows(unit: Unit) -> tuple[dict[str, list], dict[str, float], dict[str, int]]:
    """The index columns of one unit (every moe_tp_rank, expert and tensor), and where the
    time went (ChunkHasher.seconds, .nbytes)."""
    global _HASHER
    ckpt, par = _JOB.models[unit.model], _JOB.par
    files = FileBytes()
    hasher = _HASHER = _HASHER or ChunkHasher()
    before = dict(hasher.seconds), dict(hasher.nbytes)
    cols: dict[str, list] = {k: [] for k in ("moe_tp_rank", "expert", "tensor", "copy_position", "dtype", "shape",
                                            "nbytes", "digest", "chunk_digests")}
    try:
        for expert in unit.experts:  # every rank's cut of an expert at once: a column cut's rows are read once
            ranks = []
            for r in range(par.moe_tp_size):
                plans = plan_expert(ckpt, unit.layer, expert, r, par)
                if plans is None:
                    raise MoetraceError(f"layer {unit.layer} expert {expert}: its shards are not plain bytes of "
                                        f"{ckpt.path} (an expert unlike expert 0)")
                ranks.append(plans)
            chunks = {}
            for name in ranks[0]:
                if all(name in plans for plans in ranks):
                    for r, found in enumerate(hasher.digests_of([plans[name] for plans in ranks], files)):
                        chunks[r, name] = found
            for r, plans in enumerate(ranks):
                for name, plan in plans.items():
                    if (r, name) not in chunks:
                        chunks[r, name] = hasher.digests(plan, files)
                    cols["moe_tp_rank"].append(r)
                    cols["expert"].append(expert)
                    cols["tensor"].append(name)
                    cols["copy_position"].append(copy_position(name))
                    cols["dtype"].append(plan.dtype)
                    cols["shape"].append(list(plan.shape))
                    cols["nbytes"].append(plan.nbytes)
                    cols["digest"].append(fpdef.tensor_digest(chunks[r, name], plan.nbytes))
                    cols["chunk_digests"].append(chunks[r, name])
    finally:
        files.close()
    seconds = {k: v - before[0][k] for k, v in hasher.seconds.items()}
    return cols, seconds, {k: v - before[1][k] for k, v in hasher.nbytes.items()}


def _workers(total_bytes: int, n_units: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if total_bytes < PROCESS_BYTES or not hasattr(os, "fork"):
        return 1
    return max(1, min(cores, n_units))


def build_rows(models: dict[str, Checkpoint], par: Parallel, layer_units: list[tuple[str, int]],
               progress: Callable[[int], None] | None = None, meanwhile: Callable[[], None] | None = None
               ) -> tuple[list[dict[str, list]], dict]:
    """Rows of every (model, layer) in layer_units: a list of column dicts, one per unit
    (without the columns that are the same on every row), and where the time went.
    meanwhile: called once the workers have started (work of this process that they need
    not wait for), or first when there are none."""
    global _JOB
    units, total = [], 0
    for model, layer in layer_units:
        found, nbytes = units_of(model, models[model], par, layer)
        units += found
        total += nbytes
    workers = _workers(total, len(units))
    _JOB = _Job(models, par)
    seconds: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    parts = []
    try:
        for unit, (cols, s, n) in zip(units, _run(units, workers, meanwhile)):
            n_rows = len(cols["expert"])
            cols["model"], cols["layer"] = [unit.model] * n_rows, [unit.layer] * n_rows
            parts.append(cols)
            for k, v in s.items():
                seconds[k] = seconds.get(k, 0.0) + v
            for k, v in n.items():
                nbytes[k] = nbytes.get(k, 0) + v
            ckpt = models[unit.model]
            if progress and unit.experts.stop == ckpt.spec.num_experts + ckpt.spec.shared_experts:
                progress(par.moe_tp_size)  # a layer's last unit: its (model, layer, moe_tp_rank) units
    finally:
        _JOB = None
    return parts, {"workers": workers, "seconds": seconds, "bytes": nbytes}


def _run(units: list[Unit], workers: int, meanwhile: Callable[[], None] | None):
    """unit_rows of every unit, in order: here, or in `workers` forked processes."""
    if workers <= 1:
        if meanwhile:
            meanwhile()
        yield from map(unit_rows, units)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = pool.map(unit_rows, units)  # forks the workers and hands them every unit
            if meanwhile:
                try:
                    meanwhile()
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)  # the units not begun never are
                    raise
            yield from results
    except BrokenProcessPool:
        raise MoetraceError("an index worker process died (out of memory?); nothing was written") from None

