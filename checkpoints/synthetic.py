"""Small checkpoints with real names, dtypes and layouts, whose every expert
element is a known function of where it sits.

`synthetic_values(layer, expert, proj, rows, cols, kind)` gives the stored value
of any element from its GLOBAL (unsharded) coordinates, so a test can build the
shard a rank must hold without going through shards.py, and a wrong tensor can
be recognized by recomputing candidates (expert E+2, another layer, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moetrace import outputs
from moetrace.checkpoints.quant_config import QUANT_METHODS, scale_suffix
from moetrace.checkpoints.spec import FAMILIES, FORMATS, FUSED_NOT_MAPPED, INT4_PACK, SHARED_EXPERT_MODULES
from moetrace.checkpoints.synthetic_config import synthetic_config
from moetrace.checkpoints.synthetic_model import VISION, ModelTensors, shared_intermediate
from moetrace.checkpoints.tokenizer import write_tokenizer
from moetrace.errors import MoetraceError

PROJ_NAMES = ("gate", "up", "down")  # proj ids 0, 1, 2
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_M32 = 0xFFFFFFFF

# The 252 e4m3fn bytes that are finite and nonzero: 0x7F/0xFF are NaN, and the
# two zeros are left out so a zero-filled (never-copied) tensor never matches.
_FP8_BYTES = torch.tensor([b for b in range(256) if b not in (0x00, 0x7F, 0x80, 0xFF)], dtype=torch.uint8)
_KIND = {"weight": 1, "scale": 2}
DRAFT_VALUE_LAYER = 1 << 16  # the value-layer of the draft's (mtp.*) experts: never a target layer
INT4_GROUP_SIZES = (32, 128)  # what make-checkpoint writes (Kimi-K2's 32, llm-compressor's default 128)
_INT4_CYCLE = 511  # int4 words carry the expert in their low 9 bits, never all zero


def _mix(x: torch.Tensor | int):
    """32-bit integer finalizer (xor-shift-multiply). Inputs and products stay
    below 2^63, so int64 tensor arithmetic is exact on every backend."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def synthetic_values(
    layer: int,
    expert: int,
    proj: int,
    rows: torch.Tensor,
    cols: torch.Tensor,
    kind: str = "weight",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Stored value of each element (rows, cols broadcast against each other).

    proj: 0 gate, 1 up, 2 down. rows/cols: global coordinates in the full
    per-expert tensor (for block scales: block indices; for per-channel scales
    cols is 0; for int4 words: cols counts words of 8 int4 values). kind "weight" (dtype
    float8_e4m3fn, the default, bfloat16, or int32: int4 weight_packed words) or "scale"
    (dtype float32, the default, bfloat16 or float16).

    Guarantees: fp8 weights are finite, nonzero e4m3fn bytes; scales are positive
    and exact in every scale dtype. At every element, two experts in the same
    group of CYCLE ids (e // CYCLE equal; CYCLE = 252 for fp8 weights, 511 for int4
    words, 512 otherwise) hold different values (int4 words: in their low 9 bits,
    which are never all zero; the other 23 bits are the position's), so E+1, E+2 are always visible; gate, up
    and down scales of one expert differ at every element. Other pairs (another
    group, layer or seed) differ at about 99% of elements.
    """
    if kind not in _KIND or proj not in (0, 1, 2):
        raise ValueError(f"kind must be weight|scale and proj 0|1|2, got {kind!r}, {proj!r}")
    dtype = dtype or (torch.float8_e4m3fn if kind == "weight" else torch.float32)
    rows, cols = torch.broadcast_tensors(torch.as_tensor(rows, dtype=torch.int64),
                                         torch.as_tensor(cols, dtype=torch.int64))
    fp8 = kind == "weight" and dtype == torch.float8_e4m3fn
    int4 = kind == "weight" and dtype == torch.int32
    cycle = len(_FP8_BYTES) if fp8 else _INT4_CYCLE if int4 else 512
    # The expert enters the hash only by its group; inside a group it is added
    # to the hash modulo the cycle, which makes any two differ at every element.
    base = _mix(_mix(_mix(_mix(seed + 0x1000) + layer) + 7 * proj + _KIND[kind]) + expert // cycle)
    g = _mix(_mix(base + rows * 0x9E3779B1) + cols * 0x85EBCA6B)
    c = (g + expert) % cycle
    if fp8:
        return _FP8_BYTES[c].view(torch.float8_e4m3fn)
    if int4:
        word = (g & 0xFFFFFE00) | (c + 1)
        return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    # value = (1 + m/128) * 2^-x with c = (m, q) -> distinct values for distinct c:
    # 8 significant bits, exact in bf16, f16 and f32.
    m, q = (c % 128).to(torch.float32), c // 128
    if kind == "weight":
        if dtype != torch.bfloat16:
            raise ValueError(f"weights are float8_e4m3fn, bfloat16 or int32 (int4 words), got {dtype}")
        x = 1 + q + 4 * ((g >> 9) & 1)  # 1..8
        sign = 1.0 - 2.0 * ((g >> 12) & 1).to(torch.float32)
        return (sign * (1.0 + m / 128.0) * torch.pow(2.0, -x.to(torch.float32))).to(dtype)
    if dtype not in SCALE_DTYPES.values():
        raise ValueError(f"scales are float32, bfloat16 or float16, got {dtype}")
    # x = 2 + proj + 3q in 2..13: proj fixes x mod 3 (gate/up/down always differ),
    # and 2^-13 is still a normal float16.
    x = 2 + proj + 3 * q
    return ((1.0 + m / 128.0) * torch.pow(2.0, -x.to(torch.float32))).to(dtype)


def _grid(n_rows: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n_rows).view(-1, 1), torch.arange(n_cols).view(1, -1)


def _scale_shape(fmt: str, quant_method: str, out_dim: int, in_dim: int, block: tuple[int, int]) -> tuple[int, ...]:
    if fmt == "fp8_block":
        return (-(-out_dim // block[0]), -(-in_dim // block[1]))
    if fmt == "fp8_channel":
        return (out_dim, 1)
    return (1,) if quant_method == "compressed-tensors" else ()  # per tensor


def parse_block(text: str) -> int | tuple[int, int]:
    """make-checkpoint's --block: N (N x N) or N,K (block_n over output rows, block_k over
    input columns); their sizes are checked with the other arguments."""
    try:
        sizes = tuple(int(b) for b in str(text).split(","))
    except ValueError:
        sizes = ()
    if len(sizes) not in (1, 2):
        raise MoetraceError(f"--block {text!r}: expected N or N,K (positive integers)")
    return sizes if len(sizes) == 2 else sizes[0]


def check_fits_in_memory(moe_layers: int, experts: int, hidden: int, intermediate: int, itemsize: int) -> None:
    """Every tensor is held in memory before writing: refuse sizes past half of the
    machine's memory, in one line, before allocating any."""
    need = max(moe_layers, 1) * (experts + 1) * 3 * hidden * intermediate * itemsize
    try:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    if need > available // 2:
        raise MoetraceError(f"make-checkpoint: --layers/--experts/--hidden/--intermediate need about "
                            f"{need / 2**30:,.1f} GiB of expert weights in memory, more than half of this "
                            f"machine's {available / 2**30:,.1f} GiB; give smaller sizes")


def _check_arguments(family, fmt, quant_method, block, scale_dtype, fused, sizes, dense_layers,
                     shared_expert=False, draft=False, group_size=None):
    """The writer's options, checked (one-line errors naming the option); returns the
    resolved (quant_method, (block_n, block_k))."""
    num_layers = sizes[0]
    quant_method = quant_method or (None if fmt == "bf16" else "compressed-tensors" if fmt in ("fp8_channel", "int4")
                                    else "fp8")
    gs = group_size or 1
    block = (block, block) if isinstance(block, int) else tuple(block)
    checks = [
        (fmt == "bf16" or quant_method in QUANT_METHODS,
         f"--quant-method must be one of {', '.join(QUANT_METHODS)}, got {quant_method!r}"),
        (not (fmt == "fp8_channel" and quant_method == "fp8"),
         "--format fp8_channel needs --quant-method compressed-tensors: fp8 without weight_block_size means "
         "per-tensor scales (use --format fp8_tensor)"),
        (fmt != "bf16" or quant_method is None, f"--quant-method {quant_method} needs an FP8 --format"),
        (family in FAMILIES, f"--family must be one of {', '.join(FAMILIES)}, got {family!r}"),
        (fmt in FORMATS, f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}"),
        (scale_dtype in SCALE_DTYPES, f"--scale-dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}"),
        (min(*sizes, *block) >= 1,
         "--layers, --experts, --hidden, --intermediate, --files and block must be >= 1"),
        (0 <= dense_layers < num_layers,
         f"--dense-layers {dense_layers} must be in [0, --layers {num_layers}) so at least one layer is MoE"),
        (not fused or fmt == "bf16", f"--fused writes the BF16 3-D layout; it needs --format bf16, got {fmt}"),
        (not fused or family not in FUSED_NOT_MAPPED, f"--fused for {family}: {FUSED_NOT_MAPPED.get(family)}"),
        (not draft or family == "qwen3_5_moe", f"a draft model (mtp.*) is written for qwen3_5_moe only, got {family}"),
        (not shared_expert or family != "qwen3_moe", "qwen3_moe has no shared expert"),
        (fmt != "int4" or quant_method == "compressed-tensors",
         "--format int4 is compressed-tensors pack-quantized: it needs --quant-method compressed-tensors"),
        (fmt == "int4" or group_size is None, f"--group-size goes with --format int4, got --format {fmt}"),
        (fmt != "int4" or group_size in INT4_GROUP_SIZES,
         f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} for --format int4, got {group_size}"),
        (fmt != "int4" or (sizes[2] % gs == 0 and sizes[3] % gs == 0),
         f"--hidden {sizes[2]} and --intermediate {sizes[3]} must be multiples of --group-size {gs} for --format int4"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise MoetraceError(message)
    return quant_method, block


def write_synthetic_checkpoint(
    out_dir: str | Path,
    family: str = "qwen3_5_moe",
    fmt: str = "fp8_block",
    num_layers: int = 2,
    num_experts: int = 8,
    hidden: int = 256,
    intermediate: int = 256,
    scale_dtype: str = "bfloat16",
    num_files: int = 2,
    dense_layers: int = 0,
    block: int | tuple[int, int] = 128,
    seed: int = 0,
    fused: bool = False,
    quant_method: str | None = None,
    shared_expert: bool = False,
    draft: bool = False,
    group_size: int | None = None,
) -> Path:
    """Write a complete model folder (config.json, safetensors, tokenizer) and return its path.

    fmt: fp8_block, fp8_channel, fp8_tensor, bf16 or int4; quant_method: "fp8" or
    "compressed-tensors" (default: compressed-tensors for fp8_channel, which is how
    per-channel FP8 ships, and for int4, else fp8); block: block_n = block_k, or
    (block_n, block_k). int4 writes compressed-tensors W4A16 pack-quantized experts as
    llm-compressor does (``weight_packed`` int32 [out, in/8], ``weight_scale`` in
    --scale-dtype [out, in/group_size], ``weight_shape`` int64 [out, in]); group_size
    32 or 128 (int4 only).
    Layers [0, dense_layers) are dense (first_k_dense_replace for DeepSeek,
    mlp_only_layers for Qwen). fused=True writes the 3-D BF16 expert layout
    (mlp.experts.gate_up_proj / down_proj) instead of per-expert tensors; its
    values equal the per-expert ones. Tensors are dealt to files round-robin in
    write order, skipping a file every 5 tensors, so with num_files > 1 some
    weights share a file with their scale and some do not. The rest of the model (attention,
    norms, embeddings, router, dense MLPs, the shared expert, Qwen3.5's vision tower) is
    BF16 with the names and shapes its model class loads (checkpoints.synthetic_model),
    left unquantized by the quantization_config; a few expert-looking tensors that no
    model class loads (Qwen3.5 mtp.* and model.visual.*, DeepSeek's MTP layer) are decoys.
    The shared expert is BF16 and sized so it is never taken for a routed expert
    (synthetic_model.shared_intermediate), except that shared_expert=True writes each MoE
    layer's shared expert (DeepSeek mlp.shared_experts, Qwen mlp.shared_expert) shaped
    like a routed expert in the experts' format, with the values of expert id
    num_experts (the id SGLang's loader fuses it as); draft=True (Qwen3.5) writes the
    MTP draft's experts ``mtp.layers.0.mlp.experts.*`` in the target's format, with the
    values of layer ``DRAFT_VALUE_LAYER`` so they differ from every target layer.
    """
    from safetensors.torch import save_file  # writer-only dependency path

    quant_method, block = _check_arguments(family, fmt, quant_method, block, scale_dtype, fused,
                                           (num_layers, num_experts, hidden, intermediate, num_files), dense_layers,
                                           shared_expert, draft, group_size)
    out = Path(out_dir)
    outputs.check_output(str(out), "-o", kind="dir")
    if out.exists() and any(out.iterdir()):
        raise MoetraceError(f"-o {out}: output path exists and is not an empty directory")

    w = _Tensors(fmt, quant_method, block, hidden, intermediate, SCALE_DTYPES[scale_dtype], seed, group_size)
    m = ModelTensors(family, w.tensors, hidden, intermediate, w.g)
    prefix = "model.language_model" if family == "qwen3_5_moe" else "model"
    m.embeddings(prefix)
    for L in range(num_layers):
        pre = f"{prefix}.layers.{L}"
        m.layer_attention(pre, L, num_layers)
        _write_mlp(w, m, pre, L, num_experts, L < dense_layers, fused, shared_expert)
    m.head(prefix)
    if family == "qwen3_5_moe":
        m.vision_tower()
    _write_not_routed(w, family, num_layers, num_experts, draft)

    cfg = synthetic_config(family, fmt, num_layers, num_experts, hidden, intermediate, dense_layers,
                           None if fmt == "bf16" else (quant_method, block), seed, shared_expert,
                           group_size=group_size)
    with outputs.new_local_dir(str(out), "-o") as tmp:  # whole or nothing: never a folder with only config.json
        _write_files(Path(tmp), cfg, w.tensors, num_files, save_file)
        write_tokenizer(tmp, VISION if family == "qwen3_5_moe" else None)
    return out


class _Tensors:
    """The checkpoint's tensors in write order (file assignment and filler values follow it)."""

    def __init__(self, fmt: str, quant_method: str | None, block, hidden: int, intermediate: int, sdt, seed: int,
                 group_size: int | None = None):
        self.fmt, self.quant_method, self.block, self.H, self.I, self.sdt, self.seed = (
            fmt, quant_method, block, hidden, intermediate, sdt, seed)
        self.group_size = group_size
        self.wdt = {"bf16": torch.bfloat16, "int4": torch.int32}.get(fmt, torch.float8_e4m3fn)
        self.g = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def filler(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(torch.bfloat16)

    def expert_weight(self, L: int, e: int, p: int) -> torch.Tensor:
        return synthetic_values(L, e, p, *_grid(*self._dims(p)), "weight", self.wdt, self.seed)

    def int4_expert(self, name: str, L: int, e: int) -> None:
        """compressed-tensors pack-quantized: weight_packed words, group scales, weight_shape."""
        for p, proj in enumerate(PROJ_NAMES):
            out, inp = self._dims(p)
            self.tensors[f"{name}.{proj}_proj.weight_packed"] = synthetic_values(
                L, e, p, *_grid(out, inp // INT4_PACK), "weight", torch.int32, self.seed)
            self.tensors[f"{name}.{proj}_proj.weight_scale"] = synthetic_values(
                L, e, p, *_grid(out, inp // self.group_size), "scale", self.sdt, self.seed)
            self.tensors[f"{name}.{proj}_proj.weight_shape"] = torch.tensor([out, inp], dtype=torch.int64)

    def expert(self, name: str, L: int, e: int) -> None:
        """`name`.{gate,up,down}_proj weights and scales: expert e of value-layer L."""
        if self.fmt == "int4":
            return self.int4_expert(name, L, e)
        for p, proj in enumerate(PROJ_NAMES):
            self.tensors[f"{name}.{proj}_proj.weight"] = self.expert_weight(L, e, p)
            if self.fmt != "bf16":
                shape = _scale_shape(self.fmt, self.quant_method, *self._dims(p), self.block)
                grid = _grid(*shape) if len(shape) == 2 else (torch.zeros(shape, dtype=torch.int64),) * 2
                scale = f"{name}.{proj}_proj.{scale_suffix(self.fmt, self.quant_method)}"
                self.tensors[scale] = synthetic_values(L, e, p, *grid, "scale", self.sdt, self.seed)

    def _dims(self, p: int) -> tuple[int, int]:  # (out, in) of projection p
        return (self.H, self.I) if p == 2 else (self.I, self.H)


def _write_mlp(w: _Tensors, m: ModelTensors, pre: str, L: int, E: int, dense: bool, fused: bool,
               shared_expert: bool) -> None:
    """Layer L's MLP: a dense one, or the router, the routed experts and the shared expert."""
    if dense:
        m.mlp(f"{pre}.mlp", w.I)
        return
    m.router(pre, E)
    if fused:
        w.tensors[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w.expert_weight(L, e, 0), w.expert_weight(L, e, 1)]) for e in range(E)])
        w.tensors[f"{pre}.mlp.experts.down_proj"] = torch.stack([w.expert_weight(L, e, 2) for e in range(E)])
    else:
        for e in range(E):
            w.expert(f"{pre}.mlp.experts.{e}", L, e)
    shared = SHARED_EXPERT_MODULES.get(m.family)
    if shared is None:
        return
    if shared_expert:  # the values of expert id E, the slot SGLang fuses it into
        w.expert(f"{pre}.mlp.{shared}", L, E)
    else:
        m.mlp(f"{pre}.mlp.{shared}", shared_intermediate(m.family, w.fmt, w.I, shared_expert))


def _write_not_routed(w: _Tensors, family: str, num_layers: int, E: int, draft: bool) -> None:
    """Expert-looking tensors that are not routed decoder experts; their shapes are
    deliberately wrong, so reading one by mistake fails loudly (the draft's experts aside).
    The model classes skip them: SGLang's and transformers' load them into nothing."""
    H = w.H
    if family == "deepseek_v3":  # MTP layer, stored as layer num_hidden_layers
        w.tensors[f"model.layers.{num_layers}.mlp.experts.0.gate_proj.weight"] = w.filler(8, H)
        w.tensors[f"model.layers.{num_layers}.eh_proj.weight"] = w.filler(H, 2 * H)
    if family != "qwen3_5_moe":
        return
    if draft:
        for e in range(E):
            w.expert(f"mtp.layers.0.mlp.experts.{e}", DRAFT_VALUE_LAYER, e)
    else:
        w.tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = w.filler(8, H)
    w.tensors["mtp.fc.weight"] = w.filler(H, 2 * H)
    w.tensors["model.visual.blocks.0.mlp.experts.0.gate_proj.weight"] = w.filler(8, 8)


def _write_files(out: Path, cfg: dict, tensors: dict[str, torch.Tensor], num_files: int, save_file) -> None:
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if num_files == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        outputs.plain_mode(str(out / "model.safetensors"))  # save_file makes 0600
        return
    files = [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    weight_map = {name: files[(i + i // 5) % num_files] for i, name in enumerate(tensors)}
    empty = len(files) - len(set(weight_map.values()))
    if empty:  # a file no tensor is listed in: no server would load it
        raise MoetraceError(f"--files {num_files}: the checkpoint's {len(tensors)} tensors would leave {empty} "
                            "file(s) empty; give fewer files")
    for fname in files:
        part = {n: t for n, t in tensors.items() if weight_map[n] == fname}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        outputs.plain_mode(str(out / fname))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
