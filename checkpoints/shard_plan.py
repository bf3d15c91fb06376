"""Each expected shard as byte ranges of the checkpoint's files, without reading them.

The same shards checkpoints.shards cuts with torch (same tensors, rows, columns, padding,
scale casts, order; tests/test_shard_plan.py holds every plan's bytes to its tensor), said
as ``Piece``s: runs of bytes at file offsets, each followed by zeros. A shard is then read
and hashed where it lies (checkpoints.shard_hash): a contiguous piece (gate and up rows, a
whole tensor) is hashed in place, a column cut (w2, its block scale) is gathered into a
small buffer. Only what is exact as bytes is planned: a layout with post-load transforms
(they compute), or a scale held from a dtype other than F32, BF16 or F16, has no plan
(``plan_expert`` returns None) and is cut by checkpoints.shards instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from moetrace.checkpoints.quant_config import held_scale_names
from moetrace.checkpoints.reader import Checkpoint
from moetrace.checkpoints.safetensors_file import DTYPE_BYTES, SCHEMA_DTYPES, TensorInfo
from moetrace.checkpoints.shard_cuts import Parallel, ShardCut, scale_blocks, shard_cut, tensor_names
from moetrace.checkpoints.spec import expert_tensor_name, fused_tensor_name

CASTS = ("BF16", "F16")  # scale dtypes held as float32 by an exact cast (F32: as stored)


@dataclass(frozen=True)
class Piece:
    """`rows` runs of `width` bytes, `stride` apart, from byte `offset` of `file`, each
    followed by `pad` zero bytes. `cast`: the runs hold this dtype and the shard holds
    them as float32 (4 bytes per element; `pad` counts bytes of the result). A piece
    with no file is `pad` zero bytes."""

    file: Path | None
    offset: int
    rows: int
    width: int
    stride: int
    pad: int = 0
    cast: str | None = None

    @property
    def row_out(self) -> int:
        """Bytes of the shard per run: the run (cast) and its zeros."""
        width = self.width if self.cast is None else self.width // DTYPE_BYTES[self.cast] * 4
        return width + self.pad

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_out

    @property
    def contiguous(self) -> bool:
        """One run of file bytes as they are: hashed in place."""
        return self.file is not None and self.cast is None and self.pad == 0 and (
            self.rows == 1 or self.width == self.stride)


@dataclass(frozen=True)
class ShardPlan:
    """One expert's tensor on a rank: its dtype (schema spelling), per-expert shape and bytes."""

    tensor: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


class _Unplanned(Exception):
    """Not exact as bytes: checkpoints.shards cuts it."""


@dataclass(frozen=True)
class _Region:
    """A 2-D view [rows, cols] of a tensor (a fused tensor's one expert), its item size."""

    info: TensorInfo
    base: int  # file offset of element [0, 0]
    rows: int
    cols: int
    item: int

    def cut(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None, pad_rows: int = 0,
            pad_cols: int = 0, cast: str | None = None) -> tuple[list[Piece], tuple[int, int]]:
        """Rows [a, b) and columns [c0, c1), zero-extended by pad_rows and pad_cols (in
        elements of the result), as pieces, and the result's 2-D shape."""
        a, b = rows or (0, self.rows)
        c0, c1 = cols or (0, self.cols)
        out_item = 4 if cast else self.item
        row_bytes = self.cols * self.item
        if c0 == 0 and c1 == self.cols and pad_cols == 0:
            pieces = [Piece(self.info.file, self.base + a * row_bytes, 1, (b - a) * row_bytes, (b - a) * row_bytes,
                            pad_rows * self.cols * out_item, cast)]
        else:
            pieces = [Piece(self.info.file, self.base + a * row_bytes + c0 * self.item, b - a, (c1 - c0) * self.item,
                            row_bytes, pad_cols * out_item, cast)]
            if pad_rows:
                pieces.append(Piece(None, 0, 1, 0, 0, pad_rows * (c1 - c0 + pad_cols) * out_item))
        return pieces, (b - a + pad_rows, c1 - c0 + pad_cols)


def _region(ckpt: Checkpoint, name: str, expert_index: int | None = None) -> _Region:
    """The tensor `name` (header checked against the spec) as 2-D: [rows, last dim]; a
    fused [E, R, C] tensor's expert `expert_index` as [R, C]; a 1-D or 0-D one as a column."""
    t = ckpt.check(name)
    item = DTYPE_BYTES[t.dtype]
    base = t.data_start + t.offsets[0]
    shape = t.shape
    if expert_index is not None:
        if len(shape) != 3:
            raise _Unplanned(name)
        base += expert_index * shape[1] * shape[2] * item
        shape = shape[1:]
    if len(shape) <= 1:
        return _Region(t, base, math.prod(shape), 1, item)
    if len(shape) != 2:
        raise _Unplanned(name)
    return _Region(t, base, shape[0], shape[1], item)


def _held_cast(region: _Region) -> str | None:
    """A scale is held as float32: None when stored so, else the exact cast's source."""
    dtype = region.info.dtype
    if dtype == "F32":
        return None
    if dtype in CASTS:
        return dtype
    raise _Unplanned(region.info.name)


def _weight_dtype(region: _Region) -> str:
    name = SCHEMA_DTYPES.get(region.info.dtype)
    if name is None:
        raise _Unplanned(region.info.name)
    return name


def _stacked(tensor: str, dtype: str, parts: list[tuple[list[Piece], tuple[int, int]]]) -> ShardPlan:
    """Parts stacked along dim 0 (w13: first half, then second)."""
    cols = parts[0][1][1]
    pieces = tuple(p for part, _ in parts for p in part)
    return ShardPlan(tensor, dtype, (sum(shape[0] for _, shape in parts), cols), pieces)


def _unfused(ckpt: Checkpoint, layer: int, expert: int, c: ShardCut) -> dict[str, ShardPlan]:
    """Per-expert tensors (checkpoints.shards._expert_parts)."""
    spec = ckpt.spec
    name = lambda proj, kind="weight": expert_tensor_name(spec, layer, expert, proj, kind)  # noqa: E731
    halves = (c.first, c.second)
    short = c.size - (c.r1 - c.r0)  # rows of zeros the runner's padding adds (0: unpadded)
    w13 = [_region(ckpt, name(p)) for p in halves]
    down = _region(ckpt, name("down"))
    out = {"w13_weight": _stacked("w13_weight", _weight_dtype(w13[0]),
                                  [r.cut(rows=(c.r0, c.r1), pad_rows=short) for r in w13]),
           "w2_weight": _stacked("w2_weight", _weight_dtype(down), [down.cut(cols=(c.r0, c.r1), pad_cols=short)])}
    scales = held_scale_names(spec.fmt, spec.quant_method)
    I = spec.intermediate_size
    if spec.fmt == "fp8_block":
        bn, bk = spec.block
        (s0, s1), n_rows = scale_blocks(c.r0, c.size, bn, -(-I // bn))
        (k0, k1), n_cols = scale_blocks(c.r0, c.size, bk, -(-I // bk))
        w13s = [_region(ckpt, name(p, "scale")) for p in halves]
        downs = _region(ckpt, name("down", "scale"))
        out[scales[0]] = _stacked(scales[0], "float32", [r.cut(rows=(s0, s1), pad_rows=n_rows - (s1 - s0),
                                                               cast=_held_cast(r)) for r in w13s])
        out[scales[1]] = _stacked(scales[1], "float32", [downs.cut(cols=(k0, k1), pad_cols=n_cols - (k1 - k0),
                                                                   cast=_held_cast(downs))])
    elif spec.fmt == "fp8_channel":  # [out] or [out, 1] -> [out, 1]; w2 keeps every output channel
        w13s = [_region(ckpt, name(p, "scale")) for p in halves]
        downs = _region(ckpt, name("down", "scale"))
        if any(r.cols != 1 for r in (*w13s, downs)):
            raise _Unplanned(name("down", "scale"))
        out[scales[0]] = _stacked(scales[0], "float32", [r.cut(rows=(c.r0, c.r1), pad_rows=short,
                                                               cast=_held_cast(r)) for r in w13s])
        out[scales[1]] = _stacked(scales[1], "float32", [downs.cut(cast=_held_cast(downs))])
    elif spec.fmt == "fp8_tensor":  # one scale each: [gate, up] and the down scale, 0-D
        regions = [_region(ckpt, name(p, "scale")) for p in (*halves, "down")]
        if any(r.rows * r.cols != 1 for r in regions):
            raise _Unplanned(name("down", "scale"))
        pieces = [r.cut(cast=_held_cast(r))[0] for r in regions]
        out[scales[0]] = ShardPlan(scales[0], "float32", (2,), tuple(pieces[0] + pieces[1]))
        out[scales[1]] = ShardPlan(scales[1], "float32", (), tuple(pieces[2]))
    return out


def _fused(ckpt: Checkpoint, layer: int, expert: int, c: ShardCut) -> dict[str, ShardPlan]:
    """One expert of fused 3-D tensors (checkpoints.shards._experts_fused): gate_up_proj
    [E, 2I, H] with gate rows first, down_proj [E, H, I], and their FP8 block scales."""
    spec = ckpt.spec
    I = spec.intermediate_size
    short = c.size - (c.r1 - c.r0)
    gate_up = _region(ckpt, fused_tensor_name(spec, layer, "gate_up"), expert)
    down = _region(ckpt, fused_tensor_name(spec, layer, "down"), expert)
    offset = {"gate": 0, "up": I}
    out = {"w13_weight": _stacked("w13_weight", _weight_dtype(gate_up), [
               gate_up.cut(rows=(offset[p] + c.r0, offset[p] + c.r1), pad_rows=short) for p in (c.first, c.second)]),
           "w2_weight": _stacked("w2_weight", _weight_dtype(down), [down.cut(cols=(c.r0, c.r1), pad_cols=short)])}
    if spec.fmt == "fp8_block":
        w13_scale, w2_scale = held_scale_names(spec.fmt, spec.quant_method)
        bn, bk = spec.block
        (s0, s1), n_rows = scale_blocks(c.r0, c.size, bn, -(-I // bn))
        (k0, k1), n_cols = scale_blocks(c.r0, c.size, bk, -(-I // bk))
        block_offset = {"gate": 0, "up": -(-I // bn)}
        scales = _region(ckpt, fused_tensor_name(spec, layer, "gate_up", "scale"), expert)
        downs = _region(ckpt, fused_tensor_name(spec, layer, "down", "scale"), expert)
        out[w13_scale] = _stacked(w13_scale, "float32", [
            scales.cut(rows=(block_offset[p] + s0, block_offset[p] + s1), pad_rows=n_rows - (s1 - s0),
                       cast=_held_cast(scales)) for p in (c.first, c.second)])
        out[w2_scale] = _stacked(w2_scale, "float32", [downs.cut(cols=(k0, k1), pad_cols=n_cols - (k1 - k0),
                                                                 cast=_held_cast(downs))])
    elif spec.fmt != "bf16":
        raise _Unplanned(fused_tensor_name(spec, layer, "gate_up"))
    return out


def plan_expert(ckpt: Checkpoint, layer: int, expert: int, moe_tp_rank: int, par: Parallel
                ) -> dict[str, ShardPlan] | None:
    """One expert's shards on a rank of this moe_tp_rank, keyed by FusedMoE parameter in
    copy order; None when they are not plain bytes of the files (see the module's doc).
    Bad options and headers fail as checkpoints.shards fails."""
    c = shard_cut(ckpt, layer, moe_tp_rank, par)
    spec = ckpt.spec
    if par.layout.transforms or spec.fmt == "int4":  # INT4 is held transposed: computed, not bytes of the files
        return None
    try:
        held = _fused(ckpt, layer, expert, c) if spec.fused_experts and expert < spec.num_experts else \
            _unfused(ckpt, layer, expert, c)
    except _Unplanned:
        return None
    return {k: held[k] for k in tensor_names(spec)}
