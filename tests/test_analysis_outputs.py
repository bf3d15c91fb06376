"""analysis outputs through the CLI: terminal text, --json, --junit, --markdown, --plot,
audit exit codes and diff."""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET

import pytest
from support.cli import cli
from support.traces import CheckpointModel, write_scenario

STEPS = [0, 1, 2]


def unfenced(s, r, l):
    c = {}
    if (s, r, l) == (1, 1, 0):
        c.update({(e, "w2_weight_scale_inv"): ("expert", e + 2) for e in range(6)})
    if s == 2 and l == 1:
        c[(3, "w13_weight")] = ("rank", 1 - r)
    if (s, r, l) == (2, 0, 0):
        c[(4, "w2_weight")] = ("zeros",)
    if (s, r, l) == (2, 1, 1):
        c[(5, "w13_weight")] = ("torn", 7)
    return c


@pytest.fixture(scope="module")
def env(make_ckpt, tmp_path_factory):
    model = CheckpointModel(make_ckpt(num_layers=2, num_experts=8, hidden=256, intermediate=512), tp_size=2)
    root = tmp_path_factory.mktemp("out")
    index = model.write_index(str(root / "index.parquet"))
    out = str(root / "traces")
    write_scenario(model, out, "unfenced", STEPS, unfenced)
    write_scenario(model, out, "fenced", STEPS, None)
    return {"model": model, "index": index, "out": out, "root": root}




def test_analyze_terminal_text(env):
    r = cli("analyze", f"{env['out']}/unfenced", "--index", env["index"])
    assert r.exit_code == 0
    assert "moetrace analyze: DIVERGENT" in r.output
    assert "first divergence: step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)" in r.output
    assert "  rank 1, layer 0, step 1: 6/8 w2_weight_scale_inv are E+2" in r.output
    assert "374/384 tensors match across 3 steps, 2 ranks" in r.output


def test_json_is_stable_and_documented(env):
    r = cli("analyze", f"{env['out']}/unfenced", "--index", env["index"], "--json")
    assert r.exit_code == 0
    doc = json.loads(r.output)
    assert doc["schema"] == "moetrace.analysis" and doc["version"] == 3
    assert list(doc) == ["schema", "version", "moetrace_version", "created_at", "inputs", "status", "audit_exit_code",
                         "totals", "incomplete", "warnings", "first_divergence", "summaries", "runs", "skipped_parts",
                         "loads", "missing_loads", "divergent_rows", "divergent_rows_truncated"]
    assert doc["status"] == "divergent" and doc["audit_exit_code"] == 1
    row = doc["divergent_rows"][0]
    assert set(row) == {"run_id", "step", "model", "layer", "rank", "tp_rank", "moe_tp_rank", "source", "capture_seq",
                        "transport_position", "copy_position", "expert", "slot", "expert_copy", "shared_expert", "tensor",
                        "verdict", "k", "found", "value", "chunks", "digest", "expected_digest", "sentence"}
    assert len(row["digest"]) == 32
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "analysis.md")).read()
    for key in list(doc) + list(doc["totals"]) + list(row):
        assert f"`{key}`" in docs, f"docs/analysis.md does not document {key}"


def test_json_row_cap(env):
    doc = json.loads(cli("analyze", f"{env['out']}/unfenced", "--index", env["index"], "--json", "--max-rows", "2").output)
    assert len(doc["divergent_rows"]) == 2 and doc["divergent_rows_truncated"] == 8


def test_junit_markdown_plot(env, tmp_path):
    junit, md, png = tmp_path / "a.xml", tmp_path / "a.md", tmp_path / "a.png"
    r = cli("analyze", f"{env['out']}/unfenced", "--index", env["index"], "--junit", junit, "--markdown", md, "--plot", png)
    assert r.exit_code == 0, r.output
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert int(suite.get("tests")) == len(cases) == 5  # 2 ranks x 2 layers + completeness
    fails = {c.get("classname") + "/" + c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert set(fails) == {"moetrace.unfenced.rank0/layer0.staged", "moetrace.unfenced.rank0/layer1.staged",
                          "moetrace.unfenced.rank1/layer0.staged", "moetrace.unfenced.rank1/layer1.staged"}
    f = fails["moetrace.unfenced.rank1/layer0.staged"]
    assert f.get("message") == "step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)"
    assert f.get("type") == "stale" and "6/8 w2_weight_scale_inv are E+2" in f.text
    assert int(suite.get("failures")) == 4 and int(suite.get("errors")) == 0
    text = md.read_text()
    assert "## First divergence" in text and "holds expert 2 (E+2)" in text and "| stale | 6 |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    shutil.copy(png, "/tmp/moetrace_plot.png")  # for a person to look at


def test_junit_passes_for_a_clean_run(env, tmp_path):
    junit = tmp_path / "ok.xml"
    r = cli("audit", f"{env['out']}/fenced", "--index", env["index"], "--junit", junit)
    assert r.exit_code == 0, r.output
    assert "audit: exit 0 (pass)" in r.output
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "0" and root.get("errors") == "0" and int(root.get("tests")) == 5


def test_audit_exit_codes(env, tmp_path):
    m, index, out = env["model"], env["index"], env["out"]
    assert cli("audit", f"{out}/fenced", "--index", index).exit_code == 0
    assert cli("audit", f"{out}/unfenced", "--index", index).exit_code == 1
    # missing rank: rank 1 never wrote anything
    write_scenario(m, str(tmp_path), "onerank", STEPS, None, ranks=[0])
    r = cli("audit", tmp_path / "onerank", "--index", index)
    assert r.exit_code == 2 and "rank 1 missing" in r.output
    # dropped rows
    write_scenario(m, str(tmp_path), "dropped", STEPS, None, manifest={"rows_dropped": 5})
    r = cli("audit", tmp_path / "dropped", "--index", index)
    assert r.exit_code == 2 and "rank 0 dropped 5 rows" in r.output
    # a manifest that never finished
    write_scenario(m, str(tmp_path), "killed", STEPS, None, manifest=lambda r: {"finished": r == 0})
    r = cli("audit", tmp_path / "killed", "--index", index)
    assert r.exit_code == 2 and "did not finish" in r.output
    # one expected entry not captured, everything else matches
    write_scenario(m, str(tmp_path), "partial", STEPS, lambda s, r, l: {(2, "w2_weight"): None} if s == 1 else {})
    r = cli("audit", tmp_path / "partial", "--index", index)
    assert r.exit_code == 2 and "expected entries not captured" in r.output
    # hook errors
    write_scenario(m, str(tmp_path), "errs", STEPS, None, manifest={"hook_errors": 3})
    assert cli("audit", tmp_path / "errs", "--index", index).exit_code == 2
    # divergence wins over incompleteness
    write_scenario(m, str(tmp_path), "both", STEPS, unfenced, ranks=[0, 1], manifest={"rows_dropped": 1})
    assert cli("audit", tmp_path / "both", "--index", index).exit_code == 1
    # analyze itself exits 0 on all of them
    assert cli("analyze", tmp_path / "onerank", "--index", index).exit_code == 0


def test_missing_rank_counts_its_loads(env, tmp_path):
    write_scenario(env["model"], str(tmp_path), "onerank", STEPS, None, ranks=[0])
    doc = json.loads(cli("analyze", tmp_path / "onerank", "--index", env["index"], "--json").output)
    assert doc["runs"][0]["ranks_missing"] == ["1"]
    assert doc["totals"]["sentence"].startswith("192/384 tensors match across 3 steps, 1 rank")
    assert len(doc["missing_loads"]) == 6 and doc["status"] == "incomplete"


def test_diff_runs(env):
    out, index = env["out"], env["index"]
    r = cli("diff", f"{out}/unfenced", f"{out}/fenced", "--index", index)
    assert r.exit_code == 0, r.output
    assert "10 of 384 entries present in both runs differ" in r.output
    assert "rank 1, w2_weight_scale_inv: 6 entries E+2 → match" in r.output
    assert "first change: step 1, layer 0, rank 1, expert 0: w2_weight_scale_inv E+2 in A, match in B" in r.output
    doc = json.loads(cli("diff", f"{out}/unfenced", f"{out}/fenced", "--json").output)
    assert doc["schema"] == "moetrace.diff" and doc["totals"]["changed"] == 10 and doc["totals"]["same"] == 374
    assert doc["changes"][0]["sentence"] == "rank 1, layer 0, w2_weight_scale_inv: 6 entries changed digest"
    same = json.loads(cli("diff", f"{out}/fenced", f"{out}/fenced", "--json").output)
    assert same["totals"]["changed"] == 0 and same["first_change"] is None


def test_diff_refuses_runs_of_different_tp(env, tmp_path):
    """A TP1 run diffed against a TP2 run holds other shards on rank 0: refused
    by name (exit 2) rather than listed as changed digests."""
    tp1 = CheckpointModel(env["model"].path, tp_size=1)
    write_scenario(tp1, str(tmp_path), "tp1", STEPS, None)
    r = cli("diff", f"{env['out']}/fenced", tmp_path / "tp1")
    assert r.exit_code == 2 and "run A is TP2 EP1 PP1 but run B is TP1 EP1 PP1: their ranks hold different shards" in r.output, r.output
    assert "entries present in both runs" not in r.output


def test_help_has_examples():
    for cmd in ("analyze", "audit", "diff"):
        r = cli(cmd, "--help")
        assert r.exit_code == 0 and "Example" in r.output
