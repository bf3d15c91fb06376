"""The expert tensors a TP/EP rank of SGLang's FusedMoE holds after loading,
computed from the checkpoint alone.

Facts this follows (docs/checkpoints.md; checked byte for byte against SGLang's own
loader in tests/test_loader_oracle.py): moe_tp_size = tp_size // ep_size //
moe_dp_size; moe_tp_rank = r = tp_rank % moe_tp_size, ep_rank = (tp_rank //
moe_tp_size) % ep_size; without EPLB a rank owns global experts [ep_rank*E/ep,
(ep_rank+1)*E/ep), with EPLB any of them (so the index keeps every expert per
moe_tp_rank: ``expected_experts``). With I_tp = I/moe_tp_size: w13_weight[e] =
gate rows [r*I_tp, (r+1)*I_tp) then up rows (up first when the layout says so); w2 =
down columns [r*I_tp, (r+1)*I_tp). Block scales follow in whole blocks: w13 scale rows
by block_n, w2 scale columns by block_k. Per-channel w2 scales are per output row of
down, which TP does not split; per-tensor scales are [gate, up] and one down scale.
Scales are held in fp32. INT4 (compressed-tensors pack-quantized) cuts the same
rows and columns in the checkpoint's [out, in/8] int32 words and [out, in/group_size]
scales (w2's column cut in whole packs and groups) and is held transposed, as
SGLang's CompressedTensorsWNA16MoE loads it: w13_weight_packed [H/8, 2*I_tp],
w2_weight_packed [I_tp/8, H], scales [groups, out] in bfloat16. When the runner pads
I_tp to P (flashinfer-trtllm), rank r loads rows [r*P, min((r+1)*P, I)) into each
half and zeros the rest (SGLang's narrow_padded_param_and_loaded_weight): the pad
re-partitions I, it is not per rank.
"""

from __future__ import annotations

import torch

from moetrace.checkpoints.quant_config import held_scale_names, held_weight_names
from moetrace.checkpoints.reader import Checkpoint
from moetrace.checkpoints.safetensors_file import host_copy
from moetrace.checkpoints.shard_cuts import (  # noqa: F401  (Parallel and the checks: imported from here too)
    Parallel,
    ShardCut,
    check_split,
    local_experts,
    rank_coords,
    scale_blocks,
    shard_cut,
    tensor_names,
    validate_moe_tp,
    validate_parallel,
)
from moetrace.checkpoints.spec import INT4_PACK, MoESpec, expert_tensor_name, fused_tensor_name
from moetrace.checkpoints.transforms import apply_transforms
from moetrace.errors import MoetraceError


def _prepare(ckpt: Checkpoint, layer: int, tp_rank: int, par: Parallel) -> tuple[ShardCut, range]:
    validate_parallel(ckpt.spec, par)
    moe_tp_rank, ep_rank = rank_coords(tp_rank, par)
    return shard_cut(ckpt, layer, moe_tp_rank, par), local_experts(ckpt.spec, par, ep_rank)


def _pad(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Zero-extend dim to `size` (the loader zeroes what it does not write)."""
    short = size - t.shape[dim]
    if short <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def _scale_rows(t: torch.Tensor) -> torch.Tensor:
    """Per-channel scale [out] or [out, 1] -> [out, 1] fp32."""
    return t.reshape(-1, 1).to(torch.float32)


def _expert_parts(ckpt: Checkpoint, layer: int, expert: int, c: ShardCut,
                  into: dict[str, torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
    """One expert's tensors on the rank as the parts stacked along dim 0 (w13 =
    first half then second half), in stored dtypes; callers cat or copy them.
    into: the expert's slots (one [rows, ...] tensor per param): unpadded parts are
    read straight into their rows there (and returned as those views)."""
    spec = ckpt.spec
    I = spec.intermediate_size
    padded = c.size != c.r1 - c.r0  # rare (trtllm): read, zero-extend, let the caller copy

    def read(param: str, half: int | None, proj: str, kind: str = "weight", size: int = 0, dim: int = 0,
             **cut) -> torch.Tensor:
        name = expert_tensor_name(spec, layer, expert, proj, kind)
        if padded:
            return _pad(ckpt.read(name, **cut), size, dim)
        dst = None
        if into is not None:
            slot = into[param]
            rows = slot.shape[0] // 2
            dst = slot if half is None else slot[half * rows : (half + 1) * rows]
        return ckpt.read(name, into=dst, **cut)

    halves = (c.first, c.second)
    w13, w2 = held_weight_names(spec.fmt)
    pack = INT4_PACK if spec.fmt == "int4" else 1  # w2's columns in int32 words of 8 int4 values
    out = {
        w13: [read(w13, h, p, size=c.size, rows=(c.r0, c.r1)) for h, p in enumerate(halves)],
        w2: [read(w2, None, "down", size=c.size // pack, dim=1, cols=(c.r0 // pack, c.r1 // pack))],
    }
    scales = held_scale_names(spec.fmt, spec.quant_method)
    if spec.fmt == "int4":  # group scales: w13 rows as the weight's, w2 columns in whole groups
        gs = spec.group_size
        out[scales[0]] = [read(scales[0], h, p, "scale", rows=(c.r0, c.r1)) for h, p in enumerate(halves)]
        out[scales[1]] = [read(scales[1], None, "down", "scale", cols=(c.r0 // gs, c.r1 // gs))]
    elif spec.fmt == "fp8_block":
        # Whole blocks: w13 scale rows by block_n, w2 scale columns by block_k; the cast
        # from bf16/f16 to the fp32 SGLang holds is exact.
        bn, bk = spec.block
        rows, n_rows = scale_blocks(c.r0, c.size, bn, -(-I // bn))
        cols, n_cols = scale_blocks(c.r0, c.size, bk, -(-I // bk))
        out[scales[0]] = [read(scales[0], h, p, "scale", size=n_rows, rows=rows) for h, p in enumerate(halves)]
        out[scales[1]] = [read(scales[1], None, "down", "scale", size=n_cols, dim=1, cols=cols)]
    elif spec.fmt == "fp8_channel":
        name = lambda p: expert_tensor_name(spec, layer, expert, p, "scale")  # noqa: E731
        out[scales[0]] = [_pad(_scale_rows(ckpt.read(name(p), rows=(c.r0, c.r1))), c.size, 0) for p in halves]
        # w2 is split along its input columns: every rank keeps all H output
        # channels, hence the full per-channel scale.
        out[scales[1]] = [_scale_rows(ckpt.read(name("down")))]
    elif spec.fmt == "fp8_tensor":
        # [gate, up] in the order the halves are loaded, and the one down scale
        name = lambda p: expert_tensor_name(spec, layer, expert, p, "scale")  # noqa: E731
        out[scales[0]] = [ckpt.read(name(p)).reshape(1).to(torch.float32) for p in halves]
        out[scales[1]] = [ckpt.read(name("down")).reshape(()).to(torch.float32)]
    return {k: out[k] for k in tensor_names(spec)}


def _held_dtype(name: str, stored: torch.dtype, fmt: str) -> torch.dtype:
    """FP8 scales are held in fp32; INT4's in the model dtype (bfloat16: spec checks it)."""
    if "scale" not in name:
        return stored
    return torch.bfloat16 if fmt == "int4" else torch.float32


def _loaded(spec: MoESpec, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer as the loader leaves it: INT4 is held transposed ([E, in, out]; SGLang's
    WNA16 MoE params are is_transposed and its loader transposes each checkpoint tensor)."""
    if spec.fmt != "int4":
        return layer
    return {k: v.transpose(-2, -1).contiguous() for k, v in layer.items()}


def _slot_shape(parts: list[torch.Tensor]) -> tuple[int, ...]:
    """Per-expert shape of parts stacked along dim 0 (a 0-dim part is the whole tensor)."""
    if parts[0].dim() == 0:
        return ()
    return (sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def _expert_unfused(ckpt: Checkpoint, layer: int, expert: int, c: ShardCut) -> dict[str, torch.Tensor]:
    parts = _expert_parts(ckpt, layer, expert, c)
    return {k: (torch.cat(v) if v[0].dim() else v[0]).to(_held_dtype(k, v[0].dtype, ckpt.spec.fmt))
            for k, v in parts.items()}


def _experts_fused(ckpt: Checkpoint, layer: int, experts: range, c: ShardCut) -> dict[str, torch.Tensor]:
    """Fused 3-D layout: gate_up_proj [E, 2I, H] (gate rows first on dim -2),
    down_proj [E, H, I], and with FP8 block scales gate_up_proj's [E, 2*ceil(I/bn),
    ceil(H/bk)] (gate blocks first) and down_proj's [E, ceil(H/bn), ceil(I/bk)]. One
    read per half for all local experts at once."""
    spec = ckpt.spec
    I = spec.intermediate_size
    gate_up, down = fused_tensor_name(spec, layer, "gate_up"), fused_tensor_name(spec, layer, "down")
    e = (experts.start, experts.stop)
    offset = {"gate": 0, "up": I}
    halves = [_pad(ckpt.read(gate_up, rows=(e, (offset[p] + c.r0, offset[p] + c.r1))), c.size, 1)
              for p in (c.first, c.second)]
    out = {"w13_weight": torch.cat(halves, dim=1),
           "w2_weight": _pad(ckpt.read(down, rows=(e,), cols=(c.r0, c.r1)), c.size, 2)}
    if spec.fmt == "fp8_block":
        w13_scale, w2_scale = held_scale_names(spec.fmt, spec.quant_method)
        bn, bk = spec.block
        (s0, s1), n_rows = scale_blocks(c.r0, c.size, bn, -(-I // bn))
        (k0, k1), n_cols = scale_blocks(c.r0, c.size, bk, -(-I // bk))
        block_offset = {"gate": 0, "up": -(-I // bn)}
        scales = fused_tensor_name(spec, layer, "gate_up", "scale")
        out[w13_scale] = torch.cat([_pad(ckpt.read(scales, rows=(e, (block_offset[p] + s0, block_offset[p] + s1))),
                                         n_rows, 1) for p in (c.first, c.second)], dim=1).to(torch.float32)
        out[w2_scale] = _pad(ckpt.read(fused_tensor_name(spec, layer, "down", "scale"), rows=(e,), cols=(k0, k1)),
                             n_cols, 2).to(torch.float32)
    return {k: out[k] for k in tensor_names(spec)}


def expected_expert(ckpt: Checkpoint, layer: int, expert: int, tp_rank: int, par: Parallel) -> dict[str, torch.Tensor]:
    """One expert's tensors on tp_rank (no leading expert dim), keyed by FusedMoE
    param name in copy order. `expert` is a global id the rank must own."""
    c, experts = _prepare(ckpt, layer, tp_rank, par)
    if expert not in experts:
        raise MoetraceError(
            f"expert {expert} is not on tp_rank {tp_rank}: it holds experts [{experts.start}, {experts.stop}) "
            f"(num_experts={ckpt.spec.num_experts}, ep_size={par.ep_size})"
        )
    if ckpt.spec.fused_experts:
        held = _experts_fused(ckpt, layer, range(expert, expert + 1), c)
    else:
        held = _loaded(ckpt.spec, {k: v.unsqueeze(0) for k, v in _expert_unfused(ckpt, layer, expert, c).items()})
    return {k: v[0] for k, v in apply_transforms(held, par.layout.transforms).items()}


def _stack_unfused(ckpt: Checkpoint, layer: int, experts, c: ShardCut,
                   buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, expert in enumerate(experts):
        parts = _expert_parts(ckpt, layer, expert, c, {k: v[i] for k, v in out.items()} if out else None)
        if not out:  # allocate once the first expert tells the shapes
            shapes = {k: ((len(experts), *_slot_shape(v)), _held_dtype(k, v[0].dtype, ckpt.spec.fmt))
                      for k, v in parts.items()}
            reuse = buffers is not None and set(buffers) == set(shapes) and all(
                tuple(buffers[k].shape) == s and buffers[k].dtype == d for k, (s, d) in shapes.items())
            out = dict(buffers) if reuse else {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
        for k, v in parts.items():
            row = 0  # each part lands in its slot: no concatenated temporary
            for p in v:
                dst = out[k][i] if p.dim() == 0 else out[k][i, row : row + p.shape[0]]
                if p.data_ptr() != dst.data_ptr():
                    host_copy(p, dst)
                row += p.shape[0] if p.dim() else 0
    return out


def expected_layer(ckpt: Checkpoint, layer: int, tp_rank: int, par: Parallel, slots: range | None = None,
                   buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """All local experts' tensors on tp_rank, [E_local, ...] per FusedMoE param,
    slot i holding global expert local_experts(...)[i] (contiguous EP blocks, no EPLB),
    in the layout's order and padding and after its post-load transforms.

    slots: only these local slots (rows of the result, in order), e.g. a block
    of experts at a time. buffers: a previous result to fill again when shapes
    and dtypes match: a caller walking a checkpoint block by block reuses the
    same memory instead of faulting in new pages (1-2 GB/s on a VM)."""
    c, experts = _prepare(ckpt, layer, tp_rank, par)
    if slots is not None:
        experts = experts[slots.start : slots.stop]
    if ckpt.spec.fused_experts:
        return apply_transforms(_experts_fused(ckpt, layer, experts, c), par.layout.transforms)
    return apply_transforms(_loaded(ckpt.spec, _stack_unfused(ckpt, layer, experts, c, buffers)),
                            par.layout.transforms)


def expected_experts(ckpt: Checkpoint, layer: int, moe_tp_rank: int, par: Parallel,
                     experts: range | None = None,
                     buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The shards of `experts` (default: every routed expert, then the fused shared
    expert(s) ids num_experts + j when the checkpoint has them) for a rank of this
    moe_tp_rank, stacked [len(experts), ...] per FusedMoE param in the given order,
    in the layout's order and padding and after its post-load transforms.
    The shard of an expert does not depend on which EP rank or slot holds it.
    buffers: as expected_layer's."""
    spec = ckpt.spec
    c = shard_cut(ckpt, layer, moe_tp_rank, par)
    if experts is None:
        experts = range(spec.num_experts + spec.shared_experts)
    routed = range(experts.start, min(experts.stop, spec.num_experts))
    shared = range(max(experts.start, spec.num_experts), experts.stop)
    if not spec.fused_experts:
        return apply_transforms(_loaded(spec, _stack_unfused(ckpt, layer, experts, c, buffers)),
                                par.layout.transforms)
    out = _experts_fused(ckpt, layer, routed, c) if len(routed) else {}
    if len(shared):  # a fused 3-D checkpoint keeps its shared expert unfused
        extra = _stack_unfused(ckpt, layer, shared, c)
        out = {k: torch.cat([out[k], v]) if k in out else v for k, v in extra.items()}
    return apply_transforms(out, par.layout.transforms)
