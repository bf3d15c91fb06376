"""hooks.layout_facts reads layout facts without ever raising into the server; the facts land
in the rank manifest; checkpoints.layout_rules refuses what it cannot reproduce."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from moetrace.checkpoints.layout import LayoutRefused, ServerLayout
from moetrace.checkpoints.layout_rules import derive_layout
from moetrace.hooks.layout_facts import kt_format, layout_facts


class Hostile(nn.Module):
    """Attributes that raise, as a version with moved properties might."""

    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(2, 8, 4, dtype=torch.bfloat16), requires_grad=False)

    @property
    def quant_method(self):
        raise RuntimeError("moved")

    @property
    def use_flashinfer_trtllm_moe(self):
        raise KeyError("moved")


def test_unreadable_attributes_are_unknown_never_an_exception():
    facts = layout_facts(Hostile())
    assert facts["quant_method_class"] is None and facts["use_flashinfer_trtllm_moe"] is None
    assert facts["params"]["w13_weight"] == {"shape": [2, 8, 4], "dtype": "bfloat16", "format_ue8m0": None,
                                             "is_shuffled": None}
    # SGLang's own FusedMoE with an unknown fact is refused, not guessed
    facts["module_path"] = "sglang.srt.layers.moe.fused_moe_triton.layer"
    with pytest.raises(LayoutRefused, match="an unknown layout.*use_flashinfer_trtllm_moe"):
        derive_layout(facts, "bf16", 4, where="rank 0 layer 3")
    broken = types.SimpleNamespace()
    assert layout_facts(broken)["module_class"] == "SimpleNamespace"  # no tensors, no error


def test_kt_format_follows_the_forks_dispatch_flags():
    ctx = lambda **kw: types.SimpleNamespace(**kw)  # noqa: E731
    flags = dict(_is_mxfp4_quant=False, _is_mxfp8_quant=False, _is_fp8_quant=False, _is_fp8_channel_quant=False,
                 _is_bf16_quant=False)
    assert kt_format(ctx(**flags)) == "int4"  # load()'s else branch
    assert kt_format(ctx(**{**flags, "_is_fp8_channel_quant": True})) == "fp8_channel"
    assert kt_format(ctx(**{**flags, "_is_mxfp4_quant": True, "_is_fp8_quant": True})) == "mxfp4"  # dispatch order
    assert kt_format(ctx(is_bf16_quant=True)) == "bf16"  # before _build_layers copied the flags
    assert kt_format(object()) is None


BASE = {"module_path": "sglang.srt.layers.moe.fused_moe_triton.layer", "quant_method_class": "Fp8MoEMethod",
        "use_flashinfer_trtllm_moe": False, "load_up_proj_weight_first": False, "runner_backend": "triton",
        "intermediate_size_per_partition": 256, "params": {}}


@pytest.mark.parametrize("change,source,want", [
    ({}, "resident", ServerLayout()),
    ({"use_flashinfer_trtllm_moe": True, "runner_backend": "flashinfer_trtllm"}, "resident", ServerLayout(True)),
    ({"use_flashinfer_trtllm_moe": True, "load_up_proj_weight_first": True}, "resident", ServerLayout(False)),
    ({"intermediate_size_per_partition": 384}, "resident", ServerLayout(False, 384)),
    ({"quant_method_class": "UnquantizedFusedMoEMethod", "w13_swiglu_interleaved": True}, "resident",
     ServerLayout(transforms=("w13_swiglu_interleave",))),
    ({"w13_swiglu_interleaved": True}, "staged", ServerLayout()),  # staged: before post-load steps
])  # fmt: skip
def test_rules(change, source, want):
    assert derive_layout({**BASE, **change}, "fp8_block", 256, source) == want


def test_int4_staged_by_conform_is_judged_before_the_repack():
    """A KT INT4 context whose gptq_marlin_repack conform replaced by its identity (the layer
    says so): the words as loaded in the repack's shape, the scales permuted; a server's
    INT4 layer (no such fact), or one with the real repack, is refused."""
    facts = {**BASE, "kt_format": "int4", "marlin_repack": "identity"}
    assert derive_layout(facts, "int4", 256, "staged") == ServerLayout(
        transforms=("marlin_repack_identity", "marlin_permute_scales"))
    for repack in (None, "gptq_marlin_repack"):
        with pytest.raises(LayoutRefused, match="Marlin-repacked INT4 weights"):
            derive_layout({**facts, "marlin_repack": repack}, "int4", 256, "staged")
    params = {"w13_weight_packed": {"shape": [8, 32, 256], "dtype": "int32"}}
    with pytest.raises(LayoutRefused, match="Marlin-repacked weights"):  # a resident INT4 layer
        derive_layout({**BASE, "params": params, "marlin_repack": "identity"}, "int4", 256, "resident")


def test_rules_refuse_by_name():
    with pytest.raises(LayoutRefused, match=r"^run r rank 1 layer 7 \(resident\): the server holds a KT mxfp4"):
        derive_layout({**BASE, "kt_format": "mxfp4"}, "fp8_block", 256, "staged", where="run r rank 1 layer 7 (resident)")
    with pytest.raises(LayoutRefused, match=r"^w: the server holds Marlin-repacked INT4 weights \(_prepare_weight_int4"):
        derive_layout({**BASE, "kt_format": "int4"}, "int4", 256, "staged", where="w")
    with pytest.raises(LayoutRefused, match="128 intermediate rows per rank"):
        derive_layout({**BASE, "intermediate_size_per_partition": 128}, "fp8_block", 256)
    with pytest.raises(LayoutRefused, match="per-tensor FP8 scales beside up-first weights"):
        derive_layout({**BASE, "load_up_proj_weight_first": True}, "fp8_tensor", 256)
    assert derive_layout(None, "fp8_block", 256) == ServerLayout()  # traces from before layouts were recorded


def test_fp8_requant_gpu_check_tells_cpu_semantics_apart():
    """bench/check_fp8_requant.py is the GPU check of the requant's one CUDA assumption:
    on CPU, torch keeps the fp32 scale, so the check must report a difference there."""
    from check_fp8_requant import check  # bench/ is on sys.path (conftest)

    doc = check("cpu", experts=64, seed=2, rows=64, cols=64)  # seed 2: some scales round differently in fp16
    assert doc["differ"] > 0 and doc["matches_moetrace"] is False
