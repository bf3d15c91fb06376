"""What the fork's ``_prepare_weight_int4`` calls after staging, inside a conform rank.

Per expert it transposes each staged tensor (plain torch: runs as it is), repacks the
words for the Marlin kernel with ``gptq_marlin_repack`` (a CUDA kernel) and permutes
the scales with ``marlin_permute_scales`` (plain torch). Here:

- ``marlin_permute_scales`` is SGLang's own, compiled from the installed
  ``marlin_utils.py`` with ``ast`` (the function and the module-level definitions it
  names): the fork's own file beside its ``kt_ep_wrapper.py`` when the release ships
  it there, else the upstream ``sglang`` distribution's; nothing of it is copied;
- ``gptq_marlin_repack`` is ``RepackIdentity``: it returns its input unchanged and
  records every call, so the words a rank holds after ``load`` are the words the repack
  was given: conform judges the weights before the Marlin repack, the scales after
  SGLang's permute.

Both run stream-ordered (``SimRuntime.stream_ordered``): issued on a stream, they run
once the stream has run what was queued before them, as a kernel does on a GPU.
"""

from __future__ import annotations

import ast
import builtins
import threading
import types
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from moetrace.conform.fork import JIT_INIT_REL, MARLIN_UTILS_REL, ForkError, fork_root

PERMUTE = "marlin_permute_scales"
# Where the fork's releases import them from: the function from sgl_kernel (0.5.2-0.6.2) or
# from its module (0.6.3.post1 on); 0.6.3 imports the name from the package (JIT_PACKAGE_IMPORT)
PERMUTE_IMPORTS = ("sglang.srt.layers.quantization.marlin_utils.marlin_permute_scales",)
REPACK_IMPORTS = ("sglang.jit_kernel.gptq_marlin_repack.gptq_marlin_repack", "sgl_kernel.gptq_marlin_repack")
JIT_PACKAGE_IMPORT = "sglang.jit_kernel.gptq_marlin_repack"
JUDGED = "weights judged before the Marlin repack, scales after SGLang's permute"


@dataclass(frozen=True)
class PermuteSource:
    path: Path
    origin: str  # "sglang-kt 0.7.2's own" | "sglang 0.5.23's (the release does not ship marlin_utils.py)"


def permute_source(wrapper: Path, fork_version: str) -> PermuteSource:
    """The marlin_utils.py the fork's import resolves to: its own beside the wrapper, else
    the installed upstream sglang's; ForkError naming both places when neither is there."""
    own = fork_root(wrapper) / MARLIN_UTILS_REL
    if own.is_file():
        return PermuteSource(own, f"sglang-kt {fork_version}'s own")
    try:
        up = metadata.distribution("sglang")
        path = Path(up.locate_file(MARLIN_UTILS_REL))
        if path.is_file():
            return PermuteSource(path, f"sglang {up.version}'s (sglang-kt {fork_version} ships no {MARLIN_UTILS_REL} "
                                       f"beside its wrapper)")
    except metadata.PackageNotFoundError:
        pass
    raise ForkError(f"--format int4: no {MARLIN_UTILS_REL} beside {wrapper} nor an installed sglang: conform runs "
                    f"SGLang's own {PERMUTE} and has none to run")


def compile_permute(src: PermuteSource):
    """SGLang's marlin_permute_scales from the file, with the module-level functions it
    calls (get_scale_perms); ForkError when it reads a name that is not torch or a builtin."""
    tree = ast.parse(src.path.read_text(), filename=str(src.path))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if PERMUTE not in defs:
        raise ForkError(f"{src.path}: no function {PERMUTE}")
    wanted, todo = [], [PERMUTE]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.append(name)
        reads = {n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        todo += [r for r in reads if r in defs]
        args = {a.arg for a in ast.walk(defs[name]) if isinstance(a, ast.arg)}
        stores = {n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        unknown = reads - set(defs) - args - stores - set(dir(builtins)) - {"torch"}
        if unknown:
            raise ForkError(f"{src.path}: {name} reads {', '.join(sorted(unknown))}, which conform does not provide")
    ns: dict = {"torch": torch, "__name__": "sglang.srt.layers.quantization.marlin_utils"}
    module = ast.Module(body=[defs[n] for n in reversed(wanted)], type_ignores=[])
    exec(compile(module, str(src.path), "exec"), ns)
    return ns[PERMUTE]


@dataclass
class RepackIdentity:
    """gptq_marlin_repack's stand-in: the words it is given, unchanged (a copy, as the
    kernel returns a new tensor), each call recorded. A call whose arguments disagree
    with its input (size_k, size_n, num_bits against the words' shape, a non-empty
    perm) is refused: the identity would not then stand for it."""

    calls: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, b_q_weight: torch.Tensor, perm: torch.Tensor, size_k: int, size_n: int, num_bits: int):
        rows = size_k * num_bits // 32
        if (b_q_weight.dtype != torch.int32 or tuple(b_q_weight.shape) != (rows, size_n) or perm.numel()
                or num_bits != 4):
            raise ForkError(f"gptq_marlin_repack called with words {b_q_weight.dtype}{list(b_q_weight.shape)}, "
                            f"size_k {size_k}, size_n {size_n}, num_bits {num_bits}, perm of {perm.numel()}: not "
                            f"the [size_k * num_bits / 32, size_n] int32 words of a 4-bit repack without act order")
        with self._lock:
            self.calls.append((size_k, size_n, num_bits))
        return b_q_weight.clone()

    def summary(self) -> dict:
        """{"calls": n, "shapes": distinct [size_k, size_n, num_bits]}, what the result reports."""
        return {"calls": len(self.calls), "shapes": [list(c) for c in sorted(set(self.calls))]}


def jit_package_binding(wrapper: Path, repack):
    """What ``from sglang.jit_kernel import gptq_marlin_repack`` binds, as Python decides it:
    the name the fork's own ``sglang/jit_kernel/__init__.py`` defines or imports, else the
    submodule (sglang-kt 0.6.3's __init__.py is empty: its INT4 path then calls a module).
    Without that file beside the wrapper, a placeholder that refuses by name when used."""
    from moetrace.conform.fork import _missing

    init = fork_root(wrapper) / JIT_INIT_REL
    if not init.is_file():
        return _missing("gptq_marlin_repack", f"from sglang.jit_kernel import gptq_marlin_repack: no {JIT_INIT_REL} "
                                              f"beside the wrapper to tell a function from the submodule")
    tree = ast.parse(init.read_text(), filename=str(init))
    bound = {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    bound |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if "gptq_marlin_repack" in bound:
        return repack
    module = types.ModuleType(JIT_PACKAGE_IMPORT)
    module.gptq_marlin_repack = repack
    return module


def provided(runtime, repack: RepackIdentity, permute, wrapper: Path) -> dict:
    """The fork's imports of the two, stream-ordered on the simulated runtime."""
    out = {key: runtime.stream_ordered(permute) for key in PERMUTE_IMPORTS}
    kernel = runtime.stream_ordered(repack)
    out.update({key: kernel for key in REPACK_IMPORTS})
    out[JIT_PACKAGE_IMPORT] = jit_package_binding(wrapper, kernel)
    return out
