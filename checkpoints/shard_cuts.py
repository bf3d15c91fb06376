"""Where a TP/EP rank's shard of each expert sits in the checkpoint's tensors: the
server's split (``Parallel``), the checks SGLang makes on it, and the rows and columns a
moe_tp_rank holds (``ShardCut``). No tensors here: the two shard cutters
(checkpoints.shards, in torch; checkpoints.shard_plan, as byte ranges of the files) and
``moetrace index``'s option checks share it. The facts followed are checkpoints.shards'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetrace.checkpoints.layout import CANONICAL, ServerLayout
from moetrace.checkpoints.quant_config import held_scale_names, held_weight_names
from moetrace.checkpoints.spec import INT4_PACK, MoESpec
from moetrace.errors import MoetraceError

if TYPE_CHECKING:
    from moetrace.checkpoints.reader import Checkpoint


@dataclass(frozen=True)
class Parallel:
    """How the server splits experts (--tp-size, --ep-size, --moe-dp-size) and the
    layout its MoE runner and quant method leave them in (checkpoints.layout)."""

    tp_size: int
    ep_size: int = 1
    layout: ServerLayout = CANONICAL
    moe_dp_size: int = 1  # --moe-dp-size: experts replicated over moe_dp groups

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size // self.moe_dp_size

    @property
    def up_first(self) -> bool:
        return self.layout.up_first


def check_split(tp_size: int, ep_size: int = 1, moe_dp_size: int = 1) -> None:
    """The server's --tp must split into --ep x --moe-dp groups (moe_tp = tp / ep / moe_dp)."""
    if tp_size % (ep_size * moe_dp_size):
        raise MoetraceError(f"--tp {tp_size} is not divisible by --ep {ep_size} x --moe-dp {moe_dp_size}")


def per_rank(spec: MoESpec, par: Parallel) -> int:
    """I per rank as the layer holds it (padded when the layout says so)."""
    return par.layout.intermediate_padded or spec.intermediate_size // par.moe_tp_size


def _options(par: Parallel) -> str:
    return f"(tp_size={par.tp_size}, ep_size={par.ep_size}" + (
        f", moe_dp_size={par.moe_dp_size})" if par.moe_dp_size != 1 else ")")


def validate_moe_tp(spec: MoESpec, par: Parallel) -> None:
    """Refuse a TP split of the experts SGLang refuses, with its reason, in one line."""
    opts = _options(par)
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
    padded = par.layout.intermediate_padded
    if padded is not None and padded < spec.intermediate_size // mts:
        raise MoetraceError(f"padded I per rank {padded} is below moe_intermediate_size / moe_tp_size {opts}")
    if spec.fmt == "int4":
        _validate_int4(spec, par, opts)
    if spec.fmt == "fp8_block":
        i_tp, (bn, bk) = per_rank(spec, par), spec.block
        # SGLang's create_weights checks both (on the padded size): w13's output and
        # w2's input per rank must hold whole quantization blocks.
        if i_tp % bn:
            raise MoetraceError(
                f"The output_size of gate's and up's weight = {i_tp} (moe_intermediate_size "
                f"{spec.intermediate_size} / moe_tp_size {mts}) is not divisible by weight quantization "
                f"block_n = {bn} {opts}"
            )
        if mts > 1 and i_tp % bk:
            raise MoetraceError(
                f"The input_size of down's weight = {i_tp} (moe_intermediate_size {spec.intermediate_size} / "
                f"moe_tp_size {mts}) is not divisible by weight quantization block_k = {bk} {opts}"
            )


def _validate_int4(spec: MoESpec, par: Parallel, opts: str) -> None:
    """w2's input columns are cut per rank in int32 packs and scale groups: both must be whole."""
    if par.layout.intermediate_padded is not None:
        raise MoetraceError(f"INT4 with I per rank padded to {par.layout.intermediate_padded}: SGLang's WNA16 MoE "
                            f"method does not pad {opts}")
    i_tp = spec.intermediate_size // par.moe_tp_size
    units = ((f"int4 packs ({INT4_PACK} values per int32)", INT4_PACK),
             (f"groups (group_size {spec.group_size})", spec.group_size))
    for what, n in units:
        if i_tp % n:
            raise MoetraceError(f"moe_intermediate_size {spec.intermediate_size} / moe_tp_size {par.moe_tp_size} = "
                                f"{i_tp} input columns of down per rank is not a whole number of {what}: w2's "
                                f"column cut would split one {opts}")


def validate_parallel(spec: MoESpec, par: Parallel) -> None:
    """validate_moe_tp, plus contiguous EP blocks of experts (no EPLB redundancy)."""
    validate_moe_tp(spec, par)
    if spec.num_experts % par.ep_size:
        raise MoetraceError(f"num_experts {spec.num_experts} is not divisible by ep_size {par.ep_size} {_options(par)}")


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
    scales = held_scale_names(spec.fmt, spec.quant_method)
    w13, w2 = held_weight_names(spec.fmt)
    if scales is None:
        return (w13, w2)
    return (w13, scales[0], w2, scales[1])


@dataclass(frozen=True)
class ShardCut:
    """Where one rank's shard sits in the full per-expert tensors."""

    r0: int  # first intermediate row/col read, r*P
    r1: int  # end of the rows read (clipped to I)
    size: int  # rows per half held (P; > r1 - r0 when padded)
    first: str  # "gate" or "up": which goes to w13 rows [0, size)
    second: str


def shard_cut_of(spec: MoESpec, par: Parallel, moe_tp_rank: int) -> ShardCut:
    size = per_rank(spec, par)
    r0 = moe_tp_rank * size
    first, second = ("up", "gate") if par.up_first else ("gate", "up")
    return ShardCut(min(r0, spec.intermediate_size), min(r0 + size, spec.intermediate_size), size, first, second)


def shard_cut(ckpt: "Checkpoint", layer: int, moe_tp_rank: int, par: Parallel) -> ShardCut:
    spec = ckpt.spec
    validate_moe_tp(spec, par)
    if layer not in spec.moe_layers:
        raise MoetraceError(f"layer {layer} is not a MoE layer of {ckpt.path} (MoE layers: {list(spec.moe_layers)})")
    if not 0 <= moe_tp_rank < par.moe_tp_size:
        raise MoetraceError(f"moe_tp_rank {moe_tp_rank} is outside [0, moe_tp_size={par.moe_tp_size})")
    return shard_cut_of(spec, par, moe_tp_rank)


def scale_blocks(a: int, size: int, block: int, total: int) -> tuple[tuple[int, int], int]:
    """Scale blocks of the `size` rows from row a (clipped to the checkpoint's `total`
    blocks), and how many blocks the layer holds."""
    n = -(-size // block)
    s0 = min(a // block, total)
    return (s0, min(s0 + n, total)), n
