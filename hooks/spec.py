"""The ``--forward-hooks`` JSON for SGLang. The flags that keep hooks firing (CUDA
graphs off) are hooks.server's."""

from __future__ import annotations

import os

from moetrace.errors import MoetraceError
from moetrace.tracer.config import TraceConfig, new_run_id

FACTORY_PATH = "moetrace.hooks.sglang_hook:make_hook"
SPEC_NAME = "moetrace"
# Qwen3-MoE / Qwen3-Next / DeepSeek: model.layers.L.mlp.experts; Qwen3.5-MoE
# (conditional-generation wrapper) may nest the decoder under language_model.
DEFAULT_TARGETS = ("model.layers.*.mlp.experts", "model.language_model.layers.*.mlp.experts")

def hook_config(config: dict) -> dict:
    """Validate a capture config and pin what every rank must agree on (run id,
    absolute output path). Returns the JSON-ready dict."""
    conf = dict(config)
    if not conf.get("run_id"):
        conf["run_id"] = new_run_id()
    for key in ("out", "index"):
        if conf.get(key) and "://" not in str(conf[key]):
            conf[key] = os.path.abspath(conf[key])
    if conf.get("index") and "://" not in conf["index"] and not os.path.isfile(conf["index"]):
        raise MoetraceError(f"--index {conf['index']}: no such file (build it with `moetrace index`)")
    TraceConfig.from_dict(conf)  # raises MoetraceError on anything wrong
    return conf


def hook_spec(config: dict, targets=DEFAULT_TARGETS, name: str = SPEC_NAME) -> list[dict]:
    """The ``--forward-hooks`` list with one moetrace entry."""
    return [{"name": name, "target_modules": list(targets), "hook_factory": FACTORY_PATH, "config": hook_config(config)}]
