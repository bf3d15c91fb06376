"""From the layout facts a trace recorded (hooks.layout_facts) to the ServerLayout the
expected side must reproduce, or a refusal naming the transform (LayoutRefused).

docs/compat.md is the table these rules implement (tests/test_compat.py runs a row
for each through SGLang's own loader and hook manager). The rules follow SGLang
0.5.23 and sglang-kt 0.7.2: the w13 half order is decided in FusedMoE's loader
(flashinfer-trtllm swaps w1/w3 for the FP8 and unquantized methods; the layout
method's load_up_proj_weight_first flips it again) and, for compressed-tensors block
FP8 under trtllm, by a swap after loading. Captures of a KT staged context are taken
before process_weights_after_loading, so post-load transforms apply to resident
captures only. vLLM's layers carry their own facts (hooks.vllm.kernel_layout: the hook
undoes vLLM CPU's packs and padding before fingerprinting and names what it refuses).
"""

from __future__ import annotations

from moetrace.checkpoints.layout import CANONICAL, LayoutRefused, ServerLayout

TRTLLM = ("flashinfer_trtllm", "flashinfer_trtllm_routed")
# Runners whose kernels read the weights as loaded (up to the reorders derived below).
QUALIFIED_RUNNERS = ("triton", "deep_gemm", "flashinfer_cutlass", *TRTLLM)
# Methods whose loader swaps w1/w3 under flashinfer-trtllm (layer.py _weight_loader_impl).
TRTLLM_SWAP_METHODS = ("Fp8MoEMethod", "UnquantizedFusedMoEMethod", "CompressedTensorsMxInt4MoE")
STAGED_FORMATS = ("fp8_block", "fp8_channel", "bf16")  # KT contexts moetrace captures (INT4: _int4_staged)
FP8_TENSOR_REQUANT = "fp8_tensor_w13_requant"
SWIGLU_INTERLEAVE = "w13_swiglu_interleave"
MARLIN_REPACK_IDENTITY = "marlin_repack_identity"
MARLIN_PERMUTE_SCALES = "marlin_permute_scales"


def _int4_staged(facts: dict) -> ServerLayout:
    """A KT INT4 staged context: _prepare_weight_int4 transposes each staged expert, repacks
    its words for Marlin (gptq_marlin_repack, a CUDA kernel) and permutes its scales
    (marlin_permute_scales) inside load(). moetrace reproduces the transpose and the permute;
    the repack only where moetrace conform replaced it by its identity (the layer says so)."""
    if facts.get("marlin_repack") != "identity":
        raise LayoutRefused("Marlin-repacked INT4 weights", "_prepare_weight_int4 repacks every staged expert with "
                            "gptq_marlin_repack, a CUDA kernel moetrace does not reproduce (moetrace conform "
                            "replaces it and judges the weights before it)")
    return ServerLayout(transforms=(MARLIN_REPACK_IDENTITY, MARLIN_PERMUTE_SCALES))


def _refuse_transforms(facts: dict, fmt: str, source: str) -> None:
    """Post-load transforms moetrace does not reproduce, most specific first."""
    params = facts.get("params") or {}
    dtypes = {str(p.get("dtype")) for p in params.values()}
    classes = " ".join(str(facts.get(k) or "") for k in ("quant_method_class", "gpu_method_class", "scheme_class"))
    runner = facts.get("runner_backend")
    trtllm = bool(facts.get("use_flashinfer_trtllm_moe")) or runner in TRTLLM
    if any("fnuz" in d for d in dtypes):
        raise LayoutRefused("ROCm e4m3fnuz weights",
                            "normalize_e4m3fn_to_e4m3fnuz rewrites the bytes and doubles scales")
    if any(p.get("is_shuffled") for p in params.values()):
        raise LayoutRefused("aiter-shuffled weights", "shuffle_weight((16, 16)) for the aiter MoE kernels")
    if facts.get("amx"):
        raise LayoutRefused("CPU AMX-packed weights", "_amx_process_weight_after_loading repacks for the AMX kernels")
    if ("marlin" in classes.lower() or runner in ("marlin", "experimental_sgl_marlin")
            or "w13_weight_packed" in params or dtypes & {"int32", "uint32"}):
        raise LayoutRefused("Marlin-repacked weights", "FP8 on SM < 89 and INT4 are repacked for the Marlin kernel")
    if any(p.get("format_ue8m0") for p in params.values()):
        what = "MXFP8 UE8M0 scales" if facts.get("use_mxfp8") else "DeepGEMM UE8M0-requantized weights and scales"
        raise LayoutRefused(what, "requant_weight_ue8m0 rewrites the weights and rounds scales to powers of two")
    if facts.get("mega_moe"):
        raise LayoutRefused("MegaMoE-repacked weights", "build_mega_moe_experts_weights")
    if runner is not None and runner not in QUALIFIED_RUNNERS:
        raise LayoutRefused(f"the {runner} MoE runner's weight layout", "not a row of moetrace's compatibility table")
    if fmt == "fp8_tensor" and facts.get("load_up_proj_weight_first"):
        raise LayoutRefused("per-tensor FP8 scales beside up-first weights",
                            "_load_per_tensor_weight_scale keeps [gate, up] while load_up_proj_weight_first loads up "
                            "rows first; no quant method in sglang 0.5.23 or sglang-kt 0.7.2 sets this up")
    if trtllm and source == "staged":
        raise LayoutRefused("a KT staged load under flashinfer-trtllm",
                            "the staging writer's gate/up order there is unqualified")
    if trtllm and fmt == "bf16":
        raise LayoutRefused("the flashinfer-trtllm BF16 block layout",
                            "rows shuffled and blocked by flashinfer.fused_moe.core, defined outside the sglang wheel")
    if trtllm and fmt == "fp8_tensor":
        raise LayoutRefused("the flashinfer-trtllm FP8 per-tensor weight shuffle",
                            "align_fp8_moe_weights_for_flashinfer_trtllm uses flashinfer's shuffle_matrix_a")


def _known(facts: dict, key: str, missing: list[str]):
    value = facts.get(key)
    if value is None:
        missing.append(key)
    return value


def _loader_up_first(facts: dict, missing: list[str]) -> bool:
    """The w13 half order FusedMoE's loader writes."""
    method = facts.get("gpu_method_class") or facts.get("quant_method_class") or ""
    scheme = facts.get("scheme_class")
    trtllm = bool(_known(facts, "use_flashinfer_trtllm_moe", missing))
    swap = trtllm and scheme is None and method in TRTLLM_SWAP_METHODS  # shard_id w1 <-> w3
    return swap != bool(_known(facts, "load_up_proj_weight_first", missing))  # _load_w13's switch_w13


def _post_load_swap(facts: dict) -> bool:
    """compressed-tensors block FP8 under trtllm swaps the halves after loading (swap_w13_to_w31)."""
    return (facts.get("scheme_class") == "CompressedTensorsW8A8Fp8MoE" and facts.get("strategy") == "block"
            and bool(facts.get("scheme_use_flashinfer_trtllm")))


def loaded_layout(facts: dict, i_tp: int) -> ServerLayout:
    """The layout FusedMoE's loader leaves (half order, padding), before any post-load
    step and without refusals; derive_layout builds on it. LayoutRefused when a fact it
    needs is unknown."""
    missing: list[str] = []
    layout = ServerLayout(_loader_up_first(facts, missing), _padded(facts, i_tp, missing))
    if missing:
        raise LayoutRefused("an unknown layout", f"the trace could not read {', '.join(sorted(set(missing)))}")
    return layout


def _padded(facts: dict, i_tp: int, missing: list[str]) -> int | None:
    got = _known(facts, "intermediate_size_per_partition", missing)
    if got is None or got == i_tp:
        return None
    if got < i_tp:
        raise LayoutRefused(f"{got} intermediate rows per rank", f"the checkpoint gives each rank {i_tp}")
    return int(got)


def vllm_layout(facts: dict, i_tp: int, where: str = "") -> ServerLayout:
    """A vLLM layer's layout: what hooks.vllm.kernel_layout left in the captured bytes (the
    checkpoint's shards, CPU packs and padding undone; up rows first under FlashInfer
    CUTLASS), or the transform it refused."""
    refused = facts.get("refused")
    if isinstance(refused, dict):
        raise LayoutRefused(str(refused.get("transform")), str(refused.get("why")), where)
    got = facts.get("intermediate_size_per_partition")
    if got != i_tp:
        raise LayoutRefused(f"{got} intermediate rows per rank", f"the checkpoint gives each rank {i_tp}", where)
    return ServerLayout(up_first=bool(facts.get("up_first")))


def derive_layout(facts: dict | None, fmt: str, i_tp: int, source: str = "resident", where: str = "") -> ServerLayout:
    """The ServerLayout of one captured layer (i_tp: the checkpoint's I / moe_tp_size),
    or LayoutRefused. facts=None (a trace recorded before layouts were): canonical."""
    if facts is None:
        return CANONICAL
    if facts.get("server") == "vllm":
        return vllm_layout(facts, i_tp, where)
    try:
        if "error" in facts:
            raise LayoutRefused("an unreadable layout", f"reading the layer's facts failed: {facts['error']}")
        kt = facts.get("kt_format")
        if source == "staged" and kt == "int4":
            return _int4_staged(facts)
        if source == "staged" and kt is not None and kt not in STAGED_FORMATS:
            raise LayoutRefused(f"a KT {kt} staged context",
                                "moetrace captures FP8 block/channel and BF16 contexts only")
        _refuse_transforms(facts, fmt, source)
        loaded = loaded_layout(facts, i_tp)
    except LayoutRefused as err:
        raise LayoutRefused(err.transform, err.why, where) from None
    if source == "staged":  # captured when load() returns, before process_weights_after_loading
        return loaded
    transforms = []
    if fmt == "fp8_tensor":
        transforms.append(FP8_TENSOR_REQUANT)  # every CUDA process_weights_after_loading of per-tensor FP8
    if facts.get("w13_swiglu_interleaved"):
        transforms.append(SWIGLU_INTERLEAVE)
    return ServerLayout(loaded.up_first != _post_load_swap(facts), loaded.intermediate_padded, tuple(transforms))
