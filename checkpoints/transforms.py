"""Post-load transforms moetrace reproduces exactly on the expected side.

Each takes a rank's expected layer ``{FusedMoE param: [E_local, ...]}`` in load-time
layout and returns it as the server holds it after process_weights_after_loading.
Definitions followed (installed files; checked against them in tests):

- fp8_tensor_w13_requant: SGLang's FP8 per-tensor path (quantization/fp8.py
  process_weights_after_loading, 0.5.23 ~2701-2722; compressed-tensors
  compressed_tensors_w8a8_fp8_moe.py ~290-312): per expert, both w13 halves are
  dequantized with their own scale (utils.per_tensor_dequantize: fp16 weight times the
  scale, in fp16) and requantized with the larger scale by the per-tensor kernel
  (kernels/jit/csrc/gemm/per_tensor_quant_fp8.cuh: x * (1.0f / s), clipped to +-448,
  rounded to e4m3); w13_weight_scale becomes that max, [E].
- w13_swiglu_interleave: unquant.py _maybe_interleave_w13_for_fused_swiglu (0.5.23):
  w13 rows reordered gate0, up0, gate1, up1, ...
- marlin_permute_scales: INT4 group scales as the KT fork's _prepare_weight_int4 leaves
  them (marlin_utils.marlin_permute_scales, called per expert with size_k 2*I_tp for w13
  and I_tp for w2): the scales in row-major order, in runs of 64, each run an 8 x 8
  transpose; where one group spans the whole input (w2 with I_tp == group_size) runs of
  32, each a [4, 4, 2] -> [4, 4, 2] swap of its first two axes. Written here from that
  definition; tests hold it to SGLang's own function.
- marlin_repack_identity: conform only (the KT fork's _prepare_weight_int4 under
  ``moetrace conform``, whose gptq_marlin_repack is a recorded identity): the loaded INT4
  words in the shape the Marlin repack returns, [k/16, n * 2] (bytes unchanged). A real
  server's repacked weights are refused (checkpoints.layout_rules).
"""

from __future__ import annotations

import torch

from moetrace.errors import MoetraceError

FP8_MAX = 448.0


def fp8_tensor_w13_requant(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w13, scale = layer["w13_weight"], layer["w13_weight_scale"].to(torch.float32)
    if scale.dim() != 2 or scale.shape[1] != 2:
        raise MoetraceError(f"fp8 per-tensor requant needs w13_weight_scale [E, 2], got {list(scale.shape)}")
    half = w13.shape[1] // 2
    top = scale.max(dim=1).values
    # The server multiplies on CUDA, where the fp32 0-dim scale is cast to the fp16
    # operand dtype before the multiply (TensorIterator casts inputs to the common dtype).
    s16 = scale.to(torch.float16).to(torch.float32)
    inv = torch.ones((), dtype=torch.float32) / top  # 1.0f / s, one IEEE division
    out = torch.empty_like(w13)
    for j in range(2):
        rows = slice(j * half, (j + 1) * half)
        dq = (w13[:, rows].to(torch.float32) * s16[:, j].view(-1, 1, 1)).to(torch.float16)
        q = (dq.to(torch.float32) * inv.view(-1, 1, 1)).clamp(-FP8_MAX, FP8_MAX)
        out[:, rows] = q.to(torch.float8_e4m3fn)
    return {**layer, "w13_weight": out, "w13_weight_scale": top}


def w13_swiglu_interleave(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w13 = layer["w13_weight"]
    inter = w13.shape[1] // 2
    idx = torch.empty(w13.shape[1], dtype=torch.long)
    idx[0::2] = torch.arange(inter)
    idx[1::2] = torch.arange(inter, 2 * inter)
    return {**layer, "w13_weight": w13.index_select(1, idx)}


MARLIN_RUN, MARLIN_RUN_SINGLE = 64, 32  # scales per permuted run (grouped, one group over k)


def _marlin_runs(s: torch.Tensor, single: bool) -> torch.Tensor:
    flat = s.contiguous().reshape(-1)
    run = MARLIN_RUN_SINGLE if single else MARLIN_RUN
    if flat.numel() % run:
        raise MoetraceError(f"marlin_permute_scales: {flat.numel()} scales are not whole runs of {run}")
    if single:
        return flat.view(-1, 4, 4, 2).transpose(1, 2).reshape(s.shape)
    return flat.view(-1, 8, 8).transpose(1, 2).reshape(s.shape)


def marlin_permute_scales(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per expert: w13's scales grouped (size_k 2*I_tp exceeds any group), w2's grouped when
    it holds more than one group per expert, else the single-group order."""
    w13, w2 = layer["w13_weight_scale"], layer["w2_weight_scale"]
    out13 = torch.stack([_marlin_runs(e, False) for e in w13]) if len(w13) else w13
    out2 = torch.stack([_marlin_runs(e, e.shape[0] == 1) for e in w2]) if len(w2) else w2
    return {**layer, "w13_weight_scale": out13, "w2_weight_scale": out2}


def marlin_repack_identity(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(layer)
    for name in ("w13_weight_packed", "w2_weight_packed"):
        t = layer[name]
        if t.shape[1] % 2:
            raise MoetraceError(f"{name}: {t.shape[1]} rows of int4 words do not make Marlin's k/16 tiles")
        out[name] = t.reshape(t.shape[0], t.shape[1] // 2, t.shape[2] * 2)
    return out


TRANSFORMS = {
    "fp8_tensor_w13_requant": fp8_tensor_w13_requant,
    "w13_swiglu_interleave": w13_swiglu_interleave,
    "marlin_permute_scales": marlin_permute_scales,
    "marlin_repack_identity": marlin_repack_identity,
}


def apply_transforms(layer: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    for name in names:
        fn = TRANSFORMS.get(name)
        if fn is None:
            raise MoetraceError(f"transform {name!r} is not one moetrace reproduces (known: {', '.join(TRANSFORMS)})")
        layer = fn(layer)
    return layer
