"""SGLang ``--forward-hooks`` factory: ``moetrace.hooks.sglang_hook:make_hook``.

SGLang calls ``make_hook(config)`` once per hook spec in every TP worker, after
the model is loaded, and registers the returned ``hook(module, inputs, output)``
on every module matching the spec's ``target_modules``; a speculative draft's
runner does the same for its own model. The factory

- reads the config (plain JSON, docs/capture.md),
- reads where it is called from (hooks.registration): which runner and model,
  whether that is a draft, the modules it will hook, the server's pass counter,
- finds this worker's identity (TP rank, pipeline stage, replica: hooks.ranks),
- opens (once per process and run) the tracer and its Parquet sink,
- wraps KT's ``SharedFullContext.load`` when the server is a KT server,
- records the checkpoint the server loaded (its identity, read here from the runner's
  model path) and the KT wrapper's staging threshold (hooks.kt.staging_facts),
- with the guard on, listens to the server's weight-update entry points and checks
  that the index is of the checkpoint the server loaded (tracer.index_fit),
- returns a FusedMoE capture hook bound to that model.

It never raises into the server: a bad config or an unwritable output logs an
error and returns None (SGLang then registers nothing). Importing this module
loads torch, numpy and pyarrow only.
"""

from __future__ import annotations

import logging
import threading

from moetrace.hooks import weight_events
from moetrace.hooks.fused_moe import FusedMoECapture, layer_of
from moetrace.hooks.kt import install_kt_capture, staging_facts
from moetrace.hooks.ranks import detect_process
from moetrace.hooks.registration import Registration, bind_modules, find_registration, model_name
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig
from moetrace.tracer.index_fit import checkpoint_misfit, model_path_of

log = logging.getLogger("moetrace.hooks")

_TRACERS: dict[tuple[str, str], Tracer] = {}
_LOCK = threading.Lock()


def get_tracer(cfg: TraceConfig, reg: Registration | None = None) -> Tracer:
    """The process's tracer for (out, run_id): created on first use."""
    key = (cfg.out, cfg.run_id)
    with _LOCK:
        tracer = _TRACERS.get(key)
        if tracer is None or tracer.sink.closed:
            p = detect_process(cfg, reg.runner if reg else None, reg.dp_rank if reg else None)
            tracer = _TRACERS[key] = Tracer(cfg, p.tp_rank, p.tp_size, tp_rank_found_by=p.found_by["tp"],
                                            pp_rank=p.pp_rank, pp_size=p.pp_size, replica=p.replica,
                                            rank_found_by=p.found_by)
        return tracer


def _hooked_layers(reg: Registration | None) -> list[int] | None:
    if reg is None:
        return None
    layers = set()
    for module in reg.modules.values():
        try:
            layers.add(layer_of(module))
        except AttributeError:
            continue
    return sorted(layers)


def serve_model(tracer: Tracer, reg: Registration | None) -> str:
    """Declare the model this factory call serves to the tracer; returns its name."""
    name, how = model_name(reg)
    pass_id, steps_found_by = reg.pass_counter() if reg is not None else (None, "layer-order")
    tracer.register_model(name, pass_id=pass_id, steps_found_by=steps_found_by, found_by=how,
                          architecture=reg.architecture if reg is not None else None, layers=_hooked_layers(reg))
    bind_modules(reg, name)
    return name


def _missing(tracer: Tracer, message: str) -> None:
    """A condition that holds on every rank alike: recorded in every rank's manifest,
    said once (by TP rank 0), and not at all where it is expected (the emulator)."""
    if tracer.tp_rank == 0 and weight_events.absence_expected() is None:
        tracer.note_once(message)
    else:
        tracer.sink.note(message)


def _server_facts(tracer: Tracer, reg: Registration) -> None:
    """What the target's runner and layers say of the server: the checkpoint it loaded, its
    staging; the guard's index must be of that checkpoint (else unverified, said once)."""
    try:
        path = model_path_of(reg.runner)
        identity = tracer.loaded_checkpoint(path)
        if tracer.guard is not None and tracer.guard.expected is not None:
            tracer.guard.misfit(checkpoint_misfit(tracer.guard.expected.meta, path, identity))
    except Exception as err:
        tracer.record_error("guard_fit" if tracer.guard is not None else "checkpoint_identity", err)
    try:
        staging = staging_facts(reg.modules.values(), reg.runner)
        if staging is not None:
            tracer.sink.update(staging=staging)
    except Exception as err:
        tracer.record_error("staging_facts", err)


def make_hook(config: dict | None):
    """``factory(config) -> hook`` for SGLang's ``--forward-hooks``."""
    try:
        cfg = TraceConfig.from_dict(config)
    except Exception as err:
        log.error("moetrace: invalid hook config, tracing is off: %s", err)
        return None
    try:
        reg = find_registration()
    except Exception as err:  # never stop the server over reading its frames
        log.warning("moetrace: cannot read the registering runner (%s): target model, layer-order steps", err)
        reg = None
    try:
        tracer = get_tracer(cfg, reg)
    except Exception as err:
        log.error("moetrace: cannot start tracing, the server runs untraced: %s", err)
        return None
    if cfg.resident_cache and not weight_events.install():
        _missing(tracer, "SGLang's weight writers were not found: resident weights are fingerprinted on every pass")
    found = weight_events.watch_updates(tracer.weights_updated)  # the manifest records every update
    if tracer.guard is not None and not weight_events.watch_updates(tracer.guard.weights_updated):
        _missing(tracer, "guard: SGLang's weight-update entry points were not found: a weight update would not be seen")
    elif tracer.guard is None and not found:
        _missing(tracer, "SGLang's weight-update entry points were not found: a weight update would not be recorded")
    try:
        model = serve_model(tracer, reg)
    except Exception as err:
        tracer.record_error("model_identity", err)
        model = "target"
    if model == "target" and reg is not None:
        _server_facts(tracer, reg)
    try:
        install_kt_capture(tracer, cfg.kt)
    except Exception as err:
        tracer.record_error("kt_install", err)
    return FusedMoECapture(tracer, model)


def close_all(reason: str = "close", timeout: float | None = None) -> bool:
    """Close every tracer of this process (flushes parts, finishes manifests)."""
    with _LOCK:
        tracers = list(_TRACERS.values())
        _TRACERS.clear()
    ok = True
    for t in tracers:
        ok = t.close(reason, timeout) and ok
    return ok
