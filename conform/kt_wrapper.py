"""Rank 0's kt-kernel writer in a conform rank: ``KTMoEWrapper`` built as the fork builds it
(KTEPWrapperMethod.create_weights), its experts loaded from the checkpoint with kt-kernel's
own loader; ``kt_wrapper`` says what it is, or why it cannot run here.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

KT_METHODS = {"fp8_block": "FP8", "fp8_channel": "FP8_PERCHANNEL", "bf16": "BF16", "int4": "RAWINT4"}


class _NoPin(TorchFunctionMode):
    """kt-kernel allocates with pin_memory=True, which a CPU-only torch refuses:
    drop the flag while it builds its wrapper (pinning changes no bytes)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def kt_wrapper(checkpoint: str, fmt: str, layer: int, experts: int, hidden: int, intermediate: int,
               mask: torch.Tensor):
    """(rank 0's kt-kernel wrapper for one layer or None, what it is or why not), built
    as the fork builds it (KTEPWrapperMethod.create_weights), weights from the checkpoint."""
    method = KT_METHODS[fmt]
    try:
        import kt_kernel
        from kt_kernel import KTMoEWrapper
    except Exception as err:
        return None, f"kt-kernel does not import here ({type(err).__name__}: {err})"
    try:
        with _NoPin():
            w = KTMoEWrapper(layer_idx=layer, num_experts=experts, num_experts_per_tok=2, hidden_size=hidden,
                             moe_intermediate_size=intermediate, gpu_experts_mask=mask, cpuinfer_threads=1,
                             threadpool_count=1, weight_path=checkpoint, chunked_prefill_size=16, method=method)
            keep = _KeepLoaded(w) if fmt == "int4" else None
            w.load_weights(torch.arange(experts, dtype=torch.int64))
            if keep is not None:
                w._moetrace_kept = keep.kept
    except Exception as err:
        return None, f"kt-kernel's {method} wrapper failed here ({type(err).__name__}: {' '.join(str(err).split())})"
    words = f"kt-kernel {getattr(kt_kernel, '__version__', '?')} {method} wrapper ({kt_kernel.__cpu_variant__} build)"
    if fmt == "int4":
        words += (f"; {type(getattr(w, 'moe', None)).__name__}, the tensors its loader read kept alive "
                  f"(AVX2RawInt4_MOE writes from them after load_weights drops them)")
    return w, words


class _KeepLoaded:
    """kt-kernel's RAWINT4 loader with what it returns kept referenced: load_weights drops
    the loaded tensors, and the AVX2 backend (AVX2RawInt4_MOE) keeps pointers into them
    and writes from them later (SIGSEGV on an AVX2 EPYC without this)."""

    def __init__(self, wrapper):
        self.kept: list = []
        loader = getattr(wrapper, "loader", None)
        if loader is not None and hasattr(loader, "load_experts"):
            original = loader.load_experts

            def load_experts(*args, **kwargs):
                out = original(*args, **kwargs)
                self.kept.append(out)
                return out

            loader.load_experts = load_experts
