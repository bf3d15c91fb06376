"""Inputs are read strictly: the side files of a trace against their declared fields (a
wrong type, complete: false, a declared rank missing, a part the manifest does not list,
a row count that disagrees: none passes an audit), a checkpoint whose files or tensors
are ambiguous, and sizes or ranges past what the model holds (refused before anything
is sized by them)."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from support.traces import SMALL_MOE, write_scenario

from moetrace.analysis.report import analyze
from moetrace.checkpoints.reader import open_checkpoint
from moetrace.cli import main
from moetrace.errors import MoetraceError
from moetrace.tracer.manifest import RANK_MANIFEST_FIELDS, RUN_MANIFEST_FIELDS, new_rank_manifest, new_run_manifest


@pytest.fixture(scope="module")
def clean(small_model, tmp_path_factory):
    """A clean run X (two parts per rank), and a stale X: an earlier launch under the same
    run id whose rank 1 held E+2 in its first load. Both pass as written."""
    out = tmp_path_factory.mktemp("traces")
    write_scenario(small_model, str(out / "now"), "X", [0, 1], parts=2)
    e2 = {(0, 1, small_model.layer_ids[0]): {(0, "w2_weight_scale_inv"): ("expert", 2)}}
    write_scenario(small_model, str(out / "stale"), "X", [0, 1], e2)
    return out


@pytest.fixture
def run(clean, tmp_path):
    return shutil.copytree(clean / "now" / "X", tmp_path / "X")


def edit(path, **fields):
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


# ---------------------------------------------------------------- 6. side files


def test_the_field_tables_declare_every_key_the_writers_write():
    assert set(new_rank_manifest("r", 0, 1, {}, None, "config")) == set(RANK_MANIFEST_FIELDS)
    assert set(new_run_manifest("r", "out")) == set(RUN_MANIFEST_FIELDS)


@pytest.mark.parametrize("where, fields, message", [
    ("rank=1/_manifest.json", {"finished": "true"}, "'finished' is a string ('true'), expected bool"),
    ("rank=1/_manifest.json", {"rows_dropped": "0"}, "'rows_dropped' is a string ('0'), expected count"),
    ("rank=1/_manifest.json", {"hook_errors": 0.5}, "'hook_errors' is a float"),
    ("rank=0/_manifest.json", {"tp_rank": 0.0}, "'tp_rank' is a float"),
    ("rank=0/_manifest.json", {"rows_written": -1}, "'rows_written' is an int (-1), expected count"),
    ("rank=0/_manifest.json", {"kind": "run"}, "kind is 'run', expected 'rank'"),
    ("rank=0/_manifest.json", {"parts": [{"file": "part-00000.parquet"}]}, "parts[0]: lacks the key 'rows'"),
    ("_run.json", {"complete": "yes"}, "'complete' is a string"),
    ("_run.json", {"ranks": [0, 1]}, "ranks[0]: is an int, expected a JSON object"),
    ("_run.json", {"run_id": "Y"}, "mixes run ids"),
    ("_run.json", {"run_nonce": "0" * 32}, "mixes launches"),
])
def test_a_side_file_of_the_wrong_shape_is_refused(run, small_index, where, fields, message):
    edit(run / where, **fields)
    with pytest.raises(MoetraceError) as ei:
        analyze([str(run)], index=small_index)
    assert message in str(ei.value) and "\n" not in str(ei.value)


def test_a_key_missing_from_a_manifest_is_refused(run, small_index):
    doc = json.loads((run / "rank=1" / "_manifest.json").read_text())
    del doc["sink_errors"]
    (run / "rank=1" / "_manifest.json").write_text(json.dumps(doc))
    with pytest.raises(MoetraceError, match="rank=1/_manifest.json: lacks the key 'sink_errors'"):
        analyze([str(run)], index=small_index)


def incomplete(run, small_index) -> list[str]:
    rep = analyze([str(run)], index=small_index)
    assert rep.exit_code == 2 and rep.doc["status"] == "incomplete", rep.doc["incomplete"]
    return rep.doc["incomplete"]


def test_a_run_file_that_says_incomplete_never_passes(run, small_index):
    assert analyze([str(run)], index=small_index).exit_code == 0
    edit(run / "_run.json", complete=False, problems=["rank 1 dropped 5 rows (queue_full: 5)"])
    assert any("_run.json says the run is incomplete (rank 1 dropped 5 rows" in p for p in incomplete(run, small_index))
    edit(run / "_run.json", finished=False)
    assert any("launcher did not finish" in p for p in incomplete(run, small_index))


def test_a_rank_the_run_declares_but_lacks_never_passes(run, small_index):
    edit(run / "_run.json", expected_ranks=3)
    assert any("rank 2 missing" in p for p in incomplete(run, small_index))
    shutil.rmtree(run / "rank=1")
    edit(run / "_run.json", expected_ranks=None, tp_size=None, ranks=[{"rank_label": "0", "tp_rank": 0, "pp_rank": 0, "replica": None, "present": True}])
    assert any("rank 1 missing" in p for p in incomplete(run, small_index))  # rank 0's manifest says tp_size 2


def test_a_part_the_manifest_does_not_list_is_never_read(clean, run, small_index):
    """A stale part of an earlier launch under the same run id (here: one holding E+2) is
    not this run's data: never a divergence of this run, and the run is incomplete."""
    shutil.copy(clean / "stale" / "X" / "rank=1" / "part-00000.parquet", run / "rank=1" / "part-00007.parquet")
    rep = analyze([str(run)], index=small_index)
    assert rep.exit_code == 2 and rep.doc["totals"]["divergent"] == 0
    assert any("part-00007.parquet is not listed in its manifest" in p for p in rep.doc["incomplete"])


def test_a_listed_part_that_is_absent_never_passes(run, small_index):
    (run / "rank=0" / "part-00001.parquet").unlink()
    assert any("part-00001.parquet is listed in its manifest but missing" in p for p in incomplete(run, small_index))


def test_a_part_whose_rows_disagree_with_the_manifest_is_not_read(clean, run, small_index):
    part = run / "rank=1" / "part-00000.parquet"
    t = pq.read_table(part)
    pq.write_table(t.slice(0, t.num_rows - 3), part)
    problems = incomplete(run, small_index)
    assert any("unreadable Parquet part" in p for p in problems)
    rep = analyze([str(run)], index=small_index)
    assert any(f"holds {t.num_rows - 3} rows but its manifest lists {t.num_rows}" in w for w in rep.doc["warnings"])
    edit(run / "rank=0" / "_manifest.json", rows_written=1)  # the manifest disagrees with itself
    assert any("lists parts of" in p and "says it wrote 1" in p for p in incomplete(run, small_index))


# ---------------------------------------------------------------- 8. checkpoint ambiguity


def test_a_tensor_in_two_files_names_both(ckpt_copy):
    root = ckpt_copy(**SMALL_MOE)
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.0.mlp.experts.1.down_proj.weight"
    home = weight_map[name]
    other = next(f for f in sorted(set(weight_map.values())) if f != home)
    tensors = load_file(root / other)
    tensors[name] = torch.zeros_like(load_file(root / home)[name])  # a stale copy with other bytes
    save_file(tensors, root / other)
    with pytest.raises(MoetraceError) as ei:
        open_checkpoint(root)
    msg = str(ei.value)
    assert name in msg and str(root / home) in msg and str(root / other) in msg


def test_a_second_file_without_an_index_is_an_error(ckpt_copy, make_ckpt, tmp_path):
    """Without model.safetensors.index.json a server loads every visible *.safetensors, so
    another one beside model.safetensors is ambiguous; beside an index, an unlisted file
    is never loaded and is ignored (test_checkpoint_files)."""
    root = ckpt_copy(**SMALL_MOE)
    shutil.copy(root / "model-00001-of-00002.safetensors", root / "model-00003-of-00003.safetensors")
    open_checkpoint(root)
    # the single-file checkpoint test_checkpoints_reader also uses (one write per session)
    small = dict(family="qwen3_moe", num_layers=2, dense_layers=1, num_experts=4, hidden=256, intermediate=256)
    single = shutil.copytree(make_ckpt(**small, num_files=1), tmp_path / "single")
    shutil.copy(single / "model.safetensors", single / "extra.safetensors")
    with pytest.raises(MoetraceError, match=r"extra.safetensors: .*model.safetensors.index.json to say whether"):
        open_checkpoint(single)


# ---------------------------------------------------------------- 4. sizes and ranges


@pytest.mark.parametrize("key, value, message", [
    ("num_experts", 10_000_000, "'num_experts' 10,000,000 is not a model size moetrace accepts"),
    ("num_experts", 1000, "'num_experts' is 1,000 but the safetensors files hold experts 0-3 only"),
    ("num_hidden_layers", 500, "'num_hidden_layers' is 500 but the safetensors files hold layers 0-1 only"),
])
def test_config_sizes_are_checked_against_the_files_first(ckpt_copy, key, value, message):
    root = ckpt_copy(**SMALL_MOE)
    cfg = json.loads((root / "config.json").read_text())
    cfg["text_config"][key] = value
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoetraceError, match=message):
        open_checkpoint(root)


def test_an_expert_range_past_the_model_is_refused(small_index, small_model, tmp_path):
    r = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--index", small_index, "--experts", "0-99999999"])
    assert r.exit_code == 2 and "--experts: '0-99999999': ids must be below 4 (the model's size)" in r.output
    r = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path), "--index", small_index, "--experts", "0-3"])
    assert r.exit_code == 0
