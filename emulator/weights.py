"""Expert weights for the emulator: per-rank TP shards, as SGLang's FusedMoE holds them.

``CheckpointWeights`` reads them from a safetensors checkpoint through
``moetrace.checkpoints`` (``expected_layer``: exactly the shard a rank must
hold). ``FillerWeights`` makes distinct, cheap bytes of any size for benchmarks
(Qwen3.5-122B layer size without a 2 GB checkpoint on disk).
"""

from __future__ import annotations

import torch

from moetrace.emulator.config import ModelDims, WeightsSpec
from moetrace.errors import MoetraceError


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def dims_from_checkpoint(ckpt) -> ModelDims:
    """ModelDims of an opened moetrace Checkpoint; refuses what the emulator cannot stage."""
    spec = ckpt.spec
    if spec.fmt != "fp8_block":
        raise MoetraceError(f"{ckpt.path}: the emulator stages FP8 block checkpoints (fp8_block), this one is "
                            f"{spec.fmt}")
    if spec.scale_suffix != "weight_scale_inv":
        # the fork's FP8 block path stages w13_weight_scale_inv; a FusedMoE of compressed-tensors
        # block scales holds w13_weight_scale, which the fork takes for per-channel FP8
        raise MoetraceError(f"{ckpt.path}: the emulator stages FP8 block checkpoints of the fp8 method (scales "
                            f"*.weight_scale_inv), this one is {spec.quant_method} (scales *.{spec.scale_suffix}); "
                            "make one with `moetrace make-checkpoint --quant-method fp8`")
    top_k = int(_text_config(ckpt.config).get("num_experts_per_tok", 8) or 8)
    return ModelDims(
        num_layers=spec.num_layers,
        moe_layers=tuple(spec.moe_layers),
        num_experts=spec.num_experts,
        hidden=spec.hidden_size,
        intermediate=spec.intermediate_size,
        top_k=max(1, min(top_k, spec.num_experts)),
        block=tuple(spec.block),
    )


class CheckpointWeights:
    """Per-rank shards read from a checkpoint (opened lazily, once per process)."""

    def __init__(self, path: str, tp: int):
        from moetrace.checkpoints.reader import open_checkpoint
        from moetrace.checkpoints.shards import Parallel

        self.path = path
        self.ckpt = open_checkpoint(path)
        self.par = Parallel(tp_size=tp, ep_size=1)
        self.dims = dims_from_checkpoint(self.ckpt)

    def layer_shards(self, layer: int, tp_rank: int) -> dict[str, torch.Tensor]:
        from moetrace.checkpoints.shards import expected_layer

        shards = expected_layer(self.ckpt, layer, tp_rank, self.par)
        return {k: v.contiguous() for k, v in shards.items()}

    def close(self) -> None:
        self.ckpt.close()


class FillerWeights:
    """Distinct per (layer, rank, expert) bytes with the FusedMoE shapes of ``dims``.

    Weights are one repeated finite e4m3fn byte per expert; scales are 1/(e+1).
    Good for timing and for recognizing experts, not for numerics."""

    def __init__(self, dims: ModelDims, tp: int):
        self.dims = dims
        self.tp = tp

    def layer_shards(self, layer: int, tp_rank: int) -> dict[str, torch.Tensor]:
        d = self.dims
        E, H, i_tp = d.num_experts, d.hidden, d.i_tp(self.tp)
        bn, bk = d.block
        shapes = {
            "w13_weight": ((E, 2 * i_tp, H), torch.float8_e4m3fn),
            "w13_weight_scale_inv": ((E, 2 * -(-i_tp // bn), -(-H // bk)), torch.float32),
            "w2_weight": ((E, H, i_tp), torch.float8_e4m3fn),
            "w2_weight_scale_inv": ((E, -(-H // bn), -(-i_tp // bk)), torch.float32),
        }
        out = {}
        for name, (shape, dtype) in shapes.items():
            t = torch.empty(shape, dtype=torch.uint8 if dtype != torch.float32 else dtype)
            for e in range(E):
                if dtype == torch.float32:
                    t[e].fill_(1.0 / (e + 1 + 1000 * layer + 100 * tp_rank))
                else:  # bytes 0x01..0x7e are finite, nonzero e4m3fn values
                    t[e].fill_(1 + (e + 37 * layer + 11 * tp_rank) % 0x7E)
            out[name] = t.view(dtype) if dtype != torch.float32 else t
        return out

    def close(self) -> None:
        pass


def open_weights(spec: WeightsSpec, tp: int):
    if spec.checkpoint is not None:
        return CheckpointWeights(spec.checkpoint, tp)
    if spec.dims is None:
        raise MoetraceError("WeightsSpec needs a checkpoint or dims")
    return FillerWeights(spec.dims, tp)


def weights_dims(spec: WeightsSpec, tp: int) -> ModelDims:
    """Dims without reading any expert data (the checkpoint's headers and config only)."""
    if spec.checkpoint is None:
        if spec.dims is None:
            raise MoetraceError("WeightsSpec needs a checkpoint or dims")
        return spec.dims
    from moetrace.checkpoints.reader import open_checkpoint

    with open_checkpoint(spec.checkpoint) as ckpt:
        return dims_from_checkpoint(ckpt)
