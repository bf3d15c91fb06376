"""Import-time fixes for the real SGLang server on CPU (tests only; README.md here).

- torchvision beside a CPU torch: define the operator schemas its fake-kernel registrations
  expect, just before its first import, without importing torch in processes that never
  import torchvision.
- Two CPU paths SGLang 0.5.23 takes only where AMX is present (the gated RMSNorm of the
  DeltaNet layers, the shared-expert gate); without AMX it runs Triton GPU code there. Each
  of those modules runs as it is, then one name in it is set (cpu_fixes.py says which, why).
"""

import importlib.abc
import importlib.util
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        try:
            torch.ops.torchvision.nms
        except (AttributeError, RuntimeError):
            global _LIB
            _LIB = torch.library.Library("torchvision", "FRAGMENT")  # kept alive: the schemas live with it
            for schema in _SCHEMAS:
                _LIB.define(schema)
        return None  # the normal finders import torchvision itself


# SGLang module -> the name in cpu_fixes applied once it has run
_AFTER_IMPORT = {"sglang.kernels.ops.attention.fla.layernorm_gated": "gated_norm_on_cpu",
                 "sglang.srt.models.qwen2_moe": "shared_gate_on_cpu"}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each module of _AFTER_IMPORT as it is, then applies its fix."""

    def find_spec(self, name, path=None, target=None):
        fix = _AFTER_IMPORT.pop(name, None)
        if fix is None:
            return None
        if not _AFTER_IMPORT:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            import cpu_fixes

            run(module)
            getattr(cpu_fixes, fix)(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _BeforeTorchvision())
sys.meta_path.insert(0, _AfterImport())
