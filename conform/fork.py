"""Find the installed sglang-kt and compile its ``SharedFullContext`` from the file.

The class and the module-level definitions it names are taken from the fork's
``kt_ep_wrapper.py`` with ``ast`` (symtable says which names they read) and
executed in a fresh module whose imports resolve to what the caller provides
(the simulated CUDA runtime, gloo TP groups). Any other sglang name becomes a
placeholder that raises ForkError, by name, when the code that runs touches
it. Code objects keep the installed file name and line numbers, so a
traceback points into the fork. Nothing of the fork is copied anywhere.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import hashlib
import importlib
import importlib.util
import os
import symtable
import sys
import types
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from moetrace.errors import MoetraceError

WRAPPER_REL = Path("sglang/srt/layers/moe/kt_ep_wrapper.py")
MARLIN_UTILS_REL = Path("sglang/srt/layers/quantization/marlin_utils.py")  # its INT4 scale permute (conform.marlin)
JIT_INIT_REL = Path("sglang/jit_kernel/__init__.py")  # what `from sglang.jit_kernel import X` binds (conform.marlin)
MODULE_NAME = "sglang.srt.layers.moe.kt_ep_wrapper"
CLASS_NAME = "SharedFullContext"
SIDE_DIR_NAME = "kt-side"


class ForkError(MoetraceError):
    """No fork, or a fork whose file lacks what conform drives (says what is missing). Exit 2."""


@dataclass(frozen=True)
class InstalledFork:
    path: Path  # kt_ep_wrapper.py
    version: str
    origin: str  # how it was found


def _version_near(root: Path) -> str:
    for info in sorted(root.glob("sglang_kt-*.dist-info")):
        try:
            return metadata.Distribution.at(info).version
        except Exception:
            pass
    return "unknown"


def side_dirs() -> list[str]:
    """Where the Makefile (and a user) put the fork and kt-kernel: $MOETRACE_KT_SIDE,
    then the venv's kt-side folder. They are never on sys.path of the CLI itself:
    the fork installs a package named ``sglang``."""
    dirs = [os.environ.get("MOETRACE_KT_SIDE", ""), str(Path(sys.prefix) / SIDE_DIR_NAME)]
    return [d for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def find_fork(fork_path: str | None = None, search: list[str] | None = None) -> InstalledFork:
    """--fork-path DIR (an install target, a site-packages, or a source checkout
    with python/sglang), else the sglang-kt distribution on `search` (default:
    sys.path and side_dirs())."""
    if fork_path:
        root = Path(fork_path)
        if root.is_file() and root.name == WRAPPER_REL.name:
            return InstalledFork(root, "unknown", f"--fork-path {root}")
        for base in (root, root / "python"):
            if (base / WRAPPER_REL).is_file():
                return InstalledFork(base / WRAPPER_REL, _version_near(base), f"--fork-path {root}")
        raise ForkError(f"--fork-path {root}: no {WRAPPER_REL} under it (nor under {root / 'python'})")
    search = list(search) if search is not None else [*sys.path, *side_dirs()]
    for dist in metadata.distributions(path=search):
        if (dist.metadata.get("Name") or "").lower().replace("_", "-") != "sglang-kt":
            continue
        f = Path(dist.locate_file(WRAPPER_REL))
        if f.is_file():
            return InstalledFork(f, dist.version, f"sglang-kt {dist.version} in {Path(dist.locate_file('')).resolve()}")
        raise ForkError(f"sglang-kt {dist.version} is installed but has no {WRAPPER_REL}")
    raise ForkError(f"no sglang-kt found (searched sys.path and {', '.join(side_dirs()) or 'no side folder'}): "
                    f"run `make venv`, or pip install --no-deps --target DIR sglang-kt and pass --fork-path DIR")


def find_kt_kernel(extra: list[str] = ()) -> tuple[str | None, str | None]:
    """(folder to append to sys.path or None when importable already, version or None when absent)."""
    if importlib.util.find_spec("kt_kernel") is not None:
        try:
            return None, metadata.version("kt-kernel")
        except metadata.PackageNotFoundError:
            return None, "unknown"
    for d in [*extra, *side_dirs()]:
        if d and (Path(d) / "kt_kernel" / "__init__.py").is_file():
            version = next((x.version for x in metadata.distributions(path=[d])
                            if (x.metadata.get("Name") or "").lower() == "kt-kernel"), "unknown")
            return d, version
    return None, None


def _missing(name: str, origin: str) -> type:
    """A placeholder class: isinstance() against it is False, anything else raises."""
    msg = f"unsupported fork layout: its code needs {name!r} ({origin}), which conform does not provide"

    class Meta(type):
        def __getattr__(cls, attr):
            raise ForkError(f"{msg} (attribute {attr!r})")

        def __call__(cls, *a, **k):
            raise ForkError(msg)

    return Meta(name, (), {"__module__": "moetrace.conform.fork.missing"})


def _top_imports(tree: ast.Module) -> list[tuple[str, str, str | None]]:
    """(bound name, module, attr or None) of the imports that run at module level
    (inside if/try too: conditional imports of the same names), not in defs."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.asname, a.name, None) if a.asname else (a.name.split(".")[0], a.name.split(".")[0], None))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.extend((a.asname or a.name, node.module, a.name) for a in node.names)
        else:
            todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))
    return out


def _top_defs(tree: ast.Module) -> dict[str, ast.stmt]:
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    return defs


def _globals_used(table: symtable.SymbolTable) -> set[str]:
    """Module-level names a def (and everything nested in it) reads."""
    names = set()
    for t in [table, *_descendants(table)]:
        for s in t.get_symbols():
            if t.get_type() == "class" and not s.is_global():
                continue  # class-body locals are class attributes
            if s.is_global() or (t.get_type() == "module" and s.is_referenced()):
                names.add(s.get_name())
    return names


def _descendants(table: symtable.SymbolTable):
    for c in table.get_children():
        yield c
        yield from _descendants(c)


@dataclass
class CompiledFork:
    module: types.ModuleType
    cls: type
    source: InstalledFork
    statements: int  # top-level statements compiled from the file
    placeholders: list[str]  # names bound to placeholders
    patched: list[str]  # methods rewritten by `patch`
    cls_node: ast.ClassDef  # the class as compiled (patched or the file's)


@dataclass(frozen=True)
class ParsedFork:
    """What one fork file needs, parsed once per process: the statements to run
    (compiled, except the class, which a patch rewrites on a copy), the names they read."""

    body: tuple  # (node, code object or None for the class)
    cls_node: ast.ClassDef
    free: frozenset
    imports: tuple
    file_sha256: str  # of the file as read
    class_sha256: str  # of the class's source text (its lines in the file)


@functools.lru_cache(maxsize=4)
def _parse(path: str, stamp: int) -> ParsedFork:
    raw = Path(path).read_bytes()
    text = raw.decode()
    tree = ast.parse(text, filename=path)
    defs = _top_defs(tree)
    cls_node = defs.get(CLASS_NAME)
    if not isinstance(cls_node, ast.ClassDef):
        raise ForkError(f"{path}: no top-level class {CLASS_NAME}")
    tables = {t.get_name(): t for t in symtable.symtable(text, path, "exec").get_children()}
    uses = {}
    for name, node in defs.items():
        if name in tables and isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            uses[name] = _globals_used(tables[name])
        else:  # an assignment: the names its value reads
            uses[name] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    wanted, todo = set(), [CLASS_NAME]
    while todo:
        name = todo.pop()
        if name not in wanted and name in defs:
            wanted.add(name)
            todo.extend(uses[name] - wanted)
    free = set().union(*(uses[n] for n in wanted)) - wanted - set(dir(builtins))
    body = tuple((n, None if n is cls_node else _code(n, path)) for n in tree.body
                 if any(defs.get(k) is n for k in wanted))
    segment = "".join(text.splitlines(keepends=True)[cls_node.lineno - 1:cls_node.end_lineno])
    return ParsedFork(body, cls_node, frozenset(free), tuple(_top_imports(tree)), _sha256(raw),
                      _sha256(segment.encode()))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_fork(src: InstalledFork) -> ParsedFork:
    """The fork's file parsed (ForkError without the class); cached per process and
    file version. What the class must have is conform.requirements' to say."""
    return _parse(str(src.path), src.path.stat().st_mtime_ns)


def _code(node: ast.stmt, path: str):
    return compile(ast.Module(body=[node], type_ignores=[]), path, "exec")


def _resolve(name: str, mod_name: str, attr: str | None, provided: dict, modules: dict):
    key = f"{mod_name}.{attr}" if attr else mod_name
    if key in provided:
        return provided[key]
    if mod_name in modules:
        return getattr(modules[mod_name], attr) if attr else modules[mod_name]
    if mod_name.split(".")[0] == "sglang":
        raise ImportError(key)
    mod = importlib.import_module(mod_name)
    if attr and not hasattr(mod, attr):  # a submodule: from multiprocessing import shared_memory
        importlib.import_module(f"{mod_name}.{attr}")
    return getattr(mod, attr) if attr else mod


def compile_fork(src: InstalledFork, provided: dict[str, object], modules: dict[str, object],
                 register: bool = True, patch=None) -> CompiledFork:
    """Compile SharedFullContext and what it names into a fresh module.
    `provided`: objects by qualified import ("sglang.srt.distributed.get_tp_group");
    `modules`: replacement modules by import name ("torch", "torch.distributed", "os");
    `patch(class_node, namespace) -> [method names]` rewrites a copy of the class."""
    parsed = parse_fork(src)
    module = types.ModuleType(MODULE_NAME)
    module.__file__ = str(src.path)
    ns = module.__dict__
    placeholders = []
    for bound, mod_name, attr in parsed.imports:
        if bound in parsed.free and bound not in ns:
            try:
                ns[bound] = _resolve(bound, mod_name, attr, provided, modules)
            except Exception:
                key = f"{mod_name}.{attr}" if attr else mod_name
                ns[bound] = _missing(bound, f"import {key}")
                placeholders.append(key)
    patched, cls_node = [], parsed.cls_node
    for node, code in parsed.body:
        if code is None:  # the class: patched on a copy, so the cached tree stays the file's
            cls_node = copy.deepcopy(node) if patch is not None else node
            patched = patch(cls_node, ns) if patch is not None else []
            code = _code(cls_node, str(src.path))
        try:
            exec(code, ns)
        except Exception as err:  # a module-level assignment needing what is not provided
            for t in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(t, ast.Name):
                    ns[t.id] = _missing(t.id, f"line {node.lineno}: {type(err).__name__}: {err}")
                    placeholders.append(f"{t.id} (line {node.lineno})")
    for name in sorted(parsed.free - set(ns)):
        ns[name] = _missing(name, "not defined at module level")
        placeholders.append(name)
    if register:
        sys.modules[MODULE_NAME] = module
    return CompiledFork(module, ns[CLASS_NAME], src, len(parsed.body), sorted(placeholders), patched, cls_node)


def released_sha256(wrapper: Path) -> str | None:
    """The sha256 (hex) the release's RECORD gives for this wrapper file (None: no RECORD
    beside it, e.g. a source checkout or a loose file)."""
    import base64
    import csv

    root = fork_root(wrapper)
    for record in sorted(root.glob("sglang_kt-*.dist-info/RECORD")):
        with open(record, newline="") as fh:
            for row in csv.reader(fh):
                if row and row[0] == WRAPPER_REL.as_posix() and len(row) > 1 and row[1].startswith("sha256="):
                    b64 = row[1][len("sha256="):]
                    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def fork_root(wrapper: Path) -> Path:
    """The folder holding ``sglang/`` (and the dist-info) for an installed wrapper file."""
    parents = wrapper.parents
    return parents[len(WRAPPER_REL.parts) - 1] if len(parents) >= len(WRAPPER_REL.parts) else wrapper.parent
