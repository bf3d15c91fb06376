"""SGLang ``--forward-hooks`` factory: ``moetrace.hooks.sglang_hook:make_hook``.

SGLang calls ``make_hook(config)`` once per hook spec in every TP worker, after
the model is loaded, and registers the returned ``hook(module, inputs, output)``
on every module matching the spec's ``target_modules``. The factory

- reads the config (plain JSON, docs/capture.md) and finds this worker's rank,
- opens (once per process and run) the tracer and its Parquet sink,
- wraps KT's ``SharedFullContext.load`` when the server is a KT server,
- with the guard on, listens to the server's weight-update entry points,
- returns the FusedMoE capture hook.

It never raises into the server: a bad config or an unwritable output logs an
error and returns None (SGLang then registers nothing). Importing this module
loads torch, numpy and pyarrow only.
"""

from __future__ import annotations

import logging
import threading

from moetrace.hooks import weight_events
from moetrace.hooks.fused_moe import FusedMoECapture
from moetrace.hooks.kt import install_kt_capture
from moetrace.hooks.ranks import detect_rank
from moetrace.tracer.capture import Tracer
from moetrace.tracer.config import TraceConfig

log = logging.getLogger("moetrace.hooks")

_TRACERS: dict[tuple[str, str], Tracer] = {}
_LOCK = threading.Lock()


def get_tracer(cfg: TraceConfig) -> Tracer:
    """The process's tracer for (out, run_id): created on first use."""
    key = (cfg.out, cfg.run_id)
    with _LOCK:
        tracer = _TRACERS.get(key)
        if tracer is None or tracer.sink.closed:
            rank, size, how = detect_rank(cfg.tp_rank, cfg.tp_size)
            tracer = _TRACERS[key] = Tracer(cfg, rank, size, rank_source=how)
        return tracer


def make_hook(config: dict | None):
    """``factory(config) -> hook`` for SGLang's ``--forward-hooks``."""
    try:
        cfg = TraceConfig.from_dict(config)
    except Exception as err:
        log.error("moetrace: invalid hook config, tracing is off: %s", err)
        return None
    try:
        tracer = get_tracer(cfg)
    except Exception as err:
        log.error("moetrace: cannot start tracing, the server runs untraced: %s", err)
        return None
    if cfg.resident_cache and not weight_events.install():
        tracer.note_once("SGLang's weight writers were not found: resident weights are fingerprinted on every pass")
    if tracer.guard is not None and not weight_events.watch_updates(tracer.guard.weights_updated):
        tracer.note_once("guard: SGLang's weight-update entry points were not found: a weight update would not be seen")
    try:
        install_kt_capture(tracer, cfg.kt)
    except Exception as err:
        tracer.record_error("kt_install", err)
    return FusedMoECapture(tracer)


def close_all(reason: str = "close", timeout: float | None = None) -> bool:
    """Close every tracer of this process (flushes parts, finishes manifests)."""
    with _LOCK:
        tracers = list(_TRACERS.values())
        _TRACERS.clear()
    ok = True
    for t in tracers:
        ok = t.close(reason, timeout) and ok
    return ok
