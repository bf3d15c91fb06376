"""What a checkpoint's MoE experts look like, from config.json (and checked against
the tensor names it ships): family, prefix, which layers are MoE, sizes, format.

Everything downstream (reader validation, TP/EP shard math, the expected index)
reads this one frozen record instead of re-parsing the config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from moetrace.checkpoints.model_config import ALIASES, MODEL_TYPES, decoder_json, read_decoder_config
from moetrace.checkpoints.quant_config import quant_format, scale_suffix, weight_suffix
from moetrace.errors import MoetraceError
from moetrace.schema import MAX_ID, format_ids

# architectures[0] -> (family, tensor-name prefix of the decoder layers)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("qwen3_moe", "model"),
    "Qwen3NextForCausalLM": ("qwen3_next", "model"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "model.language_model"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "model"),  # Qwen3.5's text-only model (sglang models/qwen3_5_text.py)
    "DeepseekV3ForCausalLM": ("deepseek_v3", "model"),
}
FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3")
FORMATS = ("fp8_block", "fp8_channel", "fp8_tensor", "bf16", "int4")
INT4_PACK = 8  # int4 values per int32 word of weight_packed, along the input dimension
PROJS = ("gate", "up", "down")
# Tensor-name prefixes that look like experts but are not routed decoder experts:
# Qwen3.5's multi-token-prediction head and vision tower.
IGNORED_PREFIXES = ("mtp.", "model.visual.")
SCALE_DTYPES = ("F32", "BF16", "F16")  # the header dtypes a scale may be stored in


@dataclass(frozen=True)
class MoESpec:
    arch: str  # config architectures[0]
    family: str  # one of FAMILIES
    prefix: str  # "model" or "model.language_model"
    num_layers: int  # num_hidden_layers (DeepSeek's MTP layer at index num_layers is not counted)
    moe_layers: tuple[int, ...]  # decoder layers whose mlp is a routed-expert FusedMoE
    num_experts: int  # routed experts per MoE layer (global)
    hidden_size: int
    intermediate_size: int  # moe_intermediate_size (per expert, before TP)
    fmt: str  # one of FORMATS
    block: tuple[int, int] | None  # weight_block_size (block_n over out rows, block_k over in cols)
    fused_experts: bool = False  # 3-D mlp.experts.gate_up_proj / down_proj tensors
    scale_dtype: str | None = None  # torch dtype name of the stored scales ("bfloat16", ...)
    quant_method: str | None = None  # "fp8" | "compressed-tensors" | None (bf16): see quant_config
    # Shared experts shaped like a routed one (checkpoints.extra): SGLang can fuse them
    # into the FusedMoE's last slot(s) as expert ids num_experts + j.
    shared_experts: int = 0
    group_size: int | None = None  # int4: input columns per scale (compressed-tensors group_size)

    @property
    def scale_suffix(self) -> str | None:
        """Tensor-name suffix of the FP8 scale (fp8 block: weight_scale_inv; else weight_scale)."""
        return scale_suffix(self.fmt, self.quant_method)


# Fused 3-D expert tensors (mlp.experts.gate_up_proj [E, 2I, H], gate rows first, and
# mlp.experts.down_proj [E, H, I]) as each family's SGLang model class maps them onto
# w13_*/w2_* (sglang 0.5.23): the suffix of the FP8 block scales it maps (onto
# w13/w2_weight_scale_inv), or why it maps no fused names at all.
FUSED_SCALE_SUFFIX = {
    "qwen3_5_moe": "_scale_inv",  # models/qwen3_5.py: experts.gate_up_proj* split with chunk(2, dim=-2)
    "deepseek_v3": "_scale",  # deepseek_common/deepseek_weight_loader.py: _load_fused_expert_tensor
}
FUSED_NOT_MAPPED = {
    "qwen3_moe": "SGLang's models/qwen3_moe.py maps per-expert names only and skips fused ones: the server would "
                 "hold no expert weights",
    "qwen3_next": "SGLang's models/qwen3_next.py maps per-expert names only; a fused name fails its load",
}

SHARED_EXPERT_MODULES = {"deepseek_v3": "shared_experts", "qwen3_next": "shared_expert", "qwen3_5_moe": "shared_expert"}


def expert_tensor_name(spec: MoESpec, layer: int, expert: int, proj: str, kind: str = "weight") -> str:
    """Checkpoint name of one per-expert tensor; proj in PROJS, kind "weight"|"scale"
    (int4: "weight" is the packed words, ``weight_packed``; "shape" its ``weight_shape``).
    Expert ids from num_experts on are the shared expert(s), as SGLang's loader fuses
    them (``mlp.shared_experts`` -> ``mlp.experts.{n_routed_experts}``)."""
    suffix = {"weight": weight_suffix(spec.fmt), "shape": "weight_shape"}.get(kind, spec.scale_suffix)
    if suffix is None:
        raise MoetraceError(f"{spec.fmt} checkpoints have no scale tensors")
    if expert >= spec.num_experts:
        shared = SHARED_EXPERT_MODULES.get(spec.family)
        if shared is None or expert >= spec.num_experts + max(spec.shared_experts, 1):
            raise MoetraceError(f"expert {expert}: {spec.arch} has {spec.num_experts} routed experts "
                                f"and {spec.shared_experts} fusable shared expert(s)")
        return f"{spec.prefix}.layers.{layer}.mlp.{shared}.{proj}_proj.{suffix}"
    return f"{spec.prefix}.layers.{layer}.mlp.experts.{expert}.{proj}_proj.{suffix}"


def fused_tensor_name(spec: MoESpec, layer: int, which: str, kind: str = "weight") -> str:
    """Checkpoint name of a fused 3-D expert tensor; which in ("gate_up", "down"),
    kind "weight" | "scale" (FP8 block scales, named as the family's loader maps them)."""
    name = f"{spec.prefix}.layers.{layer}.mlp.experts.{which}_proj"
    return name if kind == "weight" else name + FUSED_SCALE_SUFFIX[spec.family]


def is_ignored(name: str) -> bool:
    return name.startswith(IGNORED_PREFIXES)


def _get(cfg: Mapping, key: str, where: str, default=...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is not ...:
        return default
    raise MoetraceError(f"{where}: missing key '{key}'")


def _int(cfg: Mapping, key: str, where: str, default=...) -> int:
    value = _get(cfg, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MoetraceError(f"{where}: '{key}' must be a non-negative integer, found {value!r}")
    return value


def moe_layers_from_config(family: str, text: Mapping, where: str) -> tuple[int, ...]:
    """MoE layer ids exactly as the modeling code decides them."""
    n = _int(text, "num_hidden_layers", where)
    if family == "deepseek_v3":
        # DeepSeek: dense for the first first_k_dense_replace layers, then every
        # moe_layer_freq-th layer is routed.
        first = _int(text, "first_k_dense_replace", where, 0)
        freq = _int(text, "moe_layer_freq", where, 1) or 1
        return tuple(layer for layer in range(n) if layer >= first and layer % freq == 0)
    # Qwen3-MoE / Qwen3-Next / Qwen3.5: MoE unless listed in mlp_only_layers, and
    # only every decoder_sparse_step-th layer (both default to "all layers").
    mlp_only = _get(text, "mlp_only_layers", where, [])
    if not isinstance(mlp_only, list) or not all(isinstance(x, int) for x in mlp_only):
        raise MoetraceError(f"{where}: 'mlp_only_layers' must be a list of layer ids, found {mlp_only!r}")
    step = _int(text, "decoder_sparse_step", where, 1) or 1
    return tuple(layer for layer in range(n) if layer not in set(mlp_only) and (layer + 1) % step == 0)


_FORMAT_WORDS = {"fp8_block": "block scales", "fp8_channel": "per-channel scales", "fp8_tensor": "per-tensor scales",
                 "int4": "INT4 group scales"}


def _check_sizes_held(prefix: str, sizes: dict[str, int], tensors: Mapping[str, str] | None, where: str,
                      defaulted: set[str] = frozenset()) -> None:
    """Sizes in config.json are checked before anything is sized by them: never above
    schema.MAX_ID, and (given the tensor names) never above what the safetensors files
    hold: a layer count past the last layer with tensors, an expert count past the last
    per-expert tensor (one pass over the names, nothing allocated per config id)."""
    for key, n in sizes.items():
        if n >= MAX_ID:
            raise MoetraceError(f"{where}: '{key}' {n:,} is not a model size moetrace accepts (at most {MAX_ID - 1:,})")
    if tensors is None:
        return
    layer_re = re.compile(rf"^{re.escape(prefix)}\.layers\.(\d+)\.")
    expert_re = re.compile(rf"^{re.escape(prefix)}\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    layers, experts, fused = -1, -1, False
    for name in tensors:
        m = layer_re.match(name)
        if m:
            layers = max(layers, int(m.group(1)))
            e = expert_re.match(name)
            if e:
                experts = max(experts, int(e.group(1)))
            fused = fused or name.endswith(".mlp.experts.gate_up_proj")
    held = {"num_hidden_layers": (layers + 1, "layers"),
            **{k: (experts + 1, "experts") for k in sizes if k != "num_hidden_layers"}}
    for key, n in sizes.items():
        have, what = held[key]
        if what == "experts" and fused:
            continue  # fused 3-D experts: the stacked dimension is checked against the config by shape
        if n > have:
            ids = f"{what} 0-{have - 1}" if have > 0 else f"no {what}"
            default = " (transformers' default: the file does not set it)" if key in defaulted else ""
            raise MoetraceError(f"{where}: '{key}' is {n:,}{default} but the safetensors files hold {ids} only: the "
                                "config and the weights disagree")


_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn"}


def spec_from_config(config: Mapping, path: str | Path, tensors: Mapping[str, str] | None = None) -> MoESpec:
    """Build the MoESpec of config.json at `path` (used only in messages).

    `tensors` maps checkpoint tensor names to their safetensors dtype ("F8_E4M3",
    "BF16", ...). When given, the format the config claims is checked against the
    names and dtypes actually shipped, and fused_experts / scale_dtype are filled in.
    """
    where = str(path)
    if not isinstance(config, Mapping):
        raise MoetraceError(f"{where}: expected a JSON object")
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in ARCHITECTURES:
        raise MoetraceError(
            f"{where}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    family, prefix = ARCHITECTURES[arch]
    raw_text, where_text = decoder_json(config, arch, where)
    # The sizes as SGLang sees them (transformers' attribute maps and defaults).
    text = read_decoder_config(config, arch, where)
    experts_key = "n_routed_experts" if family == "deepseek_v3" else "num_experts"
    num_experts = _int(text, experts_key, where_text)
    if num_experts < 1:
        raise MoetraceError(f"{where_text}: the number of routed experts must be >= 1, found {num_experts}")
    aliases = ALIASES.get(MODEL_TYPES[arch][1], {})
    defaulted = {k for k in ("num_hidden_layers", experts_key) if not any(a in raw_text for a in aliases.get(k, (k,)))}
    _check_sizes_held(prefix, {"num_hidden_layers": _int(text, "num_hidden_layers", where_text),
                               experts_key: num_experts}, tensors, where_text, defaulted)
    q = quant_format(config, raw_text, where)
    spec = MoESpec(
        arch=arch,
        family=family,
        prefix=prefix,
        num_layers=_int(text, "num_hidden_layers", where_text),
        moe_layers=moe_layers_from_config(family, text, where_text),
        num_experts=num_experts,
        hidden_size=_int(text, "hidden_size", where_text),
        intermediate_size=_int(text, "moe_intermediate_size", where_text),
        fmt=q.fmt,
        block=q.block,
        quant_method=q.quant_method,
        group_size=q.group_size,
    )
    if not spec.moe_layers:
        raise MoetraceError(f"{where}: the config declares no MoE layers")
    if spec.fmt == "int4":
        _check_int4(spec, text, where_text)
    if tensors is None:
        return spec
    return verify_against_tensors(spec, tensors, where)


def _check_int4(spec: MoESpec, text: Mapping, where: str) -> None:
    """INT4 packs 8 values per int32 and groups group_size input columns per scale: both
    sizes must hold whole packs and groups, and the scales are held in bfloat16."""
    gs = spec.group_size
    for key, n in (("hidden_size", spec.hidden_size), ("moe_intermediate_size", spec.intermediate_size)):
        if n % INT4_PACK or n % gs:
            raise MoetraceError(f"{where}: '{key}' {n} is not a whole number of int4 packs ({INT4_PACK} values per "
                                f"int32) and of groups (group_size {gs})")
    dtype = text.get("torch_dtype") or text.get("dtype")
    if dtype not in (None, "bfloat16"):
        raise MoetraceError(f"{where}: torch_dtype {dtype!r}: SGLang holds INT4 scales in the model dtype; moetrace "
                            "reproduces bfloat16 models only")


def verify_against_tensors(spec: MoESpec, tensors: Mapping[str, str], where: str) -> MoESpec:
    """The config says what the format should be; the names and dtypes say what it
    is. Disagreement is an error naming both, never a silent guess."""
    layer = spec.moe_layers[0]
    stem = f"{spec.prefix}.layers.{layer}.mlp.experts"
    unfused, fused = f"{stem}.0.gate_proj.{weight_suffix(spec.fmt)}", f"{stem}.gate_up_proj"
    if unfused in tensors:
        is_fused = False
        weight = unfused
    elif fused in tensors:
        is_fused = True
        weight = fused
    else:
        raise MoetraceError(
            f"{where}: {spec.arch} expects expert tensor {unfused} (or fused {fused}) but the checkpoint has neither"
        )
    has_inv = f"{stem}.0.gate_proj.weight_scale_inv" in tensors
    has_scale = f"{stem}.0.gate_proj.weight_scale" in tensors
    if is_fused:
        return _verify_fused(spec, tensors, fused, where)
    if spec.scale_suffix is not None and f"{stem}.0.gate_proj.{spec.scale_suffix}" not in tensors:
        other = "weight_scale" if spec.scale_suffix == "weight_scale_inv" else "weight_scale_inv"
        found = f"; it has {stem}.0.gate_proj.{other}" if (has_scale or has_inv) else ""
        raise MoetraceError(
            f"{where}: quantization_config ({spec.quant_method}, {_FORMAT_WORDS[spec.fmt]}) needs "
            f"{stem}.0.gate_proj.{spec.scale_suffix} but it is missing{found}"
        )
    if spec.fmt == "bf16" and (has_inv or has_scale):
        raise MoetraceError(f"{where}: no quantization_config but the checkpoint has FP8 scales ({stem}.0.gate_proj.*)")
    want = {"int4": "I32"}.get(spec.fmt, "F8_E4M3" if spec.fmt.startswith("fp8") else "BF16")
    if tensors[weight] != want:
        raise MoetraceError(f"{where}: format {spec.fmt} needs {want} expert weights but {weight} is {tensors[weight]}")
    scale_dtype = None
    if spec.scale_suffix is not None:
        scale_name = f"{stem}.0.gate_proj.{spec.scale_suffix}"
        scale_dtype = _DTYPE_NAMES.get(tensors[scale_name], tensors[scale_name])
    return replace(spec, fused_experts=is_fused, scale_dtype=scale_dtype)


def _verify_fused(spec: MoESpec, tensors: Mapping[str, str], fused: str, where: str) -> MoESpec:
    """Fused 3-D experts, where the family's SGLang loader maps them: BF16, or FP8
    block scales under the name it maps. Anything else is refused by name: SGLang
    would skip it (and hold no scale) or fail."""
    if spec.fmt == "int4":
        raise MoetraceError(f"{where}: fused expert tensors ({fused}) with INT4 weights: compressed-tensors "
                            "pack-quantized checkpoints store experts per expert")
    if spec.family in FUSED_NOT_MAPPED:
        raise MoetraceError(f"{where}: {fused}: fused expert tensors in a {spec.arch} checkpoint; "
                            f"{FUSED_NOT_MAPPED[spec.family]}")
    scales = [f"{fused}{suffix}" for suffix in ("_scale_inv", "_scale", "_weight_scale")
              if f"{fused}{suffix}" in tensors]
    mapped = f"{fused}{FUSED_SCALE_SUFFIX[spec.family]}"
    if spec.fmt == "bf16":
        if scales:
            raise MoetraceError(f"{where}: no quantization_config but the checkpoint has FP8 scales ({scales[0]})")
    elif spec.fmt != "fp8_block" or spec.quant_method != "fp8":
        raise MoetraceError(f"{where}: fused expert tensors ({fused}) with {spec.fmt} ({spec.quant_method}) scales: "
                            f"SGLang maps fused FP8 experts with block scales (quant_method fp8, weight_block_size) "
                            f"only")
    elif mapped not in tensors:
        found = f"it has {scales[0]}, which" if scales else "it has no fused scale, and"
        raise MoetraceError(f"{where}: fused FP8 expert scales: SGLang's {spec.arch} loader maps {mapped}; {found} "
                            "SGLang does not load (the server would hold no scales)")
    want = "F8_E4M3" if spec.fmt.startswith("fp8") else "BF16"
    if tensors[fused] != want:
        raise MoetraceError(f"{where}: format {spec.fmt} needs {want} expert weights but {fused} is {tensors[fused]}")
    scale_dtype = _DTYPE_NAMES.get(tensors[mapped], tensors[mapped]) if spec.fmt != "bf16" else None
    return replace(spec, fused_experts=True, scale_dtype=scale_dtype)


# ---------------------------------------------------------------- the tensors' headers


def expert_tensor_pattern(spec: MoESpec) -> re.Pattern:
    """A per-expert weight or scale of the spec's format, or a fused 3-D expert tensor
    (groups: projection, kind; fused projection, fused scale suffix)."""
    kinds = weight_suffix(spec.fmt) + (f"|{spec.scale_suffix}" if spec.scale_suffix else "")
    if spec.fmt == "int4":
        kinds += "|weight_shape"
    return re.compile(
        rf"^{re.escape(spec.prefix)}\.layers\.\d+\.mlp\.(?:experts\.|shared_experts?\.)"
        rf"(?:(?:\d+\.)?(gate|up|down)_proj\.({kinds})|(gate_up|down)_proj(_scale_inv|_scale)?)$"
    )


def expected_header(s: MoESpec, name: str, pattern: re.Pattern | None = None
                    ) -> tuple[tuple[str, ...], list[tuple[int, ...]], str] | None:
    """(allowed dtypes, allowed shapes, why) of an expert tensor's header, from config.json;
    None for a tensor that is not an expert's. ``pattern``: expert_tensor_pattern(s), reused."""
    m = (pattern or expert_tensor_pattern(s)).match(name)
    if not m:
        return None
    H, I, E = s.hidden_size, s.intermediate_size, s.num_experts
    sizes = f"hidden_size {H}, moe_intermediate_size {I}"
    weight_dtype = ("F8_E4M3",) if s.fmt.startswith("fp8") else ("BF16",)
    proj, kind, fused, fused_scale = m.groups()
    if fused:
        out, inp = (2 * I, H) if fused == "gate_up" else (H, I)
        if not fused_scale:
            return weight_dtype, [(E, out, inp)], f"num_experts {E}, {sizes}"
        if s.fmt != "fp8_block":
            return None  # refused with the spec (spec._verify_fused)
        bn, bk = s.block
        # gate and up each in whole block_n blocks, stacked (SGLang splits with chunk(2, dim=-2))
        rows = 2 * -(-I // bn) if fused == "gate_up" else -(-H // bn)
        why = f"num_experts {E}, weight [{E}, {out}, {inp}] in blocks {list(s.block)}"
        return SCALE_DTYPES, [(E, rows, -(-inp // bk))], why
    out, inp = (H, I) if proj == "down" else (I, H)
    if s.fmt == "int4":
        return _int4_header(s, kind, out, inp, sizes)
    if kind == "weight":
        return weight_dtype, [(out, inp)], sizes
    if s.fmt == "fp8_block":
        bn, bk = s.block
        return SCALE_DTYPES, [(-(-out // bn), -(-inp // bk))], f"weight [{out}, {inp}] in blocks {list(s.block)}"
    if s.fmt == "fp8_tensor":
        why = f"one scale for weight [{out}, {inp}]"
        if s.quant_method == "fp8":  # the old moetrace fp8_channel checkpoints land here
            why += ("; fp8 without weight_block_size is per-tensor in SGLang, per-channel FP8 checkpoints are "
                    "compressed-tensors with strategy channel")
        return SCALE_DTYPES, [(), (1,)], why
    return SCALE_DTYPES, [(out, 1), (out,)], f"one scale per output channel of weight [{out}, {inp}]"


def _int4_header(s: MoESpec, kind: str, out: int, inp: int, sizes: str):
    if kind == "weight_packed":
        return ("I32",), [(out, inp // INT4_PACK)], f"{sizes}, {INT4_PACK} int4 values per int32 along the input"
    if kind == "weight_shape":
        return ("I64", "I32"), [(2,)], f"[out, in] = [{out}, {inp}]"
    return SCALE_DTYPES, [(out, inp // s.group_size)], f"weight [{out}, {inp}] in groups of {s.group_size} columns"


def check_expert_coverage(spec: MoESpec, tensors: Mapping, root: Path) -> None:
    """Every MoE layer has every expert tensor, and no layer the config calls
    dense (or no expert id past num_experts) has any: either means the config and
    the weights disagree, and every expected shard downstream would be wrong."""
    missing = []
    for layer in spec.moe_layers:
        if spec.fused_experts:
            kinds = ("weight",) if spec.scale_suffix is None else ("weight", "scale")
            names = [fused_tensor_name(spec, layer, w, k) for w in ("gate_up", "down") for k in kinds]
        else:
            kinds = ("weight",) if spec.scale_suffix is None else ("weight", "scale")
            names = [
                expert_tensor_name(spec, layer, e, p, k)
                for e in range(spec.num_experts)
                for p in ("gate", "up", "down")
                for k in kinds
            ]
        missing += [n for n in names if n not in tensors]
    if missing:
        raise MoetraceError(
            f"{root}: {len(missing)} expert tensor(s) expected from config.json are not in the checkpoint, "
            f"first: {missing[0]}"
        )
    pat = re.compile(rf"^{re.escape(spec.prefix)}\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.|gate_up_proj|down_proj)")
    moe = set(spec.moe_layers)
    for name in tensors:
        m = pat.match(name)
        if not m:
            continue
        layer, expert = int(m.group(1)), m.group(2)
        # Layers at index >= num_layers are extra heads (DeepSeek's MTP layer 61).
        if layer < spec.num_layers and layer not in moe:
            raise MoetraceError(
                f"{name}: config.json makes layer {layer} dense (MoE layers: {format_ids(spec.moe_layers)}) "
                "but the checkpoint has experts there"
            )
        if layer in moe and expert is not None and int(expert) >= spec.num_experts:
            raise MoetraceError(f"{name}: expert id past config.json's {spec.num_experts} routed experts")
