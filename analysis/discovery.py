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
from moetrace.schema import MANIFEST_SCHEMA_VERSION, parse_ids, parse_rank_label
from moetrace.tracer.manifest import MANIFEST_NAME, RUN_MANIFEST_NAME, expected_labels, label_key, read_refusals

RANK_DIR = re.compile(r"^rank=([0-9a-z-]+)$")


def _label_of(dirname: str) -> str | None:
    m = RANK_DIR.match(dirname)
    return m.group(1) if m and parse_rank_label(m.group(1)) is not None else None
PART_FILE = re.compile(r"^part-\d+\.parquet$")


@dataclass
class RankDir:
    fs: pafs.FileSystem
    path: str
    label: str  # the folder's rank label
    parts: list[str]
    manifest_path: str | None
    display: str


@dataclass
class RankManifest:
    label: str  # schema.rank_label of the process
    path: str
    manifest: dict
    parts: list[str]

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
    ranks: dict[str, RankManifest] = field(default_factory=dict)  # by rank label
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


def load_runs(rank_dirs: Sequence[RankDir]) -> list[RunInfo]:
    """Manifests grouped by run folder; refuses missing manifests and inconsistent runs."""
    by_run: dict[str, list[RankDir]] = {}
    for rd in rank_dirs:
        by_run.setdefault(rd.path.rsplit("/", 1)[0], []).append(rd)
    runs: list[RunInfo] = []
    for run_path, rds in by_run.items():
        fs = rds[0].fs
        run_json = None
        if fs.get_file_info(f"{run_path}/{RUN_MANIFEST_NAME}").type == pafs.FileType.File:
            run_json = _read_json(fs, f"{run_path}/{RUN_MANIFEST_NAME}", "run file")
        ranks: dict[str, RankManifest] = {}
        for rd in rds:
            if rd.manifest_path is None:
                raise MoetraceError(
                    f"{rd.display} has no {MANIFEST_NAME}: the tracer never started there or the folder is incomplete"
                )
            m = _read_json(fs, rd.manifest_path, "manifest")
            ver = m.get("schema_version")
            if ver != MANIFEST_SCHEMA_VERSION:
                raise MoetraceError(
                    f"manifest {rd.manifest_path} has schema_version {ver!r}; this moetrace reads version {MANIFEST_SCHEMA_VERSION}"
                )
            if m.get("fp_version") != FP_VERSION:
                raise MoetraceError(
                    f"manifest {rd.manifest_path} has fingerprint version {m.get('fp_version')!r}; this moetrace "
                    f"computes version {FP_VERSION}: capture the trace again with this moetrace"
                )
            said = m.get("rank_label", str(m.get("tp_rank")))
            if said != rd.label:
                raise MoetraceError(f"manifest {rd.manifest_path} says rank {said} but sits in rank={rd.label}")
            ranks[rd.label] = RankManifest(label=rd.label, path=rd.path, manifest=m, parts=rd.parts)

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
        moe_tp = one("moe_tp_size")
        manifests = {label: rk.manifest for label, rk in ranks.items()}
        expected = expected_labels(manifests, tp_size)
        if run_json is not None and isinstance(run_json.get("ranks"), list):
            rl = []
            for x in run_json["ranks"]:
                if isinstance(x, dict):
                    x = x.get("rank_label", x.get("tp_rank", x.get("rank")))
                if x is not None:
                    rl.append(str(x))
            if rl:
                expected = sorted(set(rl) | set(expected), key=label_key)
        runs.append(
            RunInfo(run_id=run_id, path=run_path, checkpoint_id=ckpt, tp_size=tp_size, ep_size=ep_size,
                    expected_ranks=expected, ranks=ranks, run_json=run_json, pp_size=int(one("pp_size", 1) or 1),
                    moe_tp_size=None if moe_tp is None else int(moe_tp), refusals=read_refusals(fs, run_path))
        )
    ids = [r.run_id for r in runs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise MoetraceError(f"run id(s) {sorted(dup)} appear in several folders; analyze them separately")
    return runs

