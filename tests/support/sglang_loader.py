"""SGLang's own FusedMoE loading, run on CPU (tests only): upstream sglang 0.5.23 or
the sglang-kt fork, compiled from the installed files by support.sglang_source.

``build(root)`` compiles, from the installed tree at `root`:
- FusedMoE's loader (weight_loader and every path it takes for weights, block /
  per-channel / per-tensor scales, make_expert_params_mapping),
- the create_weights of Fp8MoEMethod, UnquantizedFusedMoEMethod,
  CompressedTensorsW8A8Fp8MoE and CompressedTensorsWNA16MoE (parameter shapes, dtypes,
  scale attributes; INT4's is_transposed params),
- marlin_permute_scales (marlin_utils.py), the scale permutation the INT4 Marlin path runs,
- the post-load steps moetrace reproduces (FP8 per-tensor w13 requant, the SwiGLU
  interleave, compressed-tensors' swap_w13_to_w31),
- Qwen3_5MoeForCausalLM.load_weights (checkpoint names -> weight_loader calls, the
  model.language_model rename and the fused gate_up_proj split).
The stand-ins (STUBS below) answer as a CUDA build on a non-HIP GPU would. What
FusedMoE.__init__ computes for a rank is set by ``make_layer`` (layer.py ~341-560).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
import types
from functools import cached_property
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from torch.nn import Module, Parameter

from support.sglang_source import Source, guarded_builtins, module

LAYER = "sglang/srt/layers/moe/fused_moe_triton/layer.py"
FP8 = "sglang/srt/layers/quantization/fp8.py"
UNQUANT = "sglang/srt/layers/quantization/unquant.py"
QUTILS = "sglang/srt/layers/quantization/utils.py"
CT_FP8 = "sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8_moe.py"
CT_WNA16 = "sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py"
MARLIN_UTILS = "sglang/srt/layers/quantization/marlin_utils.py"
WUTILS = "sglang/srt/model_loader/weight_utils.py"
MOE_UTILS = "sglang/srt/layers/moe/utils.py"
COMMON = "sglang/srt/utils/common.py"
LAYER_UTILS = "sglang/srt/layers/utils/common.py"
REGISTRY = "sglang/srt/layers/moe/quant_method_registry.py"
QWEN35 = "sglang/srt/models/qwen3_5.py"
QWEN3_MOE = "sglang/srt/models/qwen3_moe.py"
QWEN3_NEXT = "sglang/srt/models/qwen3_next.py"
DEEPSEEK_LOADER = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py"

# The loader paths moetrace follows; every supported version has them.
LOADER = ["weight_loader", "_weight_loader_impl", "_load_w13", "_load_w2", "_load_per_tensor_weight_scale",
          "_load_model_weight_or_group_weight_scale", "_load_per_channel_weight_scale",
          "_map_global_expert_id_to_local_expert_id", "make_expert_params_mapping"]
# What those paths call in one version or the other (0.5.23 / fork).
LOADER_HELPERS = ["_weight_loader_physical", "_load_gguf_weight", "_load_single_value", "_load_g_idx",
                  "_maybe_load_bf16_shared_expert_as_fp4", "_maybe_load_fp8_shared_expert_as_fp4",
                  "use_padded_loading", "scheme"]
TRTLLM = ("flashinfer_trtllm", "flashinfer_trtllm_routed")


class Backend:
    """get_moe_runner_backend()'s answer: is_<name>() is true for the chosen runner only."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            return lambda: attr[3:] == self.name
        raise AttributeError(attr)


class QuantizationStrategy(str, enum.Enum):
    """compressed_tensors' enum (0.5.23 imports the package, not installed with --no-deps)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    TOKEN = "token"


def per_tensor_quant_kernel(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """kernels/jit/csrc/gemm/per_tensor_quant_fp8.cuh, per element: clip(float(x) *
    (1.0f / *scale), +-448) cast to e4m3 (round to nearest even)."""
    inv = torch.ones((), dtype=torch.float32) / scale.to(torch.float32).reshape(())
    return (x.to(torch.float32) * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _scaled_fp8_quant(x, scale=None, *args, **kwargs):
    assert scale is not None, "only the static (given-scale) path is stood in"
    return per_tensor_quant_kernel(x, scale), scale


class _Logger:
    """SGLang's logger has info_once / warning_once; these tests need no log."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def _marker(name: str) -> type:
    return type(name, (), {})


@functools.lru_cache(maxsize=None)
def build(root: str) -> types.SimpleNamespace:
    src = Source(root)
    state = types.SimpleNamespace(backend=Backend("triton"), tp_size=1, env=set())

    class Env:
        def __getattr__(self, name):
            return types.SimpleNamespace(get=lambda: name in state.env)

    ns: dict = {  # one namespace: every compiled definition sees these stand-ins
        "torch": torch, "Module": Module, "Parameter": Parameter, "Optional": Optional, "Dict": Dict,
        "List": List, "Tuple": Tuple, "Any": Any, "Union": Union, "Iterable": Iterable, "Set": Set,
        "Enum": enum.Enum, "cached_property": cached_property, "logging": logging, "os": os, "re": re,
        "_is_hip": False, "_is_cpu": False, "_is_npu": False, "_is_cuda": True, "_use_aiter": False,
        "_use_hip_int4": False, "_is_fp8_fnuz": False, "_is_cpu_amx_available": False, "fp8_dtype": torch.float8_e4m3fn,
        "envs": Env(), "get_bool_env_var": lambda *a, **k: False, "is_xpu": lambda: False,
        "is_large_dummy_model": lambda: False, "is_fp8_fnuz": lambda: False,
        "get_global_expert_location_metadata": lambda: None,
        "get_moe_runner_backend": lambda: state.backend,
        "get_moe_a2a_backend": lambda: Backend("none"),
        "get_tensor_model_parallel_world_size": lambda: state.tp_size,
        "get_lora": lambda: types.SimpleNamespace(enable_lora=False, lora_paths=None),
        "get_exec": lambda: types.SimpleNamespace(moe=types.SimpleNamespace(enable_eplb=False)),
        "scaled_fp8_quant": _scaled_fp8_quant,
        "quantize_block_fp8_weight_to_mxfp4": None,
        "KTEPWrapperMethod": _marker("KTEPWrapperMethod"),
        "ModelOptNvFp4FusedMoEMethod": _marker("ModelOptNvFp4FusedMoEMethod"),
        "CompressedTensorsMxInt4MoE": _marker("CompressedTensorsMxInt4MoE"),
        "FusedMoEMethodBase": object, "CompressedTensorsMoEScheme": object, "BaseFusedOp": object,
        "QuantizationStrategy": QuantizationStrategy, "_use_xpu_moe_ld_padding": lambda *a: False,
        # kv-scale renames only; expert names pass through unchanged
        "QWEN3_5_KV_SCALE_MAPPER": types.SimpleNamespace(apply=lambda w: w),
        "default_weight_loader": None, "logger": _Logger(), "print_warning_once": lambda *a, **k: None,
    }
    fused_pkg = module("sglang.srt.layers.moe.fused_moe_triton")
    ns["__builtins__"] = guarded_builtins({
        "sglang.srt.layers.moe.fused_moe_triton": fused_pkg,
        # the FP8 trtllm reload path clears a shuffle-index cache: nothing to clear here
        "sglang.srt.layers.moe.moe_runner.flashinfer_trtllm": module("trtllm", clear_mxfp8_shuffle_index_cache=lambda: None),
    })

    def top(rel, required, optional=()):
        src.run(rel, [src.top(rel, n) for n in list(required) + [n for n in optional if src.has(rel, n)]], ns)

    def cls(rel, name, required, optional=(), bases=("object",)):
        src.run(rel, [src.members(rel, name, required, optional, bases=list(bases))], ns)

    top(WUTILS, ["get_actual_shard_size", "reset_param_data_if_needed", "narrow_padded_param_and_loaded_weight"])
    top(COMMON, ["set_weight_attrs"])
    top(MOE_UTILS, ["AITER_PADDING_SIZE", "TRITON_PADDING_SIZE", "get_moe_padding_size"], ["get_moe_weight_sizes"])
    top(LAYER_UTILS, ["get_layer_id"])
    top(QUTILS, ["per_tensor_dequantize", "swap_w13_to_w31"])
    if src.exists(REGISTRY):  # fork: isinstance replacement for wrapped methods
        top(REGISTRY, ["is_wrapped_method"])
    top(LAYER, ["FusedMoeWeightScaleSupported"],
        ["_weight_layout_method", "_copy_weight_view_before_h2d", "_maybe_copy_weight_view_before_h2d"])
    fused_pkg.FusedMoeWeightScaleSupported = ns["FusedMoeWeightScaleSupported"]
    cls(FP8, "Fp8MoEMethod", ["create_weights", "process_weights_after_loading"], ["create_fp8_moe_weight_"],
        bases=["FusedMoEMethodBase"])
    top(UNQUANT, [], ["_FUSED_EXPERT_WEIGHT_NAMES", "_fused_expert_weight_name"])
    cls(UNQUANT, "UnquantizedFusedMoEMethod", ["create_weights", "load_up_proj_weight_first"],
        ["_canonical_expert_weight_shape", "maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load",
         "_maybe_interleave_w13_for_fused_swiglu", "get_moe_runner_backend"], bases=["FusedMoEMethodBase"])
    cls(CT_FP8, "CompressedTensorsW8A8Fp8MoE", ["create_weights", "process_weights_after_loading"],
        bases=["CompressedTensorsMoEScheme"])
    ns["GPTQMarlinState"] = enum.Enum("GPTQMarlinState", ["REPACK", "READY"])
    cls(CT_WNA16, "CompressedTensorsWNA16MoE", ["create_weights"], bases=["CompressedTensorsMoEScheme"])
    top(MARLIN_UTILS, ["get_scale_perms", "marlin_permute_scales"])
    cls(LAYER, "FusedMoE", LOADER, LOADER_HELPERS, bases=["torch.nn.Module"])
    ns["FusedMoE"].__module__ = "sglang.srt.layers.moe.fused_moe_triton.layer"
    cls(QWEN35, "Qwen3_5MoeForCausalLM", ["load_weights"])
    # The other Qwen families' own name mapping (model level: tests/test_real_checkpoints.py)
    models = {"qwen3_5_moe": ns["Qwen3_5MoeForCausalLM"]}
    for family, rel, name in (("qwen3_moe", QWEN3_MOE, "Qwen3MoeForCausalLM"),
                              ("qwen3_next", QWEN3_NEXT, "Qwen3NextForCausalLM")):
        if src.has(rel, name):
            cls(rel, name, ["load_weights"])
            models[family] = ns[name]
    if src.exists(DEEPSEEK_LOADER):  # the DeepSeek V2/V3 weight-loading mixin
        _build_deepseek(src, ns)
        models["deepseek_v3"] = ns["DeepseekLoader"]
    ns["models_by_family"] = models
    return types.SimpleNamespace(ns=ns, state=state, src=src, root=str(root), models=models,
                                 **{k: ns[k] for k in ("FusedMoE", "Fp8MoEMethod", "UnquantizedFusedMoEMethod",
                                                       "CompressedTensorsW8A8Fp8MoE", "Qwen3_5MoeForCausalLM")})


def _build_deepseek(src: Source, ns: dict) -> None:
    """DeepseekV2WeightLoaderMixin.do_load_weights and _load_fused_expert_tensor as they
    are; the steps around them that touch no expert name stand in (no UE8M0 requant, no
    NextN draft, no post-load MLA split), and the thread pool's submit runs the loader."""
    import concurrent.futures
    from dataclasses import dataclass

    ns.update({"concurrent": concurrent, "dataclass": dataclass, "NVFP4_CKPT_FP8_ATTN_QUANT_MODULES": ["q_b_proj"],
               "is_wint4afp8_or_wint4a16_config": lambda qc: False, "log_info_on_rank0": lambda *a, **k: None,
               "should_async_load": lambda w: False, "_is_npu": False,
               "maybe_executor_submit": lambda executor, futures, use_async, func, func_args=(), func_kwargs=None:
               func(*func_args, **(func_kwargs or {})),
               "_load_fused_indexer_wk": lambda *a, **k: False,
               "_clone_if_runai_streamed_tensor": lambda t: t,
               "_resolve_quark_fp8_block_scale_name": lambda name, params: name})
    rel = DEEPSEEK_LOADER
    # the fork (sglang-kt 0.7.2) has no _load_fused_expert_tensor: it maps no fused names
    names = [n for n in ("_load_fused_expert_tensor", "NextNEnabledConfig", "NextNDisabledConfig") if src.has(rel, n)]
    src.run(rel, [src.top(rel, n) for n in names], ns)
    src.run(rel, [src.members(rel, "DeepseekV2WeightLoaderMixin", ["do_load_weights", "_initialize_nextn_conf"])], ns)

    class DeepseekLoader:
        """load_weights(model, weights) as DeepseekV2ForCausalLM.load_weights calls it."""

        @staticmethod
        def load_weights(model, weights):
            mixin = ns["DeepseekV2WeightLoaderMixin"]
            model._maybe_quant_weights_to_fp8_ue8m0 = lambda w, modules, conf: w
            model.post_load_weights = lambda **kw: None
            model.quant_config, model.pp_group = None, types.SimpleNamespace(is_last_rank=True)
            model.config = types.SimpleNamespace(n_routed_experts=model.config.num_experts, q_lora_rank=None)
            model._initialize_nextn_conf = types.MethodType(mixin._initialize_nextn_conf, model)
            return mixin.do_load_weights(model, weights)

    ns["DeepseekLoader"] = DeepseekLoader


# ------------------------------------------------------------------ one rank's layer


def _method(o, fmt: str, quant_method: str | None, block, runner: str, up_first_method: bool, group_size=None):
    """(layer.quant_method, layer.scheme or None, layer.quant_config) as SGLang picks them."""
    trtllm = runner in TRTLLM
    if fmt == "bf16":
        m = o.UnquantizedFusedMoEMethod.__new__(o.UnquantizedFusedMoEMethod)
        m.use_triton_kernels, m.use_flashinfer_trtllm_moe, m.with_bias = False, trtllm, False
        m.use_flashinfer_cutlass = up_first_method  # load_up_proj_weight_first (unquant.py)
        m._cache_permute_indices, m.runner, m._aiter_runner = {}, types.SimpleNamespace(runner_backend=Backend(runner)), None
        return m, None, None
    S = QuantizationStrategy
    if fmt == "int4":  # CompressedTensorsWNA16MoE.__init__ for a symmetric group scheme, no actorder
        sch = o.ns["CompressedTensorsWNA16MoE"].__new__(o.ns["CompressedTensorsWNA16MoE"])
        sch.num_bits, sch.packed_factor, sch.strategy, sch.group_size = 4, 8, "group", group_size
        sch.actorder, sch.sym, sch.num_gpu_experts = None, True, -1
        return types.SimpleNamespace(), sch, types.SimpleNamespace(get_name=lambda: "compressed-tensors")
    if quant_method == "compressed-tensors":
        strategy = {"fp8_block": S.BLOCK, "fp8_channel": S.CHANNEL, "fp8_tensor": S.TENSOR}[fmt]
        sch = o.CompressedTensorsW8A8Fp8MoE.__new__(o.CompressedTensorsW8A8Fp8MoE)
        sch.weight_quant = types.SimpleNamespace(strategy=strategy)
        sch.block_quant = strategy == S.BLOCK
        sch.weight_block_size = list(block) if block else None
        sch.static_input_scales, sch.use_flashinfer_trtllm = False, trtllm
        # CompressedTensorsFusedMoEMethod copies the scheme's flag (compressed_tensors.py ~1366)
        qm = types.SimpleNamespace(load_up_proj_weight_first=up_first_method)
        return qm, sch, types.SimpleNamespace(get_name=lambda: "compressed-tensors")
    qc = types.SimpleNamespace(get_name=lambda: "fp8", weight_block_size=list(block) if block else None,
                               is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", is_fp4_experts=False)
    m = o.Fp8MoEMethod.__new__(o.Fp8MoEMethod)
    m.quant_config, m.use_mxfp8, m.block_quant = qc, False, block is not None
    m.weight_block_size, m.is_fp4_expert, m._owns_moe_runner = qc.weight_block_size, False, False
    if up_first_method:
        m.load_up_proj_weight_first = True
    return m, None, qc


def make_layer(o, *, layer_id: int, num_experts: int, hidden: int, intermediate: int, tp_size: int, ep_size: int,
               tp_rank: int, fmt: str, quant_method: str | None = "fp8", block=None, runner: str = "triton",
               up_first_method: bool = False, group_size: int | None = None):
    """One rank's FusedMoE with the attributes FusedMoE.__init__ sets for this
    configuration (layer.py ~341-560) and params from the quant method's own create_weights."""
    o.state.backend, o.state.tp_size = Backend(runner), tp_size
    layer = o.FusedMoE.__new__(o.FusedMoE)
    torch.nn.Module.__init__(layer)
    moe_tp = tp_size // ep_size
    layer.layer_id, layer.num_experts, layer.num_fused_shared_experts = layer_id, num_experts, 0
    layer.hidden_size = hidden
    layer.moe_ep_size, layer.moe_ep_rank = ep_size, tp_rank // moe_tp
    layer.moe_tp_size, layer.moe_tp_rank = moe_tp, tp_rank % moe_tp
    layer._num_global_routed, layer._expert_storage_rank = num_experts, layer.moe_ep_rank
    layer._num_local_routed = layer.num_local_experts = num_experts // ep_size
    layer._has_fused_shared, layer._pending_fp8_shared_weights, layer._pending_fp8_shared_scales = False, {}, {}
    layer.uses_expert_location, layer.use_presharded_weights, layer.use_triton_kernels = True, False, False
    layer.use_flashinfer_trtllm_moe = runner in TRTLLM
    layer.use_deep_gemm = runner == "deep_gemm"
    layer.runner_backend = types.SimpleNamespace(value=runner)
    i_tp = intermediate // moe_tp
    if layer.use_flashinfer_trtllm_moe and i_tp % 128:  # padded for the trtllm kernels
        i_tp = -(-i_tp // 128) * 128
    layer.intermediate_size_per_partition = i_tp
    layer.moe_runner_config = types.SimpleNamespace(is_gated=True, activation="silu", gemm1_alpha=None,
                                                    gemm1_clamp_limit=None, swiglu_limit=None,
                                                    apply_router_weight_on_input=False)
    qm, scheme, qc = _method(o, fmt, quant_method, block, runner, up_first_method, group_size)
    layer.quant_method, layer.quant_config, layer.weight_load_method = qm, qc, None
    if scheme is not None:  # compressed-tensors sets layer.scheme; otherwise the class default stays
        layer.scheme = scheme
    (scheme or qm).create_weights(layer=layer, num_experts=layer.num_local_experts, hidden_size=hidden,
                                  intermediate_size_per_partition=i_tp, params_dtype=torch.bfloat16,
                                  weight_loader=layer.weight_loader, with_bias=False,
                                  moe_intermediate_size=intermediate)
    return layer


class ExpertsModel(torch.nn.Module):
    """FusedMoE layers at model.layers.{L}.mlp.experts, as SGLang names them."""

    def __init__(self, experts: dict[int, torch.nn.Module], num_experts: int):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleDict()
        for layer, m in experts.items():
            block = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.mlp.experts = m
            self.model.layers[str(layer)] = block
        self.config = types.SimpleNamespace(num_experts=num_experts)
        self.enable_shared_expert_fusion, self.num_fused_shared_experts = False, 0
        self.routed_experts_weights_of_layer = None  # qwen3_moe.py's load_weights sets it when absent


def load(o, weights: list[tuple[str, torch.Tensor]], experts: dict[int, torch.nn.Module], num_experts: int,
         family: str = "qwen3_5_moe", fused_shared: int = 0):
    """Checkpoint tensors (name, tensor) through the family's own load_weights (Qwen3.5's
    by default) into `experts`; fused_shared: shared experts SGLang fuses into the last
    slot(s) (DeepSeek), the layers then hold num_experts + fused_shared slots."""
    model = ExpertsModel(experts, num_experts)
    model.num_fused_shared_experts = fused_shared
    o.models[family].load_weights(model, iter(weights))
    return model


def post_load(o, layer) -> None:
    """The quant method's own process_weights_after_loading, for the steps compiled above
    (FP8 per-tensor requant, compressed-tensors' swap, the BF16 SwiGLU interleave)."""
    scheme = getattr(layer, "scheme", None)
    if scheme is not None:
        scheme.process_weights_after_loading(layer)
    elif isinstance(layer.quant_method, o.Fp8MoEMethod) and not layer.quant_method.block_quant:
        # (block FP8 on CUDA: process_weights_after_loading_block_quant rewrites nothing unless
        # DeepGEMM's UE8M0 requant runs, which flags the scales format_ue8m0)
        layer.quant_method.process_weights_after_loading(layer)
    elif isinstance(layer.quant_method, o.UnquantizedFusedMoEMethod):
        layer.quant_method._maybe_interleave_w13_for_fused_swiglu(layer)


def checkpoint_tensors(ckpt, layer: int) -> list[tuple[str, torch.Tensor]]:
    """The routed-expert tensors of one layer, read once (loading never modifies them)."""
    from safetensors import safe_open

    handles, out = {}, []
    for name, info in sorted(ckpt.tensors.items()):
        if f".layers.{layer}.mlp.experts." not in name:
            continue
        h = handles.get(info.file) or handles.setdefault(info.file, safe_open(str(info.file), "pt"))
        out.append((name, h.get_tensor(name)))
    return out
