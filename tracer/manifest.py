"""Per-rank and per-run manifests, and the one rule that says whether a trace is whole.

``OUT/<run_id>/rank=<r>/_manifest.json`` is owned by that rank's writer and
rewritten atomically after every part and at close; ``finished`` turns true
only on a clean close, so a killed rank leaves ``finished: false`` and an
audit can refuse the trace. ``OUT/<run_id>/_run.json`` is written by
``moetrace launch``. ``rank_problems`` / ``run_problems`` are the completeness
rule the launcher and the analysis both apply. docs/capture.md lists every field.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
from importlib import metadata

from moetrace import __version__, storage
from moetrace.fingerprint import CHUNK_BYTES, FP_VERSION
from moetrace.schema import MANIFEST_SCHEMA_VERSION, TRACE_SCHEMA_VERSION, parse_rank_label, rank_label
from moetrace.tracer.manifest_fields import (  # noqa: F401 (the side files' schema, read through here)
    RANK_MANIFEST_FIELDS,
    RUN_MANIFEST_FIELDS,
    check_rank_manifest,
    check_run_manifest,
)

MANIFEST_NAME = "_manifest.json"
LAYOUT_SCHEMA_VERSION = 1  # the facts record under "layouts" (hooks.layout)
RUN_MANIFEST_NAME = "_run.json"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def package_version(name: str) -> str | None:
    """Installed distribution version, without importing the package."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import numpy
    import pyarrow
    import torch

    return {
        "moetrace": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "sglang": package_version("sglang"),
        "kt_kernel": package_version("kt-kernel") or package_version("kt_kernel"),
    }


def rank_dir_name(tp_rank: int, pp_rank: int = 0, pp_size: int = 1, replica: int | None = None) -> str:
    return f"rank={rank_label(tp_rank, pp_rank, pp_size, replica)}"


def new_rank_manifest(run_id: str, tp_rank: int, tp_size: int, config: dict, checkpoint_id: str | None,
                      rank_source: str, *, pp_rank: int = 0, pp_size: int = 1, replica: int | None = None,
                      rank_sources: dict | None = None) -> dict:
    """The manifest a rank writes when its sink opens (finished: false)."""
    return {
        "kind": "rank",
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "trace_schema_version": TRACE_SCHEMA_VERSION,
        "fp_version": FP_VERSION,
        "chunk_bytes": CHUNK_BYTES,
        "run_id": run_id,
        "run_nonce": config.get("run_nonce"),  # the launch this trace belongs to (hook config)
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
        "checkpoint_id": checkpoint_id,
        "tp_size": int(tp_size),
        "tp_rank": int(tp_rank),
        "rank_source": rank_source,
        "pp_size": int(pp_size),
        "pp_rank": int(pp_rank),
        "replica": None if replica is None else int(replica),
        "rank_label": rank_label(tp_rank, pp_rank, pp_size, replica),
        "rank_sources": dict(rank_sources or {}),
        # Per model the hooks serve ("target", "draft"): how it was identified, its hooked
        # MoE layers, where its steps come from, and how its slots were mapped.
        "models": {},
        # Filled from the first captured module (null until then).
        "ep_size": None,
        "ep_rank": None,
        "moe_tp_size": None,
        "moe_tp_rank": None,
        "config": config,
        "started_at": utc_now(),
        "updated_at": None,
        "finished_at": None,
        "finished": False,
        "close_reason": None,
        "disabled": False,
        "disabled_reason": None,
        "steps_seen": 0,
        "captures": 0,
        "resident_reused": 0,  # resident captures served from the unchanged-weights cache
        "rows_captured": 0,
        "rows_written": 0,
        "rows_dropped": 0,
        "drops": {},
        "rows_after_close": 0,
        "hook_errors": 0,
        "sink_errors": 0,
        "errors": [],
        "notes": [],
        "online": {"match": 0, "mismatch": 0, "unchecked": 0},
        "dumps": {"count": 0, "bytes": 0, "skipped": 0, "files": []},
        "guard": None,  # the in-server guard's record (tracer.guard), null when it is off
        "parts": [],
        # Layout facts per captured layer, "<source>:<model>:<layer>" -> hooks.layout facts
        "layout_schema": LAYOUT_SCHEMA_VERSION,
        "layouts": {},
    }


def new_run_manifest(run_id: str, out: str, **fields) -> dict:
    """The run manifest ``moetrace launch`` writes before the server starts (finished:
    false); ``fields`` fill in the launch facts (command, versions, expected ranks...)."""
    doc = {
        "kind": "run",
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "run_id": run_id,
        "run_nonce": None,  # this launch's identity, the same in every rank manifest of the run
        "replaced": False,  # --replace cleared an existing run folder first
        "out": out,
        "host": socket.gethostname(),
        "launcher_pid": os.getpid(),
        "moetrace": __version__,
        "sglang_version": None,
        "sglang_version_source": None,
        "server_distribution": None,  # {"name": "sglang" | "sglang-kt", "version"} providing `sglang`
        "cuda_graph_flags": [],
        "cuda_graph_flags_source": None,  # option | distribution | help | default | kept
        "user_command": [],
        "command": [],
        "hook_spec": [],
        "expected_ranks": None,
        "tp_size": None,
        "ep_size": None,
        "checkpoint_id": None,
        "started_at": utc_now(),
        "finished_at": None,
        "finished": False,
        "server_pid": None,
        "server_exit_code": None,
        "stop_signal": None,
        "stop_reason": None,
        "stop": None,  # how the server's process group was stopped (hooks.launch)
        "ranks_closed_before_stop": None,
        "port_check": None,  # audit --launch: the port was free, the server answering was ours
        "ranks": [],
        "complete": False,
        "problems": [],
    }
    unknown = set(fields) - set(doc)
    if unknown:
        raise KeyError(f"not run manifest fields: {sorted(unknown)}")
    doc.update(fields)
    return doc


# ---------------------------------------------------------------- completeness


def _count(m: dict, key: str) -> int:
    v = m.get(key) or 0
    return len(v) if isinstance(v, list) else int(v)


def rank_problems(m: dict) -> list[str]:
    """Why one rank's manifest does not describe a whole trace, one phrase each
    ("did not finish its trace ..."); empty when it does. A rank that wrote 0 rows
    is a problem even when its sampling legitimately kept nothing: an audit of it
    would check nothing."""
    problems = []
    if m.get("disabled"):
        problems.append(f"disabled tracing ({m.get('disabled_reason') or 'no reason recorded'})")
    elif not m.get("finished"):
        problems.append("did not finish its trace (finished: false)")
    dropped = _count(m, "rows_dropped")
    if dropped:
        drops = m.get("drops") or {}
        why = ", ".join(f"{k}: {v:,}" for k, v in sorted(drops.items()) if v) or "reason not recorded"
        problems.append(f"dropped {dropped:,} rows ({why})")
    for key, word in (("hook_errors", "hook"), ("sink_errors", "sink")):
        n = _count(m, key)
        if n:
            problems.append(f"had {n:,} {word} errors")
    guard = m.get("guard") if isinstance(m.get("guard"), dict) else None
    problems += guard_problems(guard)
    if not _count(m, "rows_written") and not (guard and guard.get("rows") == "mismatch" and _guard_checked(guard)):
        problems.append("wrote 0 rows (nothing captured: check the sampling filters and that traffic reached the server)")
    listed = sum(int(p.get("rows") or 0) for p in m.get("parts") or [] if isinstance(p, dict))
    if "parts" in m and listed != _count(m, "rows_written"):
        problems.append(f"lists parts of {listed:,} rows but says it wrote {_count(m, 'rows_written'):,}")
    return problems


def _guard_checked(guard: dict) -> int:
    t = guard.get("tensors") or {}
    return int(t.get("match") or 0) + int(t.get("mismatch") or 0)


def guard_problems(guard: dict | None) -> list[str]:
    """A guard that could not verify, or verified nothing, does not vouch for the run
    (its trace holds rows for mismatches only, so 0 rows there is not a problem by itself)."""
    if not guard:
        return []
    if guard.get("status") == "unverified":
        return [f"guard could not verify ({guard.get('status_reason') or 'no reason recorded'})"]
    if not _guard_checked(guard):
        return ["guard verified nothing (no staged load or resident weights reached it)"]
    return []


def run_file_problems(run: dict | None) -> list[str]:
    """What a run's ``_run.json`` itself says is wrong (none when there is no _run.json):
    a launcher that never finished (killed, or still running), or one that found the
    run incomplete."""
    if run is None:
        return []
    if not run.get("finished"):
        return ["_run.json says the launcher did not finish (finished: false: it was killed, or is still running)"]
    problems = []
    server = server_problem(run.get("server_exit_code"), bool(run.get("stop_reason")))
    if server:
        problems.append(f"{server} (_run.json)")
    if run.get("complete") is not True:
        why = "; ".join(str(p) for p in run.get("problems") or []) or "no reason recorded"
        problems.append(f"_run.json says the run is incomplete ({why})")
    return problems


def foreign_ranks(manifests: dict[str, dict], nonce: str | None) -> list[str]:
    """Rank labels whose manifest belongs to another launch than `nonce` (a reused run id)."""
    return sorted((r for r, m in manifests.items() if m.get("run_nonce") != nonce), key=label_key)


def server_problem(exit_code: int | None, stop_requested: bool) -> str | None:
    """A server that exited non-zero when nobody asked it to stop crashed or never
    started: its trace is not the run that was asked for."""
    if exit_code is None or exit_code == 0 or stop_requested:
        return None
    how = f"signal {-exit_code}" if exit_code < 0 else f"code {exit_code}"
    return f"the server exited on its own with {how} (start-up failure or crash; see its log)"


def run_problems(manifests: dict[str, dict], expected_ranks: int | None, *, server_started: bool = True,
                 server_exit_code: int | None = None, stop_requested: bool = False,
                 nonce: str | None = None, refusals: list[dict] = ()) -> list[str]:
    """Why a run is not a whole trace, one sentence per reason (empty: whole).
    ``manifests``: {rank label: manifest} (read_manifests). ``expected_ranks``: the TP
    rank count the server was started with (None: the tp_size the manifests agree on);
    every pipeline stage and replica the manifests name must have all of them.
    ``nonce``: the launch's run_nonce, which every manifest must carry (one from an
    earlier launch under the same run id is not this run's). ``refusals``: tracer.claim
    records of processes refused a folder."""
    problems: list[str] = []
    if not server_started:
        problems.append("the server did not start")
    foreign = foreign_ranks(manifests, nonce) if nonce is not None else []
    if foreign:
        problems.append(f"manifests of rank {_ids(foreign)} are from another launch (a different run_nonce: "
                        "a reused run id)")
        manifests = {r: m for r, m in manifests.items() if r not in foreign}
    server = server_problem(server_exit_code, stop_requested)
    if server:
        problems.append(server)
    problems += [refusal_problem(r) for r in refusals]
    if not manifests:
        problems.append("no rank wrote a manifest (the hooks never started: check the server log for 'moetrace')")
        return problems
    want = expected_labels(manifests, expected_ranks)
    if want is not None:
        missing = [r for r in want if r not in manifests]
        extra = [r for r in manifests if r not in want]
        if missing:
            problems.append(f"{len(want) - len(missing)}/{len(want)} ranks reported (no manifest from rank {_ids(missing)})")
        if extra:
            problems.append(f"manifests from unexpected rank {_ids(extra)} (expected ranks {_ids(want)})")
    for r, m in manifests.items():
        problems += [f"rank {r} {p}" for p in rank_problems(m)]
    return problems


REFUSED_PREFIX = "_refused-"  # OUT/<run_id>/_refused-<host>-<pid>.json (tracer.claim writes them)


def read_refusals(fs, run_dir: str) -> list[dict]:
    """The refusal records of a run folder (each: the refused process and who owns its folder)."""
    out = []
    for info in storage.list_dir(fs, run_dir):
        if info.base_name.startswith(REFUSED_PREFIX) and info.base_name.endswith(".json"):
            try:
                doc = storage.read_json(fs, info.path)
            except Exception:
                doc = {}
            out.append(doc if isinstance(doc, dict) else {})
    return out


def another_launch(owner: dict, me: dict) -> bool:
    """A folder claim (tracer.claim) `owner` belongs to another launch than `me` (both say their run_nonce)."""
    return bool(owner.get("run_nonce") and me.get("run_nonce") and owner["run_nonce"] != me["run_nonce"])


def refusal_problem(doc: dict) -> str:
    """One phrase for a refusal record: a process with another's identity traced nothing."""
    owner = doc.get("claimed_by") or {}
    why = "a process of an earlier launch under the same run id" if another_launch(owner, doc) else \
        "two processes with one identity"
    return (f"process pid {doc.get('pid', '?')} on {doc.get('host', '?')} was refused: rank {doc.get('rank_label', '?')} "
            f"already belonged to pid {owner.get('pid', '?')} on {owner.get('host', '?')} ({why}; that process traced "
            "nothing)")


def common_value(manifests: dict[str, dict], key: str):
    """The value of `key` every manifest that has it agrees on, else None."""
    vals = {m.get(key) for m in manifests.values()} - {None}
    return next(iter(vals)) if len(vals) == 1 else None


def expected_rank_count(manifests: dict[str, dict], expected_ranks: int | None) -> int | None:
    """The TP rank count to expect: the server command's --tp, else the tp_size the
    manifests agree on, else unknown."""
    if expected_ranks is not None:
        return expected_ranks
    tp = common_value(manifests, "tp_size")
    return tp if isinstance(tp, int) and tp > 0 else None


def expected_labels(manifests: dict[str, dict], expected_ranks: int | None) -> list[str] | None:
    """Every rank label the run must have: each TP rank of each pipeline stage of each
    replica the manifests name (None when the TP size is unknown)."""
    n = expected_rank_count(manifests, expected_ranks)
    if n is None:
        return None
    pp = common_value(manifests, "pp_size")
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    replicas = sorted({m.get("replica") for m in manifests.values()}, key=lambda r: -1 if r is None else r) or [None]
    return [rank_label(t, p, pp, r) for r in replicas for p in range(pp) for t in range(n)]


def label_key(label: str) -> tuple[int, int, int]:
    """A rank label's sort key: (replica, pp_rank, tp_rank), absent parts 0."""
    parsed = parse_rank_label(str(label))
    if parsed is None:
        return (1 << 30, 0, 0)
    replica, pp, tp = parsed
    return (replica or 0, pp or 0, tp)


def _ids(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def read_manifests(out: str, run_id: str) -> dict[str, dict]:
    """{rank label: manifest} of every rank folder of a run that has one, in rank order."""
    fs, base = storage.open_fs(out)
    run_dir = storage.join(base, run_id)
    found: dict[str, dict] = {}
    for info in storage.list_dir(fs, run_dir):
        label = info.base_name[5:] if info.base_name.startswith("rank=") else None
        if label is None or parse_rank_label(label) is None:
            continue
        path = storage.join(info.path, MANIFEST_NAME)
        if storage.exists(fs, path):
            try:
                found[label] = storage.read_json(fs, path)
            except (ValueError, OSError):
                continue
    return dict(sorted(found.items(), key=lambda kv: label_key(kv[0])))
