"""Shared fixtures: synthetic checkpoints, written once per session per argument set."""

from __future__ import annotations

import shutil

import pytest


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
