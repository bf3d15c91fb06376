"""Imports run one way: bottom <- checkpoints <- tracer <- hooks <- servers; analysis reads
through the bottom layer, the index reader and the trace's side files (their declaration, the
completeness rule, claims, sampling), never through hooks; jobs <- commands <- cli.
Every import of every module counts, at the top level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTTOM = {"errors", "schema", "declared", "fingerprint", "storage", "outputs", "__init__"}  # modules, and fingerprint/ as a whole
# layer -> the layers it may import (besides itself and the bottom)
ALLOWED = {
    "bottom": set(),
    "checkpoints": set(),
    "tracer": {"checkpoints"},
    "hooks": {"checkpoints", "tracer"},
    "servers": {"checkpoints", "tracer", "hooks"},
    # the trace's side files: their declaration, the completeness rule, claims, the sampling a config records
    "analysis": {"checkpoints", "tracer.manifest", "tracer.completeness", "tracer.claim", "tracer.sampling"},
    "conform": {"checkpoints", "tracer", "hooks"},
    "emulator": {"checkpoints", "tracer", "hooks", "conform"},
    "jobs": {"checkpoints", "tracer", "hooks", "servers", "analysis", "conform", "emulator"},
    "commands": {"checkpoints", "tracer", "hooks", "servers", "analysis", "conform", "emulator", "jobs"},
    "cli": {"checkpoints", "tracer", "hooks", "servers", "analysis", "conform", "emulator", "jobs", "commands"},
}
SCAFFOLDING = {"tests", "bench", "docs", "build", ".venv", ".git"}


def package_modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not (set(p.relative_to(ROOT).parts[:-1]) & SCAFFOLDING) and p.name != "setup.py"
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def layer_of(parts: list[str]) -> str:
    if not parts or parts[0] in BOTTOM:
        return "bottom"
    return parts[0]


def imported(path: Path) -> list[tuple[int, list[str]]]:
    """(line, moetrace module path parts) of every moetrace import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "moetrace":
                    out.append((node.lineno, a.name.split(".")[1:]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "moetrace":
                mod = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:  # `from moetrace import storage` imports the module storage
                out.append((node.lineno, mod + [a.name] if (ROOT / Path(*mod, a.name)).with_suffix(".py").exists()
                            or (ROOT / Path(*mod, a.name)).is_dir() else mod))
    return out


def allowed(src: list[str], dst: list[str]) -> bool:
    a, b = layer_of(src), layer_of(dst)
    if b == "bottom" or a == b:
        return True
    return any(b == rule or ".".join(dst).startswith(rule) for rule in ALLOWED.get(a, ()))


def test_every_import_runs_one_way():
    bad = []
    for path in package_modules():
        src = module_name(path)
        for line, dst in imported(path):
            if not allowed(src, dst):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {layer_of(src)} imports moetrace.{'.'.join(dst)}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_folder_has_a_place_in_the_table():
    """A new folder must be placed in the layer table before its imports can be judged."""
    unplaced = sorted({layer_of(module_name(p)) for p in package_modules()} - set(ALLOWED))
    assert not unplaced, f"folders without a layer: {unplaced}"


def test_the_checker_sees_what_it_must():
    """The rule itself: an upward edge or a relative import is caught, a downward one passes."""
    assert not allowed(["checkpoints", "index"], ["tracer", "fingerprint"])
    assert not allowed(["analysis", "report"], ["hooks", "kt"])
    assert not allowed(["schema"], ["checkpoints", "spec"])
    assert not allowed(["tracer", "capture"], ["hooks", "fused_moe"])
    assert allowed(["analysis", "report"], ["tracer", "manifest"]) and not allowed(["analysis", "x"], ["tracer", "sink"])
    assert allowed(["hooks", "kt"], ["tracer", "capture"]) and allowed(["cli"], ["jobs", "demo"])
    assert allowed(["emulator", "staging"], ["conform", "writer"]) and not allowed(["conform", "rank"], ["emulator", "x"])
    assert not allowed(["hooks", "kt"], ["servers", "launcher"]) and allowed(["jobs", "traffic"], ["servers", "launcher"])
    assert allowed(["cli"], ["commands", "index"]) and not allowed(["jobs", "audit"], ["commands", "options"])
    assert {layer_of(module_name(p)) for p in package_modules()} >= {"bottom", "checkpoints", "tracer", "hooks",
                                                                     "servers", "analysis", "conform", "emulator",
                                                                     "jobs", "commands", "cli"}
