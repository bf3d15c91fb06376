"""Before a divergence is blamed on the server: is the index still the checkpoint's?

An index holds the digests of the checkpoint as it was when indexed, and a cached one is
reused on a key that hashes no tensor data (checkpoints.index_cache: file sizes and
mtimes, headers, a sample of the data). Expert shards edited in place with those kept
read as divergent rows of a clean server. So before a divergence is reported, the
expected shards of the divergent rows (their distinct (model, moe_tp_rank, layer, expert,
tensor), first divergence first, at most ``MAX_RECHECKED``) are cut again from the
checkpoint on disk and fingerprinted: one that differs from the index makes the index
stale, exit 2 naming the tensor, and the cache entry the index came from is dropped (the
next `moetrace index` or `--checkpoint` builds it again). An index whose checkpoint is not
readable here (another identity, gone) is not rechecked.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from moetrace import fingerprint as fpdef
from moetrace.analysis.coverage import Analysis
from moetrace.analysis.index_choice import readable_checkpoint
from moetrace.checkpoints.index import index_metadata, read_index
from moetrace.checkpoints.index_build import cache_dir
from moetrace.checkpoints.reader import draft_checkpoint, open_checkpoint
from moetrace.errors import MoetraceError

MAX_RECHECKED = 64  # distinct divergent tensors cut again from the checkpoint (a stale index differs in the first)


def _divergent_keys(a: Analysis) -> list[tuple[str, int, int, int, str]]:
    """(model, moe_tp_rank, layer, expert, tensor) of the divergent rows, first divergence first, distinct."""
    d, c = a.data, a.data.cols
    rows = a.order_rows(a.divergent_rows())
    seen: dict[tuple, None] = {}
    for i in rows:
        key = (d.models.names[int(c["model"][i])], int(c["shard"][i]), int(c["layer"][i]), int(c["expert"][i]),
               d.tensors.names[int(c["tensor"][i])])
        seen.setdefault(key)
        if len(seen) >= MAX_RECHECKED:
            break
    return list(seen)


def _indexed(path: str, keys) -> dict[tuple, bytes]:
    """The index's digest of each key."""
    layers = sorted({k[2] for k in keys})
    t = read_index(path, columns=["model", "moe_tp_rank", "layer", "expert", "tensor", "digest"])
    t = t.filter(pc.is_in(t.column("layer"), value_set=pc.cast(np.array(layers), t.column("layer").type)))
    names = ("model", "moe_tp_rank", "layer", "expert", "tensor")
    return dict(zip(zip(*(t.column(n).to_pylist() for n in names)), t.column("digest").to_pylist()))


def stale_tensor(a: Analysis, checkpoint: str) -> tuple[str, int] | None:
    """(the first divergent tensor whose shard the checkpoint now gives otherwise than the
    index says, how many of the rechecked differ), or None when every rechecked one agrees."""
    from moetrace.checkpoints.shards import Parallel, expected_experts  # torch: only when there is a divergence

    keys = _divergent_keys(a)
    idx = a.idx
    indexed = _indexed(a.index_path, keys)
    ckpt = open_checkpoint(checkpoint)
    par = Parallel(tp_size=idx.tp_size, ep_size=idx.ep_size, layout=idx.layout, moe_dp_size=idx.moe_dp_size)
    shards: dict[tuple, dict] = {}
    first, differ = None, 0
    for model, rank, layer, expert, tensor in keys:
        want = indexed.get((model, rank, layer, expert, tensor))
        if want is None:  # a row the index has no entry for: nothing of the index to recheck
            continue
        unit = (model, rank, layer, expert)
        if unit not in shards:
            source = ckpt if model == "target" else draft_checkpoint(ckpt)[0]
            try:
                shards[unit] = expected_experts(source, layer, rank, par, range(expert, expert + 1)) if source else {}
            except MoetraceError:  # cannot be cut again here: this one is not rechecked
                shards[unit] = {}
        got = shards[unit].get(tensor)
        if got is None:
            continue
        if fpdef.fingerprint_rows(got)[0].digest != want:
            differ += 1
            where = f"{'' if model == 'target' else model + ' '}layer {layer} expert {expert} {tensor}"
            first = first or f"{where} of moe_tp_rank {rank}"
    return (first, differ) if first else None


def _drop_cache_entry(index_path: str, checkpoint_id: str) -> str | None:
    """Remove the cache entry the index is or was copied from (when it still holds this
    checkpoint's index); returns its path, or None."""
    root = cache_dir()
    candidates = [Path(index_path)]
    with contextlib.suppress(MoetraceError, OSError):
        cached_as = index_metadata(index_path).get("cached_as")
        if isinstance(cached_as, str) and os.path.basename(cached_as) == cached_as:
            candidates.append(root / cached_as)
    for path in candidates:
        try:
            inside = path.resolve().parent == root.resolve()
            if inside and path.is_file() and index_metadata(str(path)).get("checkpoint_id") == checkpoint_id:
                path.unlink()
                return str(path)
        except (MoetraceError, OSError):
            continue
    return None


def check_fresh(a: Analysis, checkpoint: str | None, served: str | None = None) -> None:
    """Raise (exit 2) when the divergent rows' expected shards, cut again from the
    checkpoint (`checkpoint`, else the one the index records when readable here), are not
    the index's; nothing when there is no divergence or no readable checkpoint.

    served: the folder the server itself loaded (its manifests' checkpoint_path). Two
    checkpoints of one shape share a checkpoint id (the id hashes headers, not data), so
    when that folder is readable here and is not the one checked, its shards are cut too:
    an index whose bytes are not the served checkpoint's is the wrong reference (exit 2),
    never a divergence of the server."""
    if not len(a.divergent_rows()):
        return
    checkpoint = checkpoint or readable_checkpoint(a.idx)
    if served and os.path.isdir(served) and (checkpoint is None or
                                             os.path.realpath(served) != os.path.realpath(checkpoint)):
        other = None
        with contextlib.suppress(MoetraceError):  # a folder that cannot be cut here is not rechecked
            other = stale_tensor(a, served)
        if other is not None:
            raise MoetraceError(f"index {a.index_path} is not of the checkpoint the server loaded: the server "
                                    f"loaded {served}, whose shards differ from the index's (tensor {other[0]}; "
                                    f"{other[1]} of the divergent tensors rechecked differ); the same checkpoint id "
                                    "(it hashes headers, not data) does not make them the same weights: audit "
                                    f"against an index of {served} (`moetrace index {served}` or --checkpoint)")
    if checkpoint is None:
        return
    found = stale_tensor(a, checkpoint)
    if found is None:
        return
    where, differ = found
    dropped = _drop_cache_entry(a.index_path, a.idx.checkpoint_id)
    more = f"; {differ} of the divergent tensors rechecked differ" if differ > 1 else ""
    drop = f"; its cache entry {dropped} was dropped" if dropped else ""
    raise MoetraceError(f"the index is stale: {checkpoint} changed since it was indexed (tensor {where}: the "
                        f"checkpoint's bytes are no longer the index's{more}); index {a.index_path} was not used to "
                        f"judge the server{drop}: build it again (`moetrace index {checkpoint}` or --checkpoint)")
