"""The ``vllm.general_plugins`` entry point: ``moetrace.hooks.vllm.plugin:register``.

vLLM loads every general plugin in each of its processes (the API server, the engine
core, every worker: ``vllm/plugins/__init__.py`` load_general_plugins, called from
``v1/worker/worker_base.py`` init_worker before the model exists), once per process.
``register`` does nothing unless ``MOETRACE_VLLM_CONFIG`` holds moetrace's hook config:
the JSON object ``moetrace hook-spec --server vllm`` prints (the same ``config`` an
SGLang ``--forward-hooks`` entry carries), or the path of a file holding it. Then it
registers moetrace's model loader (hooks.vllm.loader) through vLLM's public
``register_model_loader``; the tracer starts only where a model is loaded (the workers).

It never raises into vLLM: a bad config is logged and the server runs untraced.
Importing this module loads the standard library only.
"""

from __future__ import annotations

import json
import logging
import os

CONFIG_ENV = "MOETRACE_VLLM_CONFIG"

log = logging.getLogger("moetrace.hooks")


def read_config(value: str) -> dict:
    """The hook config from the variable's value: a JSON object, or a path to a file of one."""
    text = value.strip()
    if not text.startswith("{"):
        try:
            with open(text) as f:
                text = f.read()
        except OSError as err:
            why = f"neither a JSON object nor a readable file ({err.strerror})"
            raise ValueError(f"{CONFIG_ENV}={value!r}: {why}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{CONFIG_ENV}: not JSON ({err})") from None
    if not isinstance(config, dict) or not config.get("out"):
        raise ValueError(f"{CONFIG_ENV}: expected a JSON object of hook config keys with 'out' (docs/capture.md)")
    return config


def register() -> None:
    """vLLM's plugin call: install moetrace's loader when its config is in the environment."""
    value = os.environ.get(CONFIG_ENV)
    if not value:
        return
    try:
        config = read_config(value)
        from moetrace.hooks.vllm.loader import install

        install(config)
    except Exception as err:  # never stop the server over its tracing
        log.error("moetrace: tracing is off in this process (pid %d): %s", os.getpid(), err)
