"""torchvision beside a CPU torch (tests only; README.md here): define the operator schemas its
fake-kernel registrations expect, just before its first import, without importing torch in
processes that never import torchvision."""

import importlib.abc
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


sys.meta_path.insert(0, _BeforeTorchvision())
