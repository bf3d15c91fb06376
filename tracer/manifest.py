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
from dataclasses import dataclass, field
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
        "stop": None,  # how the server's process group was stopped (servers.launcher)
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
    problems += identity_problems(m)
    guard = m.get("guard") if isinstance(m.get("guard"), dict) else None
    problems += guard_problems(guard)
    if not _count(m, "rows_written") and not (guard and guard.get("rows") == "mismatch" and _guard_checked(guard)):
        problems.append("wrote 0 rows (nothing captured: check the sampling filters and that traffic reached the server)")
    listed = sum(int(p.get("rows") or 0) for p in m.get("parts") or [] if isinstance(p, dict))
    if "parts" in m and listed != _count(m, "rows_written"):
        problems.append(f"lists parts of {listed:,} rows but says it wrote {_count(m, 'rows_written'):,}")
    return problems


def identity_problems(m: dict) -> list[str]:
    """A manifest's identity fields must agree: its rank label names its tp_rank, pp_rank and
    replica, and the MoE coordinates its first module reported follow from tp_rank as SGLang
    derives them (parallel_state: TP ranks are moe_dp_idx * ep * moe_tp + ep_idx * moe_tp +
    moe_tp_idx; checkpoints.shards.rank_coords). A folder copied from another rank and
    relabelled, or a module reporting another rank's shard, fails here."""
    problems = []
    if isinstance(m.get("rank_label"), str) and isinstance(m.get("tp_rank"), int):
        want = rank_label(m["tp_rank"], m.get("pp_rank") or 0, m.get("pp_size") or 1, m.get("replica"))
        if want != m["rank_label"]:
            problems.append(f"manifest says rank_label {m['rank_label']} but tp_rank {m['tp_rank']}, "
                            f"pp_rank {m.get('pp_rank') or 0}, replica {m.get('replica')} (rank {want})")
    tp, moe_tp, ep = m.get("tp_rank"), m.get("moe_tp_size"), m.get("ep_size") or 1
    if isinstance(tp, int) and isinstance(moe_tp, int) and moe_tp > 0:
        for key, want in (("moe_tp_rank", tp % moe_tp), ("ep_rank", (tp // moe_tp) % ep)):
            got = m.get(key)
            if got is not None and got != want:
                problems.append(f"manifest says {key} {got}, but tp_rank {tp} of moe_tp_size {moe_tp}, ep_size {ep} "
                                f"holds {key} {want} (another rank's shard)")
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
    if guard.get("rows") != "mismatch":
        return []
    # Rows of mismatches only: what the guard verified is the coverage; nothing else checks the rest.
    problems = []
    unverified = int((guard.get("tensors") or {}).get("unverified") or 0)
    if unverified:
        problems.append(f"guard left {unverified:,} tensors unverified (its trace holds rows of mismatches only, "
                        "so nothing checked them)")
    for source, share in sorted((guard.get("coverage") or {}).items()):
        if isinstance(share, (int, float)) and share < 1:
            problems.append(f"guard verified {share:.1%} of the expected {source} tensors in its last pass "
                            "(its trace holds rows of mismatches only)")
    return problems


def guard_vouches(m: dict) -> bool:
    """A rank whose guard kept rows of mismatches only: its matching tensors are the
    guard's verdicts (counted in the manifest), not rows."""
    guard = m.get("guard")
    return isinstance(guard, dict) and guard.get("rows") == "mismatch"


# ---------------------------------------------------------------- the rows against their manifest


@dataclass
class RowFacts:
    """What one rank's rows say, for ``rows_problems`` to hold against its manifest (the
    analysis reads them from the rows it joined with the index)."""

    rows: int = 0
    tp_ranks: set = field(default_factory=set)  # the rows' tp_rank values
    moe_tp_ranks: set = field(default_factory=set)  # the rows' moe_tp_rank values (the shard)
    online: dict = field(default_factory=dict)  # "match" | "mismatch" | "unchecked" -> rows
    captures: int = 0  # distinct capture batches: (model, step, source, capture_seq, layer, tensor)
    steps: set = field(default_factory=set)  # steps of the target model's rows
    resident_steps: set = field(default_factory=set)  # steps of the target model's resident rows
    slot_counts: dict = field(default_factory=dict)  # layout key "<source>:<model>:<layer>" -> slot_count values
    layers: dict = field(default_factory=dict)  # model -> layers with rows
    experts: set = field(default_factory=set)  # logical experts the rows name
    tensors: set = field(default_factory=set)  # tensor names of the rows
    sources: set = field(default_factory=set)  # sources of the rows
    slot_conflicts: list = field(default_factory=list)  # phrases: a slot naming two experts within one load
    contradicted: dict = field(default_factory=dict)  # online verdict -> rows the index judges otherwise


def layout_key(source: str, model: str, layer: int) -> str:
    """The key of a layer's layout facts in a rank manifest (tracer.capture.record_layout)."""
    return f"{source}:{model}:{int(layer)}"


def _layouts(m: dict) -> dict[str, dict]:
    """The manifest's layout facts by layout_key (a key written without the model is the target's)."""
    out = {}
    for key, facts in (m.get("layouts") or {}).items():
        parts = str(key).split(":")
        if len(parts) == 2:
            parts = [parts[0], "target", parts[1]]
        if len(parts) == 3 and parts[2].lstrip("-").isdigit() and isinstance(facts, dict):
            out[layout_key(parts[0], parts[1], int(parts[2]))] = facts
    return out


def layout_slots(facts: dict) -> int | None:
    """Slots a layer's captures must report: the physical slots its expert params hold (else
    num_local_experts) less those the loader never fills (``unfilled_slots``, hooks.fused_moe)."""
    physical = None
    for p in (facts.get("params") or {}).values():
        shape = p.get("shape") if isinstance(p, dict) else None
        if isinstance(shape, list) and shape and isinstance(shape[0], int):
            physical = shape[0]
            break
    if physical is None and isinstance(facts.get("num_local_experts"), int):
        physical = facts["num_local_experts"]
    return None if physical is None else physical - int(facts.get("unfilled_slots") or 0)


def _where(key: str) -> str:
    source, model, layer = key.split(":")
    return f"{'' if model == 'target' else model + ' '}layer {layer} ({source})"


def rows_problems(m: dict, f: RowFacts) -> list[str]:
    """Where a rank's rows contradict what its manifest says it captured, one phrase each
    (empty: they agree). Everything the manifest claims must be in the rows: the rank that
    wrote them, the verdicts online verification and the guard recorded, every capture and
    every step it counted, every layer and every slot of the layouts it recorded; and the
    rows must claim nothing the manifest does not."""
    problems = []
    for key, seen in (("tp_rank", f.tp_ranks), ("moe_tp_rank", f.moe_tp_ranks)):
        want = m.get(key)
        if want is None and key == "moe_tp_rank" and isinstance(m.get("tp_rank"), int):
            # not reported by a module (a sink fed directly): the shard a TP rank holds without EP
            want = m["tp_rank"] % max(1, int(m.get("moe_tp_size") or (m.get("tp_size") or 1) // (m.get("ep_size") or 1)))
        other = sorted(v for v in seen if v != want)
        if other:
            problems.append(f"holds rows of {key} {_ids(other)} but its process was {key} {want} (rows bound to "
                            "another rank)")
    vouched = guard_vouches(m)
    # Counters are comparable with the rows only in a closed trace that lost nothing (an
    # unfinished manifest is a snapshot that may count rows not yet in a part: already a problem).
    closed = bool(m.get("finished")) and not m.get("disabled")
    whole = closed and not _count(m, "rows_dropped") and not _count(m, "rows_after_close")
    online = m.get("online") if isinstance(m.get("online"), dict) else {}
    if whole:
        for key in ("match", "mismatch", "unchecked"):
            said, held = int(online.get(key) or 0), int(f.online.get(key) or 0)
            if said != held:
                problems.append(f"manifest counts {said:,} online '{key}' verdicts but its rows hold {held:,}")
        if _count(m, "captures") != f.captures:
            problems.append(f"manifest counts {_count(m, 'captures'):,} captures but its rows hold {f.captures:,}")
    guard = m.get("guard") if isinstance(m.get("guard"), dict) else None
    if guard and guard.get("status") != "unverified" and closed:
        t = guard.get("tensors") or {}
        said, held = int(t.get("mismatch") or 0), int(f.online.get("mismatch") or 0)
        if (held != said) if (vouched and whole) else (held < said - _count(m, "rows_after_close")):
            problems.append(f"guard counts {said:,} mismatching tensors (status {guard.get('status')}) but the rows "
                            f"hold {held:,}")
        if vouched and f.rows != held:
            problems.append(f"guard kept rows of mismatches only, but {f.rows - held:,} rows are not mismatches")
    for verdict, n in sorted(f.contradicted.items()):
        other = "diverge from" if verdict == "match" else "match"
        problems.append(f"{n:,} rows verified online as '{verdict}' {other} the index (the server's verdicts "
                        "disagree with this index's)")
    problems += f.slot_conflicts
    models = m.get("models") if isinstance(m.get("models"), dict) else {}
    # Steps counted from the hooks' own calls (layer-order) are passes the hooks saw, each with its
    # resident captures; a server's pass counter also counts CUDA-graph replays no hook sees.
    counted = (models.get("target") or {}).get("step_source") == "layer-order" if isinstance(models.get("target"),
                                                                                               dict) else False
    from moetrace.tracer.sampling import Sampling

    try:
        s = Sampling.from_config(m.get("config") or {})
    except Exception:  # a config the tracer would have refused: nothing is sampled out
        s = Sampling()
    target_layers = f.layers.get("target", set())
    for what, held, kept in (("expert", f.experts, s.experts), ("target layer", target_layers, s.layers),
                             ("tensor", f.tensors, s.tensors), ("source", f.sources, s.sources)):
        extra = sorted(held - set(kept)) if kept is not None else []
        if extra:
            problems.append(f"holds rows of {what}(s) {_ids(_short(extra))} that its sampling (config) excluded")
    if f.resident_steps and not vouched and counted and whole:
        origin = min(f.steps)
        want = {origin + k for k in range(_count(m, "steps_seen")) if s.want("resident", k, -1 if s.layers is None
                                                                               else min(s.layers))}
        gone = sorted(want - f.resident_steps)
        if gone:
            problems.append(f"manifest counts {_count(m, 'steps_seen'):,} steps (steps_seen) but no row holds step(s) "
                            f"{_ids(_short(gone))}")
    for model, layers in sorted(f.layers.items()):
        listed = (models.get(model) or {}).get("layers") if isinstance(models.get(model), dict) else None
        if listed:
            extra = sorted(set(layers) - set(listed))
            if extra:
                problems.append(f"holds rows of {model} layer(s) {_ids(_short(extra))}, which its manifest's model does "
                                f"not have (layers {_ids(_short(sorted(listed)))})")
    layouts = _layouts(m)
    if layouts:
        cfg = m.get("config") or {}
        sampled = cfg.get("experts") is not None or cfg.get("tensors") is not None  # may keep nothing of a layer
        for key in sorted(set(f.slot_counts) - set(layouts)):
            problems.append(f"holds rows of {_where(key)} but records no layout for it")
        if whole and not vouched and not sampled:
            for key in sorted(set(layouts) - set(f.slot_counts)):
                problems.append(f"records the layout of {_where(key)} but holds no row of it")
    for key, counts in sorted(f.slot_counts.items()):
        facts = layouts.get(key)
        want = layout_slots(facts) if facts is not None else None
        if want is None:
            continue
        # facts that changed during the run hold the last capture's unfilled slots: then only the physical bound
        most = want + int(facts.get("unfilled_slots") or 0)
        wrong = sorted(c for c in counts if (c > most if facts.get("changed") else c != want))
        if wrong:
            problems.append(f"loads of {_where(key)} report {_ids(wrong)} slots but its recorded layout holds {want}")
    return problems


def _short(ids: list, n: int = 8) -> list:
    return ids if len(ids) <= n else ids[:n] + [f"… ({len(ids) - n} more)"]


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
