"""Forensic dumps: a mismatching tensor's bytes as safetensors, capped by the sink.

``OUT/<run_id>/rank=<r>/_dumps/step<S>-L<L>-E<E>-<tensor>-<source>-seq<N>.safetensors``,
with the captured and expected digests in its metadata. The folder starts with ``_``, as
the manifests do, so that Parquet readers (pyarrow, pandas, DuckDB, Spark) skip it and
read a run folder as a plain dataset (docs/reference.md); the manifest lists each dump's
path, so a run written when the folder was ``dumps/`` reads the same.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import torch

from moetrace import storage
from moetrace.tracer.batch import CaptureBatch

DUMP_DIR = "_dumps"


def write_dump(fs: pafs.FileSystem, rank_dir: str, run_id: str, b: CaptureBatch, expert: int, tensor: torch.Tensor,
               want: bytes | None, got: bytes) -> tuple[str, int]:
    """Write one dump atomically; returns (path relative to the rank folder, bytes)."""
    from safetensors.torch import save  # only when something mismatched: the hook stays light

    model = "" if b.model == "target" else f"{b.model}-"
    name = f"{model}step{b.step}-L{b.layer}-E{expert}-{b.tensor}-{b.source}-seq{b.capture_seq}.safetensors"
    meta = {
        "run_id": run_id, "model": b.model, "tp_rank": str(b.ranks.tp_rank), "step": str(b.step), "layer": str(b.layer),
        "expert": str(expert), "tensor": b.tensor, "source": b.source, "capture_seq": str(b.capture_seq),
        "digest": got.hex(), "expected_digest": want.hex() if want else "",
    }
    data = save({b.tensor: tensor.contiguous()}, metadata=meta)
    if storage.is_link(fs, storage.join(rank_dir, DUMP_DIR)):
        raise OSError(f"{storage.join(rank_dir, DUMP_DIR)} is a symbolic link; dumps are never written through one")
    storage.make_dirs(fs, storage.join(rank_dir, DUMP_DIR))
    storage.write_atomic(fs, storage.join(rank_dir, DUMP_DIR, name), data)
    return f"{DUMP_DIR}/{name}", len(data)
