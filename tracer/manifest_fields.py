"""The declared fields of the side files beside a trace (``_manifest.json``, ``_run.json``)
and the strict check every reader applies before trusting one.

One table per file: key -> the JSON types it may hold. Every declared key must be
present with one of its types (``count``: an integer >= 0, never a bool); keys not
declared are ignored, so a helper adding a key adds one row here (docs/capture.md
lists them). A side file that fails the check is refused by name, never half-trusted.
"""

from __future__ import annotations

import re

from moetrace.errors import MoetraceError

# type name -> predicate on the parsed JSON value
_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}

RANK_MANIFEST_FIELDS: dict[str, str] = {
    "kind": "str",
    "schema_version": "int",
    "trace_schema_version": "int",
    "fp_version": "int",
    "chunk_bytes": "count",
    "run_id": "str",
    "run_nonce": "str|null",
    "host": "str",
    "pid": "int",
    "versions": "dict",
    "checkpoint_id": "str|null",
    "tp_size": "count",
    "tp_rank": "count",
    "rank_source": "str",
    "pp_size": "count",
    "pp_rank": "count",
    "replica": "count|null",  # data-parallel replica id; null when the server has one replica
    "rank_label": "str",  # the folder's name after rank= (schema.rank_label)
    "rank_sources": "dict",  # {"tp"|"pp"|"replica": how it was found}
    "models": "dict",  # {"target"|"draft": {architecture, detected_by, layers, step_source, slot_maps}}
    "ep_size": "count|null",
    "ep_rank": "count|null",
    "moe_tp_size": "count|null",
    "moe_tp_rank": "count|null",
    "config": "dict",
    "started_at": "str",
    "updated_at": "str|null",
    "finished_at": "str|null",
    "finished": "bool",
    "close_reason": "str|null",
    "disabled": "bool",
    "disabled_reason": "str|null",
    "steps_seen": "count",
    "captures": "count",
    "rows_captured": "count",
    "rows_written": "count",
    "rows_dropped": "count",
    "drops": "dict",
    "rows_after_close": "count",
    "resident_reused": "count",
    "layout_schema": "count",
    "layouts": "dict",
    "hook_errors": "count",
    "sink_errors": "count",
    "errors": "list",
    "notes": "list",
    "online": "dict",
    "dumps": "dict",
    "guard": "dict|null",  # the in-server guard's record (tracer.guard), null when it is off
    "parts": "list",
}

# one entry of a rank manifest's "parts"
PART_FIELDS: dict[str, str] = {"file": "str", "rows": "count", "written_at": "str"}
PART_FILE = re.compile(r"^part-\d+\.parquet$")

RUN_MANIFEST_FIELDS: dict[str, str] = {
    "kind": "str",
    "schema_version": "int",
    "run_id": "str",
    "run_nonce": "str|null",
    "replaced": "bool",
    "out": "str",
    "host": "str",
    "launcher_pid": "int",
    "moetrace": "str",
    "sglang_version": "str|null",
    "sglang_version_source": "str|null",
    "server_distribution": "dict|null",  # {"name": "sglang" | "sglang-kt", "version"} providing `sglang`
    "cuda_graph_flags": "list",
    "cuda_graph_flags_source": "str|null",  # option | distribution | help | default | kept
    "user_command": "list",
    "command": "list",
    "hook_spec": "list",
    "expected_ranks": "count|null",
    "tp_size": "count|null",
    "ep_size": "count|null",
    "checkpoint_id": "str|null",
    "started_at": "str",
    "finished_at": "str|null",
    "finished": "bool",
    "server_pid": "int|null",
    "server_exit_code": "int|null",
    "stop_signal": "str|null",
    "stop_reason": "str|null",
    "stop": "dict|null",
    "ranks_closed_before_stop": "bool|null",
    "port_check": "dict|null",
    "ranks": "list",
    "complete": "bool",
    "problems": "list",
}

# one entry of a run manifest's "ranks" (the launcher's per-rank summary)
RUN_RANK_FIELDS: dict[str, str] = {"rank_label": "str", "tp_rank": "count", "pp_rank": "count",
                                   "replica": "count|null", "present": "bool"}


def _type_name(v) -> str:
    if v is None:
        return "null"
    return {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def check_fields(doc, fields: dict[str, str], where: str) -> dict:
    """`doc` if it is an object holding every declared key with an allowed type; else a
    one-line MoetraceError naming `where`, the key, what it holds and what was expected."""
    if not isinstance(doc, dict):
        raise MoetraceError(f"{where}: is {_type_name(doc)}, expected a JSON object")
    for key, spec in fields.items():
        if key not in doc:
            raise MoetraceError(f"{where}: lacks the key {key!r} ({spec})")
        v = doc[key]
        if not any(_TYPES[t](v) for t in spec.split("|")):
            raise MoetraceError(f"{where}: {key!r} is {_type_name(v)} ({v!r:.60}), expected {spec.replace('|', ' or ')}")
    return doc


def check_rank_manifest(doc, path: str) -> dict:
    """A rank's ``_manifest.json``, checked against RANK_MANIFEST_FIELDS and its parts list."""
    check_fields(doc, RANK_MANIFEST_FIELDS, f"manifest {path}")
    if doc["kind"] != "rank":
        raise MoetraceError(f"manifest {path}: kind is {doc['kind']!r}, expected 'rank'")
    if doc["tp_size"] < 1 or doc["tp_rank"] >= doc["tp_size"]:
        raise MoetraceError(f"manifest {path}: tp_rank {doc['tp_rank']} is not below tp_size {doc['tp_size']}")
    if doc["pp_size"] < 1 or doc["pp_rank"] >= doc["pp_size"]:
        raise MoetraceError(f"manifest {path}: pp_rank {doc['pp_rank']} is not below pp_size {doc['pp_size']}")
    seen = set()
    for i, part in enumerate(doc["parts"]):
        check_fields(part, PART_FIELDS, f"manifest {path}: parts[{i}]")
        if not PART_FILE.match(part["file"]) or part["file"] in seen:
            raise MoetraceError(f"manifest {path}: parts[{i}] file {part['file']!r} is not a new part-NNNNN.parquet name")
        seen.add(part["file"])
    return doc


def check_run_manifest(doc, path: str) -> dict:
    """A run's ``_run.json``, checked against RUN_MANIFEST_FIELDS and its ranks list."""
    check_fields(doc, RUN_MANIFEST_FIELDS, f"run file {path}")
    if doc["kind"] != "run":
        raise MoetraceError(f"run file {path}: kind is {doc['kind']!r}, expected 'run'")
    for i, entry in enumerate(doc["ranks"]):
        check_fields(entry, RUN_RANK_FIELDS, f"run file {path}: ranks[{i}]")
    return doc
