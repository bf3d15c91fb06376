"""selftest --server's parts without a server: the fault plan, moetrace's fault hook on a
FusedMoE-shaped module (held to the checkpoint's own shards), and the judgement, which must
fail when a fault is not named or something else diverges (the real servers run the whole
command: tests/test_sglang_server.py, tests/test_vllm_server.py)."""

from __future__ import annotations

import json

import pytest
import torch
from test_hooks import FakeFusedMoE

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer
from moetrace.errors import ExitCode, MoetraceError
from moetrace.hooks.faults import FaultHook, check_faults
from moetrace.jobs import selftest_server as st

CKPT = dict(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)


def test_the_plan_keeps_its_faults_apart_and_refuses_a_model_too_small(make_ckpt):
    ckpt = make_ckpt(**CKPT)
    faults = check_faults(st.plan_faults(str(ckpt), tp_size=2))
    places = [(f["rank"], f["layer"], f["tensor"], e) for f in faults for e in f["experts"]]
    assert len(places) == len(set(places)) == 6
    assert sorted(f["fault"] for f in faults) == ["other_rank", "swap", "swap", "zero"]
    assert next(f for f in faults if f["fault"] == "zero")["tensor"] == "w2_weight_scale_inv"  # a scale, when held
    assert [f["at_forward"] for f in faults if f["fault"] == "swap"] == [0, st.LATE_FORWARD]
    assert "other_rank" not in {f["fault"] for f in st.plan_faults(str(ckpt), tp_size=1)}  # TP1: no other shard
    assert "other_rank" not in {f["fault"] for f in st.plan_faults(str(ckpt), tp_size=2, other_rank=False)}
    small = make_ckpt(num_layers=1, num_experts=4, hidden=128, intermediate=256, seed=3)
    with pytest.raises(MoetraceError, match="at least 4 experts"):
        st.plan_faults(str(small), tp_size=2, ep_size=2)


def test_the_fault_command_puts_the_fault_hook_before_moetraces():
    cmd = st.fault_command(["python", "-m", "sglang.launch_server", "--forward-hooks", '[{"name": "theirs"}]'],
                           [{"fault": "kill", "rank": 1, "at_forward": 3}])
    hooks = json.loads(cmd[cmd.index("--forward-hooks") + 1])
    assert [h["name"] for h in hooks] == ["theirs", "moetrace-faults"] and cmd.count("--forward-hooks") == 1
    assert hooks[1]["hook_factory"] == st.FAULT_HOOK


def _layer(ckpt, layer: int, tp_rank: int):
    shards = expected_layer(open_checkpoint(ckpt), layer, tp_rank, Parallel(tp_size=2))
    module = FakeFusedMoE(layer, shards, 8, tp_rank, 2)
    # what SGLang's FusedMoE says of its layout (the other rank's shard is cut in it)
    module.intermediate_size_per_partition, module.use_flashinfer_trtllm_moe = 128, False
    return module, shards


def test_the_fault_hook_writes_each_fault_through_data_when_due(make_ckpt):
    ckpt = make_ckpt(**CKPT)
    module, shards = _layer(ckpt, 1, 0)
    faults = [{"fault": "swap", "rank": 0, "layer": 1, "tensor": "w2_weight", "experts": [0, 2], "at_forward": 0},
              {"fault": "zero", "rank": 0, "layer": 1, "tensor": "w13_weight_scale_inv", "experts": [1],
               "at_forward": 0},
              {"fault": "swap", "rank": 0, "layer": 1, "tensor": "w13_weight", "experts": [4, 6], "at_forward": 2},
              {"fault": "other_rank", "rank": 0, "layer": 1, "tensor": "w13_weight", "experts": [3],
               "from_moe_tp_rank": 1, "checkpoint": str(ckpt), "at_forward": 0},
              {"fault": "swap", "rank": 1, "layer": 1, "tensor": "w2_weight", "experts": [5, 7], "at_forward": 0}]
    hook = FaultHook(faults, rank=0)
    version = module.w2_weight._version
    hook(module, (), None)
    w2, w13 = module.w2_weight.data, module.w13_weight.data
    assert torch.equal(w2[0].view(torch.uint8), shards["w2_weight"][2].view(torch.uint8))
    assert torch.equal(w2[2].view(torch.uint8), shards["w2_weight"][0].view(torch.uint8))
    assert torch.equal(w2[5].view(torch.uint8), shards["w2_weight"][5].view(torch.uint8))  # rank 1's fault: not here
    assert not module.w13_weight_scale_inv.data[1].any()
    other = expected_layer(open_checkpoint(ckpt), 1, 1, Parallel(tp_size=2))["w13_weight"][3]
    assert torch.equal(w13[3].view(torch.uint8), other.view(torch.uint8))
    assert torch.equal(w13[4].view(torch.uint8), shards["w13_weight"][4].view(torch.uint8))  # the late one: not yet
    assert module.w2_weight._version == version  # through .data: no version counter moved
    hook(module, (), None)
    assert torch.equal(w13[4].view(torch.uint8), shards["w13_weight"][4].view(torch.uint8))
    hook(module, (), None)  # the third forward: after two clean ones
    assert torch.equal(w13[4].view(torch.uint8), shards["w13_weight"][6].view(torch.uint8))


def _report(rows: dict, steps: list[int], incomplete=()) -> dict:
    loads = [{"source": "resident", "model": "target", "rank": r, "layer": layer, "step": s}
             for r in ("0", "1") for layer in (0, 1) for s in steps]
    divergent = [{"rank": k[0], "layer": k[1], "tensor": k[2], "expert": k[3], "step": k[4], "verdict": v[0],
                  "k": v[1] if v[0] == "stale" else 0, "found": {"moe_tp_rank": v[1]} if v[0] == "wrong_rank" else None}
                 for k, v in rows.items()]
    return {"incomplete": list(incomplete), "divergent_rows_truncated": 0, "loads": loads, "divergent_rows": divergent}


def test_the_judgement_holds_the_audit_to_exactly_the_planned_faults(make_ckpt):
    faults = st.plan_faults(str(make_ckpt(**CKPT)), tp_size=2)
    steps = [3, 4, 5, 6]
    want = st.explained(faults, {(r, layer): steps for r in ("0", "1") for layer in (0, 1)})
    late = next(f for f in faults if f["at_forward"])
    assert {k[4] for k in want if (k[0], k[1], k[2]) == (str(late["rank"]), late["layer"], late["tensor"])} == {5, 6}
    assert st.judge_faults(_report(want, steps), faults).ok is True
    missed = dict(list(want.items())[1:])  # one faulty row read as a match
    j = st.judge_faults(_report(missed, steps), faults)
    assert j.ok is False and len(j.missed) == 1 and not j.unexplained
    extra = {**want, ("0", 0, "w2_weight", 7, 3): ("unknown", 0)}  # something no fault explains
    j = st.judge_faults(_report(extra, steps), faults)
    assert j.ok is False and j.unexplained == [["0", 0, "w2_weight", 7, 3]]
    misnamed = {k: (("stale", 5) if v[0] == "zeros" else v) for k, v in want.items()}
    assert st.judge_faults(_report(misnamed, steps), faults).ok is False
    assert st.judge_faults(_report(want, steps, ["rank 1 did not finish"]), faults).ok is None
    assert st.judge_faults(None, faults).ok is None
    ok, bad, unknown = st.Judgement(True, ""), st.Judgement(False, ""), st.Judgement(None, "")
    assert (st.verdict(ok, ok), st.verdict(bad, ok), st.verdict(ok, unknown), st.verdict(bad, unknown)) == (
        ExitCode.PASS, ExitCode.DIVERGENT, ExitCode.INCOMPLETE, ExitCode.DIVERGENT)
