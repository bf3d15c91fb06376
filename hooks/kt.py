"""Capture of KT-staged expert layers: a wrapper around ``SharedFullContext.load``.

In KTransformers' SGLang fork, a long prefill stages ALL experts of a layer into
one shared full-GPU layer (``ctx.gpu_layer``) with ``SharedFullContext.load(
layer_idx, wrapper, original_layer, ...)``; the layer's forward is never called,
so forward hooks do not see it. When ``load`` returns, the staged tensors are
final on every rank and ``process_weights_after_loading`` has not run yet: that
is when the wrapper fingerprints them (``source="staged"``).

Transport order follows the fork's ``load`` (sglang-kt 0.7.2): FP8 block and
FP8 channel pass ``original_layer=None``, so EVERY expert is staged through the
host slots, in id order (position = expert id, whatever the GPU mask says).
BF16 keeps the resident-first copy: experts of the GPU mask are copied
device-to-device (-1) and the others are staged in CPU-expert order. A format
conform does not know keeps that mask-based reading, and if the order cannot be
derived at all, the expert index.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import threading

from moetrace.hooks.fused_moe import expert_tensors
from moetrace.hooks.layout_facts import MARLIN_REPACK_ATTR, kt_format, layout_facts
from moetrace.hooks.ranks import module_ranks
from moetrace.hooks.registration import model_of
from moetrace.schema import COPY_ORDERS
from moetrace.tracer.capture import Tracer
from moetrace.tracer.guard import GuardMismatch

log = logging.getLogger("moetrace.kt")

# Where KTransformers' SGLang fork defines SharedFullContext (across its history);
# kt=true imports these. kt="auto" finds the class in whatever module the server loaded.
KT_MODULES = (
    "sglang.srt.layers.moe.kt_full_context",
    "sglang.srt.layers.moe.kt_ep_wrapper",
)
GPU_COPIED = -1
# Staged formats whose tensors are not FP8/BF16 shards (hooks.layout_facts.kt_format): skipped with a note.
# INT4 is captured where moetrace conform replaced the Marlin repack (the layer says so, MARLIN_REPACK_ATTR).
UNCAPTURED_KT_FORMATS = ("int4", "mxfp4", "mxfp8")

_ATTACHED: dict[type, "KTLoadCapture"] = {}
_ATTACH_LOCK = threading.Lock()


def _ids(value) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


# How SharedFullContext.load moves each format's experts: "all-staged" (through the
# host slots, in id order) or "resident-first" (GPU-mask experts device-to-device).
# (INT4: _prepare_weight_int4's full CPU pipeline; MXFP8 -> _prepare_weight_fp8 with
# original_layer=None; MXFP4 passes original_layer. Those three are not captured.)
STAGING = {"fp8_block": "all-staged", "fp8_channel": "all-staged", "bf16": "resident-first",
           "int4": "all-staged", "mxfp8": "all-staged", "mxfp4": "resident-first"}


def staged_format(ctx, tensors: dict) -> str | None:
    """The expert format of a staged context: "fp8_block" | "fp8_channel" | "bf16" |
    "int4" | "mxfp4" | "mxfp8", None when unknown. The fork's own dispatch flags win
    where present (hooks.layout_facts.kt_format: MXFP4 and MXFP8 stage FP8-block tensor names
    with other bytes, INT4 is load()'s fall-through); otherwise the tensor names."""
    fmt = kt_format(ctx)
    if fmt is not None:
        return fmt
    if "w13_weight_scale_inv" in tensors:
        return "fp8_block"
    if "w13_weight_scale" in tensors:
        return "fp8_channel"
    if "w13_weight" in tensors:
        return "bf16"
    return None


def transport_positions(num_experts: int, args: dict, fmt: str | None = None) -> tuple[list[int], str]:
    """Per-expert transport order from the format and the bound ``load`` arguments,
    and how it was found."""
    order = list(range(num_experts))
    if STAGING.get(fmt) == "all-staged":
        return order, "all-staged"
    original = args.get("original_layer")
    if "cpu_expert_ids_t" in args or "gpu_expert_ids_t" in args:
        gpu_ids, cpu_ids = args.get("gpu_expert_ids_t"), args.get("cpu_expert_ids_t")
        if gpu_ids is None or original is None:
            return order, "all-cpu"
        cpu = _ids(cpu_ids) if cpu_ids is not None else []
    elif "gpu_experts_mask" in args:
        mask, l2g = args.get("gpu_experts_mask"), args.get("logical_to_gpu_index")
        if mask is None or original is None or l2g is None:
            return order, "all-cpu"
        on_gpu = [bool(v) for v in (mask.tolist() if hasattr(mask, "tolist") else mask)]
        cpu = [e for e in range(num_experts) if not on_gpu[e]]
    else:
        return order, "expert-index"
    order = [GPU_COPIED] * num_experts
    for pos, e in enumerate(cpu):
        if 0 <= e < num_experts:
            order[e] = pos
    return order, "cpu-expert-order"


class KTLoadCapture:
    """Attach to a ``SharedFullContext`` class; ``detach()`` restores its ``load``."""

    source = "staged"

    def __init__(self, tracer: Tracer, cls: type):
        self.tracer = tracer
        self.cls = cls
        self._original = None
        self._signature: inspect.Signature | None = None

    def attach(self) -> "KTLoadCapture":
        with _ATTACH_LOCK:
            current = self.cls.__dict__.get("load")
            if current is None:
                raise AttributeError(f"{self.cls.__qualname__} has no load method")
            if getattr(current, "__moetrace_original__", None) is not None:
                # Already wrapped (another tracer, or a second factory call): take it over.
                prev = _ATTACHED.get(self.cls)
                self._original = current.__moetrace_original__
                self._signature = prev._signature if prev else inspect.signature(self._original)
                _ATTACHED[self.cls] = self
                return self
            self._original = current
            self._signature = inspect.signature(current)
            cls = self.cls
            original = current

            @functools.wraps(original)
            def load(ctx, *args, **kwargs):
                result = original(ctx, *args, **kwargs)
                capture = _ATTACHED.get(cls)
                if capture is not None:
                    capture.after_load(ctx, args, kwargs)
                return result

            load.__moetrace_original__ = original
            setattr(cls, "load", load)
            _ATTACHED[cls] = self
        return self

    def detach(self) -> None:
        with _ATTACH_LOCK:
            if _ATTACHED.get(self.cls) is self:
                del _ATTACHED[self.cls]
                setattr(self.cls, "load", self._original)

    def after_load(self, ctx, args: tuple, kwargs: dict) -> None:
        """Fingerprint every expert of ``ctx.gpu_layer``; never raises, except the guard's
        GuardMismatch in fail-closed mode (then the caller never uses the layer)."""
        tr = self.tracer
        if not tr.enabled:
            return
        try:
            bound = self._signature.bind(ctx, *args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            layer = a.get("layer_idx", args[0] if args else None)
            if layer is None:
                raise TypeError("SharedFullContext.load called without layer_idx")
            layer = int(layer)
            model = model_of(a.get("original_layer"))  # a draft's KT layer stages under its own layer ids
            step = tr.step_for(self.source, layer, model)
            if not tr.wants(model, self.source, step, layer):
                return
            gpu_layer = ctx.gpu_layer
            tensors = expert_tensors(gpu_layer)
            fmt = staged_format(ctx, tensors)
            if fmt == "int4" and getattr(gpu_layer, MARLIN_REPACK_ATTR, None) == "identity":
                tensors = expert_tensors(gpu_layer, COPY_ORDERS["int4"])  # conform: judged before the repack
            elif fmt in UNCAPTURED_KT_FORMATS:  # their payloads sit under FP8 names but are not FP8 shards
                tr.note_once(f"KT {fmt} staged contexts are not captured (moetrace captures FP8 block/channel and "
                             "BF16 staged layers; docs/compat.md)")
                return
            if not tensors:
                params = gpu_layer.named_parameters() if hasattr(gpu_layer, "named_parameters") else ()
                names = sorted(n for n, _ in params)
                tr.note_once(f"staged layer holds no FP8/BF16 FusedMoE tensors ({', '.join(names) or 'none'}): "
                             "staged capture skipped for this format")
                return
            n = next(iter(tensors.values())).shape[0]
            positions, how = transport_positions(n, a, fmt)
            if how == "expert-index":
                tr.note_once("KT load signature without expert-order arguments: transport_position is the expert index")
            ranks = module_ranks(gpu_layer, tr.tp_rank, tr.tp_size)
            experts = list(range(n))  # the full staged layer: slot e holds expert e
            tr.sink.count_slot_map(model, "kt-staged")
            tr.record_layout(self.source, layer, layout_facts(gpu_layer, ctx), model)
            tr.capture(tensors, layer=layer, source=self.source, step=step, experts=experts, model=model,
                       slots=experts, positions=positions, ranks=ranks, slot_count=n)
        except GuardMismatch:  # fail-closed: the layer must not be used
            raise
        except Exception as err:
            try:
                tr.record_error("kt_load_wrapper", err)
            except Exception:
                pass


def _count(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def staging_facts(modules, runner=None) -> dict | None:
    """The KT wrapper's staging as the server holds it: the fork's KTEPWrapperMethod (the
    hooked layers' quant_method) stages the full layer for a prefill pass of at least
    ``gpu_prefill_token_threshold`` tokens (0: never); a pass holds at most
    ``chunked_prefill_size`` tokens (its kt_config, else the runner's server_args). None: no
    KT wrapper on the layers."""
    for module in modules:
        method = getattr(module, "quant_method", None)
        threshold = _count(getattr(method, "gpu_prefill_token_threshold", None))
        if threshold is None:
            continue
        chunk = _count(getattr(getattr(method, "kt_config", None), "chunked_prefill_size", None))
        if chunk is None:
            chunk = _count(getattr(getattr(runner, "server_args", None), "chunked_prefill_size", None))
        return {"threshold": threshold, "chunked_prefill_size": chunk if chunk is not None and chunk > 0 else None,
                "found_by": f"{type(method).__name__}.gpu_prefill_token_threshold"}
    return None


def find_shared_full_context(mode: object = "auto") -> list[type]:
    """SharedFullContext classes to wrap. "auto": every one defined by a module the
    server already loaded (the fork's wrapper module, or a stand-in such as moetrace's
    emulator); True: also import the fork's modules; False: none."""
    if mode is False:
        return []
    if mode is True:
        for name in KT_MODULES:
            try:
                importlib.import_module(name)
            except Exception:
                continue
    found: list[type] = []
    for mod in list(sys.modules.values()):
        cls = getattr(mod, "__dict__", {}).get("SharedFullContext")  # no getattr: lazy modules stay unloaded
        if isinstance(cls, type) and "load" in cls.__dict__ and cls not in found:
            found.append(cls)
    return found


def install_kt_capture(tracer: Tracer, mode: object = "auto") -> list[KTLoadCapture]:
    """Wrap every SharedFullContext.load found; returns the attached captures."""
    attached = []
    for cls in find_shared_full_context(mode):
        attached.append(KTLoadCapture(tracer, cls).attach())
        log.info("moetrace: capturing KT staged loads via %s.%s.load", cls.__module__, cls.__qualname__)
    if mode is True and not attached:
        tracer.note_once("kt=true but no SharedFullContext with a load method was found: staged loads are not captured")
    return attached
