"""What the installed class needs, read from its AST: the methods its ``__init__`` and
``load`` reach, and which ``_prepare_weight_*`` method ``load`` dispatches a format to.

conform runs the class's own ``__init__`` with one method replaced (``_build_layers``,
which needs SGLang's quant methods) and calls its own ``load``; so what a release needs
is whatever those two reach through ``self.<method>(...)``, release by release, and a
missing piece is named with the method that calls it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from moetrace.conform.fork import CLASS_NAME, ForkError

PROVIDED = ("_build_layers",)  # conform's own (conform/rank.py): SGLang's quant methods are not here
ENTRIES = ("__init__", "load")
# load's dispatch: flag read (`self._is_<flag>_quant` / getattr) -> conform's format; INT4 is the final else
FLAG_FORMATS = {"fp8": "fp8_block", "fp8_channel": "fp8_channel", "bf16": "bf16", "mxfp4": "mxfp4", "mxfp8": "mxfp8"}
FORMATS_STAGED = ("fp8_block", "fp8_channel", "bf16", "int4", "mxfp4", "mxfp8")
_FLAG = re.compile(r"^_?is_(\w+?)_quant$")


class NoPath(ForkError):
    """The release's load has no path for the format (a row of the releases table, not a fault)."""


@dataclass(frozen=True)
class Requirements:
    methods: tuple[str, ...]  # every method __init__ and load reach, in the order found
    dispatch: dict  # conform format -> the method load stages it with
    missing: tuple[tuple[str, str], ...]  # (caller, method it calls that the class lacks)


def methods_of(cls_node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls_node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def self_calls(fn: ast.AST) -> list[str]:
    """Methods called as ``self.<name>(...)`` anywhere in fn (nested functions included)."""
    out = []
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                and n.func.value.id == "self" and n.func.attr not in out):
            out.append(n.func.attr)
    return out


def _assigned_attrs(cls_node: ast.ClassDef) -> set[str]:
    """``self.<name> = ...`` anywhere in the class, and class-level names: callables set as data."""
    names = {t.id for n in cls_node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(cls_node):
        for t in getattr(n, "targets", [getattr(n, "target", None)]):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def _flags(test: ast.AST) -> list[str]:
    """Quant flags an if-test reads: ``self._is_fp8_quant`` or ``getattr(self, "_is_mxfp4_quant", ...)``."""
    found = []
    for n in ast.walk(test):
        name = n.attr if isinstance(n, ast.Attribute) else (
            n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None)
        m = _FLAG.match(name or "")
        if m:
            found.append(m.group(1))
    return found


def _first_prepare(stmts: list) -> str | None:
    for s in stmts:
        for name in self_calls(s):
            if name.startswith("_prepare_weight"):
                return name
    return None


def dispatch(load: ast.FunctionDef) -> dict[str, str]:
    """conform format -> the ``_prepare_weight_*`` method load calls for it (INT4: the
    chain's final else)."""
    out: dict[str, str] = {}
    for node in ast.walk(load):
        if not isinstance(node, ast.If):
            continue
        flags = _flags(node.test)
        if len(flags) == 1 and flags[0] in FLAG_FORMATS:
            method = _first_prepare(node.body)
            if method:
                out.setdefault(FLAG_FORMATS[flags[0]], method)
            tail = node.orelse
            if tail and not (len(tail) == 1 and isinstance(tail[0], ast.If)):
                method = _first_prepare(tail)
                if method:
                    out.setdefault("int4", method)
    return out


def detection_calls(cls_node: ast.ClassDef) -> list[str]:
    """The format-detection methods the fork's ``_build_layers`` calls on self; conform's
    replacement of ``_build_layers`` runs them the same way."""
    build = methods_of(cls_node).get("_build_layers")
    return [c for c in self_calls(build) if c.startswith("_detect_quant")] if build is not None else []


def derive(cls_node: ast.ClassDef) -> Requirements:
    methods = methods_of(cls_node)
    lacking = [m for m in ENTRIES if m not in methods]
    if lacking:
        raise ForkError(f"{CLASS_NAME} has no method {', '.join(lacking)} (conform runs its own __init__ and load)")
    if not detection_calls(cls_node):
        raise ForkError(f"{CLASS_NAME}._build_layers calls no _detect_quant_* method: conform, which replaces "
                        f"_build_layers, cannot tell how this release detects the format")
    data = _assigned_attrs(cls_node)
    seen, missing = [], []
    todo = [(m, None) for m in ENTRIES] + [(m, "_build_layers") for m in detection_calls(cls_node)]
    while todo:
        name, caller = todo.pop(0)
        if name in seen or name in PROVIDED:
            continue
        if name not in methods:
            if name not in data:
                missing.append((caller, name))
            continue
        seen.append(name)
        todo.extend((c, name) for c in self_calls(methods[name]))
    return Requirements(tuple(seen), dispatch(methods["load"]), tuple(missing))


def check(cls_node: ast.ClassDef, fmt: str, who: str) -> Requirements:
    """Refuse (ForkError, by name) a class conform cannot drive for `fmt`; `who` names
    the release in the message ("sglang-kt 0.6.4")."""
    req = derive(cls_node)
    if req.missing:
        caller, name = req.missing[0]
        raise ForkError(f"{who}: {CLASS_NAME}.{caller} calls self.{name}(), which the class does not define")
    method = req.dispatch.get(fmt)
    if method is None:
        raise NoPath(f"{who}: {CLASS_NAME}.load has no {fmt} path (it dispatches "
                        f"{', '.join(f'{f} -> {m}' for f, m in req.dispatch.items()) or 'nothing'})")
    if method not in req.methods:
        raise ForkError(f"{who}: {CLASS_NAME}.load dispatches {fmt} to {method}, which the class does not define")
    return req
