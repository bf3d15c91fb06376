"""A small server shaped like SGLang, for the slot-map tests: four gloo processes whose
FusedMoE-shaped modules are set up as each configuration leaves them, hooked through
SGLang's own ``register_forward_hooks`` (0.5.23's hook_manager.py), capturing with
moetrace's real hook factory.

    PYTHONPATH=tests python -m support.slots_server CKPT OUT

Scenario "kt" (two data-parallel replicas, each a TP2 world of its own; the replica id
comes from SGLANG_DP_RANK as a router sets it): the KT fork's resident layer of 3 GPU
slots, a staged full-layer load (replica 1, rank 1 stages expert 5's w2 scale with
expert 7's bytes, E+2), then the fork's real ``_update_gpu_experts_from_batch``
(rank 0 picks experts 5, 6, 7, broadcasts them, ``copy_experts_weights_fp8`` copies the
staged tensors into the resident slots, the slot tables are replaced), a decode pass.

Scenarios "eplb" (clean) and "eplb-bad" (one world of 4: 2 pipeline stages x TP2 with
EP2): 4 MoE layers, stage 0 owning 0-1 and stage 1 owning 2-3; 8 logical experts in 10
physical EPLB slots (2 redundant) plus one fused shared expert per rank, placed by
0.5.23's own FusedMoE.weight_loader from 0.5.23's ExpertLocationMetadata; after pass 1
layer 2 is rebalanced (metadata.update, weights reloaded to the new placement); the last
stage also runs a Qwen3.5 MTP draft (its own runner, is_draft_worker; FusedMoE.is_draft,
no expert-location metadata, so 3 of rank 1's 5 slots are filled and 2 never are).
"eplb-bad" holds: a redundant copy with another expert's bytes (after the rebalance), a
shared-expert slot with a routed expert's w2, a draft slot with the target's layer 0.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from moetrace.checkpoints.reader import draft_checkpoint, open_checkpoint
from moetrace.checkpoints.shards import Parallel, expected_experts
from moetrace.hooks import sglang_hook
from moetrace.schema import COPY_ORDERS
from support import sglang_parts as sp
from support.sglang_source import fork_root, installed_root, load_hook_manager, source_at

E, REDUNDANT, GPU_SLOTS = 8, 2, 3
NAMES = COPY_ORDERS["fp8_block"]
LAYERS = 4
OLD_ROW = [0, 1, 2, 3, 0, 4, 5, 6, 7, 1]  # physical -> logical; 5 per EP rank
NEW_ROW = [7, 1, 2, 3, 0, 4, 5, 6, 0, 1]  # layer 2 after the rebalance: rank 1's slot 4 = logical 1, copy 1
# eplb-bad: (stage, tp, model, layer, slot, tensor) -> what the slot holds instead: (model, layer, expert)
BAD = {
    (1, 1, "target", 2, 4, "w13_weight"): ("target", 2, 3),  # after the rebalance only
    (0, 1, "target", 1, 5, "w2_weight"): ("target", 1, 2),  # the shared slot
    (1, 0, "draft", 0, 2, "w13_weight_scale_inv"): ("target", 0, 2),
}
KT_BAD = (5, "w2_weight_scale_inv", 7)  # replica 1, rank 1 stages expert 5's w2 scale from expert 7


def _spec(out: str, run_id: str, ckpt) -> list[dict]:
    return [{"name": "moetrace", "target_modules": ["model.layers.*.mlp.experts"],
             "hook_factory": "moetrace.hooks.sglang_hook:make_hook",
             "config": {"out": out, "run_id": run_id, "flush_interval_s": 0.2, "checkpoint_id": ckpt.identity}}]


# ---------------------------------------------------------------- modules


class FusedMoE(nn.Module):
    """The attributes 0.5.23's FusedMoE loader and moetrace read; params [slots, ...]."""

    def __init__(self, loader, layer_id, num_experts, shared, ep_rank, ep_size, moe_tp_rank, like, is_draft=False):
        super().__init__()
        self.layer_id, self.num_experts, self.num_fused_shared_experts = layer_id, num_experts, shared
        self.moe_ep_rank, self.moe_ep_size, self.moe_tp_rank, self.moe_tp_size = ep_rank, ep_size, moe_tp_rank, 1
        self.is_draft = is_draft
        self.uses_expert_location = not is_draft
        self._num_global_routed = num_experts - shared
        self._expert_storage_rank = ep_rank
        self._num_local_routed = self._num_global_routed // ep_size
        self.num_local_experts = self._num_local_routed + shared
        self._has_fused_shared = shared > 0
        self.quant_config = self.quant_method = None
        for name, t in like.items():
            self.register_parameter(name, nn.Parameter(torch.zeros((self.num_local_experts, *t.shape[1:]), dtype=t.dtype),
                                                       requires_grad=False))
        for name in ("weight_loader", "_weight_loader_physical", "_map_global_expert_id_to_local_expert_id"):
            setattr(type(self), name, getattr(loader, name))

    def _weight_loader_impl(self, param, loaded_weight, weight_name, shard_id, expert_id):
        param.data[expert_id].copy_(loaded_weight)  # the shard arrives cut for this rank

    def load(self, shards: dict) -> None:
        """SGLang's loop: every checkpoint expert (routed, then the shared one) through weight_loader."""
        n = E + self.num_fused_shared_experts
        for e in range(n):
            for name in NAMES:
                self.weight_loader(getattr(self, name), shards[name][e], name, "w13", e)

    def forward(self, x):
        return x


class Model(nn.Module):
    """root.model.layers[L].mlp.experts; a layer another stage owns is an Identity (PPMissingLayer)."""

    def __init__(self, experts: dict[int, nn.Module], num_layers: int):
        super().__init__()
        self.model = nn.Module()
        blocks = []
        for layer in range(num_layers):
            if layer in experts:
                b = nn.Module()
                b.mlp = nn.Module()
                b.mlp.experts = experts[layer]
                blocks.append(b)
            else:
                blocks.append(nn.Identity())
        self.model.layers = nn.ModuleList(blocks)


class ModelRunner:
    """What moetrace reads of SGLang's ModelRunner: model, is_draft_worker, forward_pass_id
    (incremented at the start of forward, as 0.5.23 and the fork do); hooks are registered
    from a method of it, as the fork's ModelRunner.initialize does."""

    def __init__(self, model, is_draft_worker: bool, hook_manager, specs, dp_rank=None):
        self.model, self.is_draft_worker, self.forward_pass_id = model, is_draft_worker, 0
        self.initialize(hook_manager, specs)

    def initialize(self, hook_manager, specs):
        hook_manager.register_forward_hooks(self.model, specs)

    def forward(self, x=None):
        self.forward_pass_id += 1
        x = torch.zeros(1) if x is None else x
        for block in self.model.model.layers:
            if hasattr(block, "mlp"):
                block.mlp.experts(x)


# ---------------------------------------------------------------- KT


class SharedFullContext:
    """Stand-in for the fork's staged full layer (load's 0.7.2 signature); stages every
    expert's shard into gpu_layer, optionally one tensor from another expert."""

    def __init__(self, shards: dict, corrupt=None):
        self.shards, self.corrupt = shards, corrupt
        self.gpu_layer = nn.Module()
        for name, t in shards[0].items():
            self.gpu_layer.register_parameter(name, nn.Parameter(torch.zeros_like(t), requires_grad=False))
        self._is_fp8_quant, self._is_fp8_channel_quant, self._is_bf16_quant = True, False, False
        self.gpu_method = types.SimpleNamespace()

    def load(self, layer_idx, wrapper, original_layer=None, gpu_experts_mask=None, logical_to_gpu_index=None):
        src = self.shards[layer_idx]
        with torch.no_grad():
            for name in NAMES:
                getattr(self.gpu_layer, name).copy_(src[name])
            if self.corrupt is not None:
                e, name, other = self.corrupt
                getattr(self.gpu_layer, name)[e].copy_(src[name][other])


class KTMethod:
    """The fork's KTEPWrapperMethod state that _update_gpu_experts_from_batch reads and writes."""

    def __init__(self, tp_rank: int, ctx: SharedFullContext):
        self.tp_rank, self.global_num_experts, self.num_gpu_experts, self.ctx = tp_rank, E, GPU_SLOTS, ctx
        mask = torch.zeros(E, dtype=torch.bool)
        mask[:GPU_SLOTS] = True
        self.gpu_experts_mask, self.gpu_experts_mask_cuda = mask, mask.clone()
        self.logical_to_gpu_index = torch.full((E,), -1, dtype=torch.int32)
        self.logical_to_gpu_index[:GPU_SLOTS] = torch.arange(GPU_SLOTS, dtype=torch.int32)
        self.logical_to_gpu_index_cuda = self.logical_to_gpu_index.clone()
        self.gpu_index_to_logical = torch.arange(GPU_SLOTS, dtype=torch.int32)
        self.kt_config = types.SimpleNamespace(layer_idx=0, kt_enable_dynamic_expert_update=True)
        self.wrapper = None

    def apply(self, layer, topk_ids):
        """A long prefill: the staged load, then the dynamic update from this batch's routing."""
        self.ctx.load(layer_idx=layer.layer_id, wrapper=self.wrapper, original_layer=layer,
                      gpu_experts_mask=self.gpu_experts_mask, logical_to_gpu_index=self.logical_to_gpu_index)
        out = types.SimpleNamespace(topk_output=types.SimpleNamespace(topk_ids=topk_ids))
        self._update_gpu_experts_from_batch(layer=layer, ctx=self.ctx, dispatch_output=out)


class KTLayer(nn.Module):
    def __init__(self, quant_method: KTMethod, shards: dict, moe_tp_rank: int):
        super().__init__()
        self.layer_id, self.moe_ep_rank, self.moe_ep_size, self.moe_tp_rank, self.moe_tp_size = 0, 0, 1, moe_tp_rank, 2
        self.num_experts, self.quant_method = E, quant_method
        for name, t in shards.items():
            self.register_parameter(name, nn.Parameter(t[:GPU_SLOTS].clone(), requires_grad=False))
        self.topk_ids = None  # set for a prefill pass: the staged path runs

    def forward(self, x):
        if self.topk_ids is not None:
            self.quant_method.apply(self, self.topk_ids)
        return x


# ---------------------------------------------------------------- scenarios


def _init(world: int, rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_kt(g: int, ports: list[int], ckpt_path: str, out: str, hm) -> None:
    replica, rank = g // 2, g % 2
    os.environ["SGLANG_DP_RANK"] = str(replica)
    _init(2, rank, ports[replica])
    try:
        ckpt = open_checkpoint(ckpt_path)
        shards = {0: expected_experts(ckpt, 0, rank, Parallel(2), range(E))}
        kt = sp.kt_dynamic_update(fork_root(), types.SimpleNamespace(device_group=None))
        KTMethod._update_gpu_experts_from_batch = kt._update_gpu_experts_from_batch
        ctx = SharedFullContext(shards, KT_BAD if (replica, rank) == (1, 1) else None)
        layer = KTLayer(KTMethod(rank, ctx), shards[0], rank)
        runner = ModelRunner(Model({0: layer}, 1), False, hm, _spec(out, "kt", ckpt))
        layer.topk_ids = torch.tensor([[5, 6], [5, 7], [6, 5], [7, 7]])  # prefill: experts 5, 6, 7 are hot
        runner.forward()
        layer.topk_ids = None  # decode: resident slots only
        runner.forward()
        assert sglang_hook.close_all(timeout=30)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        del os.environ["SGLANG_DP_RANK"]


def _parallel_state(tp: int, pp: int) -> types.ModuleType:
    """sglang.srt.distributed as a TP2 x PP2 server's worker answers it."""
    mod = types.ModuleType("sglang.srt.distributed")
    mod.get_tensor_model_parallel_rank, mod.get_tensor_model_parallel_world_size = (lambda: tp), (lambda: 2)
    mod.get_pipeline_model_parallel_rank, mod.get_pipeline_model_parallel_world_size = (lambda: pp), (lambda: 2)
    return mod


def _corrupt(module: FusedMoE, stage: int, tp: int, model: str, layer: int, shards: dict, rebalanced: bool) -> None:
    for (s, t, m, L, slot, name), (fm, fl, fe) in BAD.items():
        if (s, t, m, L) == (stage, tp, model, layer) and (L != 2 or rebalanced):
            with torch.no_grad():
                getattr(module, name)[slot].copy_(shards[(fm, fl)][name][fe])


def run_eplb(g: int, port: int, ckpt_path: str, out: str, hm, run_id: str) -> None:
    stage, tp = g // 2, g % 2
    bad = run_id == "eplb-bad"
    sys.modules["sglang.srt.distributed"] = _parallel_state(tp, stage)
    el = sp.expert_location(installed_root("sglang"))
    loader = sp.fused_moe_loader(installed_root("sglang"), el.get_global_expert_location_metadata)
    _init(4, g, port)
    try:
        el.resources.expert_location_metadata = sp.metadata_for(el, torch.tensor([OLD_ROW] * LAYERS), E, 2)
        ckpt = open_checkpoint(ckpt_path)
        draft_ckpt, why = draft_checkpoint(ckpt)
        assert draft_ckpt is not None, why
        par = Parallel(2, 2)  # EP2: moe_tp 1, every rank holds the whole intermediate
        shards = {("target", L): expected_experts(ckpt, L, 0, par) for L in range(LAYERS)}
        shards[("draft", 0)] = expected_experts(draft_ckpt, 0, 0, par)
        mine = (0, 1) if stage == 0 else (2, 3)
        experts = {}
        for L in mine:
            experts[L] = FusedMoE(loader, L, E + REDUNDANT + 1, 1, tp, 2, 0, shards[("target", L)])
            experts[L].load(shards[("target", L)])
            if bad:
                _corrupt(experts[L], stage, tp, "target", L, shards, False)
        target = ModelRunner(Model(experts, LAYERS), False, hm, _spec(out, run_id, ckpt))
        draft = None
        if stage == 1:  # Qwen2MoeSparseMoeBlock passes num_experts + ep_num_redundant_experts to the draft too
            d = FusedMoE(loader, 0, E + REDUNDANT, 0, tp, 2, 0, shards[("draft", 0)], is_draft=True)
            d.load(shards[("draft", 0)])
            if bad:
                _corrupt(d, stage, tp, "draft", 0, shards, False)
            draft = ModelRunner(Model({0: d}, 1), True, hm, _spec(out, run_id, ckpt))
        target.forward()
        if draft is not None:
            draft.forward()
        # EPLB rebalance of layer 2: SGLang's metadata.update, then the weights moved to the new placement.
        new = torch.tensor([OLD_ROW] * LAYERS)
        new[2] = torch.tensor(NEW_ROW)
        el.resources.expert_location_metadata.update(sp.metadata_for(el, new, E, 2), update_layer_ids=[2])
        if 2 in experts:
            experts[2].load(shards[("target", 2)])
            if bad:
                _corrupt(experts[2], stage, tp, "target", 2, shards, True)
        target.forward()
        assert sglang_hook.close_all(timeout=30)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        del sys.modules["sglang.srt.distributed"], sys.modules["sglang.srt.eplb.expert_location"]


def worker(g: int, ports: list[int], ckpt_path: str, out: str) -> None:
    torch.set_num_threads(1)
    hm = load_hook_manager()
    run_kt(g, ports[:2], ckpt_path, out, hm)
    for run_id, port in (("eplb", ports[2]), ("eplb-bad", ports[3])):
        run_eplb(g, port, ckpt_path, out, hm, run_id)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main(ckpt_path: str, out: str) -> None:
    t0 = time.perf_counter()
    for root, rel in ((installed_root("sglang"), sp.EXPERT_LOCATION), (installed_root("sglang"), sp.FUSED_MOE_LAYER),
                      (fork_root(), sp.KT_WRAPPER)):
        source_at(str(root)).tree(rel)  # parsed once here, inherited by the forked workers
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [0]}), io.BytesIO(), compression="zstd")  # pyarrow's first write costs ~1 s
    # fork: the workers start with torch and moetrace already imported (spawn costs seconds each)
    mp.start_processes(worker, args=(_free_ports(4), ckpt_path, out), nprocs=4, join=True, start_method="fork")
    print(f"slots_server: {time.perf_counter() - t0:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
