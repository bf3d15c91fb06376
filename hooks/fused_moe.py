"""Capture of resident FusedMoE expert tensors from a forward hook.

A FusedMoE-shaped module holds stacked per-expert params ``[E_local, ...]``:
``w13_weight``, ``w2_weight`` and, for FP8, ``w13_weight_scale_inv`` /
``w2_weight_scale_inv`` (block) or ``w13_weight_scale`` / ``w2_weight_scale``
(per-channel); BF16 has no scales. Local expert i of EP rank r is global
expert ``r * E_local + i`` (KT fork: the wrapper's slot -> logical map). The
layer comes from ``module.layer_id``.
"""

from __future__ import annotations

import torch

from moetrace.hooks import weight_events
from moetrace.hooks.layout import layout_facts
from moetrace.hooks.ranks import module_ranks
from moetrace.tracer.guard import GuardMismatch
from moetrace.tracer.capture import Tracer, cuda_graph_capturing
from moetrace.schema import TENSOR_NAMES

LAYER_ATTRS = ("layer_id", "layer_idx", "layer_number")


def expert_tensors(module) -> dict[str, torch.Tensor]:
    """The stacked expert params of a FusedMoE-like module, in copy order."""
    found: dict[str, torch.Tensor] = {}
    for name in TENSOR_NAMES:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            found[name] = t
    if not found:
        return found
    n = found.get("w13_weight", next(iter(found.values()))).shape[0]
    return {k: v for k, v in found.items() if v.shape[0] == n}


def slot_experts(module, n_local: int, ep_rank: int) -> tuple[list[int] | None, str]:
    """Global expert id held in each of the module's n_local slots, and how it was found.

    KTransformers' fork keeps only the GPU experts in the resident FusedMoE; its
    quant method (KTEPWrapperMethod) maps slots to logical ids
    (``gpu_index_to_logical``, or the inverse ``logical_to_gpu_index``), which
    dynamic expert updates change at run time, so it is read on every call.
    Otherwise slot i of EP rank r holds ``r * n_local + i``. None: nothing real
    is resident (KT with no GPU experts keeps a dummy slot).
    """
    qm = getattr(module, "quant_method", None)
    if qm is not None and getattr(qm, "num_gpu_experts", None) == 0:
        return None, "kt-no-gpu-experts"
    g2l = getattr(qm, "gpu_index_to_logical", None)
    if g2l is not None and len(g2l) == n_local:
        return [int(e) for e in (g2l.tolist() if hasattr(g2l, "tolist") else g2l)], "kt-gpu-index"
    l2g = getattr(qm, "logical_to_gpu_index", None)
    if l2g is not None:
        inv = [-1] * n_local
        for e, g in enumerate(l2g.tolist() if hasattr(l2g, "tolist") else l2g):
            if 0 <= int(g) < n_local:
                inv[int(g)] = e
        if all(e >= 0 for e in inv):
            return inv, "kt-logical-index"
    return [ep_rank * n_local + i for i in range(n_local)], "ep-rank"


def layer_of(module) -> int:
    for attr in LAYER_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise AttributeError(f"{type(module).__name__} has none of {', '.join(LAYER_ATTRS)}: cannot tell its layer")


class FusedMoECapture:
    """``hook(module, inputs, output)`` for ``register_forward_hook``; returns None
    (the output is never touched) and never raises, except the guard's GuardMismatch
    in fail-closed mode: the forward pass then fails before any token is returned."""

    source = "resident"

    def __init__(self, tracer: Tracer):
        self.tracer = tracer

    def __call__(self, module, inputs, output):
        tr = self.tracer
        if not tr.enabled:
            return None
        try:
            if cuda_graph_capturing():  # a graph-capture pass, not a step: replays never reach hooks
                tr.note_once("forward hook ran during CUDA-graph capture: that pass is not captured")
                return None
            layer = layer_of(module)
            step = tr.step_for(self.source, layer)
            if not tr.sampling.want(self.source, step, layer):
                return None
            tensors = expert_tensors(module)
            if not tensors:
                tr.note_once(f"{type(module).__name__} at layer {layer} has no FusedMoE expert params: not captured")
                return None
            n_local = next(iter(tensors.values())).shape[0]
            ranks = module_ranks(module, tr.tp_rank, tr.tp_size)
            experts, how = slot_experts(module, n_local, ranks.ep_rank)
            if experts is None:
                tr.note_once(f"layer {layer}: no GPU-resident experts ({how}): resident capture skipped")
                return None
            local = list(range(n_local))
            # Unchanged weights reuse their fingerprints only where every write is
            # counted (weight_events); KT's slots change under its own copies.
            epoch = None
            if tr.config.resident_cache and how == "ep-rank" and weight_events.watch_params(tensors):
                epoch = weight_events.epoch()
            tr.record_layout(self.source, layer, layout_facts(module))
            tr.capture(tensors, layer=layer, source=self.source, step=step, experts=experts,
                       local_experts=local, positions=local, ranks=ranks, weights_epoch=epoch)
        except GuardMismatch:  # fail-closed: the layer must not be used
            raise
        except Exception as err:
            try:
                tr.record_error("fused_moe_hook", err)
            except Exception:
                pass
        return None
