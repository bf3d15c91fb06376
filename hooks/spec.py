"""The ``--forward-hooks`` JSON for SGLang, and the flags that keep hooks firing.

SGLang hooks run only on the eager forward path (never during CUDA-graph
replay), so a capture of every step needs CUDA graphs off: 0.5.23 and later
spell it ``--disable-prefill-cuda-graph --disable-decode-cuda-graph``; older
releases (and the KT fork) ``--disable-cuda-graph`` (still accepted, deprecated,
by 0.5.23).
"""

from __future__ import annotations

import os
import re

from moetrace.checkpoints.index import index_metadata
from moetrace.errors import MoetraceError
from moetrace.schema import parse_ids
from moetrace.tracer.config import TraceConfig, new_run_id, new_run_nonce
from moetrace.tracer.manifest import package_version

FACTORY_PATH = "moetrace.hooks.sglang_hook:make_hook"
SPEC_NAME = "moetrace"
# Qwen3-MoE / Qwen3-Next / DeepSeek: model.layers.L.mlp.experts; Qwen3.5-MoE
# (conditional-generation wrapper) may nest the decoder under language_model.
DEFAULT_TARGETS = ("model.layers.*.mlp.experts", "model.language_model.layers.*.mlp.experts")
SPLIT_CUDA_GRAPH_FLAGS = ("--disable-prefill-cuda-graph", "--disable-decode-cuda-graph")
LEGACY_CUDA_GRAPH_FLAGS = ("--disable-cuda-graph",)
SPLIT_FLAGS_SINCE = (0, 5, 23)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'0.5.23', '0.5.23.post1', '0.5.4+kt' -> (0, 5, 23) / (0, 5, 4); None if no digits."""
    if not text:
        return None
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def installed_sglang_version() -> str | None:
    return package_version("sglang")


def cuda_graph_flags(version: str | None) -> tuple[str, ...]:
    """Flags that disable CUDA graphs for this SGLang version (unknown: the legacy
    spelling, which old releases need and 0.5.23 still accepts)."""
    v = parse_version(version)
    if v is not None and v >= SPLIT_FLAGS_SINCE:
        return SPLIT_CUDA_GRAPH_FLAGS
    return LEGACY_CUDA_GRAPH_FLAGS


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
        parse_ids(conf.get("experts"), "--experts", bound=index_metadata(conf["index"])["num_experts"])
    if conf.get("update_index_dir") and not os.path.isdir(conf["update_index_dir"]):
        raise MoetraceError(f"--update-index-dir {conf['update_index_dir']}: no such folder")
    TraceConfig.from_dict(conf)  # raises MoetraceError on anything wrong
    return conf


def hook_spec(config: dict, targets=DEFAULT_TARGETS, name: str = SPEC_NAME) -> list[dict]:
    """The ``--forward-hooks`` list with one moetrace entry."""
    return [{"name": name, "target_modules": list(targets), "hook_factory": FACTORY_PATH, "config": hook_config(config)}]
