"""Every Triton kernel of moetrace compiled for the GPUs users have (Hopper sm_90,
Blackwell sm_100, and sm_120), here, without a GPU: `triton.compile` with a
`GPUTarget("cuda", cc, 32)` runs the whole pipeline down to a cubin with the ptxas that
ships in the triton wheel, and the wheel's cuobjdump reads the cubin's resource usage.
A kernel that spills registers to local memory (a stack frame or local bytes) fails.

test_fingerprint_triton.py checks the kernel's bits under the interpreter; this checks
that it compiles and fits in registers on each target. The compiles run in one fresh
process: the interpreter (TRITON_INTERPRET, set by conftest on machines without a GPU)
replaces the kernels when their module is first imported."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (90, 100, 120)

# kernel ("module:function") -> its launch variants: (name, argument types, constexprs),
# as the launcher calls it (fingerprint/triton_path.py row_chunk_digests).
_XXH3_ARGS = {"src": "*i64", "out": "*u8", "consts": "*i64", "n_chunks": "i32", "out_chunks": "i32",
              "row_bytes": "i32", "row_stride": "i32"}
KERNELS = {
    "moetrace.fingerprint.triton_path:_xxh3_128_chunks": [
        ("words", _XXH3_ARGS, {"CHUNK": 65536, "WORDS": True}),
        ("bytes", {**_XXH3_ARGS, "src": "*u8"}, {"CHUNK": 65536, "WORDS": False}),
    ],
}
# a register cap that makes the words variant spill on sm_90 (it needs ~54): the negative control
SPILLING = ("moetrace.fingerprint.triton_path:_xxh3_128_chunks", "words", 90, {"maxnreg": 32})

_COMPILE = r"""
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

jobs = json.loads(sys.argv[1])
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = []
for kernel, variant, cc, sig, constexprs, options in jobs:
    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 1, **options})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    found = dict((k, int(v)) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    out.append({"kernel": kernel, "variant": variant, "cc": cc, "options": options, **found})
print(json.dumps(out))
"""


def _jit_functions(path: Path) -> list[tuple[str, bool]]:
    """(name, launched) of every @triton.jit function in a file; launched: it returns
    nothing (a kernel; helpers return values)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", "") == "triton":
                returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))
                found.append((node.name, not returns))
    return found


def test_every_kernel_is_compiled_here():
    """A new @triton.jit kernel anywhere in moetrace must be listed above (and so compiled)."""
    kernels = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "tests") or "triton.jit" not in path.read_text():
            continue
        module = "moetrace." + ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        kernels |= {f"{module}:{name}" for name, launched in _jit_functions(path) if launched}
    assert kernels == set(KERNELS)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """(kernel, variant, cc, options as JSON) -> resource usage: every variant of every
    kernel for every target, and the negative control, compiled in one fresh process (one
    torch and Triton import; no interpreter) with a Triton cache of its own: nothing reused."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip(f"this triton wheel ships no ptxas/cuobjdump in {tools}")
    jobs = [[k, v, cc, sig, cx, {}] for k, variants in KERNELS.items() for v, sig, cx in variants for cc in TARGETS]
    kernel, variant, cc, options = SPILLING
    sig, cx = next((s, c) for v, s, c in KERNELS[kernel] if v == variant)
    jobs.append([kernel, variant, cc, sig, cx, options])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(r["kernel"], r["variant"], r["cc"], json.dumps(r["options"])): r
            for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("cc", TARGETS)
@pytest.mark.parametrize("kernel,variant", [(k, v) for k, variants in KERNELS.items() for v, _, _ in variants])
def test_kernel_compiles_without_spills(compiled, kernel, variant, cc):
    usage = compiled[(kernel, variant, cc, "{}")]
    assert usage["REG"] > 0, usage
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"{kernel} ({variant}) spills on sm_{cc}: {usage}"


def test_a_spilling_kernel_is_seen(compiled):
    """Negative control: the same kernel capped at 32 registers spills (a stack frame), and it shows."""
    kernel, variant, cc, options = SPILLING
    usage = compiled[(kernel, variant, cc, json.dumps(options))]
    assert usage["REG"] <= 32 and usage["STACK"] + usage["LOCAL"] > 0, usage
