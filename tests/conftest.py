"""Shared fixtures: synthetic checkpoints, written once per session per argument set.

tests/ and bench/ go on sys.path (and on PYTHONPATH for the processes tests start)
so test modules import the shared scaffolding as ``support.*`` and the benchmark
data generator as ``synthetic_trace``; neither is part of the moetrace package.
"""

from __future__ import annotations

import os
import shutil
import sys

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
