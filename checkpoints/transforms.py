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


TRANSFORMS = {
    "fp8_tensor_w13_requant": fp8_tensor_w13_requant,
    "w13_swiglu_interleave": w13_swiglu_interleave,
}


def apply_transforms(layer: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    for name in names:
        fn = TRANSFORMS.get(name)
        if fn is None:
            raise MoetraceError(f"transform {name!r} is not one moetrace reproduces (known: {', '.join(TRANSFORMS)})")
        layer = fn(layer)
    return layer
