"""Shared fixtures: synthetic checkpoints written once per session per argument set, and
the whole-session runs (the demo pair, the GPU script's dry run) that many tests read.

tests/ and bench/ go on sys.path (and on PYTHONPATH for the processes tests start)
so test modules import the shared scaffolding as ``support.*`` and the benchmark
data generator as ``synthetic_trace``; neither is part of the moetrace package.
Every process of the session computes with one torch thread and uses the session's
own index cache.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.join(os.path.dirname(HERE), "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)
# One torch thread per process: the suite runs two workers plus the rank processes they
# start on two cores, and OpenMP threads spinning for a busy core cost more than KB-sized
# tensors gain from them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton runs interpreted, and it reads TRITON_INTERPRET when first imported:
# set it before anything imports triton (transformers' config classes import torch._dynamo,
# which imports it), or test_fingerprint_triton's interpreted kernel fails in that worker.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _session_root(tmp_path_factory) -> Path:
    """The folder every worker of this session shares (pytest-xdist workers get popen-gwN/
    below it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session", autouse=True)
def index_cache(tmp_path_factory) -> Path:
    """MOETRACE_CACHE of this session, for the tests and every process they start: the
    suite never reads or fills the user's own index cache (~/.cache/moetrace)."""
    return _use_session_cache(_session_root(tmp_path_factory))


def _use_session_cache(root: Path) -> Path:
    path = root / "index-cache"
    os.environ["MOETRACE_CACHE"] = str(path)
    return path


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
    """make(folder) -> JSON-able dict, run in this process once for the whole session
    (support.session_jobs.once)."""
    from support import session_jobs

    return session_jobs.once(_session_root(tmp_path_factory), name, make)


@dataclass
class DemoRun:
    returncode: int
    summary: dict | None  # the --json summary
    workdir: Path  # checkpoint/, index.parquet, traces/{unfenced,fenced}, reports/
    stderr: str
    shm_before: set


# Fixtures backed by a background session job (support.session_jobs): started once
# collection shows a selected test uses one, and those tests run last.
JOB_FIXTURES = {"demo_run": "demo", "gpu_script_dry_run": "gpu-dry-run", "conform_runs": "conform", "vllm_runs": "vllm",
                "sglang_runs": "sglang"}


def _uses_job(item) -> bool:
    return any(f in JOB_FIXTURES for f in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_uses_job)  # stable: the rest keep their order, the waiting tests come last


def pytest_collection_finish(session):
    if not session.items or session.config.option.collectonly:  # the xdist controller collects nothing
        return
    from support import session_jobs

    root = _session_root(session.config._tmp_path_factory)
    _use_session_cache(root)  # before any job starts: they inherit it
    for fixture, job in JOB_FIXTURES.items():
        if any(fixture in getattr(i, "fixturenames", ()) for i in session.items):
            session_jobs.start(root, job)


def session_job(tmp_path_factory, name: str) -> dict:
    """A background session job's result (support.session_jobs), for fixtures defined
    beside their tests (test_conform.py's conform_runs)."""
    from support import session_jobs

    return session_jobs.result(_session_root(tmp_path_factory), name)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """`moetrace demo --quick --json` once per session: the emulated unfenced/fenced pair
    on one injected schedule that the end-to-end and selftest tests read and re-analyze."""
    from support import session_jobs

    d = session_jobs.result(_session_root(tmp_path_factory), "demo")
    return DemoRun(d["returncode"], d["summary"], Path(d["workdir"]), d["stderr"], set(d["shm_before"]))


@pytest.fixture(scope="session")
def gpu_script_dry_run(tmp_path_factory) -> dict:
    """`bash bench/gpu_selftest.sh` with DRY_RUN=1 QUICK=1 once per session: the one-command GPU
    run on CPU. Its selftest step runs the fingerprint and throughput proofs only: the detector
    proof's emulated pair is the demo pair this session already runs (demo_run), and
    test_selftest.py judges the detector on it, through the same selftest entry point."""
    from support import session_jobs

    return session_jobs.result(_session_root(tmp_path_factory), "gpu-dry-run")
