"""moetrace inside the real SGLang 0.5.23 server (`python -m sglang.launch_server --device cpu
--tp 2`, gloo, torch-native paths), driven as a user drives it, once per session in the
background (support.sglang_server; conftest.JOB_FIXTURES):

- ``moetrace selftest --server CMD``: faults of moetrace's fault hook registered before
  its capture hook, named exactly by the audit, then a clean launch that passes;
- ``moetrace launch`` with the guard and SGLang's ``--enable-metrics`` across an
  ``/update_weights_from_disk`` to a second checkpoint, stopped by SIGTERM;
- ``audit --launch`` whose TP rank 1 is killed mid-run.

The tiny models are transformers' own Qwen3-MoE with a tokenizer trained here
(support.vllm_model). Fails, not skips, without its environment when
MOETRACE_REQUIRE_SGLANG_SERVER=1 (make test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.sglang_server import require

LAYERS = (0, 1)
RANKS = ("0", "1")


@pytest.fixture(scope="session")
def sglang_runs(tmp_path_factory) -> dict:
    from conftest import session_job

    return require(session_job(tmp_path_factory, "sglang"))


def _selftest(runs: dict) -> dict:
    res = runs["runs"]["selftest"]
    assert res["doc"] is not None, res["stderr"][-6000:]
    return res


def _report(runs: dict, name: str) -> dict:
    doc = _selftest(runs)["doc"][f"{name}_run"]
    return json.loads(Path(doc["report"]).read_text())


def _manifest(run_dir: str, rank: str) -> dict:
    return json.loads((Path(run_dir) / f"rank={rank}" / "_manifest.json").read_text())


def test_selftest_server_passes_in_the_real_server(sglang_runs):
    """selftest --server exits 0: its fault launch was named exactly and its clean launch passed."""
    res = _selftest(sglang_runs)
    doc = res["doc"]
    assert res["returncode"] == 0 and doc["verdict"] == 0, json.dumps(doc, indent=1)[-4000:] + res["stderr"][-4000:]
    assert doc["fault_run"]["ok"] is True and doc["fault_run"]["audit_exit_code"] == 1
    assert doc["fault_run"]["missed"] == [] and doc["fault_run"]["unexplained"] == []
    assert doc["clean_run"]["ok"] is True and doc["clean_run"]["audit_exit_code"] == 0
    kinds = sorted((f["fault"], f["at_forward"] > 0) for f in doc["faults"])
    assert kinds == [("other_rank", False), ("swap", False), ("swap", True), ("zero", False)]


def test_clean_launch_passes_with_full_coverage(sglang_runs):
    rep = _report(sglang_runs, "clean")
    assert rep["status"] == "match" and rep["audit_exit_code"] == 0 and rep["incomplete"] == []
    t = rep["totals"]
    assert t["tensors"] == t["match"] > 0 and t["missing"] == 0 and t["ranks"] == list(RANKS)
    loads = {(x["rank"], x["layer"]) for x in rep["loads"] if x["source"] == "resident"}
    assert loads == {(r, layer) for r in RANKS for layer in LAYERS}
    assert all(x["captured"] == x["expected"] for x in rep["loads"])
    assert rep["launch"]["traffic_problem"] is None and rep["launch"]["requests_answered"] >= 2


def test_each_fault_is_named_in_the_summaries(sglang_runs):
    """Per-load summaries of the fault launch: the swap reads E+2 and E-2 (an E-2 is not the
    fused shared expert's encoding), the zeroed tensor zeros, the other rank's shard by rank."""
    rep = _report(sglang_runs, "fault")
    faults = _selftest(sglang_runs)["doc"]["faults"]
    swap = next(f for f in faults if f["fault"] == "swap" and f["at_forward"] == 0)
    a, b = swap["experts"]
    sentences = [s["sentence"] for s in rep["summaries"]]
    assert any(f"rank {swap['rank']}, layer {swap['layer']}," in s and f"1/8 w2_weight are E+{b - a}, 1/8 are E-{b - a}"
               in s for s in sentences), sentences
    assert any("1/8 w13_weight are zeros" in s for s in sentences), sentences
    assert any("1/8 w13_weight hold rank 1's shard" in s for s in sentences), sentences
    first = rep["first_divergence"][0]["sentence"]
    assert first.endswith(f"expert {a}: w2_weight holds expert {b} (E+{b - a})"), first


def test_a_late_write_through_data_is_caught_at_the_next_forward(sglang_runs):
    """The late swap is written through param.data after two captured forwards of its layer,
    where no version counter moves: the rows before it match, every row from it on diverges."""
    rep = _report(sglang_runs, "fault")
    late = next(f for f in _selftest(sglang_runs)["doc"]["faults"] if f["at_forward"] > 0)
    rank, layer = str(late["rank"]), late["layer"]
    steps = sorted(x["step"] for x in rep["loads"] if (x["rank"], x["layer"], x["source"]) == (rank, layer, "resident"))
    hit = {(r["step"], r["expert"]) for r in rep["divergent_rows"]
           if (r["rank"], r["layer"], r["tensor"]) == (rank, layer, "w13_weight")}
    assert len(steps) > late["at_forward"] + 1
    want = {(s, e) for s in steps[late["at_forward"]:] for e in late["experts"]}
    assert hit == want


def test_ranks_come_from_sglangs_own_parallel_state(sglang_runs):
    run_dir = _selftest(sglang_runs)["doc"]["clean_run"]["run_dir"]
    for rank in RANKS:
        m = _manifest(run_dir, rank)
        assert (m["tp_rank"], m["tp_size"], m["tp_rank_found_by"]) == (int(rank), 2, "sglang")
        assert m["finished"] and m["hook_errors"] == 0 and m["resident_reused"] == 0


def test_a_killed_rank_makes_the_audit_incomplete(sglang_runs):
    res = sglang_runs["runs"]["killed"]
    assert res["returncode"] == 2, res["stdout"][-3000:] + res["stderr"][-3000:]
    rep = res["report"]
    assert rep is not None and rep["status"] in ("incomplete", "unusable"), rep
    assert (Path(res["run_dir"]) / "rank=1").exists()
    assert not _manifest(res["run_dir"], "1")["finished"]


def test_sigterm_to_launch_closes_every_rank_trace(sglang_runs):
    """The update run serves Qwen3.5-MoE, the mission's family (experts under
    model.language_model, Gated DeltaNet layers): every rank closes its trace on SIGTERM."""
    upd = sglang_runs["runs"]["update"]
    assert "error" not in upd, upd.get("error", "") + upd["log"][-4000:]
    run = json.loads((Path(upd["run_dir"]) / "_run.json").read_text())
    assert run["finished"] and run["ranks_closed_before_stop"], run
    for rank in RANKS:
        m = _manifest(upd["run_dir"], rank)
        assert m["finished"] and m["hook_errors"] == 0, m
        assert m["models"]["target"]["architecture"] == "Qwen3_5MoeForConditionalGeneration"
        assert m["models"]["target"]["layers"] == list(LAYERS)


def _ours(exposition: str, openmetrics: bool) -> str:
    """moetrace's families of a scrape (SGLang's own exposition is not ours to parse:
    0.5.23's `sglang:*` histograms clash under the strict OpenMetrics parser)."""
    ours = [line for line in exposition.splitlines()
            if line.startswith(("moetrace_", "# HELP moetrace_", "# TYPE moetrace_", "# UNIT moetrace_"))]
    return "\n".join(ours + (["# EOF"] if openmetrics else [])) + "\n"


def test_metrics_endpoint_carries_the_guard_in_both_formats(sglang_runs):
    """SGLang's own /metrics (--enable-metrics) carries the guard's metrics; prometheus_client's
    parsers read them in the text format and, strictly, in OpenMetrics."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
    from prometheus_client.parser import text_string_to_metric_families as text

    upd = sglang_runs["runs"]["update"]
    assert "sglang:" in upd["metrics_text"]  # SGLang's own exposition, with ours in it
    plain = {f.name: f for f in text(_ours(upd["metrics_text"], False))}
    strict = {f.name: f for f in openmetrics(_ours(upd["metrics_openmetrics"], True))}
    ours = sorted(n for n in plain if n.startswith("moetrace_guard"))
    assert ours and ours == sorted(n for n in strict if n.startswith("moetrace_guard")), (ours, sorted(strict))
    status = [s for s in plain["moetrace_guard_status"].samples]
    assert status and all(s.value in (0, 1) for s in status)
    loads = [s for f in plain.values() if f.name.startswith("moetrace_guard_loads") for s in f.samples
             if s.name.endswith("_total")]
    assert loads and sum(s.value for s in loads) > 0, sorted(plain)


def test_an_update_from_disk_is_recorded_and_judged_against_the_checkpoint_it_loaded(sglang_runs):
    upd = sglang_runs["runs"]["update"]
    status, body = upd["update"]
    assert status == 200 and json.loads(body)["success"], body
    assert upd["before"] == [200, 200] and upd["after"] == [200, 200]
    model_b = sglang_runs["models"]["b"]
    for rank in RANKS:
        m = _manifest(upd["run_dir"], rank)
        (u,) = m["weight_updates"]
        assert u["ok"] and u["model_path"] == model_b and u["checkpoint_id"] and u["after_step"]["target"] >= 0
        assert [x["index"] for x in m["guard"]["weight_updates"]] == [sglang_runs["indexes"]["b"]]
        assert m["guard"]["status"] == "ok" and m["guard"]["tensors"]["mismatch"] == 0
    a = sglang_runs["runs"]["audit_a"]
    rep = a["report"]
    assert a["returncode"] == 0, a["stdout"][-3000:] + a["stderr"][-3000:]
    (seg,) = rep["weight_updates"]
    assert seg["status"] == "match" and seg["model_path"] == model_b and seg["rows"] > 0
    assert rep["totals"]["tensors"] == rep["totals"]["match"] == rep["totals"]["rows_read"]
    assert any(w.startswith("weights updated (") for w in rep["warnings"])
    # B's index is not what the server started with: refused, never taken for a divergence of the server
    # (make-checkpoint's A and B differ in config, so their checkpoint ids differ; the same id with other
    # bytes is refused too: tests/test_stale_index.py)
    b = sglang_runs["runs"]["audit_b"]
    assert b["returncode"] == 2 and f"index {sglang_runs['indexes']['b']} is for" in b["stderr"], b["stderr"][-2000:]


def test_every_server_process_is_gone(sglang_runs):
    assert sglang_runs["leftover"] == []
