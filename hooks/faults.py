"""Faults injected into a live server's expert weights, to prove the detector there.

``moetrace selftest --server`` (and the tests of the real servers) register this hook
before moetrace's capture hook, so each fault is in place when moetrace reads the
layer. SGLang: ``--forward-hooks`` entry ``moetrace.hooks.faults:make_fault_hook``
with ``{"faults": [...]}``. Each fault writes through ``param.data``, as SGLang's own
weight loaders (and real corruption) write: no torch version counter moves.

vLLM: ``MOETRACE_FAULTS`` (the fault list as JSON) in the server's environment makes
moetrace's plugin register the same hook on each MoE layer before its resident capture
(hooks.vllm.session); faults then land after vLLM's own load and its kernel's repack
(swapping or zeroing whole experts is the same fault in any per-expert layout).

A fault is a dict:

- ``fault``: ``swap`` (experts[0] and experts[1] exchange their bytes), ``zero``
  (experts[0]'s tensor becomes zeros), ``other_rank`` (experts[0]'s tensor becomes
  the shard MoE TP rank ``from_moe_tp_rank`` holds of it, read from ``checkpoint``), ``kill``
  (the rank process is killed with SIGKILL: a crash mid-run);
- ``rank``: the TP rank it happens on; ``layer``: the MoE layer (``layer_id``);
  ``tensor``: the FusedMoE param (``w13_weight``, ``w2_weight_scale_inv``...);
  ``experts``: global expert ids (their slots come from the server's own slot map);
- ``at_forward``: the forward of that layer after which it happens (0: the first,
  before any capture; N: N forwards were captured clean first).

Faults are applied once; what each did is logged on the server's log at WARNING.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Callable

from moetrace.errors import MoetraceError

log = logging.getLogger("moetrace.faults")

FAULTS = ("swap", "zero", "other_rank", "kill")
FAULTS_ENV = "MOETRACE_FAULTS"  # vLLM: the fault list, read by moetrace's plugin in each worker


def faults_from_env() -> list[dict]:
    """The faults of $MOETRACE_FAULTS (none when unset); a bad list raises MoetraceError."""
    import json

    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return []
    try:
        return check_faults(json.loads(raw))
    except ValueError as err:
        raise MoetraceError(f"{FAULTS_ENV}: not JSON ({err})") from None


def check_faults(faults) -> list[dict]:
    """The fault list of a config, checked; a one-line MoetraceError naming what is wrong."""
    if not isinstance(faults, list) or not all(isinstance(f, dict) for f in faults):
        raise MoetraceError("faults: expected a list of fault objects")
    for i, f in enumerate(faults):
        kind = f.get("fault")
        if kind not in FAULTS:
            raise MoetraceError(f"faults[{i}].fault: {kind!r}; expected one of {', '.join(FAULTS)}")
        need = {"swap": 2, "zero": 1, "other_rank": 1, "kill": 0}[kind]
        keys = ("rank", "at_forward") + (("layer", "tensor", "experts") if need else ())
        for key in keys:
            if key not in f:
                raise MoetraceError(f"faults[{i}] ({kind}): {key} is missing")
        if need and (not isinstance(f["experts"], list) or len(f["experts"]) != need):
            raise MoetraceError(f"faults[{i}] ({kind}): experts must list {need} expert id(s)")
        if kind == "other_rank" and ("from_moe_tp_rank" not in f or "checkpoint" not in f):
            raise MoetraceError(f"faults[{i}] (other_rank): from_moe_tp_rank and checkpoint are needed")
    return faults


def make_fault_hook(config: dict):
    """SGLang ``--forward-hooks`` factory: a forward hook applying config["faults"]."""
    return FaultHook(check_faults(config.get("faults")))


@dataclass(frozen=True)
class LayerAccess:
    """How a server's MoE layer module shows its layer id, expert tensors and slot map (SGLang's
    FusedMoE by default; hooks.vllm.session gives vLLM's runner)."""

    layer: Callable  # module -> layer id
    tensors: Callable  # module -> {param name: stacked [slots, ...] tensor}
    slots: Callable  # (module, n_slots, layer) -> the global expert of each slot


def _sglang_layer(module) -> int:
    from moetrace.hooks.fused_moe import layer_of

    return layer_of(module)


def _sglang_tensors(module) -> dict:
    from moetrace.hooks.fused_moe import expert_tensors

    return expert_tensors(module)


def _sglang_slots(module, n_slots: int, layer: int) -> list[int]:
    from moetrace.hooks.slots import read_slot_map

    slots = read_slot_map(module, n_slots, layer)
    return list(slots.experts) if slots is not None else []


SGLANG = LayerAccess(_sglang_layer, _sglang_tensors, _sglang_slots)


class FaultHook:
    """``hook(module, inputs, output)``: counts the layer's forwards and applies its due faults."""

    def __init__(self, faults: list[dict], access: LayerAccess = SGLANG, rank: int | None = None):
        self.faults = [dict(f, done=False) for f in faults]
        self.forwards: dict[int, int] = {}
        self.access = access
        self._rank = rank

    def rank(self) -> int:
        if self._rank is None:
            from moetrace.hooks.ranks import detect_rank

            self._rank = detect_rank()[0]
        return self._rank

    def __call__(self, module, inputs, output):
        layer = self.access.layer(module)
        n = self.forwards.get(layer, 0)
        self.forwards[layer] = n + 1
        for f in self.faults:
            if f["done"] or int(f["at_forward"]) != n or int(f["rank"]) != self.rank():
                continue
            if f["fault"] == "kill":
                log.warning("moetrace fault: killing TP rank %d after %d forwards of layer %d", self.rank(), n, layer)
                os.kill(os.getpid(), signal.SIGKILL)
            if int(f["layer"]) != layer:
                continue
            f["done"] = True
            apply_fault(module, layer, f, self.access)
            log.warning("moetrace fault on TP rank %d, layer %d, after %d forwards: %s", self.rank(), layer, n,
                        {k: v for k, v in f.items() if k not in ("done", "checkpoint")})
        return None


def apply_fault(module, layer: int, f: dict, access: LayerAccess = SGLANG) -> None:
    """One fault on a MoE layer's params, written through .data."""
    tensors = access.tensors(module)
    if f["tensor"] not in tensors:
        raise MoetraceError(f"layer {layer} has no {f['tensor']} (it has {', '.join(tensors)})")
    data = tensors[f["tensor"]].data
    where = {e: i for i, e in enumerate(access.slots(module, data.shape[0], layer))}
    for e in f["experts"]:
        if e not in where:
            raise MoetraceError(f"layer {layer}: expert {e} is not held on this rank")
    a = where[f["experts"][0]]
    if f["fault"] == "swap":
        b = where[f["experts"][1]]
        held = data[a].clone()
        data[a].copy_(data[b])
        data[b].copy_(held)
    elif f["fault"] == "zero":
        data[a].zero_()
    elif f["fault"] == "other_rank":
        data[a].copy_(_other_rank_shard(module, layer, f, data.shape[1:]))


def _other_rank_shard(module, layer: int, f: dict, shape):
    """The shard of experts[0]'s tensor that MoE TP rank from_moe_tp_rank holds, in this layer's layout."""
    from moetrace.checkpoints.layout_rules import derive_layout
    from moetrace.checkpoints.reader import open_checkpoint
    from moetrace.checkpoints.shards import Parallel, expected_expert
    from moetrace.hooks.layout_facts import layout_facts

    with open_checkpoint(f["checkpoint"]) as ckpt:
        tp = int(getattr(module, "moe_tp_size", None) or 1)
        layout = derive_layout(layout_facts(module), ckpt.spec.fmt, ckpt.spec.intermediate_size // tp)
        shard = expected_expert(ckpt, layer, int(f["experts"][0]), int(f["from_moe_tp_rank"]), Parallel(tp, 1, layout))
    t = shard[f["tensor"]]
    if tuple(t.shape) != tuple(shape):
        raise MoetraceError(f"MoE TP rank {f['from_moe_tp_rank']}'s shard of {f['tensor']} is {tuple(t.shape)}, "
                            f"this rank holds {tuple(shape)}")
    return t
