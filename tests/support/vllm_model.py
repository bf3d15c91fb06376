"""A complete tiny model a real vLLM server serves (tests only): ``moetrace make-checkpoint``'s
own writer (checkpoints.synthetic), BF16 Qwen3-MoE, with its attention, norms, embeddings and
byte-level BPE tokenizer (checkpoints.synthetic_model, checkpoints.tokenizer). Its experts hold
``synthetic_values``, so a wrong expert is named by what it holds.

Sizes are the smallest vLLM's CPU kernels take: hidden 64 (the MoE kernels want multiples of
32), head_dim 32 (the writer's, the smallest head size of vLLM's CPU attention), and
moe_intermediate_size 48, so each TP2 rank holds I_tp = 24 rows, which vLLM's CPU experts
zero-pad to 32 after loading (experts/cpu_moe.py ``_pad_moe_intermediate``): the padding is
exercised, not avoided.

    python -m support.vllm_model FOLDER      (what the tests run, with moetrace importable)
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

SIZES = dict(family="qwen3_moe", fmt="bf16", num_layers=2, num_experts=8, hidden=64, intermediate=48, num_files=1)


def write_model(folder: Path, seed: str = "vllm-tiny", **sizes) -> Path:
    """The tiny Qwen3-MoE in `folder` (new or empty): config, safetensors, tokenizer; `sizes`
    override SIZES (write_synthetic_checkpoint's arguments, e.g. intermediate=64)."""
    from moetrace.checkpoints.synthetic import write_synthetic_checkpoint

    return write_synthetic_checkpoint(Path(folder), seed=zlib.crc32(seed.encode()) % 1000, **{**SIZES, **sizes})


if __name__ == "__main__":
    print(write_model(Path(sys.argv[1])))
