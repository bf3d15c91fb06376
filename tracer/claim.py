"""One process per rank folder: an exclusive claim, and a loud refusal for the second.

Two server processes with the same identity (two data-parallel replicas whose
replica id went undetected, a restart reusing a run id) would overwrite each
other's parts and manifest. The first process to create ``rank=<label>/_claim.json``
(O_EXCL on local disks; check-then-write elsewhere, which object stores cannot do
better) owns the folder. Any other process is refused: it traces nothing and leaves
``OUT/<run_id>/_refused-<host>-<pid>.json`` so that the run reads as incomplete;
``read_refusals`` and ``refusal_problem`` are the readers' side of those records.
"""

from __future__ import annotations

import json
import os
import socket

import pyarrow.fs as pafs

from moetrace import storage
from moetrace.errors import MoetraceError

CLAIM_NAME = "_claim.json"
REFUSED_PREFIX = "_refused-"  # OUT/<run_id>/_refused-<host>-<pid>.json


def _local_path(fs: pafs.FileSystem, path: str) -> str | None:
    return path if isinstance(fs, pafs.LocalFileSystem) else None


def _create_exclusive(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Create `path` holding `data`; FileExistsError if it exists."""
    local = _local_path(fs, path)
    if local is not None:
        fd = os.open(local, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    if storage.exists(fs, path):
        raise FileExistsError(path)
    storage.write_atomic(fs, path, data)


def claim_rank_dir(fs: pafs.FileSystem, run_dir: str, rank_dir: str, label: str, run_id: str, started_at: str,
                   run_nonce: str | None = None) -> None:
    """Claim the rank folder for this process, or refuse (MoetraceError) after leaving a
    refusal record in the run folder. The same process may claim its folder again.
    ``run_nonce``: the launch's; an owner with another one is an earlier
    launch under the same run id, which `moetrace launch` itself refuses or --replace clears."""
    me = {"run_id": run_id, "run_nonce": run_nonce, "rank_label": label, "host": socket.gethostname(),
          "pid": os.getpid(), "started_at": started_at}
    path = storage.join(rank_dir, CLAIM_NAME)
    try:
        _create_exclusive(fs, path, (json.dumps(me, indent=2) + "\n").encode())
        return
    except FileExistsError:
        pass
    try:
        owner = storage.read_json(fs, path)
    except Exception:
        owner = {}
    if owner.get("host") == me["host"] and owner.get("pid") == me["pid"]:
        return
    refusal = {**me, "claimed_by": owner}
    try:
        storage.write_json(fs, storage.join(run_dir, f"{REFUSED_PREFIX}{me['host']}-{me['pid']}.json"), refusal)
    except Exception:
        pass  # the error below still says it
    whose = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} (since {owner.get('started_at', '?')})"
    if another_launch(owner, me):
        raise MoetraceError(
            f"trace folder {rank_dir} already belongs to {whose} of an earlier launch of run id {run_id!r} (another "
            f"run_nonce); this process (pid {me['pid']}) is not traced. A run id names one launch: use a new run id "
            "(or `moetrace launch --replace`)")
    raise MoetraceError(
        f"trace folder {rank_dir} already belongs to {whose}: two processes identify as rank {label}; this one "
        f"(pid {me['pid']}) is not traced. Data-parallel replicas need distinct replica ids (SGLANG_DP_RANK or hook "
        "config 'replica'), a restarted server a new run id"
    )


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
    """A folder claim `owner` belongs to another launch than `me` (both say their run_nonce)."""
    return bool(owner.get("run_nonce") and me.get("run_nonce") and owner["run_nonce"] != me["run_nonce"])


def refusal_problem(doc: dict) -> str:
    """One phrase for a refusal record: a process with another's identity traced nothing."""
    owner = doc.get("claimed_by") or {}
    why = "a process of an earlier launch under the same run id" if another_launch(owner, doc) else \
        "two processes with one identity"
    return (f"process pid {doc.get('pid', '?')} on {doc.get('host', '?')} was refused: rank "
            f"{doc.get('rank_label', '?')} already belonged to pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
            f"({why}; that process traced nothing)")
