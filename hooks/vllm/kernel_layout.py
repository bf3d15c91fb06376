"""What vLLM's MoE kernel did to a layer's expert bytes, and how moetrace judges them.

Read from the installed vLLM 0.32 (its files name the facts; checked against its own
code in tests/test_vllm_layout.py):

- At the load boundary (after ``load_weights``) the unquantized method's parameters hold
  the checkpoint's shards as FusedMoE's loader cuts them (``routed_experts.py``
  ``_load_w13``/``_load_w2``): w13 rows [gate r*I_tp.., up r*I_tp..], w2 columns
  r*I_tp..; unless the method rounded the intermediate or hidden size up when it created
  them (FlashInfer TRT-LLM, AITER), which leaves the pad uninitialised: refused.
- After ``process_weights_after_loading`` (``UnquantizedFusedMoEMethod._setup_kernel``,
  ``oracle/unquantized.py`` convert_to_unquantized_kernel_format):
  * CPU (``experts/cpu_moe.py`` CPUUnquantizedExperts and its subclasses): the
    intermediate size is zero-padded to P, a multiple of 32 (gate rows [0, I), zeros,
    up rows [P, P+I), zeros; w2 columns [0, I), zeros), then every expert W[N, K] is
    repacked in place, same shape and dtype, by ``cpu_prepack_moe_weight(W, isa)``:
    isa "vec" (CPUUnquantizedExperts) holds ``W.reshape(N/16, 16, K).permute(0, 2, 1)``,
    isa "amx" (X86CPUUnquantizedExperts, CPUs with AMX tiles) holds
    ``W.reshape(N/16, 16, K/2, 2).permute(0, 2, 1, 3)``. moetrace undoes both and the
    padding (checking that the pad is all zero bytes) before fingerprinting, so the
    resident bytes are judged against the same index as the loaded ones. neon/vsx packs
    and zentorch's MoE are refused by name;
  * CUDA with the Triton runners: the bytes as loaded (made contiguous);
  * FlashInfer CUTLASS: the w13 halves swapped (up rows first: ``swap_w13_to_w31``),
    which the index reproduces;
  * anything else (FlashInfer TRT-LLM's block layout, AITER's shuffle, XPU's transpose,
    MoonEP, TPU and out-of-tree platforms) is refused by name, as is every quantized
    method (moetrace has qualified vLLM's unquantized MoE only).
A refused layer is still captured as it is, and its recorded facts make the analysis
refuse it by name (exit 2): never a false divergence, never a pass over unjudged bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrace.schema import dtype_name

LAYOUT_FACTS_VERSION = 1
CPU_PACKS = ("vec", "amx")  # the prepack isas moetrace undoes
UNQUANTIZED_METHOD = "UnquantizedFusedMoEMethod"
AS_LOADED_BACKENDS = ("TRITON", "BATCHED_TRITON")  # convert_to_unquantized_kernel_format: .contiguous()
UP_FIRST_BACKENDS = ("FlashInfer CUTLASS",)  # swap_w13_to_w31
QUANTIZED_WHY = "moetrace has qualified vLLM's unquantized MoE only"
NOT_REPRODUCED = "not reproduced by moetrace"


@dataclass(frozen=True)
class ExpertLayout:
    """How one layer's captured bytes relate to the checkpoint's shards."""

    facts: dict  # recorded in the rank manifest (analysis: checkpoints.layout_rules)
    isa: str | None = None  # the CPU pack moetrace undoes before fingerprinting
    intermediate: int = 0  # I_tp: the intermediate rows per half the checkpoint gives this rank
    padded: int | None = None  # P, when the kernel zero-padded I_tp up to it

    @property
    def refused(self) -> bool:
        return self.facts.get("refused") is not None


def _get(obj, *path):
    try:
        for name in path:
            obj = getattr(obj, name, None)
        return obj
    except Exception:
        return None


def _name(obj) -> str | None:
    return None if obj is None else (obj.__name__ if isinstance(obj, type) else type(obj).__name__)


def _backend(qm) -> str | None:
    b = _get(qm, "unquantized_backend")
    return None if b is None else str(getattr(b, "value", b))


def _experts(qm):
    """The experts kernel: the built kernel's instance, else the class the oracle chose."""
    built = _get(qm, "moe_kernel", "fused_experts")
    return built if built is not None else _get(qm, "experts_cls")


def _base_facts(routed, source: str) -> dict:
    qm = _get(routed, "quant_method")
    moe = _get(routed, "moe_config")
    experts = _experts(qm)
    return {
        "server": "vllm",
        "vllm_facts": LAYOUT_FACTS_VERSION,
        "source": source,
        "module_class": _name(routed),
        "module_path": _get(type(routed), "__module__"),
        "quant_method_class": _name(qm),
        "backend": _backend(qm),
        "experts_class": _name(experts),
        "isa": _get(experts, "isa") if isinstance(_get(experts, "isa"), str) else None,
        "zentorch": bool(_get(experts, "_use_zentorch")),
        "intermediate_size_per_partition": _get(moe, "intermediate_size_per_partition_unpadded"),
        "param_intermediate_size": _get(routed, "intermediate_size_per_partition"),
        "hidden_size": _get(moe, "hidden_dim_unpadded"),
        "param_hidden_size": _get(routed, "hidden_size"),
        "num_local_experts": _get(routed, "local_num_experts"),
        "up_first": False,
        "undone": [],
        "refused": None,
    }


def _refuse(facts: dict, transform: str, why: str) -> dict:
    facts["refused"] = {"transform": transform, "why": why}
    return facts


def loaded_layout(routed) -> ExpertLayout:
    """The layout of a layer right after load_weights."""
    f = _base_facts(routed, "loaded")
    i_tp = f["intermediate_size_per_partition"]
    padded = f["param_intermediate_size"] != i_tp or f["param_hidden_size"] != f["hidden_size"]
    if f["quant_method_class"] != UNQUANTIZED_METHOD:
        _refuse(f, f"vLLM's {f['quant_method_class']} expert weights", QUANTIZED_WHY)
    elif not isinstance(i_tp, int) or padded:
        _refuse(f, f"parameters created padded (intermediate {f['param_intermediate_size']} for {i_tp}, hidden "
                   f"{f['param_hidden_size']} for {f['hidden_size']}) by the {f['backend']} backend",
                "the loader leaves the pad uninitialised until process_weights_after_loading")
    return ExpertLayout(f, None, int(i_tp or 0), None)


def resident_layout(routed, tensors: dict[str, torch.Tensor]) -> ExpertLayout:
    """The layout of a layer as its kernel holds it (after process_weights_after_loading)."""
    f = _base_facts(routed, "resident")
    i_tp = f["intermediate_size_per_partition"]
    backend, isa = f["backend"], f["isa"]
    if f["quant_method_class"] != UNQUANTIZED_METHOD:
        return ExpertLayout(_refuse(f, f"vLLM's {f['quant_method_class']} expert weights", QUANTIZED_WHY))
    if not isinstance(i_tp, int) or f["param_hidden_size"] != f["hidden_size"]:
        return ExpertLayout(_refuse(f, f"the {backend} backend's hidden-size padding", NOT_REPRODUCED))
    if backend in AS_LOADED_BACKENDS:
        if f["param_intermediate_size"] != i_tp:
            return ExpertLayout(_refuse(f, f"the {backend} backend's intermediate padding", NOT_REPRODUCED))
        return ExpertLayout(f, None, i_tp)
    if backend in UP_FIRST_BACKENDS and f["param_intermediate_size"] == i_tp:
        f["up_first"] = True
        return ExpertLayout(f, None, i_tp)
    if backend != "CPU":
        return ExpertLayout(_refuse(f, f"vLLM's {backend} MoE weight layout",
                                    "a backend moetrace does not reproduce (docs/compat.md)"))
    if f["zentorch"]:
        return ExpertLayout(_refuse(f, "zentorch's MoE weights", "the zentorch kernel is not qualified by moetrace"))
    if isa not in CPU_PACKS:
        why = "only the vec and amx packs are undone by moetrace"
        return ExpertLayout(_refuse(f, f"vLLM CPU's {isa} prepack", why))
    w13, w2 = tensors.get("w13_weight"), tensors.get("w2_weight")
    padded = int(w2.shape[-1]) if w2 is not None and w2.dim() == 3 else None
    if (w13 is None or padded is None or padded < i_tp or w13.shape[1] != 2 * padded or w2.shape[1] != w13.shape[2]
            or any(t.shape[1] % 16 or (isa == "amx" and t.shape[2] % 2) for t in (w13, w2))):
        return ExpertLayout(_refuse(f, f"vLLM CPU's {isa} pack of unexpected shapes",
                                    f"w13 {None if w13 is None else list(w13.shape)}, w2 "
                                    f"{None if w2 is None else list(w2.shape)} for I_tp {i_tp}"))
    f["held_intermediate_size"] = padded
    f["undone"] = [f"cpu_{isa}_pack"] + ([f"zero_pad_{padded}"] if padded != i_tp else [])
    return ExpertLayout(f, isa, i_tp, padded if padded != i_tp else None)


def unpack_cpu(t: torch.Tensor, isa: str) -> torch.Tensor:
    """The inverse of vLLM CPU's ``cpu_prepack_moe_weight(t, isa)`` on stacked [E, N, K] experts."""
    e, n, k = t.shape
    if isa == "vec":  # held per expert as [N/16, K, 16]
        v = t.reshape(e, n // 16, k, 16).transpose(2, 3)
    elif isa == "amx":  # held per expert as [N/16, K/2, 16, 2]
        v = t.reshape(e, n // 16, k // 2, 16, 2).permute(0, 1, 3, 2, 4)
    else:
        raise ValueError(f"isa {isa!r}: moetrace undoes the {' and '.join(CPU_PACKS)} packs only")
    return v.reshape(e, n, k)


_GATHERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _gathers(name: str, isa: str, n: int, k: int, i: int, p: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions in one held expert of its canonical elements, in canonical order;
    those of its zero pad): the pack undone and the pad cut by one index_select per tensor
    (what a per-forward capture can afford), computed once per shape from unpack_cpu."""
    key = (name, isa, n, k, i, p)
    hit = _GATHERS.get(key)
    if hit is None:
        where = unpack_cpu(torch.arange(n * k, dtype=torch.int64).reshape(1, n, k), isa)[0]  # canonical -> held
        if p is None:
            keep, pad = where.reshape(-1), where.new_empty(0)
        elif name == "w13_weight":
            keep = torch.cat([where[:i], where[p:p + i]]).reshape(-1)
            pad = torch.cat([where[i:p], where[p + i:]]).reshape(-1)
        else:
            keep, pad = where[:, :i].reshape(-1), where[:, i:].reshape(-1)
        hit = _GATHERS[key] = (keep, pad)
        if len(_GATHERS) > 256:
            _GATHERS.clear()
    return hit


def canonical(tensors: dict[str, torch.Tensor], layout: ExpertLayout) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the layer's tensors as the checkpoint's shards lay them out, up_first aside, which
    the index reproduces: packs undone, zero padding cut; one phrase per tensor whose pad
    holds nonzero bytes, naming its slots). A nonzero pad is not in the index's bytes: the
    caller reports it as an error of the run (never a pass)."""
    if layout.isa is None:
        return dict(tensors), []
    out, problems = {}, []
    i, p = layout.intermediate, layout.padded
    for name, t in tensors.items():
        if name not in ("w13_weight", "w2_weight"):
            continue
        e, n, k = t.shape
        keep, pad = _gathers(name, layout.isa, n, k, i, p)
        flat = t.detach().reshape(e, n * k)
        dev = flat.device
        out[name] = flat.index_select(1, keep.to(dev)).reshape(e, 2 * i if name == "w13_weight" else n,
                                                                i if name == "w2_weight" else k)
        if pad.numel():
            bad = torch.nonzero(flat.index_select(1, pad.to(dev)).view(torch.uint8).any(dim=1)).flatten().tolist()
            if bad:  # bytes, not values: -0.0 is not a zero pad
                problems.append(f"{name}: the kernel's zero padding (I_tp {i} padded to {p}) holds nonzero bytes in "
                                f"slot(s) {bad}")
    return out, problems


def params_facts(tensors: dict[str, torch.Tensor]) -> dict:
    """Per captured parameter: its stacked shape and dtype (what the analysis holds against the index)."""
    return {n: {"shape": [int(d) for d in t.shape], "dtype": dtype_name(t.dtype)} for n, t in tensors.items()}
