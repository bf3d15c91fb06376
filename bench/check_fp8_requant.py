"""GPU check of the one assumption behind moetrace's FP8 per-tensor requant (docs/compat.md):
SGLang's per_tensor_dequantize runs ``w.to(float16) * scale`` with the fp32 0-dim scale on
the GPU, and on CUDA that scale is rounded to fp16 before the multiply; moetrace's
checkpoints.transforms reproduces exactly that. On CPU torch does NOT round the scale
(a CPU scalar path), so the two differ there: the check can tell them apart.

    python bench/check_fp8_requant.py [--device cuda]      # prints one JSON line

"matches_moetrace": true on CUDA confirms the reproduction; false means the requant rows of
the compatibility table must become refusals.
"""

from __future__ import annotations

import argparse
import json

import torch

from moetrace.checkpoints.transforms import fp8_tensor_w13_requant


def server_requant(w13: torch.Tensor, scale: torch.Tensor, device: str) -> torch.Tensor:
    """SGLang's loop (fp8.py process_weights_after_loading) run on `device` with torch ops:
    per_tensor_dequantize as written, the per-tensor kernel's arithmetic as written."""
    w13, scale = w13.to(device), scale.to(device)
    half, out = w13.shape[1] // 2, torch.empty_like(w13)
    top = scale.max(dim=1).values
    for e in range(w13.shape[0]):
        for j in range(2):
            dq = w13[e][j * half:(j + 1) * half].to(torch.float16) * scale[e][j]  # per_tensor_dequantize
            inv = torch.ones((), dtype=torch.float32, device=device) / top[e]
            out[e][j * half:(j + 1) * half] = (dq.to(torch.float32) * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    return out.cpu()


def check(device: str, experts: int = 8, seed: int = 0, rows: int = 512, cols: int = 256) -> dict:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, rows, cols, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(experts, 2, generator=g) * 1e-2 + 1e-4  # arbitrary fp32: not fp16-exact
    ours = fp8_tensor_w13_requant({"w13_weight": w13, "w13_weight_scale": scale})["w13_weight"]
    server = server_requant(w13, scale, device)
    diff = int((ours.view(torch.uint8) != server.view(torch.uint8)).sum())
    return {"device": device, "elements": ours.numel(), "differ": diff, "matches_moetrace": diff == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    print(json.dumps(check(args.device, args.experts)))


if __name__ == "__main__":
    main()
