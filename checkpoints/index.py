"""The expected index file: what every rank must hold, per the checkpoint.

One row per (model, moe_tp_rank, layer, expert, tensor) with the digest of the exact
shard SGLang's FusedMoE holds for that expert on a rank of that moe_tp_rank
(schema.INDEX_SCHEMA): every expert (and fused shared expert) of every layer, since
with EPLB any rank may hold any expert in any slot. JSON metadata under
``INDEX_META_KEY``: checkpoint_id, tp_size, ep_size, moe_dp_size, layers, versions.
``read_index`` is the one reader: it checks the schema and fingerprint versions
and every row it returns (checkpoints.index_checks: a corrupt index is refused by
name, exit 2) for online verification, the guard and the analysis alike. Light to import (no safetensors):
the capture side reads indexes inside a server. Building: checkpoints.index_build.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from moetrace import outputs, storage
from moetrace.errors import MoetraceError
from moetrace.schema import INDEX_SCHEMA_VERSION

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

# pyarrow is imported where it is used: `moetrace index` forks its hashing workers first
# and imports it while they run (checkpoints.index_build).

INDEX_META_KEY = b"moetrace.index"
# an index at an output path is recognized by its metadata: -o replaces only an index
INDEX_FILE = outputs.parquet_metadata("a moetrace index", INDEX_META_KEY)


def write_index(table: pa.Table, path: str | os.PathLike, option: str = "-o") -> Path:
    """Atomic write (outputs.write_local): a temp file beside the target, renamed when
    complete; a FIFO, device, link or any file but an index at the path is refused, never replaced."""
    import pyarrow.parquet as pq

    outputs.write_local(os.fspath(path), option, lambda tmp: pq.write_table(table, tmp, compression="zstd"),
                        ours=INDEX_FILE, make_parents=True)
    return Path(path)


# Columns every reader needs; chunk_digests is optional (an index may be built without).
REQUIRED_COLUMNS = ("schema_version", "checkpoint_id", "model", "tp_size", "ep_size", "moe_dp_size", "moe_tp_size",
                    "moe_tp_rank", "layer", "expert", "tensor", "copy_position", "dtype", "nbytes", "digest")


def _open(path: str | os.PathLike) -> pq.ParquetFile:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, p = storage.open_fs(str(path), "index")
    try:
        return pq.ParquetFile(fs.open_input_file(p))
    except FileNotFoundError:
        raise MoetraceError(f"index {path}: no such file (build it with `moetrace index`)") from None
    except (OSError, pa.ArrowException) as err:
        raise MoetraceError(f"index {path}: not a readable moetrace index Parquet file ({_first_line(err)})") from None


def _checked_metadata(path, pf: pq.ParquetFile) -> dict:
    raw = (pf.schema_arrow.metadata or {}).get(INDEX_META_KEY)
    if raw is None:
        raise MoetraceError(f"index {path}: not a moetrace index (a Parquet file without its metadata; build one with "
                            f"`moetrace index`)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise MoetraceError(f"index {path}: garbled moetrace index metadata (rebuild it with `moetrace "
                            f"index`)") from None
    if not isinstance(meta, dict):
        raise MoetraceError(f"index {path}: its metadata is a JSON {type(meta).__name__}, not an object; "
                            "rebuild it with `moetrace index`")
    from moetrace import fingerprint as fpdef  # here, not at the top: reading an index needs no tensors

    if meta.get("fp_version") != fpdef.FP_VERSION:  # first: digests of two versions are never compared
        raise MoetraceError(f"index {path}: fingerprint version {meta.get('fp_version')}, this moetrace computes "
                            f"version {fpdef.FP_VERSION}; rebuild it with `moetrace index`")
    found = meta.get("schema_version")
    if found != INDEX_SCHEMA_VERSION:
        raise MoetraceError(f"index {path}: index schema version {found}, this moetrace reads version "
                            f"{INDEX_SCHEMA_VERSION}; rebuild it with `moetrace index`")
    missing = [c for c in REQUIRED_COLUMNS if c not in pf.schema_arrow.names]
    if missing:
        raise MoetraceError(f"index {path}: lacks column(s) {', '.join(missing)}; rebuild it with `moetrace index`")
    from moetrace.checkpoints import index_checks

    index_checks.check_metadata(path, meta)
    return meta


def index_metadata(path: str | os.PathLike) -> dict:
    """The index's metadata (checkpoint_id, tp_size, ep_size, layers, ...), versions checked."""
    return _checked_metadata(path, _open(path))


def read_index(path: str | os.PathLike, columns: Sequence[str] | None = None,
               moe_tp_rank: int | None = None) -> pa.Table:
    """The one index reader: versions and columns checked, optionally one shard's rows
    (those of one moe_tp_rank). The table's schema metadata keeps the index metadata
    (``INDEX_META_KEY``)."""
    import pyarrow as pa

    from moetrace.checkpoints import index_checks

    pf = _open(path)
    meta = _checked_metadata(path, pf)
    names = pf.schema_arrow.names
    # Every read is checked (index_checks): the columns the checks need are read too.
    wanted = list(columns) if columns is not None else list(names)
    cols = [c for c in dict.fromkeys(wanted + list(index_checks.CHECKED_COLUMNS)) if c in names]
    try:
        table = pf.read(columns=cols)
    except (OSError, pa.ArrowException) as err:
        raise MoetraceError(f"index {path}: unreadable ({_first_line(err)})") from None
    if moe_tp_rank is not None:
        table = index_checks.rows_where(path, table, moe_tp_rank=moe_tp_rank)
    index_checks.check_rows(path, meta, table, moe_tp_rank)
    return table.select([c for c in wanted if c in table.column_names])


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def copy_index(src: Path, dst: str | os.PathLike, option: str = "-o", meta: dict | None = None) -> Path:
    """A copy of the index at `src`; `meta`: metadata keys the copy says otherwise (the
    checkpoint folder asked for now, where a cached index came from)."""
    if not meta:
        outputs.write_local(os.fspath(dst), option, lambda tmp: shutil.copyfile(src, tmp), ours=INDEX_FILE,
                            make_parents=True)
        return Path(dst)
    import pyarrow.parquet as pq

    table = pq.ParquetFile(src).read()  # not read_table: its dataset layer imports pandas
    return write_index(index_with_metadata(table, meta), dst, option)


def index_with_metadata(table: pa.Table, meta: dict) -> pa.Table:
    """The index table with `meta`'s keys merged over its metadata's."""
    merged = {**json.loads(table.schema.metadata[INDEX_META_KEY]), **meta}
    return table.replace_schema_metadata({**table.schema.metadata, INDEX_META_KEY: json.dumps(merged).encode()})
