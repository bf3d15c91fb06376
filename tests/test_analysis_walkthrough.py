"""Fixes from a user walkthrough of analyze/audit: --plot paths and errors, folded
per-step summary lines, run-level causes first, thousands separators everywhere,
and a wrong --checkpoint named as the folder the user passed (before any index is built)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support.cli import cli, one_line_error
from support.traces import CheckpointModel, write_scenario
from synthetic_trace import write_bench

from moetrace.analysis import render
from moetrace.analysis.plot import plot
from moetrace.analysis.report import analyze
from moetrace.errors import MoetraceError

STEPS = list(range(13))
SAME = {(e, "w2_weight_scale_inv"): ("expert", e + 2) for e in range(2)}  # 2/4 are E+2


def repeated(s, r, l):
    """rank 1, layer 0: the same fault at steps 0-9 and 12, a different one at step 10, none at 11."""
    if (r, l) != (1, 0) or s == 11:
        return {}
    return {(0, "w2_weight_scale_inv"): ("expert", 2)} if s == 10 else dict(SAME)


@pytest.fixture(scope="module")
def env(make_ckpt, tmp_path_factory):
    model = CheckpointModel(make_ckpt(num_layers=2, num_experts=4, hidden=256, intermediate=512), tp_size=2)
    root = tmp_path_factory.mktemp("walk")
    index = model.write_index(str(root / "index.parquet"))
    out = str(root / "traces")
    write_scenario(model, out, "r", STEPS, repeated)
    write_scenario(model, out, "clean", STEPS, None)
    write_scenario(model, str(root / "lonely"), "onerank", STEPS[:12], None, ranks=[0])
    return {"model": model, "index": index, "out": out, "root": root, "run": f"{out}/r",
            "onerank": str(root / "lonely" / "onerank")}


@pytest.fixture(scope="module")
def rep(env):
    return analyze([env["run"]], index=env["index"])






# ---------------------------------------------------------------- 1. --plot


@pytest.mark.parametrize("name", ["out.txt", "noext", "grid.jpeg", "png", ".png", "out.png.bak"])
def test_plot_rejects_other_file_names(rep, tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(MoetraceError) as ei:
        plot(rep, path)
    assert str(ei.value) == f"--plot {path}: expected a file name ending in .png, .svg or .pdf"
    assert ei.value.exit_code == 2
    assert os.listdir(tmp_path) == []  # nothing written, in particular no noext.png


def test_audit_with_a_bad_plot_name_is_a_one_line_error_not_a_divergence(env, tmp_path):
    # before: matplotlib's ValueError traceback and exit 1, which for audit means "divergence found"
    one_line_error(cli("audit", env["run"], "--index", env["index"], "--plot", tmp_path / "out.txt"),
                   f"--plot {tmp_path / 'out.txt'}", "expected a file name ending in .png, .svg or .pdf")
    one_line_error(cli("audit", env["run"], "--index", env["index"], "--plot", tmp_path / "noext"), "--plot")
    assert not (tmp_path / "noext.png").exists()


@pytest.mark.parametrize("name,magic", [("grid.PNG", b"\x89PNG\r\n\x1a\n"), ("grid.svg", b"<?xml"), ("grid.Pdf", b"%PDF")])
def test_plot_writes_exactly_the_path_in_its_format(rep, tmp_path, name, magic):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    path = str(tmp_path / name)
    assert plot(rep, path) == path
    assert os.listdir(tmp_path) == [name]
    assert (tmp_path / name).read_bytes().startswith(magic)
    assert plt.get_fignums() == before  # its own figure closed, nobody else's


def test_plot_failures_are_one_line_errors_naming_the_path(rep, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    (tmp_path / "a-file").write_text("x")  # a missing folder is made; one under a file cannot be
    path = str(tmp_path / "a-file" / "folder" / "grid.png")
    with pytest.raises(MoetraceError) as ei:
        plot(rep, path)
    msg = str(ei.value)
    assert msg.startswith(f"--plot {path}: cannot write the plot: ") and "\n" not in msg

    def boom(self, *a, **kw):
        raise RuntimeError("renderer exploded\nsecond line")

    monkeypatch.setattr(Figure, "savefig", boom)
    before = plt.get_fignums()
    with pytest.raises(MoetraceError) as ei:
        plot(rep, str(tmp_path / "grid.svg"))
    assert str(ei.value) == f"--plot {tmp_path / 'grid.svg'}: cannot write the plot: RuntimeError: renderer exploded second line"
    assert plt.get_fignums() == before


# ---------------------------------------------------------------- 2. folded summary lines


GROUPED = "rank 1, layer 0, steps 0-9,12: 2/4 w2_weight_scale_inv are E+2 (11 loads)"
SINGLE = "rank 1, layer 0, step 10: 1/4 w2_weight_scale_inv are E+2"


def test_terminal_folds_loads_that_differ_only_in_step(rep):
    text = render.to_text(rep)
    lines = text.splitlines()
    summary = [x for x in lines if "w2_weight_scale_inv are" in x]
    assert summary == ["  " + GROUPED, "  " + SINGLE]
    # unchanged: the first divergence and the JSON, one summary per load
    assert "first divergence: step 0, layer 0, rank 1, expert 0: w2_weight_scale_inv holds expert 2 (E+2)" in lines
    doc = json.loads(render.to_json(rep))
    assert len(doc["summaries"]) == 12
    assert doc["summaries"][0]["sentence"] == "rank 1, layer 0, step 0: 2/4 w2_weight_scale_inv are E+2"
    assert [s["step"] for s in doc["summaries"]] == list(range(11)) + [12]


def test_markdown_and_junit_fold_too(rep):
    md = render.to_markdown(rep)
    assert "| r | 0-9,12 | 0 | 1 | staged | w2_weight_scale_inv | 2/4 w2_weight_scale_inv are E+2 (11 loads) |" in md
    assert "| r | 10 | 0 | 1 | staged | w2_weight_scale_inv | 1/4 w2_weight_scale_inv are E+2 |" in md
    assert md.count("w2_weight_scale_inv are E+2") == 2
    root = ET.fromstring(render.to_junit(rep).split("\n", 1)[1])
    (f,) = [c.find("failure") for c in root.iter("testcase") if c.find("failure") is not None]
    assert f.text.splitlines() == ["23 divergent entries over 13 load(s)", GROUPED, SINGLE]


def test_several_runs_fold_with_the_run_in_front(env):
    rep = analyze([env["out"]], index=env["index"])
    lines = render.to_text(rep).splitlines()
    assert "  r: " + GROUPED in lines and "  r: " + SINGLE in lines


# ---------------------------------------------------------------- 3. run-level causes first


def test_incomplete_run_puts_the_cause_first_and_folds_missing_loads(env):
    r = cli("audit", env["onerank"], "--index", env["index"])
    assert r.exit_code == 2
    lines = r.output.splitlines()
    cause = lines.index("  run onerank: rank 1 missing (no rank=1 folder)")
    missing = [i for i, x in enumerate(lines) if "entries missing" in x]
    assert missing and cause < missing[0]
    assert [lines[i] for i in missing] == [
        "  rank 1, layer 0, steps 0-11 (staged): 16 entries missing per load (12 loads)",
        "  rank 1, layer 1, steps 0-11 (staged): 16 entries missing per load (12 loads)",
    ]
    doc = json.loads(cli("analyze", env["onerank"], "--index", env["index"], "--json").output)
    assert len(doc["missing_loads"]) == 24  # JSON unchanged: one per load
    md = render.to_markdown(analyze([env["onerank"]], index=env["index"]))
    assert md.index("## Incomplete") < md.index("## Loads not captured on every rank") < md.index("## Coverage")
    assert "- rank 1, layer 0, steps 0-11 (staged): 16 entries missing per load (12 loads)" in md


# ---------------------------------------------------------------- 4. thousands separators


def test_steps_and_ranks_use_thousands_separators(tmp_path):
    meta = write_bench(str(tmp_path), rows=1200 * 2 * 16, layers=1, experts=4, rows_per_part=50_000)
    assert meta["steps"] == 1200
    doc = analyze([meta["trace"]], index=meta["index"]).doc
    assert doc["totals"]["sentence"].startswith("38,396/38,400 tensors match across 1,200 steps, 2 ranks")


# ---------------------------------------------------------------- 5. --checkpoint for another checkpoint


@pytest.fixture(scope="module")
def two_checkpoints(make_ckpt, tmp_path_factory):
    traced = CheckpointModel(make_ckpt(num_layers=2, num_experts=8, hidden=256, intermediate=512), tp_size=2)
    other = make_ckpt(num_layers=2, num_experts=4)
    out = str(tmp_path_factory.mktemp("ck"))
    write_scenario(traced, out, "t", [0], None)
    return traced, str(other), os.path.join(out, "t")


def test_wrong_checkpoint_names_the_folder_and_fails_before_building_an_index(two_checkpoints, tmp_path, monkeypatch):
    from moetrace.checkpoints.reader import open_checkpoint

    traced, other, trace = two_checkpoints
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOETRACE_CACHE", str(cache))
    with pytest.raises(MoetraceError) as ei:
        analyze([trace], checkpoint=other)
    assert str(ei.value) == (f"--checkpoint {other} is checkpoint {open_checkpoint(other).identity}, but trace {trace} "
                             f"(run t) was captured from checkpoint {traced.checkpoint_id}")
    assert not any(p.suffix == ".parquet" for p in cache.rglob("*"))  # failed fast: no index built
    one_line_error(cli("analyze", trace, "--checkpoint", other), f"--checkpoint {other} is checkpoint")
    one_line_error(cli("audit", trace, "--checkpoint", other), f"--checkpoint {other} is checkpoint")


def test_index_from_checkpoint_that_disagrees_names_the_checkpoint(two_checkpoints, tmp_path, monkeypatch):
    """Should the early check be passed (e.g. a stale cache entry), the late check still names --checkpoint."""
    from moetrace.analysis import index_choice as report

    traced, other, trace = two_checkpoints
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(report, "check_checkpoint", lambda data, checkpoint: None)
    with pytest.raises(MoetraceError) as ei:
        analyze([trace], checkpoint=other)
    assert str(ei.value).startswith(f"--checkpoint {other} is checkpoint ")
    assert ".parquet" not in str(ei.value)


def test_right_checkpoint_still_analyzes(two_checkpoints, tmp_path, monkeypatch):
    traced, _, trace = two_checkpoints
    monkeypatch.setenv("MOETRACE_CACHE", str(tmp_path / "cache"))
    assert analyze([trace], checkpoint=str(traced.path)).doc["status"] == "match"



def test_server_that_died_on_its_own_makes_the_audit_incomplete(make_ckpt, tmp_path):
    """A clean-looking trace from a server that crashed is not a pass."""
    model = CheckpointModel(make_ckpt(num_layers=2, num_experts=4, hidden=256, intermediate=512), tp_size=2)
    index = model.write_index(str(tmp_path / "index.parquet"))
    out = str(tmp_path / "traces")
    write_scenario(model, out, "crash", [0, 1], None)
    run_json = Path(out) / "crash" / "_run.json"
    assert analyze([f"{out}/crash"], index=index).exit_code == 0
    doc = json.loads(run_json.read_text()) if run_json.exists() else {"run_id": "crash", "tp_size": 2}
    doc.update(finished=True, server_exit_code=1, stop_reason=None)
    run_json.write_text(json.dumps(doc))
    rep = analyze([f"{out}/crash"], index=index)
    assert rep.exit_code == 2 and any("exited on its own with code 1" in s for s in rep.doc["incomplete"])
    doc.update(stop_reason="traffic done", server_exit_code=-15)  # we stopped it: fine
    run_json.write_text(json.dumps(doc))
    assert analyze([f"{out}/crash"], index=index).exit_code == 0
