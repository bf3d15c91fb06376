"""analysis on bad input: one-line errors with exit code 2, or a skipped part that is
named and counted (and fails an audit)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cli import cli, one_line_error
from support.traces import SMALL_MOE, CheckpointModel, write_scenario

from moetrace.analysis.report import analyze
from moetrace.errors import MoetraceError

SIZES = SMALL_MOE  # small: these tests are about input handling, not shards


@pytest.fixture(scope="module")
def model(small_model):
    return small_model


@pytest.fixture(scope="module")
def index(small_index):
    return small_index


@pytest.fixture
def run(model, tmp_path):
    write_scenario(model, str(tmp_path), "r", [0, 1], None, parts=2)
    return tmp_path / "r"






def test_truncated_part_is_skipped_named_and_fails_audit(run, index):
    part = run / "rank=1" / "part-00001.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    rep = analyze([str(run)], index=index)
    assert [p["path"] for p in rep.doc["skipped_parts"]] == [str(part)]
    assert any(str(part) in w for w in rep.doc["warnings"])
    assert "1 unreadable Parquet part(s) skipped" in rep.doc["incomplete"]
    r = cli("analyze", run, "--index", index)
    assert r.exit_code == 0 and "skipped unreadable part" in r.output and "part-00001.parquet" in r.output
    assert cli("audit", run, "--index", index).exit_code == 2


def test_garbage_part_is_skipped(run, index):
    (run / "rank=0" / "part-00000.parquet").write_bytes(b"not parquet at all" * 100)
    rep = analyze([str(run)], index=index)
    assert len(rep.doc["skipped_parts"]) == 1 and rep.exit_code == 2


def test_missing_manifest(run, index):
    os.remove(run / "rank=1" / "_manifest.json")
    one_line_error(cli("analyze", run, "--index", index), "rank=1", "no _manifest.json")
    one_line_error(cli("audit", run, "--index", index), "no _manifest.json")


def test_garbled_manifest(run, index):
    (run / "rank=0" / "_manifest.json").write_text("{not json")
    one_line_error(cli("analyze", run, "--index", index), "manifest", "unreadable")


def test_trace_of_another_fingerprint_version(run, index):
    m = json.loads((run / "rank=0" / "_manifest.json").read_text())
    m["fp_version"], m["schema_version"] = 2, 2  # a trace of the previous version, as it was written
    (run / "rank=0" / "_manifest.json").write_text(json.dumps(m))
    one_line_error(cli("analyze", run, "--index", index), "fingerprint version 2", "computes version 3",
                   "capture the trace again", "moetrace index")


def test_mixed_schema_versions(run, index, model):
    """A version 3 part (readable alone) among version 4 parts: one trace is one version."""
    t = pq.read_table(run / "rank=1" / "part-00001.parquet")
    t = t.set_column(0, "schema_version", pa.array([3] * t.num_rows, pa.int16()))
    pq.write_table(t, run / "rank=1" / "part-00001.parquet")
    line = one_line_error(cli("analyze", run, "--index", index), "mixes schema versions", "v3", "v4")
    assert "part-00001.parquet" in line


def test_newer_schema_version_only(run, index):
    for rk in ("rank=0", "rank=1"):
        for p in (run / rk).glob("part-*.parquet"):
            t = pq.read_table(p)
            pq.write_table(t.set_column(0, "schema_version", pa.array([5] * t.num_rows, pa.int16())), p)
    one_line_error(cli("analyze", run, "--index", index), "schema_version 5", "reads versions 3 and 4")


def test_version_3_trace_is_read_and_cannot_hold_loaded_rows(run, index):
    """Version 3 (staged and resident only) is still read; a "loaded" row in it is not a v3 trace."""
    parts = [p for rk in ("rank=0", "rank=1") for p in (run / rk).glob("part-*.parquet")]
    for p in parts:
        t = pq.read_table(p)
        pq.write_table(t.set_column(0, "schema_version", pa.array([3] * t.num_rows, pa.int16())), p)
    assert cli("analyze", run, "--index", index).exit_code == 0
    t = pq.read_table(parts[0])
    src = t.column("source").to_pylist()
    t = t.set_column(t.schema.get_field_index("source"), "source", pa.array(["loaded"] + src[1:], pa.string()))
    pq.write_table(t, parts[0])
    one_line_error(cli("analyze", run, "--index", index), "schema v3", "'loaded'", "expected 'staged' or 'resident'")


def test_index_for_another_tp_size(run, model, tmp_path):
    other = model.write_index(str(tmp_path / "tp4.parquet"), tp_size=4)
    one_line_error(cli("analyze", run, "--index", other), "TP2", "TP4")
    one_line_error(cli("audit", run, "--index", other), "TP2", "TP4")


def test_index_for_another_checkpoint(run, make_ckpt, tmp_path):
    other_model = CheckpointModel(make_ckpt(**SIZES, seed=1), tp_size=2)
    other = other_model.write_index(str(tmp_path / "other.parquet"))
    one_line_error(cli("analyze", run, "--index", other), "traced checkpoint", other_model.checkpoint_id)


def test_empty_trace(model, index, tmp_path):
    write_scenario(model, str(tmp_path), "empty", [], None)  # manifests, no parts
    one_line_error(cli("analyze", tmp_path / "empty", "--index", index), "holds no rows", "nothing was captured")
    one_line_error(cli("audit", tmp_path / "empty", "--index", index), "nothing was captured")


def test_no_trace_at_all(tmp_path, index):
    (tmp_path / "nothing").mkdir()
    one_line_error(cli("analyze", tmp_path / "nothing", "--index", index), "no trace found")
    one_line_error(cli("analyze", tmp_path / "absent", "--index", index), "does not exist")


def test_only_unreadable_parts(run, index):
    for rk in ("rank=0", "rank=1"):
        for p in (run / rk).glob("part-*.parquet"):
            p.write_bytes(b"PAR1broken")
    one_line_error(cli("analyze", run, "--index", index), "holds no rows", "unreadable part")


def test_bad_index_files(run, tmp_path):
    one_line_error(cli("analyze", run, "--index", tmp_path / "nope.parquet"), "nope.parquet: no such file")
    (tmp_path / "junk.parquet").write_bytes(b"junk")
    one_line_error(cli("analyze", run, "--index", tmp_path / "junk.parquet"), "not a readable moetrace index")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "alien.parquet")
    one_line_error(cli("analyze", run, "--index", tmp_path / "alien.parquet"), "not a moetrace index")


def test_index_or_checkpoint_required(run, index):
    one_line_error(cli("analyze", run), "--index")
    one_line_error(cli("analyze", run, "--index", index, "--checkpoint", "x"), "not both")


def test_rows_disagreeing_with_manifest(run, index):
    m = json.loads((run / "rank=0" / "_manifest.json").read_text())
    m["tp_size"] = 4
    (run / "rank=0" / "_manifest.json").write_text(json.dumps(m))
    one_line_error(cli("analyze", run, "--index", index), "mixes tp_size")


def test_part_from_another_layout(run, index, model):
    part = run / "rank=0" / "part-00000.parquet"
    t = pq.read_table(part)
    pq.write_table(t.set_column(t.schema.get_field_index("tp_size"), "tp_size", pa.array([4] * t.num_rows, pa.int16())), part)
    one_line_error(cli("analyze", run, "--index", index), "part-00000.parquet has tp_size [4]", "manifest says 2")


def test_errors_are_moetrace_errors(run, index):
    os.remove(run / "rank=0" / "_manifest.json")
    with pytest.raises(MoetraceError) as ei:
        analyze([str(run)], index=index)
    assert ei.value.exit_code == 2 and "\n" not in str(ei.value)


def test_trace_on_an_fsspec_only_filesystem_is_analyzed(model, index):
    """The sink and the analysis open storage the same way (pyarrow, else fsspec): a trace
    written to a URL only fsspec knows (memory://) is analyzed like a local one."""
    pytest.importorskip("fsspec")
    write_scenario(model, "memory://traces", "mem", [0], None)
    rep = analyze(["memory://traces/mem"], index=index)
    assert rep.exit_code == 0 and rep.doc["totals"]["match"] == rep.doc["totals"]["tensors"] > 0
