"""The expert tensors a TP/EP rank of SGLang's FusedMoE holds after loading,
computed from the checkpoint alone.

Facts this follows (docs/checkpoints.md, from SGLang's FusedMoE loader and parallel
state): moe_tp_size = tp_size // ep_size // moe_dp_size; moe_tp_rank = tp_rank %
moe_tp_size, ep_rank = (tp_rank // moe_tp_size) % ep_size; without EPLB a rank owns
global experts [ep_rank*E/ep, (ep_rank+1)*E/ep), with EPLB any of them (so the index
keeps every expert per moe_tp_rank: ``expected_experts``). With I_tp = I/moe_tp_size
and r = moe_tp_rank: w13_weight[e] = gate rows [r*I_tp, (r+1)*I_tp) then up rows
(up first when the loader flips the order); w2_weight[e] = down columns
[r*I_tp, (r+1)*I_tp). Block scales follow in whole blocks; scales are held in
fp32. Per-channel w2 scales are per output row of down, which TP does not split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrace.checkpoints.reader import Checkpoint, host_copy
from moetrace.checkpoints.spec import MoESpec, expert_tensor_name, fused_tensor_name
from moetrace.errors import MoetraceError
from moetrace.schema import COPY_ORDERS


@dataclass(frozen=True)
class Parallel:
    """How the server splits experts: --tp-size, --ep-size, and whether the MoE
    runner loads up_proj before gate_proj into w13 (flashinfer-trtllm, or a quant
    method with load_up_proj_weight_first)."""

    tp_size: int
    ep_size: int = 1
    up_first: bool = False
    moe_dp_size: int = 1  # --moe-dp-size: experts replicated over moe_dp groups

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size // self.moe_dp_size


def validate_moe_tp(spec: MoESpec, par: Parallel) -> None:
    """Refuse a TP split of the experts SGLang refuses, with its reason, in one line."""
    opts = f"(tp_size={par.tp_size}, ep_size={par.ep_size}" + (
        f", moe_dp_size={par.moe_dp_size})" if par.moe_dp_size != 1 else ")")
    if par.tp_size < 1 or par.ep_size < 1 or par.moe_dp_size < 1:
        raise MoetraceError(f"tp_size, ep_size and moe_dp_size must be >= 1 {opts}")
    if par.tp_size % (par.ep_size * par.moe_dp_size):
        raise MoetraceError(f"tp_size {par.tp_size} is not divisible by ep_size {par.ep_size}"
                            + (f" x moe_dp_size {par.moe_dp_size}" if par.moe_dp_size != 1 else "") + f" {opts}")
    mts = par.moe_tp_size
    if spec.intermediate_size % mts:
        raise MoetraceError(
            f"moe_intermediate_size {spec.intermediate_size} is not divisible by moe_tp_size {mts} "
            f"= tp_size/ep_size{'/moe_dp_size' if par.moe_dp_size != 1 else ''} {opts}"
        )
    if spec.fmt == "fp8_block":
        i_tp, (bn, bk) = spec.intermediate_size // mts, spec.block
        # SGLang's Fp8MoEMethod checks both: w13's output and w2's input per rank
        # must hold whole quantization blocks.
        if i_tp % bn:
            raise MoetraceError(
                f"The output_size of gate's and up's weight = {i_tp} (moe_intermediate_size "
                f"{spec.intermediate_size} / moe_tp_size {mts}) is not divisible by weight quantization "
                f"block_n = {bn} {opts}"
            )
        if i_tp % bk:
            raise MoetraceError(
                f"The input_size of down's weight = {i_tp} (moe_intermediate_size {spec.intermediate_size} / "
                f"moe_tp_size {mts}) is not divisible by weight quantization block_k = {bk} {opts}"
            )


def validate_parallel(spec: MoESpec, par: Parallel) -> None:
    """validate_moe_tp, plus contiguous EP blocks of experts (no EPLB redundancy)."""
    validate_moe_tp(spec, par)
    if spec.num_experts % par.ep_size:
        raise MoetraceError(f"num_experts {spec.num_experts} is not divisible by ep_size {par.ep_size} "
                            f"(tp_size={par.tp_size}, ep_size={par.ep_size})")


def rank_coords(tp_rank: int, par: Parallel) -> tuple[int, int]:
    """tp_rank -> (moe_tp_rank, ep_rank), as SGLang derives them (parallel_state: TP ranks
    are moe_dp_idx * ep * moe_tp + ep_idx * moe_tp + moe_tp_idx)."""
    if not 0 <= tp_rank < par.tp_size:
        raise MoetraceError(f"tp_rank {tp_rank} is outside [0, tp_size={par.tp_size})")
    mts = par.moe_tp_size
    return tp_rank % mts, (tp_rank // mts) % par.ep_size


def local_experts(spec: MoESpec, par: Parallel, ep_rank: int) -> range:
    """Global expert ids held by ep_rank, in local-slot order."""
    per = spec.num_experts // par.ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def tensor_names(spec: MoESpec) -> tuple[str, ...]:
    """FusedMoE parameter names for the format, in transport copy order."""
    return COPY_ORDERS[spec.fmt]


@dataclass(frozen=True)
class _Cut:
    """Where one rank's shard sits in the full per-expert tensors."""

    r0: int  # first intermediate row/col, r*I_tp
    r1: int
    s0: int  # the same range in scale blocks (block formats only)
    s1: int
    first: str  # "gate" or "up": which goes to w13 rows [0, I_tp)
    second: str


def _cut(spec: MoESpec, par: Parallel, moe_tp_rank: int) -> _Cut:
    i_tp = spec.intermediate_size // par.moe_tp_size
    r0, r1 = moe_tp_rank * i_tp, (moe_tp_rank + 1) * i_tp
    s0 = s1 = 0
    if spec.fmt == "fp8_block":
        s0, s1 = r0 // spec.block[0], r1 // spec.block[0]
    first, second = ("up", "gate") if par.up_first else ("gate", "up")
    return _Cut(r0, r1, s0, s1, first, second)


def _shard_cut(ckpt: Checkpoint, layer: int, moe_tp_rank: int, par: Parallel) -> _Cut:
    spec = ckpt.spec
    validate_moe_tp(spec, par)
    if layer not in spec.moe_layers:
        raise MoetraceError(f"layer {layer} is not a MoE layer of {ckpt.path} (MoE layers: {list(spec.moe_layers)})")
    if not 0 <= moe_tp_rank < par.moe_tp_size:
        raise MoetraceError(f"moe_tp_rank {moe_tp_rank} is outside [0, moe_tp_size={par.moe_tp_size})")
    return _cut(spec, par, moe_tp_rank)


def _prepare(ckpt: Checkpoint, layer: int, tp_rank: int, par: Parallel) -> tuple[_Cut, range]:
    validate_parallel(ckpt.spec, par)
    moe_tp_rank, ep_rank = rank_coords(tp_rank, par)
    return _shard_cut(ckpt, layer, moe_tp_rank, par), local_experts(ckpt.spec, par, ep_rank)


def _scale_rows(t: torch.Tensor) -> torch.Tensor:
    """Per-channel scale [out] or [out, 1] -> [out, 1] fp32."""
    return t.reshape(-1, 1).to(torch.float32)


def _expert_parts(ckpt: Checkpoint, layer: int, expert: int, c: _Cut,
                  into: dict[str, torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
    """One expert's tensors on the rank as the parts stacked along dim 0 (w13 =
    first half then second half), in stored dtypes; callers cat or copy them.
    into: the expert's slots (one [rows, ...] tensor per param): parts are read
    straight into their rows there (and returned as those views)."""
    spec = ckpt.spec

    def read(param: str, half: int | None, proj: str, kind: str = "weight", **cut) -> torch.Tensor:
        dst = None
        if into is not None:
            slot = into[param]
            rows = slot.shape[0] // 2
            dst = slot if half is None else slot[half * rows : (half + 1) * rows]
        return ckpt.read(expert_tensor_name(spec, layer, expert, proj, kind), into=dst, **cut)

    out = {
        "w13_weight": [read("w13_weight", 0, c.first, rows=(c.r0, c.r1)), read("w13_weight", 1, c.second, rows=(c.r0, c.r1))],
        "w2_weight": [read("w2_weight", None, "down", cols=(c.r0, c.r1))],
    }
    if spec.fmt == "fp8_block":
        # Scales are cut in whole blocks (validate_parallel made I_tp a block
        # multiple) and held by SGLang as fp32; the cast from bf16/f16 is exact.
        out["w13_weight_scale_inv"] = [read("w13_weight_scale_inv", h, p, "scale", rows=(c.s0, c.s1))
                                       for h, p in enumerate((c.first, c.second))]
        out["w2_weight_scale_inv"] = [read("w2_weight_scale_inv", None, "down", "scale", cols=(c.s0, c.s1))]
    elif spec.fmt == "fp8_channel":
        name = lambda p: expert_tensor_name(spec, layer, expert, p, "scale")  # noqa: E731
        out["w13_weight_scale"] = [_scale_rows(ckpt.read(name(p), rows=(c.r0, c.r1))) for p in (c.first, c.second)]
        # w2 is split along its input columns: every rank keeps all H output
        # channels, hence the full per-channel scale.
        out["w2_weight_scale"] = [_scale_rows(ckpt.read(name("down")))]
    return {k: out[k] for k in tensor_names(spec)}


def _held_dtype(name: str, stored: torch.dtype) -> torch.dtype:
    return torch.float32 if "scale" in name else stored


def _expert_unfused(ckpt: Checkpoint, layer: int, expert: int, c: _Cut) -> dict[str, torch.Tensor]:
    return {k: torch.cat(v).to(_held_dtype(k, v[0].dtype)) for k, v in _expert_parts(ckpt, layer, expert, c).items()}


def _experts_fused(ckpt: Checkpoint, layer: int, experts: range, c: _Cut) -> dict[str, torch.Tensor]:
    """Fused 3-D BF16 layout: gate_up_proj [E, 2I, H] (gate rows first on dim -2),
    down_proj [E, H, I]. One read per half for all local experts at once."""
    spec = ckpt.spec
    gate_up, down = fused_tensor_name(spec, layer, "gate_up"), fused_tensor_name(spec, layer, "down")
    e = (experts.start, experts.stop)
    offset = {"gate": 0, "up": spec.intermediate_size}
    halves = [ckpt.read(gate_up, rows=(e, (offset[p] + c.r0, offset[p] + c.r1))) for p in (c.first, c.second)]
    return {"w13_weight": torch.cat(halves, dim=1), "w2_weight": ckpt.read(down, rows=(e,), cols=(c.r0, c.r1))}


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
        return {k: v[0] for k, v in _experts_fused(ckpt, layer, range(expert, expert + 1), c).items()}
    return _expert_unfused(ckpt, layer, expert, c)


def _stack_unfused(ckpt: Checkpoint, layer: int, experts, c: _Cut,
                   buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, expert in enumerate(experts):
        slots = {k: v[i] for k, v in out.items()} if out else None
        parts = _expert_parts(ckpt, layer, expert, c, slots)
        if not out:  # allocate once the first expert tells the shapes
            shapes = {k: ((len(experts), sum(p.shape[0] for p in v), *v[0].shape[1:]), _held_dtype(k, v[0].dtype))
                      for k, v in parts.items()}
            reuse = buffers is not None and set(buffers) == set(shapes) and all(
                tuple(buffers[k].shape) == s and buffers[k].dtype == d for k, (s, d) in shapes.items())
            out = dict(buffers) if reuse else {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
        for k, v in parts.items():
            row = 0  # each part lands in its slot: no concatenated temporary
            for p in v:
                dst = out[k][i, row : row + p.shape[0]]
                if p.data_ptr() != dst.data_ptr():
                    host_copy(p, dst)
                row += p.shape[0]
    return out


def expected_layer(ckpt: Checkpoint, layer: int, tp_rank: int, par: Parallel, slots: range | None = None,
                   buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """All local experts' tensors on tp_rank, [E_local, ...] per FusedMoE param,
    slot i holding global expert local_experts(...)[i] (contiguous EP blocks, no EPLB).

    slots: only these local slots (rows of the result, in order), e.g. a block
    of experts at a time. buffers: a previous result to fill again when shapes
    and dtypes match: a caller walking a checkpoint block by block reuses the
    same memory instead of faulting in new pages (1-2 GB/s on a VM)."""
    c, experts = _prepare(ckpt, layer, tp_rank, par)
    if slots is not None:
        experts = experts[slots.start : slots.stop]
    if ckpt.spec.fused_experts:
        return _experts_fused(ckpt, layer, experts, c)
    return _stack_unfused(ckpt, layer, experts, c, buffers)


def expected_experts(ckpt: Checkpoint, layer: int, moe_tp_rank: int, par: Parallel,
                     experts: range | None = None, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The shards of `experts` (default: every routed expert, then the fused shared
    expert(s) ids num_experts + j when the checkpoint has them) for a rank of this
    moe_tp_rank, stacked [len(experts), ...] per FusedMoE param in the given order.
    The shard of an expert does not depend on which EP rank or slot holds it.
    buffers: as expected_layer's."""
    spec = ckpt.spec
    c = _shard_cut(ckpt, layer, moe_tp_rank, par)
    if experts is None:
        experts = range(spec.num_experts + spec.shared_experts)
    routed = range(experts.start, min(experts.stop, spec.num_experts))
    shared = range(max(experts.start, spec.num_experts), experts.stop)
    if not spec.fused_experts:
        return _stack_unfused(ckpt, layer, experts, c, buffers)
    out = _experts_fused(ckpt, layer, routed, c) if len(routed) else {}
    if len(shared):  # a fused 3-D checkpoint keeps its shared expert unfused
        extra = _stack_unfused(ckpt, layer, shared, c)
        out = {k: torch.cat([out[k], v]) if k in out else v for k, v in extra.items()}
    return out
