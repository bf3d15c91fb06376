"""The ``--forward-hooks`` JSON for SGLang. The flags that keep hooks firing (CUDA
graphs off) are servers.command's."""

from __future__ import annotations

import os

from moetrace.errors import MoetraceError
from moetrace.schema import parse_ids
from moetrace.tracer import index_fit
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
        from moetrace.checkpoints.index import index_metadata  # pyarrow: only with an index

        meta = index_metadata(conf["index"])  # fused shared experts are ids num_experts + j
        parse_ids(conf.get("experts"), "--experts", bound=meta["num_experts"] + int(meta.get("shared_experts") or 0))
    if conf.get("update_index_dir") and not os.path.isdir(conf["update_index_dir"]):
        raise MoetraceError(f"--update-index-dir {conf['update_index_dir']}: no such folder")
    TraceConfig.from_dict(conf)  # raises MoetraceError on anything wrong
    if conf.get("index"):
        index_fits(conf["index"], tp_size=conf.get("tp_size"), checkpoint_id=conf.get("checkpoint_id"))
    return conf


def index_fits(index: str, tp_size: int | None = None, model_path: str | None = None,
               checkpoint_id: str | None = None) -> None:
    """Refuse an index that cannot fit the server as far as the options tell (tracer.index_fit):
    the guard would only say `unverified`, and the trace could not be audited against it."""
    from moetrace.checkpoints.index import index_metadata

    meta = index_metadata(index)
    why = (index_fit.tp_misfit(meta, tp_size) or index_fit.checkpoint_id_misfit(meta, checkpoint_id)
           or index_fit.checkpoint_misfit(meta, model_path))
    if why:
        raise MoetraceError(f"--index {index}: does not fit the server: {why}; build the index for it with "
                            "`moetrace index`")


def hook_spec(config: dict, targets=DEFAULT_TARGETS, name: str = SPEC_NAME) -> list[dict]:
    """The ``--forward-hooks`` list with one moetrace entry."""
    return [{"name": name, "target_modules": list(targets), "hook_factory": FACTORY_PATH,
             "config": hook_config(config)}]
