"""Experts beyond the routed decoder experts: a fused shared expert, and a draft model's.

- Shared expert: DeepSeek's ``mlp.shared_experts`` and Qwen3-Next/3.5's
  ``mlp.shared_expert`` are ordinary MLPs, but SGLang fuses them into the FusedMoE's
  last slot(s) when they are shaped like a routed expert (DeepSeek V3 on SM80+ at
  EP1; Qwen with shared-expert fusion on), loading them as expert ``num_experts + j``.
  Their expected shards are cut exactly like a routed expert's.
- Draft model: Qwen3.5's multi-token-prediction module (``mtp.*``) is a one-layer
  model whose experts SGLang loads at ``model.layers.0.mlp.experts`` of the draft
  runner (``mtp.`` renamed to ``model.``, models/qwen3_5_mtp.py). Its spec is the
  target's with prefix ``mtp`` and layer 0, when its tensors have the target's format;
  otherwise it is left out, with the reason (the analysis says so by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from moetrace.checkpoints.spec import SHARED_EXPERT_MODULES, MoESpec, verify_against_tensors
from moetrace.errors import MoetraceError

DRAFT_PREFIX = "mtp"
DRAFT_FAMILIES = ("qwen3_5_moe",)


def _shapes(spec: MoESpec) -> dict[str, tuple[int, ...]]:
    H, I = spec.hidden_size, spec.intermediate_size
    return {"gate": (I, H), "up": (I, H), "down": (H, I)}


def shared_expert_count(spec: MoESpec, tensors: Mapping[str, object]) -> int:
    """1 when every MoE layer's shared expert is shaped and typed like a routed expert
    (weights and scales of the spec's format), else 0. `tensors`: name -> an object
    with ``dtype`` (safetensors string) and ``shape``."""
    module = SHARED_EXPERT_MODULES.get(spec.family)
    if module is None:
        return 0
    # A fused 3-D checkpoint keeps its shared expert per-module too, and SGLang fuses
    # it the same way (mlp.shared_experts -> mlp.experts.{num_experts}.*).
    weight_dtype = "F8_E4M3" if spec.fmt.startswith("fp8") else "BF16"
    for layer in spec.moe_layers:
        for proj, shape in _shapes(spec).items():
            stem = f"{spec.prefix}.layers.{layer}.mlp.{module}.{proj}_proj"
            w = tensors.get(f"{stem}.weight")
            if w is None or w.dtype != weight_dtype or tuple(w.shape) != shape:
                return 0
            if spec.scale_suffix is not None and f"{stem}.{spec.scale_suffix}" not in tensors:
                return 0
    return 1


def draft_spec(spec: MoESpec, dtypes: Mapping[str, str]) -> tuple[MoESpec | None, str]:
    """(the draft model's spec, "") or (None, why there is none). `dtypes`: the draft's
    tensor names (``mtp.*``) -> safetensors dtype."""
    if spec.family not in DRAFT_FAMILIES:
        return None, f"{spec.arch} has no draft model moetrace knows"
    first = f"{DRAFT_PREFIX}.layers.0.mlp.experts"
    if not any(n.startswith(first + ".") for n in dtypes):
        return None, f"the checkpoint has no {first}.* tensors"
    draft = replace(spec, prefix=DRAFT_PREFIX, num_layers=1, moe_layers=(0,), shared_experts=0)
    try:
        return verify_against_tensors(draft, dtypes, f"draft model ({DRAFT_PREFIX}.*)"), ""
    except MoetraceError as err:  # e.g. a BF16 MTP module beside FP8 routed experts
        return None, str(err)
