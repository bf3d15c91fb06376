"""The expected-fingerprint index: what every rank must hold, per the checkpoint.

One row per (tp_rank, layer, expert, tensor) with the fingerprint of the exact
shard SGLang's FusedMoE holds on that rank (checkpoints.shards). Written
atomically to Parquet (INDEX_SCHEMA); cached by checkpoint identity + file
stats + options so an unchanged checkpoint is fingerprinted once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moetrace import __version__
from moetrace.errors import MoetraceError
from moetrace.tracer import fingerprint as fp
from moetrace.tracer.schema import INDEX_SCHEMA, INDEX_SCHEMA_VERSION, copy_order

INDEX_META_KEY = b"moetrace.index"


@dataclass(frozen=True)
class IndexOptions:
    tp_size: int
    ep_size: int = 1
    layers: tuple[int, ...] | None = None  # None: every MoE layer of the config
    up_first: bool = False
    fp_version: int = fp.FP_VERSION
    chunk_bytes: int = fp.CHUNK_BYTES
    schema_version: int = INDEX_SCHEMA_VERSION


@dataclass
class IndexStats:
    rows: int = 0
    bytes_fingerprinted: int = 0
    seconds_read: float = 0.0
    seconds_fingerprint: float = 0.0
    extra: dict = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_rows(ckpt, spec, par, layer: int, tp_rank: int, device: str, stats: IndexStats) -> dict[str, list]:
    import time

    from moetrace.checkpoints.shards import expected_layer, local_experts, rank_coords

    moe_tp_rank, ep_rank = rank_coords(tp_rank, par)
    experts = list(local_experts(spec, par, ep_rank))
    t0 = time.perf_counter()
    shards = expected_layer(ckpt, layer, tp_rank, par)
    t1 = time.perf_counter()
    cols: dict[str, list] = {f.name: [] for f in INDEX_SCHEMA}
    for name, stacked in shards.items():
        prints = fp.fingerprint_rows(stacked.to(device), threads=False)
        per_shape = list(stacked.shape[1:])
        for local, (expert, print_) in enumerate(zip(experts, prints)):
            cols["expert"].append(expert)
            cols["local_expert"].append(local)
            cols["tensor"].append(name)
            cols["copy_order"].append(copy_order(name))
            cols["dtype"].append(dtype_name(stacked.dtype))
            cols["shape"].append(per_shape)
            cols["nbytes"].append(print_.nbytes)
            cols["fp"].append(print_.digest)
            cols["chunk_fps"].append(print_.chunk_digests)
            stats.bytes_fingerprinted += print_.nbytes
    n = len(cols["expert"])
    cols["layer"] = [layer] * n
    cols["tp_size"], cols["tp_rank"] = [par.tp_size] * n, [tp_rank] * n
    cols["ep_size"], cols["ep_rank"] = [par.ep_size] * n, [ep_rank] * n
    cols["moe_tp_size"], cols["moe_tp_rank"] = [par.moe_tp_size] * n, [moe_tp_rank] * n
    stats.seconds_read += t1 - t0
    stats.seconds_fingerprint += time.perf_counter() - t1
    return cols


def build_index(
    checkpoint: str | os.PathLike,
    tp_size: int,
    ep_size: int = 1,
    layers: Sequence[int] | None = None,
    up_first: bool = False,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    stats: IndexStats | None = None,
) -> pa.Table:
    """Fingerprint every expected shard; returns an INDEX_SCHEMA table.

    progress(n) is called with the number of (rank, layer) units finished.
    """
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, validate_parallel

    stats = stats if stats is not None else IndexStats()
    ckpt = open_checkpoint(checkpoint)
    spec = ckpt.spec
    par = Parallel(tp_size=tp_size, ep_size=ep_size, up_first=up_first)
    validate_parallel(spec, par)
    wanted = _resolve_layers(spec, layers, checkpoint)
    if device != "cpu" and not torch.cuda.is_available():
        raise MoetraceError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    units = [(layer, rank) for layer in wanted for rank in range(tp_size)]
    workers = max(1, min(len(units), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    parts: list[dict[str, list]] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-index") as pool:
        futures = [pool.submit(_layer_rows, ckpt, spec, par, layer, rank, device, stats) for layer, rank in units]
        for fut in futures:
            parts.append(fut.result())
            if progress:
                progress(1)
    cols = {f.name: [] for f in INDEX_SCHEMA}
    for part in parts:
        for k, v in part.items():
            cols[k].extend(v)
    n = len(cols["layer"])
    cols["schema_version"] = [INDEX_SCHEMA_VERSION] * n
    cols["checkpoint_id"] = [ckpt.identity] * n
    table = pa.table({f.name: pa.array(cols[f.name], type=f.type) for f in INDEX_SCHEMA}, schema=INDEX_SCHEMA)
    table = table.sort_by([("tp_rank", "ascending"), ("layer", "ascending"), ("expert", "ascending"), ("copy_order", "ascending")])
    opts = IndexOptions(tp_size, ep_size, tuple(wanted), up_first)
    meta = {"checkpoint_id": ckpt.identity, "checkpoint_path": str(Path(checkpoint).resolve()), "moetrace": __version__,
            "family": spec.family, "format": spec.fmt, "num_experts": spec.num_experts, **asdict(opts)}
    stats.rows = n
    return table.replace_schema_metadata({INDEX_META_KEY: json.dumps(meta).encode()})


def _resolve_layers(spec, layers: Sequence[int] | None, checkpoint) -> list[int]:
    if layers is None:
        return list(spec.moe_layers)
    bad = [l for l in layers if l not in spec.moe_layers]
    if bad:
        raise MoetraceError(
            f"--layers {','.join(map(str, bad))}: not MoE layers of {checkpoint} "
            f"(its config makes layers {_ranges(spec.moe_layers)} MoE)"
        )
    return sorted(set(layers))


def _ranges(values: Sequence[int]) -> str:
    values = sorted(values)
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(out) or "none"


def parse_layers(text: str | None) -> list[int] | None:
    """'0,2,5-7' -> [0, 2, 5, 6, 7]; None/'all' -> None."""
    if text is None or text.strip().lower() in ("", "all"):
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise MoetraceError(f"--layers {text!r}: expected a list like 0,2,5-7") from None
    return out


# ------------------------------------------------------------- write / read


def _temp_beside(path: Path) -> str:
    """A temp file next to `path` with the mode a plain open() would give it:
    mkstemp makes 0600, and a server running as another user must still be
    able to read the index for online verification."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)
    os.close(fd)
    return tmp


def write_index(table: pa.Table, path: str | os.PathLike) -> Path:
    """Atomic write: a temp file beside the target, renamed when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def index_metadata(path: str | os.PathLike) -> dict:
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as err:
        raise MoetraceError(f"{path}: not a readable moetrace index Parquet file ({_first_line(err)})") from None
    if INDEX_META_KEY not in meta:
        raise MoetraceError(f"{path}: Parquet file without moetrace index metadata (expected an index from `moetrace index`)")
    return json.loads(meta[INDEX_META_KEY])


def read_index(path: str | os.PathLike, columns: Sequence[str] | None = None) -> pa.Table:
    meta = index_metadata(path)
    if meta.get("schema_version") != INDEX_SCHEMA_VERSION:
        raise MoetraceError(
            f"{path}: index schema version {meta.get('schema_version')}, this moetrace reads {INDEX_SCHEMA_VERSION}; rebuild it with `moetrace index`"
        )
    if meta.get("fp_version") != fp.FP_VERSION:
        raise MoetraceError(f"{path}: fingerprint version {meta.get('fp_version')}, expected {fp.FP_VERSION}; rebuild the index")
    return pq.read_table(path, columns=list(columns) if columns else None)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# ------------------------------------------------------------------ caching


def cache_dir() -> Path:
    return Path(os.environ.get("MOETRACE_CACHE", Path.home() / ".cache" / "moetrace")) / "index"


def cache_key(checkpoint: str | os.PathLike, opts: IndexOptions, identity: str | None = None) -> str:
    """Checkpoint identity (names, dtypes, shapes, offsets) + each file's size and
    mtime (content edits) + every option that changes the rows."""
    if identity is None:
        from moetrace.checkpoints.reader import open_checkpoint

        identity = open_checkpoint(checkpoint).identity
    h = hashlib.sha256(identity.encode())
    root = Path(checkpoint)
    for f in sorted(root.glob("*.safetensors")) + [root / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(asdict(opts), sort_keys=True).encode())
    return h.hexdigest()[:24]


def cached_index(
    checkpoint: str | os.PathLike,
    tp_size: int,
    ep_size: int = 1,
    layers: Sequence[int] | None = None,
    up_first: bool = False,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    stats: IndexStats | None = None,
) -> tuple[Path, bool]:
    """Path of an index for these options, built only when the cache lacks it.
    Returns (path, reused)."""
    from moetrace.checkpoints.reader import open_checkpoint

    ckpt = open_checkpoint(checkpoint)  # headers only; opened once for the key and the layers
    resolved = tuple(_resolve_layers(ckpt.spec, layers, checkpoint))
    opts = IndexOptions(tp_size, ep_size, resolved, up_first)
    path = cache_dir() / f"{cache_key(checkpoint, opts, ckpt.identity)}.parquet"
    if path.exists():
        try:
            index_metadata(path)
            return path, True
        except MoetraceError:
            path.unlink(missing_ok=True)
    table = build_index(checkpoint, tp_size, ep_size, resolved, up_first, device, progress, stats)
    write_index(table, path)
    return path, False


def copy_index(src: Path, dst: str | os.PathLike) -> Path:
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(dst)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst
