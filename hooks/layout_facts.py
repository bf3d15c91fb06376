"""The layout facts of a captured expert layer: what decides how its bytes are laid out.

Read defensively from a FusedMoE (or a KT staged context's ``gpu_layer``): attributes
move between SGLang versions, so a fact that cannot be read is recorded as None
(unknown) and nothing here ever raises. The rank manifest keeps them under
``layouts`` (docs/capture.md); checkpoints.layout_rules turns them into the layout the
expected side reproduces, or into a refusal naming the transform (docs/compat.md).
"""

from __future__ import annotations

import torch

from moetrace.schema import TENSOR_NAMES, dtype_name

FACTS_VERSION = 1
# Set on a KT staged layer by moetrace conform, whose stand-in for gptq_marlin_repack is the
# identity ("identity"): its INT4 words are then the loaded bytes (checkpoints.layout_rules).
MARLIN_REPACK_ATTR = "moetrace_marlin_repack"
# The KT fork's staged-context format flags (SharedFullContext), in the order its load()
# dispatches on them; none set means load()'s INT4 (Marlin) branch.
KT_FORMAT_FLAGS = (
    ("mxfp4_quant", "mxfp4"),
    ("mxfp8_quant", "mxfp8"),
    ("fp8_quant", "fp8_block"),
    ("fp8_channel_quant", "fp8_channel"),
    ("bf16_quant", "bf16"),
)


def _get(obj, *path):
    """obj.a.b... or None; never raises (properties may)."""
    try:
        for name in path:
            if obj is None:
                return None
            obj = getattr(obj, name, None)
        return obj
    except Exception:
        return None


def _attr(obj, name: str, default):
    """getattr(obj, name, default) as SGLang itself reads it; None only when reading raises."""
    try:
        v = getattr(obj, name, default)
    except Exception:
        return None
    return v if isinstance(v, bool) else None


def _bool(v) -> bool | None:
    return v if isinstance(v, bool) else None


def _str(v) -> str | None:
    return v if isinstance(v, str) else None


def _int(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _name(obj) -> str | None:
    return None if obj is None else type(obj).__name__


def _backend(v) -> str | None:
    """MoeRunnerBackend enum (``.value``) or a plain string."""
    if v is None:
        return None
    value = getattr(v, "value", v)
    return value if isinstance(value, str) else str(value)


def _param_facts(module) -> dict:
    out = {}
    for name in TENSOR_NAMES + ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale1", "w2_weight_scale1"):
        t = _get(module, name)
        if not isinstance(t, torch.Tensor):
            continue
        out[name] = {
            "shape": [int(d) for d in t.shape],
            "dtype": dtype_name(t.dtype),
            "format_ue8m0": _bool(_get(t, "format_ue8m0")),
            "is_shuffled": _bool(_get(t, "is_shuffled")),
        }
    return out


def _device_facts(module) -> dict:
    t = _get(module, "w13_weight")
    if not isinstance(t, torch.Tensor):
        t = _get(module, "w13_weight_packed")
    dev = t.device if isinstance(t, torch.Tensor) else None
    cap = None
    if dev is not None and dev.type == "cuda":
        try:
            cap = list(torch.cuda.get_device_capability(dev))
        except Exception:
            cap = None
    return {"device": None if dev is None else dev.type, "capability": cap,
            "hip": bool(getattr(torch.version, "hip", None))}


def kt_format(ctx) -> str | None:
    """A KT staged context's format from the fork's own flags (``_is_<flag>``, as load()
    reads them, else ``is_<flag>`` as _detect_quant_type_from_created_weights sets them):
    "fp8_block" | "fp8_channel" | "bf16" | "mxfp4" | "mxfp8" | "int4" (no flag set);
    None when the context has none of the flags (not the fork's SharedFullContext)."""
    seen = False
    for flag, fmt in KT_FORMAT_FLAGS:
        for name in (f"_is_{flag}", f"is_{flag}"):
            value = _get(ctx, name)
            if isinstance(value, bool):
                seen = True
                if value:
                    return fmt
                break
    return "int4" if seen else None


def layout_facts(module, ctx=None) -> dict:
    """JSON-ready facts of a FusedMoE-like module (ctx: the KT context that staged it)."""
    try:
        qm = _get(module, "quant_method")
        gpu = _get(qm, "gpu_method")  # KTEPWrapperMethod wraps the GPU method
        base = gpu if gpu is not None else qm
        scheme = _get(module, "scheme")
        layout_method = _get(module, "weight_load_method") or qm
        runner = _get(module, "runner_backend")
        if runner is None:
            runner = _get(base, "runner", "runner_backend")
        wq = _get(scheme, "weight_quant", "strategy")
        block = _get(base, "quant_config", "weight_block_size") or _get(scheme, "weight_block_size")
        facts = {
            "module_class": _name(module),
            "module_path": _get(type(module), "__module__"),
            "quant_method_class": _name(qm),
            "gpu_method_class": _name(gpu),
            "scheme_class": _name(scheme),
            "layout_method_class": _name(layout_method),
            "runner_backend": _backend(runner),
            "use_flashinfer_trtllm_moe": _bool(_get(module, "use_flashinfer_trtllm_moe")),
            "use_triton_kernels": _bool(_get(module, "use_triton_kernels")),
            "use_deep_gemm": _bool(_get(module, "use_deep_gemm")),
            "use_flashinfer_cutlass": _bool(_get(base, "use_flashinfer_cutlass")),
            # SGLang reads it with getattr(..., False): absent means False, not unknown.
            "load_up_proj_weight_first": _attr(layout_method, "load_up_proj_weight_first", False),
            "scheme_use_flashinfer_trtllm": _bool(_get(scheme, "use_flashinfer_trtllm")),
            "strategy": _backend(wq),
            "block_quant": _bool(_get(base, "block_quant")) if scheme is None else _bool(_get(scheme, "block_quant")),
            "use_mxfp8": _bool(_get(base, "use_mxfp8")),
            "weight_block_size": [int(b) for b in block] if isinstance(block, (list, tuple)) else None,
            "w13_swiglu_interleaved": _attr(base, "w13_swiglu_interleaved", False),
            "mega_moe": _bool(_get(module, "_mega_moe_weights_built")),
            "amx": _bool(_get(module, "use_intel_amx_backend")),
            "intermediate_size_per_partition": _int(_get(module, "intermediate_size_per_partition")),
            "marlin_repack": _str(_get(module, MARLIN_REPACK_ATTR)),
            "hidden_size": _int(_get(module, "hidden_size")),
            "num_local_experts": _int(_get(module, "num_local_experts")),
            "params": _param_facts(module),
            **_device_facts(module),
        }
        if ctx is not None:
            facts["kt_format"] = kt_format(ctx)
        return facts
    except Exception as err:  # never into the server
        return {"error": f"{type(err).__name__}: {err}"}
