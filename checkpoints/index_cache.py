"""Proof that a cached index is the index of the checkpoint asking for it.

The cache key (checkpoints.index_build.cache_key) names the checkpoint's layout, its
files' sizes and mtimes and the options; it hashes no tensor data, so two checkpoints
with equal shapes and mtimes (a copy with ``cp -p``, a re-quantized export, files
restored from an archive) share a key. A hit is used only when

- every safetensors header (its raw bytes, ``__metadata__`` included) hashes to what
  the key recorded (``headers_digest``, part of the key), and
- a random sample of the cached rows is reproduced from the checkpoint: for
  ``SAMPLE_EXPERTS`` (model, layer, moe_tp_rank, expert) picks, every tensor's shard
  is planned again (checkpoints.shard_plan; cut by checkpoints.shards where a layout
  computes) and ``SAMPLE_CHUNKS`` random chunks of it are read, hashed and compared
  with the cached chunk digests (``verify_hit``; no torch on the planned path);

on any difference the entry is rebuilt. The cached file is read through the one
index reader, so its own consistency is checked too (checkpoints.index_checks).
A checkpoint whose every expert differs is caught by the first chunk; one edited
byte that kept sizes and mtimes is caught with the probability that a sampled chunk
holds it. docs/index.md says what a hit costs.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
from typing import TYPE_CHECKING

from moetrace import fingerprint as fpdef
from moetrace.checkpoints.index import read_index
from moetrace.checkpoints.reader import Checkpoint, draft_checkpoint, weight_files
from moetrace.checkpoints.shard_hash import FileBytes, shard_bytes
from moetrace.checkpoints.shard_plan import plan_expert
from moetrace.errors import MoetraceError

if TYPE_CHECKING:
    from moetrace.checkpoints.shard_cuts import Parallel

SAMPLE_EXPERTS = 8  # (model, layer, moe_tp_rank, expert) shards cut again per hit
SAMPLE_CHUNKS = 1  # chunks hashed per tensor of each: another checkpoint differs in every chunk
_COLUMNS = ["model", "moe_tp_rank", "layer", "expert", "tensor", "nbytes", "chunk_digests"]


def headers_digest(checkpoint: str | os.PathLike) -> str:
    """sha256 of the name and raw header bytes of every safetensors file a server loads
    (reader.weight_files: a hidden download temp file or an unlisted leftover is none), in
    name order."""
    h = hashlib.sha256()
    for f in weight_files(checkpoint):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                h.update(f"{f.name}\0{n}\0".encode())
                h.update(fh.read(min(n, 100 << 20)))  # safetensors caps headers at 100 MB
        except (OSError, struct.error) as err:
            raise MoetraceError(f"{f}: cannot read its safetensors header ({err})") from None
    return h.hexdigest()


def verify_hit(index_path: str | os.PathLike, ckpt: Checkpoint, par: Parallel, rng: random.Random | None = None
               ) -> str | None:
    """None when a random sample of the cached index's chunk digests is reproduced from
    `ckpt` (cut for `par`); else why not, in words."""
    from moetrace.checkpoints.index_checks import distinct_rows, rows_where

    rng = rng or random.Random(os.urandom(8))
    table = read_index(index_path, columns=_COLUMNS)
    if "chunk_digests" not in table.column_names:
        return "the cached index has no chunk digests"
    coded: dict = {}  # each key column coded once for the sample's lookups
    units = distinct_rows(index_path, table, ["model", "layer", "moe_tp_rank", "expert"], coded)
    if not units:
        return None
    draft, files = None, FileBytes()  # unmapped when it goes
    for u in rng.sample(units, min(SAMPLE_EXPERTS, len(units))):
        model, layer, rank, expert = u["model"], u["layer"], u["moe_tp_rank"], u["expert"]
        model_ckpt = ckpt
        if model != "target":
            draft = draft or draft_checkpoint(ckpt)[0]
            if draft is None:
                return "the cached index has draft rows, the checkpoint has no draft model"
            model_ckpt = draft
        rows = rows_where(index_path, table, coded, model=model, layer=layer, moe_tp_rank=rank,
                          expert=expert).to_pylist()
        shards = _shard_reader(model_ckpt, layer, rank, par, expert, files)
        where = f"{'' if model == 'target' else model + ' '}layer {layer} moe_tp_rank {rank} expert {expert}"
        if sorted(shards) != sorted(r["tensor"] for r in rows):
            cached = sorted(r["tensor"] for r in rows)
            return f"{where}: the checkpoint gives tensors {sorted(shards)}, the cache {cached}"
        for row in rows:
            size, read = shards[row["tensor"]]
            if size != row["nbytes"]:
                return f"{where} {row['tensor']}: {size} bytes in the checkpoint, {row['nbytes']} cached"
            n = fpdef.n_chunks_for(size)
            for c in rng.sample(range(n), min(SAMPLE_CHUNKS, n)):
                chunk = read(c * fpdef.CHUNK_BYTES, (c + 1) * fpdef.CHUNK_BYTES)
                if fpdef.chunk_digest(chunk) != row["chunk_digests"][16 * c:16 * (c + 1)]:
                    return f"{where} {row['tensor']} chunk {c}: the checkpoint's bytes are not the cached index's"
    return None


def _shard_reader(ckpt: Checkpoint, layer: int, rank: int, par: Parallel, expert: int, files: FileBytes) -> dict:
    """tensor -> (shard bytes, read(start, stop) of its bytes): planned where the shard is
    plain bytes of the files, else cut by checkpoints.shards (torch) as the index was."""
    plans = plan_expert(ckpt, layer, expert, rank, par)
    if plans is not None:
        return {name: (plan.nbytes, lambda a, b, plan=plan: shard_bytes(plan, files, a, b))
                for name, plan in plans.items()}
    from moetrace.checkpoints.shards import expected_experts

    out = {}
    for name, t in expected_experts(ckpt, layer, rank, par, range(expert, expert + 1)).items():
        data = fpdef.raw_bytes(t[0]).cpu().numpy()
        out[name] = (data.size, lambda a, b, data=data: data[a:b].tobytes())
    return out
