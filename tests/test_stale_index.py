"""A stale index never blames the server: expert shards edited in place with sizes,
headers and mtimes kept (what a cache hit cannot always see) make the audit of a clean
server exit 2 naming the index as stale and the tensor, and drop the cache entry; a
genuine divergence against a fresh index still exits 1."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.cli import cli, one_line_error
from support.traces import CheckpointModel, write_scenario

from moetrace.checkpoints import index_cache
from moetrace.checkpoints.index import index_metadata
from moetrace.checkpoints.reader import open_checkpoint

EDITED = "model.language_model.layers.1.mlp.experts.3.down_proj.weight"


def _edit_in_place(ckpt: Path, name: str) -> None:
    """Flip the first byte of `name`'s data; size, header and every mtime kept (touch -r)."""
    info = open_checkpoint(ckpt).tensors[name]
    st = info.file.stat()
    with open(info.file, "r+b") as f:
        f.seek(info.data_start + info.offsets[0])
        first = f.read(1)
        f.seek(info.data_start + info.offsets[0])
        f.write(bytes([first[0] ^ 0x10]))
    os.utime(info.file, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def edited(make_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    ckpt = Path(shutil.copytree(make_ckpt(num_layers=2, num_experts=4, hidden=256, intermediate=512, seed=5),
                                tmp_path / "ckpt", copy_function=shutil.copy2))
    assert cli("index", ckpt, "--tp", "2", "-o", tmp_path / "cached.parquet").exit_code == 0
    _edit_in_place(ckpt, EDITED)
    # a clean server of the checkpoint as it is now: every rank holds the edited bytes
    trace = write_scenario(CheckpointModel(ckpt, 2), str(tmp_path / "traces"), "clean", steps=[0])
    return ckpt, trace


def test_a_stale_index_from_the_cache_is_exit_2_and_its_entry_is_dropped(edited, tmp_path):
    ckpt, trace = edited
    index = tmp_path / "cached.parquet"
    entry = tmp_path / "cache" / "index" / index_metadata(str(index))["cached_as"]
    assert entry.is_file()
    line = one_line_error(cli("audit", trace, "--index", index, "--junit", tmp_path / "j.xml"),
                          f"the index is stale: {ckpt} changed since it was indexed (tensor layer 1 expert 3 w2_weight")
    assert "dropped" in line and not entry.exists()
    # built again from the checkpoint as it is: the clean server passes
    assert cli("index", ckpt, "--tp", "2", "-o", tmp_path / "fresh.parquet").exit_code == 0
    assert cli("audit", trace, "--index", tmp_path / "fresh.parquet").exit_code == 0


def test_a_stale_cache_hit_under_checkpoint_is_exit_2(edited, tmp_path, monkeypatch):
    ckpt, trace = edited
    monkeypatch.setattr(index_cache, "verify_hit", lambda *a, **k: None)  # the hit's sample missed the edit
    one_line_error(cli("audit", trace, "--checkpoint", ckpt), "the index is stale", "layer 1 expert 3 w2_weight")
    assert cli("audit", trace, "--checkpoint", ckpt).exit_code == 0  # the entry was dropped: built again


def test_a_real_divergence_against_a_fresh_index_is_still_exit_1(make_ckpt, tmp_path):
    model = CheckpointModel(make_ckpt(num_layers=2, num_experts=4, hidden=256, intermediate=512, seed=5), 2)
    index = model.write_index(str(tmp_path / "i.parquet"))
    trace = write_scenario(model, str(tmp_path / "traces"), "e2", steps=[0],
                           corrupt={(0, 1, 1): {(1, "w2_weight_scale_inv"): ("expert", 3)}})
    r = cli("audit", trace, "--index", index)
    assert r.exit_code == 1 and "index is stale" not in r.output, r.output


def test_an_index_of_another_folder_with_the_same_id_is_the_references_fault(make_ckpt, tmp_path, monkeypatch):
    """Two checkpoints of one shape share a checkpoint id (it hashes headers, not data). A
    clean server of A audited against B's index: the divergent rows are cut again from the
    folder the server loaded (its manifests' checkpoint_path), differ from B's index, and the
    reference is refused (exit 2); without that folder recorded, the same audit blames the
    server (exit 1), which is what the check prevents."""
    import json

    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    a = Path(shutil.copytree(make_ckpt(num_layers=2, num_experts=4, hidden=256, intermediate=512, seed=5),
                             tmp_path / "a", copy_function=shutil.copy2))
    b = Path(shutil.copytree(a, tmp_path / "b", copy_function=shutil.copy2))
    _edit_in_place(b, EDITED)
    assert open_checkpoint(a).identity == open_checkpoint(b).identity
    for name, folder in (("ia", a), ("ib", b)):
        assert cli("index", folder, "--tp", "2", "--no-cache", "-o", tmp_path / f"{name}.parquet").exit_code == 0
    trace = write_scenario(CheckpointModel(a, 2), str(tmp_path / "traces"), "clean", steps=[0])
    manifests = sorted(Path(trace).glob("rank=*/_manifest.json"))
    for m in manifests:
        doc = json.loads(m.read_text())
        m.write_text(json.dumps({**doc, "checkpoint_path": str(a)}))  # as the server's hook records it
    assert cli("audit", trace, "--index", tmp_path / "ia.parquet").exit_code == 0
    one_line_error(cli("audit", trace, "--index", tmp_path / "ib.parquet"),
                   f"index {tmp_path / 'ib.parquet'} is not of the checkpoint the server loaded: the server loaded {a}")
    for m in manifests:
        doc = json.loads(m.read_text())
        m.write_text(json.dumps({**doc, "checkpoint_path": None}))
    assert cli("audit", trace, "--index", tmp_path / "ib.parquet").exit_code == 1
