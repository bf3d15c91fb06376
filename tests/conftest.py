"""Shared fixtures: synthetic checkpoints, written once per session per argument set.

tests/ and bench/ go on sys.path (and on PYTHONPATH for the processes tests start)
so test modules import the shared scaffolding as ``support.*`` and the benchmark
data generator as ``synthetic_trace``; neither is part of the moetrace package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.join(os.path.dirname(HERE), "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """make_ckpt(**write_synthetic_checkpoint kwargs) -> Path, cached: do not modify it."""
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    cache = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "c", **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def small_model(make_ckpt):
    """support.traces.CheckpointModel of the SMALL_MOE checkpoint (2 layers, 4 experts) at
    TP2, for tests about input handling rather than shards."""
    from support.traces import SMALL_MOE, CheckpointModel

    return CheckpointModel(make_ckpt(**SMALL_MOE), tp_size=2)


@pytest.fixture(scope="session")
def small_index(small_model, tmp_path_factory) -> str:
    """The index of small_model (TP2), built once per session."""
    return small_model.write_index(str(tmp_path_factory.mktemp("small-index") / "index.parquet"))


@pytest.fixture
def ckpt_copy(make_ckpt, tmp_path):
    """ckpt_copy(**kwargs) -> Path of a private copy, free to corrupt."""

    def copy(**kw):
        return shutil.copytree(make_ckpt(**kw), tmp_path / "c")

    return copy


def once_per_session(tmp_path_factory, name: str, make) -> dict:
    """make(folder) -> JSON-able dict, run once for the whole test session even with
    pytest-xdist workers (they share the base temp folder's parent): the first caller
    runs it under a file lock, the others read its result."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # popen-gwN/: the parent is this session's, shared
        root = root.parent
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())


@dataclass
class DemoRun:
    returncode: int
    summary: dict | None  # the --json summary
    workdir: Path  # checkpoint/, index.parquet, traces/{unfenced,fenced}, reports/
    stderr: str
    shm_before: set


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """`moetrace demo --quick --json` once per session: the emulated unfenced/fenced pair
    on one injected schedule that the end-to-end and selftest tests read and re-analyze."""

    def run(work: Path) -> dict:
        before = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
        proc = subprocess.run([sys.executable, "-m", "moetrace.cli", "demo", "--quick", "--json", "--workdir", str(work)],
                              capture_output=True, text=True, timeout=600)
        summary = json.loads(proc.stdout) if proc.returncode in (0, 1) and proc.stdout.strip() else None
        return {"returncode": proc.returncode, "summary": summary, "workdir": str(work), "stderr": proc.stderr,
                "shm_before": before}

    d = once_per_session(tmp_path_factory, "demo", run)
    return DemoRun(d["returncode"], d["summary"], Path(d["workdir"]), d["stderr"], set(d["shm_before"]))


@pytest.fixture(scope="session")
def gpu_script_dry_run(tmp_path_factory) -> dict:
    """`bash bench/gpu_selftest.sh` with DRY_RUN=1 QUICK=1 once per session: the one-command GPU
    run on CPU; its selftest step is exactly what CI runs (`moetrace selftest --device cpu --quick --json`)."""
    script = Path(HERE).parent / "bench" / "gpu_selftest.sh"

    def run(out: Path) -> dict:
        env = dict(os.environ, DRY_RUN="1", QUICK="1", PYTHON=sys.executable)
        proc = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, timeout=900, env=env)
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "out": str(out)}

    return once_per_session(tmp_path_factory, "gpu-dry-run", run)
