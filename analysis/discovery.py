"""Find trace runs and read their side files: rank folders, manifests, _run.json.

A trace is ``OUT/<run_id>/rank=<label>/part-NNNNN.parquet`` plus
``OUT/<run_id>/rank=<label>/_manifest.json`` (and ``OUT/<run_id>/_run.json`` when
``moetrace launch`` ran it); <label> is schema.rank_label: the TP rank, or
"pp1-tp3" / "replica2-pp1-tp3" with pipeline stages or data-parallel replicas.
Refusal records (tracer.claim) of processes that found their folder taken are read
too: such a run is incomplete. Callers pass one run folder, an ``OUT`` folder holding
several runs, a rank folder, a glob, or a URL of any pyarrow / fsspec filesystem.
"""

from __future__ import annotations

import fnmatch
import glob as globmod
import json
import re
from dataclasses import dataclass, field
from typing import Sequence

import pyarrow.fs as pafs

from moetrace import storage
from moetrace.errors import MoetraceError
from moetrace.fingerprint import FP_VERSION
from moetrace.schema import MANIFEST_SCHEMA_VERSION, label_key, parse_ids, parse_rank_label
from moetrace.tracer.claim import read_refusals
from moetrace.tracer.completeness import expected_labels
from moetrace.tracer.manifest import (
    MANIFEST_NAME,
    PART_FILE,
    RUN_MANIFEST_NAME,
    check_rank_manifest,
    check_run_manifest,
)

RANK_DIR = re.compile(r"^rank=([0-9a-z-]+)$")


def _label_of(dirname: str) -> str | None:
    m = RANK_DIR.match(dirname)
    return m.group(1) if m and parse_rank_label(m.group(1)) is not None else None


@dataclass
class RankDir:
    fs: pafs.FileSystem
    path: str
    label: str  # the folder's rank label
    parts: list[str]
    manifest_path: str | None
    display: str


@dataclass
class RankFolder:
    label: str  # schema.rank_label of the process
    path: str
    manifest: dict
    parts: list[str]  # the part files its manifest lists and the folder holds: the only ones read
    part_rows: dict[str, int] = field(default_factory=dict)  # part path -> rows its manifest lists
    unlisted_parts: list[str] = field(default_factory=list)  # in the folder, not in the manifest: never read
    absent_parts: list[str] = field(default_factory=list)  # in the manifest, not in the folder

    @property
    def tp_rank(self) -> int:
        return int(self.manifest.get("tp_rank", parse_rank_label(self.label)[2]))

    @property
    def pp_rank(self) -> int:
        return int(self.manifest.get("pp_rank") or 0)

    @property
    def replica(self) -> int | None:
        r = self.manifest.get("replica")
        return None if r is None else int(r)

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
    expected_ranks: list[str]  # rank labels: every TP rank of every stage and replica
    ranks: dict[str, RankFolder] = field(default_factory=dict)  # by rank label
    run_json: dict | None = None
    pp_size: int = 1
    moe_tp_size: int | None = None  # from the manifests (the modules' moe_tp_size)
    refusals: list[dict] = field(default_factory=list)  # tracer.claim records

    @property
    def missing_ranks(self) -> list[str]:
        return [r for r in self.expected_ranks if r not in self.ranks]



def sampling_of(manifest: dict) -> tuple[set[int] | None, set[int] | None, set[str] | None]:
    """(layers, experts, tensors) the hook config recorded in a rank manifest restricted
    capture to; None means all."""
    cfg = manifest.get("config")
    if not isinstance(cfg, dict):
        return None, None, None
    layers = parse_ids(cfg.get("layers"), "manifest config 'layers'")
    experts = parse_ids(cfg.get("experts"), "manifest config 'experts'")
    tensors = cfg.get("tensors")
    if isinstance(tensors, str):
        tensors = [x.strip() for x in tensors.split(",") if x.strip()]
    return (None if layers is None else set(layers), None if experts is None else set(experts),
            set(tensors) if tensors else None)


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _expand(path: str) -> list[tuple[pafs.FileSystem, str, str]]:
    """(fs, path, display) for a path, URL or glob."""
    fs, p = storage.open_fs(path, "trace")
    if not _has_glob(p):
        return [(fs, p, path)]
    if isinstance(fs, pafs.LocalFileSystem):
        hits = sorted(globmod.glob(p))
        return [(fs, h, h) for h in hits]
    # remote glob: list below the longest literal prefix, match the rest
    prefix = re.split(r"[*?\[]", p, 1)[0].rsplit("/", 1)[0]
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    depth = p.count("/")  # as a local glob: `*` never crosses a "/" (not into rank folders' files)
    return [(fs, i.path, i.path) for i in infos if i.path.count("/") == depth and fnmatch.fnmatch(i.path, p)]


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
                if p.endswith(".parquet") or p.endswith(MANIFEST_NAME):
                    p = p.rsplit("/", 1)[0]
                else:
                    raise MoetraceError(f"{display} is a file; pass a trace folder OUT/<run_id>")
            files = fs.get_file_info(pafs.FileSelector(p, recursive=True))
            rank_files: dict[str, list[str]] = {}
            if _label_of(p.rstrip("/").rsplit("/", 1)[-1]):
                rank_files[p.rstrip("/")] = []
            for f in files:
                if f.type != pafs.FileType.File:
                    if f.type == pafs.FileType.Directory and _label_of(f.base_name):
                        rank_files.setdefault(f.path, [])
                    continue
                parent, name = f.path.rsplit("/", 1)
                if _label_of(parent.rsplit("/", 1)[-1]):
                    rank_files.setdefault(parent, []).append(name)
            for rd, names in rank_files.items():
                key = (id(fs), rd)
                if key in found:
                    continue
                parts = sorted(n for n in names if PART_FILE.match(n))
                found[key] = RankDir(
                    fs=fs,
                    path=rd,
                    label=_label_of(rd.rsplit("/", 1)[-1]),
                    parts=[f"{rd}/{n}" for n in parts],
                    manifest_path=f"{rd}/{MANIFEST_NAME}" if MANIFEST_NAME in names else None,
                    display=rd,
                )
    if not found:
        raise MoetraceError(
            f"no trace found under {', '.join(paths)} (expected OUT/<run_id>/rank=<r>/part-NNNNN.parquet)"
        )
    return sorted(found.values(), key=lambda d: (d.path.rsplit("/", 1)[0], label_key(d.label)))


def _read_json(fs: pafs.FileSystem, path: str, what: str) -> dict:
    try:
        with fs.open_input_stream(path) as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise MoetraceError(f"{what} {path} is unreadable: {str(err).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise MoetraceError(f"{what} {path} is not a JSON object")
    return doc


def _rank_manifest(fs: pafs.FileSystem, rd: RankDir) -> RankFolder:
    """A rank folder's manifest, read strictly (tracer.manifest), with its parts
    split into the listed ones found, the unlisted ones and the listed ones absent."""
    if rd.manifest_path is None:
        raise MoetraceError(
            f"{rd.display} has no {MANIFEST_NAME}: the tracer never started there or the folder is incomplete"
        )
    m = _read_json(fs, rd.manifest_path, "manifest")
    # the versions first (an older manifest lacks or names keys otherwise): digests of two
    # fingerprint versions are never compared, and a manifest of another version is not read
    if _is_int(m.get("fp_version")) and m["fp_version"] != FP_VERSION:
        raise MoetraceError(
            f"manifest {rd.manifest_path} has fingerprint version {m['fp_version']!r}; this moetrace "
            f"computes version {FP_VERSION}: capture the trace again with this moetrace "
            "(and rebuild its index with `moetrace index`)"
        )
    _same_version(m, f"manifest {rd.manifest_path}")
    check_rank_manifest(m, rd.manifest_path)
    if m["rank_label"] != rd.label:
        raise MoetraceError(f"manifest {rd.manifest_path} says rank {m['rank_label']} but sits in rank={rd.label}")
    listed = {f"{rd.path}/{p['file']}": p["rows"] for p in m["parts"]}
    found = set(rd.parts)
    return RankFolder(label=rd.label, path=rd.path, manifest=m, parts=[p for p in rd.parts if p in listed],
                        part_rows=listed, unlisted_parts=sorted(found - set(listed)),
                        absent_parts=sorted(set(listed) - found))


def _run_file(fs: pafs.FileSystem, run_path: str) -> dict | None:
    path = f"{run_path}/{RUN_MANIFEST_NAME}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    doc = _read_json(fs, path, "run file")
    _same_version(doc, f"run file {path}")
    return check_run_manifest(doc, path)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same_version(doc: dict, what: str) -> None:
    """A side file of another manifest schema version is refused in one line (version 4
    renamed the "how it was found" fields: docs/capture.md)."""
    ver = doc.get("schema_version")
    if _is_int(ver) and ver != MANIFEST_SCHEMA_VERSION:
        raise MoetraceError(f"{what} has schema_version {ver!r}; this moetrace reads version {MANIFEST_SCHEMA_VERSION} "
                            "(capture the trace again with this moetrace)")


def _one_launch(run_path: str, run_json: dict | None, ranks: dict[str, RankFolder]) -> None:
    """Every side file of a run folder belongs to one launch: the same run id, and the
    run_nonce of _run.json (or, without one, the same run_nonce on every rank). A reused
    run id mixes launches; nothing of such a folder can be trusted."""
    ids = {rk.manifest["run_id"] for rk in ranks.values()} | ({run_json["run_id"]} if run_json else set())
    if len(ids) > 1:
        raise MoetraceError(f"run folder {run_path} mixes run ids {sorted(ids)}")
    nonces = {r: rk.manifest["run_nonce"] for r, rk in ranks.items()}
    want = run_json["run_nonce"] if run_json else next(iter(nonces.values()), None)
    foreign = sorted((r for r, n in nonces.items() if n != want), key=label_key)
    if foreign:
        whose = f"{RUN_MANIFEST_NAME}'s" if run_json else f"rank {min(set(nonces) - set(foreign), key=label_key)}'s"
        raise MoetraceError(
            f"run folder {run_path} mixes launches: rank {', '.join(map(str, foreign))} has another run_nonce than "
            f"{whose} ({want}); a run id was reused: rerun with a new --run-id or with --replace")


def _expected_ranks(manifests: dict[str, dict], tp_size: int, run_json: dict | None) -> list[str]:
    """Rank labels the run declares: each TP rank 0..tp_size-1 of every stage and replica the
    manifests name (tracer.completeness.expected_labels), plus every rank _run.json lists or counts."""
    counts = {tp_size} | ({run_json[k] for k in ("expected_ranks", "tp_size") if run_json[k] is not None}
                          if run_json is not None else set())
    expected = {label for n in counts for label in expected_labels(manifests, n) or []}
    if run_json is not None:
        expected |= {e["rank_label"] for e in run_json["ranks"]}
    return sorted(expected, key=label_key)


def load_runs(rank_dirs: Sequence[RankDir]) -> list[RunInfo]:
    """Manifests grouped by run folder, read strictly; refuses missing or malformed side
    files, mixed launches and inconsistent runs."""
    by_run: dict[str, list[RankDir]] = {}
    for rd in rank_dirs:
        by_run.setdefault(rd.path.rsplit("/", 1)[0], []).append(rd)
    runs: list[RunInfo] = []
    for run_path, rds in by_run.items():
        fs = rds[0].fs
        run_json = _run_file(fs, run_path)
        ranks = {rd.label: _rank_manifest(fs, rd) for rd in rds}
        _one_launch(run_path, run_json, ranks)

        def one(key: str, default=None):
            vals = {rk.manifest.get(key, default) for rk in ranks.values()}
            if run_json is not None and run_json.get(key) is not None:
                vals.add(run_json.get(key))
            vals.discard(None)
            if len(vals) > 1:
                raise MoetraceError(f"run {run_path} mixes {key} values {sorted(map(str, vals))} across its manifests")
            return next(iter(vals)) if vals else default

        run_id = next(iter(rk.manifest["run_id"] for rk in ranks.values()))
        tp_size = int(one("tp_size"))
        ep_size = int(one("ep_size", 1) or 1)
        moe_tp = one("moe_tp_size")
        manifests = {label: rk.manifest for label, rk in ranks.items()}
        runs.append(
            RunInfo(run_id=run_id, path=run_path, checkpoint_id=one("checkpoint_id"), tp_size=tp_size, ep_size=ep_size,
                    expected_ranks=_expected_ranks(manifests, tp_size, run_json), ranks=ranks, run_json=run_json,
                    pp_size=int(one("pp_size", 1) or 1), moe_tp_size=None if moe_tp is None else int(moe_tp),
                    refusals=read_refusals(fs, run_path))
        )
    ids = [r.run_id for r in runs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise MoetraceError(f"run id(s) {sorted(dup)} appear in several folders; analyze them separately")
    return runs
