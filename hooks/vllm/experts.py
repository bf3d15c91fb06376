"""The MoE layers of a vLLM model, and which process and shard each belongs to.

vLLM 0.32 builds a Qwen3-MoE layer's experts with ``FusedMoEFactory`` (no class is
named FusedMoE): ``model.layers.{L}.mlp.experts`` is a ``MoERunner``
(``model_executor/layers/fused_moe/runner/moe_runner.py``) whose ``routed_experts``
(``routed_experts.py`` RoutedExperts) holds the stacked parameters ``w13_weight
[E_local, 2*I_tp, H]`` and ``w2_weight [E_local, H, I_tp]``. A forward hook fires on the
runner (the runner calls RoutedExperts' ``forward_modular`` directly, so a hook there
never fires).

Shards and slots come from the layer's own parallel config, ``moe_config.
moe_parallel_config`` (FusedMoEParallelConfig: the MoE's tp_rank/tp_size, ep_rank/
ep_size; vLLM's general EP group numbers ranks even without EP, so it is not read), and
its expert map (``_expert_map``: global expert -> local slot, -1 elsewhere; None when
every expert is local). The process (its trace folder) is vLLM's TP/PP group rank and
data-parallel rank. Nothing here imports vLLM: its modules are read from sys.modules.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass

from moetrace.hooks.ranks import ProcessRanks
from moetrace.hooks.slots import SlotMapError
from moetrace.hooks.spec import DEFAULT_TARGETS
from moetrace.schema import RankIdentity

PARALLEL_STATE = "vllm.distributed.parallel_state"


@dataclass
class MoELayer:
    name: str  # the module's name in the model, e.g. model.layers.3.mlp.experts
    layer: int  # the checkpoint's layer id
    module: object  # where the forward hook goes (the MoERunner)
    routed: object  # what holds the expert parameters (RoutedExperts)


def _layer_id(name: str, module) -> int:
    v = getattr(module, "layer_id", None)  # MoERunner: extract_layer_index(layer_name)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise AttributeError(f"{name}: cannot tell its layer (no layer_id, no layers.<L> in its name)")


def find_layers(model, targets=DEFAULT_TARGETS) -> list[MoELayer]:
    """The MoE expert modules of `model` matching `targets`, in layer order."""
    out = []
    for name, module in model.named_modules():
        if not any(fnmatch.fnmatch(name, t) for t in targets):
            continue
        routed = getattr(module, "routed_experts", None)
        routed = routed if routed is not None else module  # a module holding the params itself
        if getattr(routed, "w13_weight", None) is None and getattr(routed, "w13_weight_packed", None) is None:
            continue
        out.append(MoELayer(name, _layer_id(name, module), module, routed))
    return sorted(out, key=lambda x: x.layer)


def parallel_config(routed):
    moe = getattr(routed, "moe_config", None)
    par = getattr(moe, "moe_parallel_config", None)
    if par is None:
        raise SlotMapError(f"{type(routed).__name__} has no moe_config.moe_parallel_config: its shard is unknown")
    return par


def layer_ranks(routed, tp_rank: int, tp_size: int) -> RankIdentity:
    """Row ranks from the layer's own parallel config: the MoE's tp (its shard) and ep."""
    par = parallel_config(routed)
    return RankIdentity(int(tp_size), int(tp_rank), int(par.ep_size), int(par.ep_rank), int(par.tp_size),
                        int(par.tp_rank))


def slot_experts(routed, n_slots: int) -> tuple[list[int], str]:
    """(the global expert each slot holds, how the map was read), from the layer's expert map."""
    par = parallel_config(routed)
    if getattr(par, "enable_eplb", False):
        raise SlotMapError("EPLB is on: vLLM's physical-to-logical map of redundant experts is not read by moetrace")
    manager = getattr(routed, "expert_map_manager", None)
    if int(getattr(manager, "num_fused_shared_experts", 0) or 0):
        raise SlotMapError("fused shared experts (ROCm AITER) are not mapped by moetrace")
    emap = getattr(routed, "_expert_map", None)
    if emap is None:
        if int(par.ep_size) > 1:
            raise SlotMapError(f"ep_size {par.ep_size} but the layer has no expert map")
        return list(range(n_slots)), "vllm-all-local"
    slots = [-1] * n_slots
    for expert, slot in enumerate(emap.tolist()):
        if 0 <= slot < n_slots:
            if slots[slot] != -1:
                raise SlotMapError(f"the expert map puts experts {slots[slot]} and {expert} in slot {slot}")
            slots[slot] = expert
    if -1 in slots:
        raise SlotMapError(f"the expert map fills {n_slots - slots.count(-1)} of {n_slots} slots")
    return slots, f"vllm-expert-map-{getattr(routed, 'expert_placement_strategy', None) or 'linear'}"


def _group(ps, getter: str) -> tuple[int, int] | None:
    try:
        g = getattr(ps, getter)()
        return int(g.rank_in_group), int(g.world_size)
    except Exception:  # not initialised in this process
        return None


def process_ranks(config, vllm_config) -> ProcessRanks:
    """This worker's identity: the hook config's overrides, else vLLM's TP and PP groups
    and its parallel config's data-parallel rank (a replica when data_parallel_size > 1)."""
    ps = sys.modules.get(PARALLEL_STATE)
    tp = _group(ps, "get_tp_group") if ps is not None else None
    pp = _group(ps, "get_pp_group") if ps is not None else None
    found_by = {}
    if config.tp_rank is not None:
        tp_rank, tp_size, found_by["tp"] = config.tp_rank, config.tp_size or config.tp_rank + 1, "config"
    elif tp is not None:
        (tp_rank, tp_size), found_by["tp"] = tp, "vllm"
    else:
        tp_rank, tp_size, found_by["tp"] = 0, 1, "default"
    if config.pp_rank is not None:
        pp_rank, pp_size, found_by["pp"] = config.pp_rank, config.pp_size or config.pp_rank + 1, "config"
    elif pp is not None:
        (pp_rank, pp_size), found_by["pp"] = pp, "vllm"
    else:
        pp_rank, pp_size, found_by["pp"] = 0, 1, "default"
    par = getattr(vllm_config, "parallel_config", None)
    dp_size = int(getattr(par, "data_parallel_size", 1) or 1)
    if config.replica is not None:
        replica, found_by["replica"] = config.replica, "config"
    elif dp_size > 1:
        replica, found_by["replica"] = int(par.data_parallel_rank), "vllm"
    else:
        replica, found_by["replica"] = None, "vllm" if par is not None else "default"
    return ProcessRanks(int(tp_rank), int(tp_size), int(pp_rank), int(pp_size), replica, found_by)
