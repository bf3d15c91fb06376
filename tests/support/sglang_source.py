"""Compile chosen definitions of an installed SGLang file with ``ast`` (tests only).

Importing ``sglang`` needs its GPU dependencies, so tests compile just the functions
and class members they run, straight from the installed file, into a namespace of
stand-ins they provide. Code objects keep the installed file's name, so a traceback
points at SGLang's own file:line. Nothing of SGLang is copied into this repository.

    src = Source(installed_root("sglang"))
    src.run(rel, [src.top(rel, "fn"), src.members(rel, "Cls", ["m"], bases=["object"])], ns)
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import types
from importlib import metadata
from pathlib import Path


def installed_root(dist: str, side_dir: str | Path | None = None) -> Path | None:
    """The folder holding the ``sglang/`` files of distribution `dist` ("sglang" or
    "sglang-kt"), from its dist-info; side_dir: a ``pip --target`` folder to search."""
    try:
        found = metadata.distribution(dist) if side_dir is None else next(
            (d for d in metadata.distributions(path=[str(side_dir)]) if d.metadata["Name"] == dist), None)
    except metadata.PackageNotFoundError:
        return None
    if found is None:
        return None
    root = Path(found.locate_file(""))
    return root if (root / "sglang").is_dir() else None


def fork_root() -> Path | None:
    """The folder holding the KT fork's ``sglang/`` files: $MOETRACE_FORK_PATH (a
    ``pip --target`` folder), else the side folders conform uses (conform.fork:
    $MOETRACE_KT_SIDE, the venv's kt-side, where the Makefile installs sglang-kt)."""
    from moetrace.conform.fork import side_dirs

    env = os.environ.get("MOETRACE_FORK_PATH")
    for d in [env] if env else side_dirs():
        root = installed_root("sglang-kt", d)
        if root is not None:
            return root
    return None


@functools.lru_cache(maxsize=None)
def source_at(root: str | Path) -> "Source":
    """One Source per installed tree, so a file is parsed once per process."""
    return Source(root)


def load_hook_manager():
    """SGLang's own srt/model_executor/hook_manager.py from the installed wheel (it
    imports only the standard library and torch.nn, so the file runs as it is)."""
    import importlib.util

    root = installed_root("sglang")
    if root is None:
        import pytest

        pytest.skip("sglang wheel not installed (make venv installs it with --no-deps)")
    path = root / "sglang" / "srt" / "model_executor" / "hook_manager.py"
    spec = importlib.util.spec_from_file_location("sglang_hook_manager_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def version_of(root: Path) -> str | None:
    for d in metadata.distributions(path=[str(root)]):
        if d.metadata["Name"] in ("sglang", "sglang-kt"):
            return f"{d.metadata['Name']} {d.version}"
    return None


class Source:
    """The parsed files under `root` (the folder holding ``sglang/``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @functools.lru_cache(maxsize=None)
    def tree(self, rel: str) -> ast.Module:
        path = self.root / rel
        return ast.parse(path.read_text(), filename=str(path))

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def top(self, rel: str, name: str) -> ast.stmt:
        """The top-level def, class or assignment that binds `name`."""
        for node in self.tree(rel).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return node
        raise LookupError(f"{self.root / rel}: no top-level {name}")

    def has(self, rel: str, name: str) -> bool:
        try:
            self.top(rel, name)
            return True
        except LookupError:
            return False

    def members(self, rel: str, cls: str, required, optional=(), bases: list[str] | None = None) -> ast.ClassDef:
        """Class `cls` with only the named methods / class attributes (decorators kept)
        and the given bases (source expressions evaluated in the run namespace)."""
        node = self.top(rel, cls)
        want, found, body = set(required) | set(optional), set(), []
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name in want:
                body.append(item)
                found.add(item.name)
            elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)} & want
                if names:
                    body.append(item)
                    found |= names
        missing = set(required) - found
        if missing:
            raise LookupError(f"{self.root / rel}: class {cls} lacks {', '.join(sorted(missing))}")
        new = ast.ClassDef(name=cls, bases=[ast.parse(b, mode="eval").body for b in (bases or [])], keywords=[],
                           body=body, decorator_list=[], type_params=[])
        return ast.copy_location(new, node)

    def run(self, rel: str, nodes: list[ast.stmt], namespace: dict) -> dict:
        mod = ast.fix_missing_locations(ast.Module(body=nodes, type_ignores=[]))
        exec(compile(mod, str(self.root / rel), "exec"), namespace)
        return namespace


def guarded_builtins(modules: dict[str, object]) -> dict:
    """builtins whose ``__import__`` answers function-local imports of `modules` and
    refuses any other sglang/flashinfer import by name (a stand-in is missing)."""
    real = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name in modules:
            return modules[name]
        if name.split(".")[0] in ("sglang", "flashinfer", "sgl_kernel"):
            raise ImportError(f"test stand-in: the compiled SGLang code imports {name}, which the test does not provide")
        return real(name, globals, locals, fromlist, level)

    return {**vars(builtins), "__import__": _import}


def module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod
