"""Per-rank and per-run manifests: JSON beside the Parquet parts.

``OUT/<run_id>/rank=<r>/_manifest.json`` is owned by that rank's writer and
rewritten atomically after every part and at close; ``finished`` turns true
only on a clean close, so a killed rank leaves ``finished: false`` and an
audit can refuse the trace. ``OUT/<run_id>/_run.json`` is written by
``moetrace launch``. docs/capture.md lists every field.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
from importlib import metadata

from moetrace import __version__
from moetrace.tracer.fingerprint import CHUNK_BYTES, FP_VERSION
from moetrace.tracer.schema import MANIFEST_SCHEMA_VERSION, TRACE_SCHEMA_VERSION

MANIFEST_NAME = "_manifest.json"
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


def rank_dir_name(tp_rank: int) -> str:
    return f"rank={int(tp_rank)}"


def new_rank_manifest(run_id: str, tp_rank: int, tp_size: int, config: dict, checkpoint_id: str | None,
                      rank_source: str) -> dict:
    """The manifest a rank writes when its sink opens (finished: false)."""
    return {
        "kind": "rank",
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "trace_schema_version": TRACE_SCHEMA_VERSION,
        "fp_version": FP_VERSION,
        "chunk_bytes": CHUNK_BYTES,
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
        "checkpoint_id": checkpoint_id,
        "tp_size": int(tp_size),
        "tp_rank": int(tp_rank),
        "rank_source": rank_source,
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
        "parts": [],
    }
