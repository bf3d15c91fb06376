"""Slot maps, draft models, process identity.

One session-wide run of tests/support/slots_server.py: four gloo processes whose
FusedMoE-shaped modules are set up by SGLang 0.5.23's own loader and expert-location
metadata (EPLB with redundant copies, a fused shared expert, a rebalance between
passes, a Qwen3.5 MTP draft beside the target, 2 pipeline stages) and by the KT fork's
own dynamic expert update (2 data-parallel replicas), hooked through SGLang's own
register_forward_hooks. The expectations come from the maps the test hands SGLang's
code, not from moetrace's reading of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import once_per_session
from support import traces as st
from support.sglang_source import fork_root, installed_root, load_hook_manager
from support.slots_server import NEW_ROW, OLD_ROW, E

from moetrace.analysis.report import analyze
from moetrace.checkpoints.index import INDEX_META_KEY, read_index, write_index
from moetrace.checkpoints.index_build import build_index
from moetrace.tracer.manifest import read_manifests

CKPT = dict(num_layers=4, num_experts=E, hidden=128, intermediate=256, shared_expert=True, draft=True, seed=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> dict:
    if installed_root("sglang") is None or fork_root() is None:
        pytest.skip("sglang 0.5.23 and sglang-kt 0.7.2 (side folder) are needed: make venv installs both")

    def run(folder: Path) -> dict:
        from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

        ckpt = write_synthetic_checkpoint(folder / "ckpt", **CKPT)
        out = folder / "traces"
        proc = subprocess.run([sys.executable, "-m", "support.slots_server", str(ckpt), str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        write_index(build_index(ckpt, 2, 2), folder / "ep2.parquet")  # TP2 EP2: moe_tp 1, every layer, draft, shared
        write_index(build_index(ckpt, 2, 1, layers=[0]), folder / "tp2.parquet")  # the KT replicas: moe_tp 2
        return {"ckpt": str(ckpt), "out": str(out), "ep2": str(folder / "ep2.parquet"), "tp2": str(folder / "tp2.parquet")}

    return once_per_session(tmp_path_factory, "slots_server", run)


def _rows(server, run: str) -> list[dict]:
    return st.read_rows(server["out"], run).to_pylist()


def _copies(row: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    out = []
    for e in row:
        out.append(seen.get(e, 0))
        seen[e] = out[-1] + 1
    return out


def test_clean_server_passes_with_every_physical_slot_checked(server):
    rep = analyze([f"{server['out']}/eplb"], index=server["ep2"])
    doc = rep.doc
    assert rep.exit_code == 0 and doc["status"] == "match" and not doc["incomplete"], doc["incomplete"]
    loads = {(x["step"], x["model"], x["layer"], x["rank"]): x for x in doc["loads"]}
    # stage 0 owns layers 0-1, stage 1 layers 2-3; 5 routed EPLB slots + 1 shared per rank; the
    # draft (last stage only, no EPLB) fills 5 slots on rank 0 and 3 of 5 on rank 1 (8 experts).
    want = {(s, "target", L, f"pp{L // 2}-tp{t}"): 6 for s in (1, 2) for L in range(4) for t in (0, 1)}
    want |= {(1, "draft", 0, "pp1-tp0"): 5, (1, "draft", 0, "pp1-tp1"): 3}
    assert {k: v["slots"] for k, v in loads.items()} == want
    assert all(x["expected"] == x["captured"] == 4 * x["slots"] and not x["missing"] for x in loads.values())
    assert doc["totals"]["match"] == doc["totals"]["tensors"] == sum(4 * v for v in want.values())
    # every slot is labelled as SGLang's metadata placed it, before and after the rebalance
    rows = _rows(server, "eplb")
    for step, table in ((1, OLD_ROW), (2, NEW_ROW)):
        got = sorted({(r["slot"], r["expert"], r["expert_copy"]) for r in rows
                      if (r["step"], r["layer"], r["tp_rank"], r["pp_rank"], r["model"]) == (step, 2, 1, 1, "target")})
        routed = list(zip(range(5), table[5:], _copies(table)[5:]))
        assert got == routed + [(5, E, 1)]  # slot 5: the fused shared expert, id num_experts, rank 1's copy
    draft = {(r["tp_rank"], r["slot"], r["expert"]) for r in rows if r["model"] == "draft"}
    assert draft == {(0, i, i) for i in range(5)} | {(1, i, 5 + i) for i in range(3)}


def test_identity_steps_and_models_in_the_manifests(server):
    ms = read_manifests(server["out"], "eplb")
    assert sorted(ms) == ["pp0-tp0", "pp0-tp1", "pp1-tp0", "pp1-tp1"]  # same TP rank, two stages: two folders
    for label, m in ms.items():
        assert (m["pp_size"], m["pp_rank"], m["tp_rank"], m["replica"], m["rank_label"]) == (
            2, int(label[2]), int(label[-1]), None, label)
        assert m["rank_found_by"] == {"tp": "sglang", "pp": "sglang", "replica": "default"}
        target = m["models"]["target"]
        assert target["steps_found_by"] == "model-runner-pass-id" and target["found_by"] == "runner.is_draft_worker"
        assert target["layers"] == ([0, 1] if label.startswith("pp0") else [2, 3])
        assert target["slot_maps"] == {"eplb+shared": 2 * 2}
        if label.startswith("pp1"):
            assert m["models"]["draft"]["layers"] == [0] and m["models"]["draft"]["slot_maps"] == {"ep-contiguous": 1}
    kt = read_manifests(server["out"], "kt")
    assert sorted(kt) == ["replica0-tp0", "replica0-tp1", "replica1-tp0", "replica1-tp1"]
    assert {(m["replica"], m["tp_rank"], m["rank_found_by"]["replica"]) for m in kt.values()} == {
        (d, t, "env") for d in (0, 1) for t in (0, 1)}
    assert all(m["models"]["target"]["slot_maps"] == {"kt-staged": 1, "kt-gpu-index": 2} for m in kt.values())


def test_corruptions_are_named_by_slot_model_and_copy(server):
    rep = analyze([f"{server['out']}/eplb-bad"], index=server["ep2"])
    got = sorted(r["sentence"] for r in rep.doc["divergent_rows"])
    assert rep.exit_code == 1 and got == [
        "step 1, draft layer 0, rank pp1-tp0, expert 2: w13_weight_scale_inv holds the tensor of target layer 0, expert 2",
        "step 1, layer 1, rank pp0-tp1, slot 5 (shared expert): w2_weight holds expert 2",
        "step 2, layer 1, rank pp0-tp1, slot 5 (shared expert): w2_weight holds expert 2",
        "step 2, layer 2, rank pp1-tp1, slot 4 (logical expert 1, redundant copy 1): w13_weight holds expert 3 (E+2)",
    ]
    summaries = [s["sentence"] for s in rep.doc["summaries"]]
    assert "rank pp1-tp0, draft layer 0, step 1: 1/5 w13_weight_scale_inv hold target layer 0's tensors" in summaries
    assert "rank pp0-tp1, layer 1, step 1: 1/6 w2_weight hold expert 2" in summaries


def test_kt_dynamic_update_reported_staged_and_resident(server):
    rep = analyze([f"{server['out']}/kt"], index=server["tp2"])
    assert rep.exit_code == 1 and not rep.doc["incomplete"]
    got = [r["sentence"] for r in rep.doc["divergent_rows"]]
    assert got == [
        "step 1, layer 0, rank replica1-tp1, expert 5: w2_weight_scale_inv holds expert 7 (E+2)",
        "step 1, layer 0, rank replica1-tp1, slot 0 (logical expert 5): w2_weight_scale_inv holds expert 7 (E+2)",
        "step 2, layer 0, rank replica1-tp1, slot 0 (logical expert 5): w2_weight_scale_inv holds expert 7 (E+2)",
    ]
    assert [r["source"] for r in rep.doc["divergent_rows"]] == ["staged", "resident", "resident"]
    # the fork's own update moved the hot experts 5, 6, 7 into the 3 GPU slots, on every rank of both replicas
    resident = {(r["replica"], r["tp_rank"], r["slot"], r["expert"]) for r in _rows(server, "kt") if r["source"] == "resident"}
    assert resident == {(d, t, s, 5 + s) for d in (0, 1) for t in (0, 1) for s in range(3)}


def test_index_holds_the_shared_expert_and_the_draft_from_the_checkpoint(server):
    """Qwen3.5: mlp.shared_expert as expert num_experts, mtp.layers.0 as the draft's layer 0,
    equal to shards cut here from synthetic_values (moe_tp 1: the whole tensors)."""
    from moetrace.checkpoints.synthetic import DRAFT_VALUE_LAYER, synthetic_values
    from moetrace.fingerprint import fingerprint

    def w13(layer, expert):
        rows, cols = torch.arange(CKPT["intermediate"]).view(-1, 1), torch.arange(CKPT["hidden"]).view(1, -1)
        return torch.cat([synthetic_values(layer, expert, p, rows, cols, "weight", seed=CKPT["seed"]) for p in (0, 1)])

    t = read_index(server["ep2"])
    rows = {(r["model"], r["layer"], r["expert"], r["tensor"]): r["digest"] for r in t.to_pylist()}
    assert rows[("target", 3, E, "w13_weight")] == fingerprint(w13(3, E)).digest
    assert rows[("draft", 0, 6, "w13_weight")] == fingerprint(w13(DRAFT_VALUE_LAYER, 6)).digest
    assert rows[("draft", 0, 6, "w13_weight")] != rows[("target", 0, 6, "w13_weight")]
    assert {k[1:3] for k in rows if k[0] == "draft"} == {(0, e) for e in range(E)}
    meta = json.loads(t.schema.metadata[INDEX_META_KEY])
    assert meta["shared_experts"] == 1 and meta["draft"] == {"format": "fp8_block", "layers": [0]}


def _without(index: str, out: Path, drop, **meta) -> str:
    """The index without some rows (as if the checkpoint side could not build them)."""
    t = read_index(index)
    keep = pa.array([not drop(r) for r in t.select(["model", "expert"]).to_pylist()])
    m = {**json.loads(t.schema.metadata[INDEX_META_KEY]), **meta}
    write_index(t.filter(keep).replace_schema_metadata({INDEX_META_KEY: json.dumps(m).encode()}), out)
    return str(out)


def test_what_the_index_cannot_check_is_said_by_name(server, tmp_path):
    no_draft = _without(server["ep2"], tmp_path / "a.parquet", lambda r: r["model"] == "draft",
                        draft={"excluded": "draft model (mtp.*): format fp8_block needs F8_E4M3 expert weights"})
    rep = analyze([f"{server['out']}/eplb"], index=no_draft)
    assert rep.exit_code == 2 and rep.doc["status"] == "incomplete"
    assert any("32 captured entries cannot be checked: draft model not checked (draft model (mtp.*): format" in x
               for x in rep.doc["incomplete"])
    no_shared = _without(server["ep2"], tmp_path / "b.parquet", lambda r: r["expert"] >= E, shared_experts=0)
    rep = analyze([f"{server['out']}/eplb-bad"], index=no_shared)
    assert rep.exit_code == 1 and any("fused shared-expert slots not checked" in x for x in rep.doc["incomplete"])
    assert all("shared expert" not in r["sentence"] for r in rep.doc["divergent_rows"])  # never a divergence


def test_a_second_process_with_one_identity_is_refused(make_ckpt, tmp_path, caplog):
    from moetrace.hooks import sglang_hook

    model = st.CheckpointModel(make_ckpt(num_layers=1, num_experts=4, hidden=128, intermediate=128, seed=1), 1)
    sink = st.open_rank(model, str(tmp_path), "dup", 0, tp_size=1)
    st.capture_load(sink, model, 0, 0, 0)
    assert sink.close()
    claim = tmp_path / "dup" / "rank=0" / "_claim.json"
    owner = json.loads(claim.read_text())
    claim.write_text(json.dumps({**owner, "pid": owner["pid"] + 1}))  # the folder belongs to another process
    assert sglang_hook.make_hook({"out": str(tmp_path), "run_id": "dup", "tp_rank": 0, "tp_size": 1}) is None
    assert "two processes identify as rank 0" in caplog.text
    (refusal,) = [p for p in os.listdir(tmp_path / "dup") if p.startswith("_refused-")]
    rep = analyze([str(tmp_path / "dup")], index=model.write_index(str(tmp_path / "i.parquet")))
    assert rep.exit_code == 2 and any("was refused: rank 0 already belonged to pid" in x for x in rep.doc["incomplete"])
    assert json.loads((tmp_path / "dup" / "rank=0" / "_manifest.json").read_text())["finished"]  # untouched
    # an owner of an earlier launch under the same run id (another run_nonce) is said as such
    claim.write_text(json.dumps({**owner, "pid": owner["pid"] + 2, "run_nonce": "a" * 32}))
    cfg = {"out": str(tmp_path), "run_id": "dup", "tp_rank": 0, "tp_size": 1, "run_nonce": "b" * 32}
    assert sglang_hook.make_hook(cfg) is None and "of an earlier launch of run id 'dup'" in caplog.text
    rep = analyze([str(tmp_path / "dup")], index=str(tmp_path / "i.parquet"))
    assert any("(a process of an earlier launch under the same run id; " in x for x in rep.doc["incomplete"])


def test_replica_and_stage_detection(monkeypatch):
    from moetrace.hooks.ranks import detect_process
    from moetrace.tracer.config import TraceConfig

    cfg = TraceConfig.from_dict({"out": "x"})
    monkeypatch.delenv("SGLANG_DP_RANK", raising=False)
    # 0.5.23's published ParallelContext: dp_size counts replicas (DP attention is attn_dp_size)
    for dp_size, want in ((2, 1), (1, None)):
        par = types.SimpleNamespace(dp_size=dp_size, dp_rank=1, pp_rank=1, pp_size=2)
        monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", types.SimpleNamespace(get_parallel=lambda p=par: p))
        p = detect_process(cfg)
        assert (p.replica, p.pp_rank, p.pp_size, p.found_by["pp"], p.found_by["replica"]) == (want, 1, 2, "sglang", "sglang")
    monkeypatch.delitem(sys.modules, "sglang.srt.runtime_context")
    # the fork: ModelRunner(dp_rank=...) with server_args; DP attention keeps one world (no replicas)
    for attention, want in ((False, 3), (True, None)):
        runner = types.SimpleNamespace(server_args=types.SimpleNamespace(dp_size=4, enable_dp_attention=attention))
        assert detect_process(cfg, runner, dp_rank=3).replica == want
    monkeypatch.setenv("SGLANG_DP_RANK", "2")  # a router-launched replica
    assert detect_process(cfg).replica == 2 and detect_process(TraceConfig.from_dict({"out": "x", "replica": 0})).replica == 0


def test_hook_manager_pass_counter_and_layer_order_fallback(make_ckpt, tmp_path):
    """A hook manager that counts passes on model.model (``_worker_forward_pass_id``) gives the
    steps; a factory called outside register_forward_hooks falls back to layer order."""
    from test_hooks import build_model

    from moetrace.hooks import sglang_hook

    model = build_model(make_ckpt(num_layers=2, num_experts=4, hidden=128, intermediate=128, seed=2))
    model.model._worker_forward_pass_id = -1  # the newer hook manager's tracker on model.model
    spec = [{"name": "m", "target_modules": ["model.layers.*.mlp.experts"], "hook_factory": sglang_hook.__name__ + ":make_hook",
             "config": {"out": str(tmp_path), "run_id": "hm", "tp_rank": 0, "tp_size": 1}}]
    load_hook_manager().register_forward_hooks(model, spec)
    for pass_id in (40, 41):  # a server that had run passes before tracing saw any
        model.model._worker_forward_pass_id = pass_id
        model(torch.zeros(2))
    assert sglang_hook.close_all()
    m = read_manifests(str(tmp_path), "hm")["0"]
    assert m["models"]["target"]["steps_found_by"] == "hook-manager-pass-id"
    assert sorted({r["step"] for r in st.read_rows(str(tmp_path), "hm").to_pylist()}) == [40, 41]
    direct = sglang_hook.make_hook({"out": str(tmp_path), "run_id": "direct", "tp_rank": 0, "tp_size": 1})
    assert direct is not None
    assert sglang_hook.close_all()
    assert read_manifests(str(tmp_path), "direct")["0"]["models"]["target"]["steps_found_by"] == "layer-order"


def test_launch_flags_by_distribution_and_help(tmp_path):
    from moetrace.servers.command import (
        LEGACY_CUDA_GRAPH_FLAGS,
        SPLIT_CUDA_GRAPH_FLAGS,
        cuda_graph_flags_for,
        invokes_sglang,
        server_distribution,
    )
    from moetrace.servers.launcher import Launcher

    fork = fork_root()
    assert server_distribution() == ("sglang", "0.5.23")
    if fork is not None:
        assert server_distribution([str(fork)]) == ("sglang-kt", "0.7.2")
        fork_args = (fork / "sglang" / "srt" / "server_args.py").read_text()
        assert '"--disable-cuda-graph"' in fork_args and "disable-prefill-cuda-graph" not in fork_args
    # the facts the choice rests on, in the installed 0.5.23: split fields, the legacy spelling deprecated
    up = installed_root("sglang") / "sglang" / "srt"
    assert "disable_prefill_cuda_graph: A[" in (up / "arg_groups" / "fields" / "exec_.py").read_text()
    assert '"--disable-cuda-graph",\n            action=DeprecatedStoreTrueAction' in (up / "server_args.py").read_text()
    never = ["/nonexistent/server"]  # the fork's distribution decides without asking the command
    assert cuda_graph_flags_for(never, "auto", ("sglang-kt", "0.7.2")) == (LEGACY_CUDA_GRAPH_FLAGS, "distribution")
    split = tmp_path / "split.py"
    split.write_text("import argparse; p = argparse.ArgumentParser()\n"
                     "for f in ('--disable-prefill-cuda-graph', '--disable-decode-cuda-graph', '--disable-cuda-graph'):\n"
                     "    p.add_argument(f, action='store_true')\np.parse_args()\n")
    legacy = tmp_path / "legacy.py"
    legacy.write_text("import argparse; p = argparse.ArgumentParser(); p.add_argument('--disable-cuda-graph', "
                      "action='store_true'); p.parse_args()\n")
    sglang = ("sglang", "0.5.23")
    assert cuda_graph_flags_for([sys.executable, str(split), "--tp", "2"], "auto", sglang) == (SPLIT_CUDA_GRAPH_FLAGS, "help")
    assert cuda_graph_flags_for([sys.executable, str(legacy)], "auto", sglang) == (LEGACY_CUDA_GRAPH_FLAGS, "help")
    assert cuda_graph_flags_for(never, "auto", sglang) == (LEGACY_CUDA_GRAPH_FLAGS, "default")
    assert cuda_graph_flags_for(never, "split") == (SPLIT_CUDA_GRAPH_FLAGS, "option")
    # the launcher probes only a command that starts SGLang itself; another one (which may
    # ignore --help and serve) gets the legacy flag, and only once the launch is accepted
    assert invokes_sglang([sys.executable, "-m", "sglang.launch_server", "--tp", "2"]) and invokes_sglang(["sglang", "serve"])
    assert not invokes_sglang([sys.executable, str(split), "--tp", "2"])
    lch = Launcher([sys.executable, "-c", "pass"], {"out": str(tmp_path / "t"), "run_id": "F"}, echo=lambda m: None)
    assert lch.flags is None and lch.run() == 0
    assert (lch.flags, lch.flags_found_by) == (LEGACY_CUDA_GRAPH_FLAGS, "default") and lch.cmd[-1] == LEGACY_CUDA_GRAPH_FLAGS[0]
    run = json.loads((tmp_path / "t" / "F" / "_run.json").read_text())
    assert run["cuda_graph_flags_found_by"] == "default" and run["command"] == lch.cmd


def test_guard_verifies_eplb_slots_and_the_draft_by_model(server, tmp_path):
    """The in-server guard reads the rows of its moe_tp_rank: EPLB slots (a redundant copy
    included) match, a pass over every layer's held slots is full coverage, and the draft's
    layer 0 is compared with the draft's rows, never the target's layer 0."""
    from moetrace.checkpoints.reader import draft_checkpoint, open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_experts
    from moetrace.tracer.capture import Tracer
    from moetrace.tracer.config import TraceConfig

    ckpt = open_checkpoint(server["ckpt"])
    draft = draft_checkpoint(ckpt)[0]
    held = OLD_ROW[:5]  # rank 0 of EP2: logical 0-3 and a redundant copy of 0
    shards = {L: expected_experts(ckpt, L, 0, Parallel(2, 2)) for L in range(4)}
    draft0 = expected_experts(draft, 0, 0, Parallel(2, 2))
    conf = TraceConfig.from_dict({"out": str(tmp_path), "run_id": "g", "index": server["ep2"], "guard": "record",
                                  "flush_interval_s": 0.2})
    tr = Tracer(conf, 0, 2)
    try:
        for L in range(4):
            tr.capture({k: v[held] for k, v in shards[L].items()}, layer=L, source="resident", step=0, experts=held,
                       copies=_copies(held), slot_count=5)
        tr.capture({k: v[:5] for k, v in draft0.items()}, layer=0, source="resident", step=0, experts=range(5),
                   model="draft", slot_count=5)
        g = tr.sink.manifest()["guard"]
        assert g["tensors"]["mismatch"] == 0 and g["tensors"]["match"] == 4 * 4 * 5 + 4 * 5
        assert g["coverage"] == {"resident": 1.0}
        tr.capture({k: v[:5] for k, v in shards[0].items()}, layer=0, source="resident", step=1, experts=range(5),
                   model="draft", slot_count=5)  # the target's layer 0 where the draft's belongs
        g = tr.sink.manifest()["guard"]
        assert g["tensors"]["mismatch"] == 4 * 5 and g["mismatches"][0]["model"] == "draft"
    finally:
        tr.close()


def test_tp_rank_comes_from_sglangs_parallel_state_before_the_global_rank(monkeypatch):
    """Under pipeline parallelism the global torch.distributed rank is tp_size * pp_rank +
    tp_rank: SGLang's own state answers first. 0.5.23 publishes a ParallelContext and keeps
    the getters in parallel_state only (not exported by sglang.srt.distributed); the fork
    exports them from sglang.srt.distributed."""
    import torch.distributed as dist

    from moetrace.hooks.ranks import detect_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)  # TP2 x PP2: stage 1, TP rank 1
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    for name in ("sglang.srt.runtime_context", "sglang.srt.distributed", "sglang.srt.distributed.parallel_state"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert detect_rank() == (3, 4, "torch.distributed")  # nothing of SGLang loaded: the global rank, said so
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", types.SimpleNamespace())  # 0.5.23: no getters exported
    getters = types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: 1, get_tensor_model_parallel_world_size=lambda: 2)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.parallel_state", getters)
    assert detect_rank() == (1, 2, "sglang")
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.parallel_state", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", getters)  # the fork
    assert detect_rank() == (1, 2, "sglang")
    par = types.SimpleNamespace(tp_rank=0, tp_size=2)  # the published context wins over everything else
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", types.SimpleNamespace(get_parallel=lambda: par))
    assert detect_rank() == (0, 2, "sglang")
    assert detect_rank(tp_rank=1, tp_size=2) == (1, 2, "config")
