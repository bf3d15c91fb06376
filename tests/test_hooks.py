"""hooks/: capture through SGLang's own register_forward_hooks, TP2 over gloo,
KT staged loads, faults, hook-spec and launch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.sglang_source import load_hook_manager
from support.traces import read_rows as read_trace
from torch import nn

from moetrace.hooks import sglang_hook
from moetrace.hooks.kt import GPU_COPIED, transport_positions
from moetrace.hooks.spec import DEFAULT_TARGETS, hook_spec
from moetrace.servers.command import SPLIT_CUDA_GRAPH_FLAGS, build_command, expected_tp
from moetrace.servers.launcher import Launcher
from moetrace.tracer.manifest import read_manifests

CKPT = dict(num_layers=2, num_experts=8, hidden=128, intermediate=256, seed=3)
# The launch tests wait for every rank to write a part before they stop the server: a part
# every 0.2 s instead of the default 5 s (docs/capture.md, flush_interval_s).
FAST_FLUSH = {"flush_interval_s": 0.2}
NAMES = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")


# ----------------------------------------------------------------- helpers


class FakeFusedMoE(nn.Module):
    """Module tree and params of SGLang's FusedMoE (FP8 block), forward is a no-op."""

    def __init__(self, layer_id, shards, num_experts, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1):
        super().__init__()
        self.layer_id = layer_id
        self.num_experts = num_experts
        self.num_local_experts = next(iter(shards.values())).shape[0]
        self.moe_tp_rank, self.moe_tp_size = tp_rank, tp_size
        self.moe_ep_rank, self.moe_ep_size = ep_rank, ep_size
        for k, v in shards.items():
            self.register_parameter(k, nn.Parameter(v.clone(), requires_grad=False))
        self.before = None  # optional callable(self) run at the start of forward (KT staging)

    def forward(self, x):
        if self.before is not None:
            self.before(self)
        return x + 1


class Block(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = experts


class FakeModel(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Block(e) for e in layers])

    def forward(self, x):
        for block in self.model.layers:
            x = block.mlp.experts(x)
            if dist.is_initialized():
                dist.all_reduce(x)
        return x


def build_model(ckpt_path, tp_rank=0, tp_size=1):
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_layer

    ckpt = open_checkpoint(ckpt_path)
    par = Parallel(tp_size=tp_size)
    layers = [
        FakeFusedMoE(L, expected_layer(ckpt, L, tp_rank, par), ckpt.spec.num_experts, tp_rank, tp_size)
        for L in ckpt.spec.moe_layers
    ]
    return FakeModel(layers)


def index_fps(index_path) -> dict:
    """(moe_tp_rank, layer, expert, tensor) -> digest of the target model's index rows."""
    t = pq.read_table(index_path).to_pylist()
    return {(r["moe_tp_rank"], r["layer"], r["expert"], r["tensor"]): r["digest"] for r in t if r["model"] == "target"}


@pytest.fixture
def index(make_ckpt, tmp_path):
    from moetrace.checkpoints.index import write_index
    from moetrace.checkpoints.index_build import build_index

    def make(tp_size=1):
        path = tmp_path / f"index-tp{tp_size}.parquet"
        write_index(build_index(make_ckpt(**CKPT), tp_size), path)
        return str(path)

    return make


@pytest.fixture(autouse=True)
def _close_tracers():
    yield
    sglang_hook.close_all(timeout=10)


def _spec(out, **config):
    return hook_spec({"out": str(out), "flush_interval_s": 0.2, **config})


# ----------------------------------------------------------------- through SGLang's hook manager


def test_sglang_register_forward_hooks_matches_index(make_ckpt, index, tmp_path):
    hm = load_hook_manager()
    idx = index(1)
    model = build_model(make_ckpt(**CKPT))
    spec = _spec(tmp_path, run_id="one", index=idx)
    hm.register_forward_hooks(model, spec)  # SGLang's code: resolve_callable + factory(config)
    for _ in range(3):
        model(torch.zeros(4))
    assert sglang_hook.close_all()
    t = read_trace(str(tmp_path), "one").to_pylist()
    assert len(t) == 3 * 2 * 8 * 4
    want = index_fps(idx)
    assert all(r["digest"] == want[(0, r["layer"], r["expert"], r["tensor"])] for r in t)
    assert {r["online"] for r in t} == {"match"}
    assert sorted({(r["step"], r["layer"]) for r in t}) == [(s, L) for s in range(3) for L in (0, 1)]
    m = read_manifests(str(tmp_path), "one")["0"]
    assert m["finished"] and m["hook_errors"] == 0 and m["online"] == {"match": len(t), "mismatch": 0, "unchecked": 0}
    # no runner names the model path here: the server's checkpoint is unknown, never taken from the index
    assert m["checkpoint_id"] is None and pq.read_table(idx).column("checkpoint_id")[0].as_py()
    assert m["tp_rank_found_by"] in ("default", "env")


def test_swapped_expert_slice_is_recorded_and_dumped(make_ckpt, index, tmp_path):
    hm = load_hook_manager()
    idx = index(1)
    model = build_model(make_ckpt(**CKPT))
    w = model.model.layers[1].mlp.experts.w2_weight_scale_inv
    with torch.no_grad():  # expert 3 ends up holding expert 5's down-proj scale (E+2)
        w[3] = w[5].clone()
    hm.register_forward_hooks(model, _spec(tmp_path, run_id="swap", index=idx, dump_max_count=1, chunk_digests="mismatch"))
    model(torch.zeros(2))
    model(torch.zeros(2))
    assert sglang_hook.close_all()
    t = read_trace(str(tmp_path), "swap").to_pylist()
    bad = [r for r in t if r["online"] == "mismatch"]
    assert [(r["step"], r["layer"], r["expert"], r["tensor"]) for r in bad] == [
        (0, 1, 3, "w2_weight_scale_inv"), (1, 1, 3, "w2_weight_scale_inv")]
    want = index_fps(idx)
    assert bad[0]["digest"] == want[(0, 1, 5, "w2_weight_scale_inv")]  # the bytes are expert 5's
    assert bad[0]["chunk_digests"] and all(r["chunk_digests"] is None for r in t if r["online"] == "match")
    m = read_manifests(str(tmp_path), "swap")["0"]
    assert m["dumps"]["count"] == 1 and m["dumps"]["skipped"] == 1 and m["online"]["mismatch"] == 2
    from safetensors import safe_open

    with safe_open(tmp_path / "swap" / "rank=0" / m["dumps"]["files"][0], "pt") as f:
        assert torch.equal(f.get_tensor("w2_weight_scale_inv"), w[5])
        assert f.metadata()["expected_digest"] == want[(0, 1, 3, "w2_weight_scale_inv")].hex()
    import pandas as pd  # docs/reference.md's call: a run folder with dumps reads as a plain dataset

    df = pd.read_parquet(tmp_path / "swap")
    assert len(df) == len(t) and sorted(df["rank"].astype(str).unique()) == ["0"]


# ----------------------------------------------------------------- TP2 over gloo, two processes


def _tp2_worker(rank, world, port, ckpt_path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        hm = load_hook_manager()
        model = build_model(ckpt_path, rank, world)
        # Rank detection: no tp_rank in the config; torch.distributed answers.
        hm.register_forward_hooks(model, json.loads(out["spec"]))
        for _ in range(3):
            model(torch.ones(4))
        assert sglang_hook.close_all(timeout=30)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_gloo_two_processes(make_ckpt, index, tmp_path):
    ckpt = make_ckpt(**CKPT)
    idx = index(2)
    spec = json.dumps(_spec(tmp_path, run_id="tp2", index=idx))
    mp.spawn(_tp2_worker, args=(2, _free_port(), str(ckpt), {"spec": spec}), nprocs=2, join=True)
    ms = read_manifests(str(tmp_path), "tp2")
    assert sorted(ms) == ["0", "1"] and all(m["finished"] and m["tp_rank_found_by"] == "torch.distributed" for m in ms.values())
    t = read_trace(str(tmp_path), "tp2").to_pylist()
    keys = {r: {(x["step"], x["layer"], x["expert"], x["tensor"]) for x in t if x["tp_rank"] == r} for r in (0, 1)}
    assert keys[0] == keys[1] and len(keys[0]) == 3 * 2 * 8 * 4  # rows line up by step
    want = index_fps(idx)
    assert all(x["digest"] == want[(x["tp_rank"], x["layer"], x["expert"], x["tensor"])] for x in t)
    assert {x["online"] for x in t} == {"match"}
    assert {(x["tp_rank"], x["tp_size"], x["moe_tp_rank"]) for x in t} == {(0, 2, 0), (1, 2, 1)}
    r0 = {(x["step"], x["layer"], x["expert"], x["tensor"]): x["digest"] for x in t if x["tp_rank"] == 0}
    r1 = {(x["step"], x["layer"], x["expert"], x["tensor"]): x["digest"] for x in t if x["tp_rank"] == 1}
    assert sum(r0[k] != r1[k] for k in r0) == len(r0)  # each rank holds its own shard


# ----------------------------------------------------------------- KT staged loads


class FakeSharedFullContext:
    """Stands in for the KT fork's SharedFullContext: ``load`` stages the experts of
    a layer into ``gpu_layer`` double-buffered, as the fork dispatches them: FP8
    passes original_layer=None (every expert staged, id order), BF16 copies the
    GPU-mask experts first. race=True reproduces the bug: the last tensor copied
    (w2 scale) of expert idx holds the bytes of the expert two places later (E+2)."""

    def __init__(self, host_layers: dict, race=False):
        self.host = host_layers  # layer -> {name: [E, ...]}
        first = next(iter(host_layers.values()))
        self.gpu_layer = FakeFusedMoE(99, {k: torch.zeros_like(v) for k, v in first.items()}, first["w13_weight"].shape[0])
        self.race = race

    def load(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
        src = self.host[layer_idx]
        n = src["w13_weight"].shape[0]
        if "w13_weight_scale_inv" in src or "w13_weight_scale" in src:
            original_layer = None  # sglang-kt 0.7.2 SharedFullContext.load, FP8 block and channel
        use_mask = gpu_experts_mask is not None and original_layer is not None and logical_to_gpu_index is not None
        cpu = [e for e in range(n) if not (use_mask and bool(gpu_experts_mask[e]))]
        with torch.no_grad():
            for e in range(n):
                if e not in cpu:
                    for k in NAMES:
                        getattr(self.gpu_layer, k)[e].copy_(getattr(original_layer, k)[int(logical_to_gpu_index[e])])
            for idx, e in enumerate(cpu):
                for k in NAMES:
                    stale = self.race and k == "w2_weight_scale_inv" and idx + 2 < len(cpu)
                    getattr(self.gpu_layer, k)[e].copy_(src[k][cpu[idx + 2] if stale else e])
        return None


def test_transport_positions_from_each_load_signature():
    mask = torch.tensor([True, False, False, True, False])
    assert transport_positions(5, {"layer_idx": 0, "original_layer": object(), "gpu_experts_mask": mask,
                                "logical_to_gpu_index": torch.arange(5)}) == ([-1, 0, 1, -1, 2], "cpu-expert-order")
    assert transport_positions(3, {"original_layer": None, "gpu_experts_mask": None,
                                "logical_to_gpu_index": None}) == ([0, 1, 2], "all-cpu")
    ids = {"original_layer": object(), "gpu_expert_ids_t": torch.tensor([2]), "cpu_expert_ids_t": torch.tensor([3, 0, 1]),
           "gpu_indices_t": torch.tensor([0])}
    assert transport_positions(4, ids) == ([1, 2, GPU_COPIED, 0], "cpu-expert-order")
    assert transport_positions(2, {"original_layer": None}) == ([0, 1], "expert-index")
    masked = {"layer_idx": 0, "original_layer": object(), "gpu_experts_mask": mask, "logical_to_gpu_index": torch.arange(5)}
    # The fork stages every FP8 expert whatever the mask (load passes original_layer=None);
    # BF16 keeps the resident-first copy.
    assert transport_positions(5, masked, "fp8_block") == ([0, 1, 2, 3, 4], "all-staged")
    assert transport_positions(5, masked, "fp8_channel") == ([0, 1, 2, 3, 4], "all-staged")
    assert transport_positions(5, masked, "bf16") == ([-1, 0, 1, -1, 2], "cpu-expert-order")


def test_staged_format_from_tensors_and_fork_flags():
    from types import SimpleNamespace

    from moetrace.hooks.kt import staged_format

    plain = SimpleNamespace()
    assert staged_format(plain, {"w13_weight": 0, "w13_weight_scale_inv": 0}) == "fp8_block"
    assert staged_format(plain, {"w13_weight": 0, "w13_weight_scale": 0}) == "fp8_channel"
    assert staged_format(plain, {"w13_weight": 0, "w2_weight": 0}) == "bf16"
    mxfp4 = SimpleNamespace(_is_mxfp4_quant=True)  # FP8-block names, other bytes: the fork's flag wins
    assert staged_format(mxfp4, {"w13_weight": 0, "w13_weight_scale_inv": 0}) == "mxfp4"
    int4 = SimpleNamespace(_is_mxfp4_quant=False, _is_fp8_quant=False, _is_bf16_quant=False)  # load()'s fall-through
    assert staged_format(int4, {"w13_weight_scale": 0, "w2_weight_scale": 0}) == "int4"


def test_kt_staged_load_capture_via_factory(make_ckpt, index, tmp_path, monkeypatch):
    """The factory finds SharedFullContext in the (fake) KT module, wraps load; the
    forward of each layer stages it first, like KTEPWrapperMethod.apply does."""
    import types

    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_layer

    hm = load_hook_manager()
    idx = index(1)
    ckpt = open_checkpoint(make_ckpt(**CKPT))
    host = {L: expected_layer(ckpt, L, 0, Parallel(1)) for L in ckpt.spec.moe_layers}
    fake_kt = types.ModuleType("sglang.srt.layers.moe.kt_ep_wrapper")

    class SharedFullContext(FakeSharedFullContext):
        pass

    SharedFullContext.load = FakeSharedFullContext.load  # defined on the class itself, as in the fork
    fake_kt.SharedFullContext = SharedFullContext
    monkeypatch.setitem(sys.modules, fake_kt.__name__, fake_kt)
    ctx = SharedFullContext(host, race=True)
    model = build_model(make_ckpt(**CKPT))
    mask = torch.tensor([e in (2, 6) for e in range(8)])
    l2g = torch.arange(8)

    def stage(module):
        ctx.load(module.layer_id, None, module, mask, l2g)

    for block in model.model.layers:
        block.mlp.experts.before = stage
    spec = _spec(tmp_path, run_id="kt", index=idx)
    hm.register_forward_hooks(model, spec)
    assert sglang_hook.make_hook(spec[0]["config"]) is not None  # a second factory call: no double wrap
    assert SharedFullContext.load.__moetrace_original__ is FakeSharedFullContext.load
    try:
        for _ in range(2):
            model(torch.zeros(2))
    finally:
        for cap in list(sys.modules["moetrace.hooks.kt"]._ATTACHED.values()):
            cap.detach()
    assert SharedFullContext.load is FakeSharedFullContext.load
    assert sglang_hook.close_all()
    t = read_trace(str(tmp_path), "kt").to_pylist()
    staged = [r for r in t if r["source"] == "staged"]
    resident = [r for r in t if r["source"] == "resident"]
    assert len(staged) == len(resident) == 2 * 2 * 8 * 4
    assert {(r["step"], r["layer"]) for r in staged} == {(r["step"], r["layer"]) for r in resident}
    cpu_order = list(range(8))  # FP8: the GPU mask given to load changes nothing, every expert is staged
    orders = {r["expert"]: r["transport_position"] for r in staged}
    assert orders == {e: e for e in range(8)}
    bad = {(r["expert"], r["tensor"]) for r in staged if r["online"] == "mismatch"}
    # every expert but the last two of the order got E+2's scale
    assert bad == {(e, "w2_weight_scale_inv") for e in cpu_order[:-2]}
    want = index_fps(idx)
    for r in staged:
        if r["online"] == "mismatch":
            e2 = cpu_order[cpu_order.index(r["expert"]) + 2]
            assert r["digest"] == want[(0, r["layer"], e2, r["tensor"])]
    assert {r["online"] for r in resident} == {"match"}


def test_slot_to_global_expert_ids(tmp_path):
    from types import SimpleNamespace

    from moetrace.hooks.slots import read_slot_map

    ep = FakeFusedMoE(0, {"w2_weight": torch.zeros(4, 2)}, 8, ep_rank=1, ep_size=2)
    m = read_slot_map(ep, 4, 0)
    assert (m.experts, m.copies, m.found_by) == ([4, 5, 6, 7], [0] * 4, "ep-contiguous")
    kt = SimpleNamespace(quant_method=SimpleNamespace(gpu_index_to_logical=torch.tensor([5, 1, 7])))
    assert read_slot_map(kt, 3, 0).experts == [5, 1, 7] and read_slot_map(kt, 3, 0).found_by == "kt-gpu-index"
    inv = SimpleNamespace(quant_method=SimpleNamespace(logical_to_gpu_index=torch.tensor([-1, 1, -1, 0])))
    assert read_slot_map(inv, 2, 0).experts == [3, 1] and read_slot_map(inv, 2, 0).found_by == "kt-logical-index"
    none = SimpleNamespace(quant_method=SimpleNamespace(num_gpu_experts=0))
    assert read_slot_map(none, 1, 0) is None
    # Through the hook: EP rank 1 of 2 records global ids 4..7 in slots 0..3.
    tr = sglang_hook.get_tracer(sglang_hook.TraceConfig.from_dict({"out": str(tmp_path), "run_id": "ep", "tp_rank": 1, "tp_size": 2}))
    sglang_hook.FusedMoECapture(tr)(ep, (), None)
    assert tr.close()
    rows = read_trace(str(tmp_path), "ep").to_pylist()
    assert [(r["expert"], r["slot"], r["ep_rank"], r["ep_size"], r["slot_count"]) for r in rows] == [
        (4 + i, i, 1, 2, 4) for i in range(4)]


def test_hook_skips_cuda_graph_capture_passes(tmp_path, monkeypatch):
    # A pass the server records into a CUDA graph runs no kernels and forbids
    # host syncs: the hook must neither capture nor count it as a step.
    ep = FakeFusedMoE(0, {"w2_weight": torch.zeros(4, 2)}, 4)
    tr = sglang_hook.get_tracer(sglang_hook.TraceConfig.from_dict({"out": str(tmp_path), "run_id": "graph", "tp_rank": 0, "tp_size": 1}))
    hook = sglang_hook.FusedMoECapture(tr)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        hook(ep, (), None)
        hook(ep, (), None)
    hook(ep, (), None)
    assert tr.close()
    rows = read_trace(str(tmp_path), "graph").to_pylist()
    assert [(r["step"], r["expert"]) for r in rows] == [(0, e) for e in range(4)]
    m = read_manifests(str(tmp_path), "graph")["0"]
    assert m["hook_errors"] == 0 and any("CUDA-graph capture" in n for n in m["notes"])


# ----------------------------------------------------------------- faults


class _Exploding(FakeFusedMoE):
    @property
    def w2_weight(self):  # a param read that fails inside the hook
        raise RuntimeError("device lost")


def test_hook_error_is_counted_and_disables_after_limit(make_ckpt, tmp_path):
    hm = load_hook_manager()
    good = build_model(make_ckpt(**CKPT))
    bad = _Exploding(0, {k: v for k, v in good.model.layers[0].mlp.experts.named_parameters() if k != "w2_weight"}, 8)
    good.model.layers[0].mlp.experts = bad
    hm.register_forward_hooks(good, _spec(tmp_path, run_id="err", max_hook_errors=3))
    for _ in range(5):
        assert torch.equal(good(torch.zeros(2)), torch.full((2,), 2.0))  # the host keeps running
    assert sglang_hook.close_all()
    m = read_manifests(str(tmp_path), "err")["0"]
    assert m["hook_errors"] == 3 and m["disabled"] and "max_hook_errors=3" in m["disabled_reason"]
    assert "device lost" in m["errors"][0]["message"] and m["finished"]
    t = read_trace(str(tmp_path), "err").to_pylist()
    assert {r["layer"] for r in t} == {1} and {r["step"] for r in t} == {0, 1}  # off from the 3rd error on


def test_unwritable_output_leaves_the_server_untraced(make_ckpt, tmp_path, caplog):
    hm = load_hook_manager()
    (tmp_path / "f").write_text("x")
    model = build_model(make_ckpt(**CKPT))
    spec = _spec(tmp_path / "f" / "trace")
    hm.register_forward_hooks(model, spec)  # factory returns None: nothing registered, no raise
    assert model(torch.zeros(2)).tolist() == [2.0, 2.0]
    assert not any(m.mlp.experts._forward_hooks for m in model.model.layers)
    assert "cannot start tracing" in caplog.text
    assert sglang_hook.make_hook({"out": str(tmp_path), "bogus": 1}) is None  # bad config: also no raise


# ----------------------------------------------------------------- spec, flags, CLI, launch


def test_hook_spec_and_cuda_graph_flags(tmp_path):
    from click.testing import CliRunner

    from moetrace.cli import main

    res = CliRunner().invoke(main, ["hook-spec", "--out", "rel/t", "--layers", "0-3", "--kt", "off", "--first", "5"])
    assert res.exit_code == 0, res.output
    spec = json.loads(res.output)
    assert spec[0]["hook_factory"] == "moetrace.hooks.sglang_hook:make_hook"
    assert spec[0]["target_modules"] == list(DEFAULT_TARGETS)
    c = spec[0]["config"]
    assert c["out"] == os.path.abspath("rel/t") and c["layers"] == "0-3" and c["kt"] is False and c["run_id"]
    bad = CliRunner().invoke(main, ["hook-spec", "--out", "t", "--layers", "x"])
    assert bad.exit_code == 2 and "layers" in bad.output
    other = [{"name": "x", "target_modules": ["a"], "hook_factory": "m:f"}]
    cmd = build_command(["python", "-m", "sglang.launch_server", "--tp", "2", "--forward-hooks", json.dumps(other)],
                        hook_spec({"out": str(tmp_path)}), SPLIT_CUDA_GRAPH_FLAGS)
    hooks = json.loads(cmd[cmd.index("--forward-hooks") + 1])
    assert [h["name"] for h in hooks] == ["x", "moetrace"] and cmd.count("--forward-hooks") == 1
    assert cmd[-2:] == list(SPLIT_CUDA_GRAPH_FLAGS) and expected_tp(cmd) == 2


def test_every_capture_option_reaches_the_hook_config(small_index, tmp_path):
    """Each option of hook-spec (and launch) lands in the config under the key its name
    says (config keys: docs/capture.md); a renamed config key cannot leave a dead option."""
    from click.testing import CliRunner

    from moetrace.checkpoints.index import index_metadata
    from moetrace.cli import main
    from moetrace.commands.hook_spec import hook_spec_cmd

    ident = index_metadata(small_index)["checkpoint_id"]  # another id than the index's is refused (tracer.index_fit)
    given = {"--run-id": "r1", "--checkpoint-id": ident, "--layers": "0", "--experts": "0-3", "--tensors": "w2_weight",
             "--sources": "staged", "--every": "2", "--first": "3", "--index": small_index, "--chunk-digests": "mismatch",
             "--dump-max-count": "1", "--dump-max-bytes": "100", "--guard": "alert", "--guard-rows": "all",
             "--metrics-port": "0", "--update-index-dir": str(tmp_path), "--queue-size": "4", "--max-hook-errors": "3",
             "--kt": "on"}
    not_config = {"--out", "--config", "--target", "--pretty", "--server", "--help"}  # --server: which JSON is printed
    options = {o.opts[0]: o for o in hook_spec_cmd.params if o.opts[0].startswith("--")}
    assert set(options) - not_config == set(given), "a new capture option: give it a value here"
    args = [a for k, v in given.items() for a in (k, v)]
    res = CliRunner().invoke(main, ["hook-spec", "--out", str(tmp_path / "t"), *args])
    assert res.exit_code == 0, res.output
    config = json.loads(res.output)[0]["config"]
    for opt, value in given.items():
        key = options[opt].name
        assert key in config, f"{opt} -> {key} is not in the hook config"
    assert config["chunk_digests"] == "mismatch" and config["every_n_steps"] == 2 and config["kt"] is True


_FAKE_SERVER = textwrap.dedent(
    """
    # A stand-in for `python -m sglang.launch_server`: registers --forward-hooks with
    # SGLang's hook manager in each of --tp worker processes, serves forward passes,
    # and on SIGTERM kills its workers with SIGKILL (as SGLang's shutdown does).
    import json, os, signal, sys, time
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    args = sys.argv[1:]
    spec = json.loads(args[args.index("--forward-hooks") + 1])
    tp = int(args[args.index("--tp") + 1])
    assert "--disable-prefill-cuda-graph" in args and "--disable-decode-cuda-graph" in args
    ckpt = os.environ["FAKE_CKPT"]
    if os.environ.get("FAKE_WORKER") is None:
        import subprocess
        kids = [subprocess.Popen([sys.executable] + sys.argv, env=dict(os.environ, FAKE_WORKER=str(r))) for r in range(tp)]
        if os.environ.get("FAKE_PORT_IN_USE"):  # workers loaded the model, then the HTTP bind fails
            for k in kids:
                k.wait()
            sys.exit(1)
        def stop(*_):
            for k in kids:
                k.kill()
            for k in kids:
                k.wait()
            os._exit(0)
        signal.signal(signal.SIGTERM, stop)
        while True:
            time.sleep(0.1)
    import torch, test_hooks as th
    assert "sglang" not in sys.modules and "pandas" not in sys.modules
    rank = int(os.environ["FAKE_WORKER"])
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(tp)
    model = th.build_model(ckpt, rank, tp)
    th.load_hook_manager().register_forward_hooks(model, spec)
    if os.environ.get("FAKE_PORT_IN_USE"):
        sys.exit(0)  # a clean worker exit: atexit closes the (empty) trace
    while True:
        model(torch.zeros(2))
        time.sleep(0.05)
    """
)


def test_launch_runs_server_and_finishes_the_trace(make_ckpt, tmp_path):
    server = tmp_path / "fake_server.py"
    server.write_text(_FAKE_SERVER.replace("os.path.dirname(os.path.abspath(__file__))", repr(str(Path(__file__).parent))))
    out = tmp_path / "traces"
    env = dict(os.environ, FAKE_CKPT=str(make_ckpt(**CKPT)))
    config = tmp_path / "hook-config.json"
    config.write_text(json.dumps(FAST_FLUSH))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrace.cli", "launch", "--out", str(out), "--run-id", "L", "--server-flags", "split",
         "--config", str(config), "--close-timeout", "20", "--", sys.executable, str(server), "--model-path", "m",
         "--tp", "2"],
        env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            ms = read_manifests(str(out), "L")
            if len(ms) == 2 and all(m["parts"] for m in ms.values()):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the ranks never wrote a part")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    run = json.loads((out / "L" / "_run.json").read_text())
    assert run["finished"] and run["complete"] and run["ranks_closed_before_stop"] is True
    assert run["stop_signal"] == "SIGTERM" and run["server_exit_code"] == 0 and run["expected_ranks"] == 2
    assert run["cuda_graph_flags"] == list(SPLIT_CUDA_GRAPH_FLAGS) and run["tp_size"] == 2
    assert [(r["tp_rank"], r["present"], r["finished"]) for r in run["ranks"]] == [(0, True, True), (1, True, True)]
    ms = read_manifests(str(out), "L")
    assert all(m["finished"] and m["close_reason"] == "control-file" and m["tp_rank_found_by"] == "env" for m in ms.values())
    t = read_trace(str(out), "L")
    assert t.num_rows == sum(m["rows_written"] for m in ms.values()) > 0
    assert run["problems"] == [] and run["stop_reason"] == "SIGTERM"
    assert "moetrace: SIGTERM: closing traces, then stopping the server" in err
    last = err.strip().splitlines()[-1]
    assert last == f"moetrace: run L complete: 2/2 ranks finished, {t.num_rows:,} rows, 0 dropped, 0 hook errors", err


def _rank(r, **kw):
    m = {"tp_rank": r, "tp_size": 2, "finished": True, "close_reason": "control-file", "disabled": False,
         "rows_written": 6528, "rows_dropped": 0, "drops": {}, "hook_errors": 0, "sink_errors": 0,
         "online": {"match": 6450, "mismatch": 78, "unchecked": 0}, "config": {"index": "/i.parquet"}}
    return {**m, **kw}


def test_run_problems_and_summary_line():
    from moetrace.servers.launcher import summary_line
    from moetrace.tracer.completeness import run_problems

    good = {"0": _rank(0), "1": _rank(1)}
    assert run_problems(good, 2, server_exit_code=0, stop_requested=True) == []
    assert summary_line("X", good, 2, []) == ("moetrace: run X complete: 2/2 ranks finished, 13,056 rows, 0 dropped, "
                                              "0 hook errors; online check: 12,900 match, 156 mismatch")
    no_index = {r: _rank(int(r), config={}, online={"match": 0, "mismatch": 0, "unchecked": 6528}) for r in ("0", "1")}
    assert summary_line("X", no_index, None, []).endswith("0 hook errors")  # no index: no online part
    # A server that dies at start-up (port in use, bad flag): no manifests, non-zero exit on its own.
    p = run_problems({}, 2, server_exit_code=1, stop_requested=False)
    assert len(p) == 2 and "code 1" in p[0] and "no rank wrote a manifest" in p[1]
    assert run_problems({}, None, server_started=False)[0] == "the server did not start"
    # A non-zero exit after we asked the server to stop is not a problem; on its own it is.
    assert run_problems(good, 2, server_exit_code=-15, stop_requested=True) == []
    assert "signal 9" in run_problems(good, 2, server_exit_code=-9)[0]
    # Fewer ranks than --tp, or than the manifests' tp_size when --tp is unknown.
    assert run_problems({"0": _rank(0)}, 2) == ["1/2 ranks reported (no manifest from rank 1)"]
    assert run_problems({"1": _rank(1)}, None) == ["1/2 ranks reported (no manifest from rank 0)"]
    assert "unexpected rank 2" in run_problems({**good, "2": _rank(2)}, 2)[0]
    # 0 rows is incomplete even when sampling kept nothing on purpose.
    p = run_problems({"0": _rank(0), "1": _rank(1, rows_written=0)}, 2)
    assert len(p) == 1 and p[0].startswith("rank 1 wrote 0 rows")
    bad = {"0": _rank(0, finished=False), "1": _rank(1, disabled=True, disabled_reason="10 hook errors", hook_errors=10,
                                                  rows_dropped=1234, drops={"queue_full": 1234})}
    p = run_problems(bad, 2)
    assert p == ["rank 0 did not finish its trace (finished: false)", "rank 1 disabled tracing (10 hook errors)",
                 "rank 1 dropped 1,234 rows (queue_full: 1,234)", "rank 1 had 10 hook errors"]
    assert summary_line("X", bad, 2, p) == "moetrace: run X INCOMPLETE: " + "; ".join(p)
    # sink errors (a part that could not be written, a manifest write that failed) make a run
    # incomplete for the launcher exactly as they do for the analysis: one rule, tracer.manifest
    assert run_problems({"0": _rank(0), "1": _rank(1, sink_errors=2)}, 2) == ["rank 1 had 2 sink errors"]
    # Pipeline stages and replicas: every TP rank of every stage of every replica the manifests name.
    staged = {f"replica{d}-pp{p}-tp{t}": _rank(t, pp_rank=p, pp_size=2, replica=d) for d in (0, 1) for p in (0, 1)
              for t in (0, 1) if (d, p, t) != (1, 1, 0)}
    assert run_problems(staged, 2) == ["7/8 ranks reported (no manifest from rank replica1-pp1-tp0)"]
    refused = {"pid": 7, "host": "h", "rank_label": "0", "claimed_by": {"pid": 6, "host": "h"}}
    assert "pid 7 on h was refused: rank 0 already belonged to pid 6" in run_problems(good, 2, refusals=[refused])[0]


def _fake_server(tmp_path):
    server = tmp_path / "fake_server.py"
    server.write_text(_FAKE_SERVER.replace("os.path.dirname(os.path.abspath(__file__))", repr(str(Path(__file__).parent))))
    return server


def test_launch_server_that_exits_at_once_is_incomplete(tmp_path):
    lines: list[str] = []
    cmd = [sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(1)", "--tp", "2"]
    launcher = Launcher(cmd, {"out": str(tmp_path), "run_id": "F"}, server_flags="split", echo=lines.append)
    assert launcher.run() == 1
    run = json.loads((tmp_path / "F" / "_run.json").read_text())
    assert run["finished"] and run["complete"] is False and run["server_exit_code"] == 1
    assert len(run["problems"]) == 2 and "exited on its own with code 1" in run["problems"][0]
    assert run["stop_signal"] is None and run["stop_reason"] is None
    assert [(r["rank_label"], r["present"]) for r in run["ranks"]] == [("0", False), ("1", False)]
    assert lines[-1] == "moetrace: run F INCOMPLETE: " + "; ".join(run["problems"])


def test_launch_port_in_use_is_incomplete(make_ckpt, tmp_path, monkeypatch):
    """The walkthrough's case: both ranks open (and cleanly close) an empty trace,
    then the server fails to bind its port and exits 1."""
    monkeypatch.setenv("FAKE_CKPT", str(make_ckpt(**CKPT)))
    monkeypatch.setenv("FAKE_PORT_IN_USE", "1")
    lines: list[str] = []
    cmd = [sys.executable, str(_fake_server(tmp_path)), "--model-path", "m", "--tp", "2"]
    launcher = Launcher(cmd, {"out": str(tmp_path), "run_id": "P"}, server_flags="split", echo=lines.append)
    assert launcher.run() == 1
    ms = read_manifests(str(tmp_path), "P")
    assert sorted(ms) == ["0", "1"] and all(m["finished"] and m["rows_written"] == 0 for m in ms.values())
    run = json.loads((tmp_path / "P" / "_run.json").read_text())
    assert run["complete"] is False and run["server_exit_code"] == 1
    assert "exited on its own with code 1" in run["problems"][0]
    assert any(p.startswith("rank 0 wrote 0 rows") for p in run["problems"])
    assert any(p.startswith("rank 1 wrote 0 rows") for p in run["problems"])
    assert lines[-1] == "moetrace: run P INCOMPLETE: " + "; ".join(run["problems"])


def test_launcher_stop_from_another_thread(make_ckpt, tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("FAKE_CKPT", str(make_ckpt(**CKPT)))
    out = tmp_path / "traces"
    lines: list[str] = []
    launcher = Launcher([sys.executable, str(_fake_server(tmp_path)), "--model-path", "m", "--tp", "2"], {"out": str(out), "run_id": "S", **FAST_FLUSH},
                        server_flags="split", echo=lines.append)

    def traffic():
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            ms = read_manifests(str(out), "S")
            if len(ms) == 2 and all(m["parts"] for m in ms.values()):
                break
            time.sleep(0.2)
        try:
            launcher.stop("traffic done")
            launcher.stop("traffic done")  # a second stop does not escalate to a kill
        except AttributeError:  # without Launcher.stop: end the run the old way, then fail below
            launcher._signals.append(signal.SIGTERM)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    assert launcher.run() == 0
    thread.join(5)
    run = json.loads((out / "S" / "_run.json").read_text())
    assert "moetrace: traffic done: closing traces, then stopping the server" in lines
    assert not any("SIGTERM:" in line for line in lines)
    assert run["stop_reason"] == "traffic done" and run["stop_signal"] == "SIGTERM"
    assert run["ranks_closed_before_stop"] is True and run["server_exit_code"] == 0
    assert run["complete"] is True and run["problems"] == []
    ms = read_manifests(str(out), "S")
    assert all(m["close_reason"] == "control-file" for m in ms.values())
    rows = sum(m["rows_written"] for m in ms.values())
    assert lines[-1] == f"moetrace: run S complete: 2/2 ranks finished, {rows:,} rows, 0 dropped, 0 hook errors"
