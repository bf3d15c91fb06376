"""Read trace rows for the analysis: only the columns the verdicts need, into numpy.

Strings are read as dictionaries and turned into small integer codes per part
(``Vocab``); the 16-byte digest becomes two int64 columns. ``chunk_digests`` is
never read here: ``read_chunk_digests`` fetches it later for the few rows that need it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from moetrace.analysis.discovery import RunInfo, discover, load_runs
from moetrace.errors import MoetraceError
from moetrace.schema import (
    MODELS,
    READABLE_TRACE_SCHEMA_VERSIONS,
    SOURCES,
    TENSOR_NAMES,
    TRACE_SCHEMA_VERSION,
    label_key,
)

TRACE_COLUMNS = [
    "schema_version", "run_id", "model", "tp_size", "tp_rank", "ep_size", "moe_tp_rank", "step", "source",
    "capture_seq", "transport_position", "slot", "expert_copy", "slot_count", "layer", "expert", "tensor",
    "copy_position", "dtype", "shape", "nbytes", "digest", "online",
]
_DICT_COLUMNS = ["run_id", "model", "source", "tensor", "dtype", "online"]
ONLINE = ("unchecked", "match", "mismatch")  # cols["online"] codes; a null verdict is "unchecked"


class Vocab:
    """String <-> small int codes shared by the trace and the index of one analysis."""

    def __init__(self, initial: Iterable[str] = ()):
        self._lock = threading.Lock()
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        for name in initial:
            self.code(name)

    def code(self, name: str) -> int:
        c = self._codes.get(name)
        if c is None:
            with self._lock:
                c = self._codes.get(name)
                if c is None:
                    c = self._codes[name] = len(self.names)
                    self.names.append(name)
        return c

    def codes_of(self, arr: pa.ChunkedArray | pa.Array, dtype=np.int16) -> np.ndarray:
        """Codes for a (dictionary or plain) string column, vectorized per chunk."""
        chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
        out = []
        for ch in chunks:
            if not pa.types.is_dictionary(ch.type):
                ch = ch.dictionary_encode()
            mapping = np.array([self.code(s) for s in ch.dictionary.to_pylist()] or [0], dtype=dtype)
            idx = ch.indices.to_numpy(zero_copy_only=False)
            out.append(mapping[idx])
        return np.concatenate(out) if out else np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return len(self.names)


def digest_columns(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """16-byte digests -> (first 8 bytes, last 8 bytes) as int64 arrays."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if len(arr) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not pa.types.is_fixed_size_binary(arr.type) or arr.type.byte_width != 16:
        arr = arr.cast(pa.binary(16))
    buf = arr.buffers()[1]
    words = np.frombuffer(buf, dtype="<i8", count=2 * (arr.offset + len(arr)))[2 * arr.offset :].reshape(-1, 2)
    return np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])


def digest_pair(digest: bytes) -> tuple[int, int]:
    a = np.frombuffer(digest, dtype="<i8")
    return int(a[0]), int(a[1])


def pair_to_hex(hi: int, lo: int) -> str:
    return np.array([hi, lo], dtype="<i8").tobytes().hex()



# ---------------------------------------------------------------- trace rows


@dataclass
class TraceData:
    """Columns of every readable trace row, as numpy arrays (one entry per row)."""

    runs: list[RunInfo]
    cols: dict[str, np.ndarray]
    run_ids: Vocab
    tensors: Vocab
    dtypes: Vocab
    parts: list[tuple[pafs.FileSystem, str]]  # part id -> (fs, path)
    skipped_parts: list[tuple[str, str]]  # (path, reason)
    labels: list[str] = field(default_factory=list)  # cols["rank"] code -> rank label of the process
    models: Vocab = field(default_factory=lambda: Vocab(MODELS))  # cols["model"] codes
    shapes: dict = field(default_factory=dict)  # (model code, tensor code, per-expert shape) -> a part holding it
    partial: bool = False  # a segment of the rows (analysis.weight_updates): counts are held to manifests elsewhere

    def label_code(self, label: str) -> int:
        return self.labels.index(label)

    @property
    def n(self) -> int:
        return len(self.cols["layer"])


# output columns of read_trace and their dtypes. "rank" is the process (a code into
# TraceData.labels, from the part's folder); "shard" its moe_tp_rank, which with "model",
# "layer", "expert" and "tensor" keys the index.
COL_DTYPES = {
    "run": np.int16, "rank": np.int16, "tp": np.int16, "shard": np.int16, "model": np.int8, "step": np.int64,
    "source": np.int8, "capture_seq": np.int64, "transport_position": np.int32, "slot": np.int32, "copy": np.int16,
    "slot_count": np.int32, "layer": np.int32, "expert": np.int32, "tensor": np.int16, "copy_position": np.int8,
    "dtype": np.int16, "nbytes": np.int64, "hi": np.int64, "lo": np.int64, "part": np.int32, "row": np.int32,
    "online": np.int8,
}
_NUMERIC = {"tp": "tp_rank", "shard": "moe_tp_rank", "step": "step", "capture_seq": "capture_seq",
            "transport_position": "transport_position", "slot": "slot", "copy": "expert_copy",
            "slot_count": "slot_count", "layer": "layer", "expert": "expert", "copy_position": "copy_position",
            "nbytes": "nbytes"}


def _open_parquet(path: str, fs, dict_columns: list[str]) -> pq.ParquetFile:
    """ParquetFile reading `dict_columns` as dictionaries (those it has)."""
    try:
        return pq.ParquetFile(path, filesystem=fs, read_dictionary=dict_columns)
    except KeyError:  # a listed column is absent: the caller reports what is missing
        pf = pq.ParquetFile(path, filesystem=fs)
        have = [c for c in dict_columns if c in pf.schema_arrow.names]
        return pq.ParquetFile(path, filesystem=fs, read_dictionary=have) if have else pf


class _SchemaVersion(Exception):
    def __init__(self, path: str, versions: list[int]):
        self.path, self.versions = path, versions


def _check_columns(pf: pq.ParquetFile, path: str) -> None:
    names = set(pf.schema_arrow.names)
    missing = [c for c in TRACE_COLUMNS if c not in names]
    if missing:
        if "schema_version" in names:
            vs = sorted(set(pf.read(columns=["schema_version"]).column(0).to_pylist()))
            if vs and not set(vs) <= set(READABLE_TRACE_SCHEMA_VERSIONS):
                raise _SchemaVersion(path, vs)
        raise MoetraceError(f"trace part {path} lacks column(s) {', '.join(missing)}: not a moetrace trace "
                            f"v{TRACE_SCHEMA_VERSION}")


def _fill_part(pf: pq.ParquetFile, path: str, part_id: int, out: dict[str, np.ndarray], start: int,
               vocabs: tuple[Vocab, Vocab, Vocab, Vocab], rank_code: int) -> tuple[set[int], set[int], set, int]:
    """Read one part into out[...][start:start+n]; returns its (tp_size, ep_size) values,
    held shapes and schema version."""
    run_v, tensor_v, dtype_v, model_v = vocabs
    t = pf.read(columns=TRACE_COLUMNS, use_threads=False)
    n = t.num_rows
    if n != pf.metadata.num_rows:
        raise ValueError(f"read {n} rows, footer says {pf.metadata.num_rows}")
    sl = slice(start, start + n)
    if n == 0:
        return set(), set(), set()
    ver = t.column("schema_version").to_numpy()
    if ver.min() != ver.max() or int(ver.min()) not in READABLE_TRACE_SCHEMA_VERSIONS:
        raise _SchemaVersion(path, sorted(set(np.unique(ver).tolist())))
    src = Vocab(SOURCES)
    out["source"][sl] = src.codes_of(t.column("source"), np.int8)
    known = SOURCES if int(ver.min()) >= 4 else ("staged", "resident")  # "loaded" came with version 4
    if len(src) > len(SOURCES) or (len(known) < len(SOURCES) and not set(_present(t.column("source"))) <= set(known)):
        bad = sorted(set(_present(t.column("source"))) - set(known))
        raise MoetraceError(f"trace part {path} (schema v{int(ver.min())}) has source value(s) {bad}; "
                            f"expected {' or '.join(repr(s) for s in known)}")
    out["hi"][sl], out["lo"][sl] = digest_columns(t.column("digest"))
    out["run"][sl] = run_v.codes_of(t.column("run_id"), np.int16)
    out["model"][sl] = model_v.codes_of(t.column("model"), np.int8)
    if len(model_v) > len(MODELS):
        raise MoetraceError(f"trace part {path} has model value(s) {model_v.names[len(MODELS):]}; expected "
                            f"{list(MODELS)}")
    out["rank"][sl] = rank_code
    out["tensor"][sl] = tensor_v.codes_of(t.column("tensor"), np.int16)
    out["dtype"][sl] = dtype_v.codes_of(t.column("dtype"), np.int16)
    out["online"][sl] = _online_codes(t.column("online"), path)
    for dst, col in _NUMERIC.items():
        out[dst][sl] = t.column(col).to_numpy()
    out["part"][sl] = part_id
    out["row"][sl] = np.arange(n, dtype=np.int32)
    sizes = tuple({int(x) for x in t.column(c).unique().to_pylist()} for c in ("tp_size", "ep_size"))
    return (*sizes, held_shapes(t.column("shape"), out["model"][sl], out["tensor"][sl]), int(ver.min()))


def _present(col: pa.ChunkedArray) -> list:
    return col.unique().to_pylist()


def held_shapes(col: pa.ChunkedArray, model: np.ndarray, tensor: np.ndarray) -> set[tuple[int, int, tuple]]:
    """The distinct (model code, tensor code, per-expert shape) of rows, without a Python
    object per row: per (model, tensor) group, rows are compared with the group's first
    (all rows of a tensor share one shape, unless the trace contradicts itself)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        return set()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    starts, ndim = offsets[:-1], np.diff(offsets)
    n_tensors = int(tensor.max()) + 1
    group = model.astype(np.int64) * n_tensors + tensor
    out = set()
    for g in np.flatnonzero(np.bincount(group)).tolist():
        rows = np.flatnonzero(group == g)
        m, t = divmod(g, n_tensors)
        for k in np.unique(ndim[rows]).tolist():
            sub = rows[ndim[rows] == k]
            dims = values[starts[sub, None] + np.arange(k)]
            same = (dims == dims[0]).all()
            for shape in ([dims[0]] if same else np.unique(dims, axis=0)):
                out.add((m, t, tuple(int(x) for x in shape)))
    return out


def _online_codes(col: pa.ChunkedArray, path: str) -> np.ndarray:
    """ONLINE codes of the online column (a null verdict is "unchecked"), without decoding strings."""
    vocab, out = Vocab(ONLINE), []
    for ch in col.chunks:
        if not pa.types.is_dictionary(ch.type):
            ch = ch.dictionary_encode()
        mapping = np.array([vocab.code(v) for v in ch.dictionary.to_pylist()] + [0], dtype=np.int8)
        idx = pc.fill_null(ch.indices, len(ch.dictionary)).to_numpy(zero_copy_only=False)
        out.append(mapping[idx])
    if len(vocab) > len(ONLINE):
        raise MoetraceError(f"trace part {path} has online value(s) {vocab.names[len(ONLINE):]}; expected 'match', "
                            "'mismatch' or null")
    return np.concatenate(out) if out else np.zeros(0, np.int8)


def _parts_of(runs: list[RunInfo], fs_of: dict) -> tuple[list[tuple[pafs.FileSystem, str]], list[RunInfo],
                                                        list[int], list[str]]:
    """(filesystem, path) of every part, run by run and rank by rank, each part's run and
    process code, and the rank labels the codes index."""
    parts, part_run, part_rank = [], [], []
    labels = sorted({lb for run in runs for lb in set(run.ranks) | set(run.expected_ranks)}, key=label_key)
    for run in runs:
        for label in sorted(run.ranks, key=label_key):
            rk = run.ranks[label]
            parts.extend((fs_of[rk.path], p) for p in rk.parts)
            part_run.extend(run for _ in rk.parts)
            part_rank.extend(labels.index(label) for _ in rk.parts)
    return parts, part_run, part_rank, labels


def _check_versions(versions: dict[int, str]) -> None:
    """versions: schema version -> a part that has it. One line when they are not one
    version this moetrace reads (a trace is written by one moetrace: one version)."""
    if len(versions) <= 1 and set(versions) <= set(READABLE_TRACE_SCHEMA_VERSIONS):
        return
    if len(versions) > 1:
        desc = ", ".join(f"v{v} ({p})" for v, p in sorted(versions.items()))
        raise MoetraceError(f"trace mixes schema versions: {desc}; analyze each version separately")
    (v, p), = versions.items()
    readable = " and ".join(str(x) for x in READABLE_TRACE_SCHEMA_VERSIONS)
    raise MoetraceError(f"trace part {p} has schema_version {v}; this moetrace reads versions {readable} "
                        f"(it writes {TRACE_SCHEMA_VERSION})")


def read_trace(paths: Sequence[str], threads: int | None = None) -> TraceData:
    """Discover, validate and load trace rows (needed columns only) into preallocated arrays."""
    rank_dirs = discover(paths)
    runs = load_runs(rank_dirs)
    parts, part_run, part_rank, labels = _parts_of(runs, {rd.path: rd.fs for rd in rank_dirs})
    # rows each part's manifest says it holds (in _parts_of's order): a part holding others is not the one written
    listed_rows = [run.ranks[label].part_rows[p] for run in runs for label in sorted(run.ranks, key=label_key)
                   for p in run.ranks[label].parts]
    vocabs = (Vocab(), Vocab(TENSOR_NAMES), Vocab(), Vocab(MODELS))
    failed = _Failures()
    workers = threads or min(4, os.cpu_count() or 1, max(1, len(parts)))
    opened = _open_parts(parts, listed_rows, workers, failed)
    counts = np.array([pf.metadata.num_rows if pf is not None else 0 for pf in opened], dtype=np.int64)
    starts = np.r_[0, np.cumsum(counts)]
    cols = {k: np.empty(int(starts[-1]), dtype=dt) for k, dt in COL_DTYPES.items()}

    def read_one(i: int):  # each part straight into its slice
        try:
            return _fill_part(opened[i], parts[i][1], i, cols, int(starts[i]), vocabs, part_rank[i])
        except (_SchemaVersion, MoetraceError) as err:
            return err
        except _READ_ERRORS as err:
            return _first_line(err)

    usable = [i for i, pf in enumerate(opened) if pf is not None]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-read") as pool:
        outcomes = list(pool.map(read_one, usable))
    ok = np.array([pf is not None for pf in opened], dtype=bool)
    shapes: dict[tuple[int, int, tuple], str] = {}
    for i, res in zip(usable, outcomes):
        if isinstance(res, (MoetraceError, _SchemaVersion, str)):
            ok[i] = False
            failed.note(i, res)
            continue
        if counts[i]:
            failed.versions.setdefault(res[3], parts[i][1])
        run = part_run[i]
        for shape in res[2]:
            shapes.setdefault(shape, parts[i][1])
        for name, vals, want in (("tp_size", res[0], run.tp_size), ("ep_size", res[1], run.ep_size)):
            if vals and vals != {want}:
                raise MoetraceError(f"trace part {parts[i][1]} has {name} {sorted(vals)} but its manifest says {want}")
    _check_versions(failed.versions)
    if not ok.all() and counts[~ok].sum():
        keep = np.repeat(ok, counts)
        cols = {k: v[keep] for k, v in cols.items()}
    data = TraceData(runs=runs, cols=cols, run_ids=vocabs[0], tensors=vocabs[1], dtypes=vocabs[2],
                     parts=parts, skipped_parts=[(parts[i][1], failed.skipped[i]) for i in sorted(failed.skipped)],
                     labels=labels, models=vocabs[3], shapes=shapes)
    _check_rows_against_manifests(data)
    return data


_READ_ERRORS = (pa.ArrowException, OSError, ValueError, EOFError, KeyError)


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


class _Failures:
    """Parts that could not be used: skipped (index -> why) or of another schema version
    (version -> a part that has it); a MoetraceError is the whole trace's and is raised."""

    def __init__(self):
        self.skipped: dict[int, str] = {}
        self.versions: dict[int, str] = {}

    def note(self, i: int, err) -> None:
        if isinstance(err, MoetraceError):
            raise err
        if isinstance(err, _SchemaVersion):
            for v in err.versions:
                self.versions.setdefault(v, err.path)
        else:
            self.skipped[i] = err


def _open_parts(parts, listed_rows: list[int], workers: int, failed: _Failures) -> list:
    """Each part's Parquet footer (None when unusable, noted in ``failed``), columns checked."""

    def open_one(i: int):
        fs, p = parts[i]
        try:
            pf = _open_parquet(p, fs, _DICT_COLUMNS)
            _check_columns(pf, p)
            if pf.metadata.num_rows != listed_rows[i]:  # not the part its manifest wrote: never read it
                return None, (f"holds {pf.metadata.num_rows:,} rows but its manifest lists {listed_rows[i]:,} "
                              "(a replaced or foreign file)")
            return pf, None
        except (_SchemaVersion, MoetraceError) as err:
            return None, err
        except _READ_ERRORS as err:
            return None, _first_line(err)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-read") as pool:
        opened = list(pool.map(open_one, range(len(parts))))
    for i, (_, err) in enumerate(opened):
        if err is not None:
            failed.note(i, err)
    return [pf for pf, _ in opened]


def _check_rows_against_manifests(data: TraceData) -> None:
    if data.n == 0:
        return
    known = {r.run_id for r in data.runs}
    for name in data.run_ids.names:
        if name not in known:
            raise MoetraceError(f"trace rows name run {name!r} but no manifest does (runs: {sorted(known)})")


def read_chunk_digests(data: TraceData, rows: np.ndarray) -> list[bytes | None]:
    """chunk_digests of the given trace rows (positions into data.cols), read from their parts."""
    out: list[bytes | None] = [None] * len(rows)
    if len(rows) == 0:
        return out
    part = data.cols["part"][rows]
    prow = data.cols["row"][rows]
    order = np.argsort(part, kind="stable")
    bounds = np.flatnonzero(np.diff(part[order])) + 1
    for grp in np.split(order, bounds):
        pid = int(part[grp[0]])
        fs, path = data.parts[pid]
        pf = pq.ParquetFile(path, filesystem=fs)
        if "chunk_digests" not in pf.schema_arrow.names:
            continue
        md = pf.metadata
        starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        want = prow[grp]
        rgs = np.unique(np.searchsorted(starts, want, side="right") - 1)
        col = pf.read_row_groups(rgs.tolist(), columns=["chunk_digests"], use_threads=False).column(0)
        # rows of the selected row groups, renumbered
        base = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in rgs])
        local = np.searchsorted(base, want)
        vals = col.take(pa.array(local)).to_pylist()
        for j, v in zip(grp, vals):
            out[int(j)] = v
    return out
