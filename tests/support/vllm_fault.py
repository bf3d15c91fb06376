"""A fault for the real vLLM server (tests only): a second ``vllm.general_plugins`` entry
point that corrupts one rank's expert weights right after vLLM loads them, before
moetrace captures anything, so both capture points hold the fault.

``install_dist(folder)`` writes a distribution (``moetrace_test_fault-0.dist-info``) whose
entry point is ``support.vllm_fault:register``; a server started with ``folder`` on its
PYTHONPATH (tests/ is there already, tests/conftest.py) loads it in every process.
``register`` does nothing unless ``MOETRACE_TEST_VLLM_FAULT`` holds the fault, e.g.
``{"rank": 1, "layer": 0, "tensor": "w2_weight", "swap": [0, 1]}``: swap two slots of
one tensor of one layer on one TP rank. It wraps ``DefaultModelLoader.load_weights``
itself, which moetrace's loader calls (super()), so whichever plugin loads first, the
fault lands between vLLM's loading and moetrace's load-boundary capture.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FAULT_ENV = "MOETRACE_TEST_VLLM_FAULT"
DIST = "moetrace_test_fault-0.dist-info"


def install_dist(folder: Path) -> Path:
    """The fault plugin's distribution in `folder` (put `folder` on the server's PYTHONPATH)."""
    info = Path(folder) / DIST
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moetrace-test-fault\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nmoetrace_test_fault = support.vllm_fault:register\n")
    return Path(folder)


def _swap(model, fault: dict) -> None:
    from vllm.distributed.parallel_state import get_tp_group

    if get_tp_group().rank_in_group != int(fault["rank"]):
        return
    experts = model.get_submodule(f"model.layers.{int(fault['layer'])}.mlp.experts.routed_experts")
    param = getattr(experts, fault["tensor"])
    a, b = (int(x) for x in fault["swap"])
    data = param.data  # as vLLM's own loaders write
    held = data[a].clone()
    data[a].copy_(data[b])
    data[b].copy_(held)


def register() -> None:
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return
    fault = json.loads(raw)
    from vllm.model_executor.model_loader import DefaultModelLoader

    if getattr(DefaultModelLoader.load_weights, "moetrace_test_fault", False):
        return
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        original(self, model, model_config)
        _swap(model, fault)

    load_weights.moetrace_test_fault = True
    DefaultModelLoader.load_weights = load_weights
