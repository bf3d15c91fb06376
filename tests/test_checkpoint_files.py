"""Which safetensors files make a checkpoint: the ones a server loads. SGLang 0.5.23 and
the KT fork glob ``*.safetensors`` (never a hidden file) and, beside
model.safetensors.index.json, keep exactly the files its weight_map names
(model_loader/weight_utils.py ``filter_duplicate_safetensors_files``, compiled here from
the installed files as the oracle). A leftover consolidated.safetensors or
adapter_model.safetensors, or a hidden download temp file, is therefore neither refused
by `index` and `serve` nor part of the index cache's key."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import List, Optional

import pyarrow.parquet as pq
import pytest
from support.cli import cli
from support.sglang_parts import compile_parts
from support.sglang_source import fork_root, installed_root
from support.traces import SMALL_MOE

from moetrace.checkpoints import index_build as ixb
from moetrace.checkpoints import reader
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.errors import MoetraceError

WEIGHT_UTILS = "sglang/srt/model_loader/weight_utils.py"
ROOTS = {"sglang": installed_root("sglang"), "sglang-kt": fork_root()}


def _loaded_by(dist: str, folder: Path) -> list[str]:
    """The files the installed server's loader keeps for a local folder: its glob of
    *.safetensors, then its own filter_duplicate_safetensors_files."""
    root = ROOTS[dist]
    if root is None:
        pytest.skip(f"{dist} is not installed here")
    mod = compile_parts(root, WEIGHT_UTILS, ["filter_duplicate_safetensors_files"],
                        {"os": os, "json": json, "fnmatch": fnmatch, "List": List, "Optional": Optional},
                        f"moetrace_test_weight_utils_{dist.replace('-', '_')}")
    found = glob.glob(os.path.join(str(folder), "*.safetensors"))
    kept = mod.filter_duplicate_safetensors_files(found, str(folder), "model.safetensors.index.json")
    return sorted(os.path.basename(f) for f in kept)


def _leftovers(root: Path) -> None:
    """What a user's folder may hold beside an indexed checkpoint: Mistral's consolidated
    file (here a copy of a shard: every name twice), a LoRA adapter, a hidden temp file
    of an interrupted download (3 bytes, not even a header)."""
    shard = sorted(root.glob("model-*.safetensors"))[0]
    shutil.copy(shard, root / "consolidated.safetensors")
    shutil.copy(shard, root / "adapter_model.safetensors")
    (root / ".tmp-download.safetensors").write_bytes(b"\x00\x01\x02")


@pytest.fixture
def leftover_ckpt(ckpt_copy):
    root = ckpt_copy(**SMALL_MOE)
    assert (root / "model.safetensors.index.json").exists()
    return root


@pytest.mark.parametrize("dist", ["sglang", "sglang-kt"])
def test_weight_files_are_the_servers(leftover_ckpt, make_ckpt, tmp_path, dist):
    _leftovers(leftover_ckpt)
    listed = sorted(set(json.loads((leftover_ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert _loaded_by(dist, leftover_ckpt) == listed  # the oracle: only what the index names
    assert [p.name for p in reader.weight_files(leftover_ckpt)] == listed
    # no index: every visible file loads, except consolidated.safetensors beside model.safetensors
    single = shutil.copytree(make_ckpt(**SMALL_MOE, num_files=1), tmp_path / "single")
    shutil.copy(single / "model.safetensors", single / "consolidated.safetensors")
    (single / ".tmp-download.safetensors").write_bytes(b"abc")
    assert [p.name for p in reader.weight_files(single)] == _loaded_by(dist, single) == ["model.safetensors"]
    open_checkpoint(single)
    shutil.copy(single / "model.safetensors", single / "extra.safetensors")  # a server loads both: ambiguous
    assert [p.name for p in reader.weight_files(single)] == _loaded_by(dist, single)
    with pytest.raises(MoetraceError, match=r"(consolidated|extra).safetensors: a safetensors file beside .*a server loads both"):
        open_checkpoint(single)


def test_index_ignores_files_the_index_json_does_not_list(leftover_ckpt, tmp_path):
    """`index` on the folder with leftovers: the same rows as on the clean folder, and the
    same cache key (the leftovers are not part of it, the hidden 3-byte file breaks nothing)."""
    clean = tmp_path / "clean.parquet"
    assert cli("index", leftover_ckpt, "--tp", "2", "--no-cache", "-o", clean).exit_code == 0
    opts = ixb.IndexOptions(tp_size=2)
    key = ixb.cache_key(leftover_ckpt, opts)
    (leftover_ckpt / ".tmp-download.safetensors").write_bytes(b"\x00\x01\x02")  # the hidden file alone first
    assert ixb.cache_key(leftover_ckpt, opts) == key
    _leftovers(leftover_ckpt)
    assert ixb.cache_key(leftover_ckpt, opts) == key
    ckpt = open_checkpoint(leftover_ckpt)
    assert {t.file.name for t in ckpt.tensors.values()} <= {p.name for p in reader.weight_files(leftover_ckpt)}
    out = tmp_path / "with-leftovers.parquet"
    r = cli("index", leftover_ckpt, "--tp", "2", "--no-cache", "-o", out)
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).equals(pq.read_table(clean))  # rows and digests alike
    r = cli("index", leftover_ckpt, "--tp", "2", "-o", tmp_path / "cached.parquet")  # through the cache
    assert r.exit_code == 0, r.output


def test_serve_starts_on_a_checkpoint_with_leftovers(leftover_ckpt):
    from moetrace.emulator import as_config, start_server

    _leftovers(leftover_ckpt)
    handle = start_server(as_config(leftover_ckpt, tp=2, fence="all"))
    try:
        with urllib.request.urlopen(handle.url + "/health", timeout=30) as r:
            assert r.status == 200
    finally:
        handle.stop()
