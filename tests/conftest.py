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


@pytest.fixture
def ckpt_copy(make_ckpt, tmp_path):
    """ckpt_copy(**kwargs) -> Path of a private copy, free to corrupt."""

    def copy(**kw):
        return shutil.copytree(make_ckpt(**kw), tmp_path / "c")

    return copy


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
    work = tmp_path_factory.mktemp("demo")
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.run([sys.executable, "-m", "moetrace.cli", "demo", "--quick", "--json", "--workdir", str(work)],
                          capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout) if proc.returncode in (0, 1) and proc.stdout.strip() else None
    return DemoRun(proc.returncode, summary, work, proc.stderr, before)
