"""``--forward-hooks``: SGLang's hook-spec JSON, with the same semantics.

Each entry: ``{"name": str, "target_modules": [fnmatch patterns over
model.named_modules()], "hook_factory": "pkg.mod:fn" (or "pkg.mod.fn"),
"config": {...}}``. In every rank process, after the model is built, each
spec's factory is resolved and called ONCE with its config (``{}`` when absent);
the returned ``hook(module, inputs, output)`` is registered with
``register_forward_hook`` on every matching module. A spec without targets or
factory, a factory returning None, or patterns matching nothing register
nothing (with a warning), as in SGLang; an unimportable factory is an error.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
from typing import Any, Callable

from torch import nn

from moetrace.errors import MoetraceError

log = logging.getLogger("moetrace.emulator.hooks")


def parse_forward_hooks(text: str | None) -> tuple[dict, ...]:
    """The CLI's JSON (a list of specs, or one spec) -> tuple of dicts."""
    if text is None or not str(text).strip():
        return ()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MoetraceError(f"--forward-hooks is not valid JSON ({err})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(s, dict) for s in data):
        raise MoetraceError("--forward-hooks must be a JSON list of objects with name, target_modules, hook_factory, "
                            "config")
    return tuple(data)


def resolve_callable(path: str) -> Callable:
    """'pkg.mod:attr' or 'pkg.mod.attr' (the attribute may be dotted after ':')."""
    if ":" in path:
        module_name, attr = path.split(":", 1)
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise MoetraceError(f"hook_factory {path!r}: expected 'package.module:factory' or 'package.module.factory'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise MoetraceError(f"hook_factory {path!r}: cannot import {module_name} ({err})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MoetraceError(f"hook_factory {path!r}: {module_name} has no attribute {attr}") from None
    if not callable(obj):
        raise MoetraceError(f"hook_factory {path!r} is not callable")
    return obj


def register_forward_hooks(model: nn.Module, specs) -> list[tuple[str, str]]:
    """Register every spec's hook; returns (spec name, module name) pairs registered."""
    modules = list(model.named_modules())
    registered: list[tuple[str, str]] = []
    for spec in specs or ():
        name = spec.get("name", "")
        patterns = spec.get("target_modules") or []
        if isinstance(patterns, str):
            patterns = [patterns]
        factory_path = spec.get("hook_factory")
        if not patterns:
            log.warning("forward hook %r has no target_modules: skipped", name)
            continue
        if not factory_path:
            log.warning("forward hook %r has no hook_factory: skipped", name)
            continue
        hook = resolve_callable(factory_path)(spec.get("config") or {})
        if hook is None:
            log.warning("forward hook %r: factory %s returned None, nothing registered", name, factory_path)
            continue
        matched = [(n, m) for n, m in modules if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if not matched:
            log.warning("forward hook %r: no module matches %s", name, patterns)
        for module_name, module in matched:
            module.register_forward_hook(hook)
            registered.append((name, module_name))
    return registered
