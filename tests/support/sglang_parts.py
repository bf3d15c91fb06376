"""Slot-map pieces of the installed SGLang (0.5.23) and KT fork (sglang-kt 0.7.2), run as
they are (tests only): EPLB's expert-location metadata, FusedMoE's slot placement and
the fork's dynamic expert update.

Compiled from the installed files by support.sglang_source (the one helper that loads
SGLang's files; roots are the folders holding ``sglang/``: ``installed_root("sglang")``,
``fork_root()``) into private modules that the test fills with what they reference.
Nothing of SGLang is copied into moetrace.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

import torch
import torch.nn.functional as F

from support.sglang_source import source_at

EXPERT_LOCATION = "sglang/srt/eplb/expert_location.py"
FUSED_MOE_LAYER = "sglang/srt/layers/moe/fused_moe_triton/layer.py"
KT_WRAPPER = "sglang/srt/layers/moe/kt_ep_wrapper.py"


def compile_parts(root: Path, rel: str, names, provided: dict, module_name: str,
                  methods_of: str | None = None) -> types.ModuleType:
    """A private module (registered as `module_name`) holding `provided` plus the named
    top-level definitions of `rel`, or the named methods of its class `methods_of` (as
    plain functions). Calling again with the same name adds to that module."""
    src = source_at(str(root))
    mod = sys.modules.get(module_name)
    if mod is None:
        mod = sys.modules[module_name] = types.ModuleType(module_name)
        mod.__file__ = str(Path(root) / rel)
    mod.__dict__.update(provided)
    if methods_of is None:
        src.run(rel, [src.top(rel, n) for n in names], mod.__dict__)
        return mod
    cls = src.run(rel, [src.members(rel, methods_of, names, bases=["object"])], mod.__dict__)[methods_of]
    for n in names:
        setattr(mod, n, cls.__dict__[n])
    return mod


def expert_location(root: Path, module_name: str = "sglang.srt.eplb.expert_location"):
    """0.5.23's eplb/expert_location.py: ExpertLocationMetadata and the getter the loader
    and moetrace's hooks call. Registered under SGLang's own module name, so moetrace
    finds it exactly as inside a server; `resources.expert_location_metadata` is what
    get_global_expert_location_metadata() returns."""
    resources = types.SimpleNamespace(expert_location_metadata=None)
    exec_ = types.SimpleNamespace(moe=types.SimpleNamespace(ep_dispatch_algorithm=None, moe_a2a_backend="none"))
    mod = compile_parts(root, EXPERT_LOCATION,
                        ["ExpertLocationMetadata", "_compute_logical_to_all_physical_map", "_pad_nested_array",
                         "get_global_expert_location_metadata"],
                        dict(torch=torch, F=F, dataclass=dataclasses.dataclass, Optional=typing.Optional,
                             List=typing.List, get_exec=lambda: exec_, get_resources=lambda: resources), module_name)
    mod.resources = resources
    return mod


def metadata_for(el, physical_to_logical: torch.Tensor, num_logical: int, ep_size: int):
    """An ExpertLocationMetadata built by SGLang's own code from a physical -> logical map."""
    l2a = el._compute_logical_to_all_physical_map(physical_to_logical, num_logical, ep_size, None)
    return el.ExpertLocationMetadata._init_raw(ep_size=ep_size, physical_to_logical_map=physical_to_logical,
                                               logical_to_all_physical_map=l2a)


def fused_moe_loader(root: Path, get_metadata) -> types.ModuleType:
    """0.5.23 FusedMoE.weight_loader / _weight_loader_physical /
    _map_global_expert_id_to_local_expert_id: which slot(s) receive a logical expert
    (EPLB copies, fused shared experts, EP blocks). Bind them to a FusedMoE-shaped class."""
    return compile_parts(root, FUSED_MOE_LAYER,
                         ["weight_loader", "_weight_loader_physical", "_map_global_expert_id_to_local_expert_id"],
                         dict(torch=torch, Optional=typing.Optional, get_global_expert_location_metadata=get_metadata,
                              KTEPWrapperMethod=type("KTEPWrapperMethod", (), {}),
                              uses_per_rank_fused_shared_slots=lambda: False),
                         "moetrace_tests_fused_moe_loader", methods_of="FusedMoE")


def kt_dynamic_update(root: Path, tp_group) -> types.ModuleType:
    """The fork's dynamic expert update: KTEPWrapperMethod._update_gpu_experts_from_batch
    and what it calls (select_top_experts_from_batch, copy_experts_weights_*,
    update_gpu_expert_mappings); its broadcast runs on torch.distributed."""
    import logging

    import torch.distributed as dist

    # the helpers first, into the module the method below is compiled into
    compile_parts(root, KT_WRAPPER,
                  ["select_top_experts_from_batch", "copy_experts_weights_fp8", "copy_experts_weights_fp8_channel",
                   "copy_experts_weights_bf16", "copy_experts_weights_int4", "update_gpu_expert_mappings"],
                  dict(torch=torch, dist=dist, get_tp_group=lambda: tp_group,
                       update_kt_wrapper_masks=lambda wrapper, mask: None,
                       logger=logging.getLogger("kt-under-test")),
                  "moetrace_tests_kt_ep_wrapper")
    return compile_parts(root, KT_WRAPPER, ["_update_gpu_experts_from_batch"], {}, "moetrace_tests_kt_ep_wrapper",
                         methods_of="KTEPWrapperMethod")
