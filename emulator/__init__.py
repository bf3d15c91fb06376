"""Emulated TP KT-staging server: KTransformers' FP8 layerwise-prefill transport,
reproduced on CPU (threads) or CUDA (streams, events, pinned memory), with a
deterministic slow-peer injection and a switchable reader fence.

Entry points (imported lazily, so ``import moetrace.emulator`` stays light):

- ``run_emulation(checkpoint, requests, tp=2, fence="none", ...)``: whole run in-process, no HTTP;
- ``reference_outputs(checkpoint, requests, tp=2)``: the same requests without transport;
- ``start_server(EmulatorConfig)`` -> ``ServerHandle`` (``.url``, ``.stop()``); ``serve(...)``: the CLI body;
- ``time_loads(dims_or_checkpoint, fences=("none", "all"))``: per-load timings;
- ``EmulatorConfig``, ``WeightsSpec``, ``ModelDims``, ``as_config``.

docs/emulator.md says what is faithful to the fork and what is not.
"""

from __future__ import annotations

_EXPORTS = {
    "run_emulation": "api",
    "reference_outputs": "api",
    "time_loads": "api",
    "EmulationResult": "api",
    "RequestResult": "api",
    "LoadRecord": "api",
    "start_server": "launcher",
    "serve": "launcher",
    "ServerHandle": "launcher",
    "EmulatorError": "launcher",
    "EmulatorConfig": "config",
    "WeightsSpec": "config",
    "ModelDims": "config",
    "as_config": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"moetrace.emulator.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moetrace.emulator' has no attribute {name!r}")
