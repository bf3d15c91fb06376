"""The ``--forward-hooks`` JSON for SGLang. The flags that keep hooks firing (CUDA
graphs off) are hooks.server's."""

from __future__ import annotations

import os

from moetrace.checkpoints.index import index_metadata
from moetrace.errors import MoetraceError
from moetrace.schema import parse_ids
from moetrace.tracer.config import TraceConfig, new_run_id, new_run_nonce

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
    if not conf.get("run_nonce"):  # every rank of this server shares it; another launch gets another
        conf["run_nonce"] = new_run_nonce()
    for key in ("out", "index", "update_index_dir"):
        if conf.get(key) and "://" not in str(conf[key]):
            conf[key] = os.path.abspath(conf[key])
    if conf.get("index") and "://" not in conf["index"] and not os.path.isfile(conf["index"]):
        raise MoetraceError(f"--index {conf['index']}: no such file (build it with `moetrace index`)")
    if conf.get("index"):  # the model's expert count is known: a range past it is an error, never expanded
        meta = index_metadata(conf["index"])  # fused shared experts are ids num_experts + j
        parse_ids(conf.get("experts"), "--experts", bound=meta["num_experts"] + int(meta.get("shared_experts") or 0))
    if conf.get("update_index_dir") and not os.path.isdir(conf["update_index_dir"]):
        raise MoetraceError(f"--update-index-dir {conf['update_index_dir']}: no such folder")
    TraceConfig.from_dict(conf)  # raises MoetraceError on anything wrong
    return conf


def hook_spec(config: dict, targets=DEFAULT_TARGETS, name: str = SPEC_NAME) -> list[dict]:
    """The ``--forward-hooks`` list with one moetrace entry."""
    return [{"name": name, "target_modules": list(targets), "hook_factory": FACTORY_PATH, "config": hook_config(config)}]
