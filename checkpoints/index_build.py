"""Building and caching the expected index from a checkpoint.

``build_index`` fingerprints every expected TP shard of every expert of every MoE layer,
per moe_tp_rank, for the target model and (when the checkpoint has one,
checkpoints.extra) the draft model: on the CPU as byte ranges of the files hashed where
they lie (checkpoints.index_cpu), where a layout computes or on a GPU through
checkpoints.shards' tensors (checkpoints.index_tensors); ``cached_index`` keeps one index
per checkpoint identity, file stats and options, so an unchanged checkpoint is
fingerprinted once. The file format and its one reader are in checkpoints.index.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from moetrace import __version__, outputs
from moetrace import fingerprint as fpdef
from moetrace.checkpoints import index_cache, index_cpu, index_tensors
from moetrace.checkpoints.index import (
    INDEX_FILE,
    INDEX_META_KEY,
    copy_index,
    index_metadata,
    index_with_metadata,
    write_index,
)
from moetrace.checkpoints.layout import CANONICAL, ServerLayout
from moetrace.checkpoints.reader import Checkpoint, draft_checkpoint, open_checkpoint, weight_files
from moetrace.checkpoints.shard_cuts import Parallel, validate_moe_tp
from moetrace.checkpoints.spec import MoESpec
from moetrace.errors import MoetraceError
from moetrace.schema import INDEX_SCHEMA_VERSION, format_ids

if TYPE_CHECKING:
    import pyarrow as pa


def _import_writer() -> None:
    """pyarrow and the index writer (a tenth of a second of imports): done while the hashing
    workers run (index_cpu.build_rows' `meanwhile`), not before they start."""
    import pyarrow.parquet  # noqa: F401

    from moetrace.checkpoints import arrow_columns, index_checks  # noqa: F401


@dataclass(frozen=True)
class IndexOptions:
    tp_size: int
    ep_size: int = 1
    layers: tuple[int, ...] | None = None  # None: every MoE layer of the config
    layout: ServerLayout = CANONICAL  # the server layout the rows reproduce (checkpoints.layout)
    moe_dp_size: int = 1
    fp_version: int = fpdef.FP_VERSION
    chunk_bytes: int = fpdef.CHUNK_BYTES
    schema_version: int = INDEX_SCHEMA_VERSION


@dataclass
class IndexStats:
    rows: int = 0
    bytes_fingerprinted: int = 0
    seconds_read: float = 0.0
    seconds_fingerprint: float = 0.0
    seconds_build: float = 0.0  # build_index, wall
    seconds_write: float = 0.0  # the Parquet file(s) written and copied, wall
    extra: dict = field(default_factory=dict)


# Device nodes without which torch sees no GPU (NVIDIA; ROCm's kfd; WSL's dxg): --device auto
# asks torch (seconds of import) only where one exists.
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def resolve_device(device: str) -> str:
    """--device auto: CUDA when torch sees a device, else the CPU; cuda without one: one line."""
    if device == "cpu" or (device == "auto" and not any(os.path.exists(p) for p in _GPU_NODES)):
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise MoetraceError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device


def build_index(
    checkpoint: str | os.PathLike,
    tp_size: int,
    ep_size: int = 1,
    layers: Iterable[int] | None = None,
    layout: ServerLayout = CANONICAL,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    stats: IndexStats | None = None,
    moe_dp_size: int = 1,
    cutter: str = "auto",
    opened: Checkpoint | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> pa.Table:
    """Fingerprint every expected shard; returns an INDEX_SCHEMA table.

    progress(n) is called with the number of (model, layer, moe_tp_rank) units finished.
    cutter: "auto" (on the CPU, shards planned as bytes of the files and hashed where they
    lie, checkpoints.index_cpu, wherever that is exact; else checkpoints.shards' tensors),
    "torch" (checkpoints.shards' tensors always: the path the plans are held to in tests).
    opened: the checkpoint as the caller opened it a moment ago (headers read once).
    meanwhile: the caller's checks that need no hashing done, run as soon as the hashing has
    started (an error stops it).
    """
    stats = stats if stats is not None else IndexStats()
    t0 = time.perf_counter()
    ckpt = opened or open_checkpoint(checkpoint)
    spec = ckpt.spec
    par = Parallel(tp_size=tp_size, ep_size=ep_size, layout=layout, moe_dp_size=moe_dp_size)
    validate_moe_tp(spec, par)
    wanted = _resolve_layers(spec, layers, checkpoint)
    device = resolve_device(device)
    draft, draft_why = draft_checkpoint(ckpt)
    models = [("target", ckpt, wanted)] + ([("draft", draft, list(draft.spec.moe_layers))] if draft else [])
    layer_units = [(model, c, layer) for model, c, ls in models for layer in ls]
    if cutter == "auto" and device == "cpu" and all(index_cpu.plannable(c, par, ls) for _, c, ls in models):
        parts, spent = index_cpu.build_rows({model: c for model, c, _ in models}, par,
                                            [(model, layer) for model, _, layer in layer_units], progress,
                                            meanwhile=lambda: (_import_writer(), meanwhile and meanwhile()))
        stats.seconds_fingerprint = sum(spent["seconds"].values())  # the reads are the hashing's page faults
        stats.extra.update(spent)
    else:
        if meanwhile:
            meanwhile()
        parts = index_tensors.tensor_rows(layer_units, par, device, progress, stats)
    table = _table(parts, ckpt, spec, draft, draft_why, par, wanted, layout, ep_size, moe_dp_size, stats, checkpoint)
    stats.seconds_build += time.perf_counter() - t0
    return table


def _table(parts, ckpt: Checkpoint, spec: MoESpec, draft, draft_why: str, par: Parallel, wanted: list[int],
           layout: ServerLayout, ep_size: int, moe_dp_size: int, stats: IndexStats, checkpoint) -> pa.Table:
    """The parts' rows as one INDEX_SCHEMA table in the index's order, with its metadata."""
    from moetrace.schema import INDEX_SCHEMA

    cols = {f.name: [] for f in INDEX_SCHEMA}
    for part in parts:
        for k, v in part.items():
            cols[k].extend(v)
    n = len(cols["layer"])
    for k in ("tp_size", "ep_size", "moe_dp_size", "moe_tp_size"):
        cols[k] = [getattr(par, k)] * n
    cols["schema_version"] = [INDEX_SCHEMA_VERSION] * n
    cols["checkpoint_id"] = [ckpt.identity] * n
    table = _sorted_table(cols)
    stats.bytes_fingerprinted = sum(cols["nbytes"])
    opts = IndexOptions(par.tp_size, ep_size, tuple(wanted), layout, moe_dp_size)
    meta = {"checkpoint_id": ckpt.identity, "checkpoint_path": str(Path(checkpoint).resolve()), "moetrace": __version__,
            "family": spec.family, "format": spec.fmt, "quant_method": spec.quant_method,
            "intermediate_size": spec.intermediate_size, "num_experts": spec.num_experts,
            "shared_experts": spec.shared_experts, "moe_tp_size": par.moe_tp_size,
            "draft": ({"format": draft.spec.fmt, "layers": list(draft.spec.moe_layers)} if draft
                      else {"excluded": draft_why}),
            **asdict(opts), "layout": layout.to_json(), "up_first": layout.up_first}
    stats.rows = n
    return table.replace_schema_metadata({INDEX_META_KEY: json.dumps(meta).encode()})


def _sorted_table(cols: dict[str, list]) -> pa.Table:
    """An INDEX_SCHEMA table of the columns, rows in the index's order (model descending:
    target first; then moe_tp_rank, layer, expert, copy_position), built from buffers:
    no pandas, no pyarrow.compute (arrow_columns)."""
    import pyarrow as pa

    from moetrace.checkpoints import arrow_columns
    from moetrace.schema import INDEX_SCHEMA

    models = sorted(set(cols["model"]), reverse=True)
    model_rank = np.array([models.index(m) for m in cols["model"]], dtype=np.int64)
    order = np.lexsort([np.asarray(cols[k], dtype=np.int64) for k in ("copy_position", "expert", "layer",
                                                                       "moe_tp_rank")] + [model_rank])
    arrays = []
    for f in INDEX_SCHEMA:
        col = cols[f.name]
        if pa.types.is_integer(f.type):
            arrays.append(arrow_columns.numbers(np.asarray(col)[order], f.type))
            continue
        items = [col[i] for i in order]
        if pa.types.is_string(f.type):
            arrays.append(arrow_columns.strings(items))
        elif pa.types.is_list(f.type):
            arrays.append(arrow_columns.int_lists(items, f.type))
        else:
            arrays.append(arrow_columns.binaries(items, f.type))
    return pa.Table.from_arrays(arrays, schema=INDEX_SCHEMA)


def _resolve_layers(spec: MoESpec, layers: Iterable[int] | None, checkpoint) -> list[int]:
    if layers is None:
        return list(spec.moe_layers)
    bad = sorted(set(layers) - set(spec.moe_layers))
    if bad:
        raise MoetraceError(
            f"--layers {format_ids(bad)}: not MoE layers of {checkpoint} "
            f"(its config makes layers {format_ids(spec.moe_layers)} MoE)"
        )
    return sorted(set(layers))


# ------------------------------------------------------------------ caching


def cache_dir() -> Path:
    return Path(os.environ.get("MOETRACE_CACHE", Path.home() / ".cache" / "moetrace")) / "index"


def _writable_cache() -> Path:
    """The cache folder, checked writable before any fingerprinting (one line naming it)."""
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        # analyze/audit have no --no-cache: the way round the cache is an index built without it
        raise MoetraceError(f"MOETRACE_CACHE {path}: cannot write the index cache there ({err.strerror or err}); "
                            "set MOETRACE_CACHE to a writable folder, or build the index without it: moetrace index "
                            "CKPT --tp N --no-cache -o FILE (analyze and audit then take --index FILE)") from None
    return path


def cache_key(checkpoint: str | os.PathLike, opts: IndexOptions, identity: str | None = None) -> str:
    """Checkpoint identity (names, dtypes, shapes, offsets) + each file's size and
    mtime (content edits) + every option that changes the rows."""
    if identity is None:
        identity = open_checkpoint(checkpoint).identity
    h = hashlib.sha256(identity.encode())
    root = Path(checkpoint)
    for f in weight_files(root) + [root / "config.json"]:  # what a server loads: never a leftover or hidden file
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(asdict(opts), sort_keys=True).encode())
    h.update(index_cache.headers_digest(checkpoint).encode())  # a hit is then proved on data: verify_hit
    return h.hexdigest()[:24]


def cached_index(
    checkpoint: str | os.PathLike,
    tp_size: int,
    ep_size: int = 1,
    layers: Iterable[int] | None = None,
    layout: ServerLayout = CANONICAL,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    stats: IndexStats | None = None,
    moe_dp_size: int = 1,
    opened: Checkpoint | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[Path, bool]:
    """Path of an index for these options, built only when the cache lacks it.
    Returns (path, reused)."""
    path, built = _cached_or_built(checkpoint, tp_size, ep_size, layers, layout, device, progress, stats, moe_dp_size,
                                   opened, meanwhile)
    return path, built is None


def _cached_or_built(checkpoint, tp_size, ep_size, layers, layout, device, progress, stats, moe_dp_size, opened,
                     meanwhile) -> tuple[Path, pa.Table | None]:
    """cached_index's work: (the cache entry's path, None) on a hit; else the index is built
    and written there: (its path, the table built), which `make_index` writes to -o as it is
    rather than reading the entry back."""
    ckpt = opened or open_checkpoint(checkpoint)  # headers only; opened once for the key, layers and build
    resolved = tuple(_resolve_layers(ckpt.spec, layers, checkpoint))
    opts = IndexOptions(tp_size, ep_size, resolved, layout, moe_dp_size)
    path = cache_dir() / f"{cache_key(checkpoint, opts, ckpt.identity)}.parquet"
    if not path.exists():
        _writable_cache()
    if path.exists():
        par = Parallel(tp_size=tp_size, ep_size=ep_size, layout=layout, moe_dp_size=moe_dp_size)
        try:  # the key hashes no tensor data: a hit must reproduce a sample of it (checkpoints.index_cache)
            differs = index_cache.verify_hit(path, ckpt, par)
        except MoetraceError as err:
            differs = str(err)
        if differs is None:
            return path, None
        _writable_cache()  # the stale entry is replaced: a read-only cache is one line, never a raw OSError
        path.unlink(missing_ok=True)
    stats = stats if stats is not None else IndexStats()
    table = build_index(checkpoint, tp_size, ep_size, resolved, layout, device, progress, stats, moe_dp_size,
                        opened=ckpt, meanwhile=meanwhile)
    t0 = time.perf_counter()
    write_index(table, path, "MOETRACE_CACHE")
    stats.seconds_write += time.perf_counter() - t0
    return path, table


def make_index(checkpoint: str | os.PathLike, output: str | os.PathLike, tp_size: int, ep_size: int = 1,
               layers: Iterable[int] | None = None, layout: ServerLayout = CANONICAL, device: str = "cpu",
               use_cache: bool = True, progress: Callable[[int], None] | None = None, moe_dp_size: int = 1,
               opened: Checkpoint | None = None) -> dict:
    """`moetrace index`: the index at `output` (from the cache unless use_cache is False);
    returns the summary the command prints. opened: as build_index's."""
    t0 = time.perf_counter()
    stats = IndexStats()
    outputs.probe_output(os.fspath(output), "-o")  # before minutes of fingerprinting

    def replaceable() -> None:  # -o replaces only an index: never a checkpoint's weight map or shard
        outputs.check_output(os.fspath(output), "-o", ours=INDEX_FILE)

    if use_cache:
        cached, built = _cached_or_built(checkpoint, tp_size, ep_size, layers, layout, device, progress, stats,
                                         moe_dp_size, opened, replaceable)
        reused = built is None
        # the copy names the folder asked for now (the cached file names the one that filled the cache) and the
        # cache entry it came from, which a stale verdict drops (analysis.staleness)
        meta = {"checkpoint_path": str(Path(checkpoint).resolve()), "cached_as": cached.name}
        t1 = time.perf_counter()
        path = (copy_index(cached, output, meta=meta) if reused
                else write_index(index_with_metadata(built, meta), output))
    else:
        table, reused = build_index(checkpoint, tp_size, ep_size, layers, layout, device, progress, stats,
                                    moe_dp_size, opened=opened, meanwhile=replaceable), False
        t1 = time.perf_counter()
        path = write_index(table, output)
    stats.seconds_write += time.perf_counter() - t1
    import pyarrow.parquet

    meta = index_metadata(path)
    spent = stats.extra.get("seconds", {})
    return {
        "index": str(path),
        "checkpoint_id": meta["checkpoint_id"],
        "rows": pyarrow.parquet.ParquetFile(path).metadata.num_rows,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "moe_dp_size": moe_dp_size,
        "layers": meta["layers"],
        "draft": meta["draft"],
        "layout": meta["layout"],
        "reused_cache": reused,
        "seconds": round(time.perf_counter() - t0, 3),
        "bytes_fingerprinted": stats.bytes_fingerprinted,
        "timings": {"build_s": round(stats.seconds_build, 3), "write_s": round(stats.seconds_write, 3),
                    "workers": stats.extra.get("workers"),
                    **{f"{k}_s": round(v, 3) for k, v in spent.items()}},
    }
