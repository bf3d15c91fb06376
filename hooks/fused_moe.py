"""Capture of resident FusedMoE expert tensors from a forward hook.

A FusedMoE-shaped module holds stacked per-expert params ``[E_local, ...]``:
``w13_weight``, ``w2_weight`` and, for FP8, ``w13_weight_scale_inv`` /
``w2_weight_scale_inv`` (block) or ``w13_weight_scale`` / ``w2_weight_scale``
(per-channel); BF16 has no scales. Which logical expert each slot holds comes
from the server's own map, read at every capture (hooks.slots); the layer from
``module.layer_id``; the model (target or draft) from where the hook was registered.
"""

from __future__ import annotations

import torch

from moetrace.hooks import weight_events
from moetrace.hooks.layout_facts import layout_facts
from moetrace.hooks.ranks import module_ranks
from moetrace.hooks.registration import model_of
from moetrace.hooks.slots import UNUSED, SlotMapError, read_slot_map
from moetrace.schema import TENSOR_NAMES
from moetrace.tracer.capture import Tracer, cuda_graph_capturing
from moetrace.tracer.guard import GuardMismatch

LAYER_ATTRS = ("layer_id", "layer_idx", "layer_number")
# A server's INT4 words are Marlin-repacked (checkpoints.layout_rules refuses them): only a KT
# staged context whose repack moetrace conform replaced captures them (hooks.kt).
INT4_WORDS = ("w13_weight_packed", "w2_weight_packed")
RESIDENT_NAMES = tuple(n for n in TENSOR_NAMES if n not in INT4_WORDS)


def expert_tensors(module, names: tuple[str, ...] = RESIDENT_NAMES) -> dict[str, torch.Tensor]:
    """The stacked expert params of a FusedMoE-like module, in copy order."""
    found: dict[str, torch.Tensor] = {}
    for name in names:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            found[name] = t
    if not found:
        return found
    n = found.get("w13_weight", next(iter(found.values()))).shape[0]
    return {k: v for k, v in found.items() if v.shape[0] == n}


def layer_of(module) -> int:
    for attr in LAYER_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise AttributeError(f"{type(module).__name__} has none of {', '.join(LAYER_ATTRS)}: cannot tell its layer")


class FusedMoECapture:
    """``hook(module, inputs, output)`` for ``register_forward_hook``; returns None
    (the output is never touched) and never raises, except the guard's GuardMismatch
    in fail-closed mode: the forward pass then fails before any token is returned.
    One per factory call: `model` is the model of the runner it was registered for."""

    source = "resident"

    def __init__(self, tracer: Tracer, model: str = "target"):
        self.tracer = tracer
        self.model = model

    def __call__(self, module, inputs, output):
        tr = self.tracer
        if not tr.enabled:
            return None
        try:
            if cuda_graph_capturing():  # a graph-capture pass, not a step: replays never reach hooks
                tr.note_once("forward hook ran during CUDA-graph capture: that pass is not captured")
                return None
            model = model_of(module, self.model)
            layer = layer_of(module)
            step = tr.step_for(self.source, layer, model)
            if not tr.wants(model, self.source, step, layer):
                return None
            tensors = expert_tensors(module)
            if not tensors:
                tr.note_once(f"{type(module).__name__} at {model} layer {layer} has no FusedMoE expert params: not "
                             f"captured")
                return None
            n_slots = next(iter(tensors.values())).shape[0]
            try:
                slots = read_slot_map(module, n_slots, layer)
            except SlotMapError as err:  # said by name; the layer reads as never captured, never as divergent
                tr.note_once(f"{model} layer {layer}: slots not mapped to experts, not captured: {err}")
                return None
            if slots is None:
                tr.note_once(f"{model} layer {layer}: no GPU-resident experts (KT keeps a dummy slot): resident "
                             f"capture skipped")
                return None
            used = [i for i, e in enumerate(slots.experts) if e != UNUSED]
            if len(used) < n_slots:
                tr.note_once(f"{model} layer {layer}: {n_slots - len(used)} slot(s) the loader never fills (no logical "
                             "expert maps to them) are not captured")
            tr.sink.count_slot_map(model, slots.found_by)
            # Unchanged weights reuse their fingerprints only where every write is counted
            # (weight_events: loaders, updaters, EPLB's); KT's slots change under its own copies.
            epoch = None
            if tr.config.resident_cache and not slots.found_by.startswith("kt") and weight_events.watch_params(tensors):
                epoch = weight_events.epoch()
            # the slots its captures report: the layout's less those never filled (analysis.row_check.layout_slots)
            tr.record_layout(self.source, layer, {**layout_facts(module), "unfilled_slots": n_slots - len(used)}, model)
            tr.capture(tensors, layer=layer, source=self.source, step=step, model=model,
                       experts=[slots.experts[i] for i in used], slots=used, positions=used,
                       copies=[slots.copies[i] for i in used], slot_count=len(used),
                       ranks=module_ranks(module, tr.tp_rank, tr.tp_size), weights_epoch=epoch)
        except GuardMismatch:  # fail-closed: the layer must not be used
            raise
        except Exception as err:
            try:
                tr.record_error("fused_moe_hook", err)
            except Exception:
                pass
        return None
