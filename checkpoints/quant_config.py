"""What a checkpoint's ``quantization_config`` says about its expert weights: the
format, the block size, and the quant method SGLang will pick for them.

- ``fp8`` with ``weight_block_size`` [n, k]: block scales ``weight_scale_inv``
  (SGLang Fp8MoEMethod, w13/w2_weight_scale_inv).
- ``fp8`` without it: per-tensor scales ``weight_scale`` (Fp8MoEMethod: w13_weight_scale
  [E, 2], w2_weight_scale [E]; w13 requantized after loading).
- ``compressed-tensors`` with FP8 weights (type float, 8 bits, symmetric, static):
  strategy ``channel`` (weight_scale [out, 1]), ``block`` (weight_scale in blocks of
  ``block_structure``) or ``tensor`` (one weight_scale); SGLang's
  CompressedTensorsW8A8Fp8MoE holds them as w13/w2_weight_scale.
- ``compressed-tensors`` W4A16 ``pack-quantized`` (type int, 4 bits, symmetric, static,
  strategy ``group``, no activation order): ``weight_packed`` int32 [out, in/8] (8 int4
  values per word along the input), ``weight_scale`` [out, in/group_size],
  ``weight_shape`` [2]; SGLang's CompressedTensorsWNA16MoE holds them transposed as
  w13/w2_weight_packed and w13/w2_weight_scale (format ``int4``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from moetrace.errors import MoetraceError

QUANT_METHODS = ("fp8", "compressed-tensors")
_CT_STRATEGY = {"channel": "fp8_channel", "block": "fp8_block", "tensor": "fp8_tensor"}


@dataclass(frozen=True)
class QuantFormat:
    fmt: str  # checkpoints.spec.FORMATS
    block: tuple[int, int] | None = None  # [block_n over out rows, block_k over in cols]
    quant_method: str | None = None  # one of QUANT_METHODS; None for unquantized bf16
    group_size: int | None = None  # int4: input columns per scale


def _block(value, where: str, key: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        raise MoetraceError(f"{where}: quantization_config.{key} must be [n, k] positive ints, found {value!r}")
    return value[0], value[1]


def _int4_scheme(q: Mapping, w: Mapping, where: str, name: str) -> tuple[str, int]:
    """A compressed-tensors W4A16 group scheme as SGLang's CompressedTensorsWNA16MoE and the
    KT fork's _prepare_weight_int4 load it, or a refusal naming what differs."""
    at = f"{where}: compressed-tensors config_groups.{name}.weights"
    if q.get("format") != "pack-quantized":
        raise MoetraceError(f"{where}: compressed-tensors INT4 weights in format {q.get('format')!r}; SGLang's "
                            "WNA16 MoE method loads pack-quantized only")
    if not w.get("symmetric", True):
        raise MoetraceError(f"{at}: asymmetric INT4 (zero points); moetrace reads symmetric INT4 only")
    if w.get("dynamic"):
        raise MoetraceError(f"{at}: dynamic INT4 weight scales; moetrace reads static ones")
    if w.get("strategy") != "group":
        raise MoetraceError(f"{at}: INT4 strategy {w.get('strategy')!r}; moetrace reads strategy group")
    if w.get("actorder") not in (None, "static"):
        raise MoetraceError(f"{at}: actorder {w.get('actorder')!r} (g_idx, w2 scales not split by TP); moetrace "
                            "reads INT4 without activation order")
    gs = w.get("group_size")
    if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1:
        raise MoetraceError(f"{at}.group_size must be a positive integer, found {gs!r}")
    return "int4", gs


def _compressed_tensors(q: Mapping, where: str) -> QuantFormat:
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise MoetraceError(f"{where}: compressed-tensors quantization_config has no config_groups")
    found = set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(w, Mapping):
            raise MoetraceError(f"{where}: compressed-tensors config_groups.{name} has no 'weights' scheme")
        if w.get("type") == "int" and w.get("num_bits") == 4:
            found.add((*_int4_scheme(q, w, where, name), None))
            continue
        fp8 = w.get("type") == "float" and w.get("num_bits") == 8 and w.get("symmetric", True) and not w.get("dynamic")
        strategy = w.get("strategy")
        if not fp8 or strategy not in _CT_STRATEGY:
            raise MoetraceError(
                f"{where}: compressed-tensors config_groups.{name} quantizes weights as {w.get('type')!r} "
                f"{w.get('num_bits')}-bit, strategy {strategy!r}; moetrace supports static FP8 (type float, 8 bits) "
                f"with strategy {', '.join(_CT_STRATEGY)}, and INT4 (type int, 4 bits) pack-quantized with "
                f"strategy group"
            )
        block = _block(w.get("block_structure"), where, f"config_groups.{name}.weights.block_structure") \
            if strategy == "block" else None
        found.add((_CT_STRATEGY[strategy], None, block))
    if len(found) != 1:
        raise MoetraceError(f"{where}: compressed-tensors config_groups mix weight schemes {sorted(found, key=str)}; "
                            "moetrace reads checkpoints whose experts share one")
    (fmt, group_size, block), = found
    return QuantFormat(fmt, block, "compressed-tensors", group_size)


def quant_format(cfg: Mapping, text: Mapping, where: str) -> QuantFormat:
    # Qwen3.5 keeps quantization_config at the top level; look there first, then
    # under text_config.
    q = cfg.get("quantization_config") or text.get("quantization_config")
    if not q:
        return QuantFormat("bf16")
    if not isinstance(q, Mapping):
        raise MoetraceError(f"{where}: 'quantization_config' must be an object, found {q!r}")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    if method != "fp8":
        raise MoetraceError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (supported: fp8 with or without "
            "weight_block_size, compressed-tensors FP8 channel/block/tensor, unquantized bf16)"
        )
    block = q.get("weight_block_size")
    if block is None:
        return QuantFormat("fp8_tensor", None, "fp8")
    return QuantFormat("fp8_block", _block(block, where, "weight_block_size"), "fp8")


def scale_suffix(fmt: str, quant_method: str | None) -> str | None:
    """Checkpoint-name suffix of an expert's FP8 scale: block scales of the fp8 method
    are inverse scales (``weight_scale_inv``, the DeepSeek/Qwen convention); every
    other FP8 scale is ``weight_scale``."""
    if fmt == "bf16":
        return None
    return "weight_scale_inv" if fmt == "fp8_block" and quant_method == "fp8" else "weight_scale"


def weight_suffix(fmt: str) -> str:
    """Checkpoint-name suffix of an expert's weight: INT4's packed words are ``weight_packed``."""
    return "weight_packed" if fmt == "int4" else "weight"


def held_weight_names(fmt: str) -> tuple[str, str]:
    """The FusedMoE parameters the weights load into (w13, w2)."""
    return (f"w13_{weight_suffix(fmt)}", f"w2_{weight_suffix(fmt)}")


def held_scale_names(fmt: str, quant_method: str | None) -> tuple[str, str] | None:
    """The FusedMoE parameters the scales load into (w13, w2)."""
    suffix = scale_suffix(fmt, quant_method)
    return None if suffix is None else (f"w13_{suffix}", f"w2_{suffix}")
