"""moetrace in one vLLM worker: the tracer, the load-boundary capture, the forward hooks.

Called by hooks.vllm.loader from inside vLLM's model loading, never raising into it:

- ``weights_loaded``: right after ``load_weights``, before ``process_weights_after_
  loading`` repacks anything. Opens this process's tracer (ranks: hooks.vllm.experts),
  declares the model and captures every MoE layer as loaded: source ``loaded``, step 0,
  judged against the index byte for byte.
- ``model_ready``: the model is final. Registers a forward hook on every MoE layer's
  runner; each forward captures the layer as its kernel holds it (source ``resident``,
  steps counted in layer order from 0), judged through the kernel's layout
  (hooks.vllm.kernel_layout: vLLM CPU's packs and zero padding undone, other layouts
  kept as held and refused by name in the analysis). Forward hooks run only in eager
  mode: under torch.compile (vLLM's default) a hook is traced away or breaks the
  engine's warm-up, so none is registered and the manifest says why; the missing
  resident rows then make the run incomplete (tracer.manifest: capture points).

A speculative-decoding draft model (loaded by a second ``load_model``) is not captured.
"""

from __future__ import annotations

import logging
import threading
import weakref

from moetrace.hooks.fused_moe import expert_tensors
from moetrace.hooks.slots import SlotMapError
from moetrace.hooks.vllm.experts import MoELayer, find_layers, layer_ranks, process_ranks, slot_experts
from moetrace.hooks.vllm.kernel_layout import canonical, loaded_layout, params_facts, resident_layout
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig
from moetrace.tracer.guard import GuardMismatch
from moetrace.tracer.index_fit import checkpoint_misfit

log = logging.getLogger("moetrace.hooks")

CAPTURE_POINTS = ("loaded", "resident")
LOAD_STEP = 0  # the load boundary is before every forward pass
_TRACERS: dict[tuple, Tracer] = {}
_LOCK = threading.Lock()
_LOADED: "weakref.WeakSet" = weakref.WeakSet()  # models whose load boundary was captured
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()  # models whose layers carry the forward hook


def _tracer(config: dict, vllm_config) -> Tracer | None:
    key = (config.get("out"), config.get("run_id"))
    with _LOCK:
        tracer = _TRACERS.get(key)
        if tracer is not None and not tracer.sink.closed:
            return tracer
        try:
            cfg = TraceConfig.from_dict(config)
        except Exception as err:
            log.error("moetrace: invalid hook config, tracing is off: %s", err)
            return None
        p = process_ranks(cfg, vllm_config)
        tracer = _TRACERS[key] = Tracer(cfg, p.tp_rank, p.tp_size, tp_rank_found_by=p.found_by["tp"],
                                        pp_rank=p.pp_rank, pp_size=p.pp_size, replica=p.replica,
                                        rank_found_by=p.found_by)
        return tracer


def _is_target(vllm_config, model_config) -> bool:
    return vllm_config is None or model_config is getattr(vllm_config, "model_config", model_config)


def eager(vllm_config) -> tuple[bool, str]:
    """(forward hooks can run, the compilation mode vLLM runs with)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "mode", None)
    value = getattr(mode, "value", mode)
    return value in (0, None), f"{getattr(mode, 'name', mode)}"


def weights_loaded(config: dict, model, vllm_config, model_config) -> None:
    """Capture every MoE layer of a just-loaded model (never raises)."""
    try:
        if not _is_target(vllm_config, model_config):
            return
        tracer = _tracer(config, vllm_config)
        if tracer is None or not tracer.enabled:
            return
        if model in _LOADED:
            tracer.note_once("the weights were loaded again after start-up: the load boundary is captured once; "
                             "resident captures judge the new weights")
            return
        _LOADED.add(model)
        layers = find_layers(model)
        if not layers:
            tracer.note_once(f"{type(model).__name__} has no MoE expert layers at model.layers.*.mlp.experts: "
                             "nothing captured")
            return
        tracer.register_model("target", steps_found_by="layer-order", found_by="vllm: the engine's model_config",
                              architecture=type(model).__name__, layers=[x.layer for x in layers], server="vllm",
                              capture_points=list(CAPTURE_POINTS))
        _check_fit(tracer, model_config)
        for layer in layers:
            try:
                capture(tracer, layer, "loaded", LOAD_STEP)
            except GuardMismatch:
                raise
            except Exception as err:
                tracer.record_error("vllm_loaded", err)
    except GuardMismatch:  # fail-closed: the server must not start on wrong weights
        raise
    except Exception as err:
        log.warning("moetrace: load-boundary capture failed (the server runs on): %s", err)


def model_ready(config: dict, model, vllm_config, model_config) -> None:
    """Register the resident forward hooks on a final model (never raises)."""
    try:
        if not _is_target(vllm_config, model_config):
            tracer = _tracer(config, vllm_config)
            if tracer is not None:
                tracer.note_once("a speculative-decoding draft model was loaded: its experts are not captured")
            return
        tracer = _tracer(config, vllm_config)
        if tracer is None or model in _HOOKED:
            return
        ok, mode = eager(vllm_config)
        if not ok:
            tracer.note_once(f"vLLM runs with torch.compile (compilation mode {mode}): forward hooks do not run under "
                             "it, so no resident weights are captured; start the server with --enforce-eager")
            return
        _HOOKED.add(model)
        layers = find_layers(model)
        _register_faults(tracer, layers)
        for layer in layers:
            layer.module.register_forward_hook(ResidentHook(tracer, layer))
    except Exception as err:
        log.warning("moetrace: cannot register the forward hooks (the server runs on): %s", err)


def _register_faults(tracer: Tracer, layers: list[MoELayer]) -> None:
    """$MOETRACE_FAULTS (selftest --server): moetrace's fault hook on each layer, before its capture."""
    from moetrace.hooks.faults import FaultHook, LayerAccess, faults_from_env

    faults = faults_from_env()
    if not faults:
        return
    by_module = {id(x.module): x for x in layers}
    access = LayerAccess(layer=lambda m: by_module[id(m)].layer,
                         tensors=lambda m: expert_tensors(by_module[id(m)].routed),
                         slots=lambda m, n, layer: slot_experts(by_module[id(m)].routed, n)[0])
    hook = FaultHook(faults, access, rank=tracer.tp_rank)
    for layer in layers:
        layer.module.register_forward_hook(hook)
    tracer.note_once(f"moetrace faults injected (selftest --server): {len(faults)}")


def _check_fit(tracer: Tracer, model_config) -> None:
    """The checkpoint the server loaded goes in the manifest; the guard's index must be of it
    (said once, unverified)."""
    guard = tracer.guard
    try:
        path = getattr(model_config, "model", None)
        identity = tracer.loaded_checkpoint(path)
        if guard is not None and guard.expected is not None:
            guard.misfit(checkpoint_misfit(guard.expected.meta, path, identity))
    except Exception as err:
        tracer.record_error("guard_fit" if guard is not None else "checkpoint_identity", err)


def capture(tracer: Tracer, layer: MoELayer, source: str, step: int) -> int:
    """Capture one layer's expert tensors (source "loaded" or "resident"); returns the rows queued."""
    routed = layer.routed
    tensors = expert_tensors(routed)
    if not tensors:
        tracer.note_once(f"{type(routed).__name__} at layer {layer.layer} has no expert params: not captured")
        return 0
    layout = loaded_layout(routed) if source == "loaded" else resident_layout(routed, tensors)
    held, problems = canonical(tensors, layout)
    n = next(iter(held.values())).shape[0]
    try:
        experts, how = slot_experts(routed, n)
    except SlotMapError as err:  # said by name; the layer reads as never captured, never as divergent
        tracer.note_once(f"layer {layer.layer}: slots not mapped to experts, not captured: {err}")
        return 0
    tracer.sink.count_slot_map("target", how)
    tracer.record_layout(source, layer.layer, {**layout.facts, "params": params_facts(held), "slot_map": how,
                                               "unfilled_slots": 0})
    slots = list(range(n))
    rows = tracer.capture(held, layer=layer.layer, source=source, step=step, model="target", experts=experts,
                          slots=slots, positions=slots, copies=[0] * n, slot_count=n,
                          ranks=layer_ranks(routed, tracer.tp_rank, tracer.tp_size))
    for phrase in problems:  # bytes the index cannot judge: an error of this run, never a pass
        tracer.record_error(f"vllm_{source}_padding", ValueError(f"layer {layer.layer} ({source}): {phrase}"))
    return rows


class ResidentHook:
    """``hook(module, args, output)`` on a MoE layer's runner: captures the layer after each
    forward; returns None and never raises (except the guard's fail-closed GuardMismatch)."""

    source = "resident"

    def __init__(self, tracer: Tracer, layer: MoELayer):
        self.tracer = tracer
        self.layer = layer

    def __call__(self, module, args, output):
        tr = self.tracer
        if not tr.enabled:
            return None
        try:
            step = tr.step_for(self.source, self.layer.layer, "target")
            if tr.wants("target", self.source, step, self.layer.layer):
                capture(tr, self.layer, self.source, step)
        except GuardMismatch:
            raise
        except Exception as err:
            try:
                tr.record_error("vllm_resident_hook", err)
            except Exception:
                pass
        return None


def close_all(reason: str = "close", timeout: float | None = None) -> bool:
    with _LOCK:
        tracers = list(_TRACERS.values())
        _TRACERS.clear()
    return all([t.close(reason, timeout) for t in tracers])
