"""Read traces and indexes for the analysis: discovery, validation, columnar load.

A trace is ``OUT/<run_id>/rank=<r>/part-NNNNN.parquet`` plus
``OUT/<run_id>/rank=<r>/_manifest.json`` (and optionally ``OUT/<run_id>/_run.json``).
Callers pass one run folder, an ``OUT`` folder holding several runs, a rank
folder, a glob, or a URL on any pyarrow filesystem (``s3://…``, ``file://…``).

Only the columns the verdicts need are read; strings are read as dictionaries
and turned into small integer codes per part, the 16-byte fingerprint becomes
two int64 columns. ``chunk_fps`` is never read here: ``read_chunk_fps`` fetches
it later for the few rows that need it.
"""

from __future__ import annotations

import fnmatch
import glob as globmod
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from moetrace.errors import MoetraceError
from moetrace.tracer.schema import (
    INDEX_SCHEMA_VERSION,
    MANIFEST_SCHEMA_VERSION,
    TENSOR_NAMES,
    TRACE_SCHEMA_VERSION,
)

RANK_DIR = re.compile(r"^rank=(\d+)$")
PART_FILE = re.compile(r"^part-\d+\.parquet$")
SOURCES = ("staged", "resident")  # code 0 sorts first: a staged load precedes the layer's resident use

TRACE_COLUMNS = [
    "schema_version", "run_id", "tp_size", "tp_rank", "ep_size", "step", "source", "load_seq",
    "transport_order", "layer", "expert", "tensor", "copy_order", "dtype", "nbytes", "fp",
]
_DICT_COLUMNS = ["run_id", "source", "tensor", "dtype"]
INDEX_COLUMNS = [
    "schema_version", "checkpoint_id", "tp_size", "ep_size", "tp_rank", "layer", "expert",
    "tensor", "copy_order", "dtype", "nbytes", "fp", "chunk_fps",
]


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


def fp_columns(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """16-byte fixed binary fingerprints -> (first 8 bytes, last 8 bytes) as int64 arrays."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if len(arr) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not pa.types.is_fixed_size_binary(arr.type) or arr.type.byte_width != 16:
        arr = arr.cast(pa.binary(16))
    buf = arr.buffers()[1]
    words = np.frombuffer(buf, dtype="<i8", count=2 * (arr.offset + len(arr)))[2 * arr.offset :].reshape(-1, 2)
    return np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])


def fp_bytes_to_pair(fp: bytes) -> tuple[int, int]:
    a = np.frombuffer(fp, dtype="<i8")
    return int(a[0]), int(a[1])


def pair_to_hex(hi: int, lo: int) -> str:
    return np.array([hi, lo], dtype="<i8").tobytes().hex()


# ---------------------------------------------------------------- discovery


@dataclass
class RankDir:
    fs: pafs.FileSystem
    path: str
    rank: int
    parts: list[str]
    manifest_path: str | None
    display: str


@dataclass
class RankInfo:
    rank: int
    path: str
    manifest: dict
    parts: list[str]

    @property
    def finished(self) -> bool:
        return bool(self.manifest.get("finished"))

    @property
    def rows_written(self) -> int:
        return int(self.manifest.get("rows_written") or 0)

    @property
    def rows_dropped(self) -> int:
        return int(self.manifest.get("rows_dropped") or 0)

    @property
    def hook_errors(self) -> int:
        v = self.manifest.get("hook_errors") or 0
        return len(v) if isinstance(v, list) else int(v)

    @property
    def errors(self) -> int:
        """Hook and sink errors counted by the tracer."""
        n = 0
        for key in ("hook_errors", "sink_errors"):
            v = self.manifest.get(key) or 0
            n += len(v) if isinstance(v, list) else int(v)
        return n

    def sampling(self) -> tuple[set[int] | None, set[int] | None, set[str] | None]:
        """(layers, experts, tensors) the hook config restricted capture to; None means all."""
        return sampling_of(self.manifest)


@dataclass
class RunInfo:
    run_id: str
    path: str
    checkpoint_id: str | None
    tp_size: int
    ep_size: int
    expected_ranks: list[int]
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    run_json: dict | None = None

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in self.expected_ranks if r not in self.ranks]


def _as_int_set(v) -> set[int] | None:
    if v is None or v == "all" or v == "*":
        return None
    if isinstance(v, int):
        return {v}
    if isinstance(v, (list, tuple)):
        return {int(x) for x in v}
    if isinstance(v, str):
        out: set[int] = set()
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
        return out
    return None


def sampling_of(manifest: dict) -> tuple[set[int] | None, set[int] | None, set[str] | None]:
    """Layers/experts/tensors lists of the hook config recorded in a manifest.

    Looked up in ``config``, ``hook_config`` and their ``sampling`` sub-dict,
    in that order; layers/experts: a list of ints, an int, a "0-3,7" string, or
    null/"all"; tensors: a list of FusedMoE param names or a comma-separated string.
    """
    layers = experts = tensors = None
    seen = set()
    for key in ("config", "hook_config", "sampling"):
        cfg = manifest.get(key)
        if not isinstance(cfg, dict):
            continue
        for c in (cfg, cfg.get("sampling") if isinstance(cfg.get("sampling"), dict) else None):
            if not c:
                continue
            for name in ("layers", "experts", "tensors"):
                if name in seen or name not in c:
                    continue
                seen.add(name)
                if name == "layers":
                    layers = _as_int_set(c[name])
                elif name == "experts":
                    experts = _as_int_set(c[name])
                else:
                    v = c[name]
                    if isinstance(v, str):
                        v = [x.strip() for x in v.split(",") if x.strip()]
                    tensors = set(v) if v else None
    return layers, experts, tensors


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:
            raise MoetraceError(f"cannot open trace URL {path}: {err}") from None
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _expand(path: str) -> list[tuple[pafs.FileSystem, str, str]]:
    """(fs, path, display) for a path, URL or glob."""
    fs, p = _filesystem(path)
    if not _has_glob(p):
        return [(fs, p, path)]
    if isinstance(fs, pafs.LocalFileSystem):
        hits = sorted(globmod.glob(p))
        return [(fs, h, h) for h in hits]
    # remote glob: list below the longest literal prefix, match the rest
    prefix = re.split(r"[*?\[]", p, 1)[0].rsplit("/", 1)[0]
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    return [(fs, i.path, i.path) for i in infos if fnmatch.fnmatch(i.path, p)]


def discover(paths: Sequence[str]) -> list[RankDir]:
    """Every ``rank=<r>`` folder below the given paths, with its parts and manifest."""
    found: dict[tuple[int, str], RankDir] = {}
    for raw in paths:
        expanded = _expand(raw)
        if not expanded:
            raise MoetraceError(f"no trace matches {raw}")
        for fs, p, display in expanded:
            info = fs.get_file_info(p)
            if info.type == pafs.FileType.NotFound:
                raise MoetraceError(f"trace path {display} does not exist")
            if info.type == pafs.FileType.File:
                if p.endswith(".parquet") or p.endswith("_manifest.json"):
                    p = p.rsplit("/", 1)[0]
                else:
                    raise MoetraceError(f"{display} is a file; pass a trace folder OUT/<run_id>")
            files = fs.get_file_info(pafs.FileSelector(p, recursive=True))
            rank_files: dict[str, list[str]] = {}
            if RANK_DIR.match(p.rstrip("/").rsplit("/", 1)[-1]):
                rank_files[p.rstrip("/")] = []
            for f in files:
                if f.type != pafs.FileType.File:
                    if f.type == pafs.FileType.Directory and RANK_DIR.match(f.base_name):
                        rank_files.setdefault(f.path, [])
                    continue
                parent, name = f.path.rsplit("/", 1)
                if RANK_DIR.match(parent.rsplit("/", 1)[-1]):
                    rank_files.setdefault(parent, []).append(name)
            for rd, names in rank_files.items():
                key = (id(fs), rd)
                if key in found:
                    continue
                parts = sorted(n for n in names if PART_FILE.match(n))
                found[key] = RankDir(
                    fs=fs,
                    path=rd,
                    rank=int(RANK_DIR.match(rd.rsplit("/", 1)[-1]).group(1)),
                    parts=[f"{rd}/{n}" for n in parts],
                    manifest_path=f"{rd}/_manifest.json" if "_manifest.json" in names else None,
                    display=rd,
                )
    if not found:
        raise MoetraceError(
            f"no trace found under {', '.join(paths)} (expected OUT/<run_id>/rank=<r>/part-NNNNN.parquet)"
        )
    return sorted(found.values(), key=lambda d: (d.path.rsplit("/", 1)[0], d.rank))


def _read_json(fs: pafs.FileSystem, path: str, what: str) -> dict:
    try:
        with fs.open_input_stream(path) as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise MoetraceError(f"{what} {path} is unreadable: {str(err).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise MoetraceError(f"{what} {path} is not a JSON object")
    return doc


def load_runs(rank_dirs: Sequence[RankDir]) -> list[RunInfo]:
    """Manifests grouped by run folder; refuses missing manifests and inconsistent runs."""
    by_run: dict[str, list[RankDir]] = {}
    for rd in rank_dirs:
        by_run.setdefault(rd.path.rsplit("/", 1)[0], []).append(rd)
    runs: list[RunInfo] = []
    for run_path, rds in by_run.items():
        fs = rds[0].fs
        run_json = None
        if fs.get_file_info(f"{run_path}/_run.json").type == pafs.FileType.File:
            run_json = _read_json(fs, f"{run_path}/_run.json", "run file")
        ranks: dict[int, RankInfo] = {}
        for rd in rds:
            if rd.manifest_path is None:
                raise MoetraceError(
                    f"{rd.display} has no _manifest.json: the tracer never started there or the folder is incomplete"
                )
            m = _read_json(fs, rd.manifest_path, "manifest")
            ver = m.get("schema_version")
            if ver != MANIFEST_SCHEMA_VERSION:
                raise MoetraceError(
                    f"manifest {rd.manifest_path} has schema_version {ver!r}; this moetrace reads version {MANIFEST_SCHEMA_VERSION}"
                )
            r = int(m.get("tp_rank", rd.rank))
            if r != rd.rank:
                raise MoetraceError(f"manifest {rd.manifest_path} says tp_rank {r} but sits in rank={rd.rank}")
            ranks[r] = RankInfo(rank=r, path=rd.path, manifest=m, parts=rd.parts)

        def one(key: str, default=None):
            vals = {rk.manifest.get(key, default) for rk in ranks.values()}
            if run_json is not None and run_json.get(key) is not None:
                vals.add(run_json.get(key))
            vals.discard(None)
            if len(vals) > 1:
                raise MoetraceError(f"run {run_path} mixes {key} values {sorted(map(str, vals))} across its manifests")
            return next(iter(vals)) if vals else default

        run_ids = {str(rk.manifest.get("run_id")) for rk in ranks.values() if rk.manifest.get("run_id") is not None}
        if len(run_ids) > 1:
            raise MoetraceError(f"run folder {run_path} mixes run ids {sorted(run_ids)}")
        run_id = next(iter(run_ids)) if run_ids else run_path.rsplit("/", 1)[-1]
        tp_size = one("tp_size")
        if tp_size is None:
            raise MoetraceError(f"manifests of {run_path} do not say tp_size")
        tp_size = int(tp_size)
        ep_size = int(one("ep_size", 1) or 1)
        ckpt = one("checkpoint_id")
        expected = list(range(tp_size))
        if run_json is not None and isinstance(run_json.get("ranks"), list):
            rl = []
            for x in run_json["ranks"]:
                if isinstance(x, dict):
                    x = x.get("tp_rank", x.get("rank"))
                if x is not None:
                    rl.append(int(x))
            if rl:
                expected = sorted(set(rl))
        runs.append(
            RunInfo(run_id=run_id, path=run_path, checkpoint_id=ckpt, tp_size=tp_size, ep_size=ep_size,
                    expected_ranks=expected, ranks=ranks, run_json=run_json)
        )
    ids = [r.run_id for r in runs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise MoetraceError(f"run id(s) {sorted(dup)} appear in several folders; analyze them separately")
    return runs


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

    @property
    def n(self) -> int:
        return len(self.cols["layer"])


# output columns of read_trace and their dtypes
COL_DTYPES = {
    "run": np.int16, "rank": np.int16, "step": np.int64, "source": np.int8, "load_seq": np.int64,
    "transport_order": np.int32, "layer": np.int32, "expert": np.int32, "tensor": np.int16, "copy_order": np.int8,
    "dtype": np.int16, "nbytes": np.int64, "hi": np.int64, "lo": np.int64, "part": np.int32, "row": np.int32,
}
_NUMERIC = {"rank": "tp_rank", "step": "step", "load_seq": "load_seq", "transport_order": "transport_order",
            "layer": "layer", "expert": "expert", "copy_order": "copy_order", "nbytes": "nbytes"}


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
            if vs and vs != [TRACE_SCHEMA_VERSION]:
                raise _SchemaVersion(path, vs)
        raise MoetraceError(f"trace part {path} lacks column(s) {', '.join(missing)}: not a moetrace trace v{TRACE_SCHEMA_VERSION}")


def _fill_part(pf: pq.ParquetFile, path: str, part_id: int, out: dict[str, np.ndarray], start: int,
               vocabs: tuple[Vocab, Vocab, Vocab]) -> tuple[set[int], set[int]]:
    """Read one part into out[...][start:start+n]; returns its (tp_size, ep_size) values."""
    run_v, tensor_v, dtype_v = vocabs
    t = pf.read(columns=TRACE_COLUMNS, use_threads=False)
    n = t.num_rows
    if n != pf.metadata.num_rows:
        raise ValueError(f"read {n} rows, footer says {pf.metadata.num_rows}")
    sl = slice(start, start + n)
    if n == 0:
        return set(), set()
    ver = t.column("schema_version").to_numpy()
    if ver.min() != TRACE_SCHEMA_VERSION or ver.max() != TRACE_SCHEMA_VERSION:
        raise _SchemaVersion(path, sorted(set(np.unique(ver).tolist())))
    src = Vocab(SOURCES)
    out["source"][sl] = src.codes_of(t.column("source"), np.int8)
    if len(src) > len(SOURCES):
        raise MoetraceError(f"trace part {path} has source value(s) {src.names[len(SOURCES):]}; expected 'resident' or 'staged'")
    out["hi"][sl], out["lo"][sl] = fp_columns(t.column("fp"))
    out["run"][sl] = run_v.codes_of(t.column("run_id"), np.int16)
    out["tensor"][sl] = tensor_v.codes_of(t.column("tensor"), np.int16)
    out["dtype"][sl] = dtype_v.codes_of(t.column("dtype"), np.int16)
    for dst, col in _NUMERIC.items():
        out[dst][sl] = t.column(col).to_numpy()
    out["part"][sl] = part_id
    out["row"][sl] = np.arange(n, dtype=np.int32)
    sizes = tuple({int(x) for x in t.column(c).unique().to_pylist()} for c in ("tp_size", "ep_size"))
    return sizes


def read_trace(paths: Sequence[str], threads: int | None = None) -> TraceData:
    """Discover, validate and load trace rows (needed columns only) into preallocated arrays."""
    rank_dirs = discover(paths)
    runs = load_runs(rank_dirs)
    fs_of = {rd.path: rd.fs for rd in rank_dirs}
    parts: list[tuple[pafs.FileSystem, str]] = []
    part_run: list[RunInfo] = []
    for run in runs:
        for rk in sorted(run.ranks.values(), key=lambda r: r.rank):
            parts.extend((fs_of[rk.path], p) for p in rk.parts)
            part_run.extend(run for _ in rk.parts)
    vocabs = (Vocab(), Vocab(TENSOR_NAMES), Vocab())
    skipped: dict[int, str] = {}
    versions: dict[int, str] = {}
    workers = threads or min(4, os.cpu_count() or 1, max(1, len(parts)))

    def why(err: BaseException) -> str:
        return str(err).splitlines()[0] if str(err) else type(err).__name__

    # pass 1: footers (row counts), column check
    def open_one(i: int):
        fs, p = parts[i]
        try:
            pf = _open_parquet(p, fs, _DICT_COLUMNS)
            _check_columns(pf, p)
            return pf, None
        except (_SchemaVersion, MoetraceError) as err:
            return None, err
        except (pa.ArrowException, OSError, ValueError, EOFError, KeyError) as err:
            return None, why(err)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-read") as pool:
        opened = list(pool.map(open_one, range(len(parts))))
    for i, (_, err) in enumerate(opened):
        if isinstance(err, MoetraceError):
            raise err
        if isinstance(err, _SchemaVersion):
            for v in err.versions:
                versions.setdefault(v, err.path)
        elif err is not None:
            skipped[i] = err
    counts = np.array([pf.metadata.num_rows if pf is not None else 0 for pf, _ in opened], dtype=np.int64)
    starts = np.r_[0, np.cumsum(counts)]
    cols = {k: np.empty(int(starts[-1]), dtype=dt) for k, dt in COL_DTYPES.items()}
    ok = np.ones(len(parts), dtype=bool)

    # pass 2: read each part straight into its slice
    def read_one(i: int):
        pf = opened[i][0]
        if pf is None:
            return None
        try:
            return _fill_part(pf, parts[i][1], i, cols, int(starts[i]), vocabs)
        except (_SchemaVersion, MoetraceError) as err:
            return err
        except (pa.ArrowException, OSError, ValueError, EOFError, KeyError) as err:
            return why(err)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-read") as pool:
        outcomes = list(pool.map(read_one, range(len(parts))))
    for i, res in enumerate(outcomes):
        if res is None:
            ok[i] = False
        elif isinstance(res, MoetraceError):
            raise res
        elif isinstance(res, _SchemaVersion):
            ok[i] = False
            for v in res.versions:
                versions.setdefault(v, res.path)
        elif isinstance(res, str):
            ok[i] = False
            skipped[i] = res
        else:
            if counts[i]:
                versions.setdefault(TRACE_SCHEMA_VERSION, parts[i][1])
            run = part_run[i]
            for name, vals, want in (("tp_size", res[0], run.tp_size), ("ep_size", res[1], run.ep_size)):
                if vals and vals != {want}:
                    raise MoetraceError(
                        f"trace part {parts[i][1]} has {name} {sorted(vals)} but its manifest says {want}"
                    )
    if set(versions) - {TRACE_SCHEMA_VERSION}:
        if len(versions) > 1:
            desc = ", ".join(f"v{v} ({p})" for v, p in sorted(versions.items()))
            raise MoetraceError(f"trace mixes schema versions: {desc}; analyze each version separately")
        (v, p), = versions.items()
        raise MoetraceError(f"trace part {p} has schema_version {v}; this moetrace reads version {TRACE_SCHEMA_VERSION}")
    if not ok.all() and counts[~ok].sum():
        keep = np.repeat(ok, counts)
        cols = {k: v[keep] for k, v in cols.items()}
    data = TraceData(runs=runs, cols=cols, run_ids=vocabs[0], tensors=vocabs[1], dtypes=vocabs[2],
                     parts=parts, skipped_parts=[(parts[i][1], skipped[i]) for i in sorted(skipped)])
    _check_rows_against_manifests(data)
    return data


def _check_rows_against_manifests(data: TraceData) -> None:
    if data.n == 0:
        return
    known = {r.run_id for r in data.runs}
    for name in data.run_ids.names:
        if name not in known:
            raise MoetraceError(f"trace rows name run {name!r} but no manifest does (runs: {sorted(known)})")


def read_chunk_fps(data: TraceData, rows: np.ndarray) -> list[bytes | None]:
    """chunk_fps of the given trace rows (positions into data.cols), read from their parts."""
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
        if "chunk_fps" not in pf.schema_arrow.names:
            continue
        md = pf.metadata
        starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        want = prow[grp]
        rgs = np.unique(np.searchsorted(starts, want, side="right") - 1)
        col = pf.read_row_groups(rgs.tolist(), columns=["chunk_fps"], use_threads=False).column(0)
        # rows of the selected row groups, renumbered
        base = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in rgs])
        local = np.searchsorted(base, want)
        vals = col.take(pa.array(local)).to_pylist()
        for j, v in zip(grp, vals):
            out[int(j)] = v
    return out


# ---------------------------------------------------------------- index


@dataclass
class IndexData:
    """Expected fingerprints, sorted by (tp_rank, layer, expert, tensor)."""

    path: str
    checkpoint_id: str
    tp_size: int
    ep_size: int
    rank: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    tensor: np.ndarray
    copy_order: np.ndarray
    dtype: np.ndarray
    nbytes: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    chunk_fps: pa.Array | None  # in file order; chunk_fps_of() maps sorted positions
    order: np.ndarray | None = None  # sorted position -> file row

    @property
    def n(self) -> int:
        return len(self.layer)

    def chunk_fps_of(self, positions: np.ndarray) -> pa.Array:
        rows = positions if self.order is None else self.order[positions]
        return self.chunk_fps.take(pa.array(rows))


def read_index(path: str, tensors: Vocab, dtypes: Vocab, layers: set[int] | None = None) -> IndexData:
    fs, p = _filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.NotFound:
        raise MoetraceError(f"index {path} does not exist")
    try:
        pf = _open_parquet(p, fs, ["checkpoint_id", "tensor", "dtype"])
        names = set(pf.schema_arrow.names)
        missing = [c for c in INDEX_COLUMNS if c not in names and c != "chunk_fps"]
        if missing:
            raise MoetraceError(f"index {path} lacks column(s) {', '.join(missing)}: not a moetrace index")
        t = pf.read(columns=[c for c in INDEX_COLUMNS if c in names])
    except MoetraceError:
        raise
    except (pa.ArrowException, OSError) as err:
        raise MoetraceError(f"index {path} is unreadable: {str(err).splitlines()[0]}") from None
    if t.num_rows == 0:
        raise MoetraceError(f"index {path} has no rows")
    vers = sorted(set(t.column("schema_version").to_pylist()))
    if vers != [INDEX_SCHEMA_VERSION]:
        raise MoetraceError(f"index {path} has schema_version {vers}; this moetrace reads version {INDEX_SCHEMA_VERSION}")

    def single(col: str):
        vals = t.column(col).unique().to_pylist()
        if len(vals) != 1:
            raise MoetraceError(f"index {path} mixes {col} values {vals}; an index covers one checkpoint and layout")
        return vals[0]

    ckpt = single("checkpoint_id")
    tp = int(single("tp_size"))
    ep = int(single("ep_size"))
    rank = t.column("tp_rank").to_numpy().astype(np.int64)
    layer = t.column("layer").to_numpy().astype(np.int64)
    expert = t.column("expert").to_numpy().astype(np.int64)
    tensor = tensors.codes_of(t.column("tensor"), np.int16).astype(np.int64)
    keep = np.ones(len(layer), dtype=bool)
    if layers is not None:
        keep = np.isin(layer, np.array(sorted(layers), dtype=np.int64))
    order = np.lexsort((tensor, expert, layer, rank))
    order = order[keep[order]]
    hi, lo = fp_columns(t.column("fp"))
    chunk = t.column("chunk_fps").combine_chunks() if "chunk_fps" in names else None
    idx = IndexData(
        path=path, checkpoint_id=str(ckpt), tp_size=tp, ep_size=ep,
        rank=rank[order], layer=layer[order], expert=expert[order], tensor=tensor[order],
        copy_order=t.column("copy_order").to_numpy().astype(np.int64)[order],
        dtype=dtypes.codes_of(t.column("dtype"), np.int16)[order],
        nbytes=t.column("nbytes").to_numpy().astype(np.int64)[order],
        hi=hi[order], lo=lo[order],
        chunk_fps=chunk, order=order,
    )
    key = np.stack([idx.rank, idx.layer, idx.expert, idx.tensor], axis=1)
    if len(key) > 1 and (np.diff(key, axis=0) == 0).all(axis=1).any():
        raise MoetraceError(f"index {path} has duplicate (tp_rank, layer, expert, tensor) entries")
    return idx
