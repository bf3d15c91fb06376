"""Pieces of the installed SGLang (0.5.23) and KT fork (sglang-kt 0.7.2), run as they are.

Importing those packages pulls GPU-only dependencies, so tests compile single
definitions (top-level functions and classes, or methods of a class) out of the
installed files with ``ast`` and execute them in a private module that the test
fills with what they reference. The text comes from the installed wheels at run
time; nothing is copied into moetrace. A missing wheel skips the test.
"""

from __future__ import annotations

import __future__
import ast
import dataclasses
import functools
import importlib.util
import os
import sys
import types
import typing
from pathlib import Path

import torch
import torch.nn.functional as F

FORK_ENV = "MOETRACE_SGLANG_KT"  # a --target folder holding sglang-kt's `sglang` package
FORK_DEFAULT = Path(sys.prefix) / "side" / "sglang-kt"  # where the Makefile puts it


def installed_root() -> Path | None:
    """The upstream `sglang` package folder (the Makefile installs 0.5.23 with --no-deps)."""
    spec = importlib.util.find_spec("sglang")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def fork_root() -> Path | None:
    """The KT fork's `sglang` folder ($MOETRACE_SGLANG_KT, else the Makefile's side folder)."""
    path = Path(os.environ.get(FORK_ENV) or FORK_DEFAULT) / "sglang"
    return path if (path / "srt" / "layers" / "moe" / "kt_ep_wrapper.py").is_file() else None


def hook_manager():
    """SGLang's own hook_manager.py (its register_forward_hooks), loaded from the file."""
    path = installed_root() / "srt" / "model_executor" / "hook_manager.py"
    spec = importlib.util.spec_from_file_location("sglang_hook_manager_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per process (kt_ep_wrapper.py is 6,000 lines)."""
    return ast.parse(path.read_text(), filename=str(path))


def load_parts(path: Path, names, provided: dict, module_name: str, methods_of: str | None = None) -> types.ModuleType:
    """A private module (registered as `module_name`) holding `provided` plus the named
    top-level definitions of `path`, or the named methods of its class `methods_of`
    (as plain functions). Calling again with the same name adds to that module."""
    mod = sys.modules.get(module_name)
    if mod is None:
        mod = sys.modules[module_name] = types.ModuleType(module_name)
        mod.__file__ = str(path)
    mod.__dict__.update(provided)
    body = parsed(path).body
    if methods_of is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == methods_of).body
    want = set(names)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in want:
            code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec",
                           flags=__future__.annotations.compiler_flag, dont_inherit=True)
            exec(code, mod.__dict__)
            want.discard(node.name)
    if want:
        raise LookupError(f"{path}: no definition of {sorted(want)}" + (f" in class {methods_of}" if methods_of else ""))
    return mod


def expert_location(root: Path, module_name: str = "sglang.srt.eplb.expert_location"):
    """0.5.23's eplb/expert_location.py: ExpertLocationMetadata and the getter the loader
    and moetrace's hooks call. Registered under SGLang's own module name, so moetrace
    finds it exactly as inside a server; `resources.expert_location_metadata` is what
    get_global_expert_location_metadata() returns."""
    resources = types.SimpleNamespace(expert_location_metadata=None)
    exec_ = types.SimpleNamespace(moe=types.SimpleNamespace(ep_dispatch_algorithm=None, moe_a2a_backend="none"))
    mod = load_parts(root / "srt/eplb/expert_location.py",
                     ["ExpertLocationMetadata", "_compute_logical_to_all_physical_map", "_pad_nested_array",
                      "get_global_expert_location_metadata"],
                     dict(torch=torch, F=F, dataclass=dataclasses.dataclass, Optional=typing.Optional, List=typing.List,
                          get_exec=lambda: exec_, get_resources=lambda: resources), module_name)
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
    return load_parts(root / "srt/layers/moe/fused_moe_triton/layer.py",
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

    path = root / "srt/layers/moe/kt_ep_wrapper.py"
    mod = load_parts(path, ["select_top_experts_from_batch", "copy_experts_weights_fp8", "copy_experts_weights_fp8_channel",
                            "copy_experts_weights_bf16", "copy_experts_weights_int4", "update_gpu_expert_mappings"],
                     dict(torch=torch, dist=dist, get_tp_group=lambda: tp_group,
                          update_kt_wrapper_masks=lambda wrapper, mask: None, logger=logging.getLogger("kt-under-test")),
                     "moetrace_tests_kt_ep_wrapper")
    return load_parts(path, ["_update_gpu_experts_from_batch"], {}, "moetrace_tests_kt_ep_wrapper",
                      methods_of="KTEPWrapperMethod")
