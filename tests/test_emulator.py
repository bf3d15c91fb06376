"""The emulated KT staging transport: the race caught every run unfenced, never fenced.

Content is checked directly against the checkpoint's expected TP shards
(moetrace.checkpoints.shards.expected_layer), not through moetrace's analysis.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from moetrace.checkpoints.reader import open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_layer
from moetrace.emulator import reference_outputs, run_emulation, shm
from moetrace.emulator.config import WEIGHT_NAMES_FP8
from moetrace.emulator.copy_engine import CopyEngine, StagingTimeout
from moetrace.emulator.engine import normalize_request
from moetrace.emulator.forward_hooks import parse_forward_hooks, register_forward_hooks, resolve_callable
from moetrace.errors import MoetraceError

E = 8  # experts in the default synthetic checkpoint
BASE = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs."
REQUESTS = [
    {"prompt": BASE, "max_tokens": 4},  # fresh: chunks 32, 32, 23 (all staged)
    {"prompt": BASE + " Again, and more.", "max_tokens": 3},  # replays the prefix: one staged chunk
    {"prompt": "Sphinx of black quartz, judge my vow!!", "max_tokens": 2},  # fresh: 32 staged, 6 resident
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt()


@pytest.fixture(scope="module")
def expected(ckpt):
    c = open_checkpoint(ckpt)
    spec = c.spec
    return {(L, r): expected_layer(c, L, r, Parallel(2)) for L in spec.moe_layers for r in range(2)}


@pytest.fixture(scope="module")
def reference(ckpt):
    return reference_outputs(ckpt, REQUESTS, tp=2)


def _hook_specs(out) -> list[dict]:
    return [
        {"name": "probe", "target_modules": ["model.layers.*.mlp.experts"],
         "hook_factory": "support.probes:record_calls", "config": {"out": str(out)}},
        {"name": "kt-loads", "target_modules": ["model.layers.0.mlp.experts"],
         "hook_factory": "support.probes.record_loads", "config": {"out": str(out)}},
    ]


@pytest.fixture(scope="module")
def unfenced(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("unfenced")
    res = run_emulation(ckpt, REQUESTS, tp=2, fence="none", slow_rank=1, snapshot_dir=str(d / "snap"),
                        forward_hooks=_hook_specs(d / "hooks"))
    return res, d


@pytest.fixture(scope="module")
def fenced(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("fenced")
    return run_emulation(ckpt, REQUESTS, tp=2, fence="all", slow_rank=1, snapshot_dir=str(d / "snap"))


def check_unfenced_loads(res, expected) -> int:
    """Every staged load: rank 1's w2_weight_scale_inv[e] holds expert e+2's bytes for
    e + 2 < E and its own otherwise; every other tensor on both ranks is correct."""
    loads = [rec for rec in res.loads]
    assert loads and {rec.rank for rec in loads} == {0, 1}
    for rec in loads:
        snap = res.snapshot(rec.rank, rec.load)
        exp = expected[(rec.layer, rec.rank)]
        for name in WEIGHT_NAMES_FP8:
            for e in range(E):
                got = snap[name][e]
                if rec.rank == 1 and name == "w2_weight_scale_inv" and e + 2 < E:
                    assert _same(got, exp[name][e + 2]), f"{rec}: {name}[{e}] is not expert {e + 2}"
                    assert not _same(got, exp[name][e])
                else:
                    assert _same(got, exp[name][e]), f"{rec}: {name}[{e}] differs from its shard"
    return len(loads)


def test_unfenced_rank1_holds_e_plus_2(unfenced, expected):
    res, _ = unfenced
    n = check_unfenced_loads(res, expected)
    # 3 requests: chunks of >= 8 tokens stage both MoE layers on both ranks.
    staged_chunks = sum(sum(1 for c in r.chunks if c >= 8) for r in res.requests)
    assert n == 2 * 2 * staged_chunks
    assert res.requests[1].cached_tokens == len(BASE)  # prefix-cache replay


def test_fenced_every_tensor_matches(fenced, expected):
    assert fenced.loads
    for rec in fenced.loads:
        snap = fenced.snapshot(rec.rank, rec.load)
        for name in WEIGHT_NAMES_FP8:
            assert _same(snap[name], expected[(rec.layer, rec.rank)][name]), f"{rec}: {name}"


def test_outputs_against_reference(unfenced, fenced, reference):
    res, _ = unfenced
    for got, ref in zip(fenced.requests, reference):
        assert got.output_ids == ref.output_ids
        assert torch.equal(got.token0_logits, ref.token0_logits)
        assert all(torch.equal(t, ref.token0_logits) for t in got.rank_token0_logits)
    for got, ref in zip(res.requests, reference):
        assert (got.token0_logits - ref.token0_logits).abs().max().item() > 1e-6
        assert all(torch.equal(t, got.token0_logits) for t in got.rank_token0_logits)  # the all-reduce agrees


def test_forward_hooks_see_the_experts(unfenced):
    res, d = unfenced
    for rank in (0, 1):
        assert sorted(res.hooks[rank]) == sorted(
            [("probe", "model.layers.0.mlp.experts"), ("probe", "model.layers.1.mlp.experts"),
             ("kt-loads", "model.layers.0.mlp.experts")])
        lines = [json.loads(x) for x in (d / "hooks" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [x["event"] for x in lines].count("factory") == 1
        calls = [x for x in lines if x["event"] == "call"]
        assert {c["layer_id"] for c in calls} == {0, 1}
        c = calls[0]
        assert c["class"] == "EmulatedFusedMoE" and c["moe_tp_rank"] == rank and c["moe_tp_size"] == 2
        assert c["num_experts"] == E
        assert c["params"]["w13_weight"] == [[E, 256, 256], "torch.float8_e4m3fn"]
        assert c["params"]["w2_weight_scale_inv"] == [[E, 2, 1], "torch.float32"]
        # A wrapper installed on SharedFullContext.load (the class attribute) sees every load.
        loads = [json.loads(x) for x in (d / "hooks" / f"loads_rank{rank}.jsonl").read_text().splitlines()]
        assert len(loads) == len([r for r in res.loads if r.rank == rank])
        assert {x["layer_idx"] for x in loads} == {0, 1}
        assert {x["gpu_layer_layer_id"] for x in loads} == {0}  # stale, as in the fork


def test_no_shared_memory_left(unfenced, fenced):
    for res in (unfenced[0], fenced):
        assert shm.list_segments(res.shm_prefix) == []


# -- small pieces, in process -----------------------------------------------------------


class _NeverReleased:
    tensor = "w2_weight_scale_inv"

    def released(self, tag):
        return False

    def describe(self, tag):
        return f"tag {tag} never released"


def test_held_copy_times_out_with_a_clear_error():
    eng = CopyEngine(1, torch.device("cpu"), timeout_s=0.5, hold=_NeverReleased())
    try:
        dst, src = torch.zeros(4), torch.ones(4)
        eng.copy(dst, src, "rank 1 layer 0 expert 3 w2_weight_scale_inv", hold=(1, 0, 3, 1, 7))
        t0 = time.monotonic()
        with pytest.raises(StagingTimeout, match="expert 3 w2_weight_scale_inv"):
            eng.record("layer 0 expert 3 copy event").synchronize()
        assert time.monotonic() - t0 < 5
    finally:
        eng.close()


def test_copy_engine_orders_events_behind_parked_copies():
    gate = threading.Event()

    class Hold:
        tensor = "x"

        def released(self, tag):
            return gate.is_set()

        def describe(self, tag):
            return "gate"

    eng = CopyEngine(1, torch.device("cpu"), timeout_s=5, hold=Hold())
    try:
        a, b = torch.zeros(2), torch.zeros(2)
        eng.copy(a, torch.ones(2), "held", hold=("t",))
        eng.copy(b, torch.full((2,), 2.0), "on time")
        ev = eng.record("both")
        time.sleep(0.05)
        assert torch.equal(b, torch.full((2,), 2.0))  # not blocked by the parked copy
        assert not ev.query() and torch.equal(a, torch.zeros(2))
        gate.set()
        ev.synchronize()
        assert torch.equal(a, torch.ones(2))
    finally:
        eng.close()


def test_forward_hooks_resolver_semantics(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    specs = parse_forward_hooks(json.dumps([
        {"name": "a", "target_modules": ["0"], "hook_factory": "support.probes:record_calls",
         "config": {"out": str(tmp_path)}},
        {"name": "no-targets", "hook_factory": "support.probes:record_calls"},
        {"name": "no-match", "target_modules": ["nothing.*"], "hook_factory": "support.probes.record_calls",
         "config": {"out": str(tmp_path)}},
    ]))
    assert register_forward_hooks(model, specs) == [("a", "0")]
    model(torch.zeros(1, 2))
    assert '"event": "call"' in (tmp_path / "rank0.jsonl").read_text()
    assert parse_forward_hooks("") == ()
    assert len(parse_forward_hooks('{"name": "one"}')) == 1
    with pytest.raises(MoetraceError, match="not valid JSON"):
        parse_forward_hooks("[{")
    with pytest.raises(MoetraceError, match="cannot import"):
        resolve_callable("no_such_pkg_xyz.mod:fn")
    with pytest.raises(MoetraceError, match="has no attribute"):
        resolve_callable("support.probes:nope")


def test_request_normalization():
    assert normalize_request("hi") == {"prompt_ids": [104, 105], "max_tokens": 16}
    assert normalize_request({"prompt": [1, 2], "max_tokens": 0}) == {"prompt_ids": [1, 2], "max_tokens": 0}
    for bad in ({"prompt": ""}, {"prompt": [300]}, {"prompt": "x", "max_tokens": -1}, {"nope": 1}):
        with pytest.raises(MoetraceError):
            normalize_request(bad)


def test_config_refusals(ckpt):
    with pytest.raises(MoetraceError, match="slow-rank 0"):
        run_emulation(ckpt, ["x"], tp=2, slow_rank=0)
    with pytest.raises(MoetraceError, match="fence"):
        run_emulation(ckpt, ["x"], tp=2, fence="some")
    with pytest.raises(MoetraceError, match="not a multiple of the FP8 block"):
        run_emulation(ckpt, ["x"], tp=4)


def test_failed_cuda_host_register_raises_and_releases(monkeypatch):
    # cudart returns an error code instead of raising: a failure must not leave
    # pageable slots behind silently (nor the segments).
    from moetrace.emulator import staging

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr))
            return 0 if len(calls) == 1 else 1

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    def check_error(res):
        if res != 0:
            raise RuntimeError(f"error {res}")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    prefix = shm.new_prefix()
    layout = shm.SlotLayout(("a", "b"), ((4, 8), (2,)), (torch.float8_e4m3fn, torch.float32))
    control = shm.Control(prefix, 1, create=True)
    slots = shm.HostSlots(prefix, 0, 1, layout, create=True)
    with pytest.raises(RuntimeError, match="cudaHostRegister of host slot b failed"):
        staging._register_slots(slots, control, 0)
    assert [c[0] for c in calls] == ["register", "register", "unregister"] and calls[2][1] == calls[0][1]
    assert shm.list_segments(prefix) == []
